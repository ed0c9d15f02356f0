"""The fake NRI runtime's facts and values: what containerd / CRI-O and NRI do by version, the
pods and containers of its table, the log of what it saw, and one plugin connection.

Shared by the parts of :class:`~dracpu.sim.fake_runtime.FakeRuntime` (see that module), which
shares no code with the daemon.
"""

from __future__ import annotations

import abc
import logging
import re
import socket
from collections.abc import Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Generic, Literal, TypeVar

import anyio
import anyio.abc
from google.protobuf.message import Message

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
    "FakeRuntimeError",
    "LogEntry",
    "Note",
    "Outcome",
    "PluginFailedError",
    "PluginInfo",
    "RuntimeBase",
    "UpdatesWhileBusy",
    "claim_env",
    "event_bit",
    "nri_version_for",
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
# containerd internal/nri: the error of an UpdateContainers that failed for some containers
UPDATE_FAILED = "NRI update of some containers failed"
CDI_ENV_PREFIX = "DRA_CPUSET_"  # the CDI env var of a CPU claim (dra-driver-cpu's format)
READ_CHUNK = 65536  # bytes per socket read; any size works, the mux parser reassembles
STOP_TIMEOUT = 5.0  # seconds the runtime waits for its connections to end when it stops
OVERSIZED_WRITE_CHUNK = 65536  # send_oversized_frame writes its payload in pieces this big
OVERSIZED_WRITE_TIMEOUT = 10.0  # seconds send_oversized_frame may block on a plugin not reading
CODE_CANCELLED = 1  # google.rpc.Code: a request whose context was cancelled
CODE_UNKNOWN = 2  # google.rpc.Code: what Go's ttrpc sends for a plain Go error
CODE_INVALID_ARGUMENT = 3  # google.rpc.Code
CODE_RESOURCE_EXHAUSTED = 8  # google.rpc.Code (ttrpc channel.go, oversized message)
CODE_UNIMPLEMENTED = 12  # google.rpc.Code (ttrpc services.go, unknown service/method)
CODE_UNAVAILABLE = 14  # google.rpc.Code (our "refuse" policy for UpdateContainers)

# NRI versions that changed what the runtime sends (containerd/nri release notes).
NRI_V0_7 = (0, 7, 0)  # ConfigureRequest timeouts, split Synchronize (more)
NRI_V0_10 = (0, 10, 0)  # events 12-14 (valid mask 0x3FFF), UpdatePodSandbox
NRI_V0_12 = (0, 12, 0)  # dedicated RPCs instead of StateChange, NRI_version, name charset

# containerd release -> embedded NRI (containerd go.mod; nri pkg/api/version.go runtimeVersionMap).
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
# CRI-O minor release -> embedded NRI (CRI-O go.mod and nri version.go).
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
    """A container in the runtime's table; ``cpus``/``mems`` are the cpuset as last applied.

    ``starting``: containerd's ``StartContainer`` has created the container's task (runc made
    its cgroup from the spec as it was then) and not yet marked it RUNNING: an update now
    rewrites only the spec, which nothing reads again, so it is lost
    (:meth:`~dracpu.sim.runtime_table.ContainerTable.create_task`).
    """

    id: str
    pod_id: str
    name: str
    env: tuple[str, ...] = ()
    state: int = nri.CONTAINER_UNKNOWN
    cpus: str = ""
    mems: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    annotations: Mapping[str, str] = field(default_factory=dict)
    starting: bool = False

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
    ended: float = 0.0  # time.monotonic() when the call was answered (orders it against peers)


@dataclass(frozen=True, slots=True)
class Note:
    """Something that happened on the socket other than a call.

    Kinds: ``listening``, ``connected``, ``registered``, ``ready``, ``closed`` (the runtime
    closed the plugin: detail says why), ``disconnected``, ``violation`` (the plugin broke the
    protocol), ``dropped-frame``, ``stray-response``, ``garbage``, ``oversized-frame``,
    ``restart``, ``sync-split``, ``update-failed``, ``update-lost`` (an update of a container
    that was starting: containerd drops it, :attr:`FakeContainer.starting`), ``evicted``.
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


class RuntimeBase(abc.ABC):
    """What the parts of the fake runtime share: its settings, table, log and connections
    (set up by :class:`~dracpu.sim.fake_runtime.FakeRuntime`), and the methods one part calls
    on another (:mod:`~dracpu.sim.runtime_table`, :mod:`~dracpu.sim.runtime_server`,
    :mod:`~dracpu.sim.runtime_faults`)."""

    socket_path: Path
    runtime_name: str
    runtime_version: str
    nri_version: str
    _nri: tuple[int, int, int]
    plugin_timeout: float
    registration_timeout: float
    sync_chunk: int | None
    updates_while_busy: UpdatesWhileBusy
    strict_framing: bool
    config: str
    pods: dict[str, FakePod]
    containers: dict[str, FakeContainer]
    evictions: list[tuple[str, str]]
    log: list[LogEntry]
    connections: int
    _tg: anyio.abc.TaskGroup
    _lock: anyio.Lock
    _conn: _Connection | None
    _changed: anyio.Event
    _listener: anyio.abc.SocketListener | None
    _accept_stopped: anyio.Event
    _live: set[_Connection]
    _ids: int

    @property
    def valid_events(self) -> int:
        """The event mask this runtime's NRI version accepts."""
        return VALID_EVENTS_V010 if self._nri >= NRI_V0_10 else VALID_EVENTS_BEFORE_V010

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

    # Declared here, implemented by the parts: FakeRuntime combines them, and abc refuses to
    # build a runtime that lacks one.

    @abc.abstractmethod
    def _close(self, conn: _Connection, reason: str) -> None:
        """Close a plugin connection, noting why (:mod:`~dracpu.sim.runtime_server`)."""

    @abc.abstractmethod
    async def _call(
        self,
        conn: _Connection,
        method: str,
        request: Message,
        response_type: type[M],
        *,
        deadline: float,
    ) -> _Result[M]:
        """Call the plugin under ``deadline`` (:mod:`~dracpu.sim.runtime_server`)."""

    @abc.abstractmethod
    async def _listen(self) -> None:
        """Accept plugin connections until stopped (:mod:`~dracpu.sim.runtime_server`)."""

    @abc.abstractmethod
    def _apply_updates(
        self, updates: Sequence[nri.ContainerUpdate], *, skip: str = ""
    ) -> list[nri.ContainerUpdate]:
        """Apply container updates to the table; return those that failed
        (:mod:`~dracpu.sim.runtime_table`)."""

    @abc.abstractmethod
    def _evict(self, evictions: Sequence[nri.ContainerEviction]) -> None:
        """Evict containers from the table (:mod:`~dracpu.sim.runtime_table`)."""
