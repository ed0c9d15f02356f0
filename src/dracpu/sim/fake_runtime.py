"""A fake container runtime that speaks NRI: containerd's side of the socket, for tests and sim.

It plays containerd (or CRI-O) for an externally launched NRI plugin
(``reference/nri-ttrpc-cdi.md`` §2.4, §3): it listens on a unix socket, lets the plugin register
on mux conn 2, calls ``Configure`` and ``Synchronize`` on conn 1, then relays container and pod
events the plugin subscribed to, applies the adjustments and updates it answers with to a small
container table, and serves the plugin's ``UpdateContainers`` calls.

It shares no code with the daemon (design §7): framing is :mod:`dracpu.sim._nri_framing`, and
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
  ="wait"``), which reproduces the deadlock of reference §3.9; ``"serve"`` applies at once and
  ``"refuse"`` answers UNAVAILABLE while the lock is held;
* ``Synchronize`` is one message unless it exceeds the ttrpc limit (then it is split as
  ``recalcObjsPerSyncMsg`` does) or ``sync_chunk`` forces chunks; each ``more=true`` chunk must be
  answered with ``more=true`` and no updates, else the plugin is closed;
* frames the plugin sends are read the way the Go runtime reads them
  (:class:`~dracpu.sim._nri_framing.GoChannelReader`): with ``strict_framing`` a frame that
  containerd could not read closes the connection and is logged as a ``violation`` note.

Everything observed is appended to :attr:`FakeRuntime.log` (:class:`Call` and :class:`Note`).
"""

from __future__ import annotations

import logging
import re
import socket
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Generic, Literal, TypeVar

import anyio
import anyio.abc
from google.protobuf.message import DecodeError, Message

from dracpu.errors import ConfigError, DracpuError
from dracpu.sim import _nri_framing as framing
from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as nri

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

logger = logging.getLogger(__name__)

PLUGIN_SERVICE = "nri.pkg.api.v1alpha1.Plugin"  # nri pkg/api/api_ttrpc.pb.go, served on conn 1
RUNTIME_SERVICE = "nri.pkg.api.v1alpha1.Runtime"  # nri pkg/api/api_ttrpc.pb.go, served on conn 2
DEFAULT_PLUGIN_TIMEOUT = 2.0  # nri pkg/api/timeouts.go DefaultPluginRequestTimeout
DEFAULT_REGISTRATION_TIMEOUT = 5.0  # nri pkg/api/timeouts.go DefaultPluginRegistrationTimeout
MIN_SYNC_OBJECTS = 8  # nri adaptation/plugin.go recalcObjsPerSyncMsg minObjsPerMsg
SYNC_SHRINK_MAX = 0.9  # recalcObjsPerSyncMsg: the shrink factor is capped at 0.9
VALID_EVENTS_BEFORE_V010 = 0x7FF  # nri event.go ValidEvents = (1 << (LAST-1)) - 1, LAST=12
VALID_EVENTS_V010 = 0x3FFF  # the same with LAST=15 (NRI >= v0.10)
UPDATE_FAILED = "NRI update of some containers failed"  # reference §3.4 UpdateContainersResponse
CDI_ENV_PREFIX = "DRA_CPUSET_"  # design §2: the CDI env var of a CPU claim
READ_CHUNK = 65536  # bytes per socket read; any size works, the mux parser reassembles
STOP_TIMEOUT = 5.0  # seconds the runtime waits for its connections to end when it stops
OVERSIZED_WRITE_CHUNK = 65536  # send_oversized_frame writes its payload in pieces this big
OVERSIZED_WRITE_TIMEOUT = 10.0  # seconds send_oversized_frame may block on a plugin not reading
CODE_UNKNOWN = 2  # google.rpc.Code: what Go's ttrpc sends for a plain Go error
CODE_INVALID_ARGUMENT = 3  # google.rpc.Code
CODE_RESOURCE_EXHAUSTED = 8  # google.rpc.Code (ttrpc channel.go, oversized message)
CODE_UNIMPLEMENTED = 12  # google.rpc.Code (ttrpc services.go, unknown service/method)
CODE_UNAVAILABLE = 14  # google.rpc.Code (our "refuse" policy for UpdateContainers)

# NRI versions that changed what the runtime sends (reference §3.5).
NRI_V0_7 = (0, 7, 0)  # ConfigureRequest timeouts, split Synchronize (more)
NRI_V0_10 = (0, 10, 0)  # events 12-14 (valid mask 0x3FFF), UpdatePodSandbox
NRI_V0_12 = (0, 12, 0)  # dedicated RPCs instead of StateChange, NRI_version, name charset

# containerd release -> embedded NRI (reference §3.5; nri pkg/api/version.go runtimeVersionMap).
_CONTAINERD_NRI: tuple[tuple[tuple[int, int, int], str], ...] = (
    ((1, 7, 0), "v0.3.0"),
    ((1, 7, 7), "v0.4.0"),
    ((1, 7, 14), "v0.6.0"),
    ((1, 7, 16), "v0.6.1"),
    ((1, 7, 26), "v0.8.0"),
    ((2, 2, 0), "v0.10.0"),
    ((2, 2, 1), "v0.11.0"),
    ((2, 3, 0), "v0.12.0"),
    ((2, 4, 0), "v0.12.2"),
)
# CRI-O minor release -> embedded NRI (reference §3.5 and version.go).
_CRIO_NRI: tuple[tuple[tuple[int, int, int], str], ...] = (
    ((1, 26, 0), "v0.3.0"),
    ((1, 29, 0), "v0.6.0"),
    ((1, 31, 0), "v0.6.1"),
    ((1, 32, 0), "v0.9.0"),
    ((1, 34, 0), "v0.10.0"),
    ((1, 35, 0), "v0.11.0"),
    ((1, 37, 0), "v0.12.0"),
)

