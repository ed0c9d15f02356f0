"""The fake runtime's failure injection: garbage, an oversized frame, a dropped plugin, a
restart, a runtime busy with a long event."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager

import anyio
import anyio.abc

from dracpu.sim import _nri_framing as framing
from dracpu.sim.runtime_model import (
    _SEND_ERRORS,
    OVERSIZED_WRITE_CHUNK,
    OVERSIZED_WRITE_TIMEOUT,
    STOP_TIMEOUT,
    FakeRuntimeError,
    RuntimeBase,
    _Connection,
)


class Faults(RuntimeBase):
    """What a broken or restarting runtime does to the plugin (a part of FakeRuntime)."""

    # --- failure injection ------------------------------------------------------------------

    def _current(self) -> _Connection:
        conn = self._conn
        if conn is None or conn.close_reason:
            raise FakeRuntimeError("no plugin connection to send to")
        return conn

    async def send_garbage(self, data: bytes) -> None:
        """Write ``data`` raw on the plugin's socket (no framing added)."""
        conn = self._current()
        self._note("garbage", data.hex(" "), conn)
        try:
            async with conn.send_lock:
                await conn.stream.send(data)
        except _SEND_ERRORS as exc:
            raise FakeRuntimeError(f"could not send garbage: {exc!r}") from exc

    async def send_oversized_frame(
        self,
        *,
        conn_id: int = framing.PLUGIN_SERVICE_CONN,
        length: int = framing.MUX_MAX_PAYLOAD + 1,
    ) -> int:
        """Send a mux frame header declaring ``length`` bytes, then that many zero bytes.

        The default is one byte more than the mux allows (10 + 4 MiB). The payload is written
        until it is complete or the plugin closes the socket (expected: it should refuse the
        header), for at most 10 s; returns how many bytes were written, header included.
        """
        conn = self._current()
        self._note("oversized-frame", f"conn {conn_id}, {length} bytes", conn)
        written = 0
        with anyio.move_on_after(OVERSIZED_WRITE_TIMEOUT):
            async with conn.send_lock:
                try:
                    await conn.stream.send(framing.MUX_HEADER.pack(conn_id, length))
                    written += framing.MUX_HEADER_LEN
                    chunk = bytes(OVERSIZED_WRITE_CHUNK)
                    remaining = length
                    while remaining:
                        piece = chunk[: min(remaining, OVERSIZED_WRITE_CHUNK)]
                        await conn.stream.send(piece)
                        written += len(piece)
                        remaining -= len(piece)
                except _SEND_ERRORS:
                    pass
        return written

    @asynccontextmanager
    async def busy(self) -> AsyncIterator[None]:
        """Hold the runtime's NRI lock for the block, as a long event (another plugin's) does:
        the plugin's ``UpdateContainers`` waits for it (``updates_while_busy="wait"``), and
        is dropped if the plugin hangs up meanwhile."""
        async with self._lock:
            yield

    async def drop_plugin(self, reason: str = "dropped by the test") -> None:
        """Close the plugin's connection as a fatal error would; wait until it is closed."""
        conn = self._current()
        self._close(conn, reason)
        await self._wait_ended([conn], None)

    async def _wait_ended(self, conns: Sequence[_Connection], accept: anyio.Event | None) -> None:
        with anyio.move_on_after(STOP_TIMEOUT):
            for conn in conns:
                await conn.closed.wait()
            if accept is not None:
                await accept.wait()
            return
        raise FakeRuntimeError(f"connections did not end within {STOP_TIMEOUT} s")

    async def _stop_all(self, reason: str) -> None:
        """Stop accepting, hang up every connection and wait (bounded) for them to end."""
        listener, self._listener = self._listener, None
        if listener is not None:
            await listener.aclose()
        live = list(self._live)
        for conn in live:
            self._close(conn, reason)
        await self._wait_ended(live, self._accept_stopped if listener is not None else None)

    async def restart(self, *, downtime: float = 0.0) -> None:
        """Restart the runtime: stop listening, close the plugin, listen again.

        The table survives (containers keep running across a containerd restart). The plugin
        sees EOF and must reconnect and register again; the runtime then synchronizes it.
        """
        self._note("restart", f"downtime {downtime} s")
        await self.go_away("runtime restart")
        await anyio.sleep(downtime)
        await self.come_back()

    async def go_away(self, reason: str = "runtime stopped") -> None:
        """Stop as a runtime that goes down does: stop listening, hang up, remove the socket."""
        await self._stop_all(reason)
        await anyio.Path(self.socket_path).unlink(missing_ok=True)

    async def come_back(self) -> None:
        """Listen again after :meth:`go_away` (the container table survived)."""
        await self._listen()
