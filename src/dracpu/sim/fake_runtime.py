"""A fake container runtime that speaks NRI: containerd's side of the socket, for tests and sim.

It plays containerd (or CRI-O) for an externally launched NRI plugin (containerd/nri
``pkg/adaptation``): it listens on a unix socket, lets the plugin register
on mux conn 2, calls ``Configure`` and ``Synchronize`` on conn 1, then relays container and pod
events the plugin subscribed to, applies the adjustments and updates it answers with to a small
container table, and serves the plugin's ``UpdateContainers`` calls.

It shares no code with the daemon: framing is :mod:`dracpu.sim._nri_framing`, and
every message is encoded and decoded with Google's protobuf runtime
(:mod:`dracpu.sim._pb2.nri.v1alpha1.api_pb2`), never with ``dracpu.wire`` or ``dracpu._gen``.

Usage::

    async with open_fake_runtime(tmp_path / "nri.sock") as runtime:
        pod = runtime.add_pod("web")
        runtime.add_container(pod, "old", cpus="0-7")          # exists before the plugin
        ...start the plugin on tmp_path / "nri.sock"...
        info = await runtime.wait_plugin(10)                   # registered, configured, synced
        new = runtime.new_container(pod, "app", env=[claim_env(uid, "2-3")])
        reply = await runtime.create_container(pod, new)       # CreateContainerResponse (pb2)
        assert runtime.containers[new.id].cpus == "2-3"

Behaviour copied from containerd 2.x / NRI (each rule names its source in a comment):

* one plugin connection at a time is served; its handshake (register within the registration
  timeout, ``Configure``, ``Synchronize``) completes before the next connection is accepted;
  a new connection replaces the old one (the old one is closed);
* every call to the plugin runs under ``plugin_timeout``; a timeout, a closed connection or a
  protocol error is *fatal*: the plugin is closed and the operation continues without its answer;
  any other error status fails the operation (:class:`PluginFailedError`);
* events the plugin did not subscribe to are not sent; on NRI >= v0.12 the dedicated RPCs are
  tried first and ``StateChange`` is used when the plugin answers UNIMPLEMENTED; older runtimes
  send ``StateChange`` only;
* one lock (containerd's NRI lock) is held across each relayed event and the whole
  ``Synchronize``; ``UpdateContainers`` from the plugin takes the same lock (``updates_while_busy
  ="wait"``), which reproduces containerd/containerd#13733; ``"serve"`` applies at once and
  ``"refuse"`` answers UNAVAILABLE while the lock is held; an update whose plugin connection
  closed while it waited is not applied (ttrpc cancels the requests of a closed connection);
  :meth:`busy` holds the lock as a long event does;
* a container whose start has begun (:meth:`create_task`: containerd's ``NewTask``, runc has
  made its cgroup) and that is not RUNNING yet loses every update, as containerd rewrites only
  its spec then; CRI-O creates the cgroup in ``CreateContainer`` and takes updates of a
  created container;
* ``Synchronize`` is one message unless it exceeds the ttrpc limit (then it is split as
  ``recalcObjsPerSyncMsg`` does) or ``sync_chunk`` forces chunks; each ``more=true`` chunk must be
  answered with ``more=true`` and no updates, else the plugin is closed;
* frames the plugin sends are read the way the Go runtime reads them
  (:class:`~dracpu.sim._nri_framing.GoChannelReader`): with ``strict_framing`` a frame that
  containerd could not read closes the connection and is logged as a ``violation`` note.

Everything observed is appended to :attr:`FakeRuntime.log` (:class:`Call` and :class:`Note`).

The class is put together from its parts: the container table and the lifecycle events
(:mod:`dracpu.sim.runtime_table`), the NRI server (:mod:`dracpu.sim.runtime_server`), the failure
injection (:mod:`dracpu.sim.runtime_faults`), over the values of :mod:`dracpu.sim.runtime_model`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path

import anyio
import anyio.abc

from dracpu.errors import ConfigError
from dracpu.sim.runtime_faults import Faults
from dracpu.sim.runtime_model import (
    DEFAULT_PLUGIN_TIMEOUT,
    DEFAULT_REGISTRATION_TIMEOUT,
    PLUGIN_SERVICE,
    RUNTIME_SERVICE,
    Call,
    FakeContainer,
    FakePod,
    FakeRuntimeError,
    LogEntry,
    Note,
    Outcome,
    PluginFailedError,
    PluginInfo,
    UpdatesWhileBusy,
    _Connection,
    _parse_version,
    claim_env,
    event_bit,
    nri_version_for,
)
from dracpu.sim.runtime_server import NriServer
from dracpu.sim.runtime_table import ContainerTable

__all__ = [
    "DEFAULT_PLUGIN_TIMEOUT",
    "DEFAULT_REGISTRATION_TIMEOUT",
    "PLUGIN_SERVICE",
    "RUNTIME_SERVICE",
    "Call",
    "FakeContainer",
    "FakePod",
    "FakeRuntime",
    "FakeRuntimeError",
    "LogEntry",
    "Note",
    "Outcome",
    "PluginFailedError",
    "PluginInfo",
    "UpdatesWhileBusy",
    "claim_env",
    "event_bit",
    "nri_version_for",
    "open_fake_runtime",
]


class FakeRuntime(ContainerTable, NriServer, Faults):
    """The runtime: listener, plugin connection, container table and log. See the module doc."""

    def __init__(
        self,
        socket_path: Path,
        task_group: anyio.abc.TaskGroup,
        *,
        runtime_name: str,
        runtime_version: str,
        nri_version: str | None,
        plugin_timeout: float,
        registration_timeout: float,
        sync_chunk: int | None,
        updates_while_busy: UpdatesWhileBusy,
        strict_framing: bool,
        config: str,
    ) -> None:
        if plugin_timeout <= 0 or registration_timeout <= 0:
            raise ConfigError("fake runtime: timeouts must be positive")
        if sync_chunk is not None and sync_chunk < 1:
            raise ConfigError(f"fake runtime: sync_chunk must be at least 1, not {sync_chunk}")
        if updates_while_busy not in ("wait", "serve", "refuse"):
            raise ConfigError(f"fake runtime: unknown updates_while_busy {updates_while_busy!r}")
        self.socket_path = socket_path
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        self.nri_version = nri_version or nri_version_for(runtime_name, runtime_version)
        self._nri = _parse_version(self.nri_version)
        self.plugin_timeout = plugin_timeout
        self.registration_timeout = registration_timeout
        self.sync_chunk = sync_chunk
        self.updates_while_busy: UpdatesWhileBusy = updates_while_busy
        self.strict_framing = strict_framing
        self.config = config
        self.pods: dict[str, FakePod] = {}
        self.containers: dict[str, FakeContainer] = {}
        self.evictions: list[tuple[str, str]] = []
        self.log: list[LogEntry] = []
        self.connections = 0
        self._tg = task_group
        self._lock = anyio.Lock()  # containerd internal/nri/nri.go local.Lock
        self._conn: _Connection | None = None
        self._changed = anyio.Event()
        self._listener: anyio.abc.SocketListener | None = None
        self._accept_stopped = anyio.Event()
        self._live: set[_Connection] = set()
        self._ids = 0

    # --- observation ----------------------------------------------------------------------

    @property
    def plugin(self) -> PluginInfo | None:
        """The ready plugin (registered, configured, synchronized), or None."""
        conn = self._ready_conn()
        return conn.info if conn is not None else None

    def calls(self, method: str | None = None, *, caller: str | None = None) -> list[Call]:
        return [
            entry
            for entry in self.log
            if isinstance(entry, Call)
            and (method is None or entry.method == method)
            and (caller is None or entry.caller == caller)
        ]

    def notes(self, kind: str | None = None) -> list[Note]:
        return [
            entry
            for entry in self.log
            if isinstance(entry, Note) and (kind is None or entry.kind == kind)
        ]

    async def wait_plugin(self, timeout: float = 10.0) -> PluginInfo:  # noqa: ASYNC109
        """Wait until a plugin is ready; raise :class:`FakeRuntimeError` after ``timeout``."""
        with anyio.move_on_after(timeout):
            while True:
                info = self.plugin
                if info is not None:
                    return info
                await self._changed.wait()
        raise FakeRuntimeError(
            f"no NRI plugin became ready within {timeout} s; last notes: {self._recent_notes()}"
        )

    async def wait_plugin_gone(self, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait until no plugin connection is open (the plugin left or was closed)."""
        with anyio.move_on_after(timeout):
            while self._conn is not None:
                await self._changed.wait()
            return
        raise FakeRuntimeError(
            f"the plugin connection is still open after {timeout} s; "
            f"last notes: {self._recent_notes()}"
        )

    def _recent_notes(self) -> str:
        return "; ".join(f"{n.kind} {n.detail}".strip() for n in self.notes()[-6:]) or "none"