# Plugin name characters accepted by NRI >= v0.12 (nri pkg/api/plugin.go CheckPluginName).
_PLUGIN_NAME = re.compile(r"[A-Za-z0-9_.+-]+")
_PLUGIN_INDEX = re.compile(r"[0-9]{2}")  # CheckPluginIndex: exactly two ASCII digits
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.(\d+))?")

Outcome = Literal["ok", "error", "timeout", "closed"]
UpdatesWhileBusy = Literal["wait", "serve", "refuse"]
M = TypeVar("M", bound=Message)

# Events relayed with a dedicated RPC on NRI >= v0.12 (nri adaptation/plugin_type.go), each
# falling back to StateChange when the plugin answers UNIMPLEMENTED.
_DEDICATED: dict[int, tuple[str, type[Message], type[Message], bool]] = {
    nri.RUN_POD_SANDBOX: (
        "RunPodSandbox",
        nri.RunPodSandboxRequest,
        nri.RunPodSandboxResponse,
        False,
    ),
    nri.STOP_POD_SANDBOX: (
        "StopPodSandbox",
        nri.StopPodSandboxRequest,
        nri.StopPodSandboxResponse,
        False,
    ),
    nri.REMOVE_POD_SANDBOX: (
        "RemovePodSandbox",
        nri.RemovePodSandboxRequest,
        nri.RemovePodSandboxResponse,
        False,
    ),
    nri.POST_UPDATE_POD_SANDBOX: (
        "PostUpdatePodSandbox",
        nri.PostUpdatePodSandboxRequest,
        nri.PostUpdatePodSandboxResponse,
        False,
    ),
    nri.POST_CREATE_CONTAINER: (
        "PostCreateContainer",
        nri.PostCreateContainerRequest,
        nri.PostCreateContainerResponse,
        True,
    ),
    nri.START_CONTAINER: (
        "StartContainer",
        nri.StartContainerRequest,
        nri.StartContainerResponse,
        True,
    ),
    nri.POST_START_CONTAINER: (
        "PostStartContainer",
        nri.PostStartContainerRequest,
        nri.PostStartContainerResponse,
        True,
    ),
    nri.POST_UPDATE_CONTAINER: (
        "PostUpdateContainer",
        nri.PostUpdateContainerRequest,
        nri.PostUpdateContainerResponse,
        True,
    ),
    nri.REMOVE_CONTAINER: (
        "RemoveContainer",
        nri.RemoveContainerRequest,
        nri.RemoveContainerResponse,
        True,
    ),
}
# Events that exist only from NRI v0.10 on (enum values 12-14).
_EVENTS_SINCE_V010 = frozenset(
    {nri.UPDATE_POD_SANDBOX, nri.POST_UPDATE_POD_SANDBOX, nri.VALIDATE_CONTAINER_ADJUSTMENT}
)


class FakeRuntimeError(DracpuError):
    """The fake runtime was used wrongly (unknown pod or container, no plugin, ...)."""


class PluginFailedError(FakeRuntimeError):
    """The plugin failed an operation (non-fatal error status): the runtime fails it too.

    ``code`` is the google.rpc code the plugin sent (or 2 when the runtime itself rejected the
    plugin's answer, e.g. an update of the container being created).
    """

    def __init__(self, method: str, code: int, message: str) -> None:
        super().__init__(f"plugin failed {method}: code {code}: {message}")
        self.method = method
        self.code = code
        self.message = message


def event_bit(event: int) -> int:
    """The subscription mask bit of an NRI event (nri event.go: ``1 << (event - 1)``)."""
    return 1 << (event - 1)


def claim_env(claim_uid: str, cpus: str) -> str:
    """The env entry the CDI spec of a CPU claim injects: ``DRA_CPUSET_<uid>=<cpus>``."""
    return f"{CDI_ENV_PREFIX}{claim_uid}={cpus}"


def _parse_version(text: str) -> tuple[int, int, int]:
    match = _VERSION.match(text.strip())
    if match is None:
        raise ConfigError(f"fake runtime: version {text!r} is not like v1.2.3")
    return (int(match.group(1)), int(match.group(2)), int(match.group(3) or 0))


def nri_version_for(runtime_name: str, runtime_version: str) -> str:
    """The NRI release a runtime version embeds (``containerd`` or ``cri-o``)."""
    version = _parse_version(runtime_version)
    if runtime_name == "containerd":
        table = _CONTAINERD_NRI
    elif runtime_name == "cri-o":
        table = _CRIO_NRI
    else:
        raise ConfigError(
            f"fake runtime: no NRI version known for runtime {runtime_name!r}; pass nri_version"
        )
    found = [nri_release for since, nri_release in table if version >= since]
    if not found:
        raise ConfigError(f"fake runtime: {runtime_name} {runtime_version} predates NRI")
    return found[-1]


# --- the container table ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FakePod:
    """A pod sandbox in the runtime's table."""

    id: str
    name: str
    uid: str
    namespace: str = "default"
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    def to_pb(self) -> nri.PodSandbox:
        return nri.PodSandbox(
            id=self.id,
            name=self.name,
            uid=self.uid,
            namespace=self.namespace,
            labels=dict(self.labels),
            annotations=dict(self.annotations),
        )


@dataclass(frozen=True, slots=True)
class FakeContainer:
    """A container in the runtime's table; ``cpus``/``mems`` are the cpuset as last applied."""

    id: str
    pod_id: str
    name: str
    env: tuple[str, ...] = ()
    state: int = nri.CONTAINER_UNKNOWN
    cpus: str = ""
    mems: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)

    @property
    def env_map(self) -> dict[str, str]:
        return dict(entry.partition("=")[::2] for entry in self.env)

    def to_pb(self, state: int | None = None) -> nri.Container:
        container = nri.Container(
            id=self.id,
            pod_sandbox_id=self.pod_id,
            name=self.name,
            state=nri.ContainerState.Name(self.state if state is None else state),
            labels=dict(self.labels),
            annotations=dict(self.annotations),
            env=list(self.env),
        )
        if self.cpus or self.mems:
            cpu = container.linux.resources.cpu
            cpu.cpus = self.cpus
            cpu.mems = self.mems
        return container


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """The plugin as the runtime knows it once it is registered, configured and synchronized."""

    name: str
    index: str
    events: int  # effective subscription mask (0 from the plugin means all valid events)
    requested_events: int  # what ConfigureResponse.events said
    nri_version: str  # RegisterPluginRequest.NRI_version ("" if the plugin did not say)
    connection: int  # 1 for the first accepted connection, 2 after a reconnect, ...

    def subscribed(self, event: int) -> bool:
        return bool(self.events & event_bit(event))


