"""The developer recipes and hooks a newcomer runs first: ``just --list`` shows every recipe's
description whole, and ``just hooks`` passes without the optional peers (shellcheck)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
_RECIPE = re.compile(r"^@?([a-z][\w-]*)\b(?!\s*:=).*:")


def _recipes() -> dict[str, list[str]]:
    """Each recipe of the justfile with the lines just above it (comments, attributes)."""
    lines = (REPO / "justfile").read_text().splitlines()
    found: dict[str, list[str]] = {}
    for number, line in enumerate(lines):
        match = _RECIPE.match(line)
        if match is None or line.startswith(("set ", "export ")) or ":=" in line:
            continue
        above: list[str] = []
        for previous in reversed(lines[:number]):
            if not previous.startswith(("#", "[")):
                break
            above.insert(0, previous)
        found[match[1]] = above
    return found


def test_every_recipe_has_a_description_just_list_shows_whole() -> None:
    # `just --list` shows the one comment line right above a recipe, or its [doc("...")].
    recipes = _recipes()
    assert {"test", "image", "hooks", "peers", "lock", "sim"} <= recipes.keys()
    for name, above in recipes.items():
        docs = [line for line in above if line.startswith("[doc(")]
        if docs:
            assert docs[-1] == above[-1], f"{name}: [doc] must come right before the recipe"
            continue
        assert len(above) == 1, f"{name}: {len(above)} comment lines, `just --list` shows one"


def _hook(hook_id: str) -> dict[str, object]:
    config = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())
    for repo in config["repos"]:
        for hook in repo["hooks"]:
            if hook["id"] == hook_id:
                assert isinstance(hook, dict)
                return hook
    raise AssertionError(f"no pre-commit hook {hook_id}")


def test_the_shellcheck_hook_passes_without_shellcheck(tmp_path: Path) -> None:
    # A PATH with bash alone: the hook's entry, as pre-commit runs it (split, then the files).
    (tmp_path / "bash").symlink_to(subprocess.check_output(["which", "bash"], text=True).strip())
    entry = shlex.split(str(_hook("shellcheck")["entry"]))
    done = subprocess.run(
        [*entry, "scripts/test"],
        cwd=REPO,
        env={"PATH": str(tmp_path)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stdout) == (
        0,
        "shellcheck is not installed (just peers): skipped\n",
    )


def test_the_fast_test_hook_runs_on_the_files_it_tests() -> None:
    files = re.compile(str(_hook("fast-tests")["files"]))
    for path in ("src/dracpu/cli.py", "src/dracpu/config/settings.py", "deploy/kustomize/base"):
        assert files.search(path), path
    for test in str(_hook("fast-tests")["entry"]).split():
        if test.startswith("tests/"):
            assert (REPO / test).is_file(), test
