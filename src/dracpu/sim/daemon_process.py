"""The simulator's handle on the real ``dracpu run`` process: its log, its HTTP port, its stop.

:class:`DaemonProcess` wraps the subprocess :mod:`dracpu.sim.node` starts; :func:`http_get` and
:func:`wait_until` are the simulator's two ways of watching the daemon from outside, as a
kubelet's probes and an operator would.
"""

from __future__ import annotations

import contextlib
import json
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import aiohttp
import anyio
import anyio.abc

from dracpu.errors import DracpuError

__all__ = ["READY_TIMEOUT", "STOP_TIMEOUT", "DaemonProcess", "SimError", "http_get", "wait_until"]

# How long the daemon may take from launch to /readyz 200 on a loaded 2-core machine (it imports
# kubernetes, grpclib and prometheus).
READY_TIMEOUT = 60.0
# The daemon promises to stop within 5 s of SIGTERM (dracpu.daemon); more than this fails.
STOP_TIMEOUT = 10.0
# Polling period of wait_until (log file, /readyz, files, container table).
POLL_INTERVAL = 0.02
# The line the HTTP task logs once it listens (tasks/http.py): how we learn the port of a daemon
# started with --bind-address=127.0.0.1:0 (no race for a free port with other processes).
_LISTENING = "serving /healthz, /readyz and /metrics on "


class SimError(DracpuError):
    """The simulated node did not behave as expected (the message says what and where)."""


# --- HTTP -----------------------------------------------------------------------------------------


async def http_get(port: int, path: str, *, timeout: float = 5.0) -> tuple[int, str]:  # noqa: ASYNC109
    """``GET http://127.0.0.1:<port><path>`` with aiohttp's client: (status, body). Raises
    ``OSError`` when nothing listens and :class:`SimError` on a malformed answer or a timeout."""
    url = f"http://127.0.0.1:{port}{path}"
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session,
            session.get(url) as response,
        ):
            return response.status, await response.text(errors="replace")
    except aiohttp.ClientOSError:
        raise  # an OSError: nothing listens (yet), or the connection broke
    except TimeoutError as exc:
        raise SimError(f"GET {path} on port {port}: no answer within {timeout:g} s") from exc
    except aiohttp.ClientError as exc:  # not HTTP, a head aiohttp cannot parse, no answer
        raise SimError(f"GET {path} on port {port}: no valid answer: {exc!r}") from exc


async def wait_until(
    what: str,
    check: Callable[[], bool],
    *,
    timeout: float = 10.0,  # noqa: ASYNC109
    failed: Callable[[], str | None] | None = None,
) -> None:
    """Poll ``check`` until it is true; :class:`SimError` naming ``what`` after ``timeout``.

    ``failed`` returns why waiting is pointless (e.g. the daemon exited), or ``None``.
    """
    deadline = anyio.current_time() + timeout
    while not check():
        if failed is not None:
            reason = failed()
            if reason is not None:
                raise SimError(f"{reason} while waiting for {what}")
        if anyio.current_time() >= deadline:
            raise SimError(f"timed out after {timeout:g} s waiting for {what}")
        await anyio.sleep(POLL_INTERVAL)


# --- the daemon process ---------------------------------------------------------------------------


class DaemonProcess:
    """One ``dracpu run`` process: its port, log, readiness and how to stop it."""

    def __init__(self, process: anyio.abc.Process, log_path: Path, log_file: IO[bytes]) -> None:
        self.process = process
        self.log_path = log_path
        self._log_file = log_file
        self.port: int | None = None
        self.started = time.monotonic()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def exited(self) -> str | None:
        """Why waiting for this daemon is pointless: it exited (with its last error lines)."""
        if self.process.returncode is None:
            return None
        errors = [e["message"] for e in self.logs() if e.get("level") == "error"]
        tail = "; ".join(errors[-3:]) or "no error logged"
        return f"dracpu run exited with code {self.process.returncode} ({tail})"

    def logs(self) -> list[dict[str, Any]]:
        """The JSON log lines so far (lines that are not JSON come as ``{"message": line}``)."""
        entries: list[dict[str, Any]] = []
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return entries
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                entry = json.loads(line)
            except ValueError:
                entry = {"level": "raw", "message": line}
            entries.append(entry if isinstance(entry, dict) else {"message": line})
        return entries

    def messages(self, level: str | None = None) -> list[str]:
        """The log messages so far (of one level, e.g. ``"error"``)."""
        return [
            str(e.get("message", ""))
            for e in self.logs()
            if level is None or e.get("level") == level
        ]

    def _port_from_log(self) -> int | None:
        """The port of the last server the log announced (a standby serves on one port, and
        on another once it took over)."""
        found = None
        for message in self.messages():
            if message.startswith(_LISTENING):
                address = message[len(_LISTENING) :].strip()
                port = address.rpartition(":")[2]
                if port.isdigit():
                    found = int(port)
        return found

    async def wait_listening(self, timeout: float = READY_TIMEOUT) -> int:  # noqa: ASYNC109
        """Wait for the HTTP port (from the log); return it."""

        def found() -> bool:
            self.port = self._port_from_log()
            return self.port is not None

        await wait_until("the daemon's HTTP port", found, timeout=timeout, failed=self.exited)
        assert self.port is not None
        return self.port

    async def get(self, path: str) -> tuple[int, str]:
        """GET ``path`` on the daemon's HTTP port."""
        port = self.port if self.port is not None else await self.wait_listening()
        return await http_get(port, path)

    async def wait_ready(self, timeout: float = READY_TIMEOUT) -> float:  # noqa: ASYNC109
        """Wait for ``/readyz`` 200; the seconds since launch."""
        port = await self.wait_listening(timeout)
        deadline = anyio.current_time() + timeout
        while True:
            reason = self.exited()
            if reason is not None:
                raise SimError(f"{reason} while waiting for /readyz")
            try:
                status, body = await http_get(port, "/readyz")
            except OSError:
                status, body = 0, "not listening"
            if status == 200:
                return time.monotonic() - self.started
            if anyio.current_time() >= deadline:
                raise SimError(f"/readyz still answers {status} after {timeout:g} s:\n{body}")
            await anyio.sleep(POLL_INTERVAL)

    async def stop(
        self,
        signum: signal.Signals = signal.SIGTERM,
        timeout: float = STOP_TIMEOUT,  # noqa: ASYNC109
    ) -> int:
        """Send ``signum`` and wait for the exit; the exit code (SIGKILL: -9)."""
        if self.process.returncode is None:
            self.process.send_signal(signum)
        with anyio.move_on_after(timeout):
            await self.process.wait()
        if self.process.returncode is None:
            self.process.kill()
            await self.process.wait()
            raise SimError(f"dracpu run did not stop within {timeout:g} s of {signum.name}")
        return self.process.returncode

    async def kill(self) -> int:
        """SIGKILL: a crash (nothing is cleaned up)."""
        return await self.stop(signal.SIGKILL)

    async def aclose(self) -> None:
        """Stop (SIGTERM, then SIGKILL) and release the process and its log file."""
        with anyio.CancelScope(shield=True):
            if self.process.returncode is None:
                with contextlib.suppress(SimError):
                    await self.stop()
            await self.process.aclose()
            self._log_file.close()


# --- the node -------------------------------------------------------------------------------------