@dataclass(frozen=True, slots=True)
class Call:
    """One ttrpc call on the NRI socket, in either direction."""

    caller: Literal["runtime", "plugin"]
    method: str
    stream_id: int
    request: Message
    response: Message | None  # decoded reply on success
    code: int  # google.rpc code of the reply (0 on success)
    message: str  # status message of an error reply
    outcome: Outcome
    seconds: float
    connection: int


@dataclass(frozen=True, slots=True)
class Note:
    """Something that happened on the socket other than a call.

    Kinds: ``listening``, ``connected``, ``registered``, ``ready``, ``closed`` (the runtime
    closed the plugin: detail says why), ``disconnected``, ``violation`` (the plugin broke the
    protocol), ``dropped-frame``, ``stray-response``, ``garbage``, ``oversized-frame``,
    ``restart``, ``sync-split``, ``update-failed``, ``evicted``.
    """

    kind: str
    detail: str = ""
    connection: int = 0


LogEntry = Call | Note


@dataclass(frozen=True, slots=True)
class _Result(Generic[M]):
    outcome: Outcome
    response: M | None
    code: int = 0
    message: str = ""


class _Pending:
    """A call waiting for its Response on conn 1."""

    __slots__ = ("done", "oversized", "reply")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.reply: bytes | None = None
        self.oversized = 0


class _Connection:
    """One accepted plugin connection: the socket, both mux conns, the plugin's identity."""

    def __init__(self, number: int, stream: anyio.abc.SocketStream, *, strict: bool) -> None:
        self.number = number
        self.stream = stream
        self.raw_socket: socket.socket = stream.extra(anyio.abc.SocketAttribute.raw_socket)
        self.send_lock = anyio.Lock()
        self.scope = anyio.CancelScope()  # the handshake; the reader ends at EOF instead
        self.closed = anyio.Event()
        self.close_reason = ""
        self.handshake_done = anyio.Event()
        self.next_stream_id = 1  # ttrpc client.go: odd ids from 1
        self.last_request_id = 0  # ttrpc server.go: request ids must increase
        self.pending: dict[int, _Pending] = {}
        self.readers = {
            framing.PLUGIN_SERVICE_CONN: framing.GoChannelReader(strict=strict),
            framing.RUNTIME_SERVICE_CONN: framing.GoChannelReader(strict=strict),
        }
        self.registered = anyio.Event()
        self.registration_error = ""
        self.name = ""
        self.index = ""
        self.plugin_nri_version = ""
        self.info: PluginInfo | None = None

    def close(self, reason: str) -> None:
        """Hang up: the peer sees EOF, our reader sees EOF and ends, the handshake stops.

        The reader is never cancelled while it waits in ``receive()``: on anyio's asyncio
        backend, cancelling a raw-socket read in the loop iteration where the socket became
        readable makes the event loop report an InvalidStateError. A shutdown wakes it instead.
        """
        if not self.close_reason:
            self.close_reason = reason
        self.scope.cancel()
        with suppress(OSError):
            self.raw_socket.shutdown(socket.SHUT_RDWR)

    async def send(self, conn_id: int, message: bytes) -> None:
        data = b"".join(framing.mux_frames(conn_id, message))
        async with self.send_lock:
            await self.stream.send(data)


_SEND_ERRORS = (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)


