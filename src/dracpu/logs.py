"""Logging setup of the daemon: readable text for people, one JSON object per line for machines.

Code logs with ``logging.getLogger(__name__)``, ``%s`` arguments, and context through ``extra=``
(``claim``, ``pod``, ``container``, ...). Both formats show that context: text appends
``key=value`` pairs, JSON adds the keys to the object.

Verbosity follows klog's ``-v=N`` (upstream's flag): 0 logs INFO and above; 1 and more add our
DEBUG messages (upstream's manifests run with ``--v=4``, klog's debug level); from 6 on the
libraries' DEBUG messages (kubernetes, asyncio, watchfiles, ...) are shown too. klog's
``-vmodule=pattern=N,...`` sets the level of single modules: a pattern (a glob; ``/`` may stand
for ``.``) matches a module of ours by its last name (``nri_plugin``) or its path below
``dracpu`` (``tasks.nri_plugin``); upstream's Go file names match nothing here and are reported.

The last :data:`RECENT_LINES` records are also kept in memory (:func:`recent_lines`), for the
debug dump ``dracpu gatherinfo`` reads: the container's log stream is not readable from inside.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import pkgutil
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from typing import Literal, TextIO

import dracpu

__all__ = ["RECENT_LINES", "JsonFormatter", "TextFormatter", "recent_lines", "setup_logging"]

# Verbosity thresholds (klog -v=N): our debug from 1, libraries' debug from 6 (klog's level for
# request/response dumps).
DEBUG_VERBOSITY = 1
LIBRARY_DEBUG_VERBOSITY = 6

# Our loggers live under this name (logging.getLogger(__name__) in every module).
_OUR_LOGGER = "dracpu"

# Libraries that log routine chatter at INFO: watchfiles says "N changes detected" on every CDI
# write. They speak at WARNING and above until LIBRARY_DEBUG_VERBOSITY.
_CHATTY_LIBRARIES = ("watchfiles",)

# Attributes every LogRecord has; anything else on a record came in through ``extra=``.
_RECORD_ATTRIBUTES = frozenset(
    vars(logging.LogRecord("", logging.INFO, "", 0, "", None, None)).keys()
) | {"message", "asctime", "taskName"}

# A marker on the handler we install, so that a second setup_logging() replaces it.
_HANDLER_MARK = "_dracpu_handler"

# Records kept for the debug dump: a bug report wants the minutes before it, and a line is
# ~200 bytes, so this bounds the buffer to a few hundred KiB.
RECENT_LINES = 2000


def _context(record: logging.LogRecord) -> dict[str, object]:
    return {k: v for k, v in vars(record).items() if k not in _RECORD_ATTRIBUTES}


def _timestamp(record: logging.LogRecord) -> str:
    """RFC 3339 in UTC with milliseconds: ``2026-05-01T12:00:00.123Z``."""
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the ``extra=`` context and, when
    there is one, the exception with its traceback (``exception``)."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in _context(record).items():
            entry.setdefault(key, value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return json.dumps(entry, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``2026-05-01T12:00:00.123Z INFO  dracpu.daemon: message key=value ...``, then any
    traceback on the following lines."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname:<5} {record.name}: {record.getMessage()}"
        context = " ".join(f"{k}={_text_value(v)}" for k, v in _context(record).items())
        if context:
            line = f"{line} {context}"
        if record.exc_info:
            line = f"{line}\n{self.formatException(record.exc_info)}"
        if record.stack_info:
            line = f"{line}\n{self.formatStack(record.stack_info)}"
        return line


def _text_value(value: object) -> str:
    text = str(value)
    return json.dumps(text) if not text or any(c.isspace() or c in '"=' for c in text) else text


def setup_logging(
    log_format: Literal["text", "json"],
    verbosity: int,
    *,
    stream: TextIO | None = None,
    vmodule: Sequence[tuple[str, int]] = (),
) -> list[str]:
    """Send every log record to ``stream`` (stderr) in ``log_format`` at ``verbosity``, with
    the per-module levels of ``vmodule`` (klog's ``-vmodule``), and keep the recent ones.

    Calling it again replaces what it installed before (tests, ``dracpu sim``). Returns the
    ``vmodule`` patterns that match no module of ours (the caller warns about them).
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if getattr(handler, _HANDLER_MARK, False):
            root.removeHandler(handler)
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    setattr(handler, _HANDLER_MARK, True)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity >= LIBRARY_DEBUG_VERBOSITY else logging.INFO)
    logging.getLogger(_OUR_LOGGER).setLevel(
        logging.DEBUG if verbosity >= DEBUG_VERBOSITY else logging.INFO
    )
    for name in _CHATTY_LIBRARIES:
        logging.getLogger(name).setLevel(
            logging.DEBUG if verbosity >= LIBRARY_DEBUG_VERBOSITY else logging.WARNING
        )
    root.addHandler(_RECENT)  # after the stream handler, which renders record.message
    return _apply_vmodule(vmodule)


class _RecentRecords(logging.Handler):
    """Keeps the last :data:`RECENT_LINES` records as (time, level, logger, message): the
    message the stream handler already rendered, so keeping costs no second formatting."""

    def __init__(self) -> None:
        super().__init__()
        self.records: deque[tuple[float, str, str, str]] = deque(maxlen=RECENT_LINES)

    def emit(self, record: logging.LogRecord) -> None:
        message = getattr(record, "message", None)
        if not isinstance(message, str):
            message = record.getMessage()
        self.records.append((record.created, record.levelname, record.name, message))


_RECENT = _RecentRecords()
setattr(_RECENT, _HANDLER_MARK, True)
# Loggers whose level the last setup_logging() set from -vmodule (reset by the next one).
_VMODULE_LOGGERS: set[str] = set()


def recent_lines() -> list[str]:
    """The records kept in memory, oldest first, one text line each."""
    lines = []
    for created, level, name, message in list(_RECENT.records):
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created))
        lines.append(f"{stamp}.{int(created % 1 * 1000):03d}Z {level:<5} {name}: {message}")
    return lines


def _our_modules() -> Iterator[str]:
    """Every module of the dracpu package, dotted, found on disk (nothing is imported)."""
    pending = [(path, "dracpu.") for path in dracpu.__path__]
    while pending:
        path, prefix = pending.pop()
        for info in pkgutil.iter_modules([path], prefix):
            yield info.name
            if info.ispkg:
                pending.append((os.path.join(path, info.name.rsplit(".", 1)[-1]), info.name + "."))


def _apply_vmodule(vmodule: Sequence[tuple[str, int]]) -> list[str]:
    for name in _VMODULE_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET)
    _VMODULE_LOGGERS.clear()
    if not vmodule:
        return []
    modules = sorted(_our_modules())
    unmatched = []
    for pattern, level in vmodule:
        glob = pattern.replace("/", ".")
        matched = [
            name
            for name in modules
            if fnmatch.fnmatchcase(name.rsplit(".", 1)[-1], glob)
            or fnmatch.fnmatchcase(name.removeprefix(f"{_OUR_LOGGER}."), glob)
        ]
        if not matched:
            unmatched.append(pattern)
        for name in matched:
            logging.getLogger(name).setLevel(
                logging.DEBUG if level >= DEBUG_VERBOSITY else logging.INFO
            )
            _VMODULE_LOGGERS.add(name)
    return unmatched
