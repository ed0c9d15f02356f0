from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterator

import pytest

from dracpu.logs import RECENT_LINES, recent_lines, setup_logging

TIME = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.fixture(autouse=True)
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    ours = logging.getLogger("dracpu")
    handlers, level, our_level = list(root.handlers), root.level, ours.level
    yield
    setup_logging("text", 0, stream=io.StringIO())  # takes back any -vmodule levels
    root.handlers[:] = handlers
    root.setLevel(level)
    ours.setLevel(our_level)


def test_json_is_one_object_per_line_with_context() -> None:
    out = io.StringIO()
    setup_logging("json", 0, stream=out)
    log = logging.getLogger("dracpu.tasks.example")
    log.info("prepared claim %s", "c1", extra={"claim": "c1", "pod": "ns/p", "container": "app"})
    log.warning("second line")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert TIME.fullmatch(first.pop("time"))
    assert first == {
        "level": "info",
        "logger": "dracpu.tasks.example",
        "message": "prepared claim c1",
        "claim": "c1",
        "pod": "ns/p",
        "container": "app",
    }
    assert json.loads(lines[1])["level"] == "warning"


def test_json_carries_the_traceback_and_odd_values() -> None:
    out = io.StringIO()
    setup_logging("json", 0, stream=out)
    try:
        raise ValueError("kaput")
    except ValueError:
        logging.getLogger("dracpu.x").exception("it broke", extra={"cpus": {1, 2}})
    (line,) = out.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["message"] == "it broke"
    assert entry["level"] == "error"
    assert entry["cpus"] == "{1, 2}"  # not JSON-native: written as text, never a crash
    assert "Traceback" in entry["exception"]
    assert "ValueError: kaput" in entry["exception"]


def test_text_is_readable_with_context() -> None:
    out = io.StringIO()
    setup_logging("text", 0, stream=out)
    logging.getLogger("dracpu.daemon").info(
        "pinned %s", "ctr", extra={"claim": "c1", "pod": "ns/my pod"}
    )
    line = out.getvalue()
    match = re.fullmatch(r"(\S+) INFO  dracpu\.daemon: pinned ctr (.*)\n", line)
    assert match is not None, line
    assert TIME.fullmatch(match[1])
    assert match[2] == 'claim=c1 pod="ns/my pod"'


def test_verbosity_levels() -> None:
    out = io.StringIO()
    ours = logging.getLogger("dracpu.core.x")
    library = logging.getLogger("grpclib.x")

    setup_logging("text", 0, stream=out)
    ours.debug("ours-0")
    library.debug("lib-0")
    library.info("lib-info-0")
    setup_logging("text", 4, stream=out)
    ours.debug("ours-4")
    library.debug("lib-4")
    setup_logging("text", 6, stream=out)
    library.debug("lib-6")

    messages = [line.split(": ", 1)[1] for line in out.getvalue().splitlines()]
    assert messages == ["lib-info-0", "ours-4", "lib-6"]


def test_setup_again_replaces_its_handler() -> None:
    first, second = io.StringIO(), io.StringIO()
    setup_logging("text", 0, stream=first)
    setup_logging("json", 0, stream=second)
    logging.getLogger("dracpu.x").info("once")
    assert first.getvalue() == ""
    assert json.loads(second.getvalue())["message"] == "once"


def test_watchfiles_chatter_is_quiet_until_library_debug() -> None:
    out = io.StringIO()
    chatty = logging.getLogger("watchfiles.main")
    before = logging.getLogger("watchfiles").level
    try:
        setup_logging("text", 4, stream=out)
        chatty.info("3 changes detected")
        chatty.warning("watch failed")
        setup_logging("text", 6, stream=out)
        chatty.info("1 change detected")
    finally:
        logging.getLogger("watchfiles").setLevel(before)

    messages = [line.split(": ", 1)[1] for line in out.getvalue().splitlines()]
    assert messages == ["watch failed", "1 change detected"]


# --- -vmodule and the recent records --------------------------------------------------------


def test_vmodule_sets_single_modules_and_reports_what_matches_nothing() -> None:
    out = io.StringIO()
    unmatched = setup_logging(
        "text",
        0,
        stream=out,
        vmodule=[("nri_plugin", 4), ("tasks/state_*", 2), ("nri_hooks", 6), ("driver", 3)],
    )
    assert unmatched == ["nri_hooks", "driver"]  # upstream's Go file names
    logging.getLogger("dracpu.tasks.nri_plugin").debug("shown")
    logging.getLogger("dracpu.tasks.state_owner").debug("shown too")
    logging.getLogger("dracpu.tasks.slice_publisher").debug("hidden at -v=0")
    lines = out.getvalue().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["shown", "shown too"]
    # A later setup without -vmodule takes the per-module levels back.
    out2 = io.StringIO()
    assert setup_logging("text", 0, stream=out2) == []
    logging.getLogger("dracpu.tasks.nri_plugin").debug("hidden now")
    assert out2.getvalue() == ""


def test_vmodule_can_lower_one_module_below_the_global_level() -> None:
    out = io.StringIO()
    setup_logging("text", 4, stream=out, vmodule=[("cdi_watcher", 0)])
    logging.getLogger("dracpu.tasks.cdi_watcher").debug("hidden")
    logging.getLogger("dracpu.tasks.cdi_files").debug("shown")
    assert [line.split(": ", 1)[1] for line in out.getvalue().splitlines()] == ["shown"]


def test_recent_lines_keep_the_last_records_as_text() -> None:
    setup_logging("json", 0, stream=io.StringIO())
    log = logging.getLogger("dracpu.tasks.example")
    for index in range(RECENT_LINES + 5):
        log.info("line %d", index, extra={"claim": "c"})
    lines = recent_lines()
    assert len(lines) == RECENT_LINES
    assert TIME.match(lines[-1])
    assert lines[-1].endswith(f" INFO  dracpu.tasks.example: line {RECENT_LINES + 4}")
    assert lines[0].endswith(": line 5")