class FakeRuntime:
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

    @property
    def valid_events(self) -> int:
        """The event mask this runtime's NRI version accepts."""
        return VALID_EVENTS_V010 if self._nri >= NRI_V0_10 else VALID_EVENTS_BEFORE_V010

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

    def _note(self, kind: str, detail: str = "", conn: _Connection | None = None) -> None:
        self.log.append(Note(kind, detail, conn.number if conn is not None else 0))
        logger.debug("fake runtime: %s %s", kind, detail)

    def _signal(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    def _ready_conn(self) -> _Connection | None:
        conn = self._conn
        if conn is None or conn.info is None or conn.close_reason:
            return None
        return conn

    # --- the table --------------------------------------------------------------------------

    def _next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}{self._ids:04d}"

    def add_pod(
        self,
        name: str = "pod",
        *,
        namespace: str = "default",
        uid: str | None = None,
        pod_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> FakePod:
        """Put a pod in the table without telling the plugin (it exists already)."""
        number = self._ids + 1
        pod = FakePod(
            id=pod_id or self._next_id("pod-"),
            name=name,
            uid=uid or f"00000000-0000-4000-8000-{number:012d}",
            namespace=namespace,
            labels=dict(labels or {}),
            annotations=dict(annotations or {}),
        )
        if pod.id in self.pods:
            raise FakeRuntimeError(f"pod {pod.id} already exists")
        self.pods[pod.id] = pod
        return pod

    def new_container(
        self,
        pod: FakePod,
        name: str,
        *,
        env: Iterable[str] = (),
        cpus: str = "",
        mems: str = "",
        container_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> FakeContainer:
        """A container description for :meth:`create_container` (not in the table yet)."""
        return FakeContainer(
            id=container_id or self._next_id("ctr-"),
            pod_id=pod.id,
            name=name,
            env=tuple(env),
            state=nri.CONTAINER_UNKNOWN,
            cpus=cpus,
            mems=mems,
            labels=dict(labels or {}),
            annotations=dict(annotations or {}),
        )

    def add_container(
        self,
        pod: FakePod,
        name: str,
        *,
        env: Iterable[str] = (),
        cpus: str = "",
        mems: str = "",
        state: int = nri.CONTAINER_RUNNING,
        container_id: str | None = None,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
    ) -> FakeContainer:
        """Put a container in the table without telling the plugin (it exists already)."""
        self._pod(pod.id)
        container = replace(
            self.new_container(
                pod,
                name,
                env=env,
                cpus=cpus,
                mems=mems,
                container_id=container_id,
                labels=labels,
                annotations=annotations,
            ),
            state=state,
        )
        if container.id in self.containers:
            raise FakeRuntimeError(f"container {container.id} already exists")
        self.containers[container.id] = container
        return container

    def _pod(self, pod_id: str) -> FakePod:
        try:
            return self.pods[pod_id]
        except KeyError:
            raise FakeRuntimeError(f"no pod {pod_id!r} in the fake runtime") from None

    def _container(self, container_id: str) -> FakeContainer:
        try:
            return self.containers[container_id]
        except KeyError:
            raise FakeRuntimeError(f"no container {container_id!r} in the fake runtime") from None

    def _set_state(self, container_id: str, state: int) -> None:
        container = self.containers.get(container_id)
        if container is not None:
            self.containers[container_id] = replace(container, state=state)

    def _apply_updates(
        self, updates: Sequence[nri.ContainerUpdate], *, skip: str = ""
    ) -> list[nri.ContainerUpdate]:
        """Apply container updates to the table; return those that failed (unknown ids)."""
        failed: list[nri.ContainerUpdate] = []
        for update in updates:
            if update.container_id == skip:
                continue
            container = self.containers.get(update.container_id)
            if container is None:
                if not update.ignore_failure:
                    failed.append(update)
                continue
            cpu = update.linux.resources.cpu
            self.containers[container.id] = replace(
                container, cpus=cpu.cpus or container.cpus, mems=cpu.mems or container.mems
            )
        for update in failed:
            self._note("update-failed", f"no container {update.container_id!r}")
        return failed

    def _evict(self, evictions: Sequence[nri.ContainerEviction]) -> None:
        for eviction in evictions:
            self.evictions.append((eviction.container_id, eviction.reason))
            self._set_state(eviction.container_id, nri.CONTAINER_STOPPED)
            self._note("evicted", f"{eviction.container_id}: {eviction.reason}")

    # --- events (the runtime calls the plugin) ----------------------------------------------

    async def create_container(
        self, pod: FakePod, container: FakeContainer
    ) -> nri.CreateContainerResponse:
        """Create ``container``: CreateContainer, then PostCreateContainer.

        Applies the plugin's adjustment (cpus, mems, env) to the new container and its updates
        to the others. Raises :class:`PluginFailedError` (and creates nothing) if the plugin
        answered with an error status or asked to update the container being created. Returns
        the plugin's reply, empty if the plugin was not asked or was closed on a fatal error.
        """
        self._pod(pod.id)
        if container.id in self.containers:
            raise FakeRuntimeError(f"container {container.id} already exists")
        async with self._lock:
            request = nri.CreateContainerRequest(
                pod=pod.to_pb(), container=container.to_pb(nri.CONTAINER_UNKNOWN)
            )
            result = await self._event(
                nri.CREATE_CONTAINER, "CreateContainer", request, nri.CreateContainerResponse
            )
            reply = nri.CreateContainerResponse()
            if result is not None and result.response is not None:
                reply = result.response
            for update in reply.update:
                if update.container_id == container.id:
                    # nri adaptation/result.go: "plugin %q asked update of %q during creation"
                    raise PluginFailedError(
                        "CreateContainer",
                        CODE_UNKNOWN,
                        f"plugin asked update of {container.id!r} during creation",
                    )
            self.containers[container.id] = replace(
                _adjusted(container, reply.adjust), state=nri.CONTAINER_CREATED
            )
            self._evict(reply.evict)
            self._apply_updates(reply.update)
            await self._notify(nri.POST_CREATE_CONTAINER, pod, self.containers[container.id])
        return reply

    async def start_container(self, container_id: str) -> None:
        """StartContainer then PostStartContainer; the container becomes RUNNING."""
        container = self._container(container_id)
        pod = self._pod(container.pod_id)
        async with self._lock:
            self._set_state(container_id, nri.CONTAINER_RUNNING)
            await self._notify(nri.START_CONTAINER, pod, self.containers[container_id])
            await self._notify(nri.POST_START_CONTAINER, pod, self.containers[container_id])

    async def update_container(
        self, container_id: str, *, cpus: str = "", mems: str = ""
    ) -> nri.UpdateContainerResponse:
        """UpdateContainer with the requested cpuset (as kubelet's UpdateContainerResources).

        The plugin's update entry for this container overrides the request; its other entries
        are applied to their containers; then PostUpdateContainer.
        """
        container = self._container(container_id)
        pod = self._pod(container.pod_id)
        async with self._lock:
            request = nri.UpdateContainerRequest(pod=pod.to_pb(), container=container.to_pb())
            request.linux_resources.cpu.cpus = cpus
            request.linux_resources.cpu.mems = mems
            request.linux_resources.SetInParent()
            result = await self._event(
                nri.UPDATE_CONTAINER, "UpdateContainer", request, nri.UpdateContainerResponse
            )
            reply = nri.UpdateContainerResponse()
            if result is not None and result.response is not None:
                reply = result.response
            self._evict(reply.evict)
            want_cpus, want_mems = cpus, mems
            for update in reply.update:
                if update.container_id == container_id:
                    want_cpus = update.linux.resources.cpu.cpus or want_cpus
                    want_mems = update.linux.resources.cpu.mems or want_mems
            self._apply_updates(reply.update, skip=container_id)
            current = self.containers[container_id]
            self.containers[container_id] = replace(
                current, cpus=want_cpus or current.cpus, mems=want_mems or current.mems
            )
            await self._notify(nri.POST_UPDATE_CONTAINER, pod, self.containers[container_id])
        return reply

    async def stop_container(self, container_id: str) -> nri.StopContainerResponse:
        """StopContainer; the container becomes STOPPED and the plugin's updates are applied."""
        async with self._lock:
            return await self._stop(container_id)

    async def _stop(self, container_id: str) -> nri.StopContainerResponse:
        container = self._container(container_id)
        pod = self._pod(container.pod_id)
        request = nri.StopContainerRequest(pod=pod.to_pb(), container=container.to_pb())
        try:
            result = await self._event(
                nri.STOP_CONTAINER, "StopContainer", request, nri.StopContainerResponse
            )
        finally:
            # containerd internal/nri/nri.go stopContainer: stopped whatever the plugin says
            self._set_state(container_id, nri.CONTAINER_STOPPED)
        reply = nri.StopContainerResponse()
        if result is not None and result.response is not None:
            reply = result.response
        self._apply_updates(reply.update)
        return reply

    async def remove_container(self, container_id: str) -> None:
        """Stop the container if it runs (StopContainer), then RemoveContainer; drop it."""
        container = self._container(container_id)
        pod = self._pod(container.pod_id)
        async with self._lock:
            if container.state in (nri.CONTAINER_CREATED, nri.CONTAINER_RUNNING):
                # containerd nri.go RemoveContainer stops it first and ignores that error
                # (still visible in the log).
                with suppress(PluginFailedError):
                    await self._stop(container_id)
            container = self.containers.pop(container_id)
            await self._notify(nri.REMOVE_CONTAINER, pod, container)

    async def run_pod_sandbox(self, pod: FakePod) -> None:
        """RunPodSandbox (the pod is added to the table if it is not there)."""
        self.pods.setdefault(pod.id, pod)
        async with self._lock:
            await self._notify(nri.RUN_POD_SANDBOX, pod, None)

    async def stop_pod_sandbox(self, pod_id: str) -> None:
        """Stop the pod's running containers, then StopPodSandbox."""
        pod = self._pod(pod_id)
        async with self._lock:
            for container in list(self.containers.values()):
                if container.pod_id == pod_id and container.state in (
                    nri.CONTAINER_CREATED,
                    nri.CONTAINER_RUNNING,
                ):
                    await self._stop(container.id)
            await self._notify(nri.STOP_POD_SANDBOX, pod, None)

    async def remove_pod_sandbox(self, pod_id: str) -> None:
        """Remove the pod's containers (each as remove_container), then RemovePodSandbox."""
        self._pod(pod_id)
        for container in [c for c in self.containers.values() if c.pod_id == pod_id]:
            await self.remove_container(container.id)
        async with self._lock:
            pod = self.pods.pop(pod_id)
            await self._notify(nri.REMOVE_POD_SANDBOX, pod, None)

    async def state_change(
        self, event: int, pod: FakePod, container: FakeContainer | None = None
    ) -> None:
        """Relay one non-mutating event as the runtime would (dedicated RPC or StateChange).

        Changes nothing in the table. Raises :class:`PluginFailedError` on an error status.
        """
        async with self._lock:
            await self._notify(event, pod, container)

    async def _notify(self, event: int, pod: FakePod, container: FakeContainer | None) -> None:
        if event in _EVENTS_SINCE_V010 and self._nri < NRI_V0_10:
            return
        pod_pb = pod.to_pb()
        container_pb = container.to_pb() if container is not None else None
        dedicated = _DEDICATED.get(event)
        if dedicated is not None and self._nri >= NRI_V0_12:
            method, request_type, response_type, with_container = dedicated
            request = request_type()
            request.pod.CopyFrom(pod_pb)  # type: ignore[attr-defined]
            if with_container and container_pb is not None:
                request.container.CopyFrom(container_pb)  # type: ignore[attr-defined]
            result = await self._event(event, method, request, response_type)
            # _event raised on any other error: only UNIMPLEMENTED falls back to StateChange.
            if result is None or result.outcome != "error":
                return
        state_change = nri.StateChangeEvent(event=nri.Event.Name(event), pod=pod_pb)
        if container_pb is not None:
            state_change.container.CopyFrom(container_pb)
        await self._event(event, "StateChange", state_change, nri.Empty)

    async def _event(
        self, event: int, method: str, request: Message, response_type: type[M]
    ) -> _Result[M] | None:
        """Send one event to the ready plugin if it subscribed to it; None when not sent.

        A non-fatal error status raises PluginFailedError, except for the calls whose error is
        handled by the caller (the StateChange fallback).
        """
        conn = self._ready_conn()
        if conn is None or conn.info is None or not conn.info.subscribed(event):
            return None
        deadline = anyio.current_time() + self.plugin_timeout
        result = await self._call(conn, method, request, response_type, deadline=deadline)
        if result.outcome == "error" and not (
            result.code == CODE_UNIMPLEMENTED and method in _FALLBACK_METHODS
        ):
            raise PluginFailedError(method, result.code, result.message)
        return result

    # --- ttrpc client on conn 1 -------------------------------------------------------------

    async def _call(
        self,
        conn: _Connection,
        method: str,
        request: Message,
        response_type: type[M],
        *,
        deadline: float,
    ) -> _Result[M]:
        """One call to the plugin; timeouts and closed connections close the plugin (fatal)."""
        stream_id = conn.next_stream_id
        conn.next_stream_id += 2
        pending = _Pending()
        conn.pending[stream_id] = pending
        started = anyio.current_time()
        timeout_nano = max(0, int((deadline - started) * 1e9))
        message = framing.request_message(
            stream_id,
            PLUGIN_SERVICE,
            method,
            request.SerializeToString(deterministic=True),
            timeout_nano,
        )
        sent = True
        try:
            with anyio.CancelScope(deadline=deadline) as scope:
                try:
                    await conn.send(framing.PLUGIN_SERVICE_CONN, message)
                except _SEND_ERRORS:
                    sent = False
                else:
                    await pending.done.wait()
        finally:
            conn.pending.pop(stream_id, None)
        result: _Result[M]
        if scope.cancelled_caught:
            result = _Result("timeout", None, 4, "context deadline exceeded")
            self._close(conn, f"failed to handle {method} request: context deadline exceeded")
        elif not sent or pending.reply is None:
            result = _Result("closed", None, 0, "ttrpc: closed")
            self._close(conn, f"failed to handle {method} request: ttrpc: closed")
        else:
            result = self._decode_reply(conn, method, pending, response_type)
        self.log.append(
            Call(
                caller="runtime",
                method=method,
                stream_id=stream_id,
                request=request,
                response=result.response,
                code=result.code,
                message=result.message,
                outcome=result.outcome,
                seconds=anyio.current_time() - started,
                connection=conn.number,
            )
        )
        return result

    def _decode_reply(
        self, conn: _Connection, method: str, pending: _Pending, response_type: type[M]
    ) -> _Result[M]:
        if pending.oversized:
            # ttrpc channel.go recv: the stream gets RESOURCE_EXHAUSTED, the connection stays.
            return _Result(
                "error",
                None,
                CODE_RESOURCE_EXHAUSTED,
                f"message length {pending.oversized} exceed maximum message size of "
                f"{framing.TTRPC_MAX_DATA}",
            )
        assert pending.reply is not None
        try:
            envelope = framing.decode_response(pending.reply)
            if envelope.HasField("status") and envelope.status.code != 0:
                return _Result("error", None, envelope.status.code, envelope.status.message)
            response = response_type()
            response.ParseFromString(envelope.payload)
        except DecodeError as exc:
            self._note("violation", f"{method} reply does not parse: {exc}", conn)
            self._close(conn, f"failed to handle {method} request: bad reply")
            return _Result("closed", None, 0, f"bad reply: {exc}")
        return _Result("ok", response)

    def _close(self, conn: _Connection, reason: str) -> None:
        if not conn.close_reason:
            self._note("closed", reason, conn)
        conn.close(reason)
        self._signal()

    # --- accepting and serving connections --------------------------------------------------

    async def _listen(self) -> None:
        path = anyio.Path(self.socket_path)
        await path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        if await path.is_socket():
            await path.unlink()  # adaptation.go startListener: remove a stale socket first
        listener = await anyio.create_unix_listener(self.socket_path)
        self._accept_stopped = anyio.Event()
        await self._tg.start(self._accept_loop, listener)
        self._note("listening", str(path))

    async def _accept_loop(
        self,
        listener: anyio.abc.SocketListener,
        *,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        # Stopped by closing the listener (_stop_all), never by cancelling accept(): like a
        # blocked receive(), a cancelled accept() can race with the selector (see close()).
        self._listener = listener
        task_status.started()
        try:
            while True:
                try:
                    stream = await listener.accept()
                except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                    return
                self.connections += 1
                conn = _Connection(self.connections, stream, strict=self.strict_framing)
                self._live.add(conn)
                old = self._conn
                if old is not None:
                    self._close(old, "replaced by a new plugin connection")
                self._conn = conn
                self._note("connected", "", conn)
                self._tg.start_soon(self._run_connection, conn)
                # adaptation.go acceptPluginConnections: one handshake at a time
                await conn.handshake_done.wait()
        finally:
            self._accept_stopped.set()

    async def _run_connection(self, conn: _Connection) -> None:
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._read_loop, conn)
                with conn.scope:
                    await self._handshake(conn)
                conn.handshake_done.set()
        finally:
            self._live.discard(conn)
            conn.handshake_done.set()
            for pending in conn.pending.values():
                pending.done.set()
            with anyio.CancelScope(shield=True):
                await conn.stream.aclose()
            if not conn.close_reason:
                conn.close_reason = "connection ended"
            self._note("disconnected", conn.close_reason, conn)
            if self._conn is conn:
                self._conn = None
            conn.closed.set()
            self._signal()

    async def _handshake(self, conn: _Connection) -> None:
        # adaptation/plugin.go start(): wait for RegisterPlugin up to the registration timeout.
        with anyio.move_on_after(self.registration_timeout):
            await conn.registered.wait()
        if not conn.registered.is_set():
            self._close(conn, "plugin registration timed out")
            return
        if conn.registration_error:
            self._close(conn, f"failed to register plugin: {conn.registration_error}")
            return
        configure = nri.ConfigureRequest(
            config=self.config,
            runtime_name=self.runtime_name,
            runtime_version=self.runtime_version,
        )
        if self._nri >= NRI_V0_7:
            configure.registration_timeout = round(self.registration_timeout * 1000)
            configure.request_timeout = round(self.plugin_timeout * 1000)
        if self._nri >= NRI_V0_12:
            configure.NRI_version = self.nri_version
        deadline = anyio.current_time() + self.plugin_timeout
        result = await self._call(
            conn, "Configure", configure, nri.ConfigureResponse, deadline=deadline
        )
        if result.response is None:
            self._close(conn, f"failed to configure plugin: {result.outcome} {result.message}")
            return
        requested = result.response.events
        events = requested or self.valid_events
        if events & ~self.valid_events:
            self._close(conn, f"invalid plugin events: 0x{events & ~self.valid_events:x}")
            return
        info = PluginInfo(
            name=conn.name,
            index=conn.index,
            events=events,
            requested_events=requested,
            nri_version=conn.plugin_nri_version,
            connection=conn.number,
        )
        if not await self._synchronize(conn):
            return
        conn.info = info
        self._note("ready", f"{info.index}-{info.name} events=0x{info.events:x}", conn)
        self._signal()

    async def _synchronize(self, conn: _Connection) -> bool:
        """nri adaptation/plugin.go synchronize, under containerd's lock (nri.go syncPlugin)."""
        async with self._lock:
            pods = [pod.to_pb() for pod in self.pods.values()]
            containers = [container.to_pb() for container in self.containers.values()]
            deadline = anyio.current_time() + self.plugin_timeout
            can_split = self._nri >= NRI_V0_7
            pods_per, ctrs_per = len(pods), len(containers)
            if self.sync_chunk is not None and can_split:
                pods_per = min(pods_per, self.sync_chunk)
                ctrs_per = min(ctrs_per, self.sync_chunk)
            while True:
                more = len(pods) > pods_per or len(containers) > ctrs_per
                request = nri.SynchronizeRequest(
                    pods=pods[:pods_per], containers=containers[:ctrs_per]
                )
                if more:
                    request.more = True
                size = _envelope_size("Synchronize", request)
                if size > framing.TTRPC_MAX_DATA:
                    # The Go client refuses to send it (OversizedMessageErr); shrink and retry.
                    shrunk = _shrink(pods_per, ctrs_per, size) if can_split else None
                    if shrunk is None:
                        self._close(conn, "failed to synchronize plugin with split messages")
                        return False
                    pods_per, ctrs_per = shrunk
                    self._note(
                        "sync-split",
                        f"{size} bytes: {pods_per} pods, {ctrs_per} containers per message",
                        conn,
                    )
                    continue
                result = await self._call(
                    conn, "Synchronize", request, nri.SynchronizeResponse, deadline=deadline
                )
                if result.response is None:
                    self._close(
                        conn, f"failed to synchronize plugin: {result.outcome} {result.message}"
                    )
                    return False
                if not more:
                    break
                if result.response.update or result.response.more != more:
                    self._close(conn, "plugin does not handle split sync requests")
                    return False
                pods, containers = pods[pods_per:], containers[ctrs_per:]
                pods_per, ctrs_per = min(pods_per, len(pods)), min(ctrs_per, len(containers))
            # containerd syncPlugin: failures of the returned updates are only logged.
            self._apply_updates(result.response.update)
            return True

    async def _read_loop(self, conn: _Connection) -> None:
        parser = framing.MuxFrameParser()
        try:
            while True:
                try:
                    data = await conn.stream.receive(READ_CHUNK)
                except (anyio.EndOfStream, *_SEND_ERRORS):
                    break
                for conn_id, payload in parser.feed(data):
                    reader = conn.readers.get(conn_id)
                    if reader is None:
                        # nri mux.go reader: frames for conns nobody opened are dropped.
                        self._note("dropped-frame", f"conn {conn_id}, {len(payload)} bytes", conn)
                        continue
                    for message in reader.feed(payload):
                        await self._dispatch(conn, conn_id, message)
        except framing.FramingError as exc:
            self._note("violation", str(exc), conn)
            self._close(conn, f"protocol error: {exc}")
            return
        partial = parser.buffered or not all(r.idle for r in conn.readers.values())
        if partial and not conn.close_reason:  # our own hang-up may cut a message short
            self._note("violation", "the plugin closed the socket inside a frame", conn)
        self._close(conn, "plugin closed the connection")

    async def _dispatch(
        self, conn: _Connection, conn_id: int, message: framing.TtrpcMessage
    ) -> None:
        if conn_id == framing.PLUGIN_SERVICE_CONN:
            if message.type != framing.TYPE_RESPONSE:
                self._note(
                    "violation", f"message type {message.type} from the plugin on conn 1", conn
                )
                return
            pending = conn.pending.get(message.stream_id)
            if pending is None or pending.done.is_set():
                # ttrpc client.go: "received message on inactive stream", dropped.
                self._note("stray-response", f"stream {message.stream_id}", conn)
                return
            pending.reply = message.data
            pending.oversized = message.oversized
            pending.done.set()
            return
        await self._serve_request(conn, message)

    # --- ttrpc server on conn 2 -------------------------------------------------------------

    async def _reply(
        self, conn: _Connection, stream_id: int, payload: bytes = b"", code: int = 0, text: str = ""
    ) -> None:
        message = framing.response_message(stream_id, payload, code=code, message=text)
        with suppress(*_SEND_ERRORS):
            await conn.send(framing.RUNTIME_SERVICE_CONN, message)

    async def _serve_request(self, conn: _Connection, message: framing.TtrpcMessage) -> None:
        stream_id = message.stream_id
        if message.type != framing.TYPE_REQUEST:
            # ttrpc server.go ignores unknown types; a response or data frame is a plugin bug.
            self._note("violation", f"message type {message.type} from the plugin on conn 2", conn)
            return
        if stream_id % 2 == 0:
            self._note("violation", f"request on even stream id {stream_id}", conn)
            await self._reply(
                conn,
                stream_id,
                code=CODE_INVALID_ARGUMENT,
                text="StreamID must be odd for client initiated streams",
            )
            return
        if stream_id <= conn.last_request_id:
            self._note("violation", f"request stream id {stream_id} reused or decreasing", conn)
            await self._reply(
                conn,
                stream_id,
                code=CODE_INVALID_ARGUMENT,
                text="StreamID cannot be re-used and must increment",
            )
            return
        conn.last_request_id = stream_id
        if message.oversized:
            await self._reply(
                conn,
                stream_id,
                code=CODE_RESOURCE_EXHAUSTED,
                text=f"message length {message.oversized} exceed maximum message size of "
                f"{framing.TTRPC_MAX_DATA}",
            )
            return
        try:
            envelope = framing.decode_request(message.data)
        except DecodeError as exc:
            self._note("violation", f"request envelope does not parse: {exc}", conn)
            await self._reply(
                conn,
                stream_id,
                code=CODE_INVALID_ARGUMENT,
                text=f"unmarshal request error: {exc}",
            )
            return
        if envelope.service != RUNTIME_SERVICE:
            await self._reply(
                conn, stream_id, code=CODE_UNIMPLEMENTED, text=f"service {envelope.service}"
            )
            return
        if envelope.method == "RegisterPlugin":
            await self._register(conn, stream_id, envelope.payload)
        elif envelope.method == "UpdateContainers":
            # Served in the runtime's task group, not the connection's: like a Go handler
            # goroutine it outlives a closed connection (and then applies late, unanswered).
            self._tg.start_soon(self._update_containers, conn, stream_id, envelope.payload)
        else:
            await self._reply(
                conn, stream_id, code=CODE_UNIMPLEMENTED, text=f"method {envelope.method}"
            )

    async def _register(self, conn: _Connection, stream_id: int, payload: bytes) -> None:
        started = anyio.current_time()
        try:
            request = nri.RegisterPluginRequest.FromString(payload)
        except DecodeError as exc:
            self._note("violation", f"RegisterPluginRequest does not parse: {exc}", conn)
            await self._reply(conn, stream_id, code=CODE_UNKNOWN, text=str(exc))
            return
        error = self._check_registration(request)
        # The reply goes out before the handshake moves on, so a rejected plugin reads why.
        # (Go leaves a rejected connection open; the fake closes it right after the reply.)
        await self._reply(conn, stream_id, code=CODE_UNKNOWN if error else 0, text=error)
        if conn.registered.is_set():
            self._note("violation", "RegisterPlugin sent twice on one connection", conn)
        elif error:
            conn.registration_error = error
        else:
            conn.name = request.plugin_name
            conn.index = request.plugin_idx
            conn.plugin_nri_version = request.NRI_version
            self._note("registered", f"{request.plugin_idx}-{request.plugin_name}", conn)
        conn.registered.set()
        self.log.append(
            Call(
                caller="plugin",
                method="RegisterPlugin",
                stream_id=stream_id,
                request=request,
                response=None if error else nri.Empty(),
                code=CODE_UNKNOWN if error else 0,
                message=error,
                outcome="error" if error else "ok",
                seconds=anyio.current_time() - started,
                connection=conn.number,
            )
        )

    def _check_registration(self, request: nri.RegisterPluginRequest) -> str:
        """nri adaptation/plugin.go RegisterPlugin + pkg/api/plugin.go checks; "" if fine."""
        name, index = request.plugin_name, request.plugin_idx
        if not name:
            return "invalid plugin name: name is empty"
        if self._nri >= NRI_V0_12 and _PLUGIN_NAME.fullmatch(name) is None:
            return f"invalid plugin name: {name!r} contains invalid characters"
        if _PLUGIN_INDEX.fullmatch(index) is None:
            return f"invalid plugin index: {index!r} is not [0-9][0-9]"
        return ""

    async def _update_containers(self, conn: _Connection, stream_id: int, payload: bytes) -> None:
        started = anyio.current_time()
        try:
            request = nri.UpdateContainersRequest.FromString(payload)
        except DecodeError as exc:
            self._note("violation", f"UpdateContainersRequest does not parse: {exc}", conn)
            await self._reply(conn, stream_id, code=CODE_UNKNOWN, text=str(exc))
            return
        code, text = 0, ""
        if self.updates_while_busy == "refuse" and self._lock.locked():
            code, text = CODE_UNAVAILABLE, "runtime busy: a plugin request is in flight"
        elif self.updates_while_busy == "serve":
            code, text = self._apply_unsolicited(request)
        else:
            async with self._lock:  # containerd nri.go updateFromPlugin takes l.Lock()
                code, text = self._apply_unsolicited(request)
        # Logged before the reply is written (an await): whoever sees the table changed also
        # sees the call that changed it.
        self.log.append(
            Call(
                caller="plugin",
                method="UpdateContainers",
                stream_id=stream_id,
                request=request,
                response=None if code else nri.UpdateContainersResponse(),
                code=code,
                message=text,
                outcome="error" if code else "ok",
                seconds=anyio.current_time() - started,
                connection=conn.number,
            )
        )
        await self._reply(conn, stream_id, code=code, text=text)

    def _apply_unsolicited(self, request: nri.UpdateContainersRequest) -> tuple[int, str]:
        self._evict(request.evict)
        if self._apply_updates(request.update):
            # containerd returns the failed list AND an error; ttrpc then drops the payload.
            return CODE_UNKNOWN, UPDATE_FAILED
        return 0, ""

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
        await self._stop_all("runtime restart")
        await anyio.Path(self.socket_path).unlink(missing_ok=True)
        await anyio.sleep(downtime)
        await self._listen()


_FALLBACK_METHODS = frozenset(method for method, _req, _resp, _ctr in _DEDICATED.values())


def _adjusted(container: FakeContainer, adjust: nri.ContainerAdjustment) -> FakeContainer:
    """Apply a ContainerAdjustment's env, annotations and cpuset to a container."""
    env = dict(entry.partition("=")[::2] for entry in container.env)
    for pair in adjust.env:
        if pair.key.startswith("-"):
            env.pop(pair.key[1:], None)  # nri adjustment.go RemoveEnv: "-NAME" marks removal
        else:
            env[pair.key] = pair.value
    annotations = dict(container.annotations)
    for key, value in adjust.annotations.items():
        if key.startswith("-"):
            annotations.pop(key[1:], None)
        else:
            annotations[key] = value
    cpu = adjust.linux.resources.cpu
    return replace(
        container,
        env=tuple(f"{key}={value}" for key, value in env.items()),
        annotations=annotations,
        cpus=cpu.cpus or container.cpus,
        mems=cpu.mems or container.mems,
    )


def _envelope_size(method: str, request: Message) -> int:
    """Bytes of the ttrpc Request envelope (the data the 4 MiB limit applies to)."""
    message = framing.request_message(
        1, PLUGIN_SERVICE, method, request.SerializeToString(deterministic=True), 1
    )
    return len(message) - framing.TTRPC_HEADER_LEN


def _shrink(pods: int, containers: int, size: int) -> tuple[int, int] | None:
    """nri adaptation/plugin.go recalcObjsPerSyncMsg; None when it gives up."""
    if pods + containers <= MIN_SYNC_OBJECTS:
        return None
    factor = min(framing.TTRPC_MAX_DATA / size, SYNC_SHRINK_MAX)
    pods, containers = int(pods * factor), int(containers * factor)
    if pods + containers < MIN_SYNC_OBJECTS:
        pods = containers = MIN_SYNC_OBJECTS // 2
    return pods, containers


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
