"""kubectl, driven through ``subprocess``, and the small parsers the kind e2e suite needs.

Nothing here imports dracpu: cpusets and quantities are parsed by this module's own few lines,
so a bug in dracpu's parsers cannot hide itself in the suite that checks dracpu on a cluster.

Every kubectl call has a timeout; a failing call raises :class:`KubectlError` with the command
line and kubectl's stderr. :func:`poll` is the one waiting primitive: it calls ``observe`` until
``done`` holds for what it returned, and fails with the last observation after ``timeout``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "DEFAULT_TIMEOUT",
    "POLL_INTERVAL",
    "Kubectl",
    "KubectlError",
    "format_cpulist",
    "parse_cpulist",
    "parse_quantity",
    "poll",
]

T = TypeVar("T")

# Seconds one kubectl call may take (a `get` on a kind cluster takes well under one; `delete
# --wait` of a namespace passes its own, longer timeout).
DEFAULT_TIMEOUT = 60.0
# Seconds between two looks of poll() (and of the waits built like it).
POLL_INTERVAL = 1.0
# A Linux cpu list as /proc/self/status and sysfs print it: "0-3,8,10-11" (or empty).
_CPULIST = re.compile(r"^(\d+(-\d+)?)(,\d+(-\d+)?)*$")
# The quantities the API returns for CPU capacity: canonical integers ("2") or milli ("1500m").
_QUANTITY = re.compile(r"^(\d+)(m?)$")


class KubectlError(RuntimeError):
    """A kubectl command failed (non-zero exit or timeout)."""


def parse_cpulist(text: str) -> frozenset[int]:
    """``"0-3,8"`` -> {0, 1, 2, 3, 8}; ``""`` -> empty. Anything else raises ``ValueError``."""
    text = text.strip()
    if not text:
        return frozenset()
    if not _CPULIST.match(text):
        raise ValueError(f"{text!r} is not a Linux cpu list")
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if last < first:
            raise ValueError(f"{text!r}: range {part!r} goes backwards")
        cpus.update(range(first, last + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 3, 8} -> ``"0-3,8"`` (the kernel's format), for messages."""
    ordered = sorted(set(cpus))
    parts: list[str] = []
    start = prev = -2
    for cpu in [*ordered, -1]:
        if cpu == prev + 1:
            prev = cpu
            continue
        if start >= 0:
            parts.append(str(start) if start == prev else f"{start}-{prev}")
        start = prev = cpu
    return ",".join(parts)


def parse_quantity(text: str) -> Fraction:
    """A CPU quantity as the API server prints it: ``"2"`` -> 2, ``"1500m"`` -> 3/2."""
    match = _QUANTITY.match(text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a plain or milli CPU quantity")
    value = Fraction(int(match.group(1)))
    return value / 1000 if match.group(2) else value


def poll(
    observe: Callable[[], T],
    done: Callable[[T], bool],
    *,
    timeout: float,
    what: str,
    interval: float | None = None,
) -> T:
    """Call ``observe`` until ``done(value)``; return that value. After ``timeout`` seconds raise
    ``AssertionError`` naming ``what`` and the last value observed. ``observe`` may raise to
    abort the wait at once (a pod that can never start, say)."""
    deadline = time.monotonic() + timeout
    while True:
        value = observe()
        if done(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f}s waiting for {what}; last: {value!r}"
            )
        time.sleep(POLL_INTERVAL if interval is None else interval)


class Kubectl:
    """Runs kubectl against one cluster (``KUBECONFIG`` from the environment unless given)."""

    def __init__(self, *, binary: str = "kubectl", kubeconfig: str | None = None) -> None:
        path = shutil.which(binary)
        if path is None:
            raise KubectlError(
                f"{binary} is not on PATH: the kind e2e suite drives the cluster with it"
            )
        self._binary = path
        self._env = dict(os.environ)
        if kubeconfig is not None:
            self._env["KUBECONFIG"] = kubeconfig

    def run(
        self,
        *args: str,
        stdin: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        check: bool = True,
    ) -> str:
        """kubectl ``args``; its stdout. Raises :class:`KubectlError` on failure when ``check``."""
        # No --request-timeout: it would also cut the watches of `delete --wait` and `logs`;
        # the subprocess timeout bounds every call instead.
        command = [self._binary, *args]
        try:
            done = subprocess.run(
                command,
                input=stdin,
                capture_output=True,
                text=True,
                timeout=timeout,
                env=self._env,
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise KubectlError(f"{_show(command)} did not finish within {timeout:.0f}s") from exc
        if check and done.returncode != 0:
            raise KubectlError(
                f"{_show(command)} exited {done.returncode}: {done.stderr.strip() or done.stdout}"
            )
        return done.stdout

    def get(self, *args: str) -> Any:
        """``kubectl get <args> -o json``, decoded."""
        return json.loads(self.run("get", *args, "-o", "json"))

    def items(self, *args: str) -> list[dict[str, Any]]:
        """The ``items`` of a list ``get``."""
        items: list[dict[str, Any]] = self.get(*args)["items"]
        return items

    def create(self, obj: Mapping[str, Any]) -> None:
        """``kubectl create -f -`` of one object (JSON on stdin)."""
        self.run("create", "-f", "-", stdin=json.dumps(obj))

    def delete(
        self, kind: str, name: str, *, namespace: str | None = None, timeout: float = 180.0
    ) -> None:
        """Delete and wait until the object is gone (a no-op if it is already gone)."""
        ns = ["-n", namespace] if namespace else []
        self.run(
            "delete",
            kind,
            name,
            *ns,
            "--ignore-not-found",
            "--wait=true",
            f"--timeout={int(timeout)}s",
            timeout=timeout + 30,
        )

    def exec_python(self, namespace: str, pod: str, container: str, script: str) -> Any:
        """Run ``python3 -c script`` in the container; its stdout decoded as JSON."""
        out = self.run("exec", "-n", namespace, pod, "-c", container, "--", "python3", "-c", script)
        return json.loads(out)

    def logs(self, namespace: str, pod: str, container: str, *, previous: bool = False) -> str:
        args = ["logs", "-n", namespace, pod, "-c", container]
        if previous:
            args.append("--previous")
        return self.run(*args, timeout=120.0)

    def save(self, path: Path, *args: str) -> None:
        """Write the output of kubectl ``args`` (or its error) to ``path``: diagnostics."""
        try:
            text = self.run(*args, timeout=120.0, check=False)
        except KubectlError as exc:
            text = f"# {exc}\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def _show(command: Sequence[str]) -> str:
    shown = " ".join([*command[:1], *[a if len(a) < 80 else a[:77] + "..." for a in command[1:]]])
    return f"`{shown}`"