@asynccontextmanager
async def open_fake_runtime(
    socket_path: Path,
    *,
    runtime_name: str = "containerd",
    runtime_version: str = "2.3.0",
    nri_version: str | None = None,
    plugin_timeout: float = DEFAULT_PLUGIN_TIMEOUT,
    registration_timeout: float = DEFAULT_REGISTRATION_TIMEOUT,
    sync_chunk: int | None = None,
    updates_while_busy: UpdatesWhileBusy = "wait",
    strict_framing: bool = True,
    config: str = "",
) -> AsyncIterator[FakeRuntime]:
    """Listen on ``socket_path`` as an NRI runtime; everything stops when the block exits.

    ``nri_version`` defaults to the NRI release ``runtime_name`` ``runtime_version`` embeds
    (:func:`nri_version_for`); it decides the event mask, StateChange vs dedicated RPCs and
    whether Synchronize can be split. ``sync_chunk`` forces Synchronize into chunks of at most
    that many pods and that many containers. ``config`` is ``ConfigureRequest.config``.
    """
    async with anyio.create_task_group() as tg:
        runtime = FakeRuntime(
            socket_path,
            tg,
            runtime_name=runtime_name,
            runtime_version=runtime_version,
            nri_version=nri_version,
            plugin_timeout=plugin_timeout,
            registration_timeout=registration_timeout,
            sync_chunk=sync_chunk,
            updates_while_busy=updates_while_busy,
            strict_framing=strict_framing,
            config=config,
        )
        await runtime._listen()
        try:
            yield runtime
        finally:
            with anyio.CancelScope(shield=True), suppress(FakeRuntimeError):
                await runtime._stop_all("runtime stopped")
            tg.cancel_scope.cancel()
    await anyio.Path(socket_path).unlink(missing_ok=True)
