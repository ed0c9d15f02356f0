"""A fake kubelet: plugin registration and DRA calls with grpcio, as the real kubelet does them.

One module, longer than most: it is one peer, whose registration, DRA calls and health watch
share the channels, the negotiated versions and the kubelet's checks of each answer.

The kubelet side of our gRPC boundary is played by an implementation that shares no code with
our server (docs/architecture.md, "How it is tested"). The kubelet is grpc-go; this is grpcio (an
independent gRPC stack) with Google-protobuf messages (:mod:`dracpu.sim._pb2`), method paths
written out literally, and the kubelet's rules (kubernetes/kubernetes ``pkg/kubelet``:
``pluginmanager``'s plugin watcher and ``operation_generator.go``, ``cm/dra/plugin``'s
``dra_plugin_manager.go`` and ``dra_plugin.go``, ``cm/dra/manager.go``):

- registration: find sockets in ``plugins_registry`` (sub-directories too; dot-files and
  non-sockets are ignored), call ``GetInfo`` with a 1 s deadline, check the plugin type
  (``DRAPlugin``), the name, the versions (the first entry of the PLUGIN's list that the kubelet
  supports wins; none or an empty list is an error), the endpoint (empty: the registration
  socket; it must be a socket we can connect to), then ``NotifyRegistrationStatus(true)``, or
  ``(false, why)`` before raising :class:`RegistrationRefused`;
- calls: ``NodePrepareResources`` / ``NodeUnprepareResources`` of the negotiated version (or the
  one asked for) with the kubelet's 45 s deadline; an answer that misses a claim or names a
  claim that was not asked is a :class:`KubeletCallError` (the kubelet fails the pod's
  preparation); a per-claim ``error`` is returned in :class:`PrepareResult`;
- device health (KEP-4680): :meth:`FakeKubelet.watch_health` opens ``NodeWatchResources`` as a
  kubelet of the 1.37 cycle does (``v1.DRAResourceHealth`` if the plugin advertised it, else
  ``v1alpha1``; none advertised: no stream), without a deadline, and hands over every list the
  plugin sends (:class:`HealthWatch`);
- PodResources: :attr:`FakeKubelet.pods` holds the pods the simulation runs and the kubelet's
  claim cache (every claim a successful Prepare answered, until its Unprepare);
  :meth:`FakeKubelet.serve_pod_resources` serves them on the PodResources socket
  (:mod:`dracpu.sim.fake_podresources`).

The calls are synchronous grpcio calls; ``a*`` methods run them in a worker thread
(``anyio.to_thread``) so async tests and the simulator can drive the daemon on the same loop.
"""

from __future__ import annotations

import os
import queue
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import TracebackType
from typing import Any, Literal

import anyio.to_thread
import grpc

from dracpu.errors import DracpuError
from dracpu.sim._pb2.dra.v1 import api_pb2 as dra_v1
from dracpu.sim._pb2.dra.v1beta1 import api_pb2 as dra_v1beta1
from dracpu.sim._pb2.dra_health.v1 import api_pb2 as health_v1
from dracpu.sim._pb2.dra_health.v1alpha1 import api_pb2 as health_v1alpha1
from dracpu.sim._pb2.pluginregistration.v1 import api_pb2 as reg
from dracpu.sim.fake_podresources import CachedClaim, ClaimDevice, KubeletPods, PodResourcesServer

__all__ = [
    "CALL_TIMEOUT",
    "DIAL_TIMEOUT",
    "GET_INFO_TIMEOUT",
    "HEALTH_SERVICES",
    "KUBELET_SERVICES",
    "NOTIFY_TIMEOUT",
    "POD_RESOURCES_SOCKET",
    "ClaimRef",
    "Device",
    "DeviceHealthReport",
    "FakeKubelet",
    "FakeKubeletError",
    "HealthList",
    "HealthVersion",
    "HealthWatch",
    "KubeletCallError",
    "PrepareResult",
    "Registration",
    "RegistrationRefused",
    "Version",
]

Version = Literal["v1", "v1beta1"]
HealthVersion = Literal["v1", "v1alpha1"]

# What a 1.34+ kubelet supports, most recent first (pkg/kubelet/cm/dra/plugin/dra_plugin.go
# servicesSupportedByKubelet).
KUBELET_SERVICES = ("v1.DRAPlugin", "v1beta1.DRAPlugin")
# The health services a kubelet of the 1.37 cycle consumes, in its preference order
# (pkg/kubelet/cm/dra/plugin pickHealthService: v1 over v1alpha1, whatever the plugin's order).
HEALTH_SERVICES = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
# The registration handler type of DRA drivers (k8s.io/kubelet pluginregistration constants.go).
DRA_PLUGIN_TYPE = "DRAPlugin"
# Kubelet timeouts (seconds): GetInfo (operation_generator.go, 1 s), dialing the registration
# socket (dialTimeoutDuration), NotifyRegistrationStatus (notifyTimeoutDuration), each DRA call
# (dra_plugin.go defaultClientCallTimeout).
GET_INFO_TIMEOUT = 1.0
DIAL_TIMEOUT = 10.0
NOTIFY_TIMEOUT = 5.0
CALL_TIMEOUT = 45.0
# The PodResources socket under the kubelet's root (pkg/kubelet/apis/podresources: the directory
# pod-resources, the socket kubelet.sock).
POD_RESOURCES_SOCKET = Path("pod-resources") / "kubelet.sock"
# How often wait_for_socket looks at the registry directory (the kubelet uses fsnotify).
_POLL_INTERVAL = 0.02

_SERVICE_VERSION: dict[str, Version] = {"v1.DRAPlugin": "v1", "v1beta1.DRAPlugin": "v1beta1"}
_DraMethod = Literal["NodePrepareResources", "NodeUnprepareResources"]
# Wire method paths, exactly as grpc-go sends them (full proto service names).
_DRA_PATHS: dict[tuple[Version, _DraMethod], str] = {
    ("v1", "NodePrepareResources"): (
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources"
    ),
    ("v1beta1", "NodePrepareResources"): (
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources"
    ),
    ("v1", "NodeUnprepareResources"): (
        "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources"
    ),
    ("v1beta1", "NodeUnprepareResources"): (
        "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources"
    ),
}
_HEALTH_VERSION: dict[str, HealthVersion] = {
    "v1.DRAResourceHealth": "v1",
    "v1alpha1.DRAResourceHealth": "v1alpha1",
}
_HEALTH_PATHS: dict[HealthVersion, str] = {
    "v1": "/v1.DRAResourceHealth/NodeWatchResources",
    "v1alpha1": "/v1alpha1.DRAResourceHealth/NodeWatchResources",
}
_HEALTH_MESSAGES: dict[HealthVersion, Any] = {"v1": health_v1, "v1alpha1": health_v1alpha1}
_GET_INFO = "/pluginregistration.Registration/GetInfo"
_NOTIFY = "/pluginregistration.Registration/NotifyRegistrationStatus"
_MESSAGES: dict[Version, Any] = {"v1": dra_v1, "v1beta1": dra_v1beta1}


class FakeKubeletError(DracpuError):
    """The fake kubelet could not do what was asked."""


class RegistrationRefused(FakeKubeletError):
    """The plugin's registration was refused (the plugin was told, where possible)."""


class KubeletCallError(FakeKubeletError):
    """A DRA call failed as a whole: a gRPC error or an answer the kubelet rejects."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        """The gRPC status code name (``"UNIMPLEMENTED"``), ``None`` for a bad answer."""


@dataclass(frozen=True, slots=True)
class ClaimRef:
    """A claim reference as the kubelet sends it."""

    namespace: str
    uid: str
    name: str


@dataclass(frozen=True, slots=True)
class Device:
    """A prepared device as the kubelet stores it (``share_id``: v1 only, ``None`` if unset)."""

    request_names: tuple[str, ...]
    pool_name: str
    device_name: str
    cdi_device_ids: tuple[str, ...]
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PrepareResult:
    """One claim's answer: its devices, or a non-empty ``error``."""

    devices: tuple[Device, ...] = ()
    error: str = ""


@dataclass(frozen=True, slots=True)
class Registration:
    """A registered DRA driver instance."""

    driver: str
    endpoint: Path
    registration_socket: Path
    supported_versions: tuple[str, ...]
    version: Version
    """The version the kubelet talks by default (the first of the plugin's list it knows)."""
    health_version: HealthVersion | None = None
    """The health service the kubelet watches (``None``: the plugin advertised none)."""


@dataclass(frozen=True, slots=True)
class DeviceHealthReport:
    """One device of a health list, as the plugin sent it (``health``: the proto enum's name,
    ``"HEALTHY"``, ``"UNHEALTHY"`` or ``"UNKNOWN"``)."""

    pool_name: str
    device_name: str
    health: str
    last_updated_time: int
    health_check_timeout_seconds: int
    message: str


@dataclass(frozen=True, slots=True)
class HealthList:
    """One ``NodeWatchResourcesResponse``: its devices in order, and when it arrived
    (``time.monotonic()``)."""

    devices: tuple[DeviceHealthReport, ...]
    received: float

    def health(self) -> dict[str, str]:
        """``{device name: health}``."""
        return {device.device_name: device.health for device in self.devices}

    def unhealthy(self) -> dict[str, str]:
        """``{device name: message}`` of the devices reported UNHEALTHY."""
        return {d.device_name: d.message for d in self.devices if d.health == "UNHEALTHY"}


@dataclass(frozen=True, slots=True)
class _StreamEnd:
    code: str  # the gRPC status code name, "OK" for a clean end
    details: str


class HealthWatch:
    """One ``NodeWatchResources`` call, open until :meth:`close` (or the plugin ends it).

    A thread reads the stream into a queue as the lists arrive, so waiting for the next one can
    time out without losing any. A context manager; thread-safe for one reader.
    """

    def __init__(self, channel: Any, version: HealthVersion) -> None:
        pb = _HEALTH_MESSAGES[version]
        watch = channel.unary_stream(
            _HEALTH_PATHS[version],
            request_serializer=pb.NodeWatchResourcesRequest.SerializeToString,
            response_deserializer=pb.NodeWatchResourcesResponse.FromString,
        )
        self.version: HealthVersion = version
        self._call = watch(pb.NodeWatchResourcesRequest())  # no deadline, as the kubelet's
        self._lists: queue.Queue[HealthList | _StreamEnd] = queue.Queue()
        self._end: _StreamEnd | None = None
        self._reader = threading.Thread(
            target=self._read, name=f"fake-kubelet-health-{version}", daemon=True
        )
        self._reader.start()

    def _read(self) -> None:
        pb = _HEALTH_MESSAGES[self.version]
        try:
            for response in self._call:
                devices = tuple(
                    DeviceHealthReport(
                        pool_name=d.device.pool_name,
                        device_name=d.device.device_name,
                        health=pb.HealthStatus.Name(d.health),
                        last_updated_time=d.last_updated_time,
                        health_check_timeout_seconds=d.health_check_timeout_seconds,
                        message=d.message,
                    )
                    for d in response.devices
                )
                self._lists.put(HealthList(devices, time.monotonic()))
        except grpc.RpcError as exc:
            self._lists.put(_StreamEnd(_code(exc), _details(exc)))
        else:
            self._lists.put(_StreamEnd("OK", ""))

    def next(self, timeout: float = 10.0) -> HealthList | None:
        """The next list the plugin sends; ``None`` once the plugin has ended the call with OK.

        Raises :class:`KubeletCallError` (with the code) when the call ended otherwise, and
        :class:`FakeKubeletError` when nothing came within ``timeout`` seconds.
        """
        if self._end is None:
            try:
                item = self._lists.get(timeout=timeout)
            except queue.Empty:
                raise FakeKubeletError(f"no health list within {timeout:g} s") from None
            if isinstance(item, HealthList):
                return item
            self._end = item
        if self._end.code == "OK":
            return None
        raise KubeletCallError(
            f"NodeWatchResources: {self._end.code}: {self._end.details}", code=self._end.code
        )

    async def anext(self, within: float = 10.0) -> HealthList | None:
        """:meth:`next` (``timeout=within``) in a worker thread."""
        return await anyio.to_thread.run_sync(self.next, within)

    async def until(self, done: Callable[[HealthList], bool], within: float = 10.0) -> HealthList:
        """The first list from now on for which ``done`` holds, read for at most ``within``
        seconds; :class:`FakeKubeletError` when none came or the plugin ended the call."""
        deadline = time.monotonic() + within
        while (left := deadline - time.monotonic()) > 0:
            try:
                health = await self.anext(left)
            except FakeKubeletError:
                break
            if health is None:
                raise FakeKubeletError("the plugin ended the health stream")
            if done(health):
                return health
        raise FakeKubeletError(f"no such health list within {within:g} s")

    def close(self) -> None:
        """Cancel the call (what the kubelet does when the plugin deregisters)."""
        self._call.cancel()
        self._reader.join(timeout=10.0)

    def __enter__(self) -> HealthWatch:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _target(path: Path) -> str:
    return f"unix:{path.absolute()}"


def _code(error: grpc.RpcError) -> str:
    code = error.code() if hasattr(error, "code") else None
    return getattr(code, "name", "UNKNOWN")


def _details(error: grpc.RpcError) -> str:
    details = error.details() if hasattr(error, "details") else None
    return str(details or error)


class FakeKubelet:
    """Registers DRA plugins found in ``registry_dir`` and calls them.

    Thread-safe: calls may run concurrently from several threads. Close it (or use it as a
    context manager) to close the gRPC channels.
    """

    def __init__(
        self,
        registry_dir: Path,
        *,
        services: Sequence[str] = KUBELET_SERVICES,
        health_services: Sequence[str] = HEALTH_SERVICES,
        get_info_timeout: float = GET_INFO_TIMEOUT,
        dial_timeout: float = DIAL_TIMEOUT,
        call_timeout: float = CALL_TIMEOUT,
    ) -> None:
        self.registry_dir = registry_dir
        self.services = tuple(services)
        self.health_services = tuple(health_services)
        self.get_info_timeout = get_info_timeout
        self.dial_timeout = dial_timeout
        self.call_timeout = call_timeout
        self._lock = threading.Lock()
        self._registrations: dict[str, Registration] = {}
        self._channels: dict[str, Any] = {}  # driver -> grpc.Channel to its endpoint
        self.pods = KubeletPods()
        self.pod_resources: PodResourcesServer | None = None
        # What the kubelet did, in order: (time.monotonic(), what), e.g. "registered dra.cpu".
        self.record: list[tuple[float, str]] = []

    # --- lifecycle -------------------------------------------------------------------------

    def close(self) -> None:
        """Close every channel; registrations are forgotten; the PodResources socket goes."""
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
            self._registrations.clear()
        for channel in channels:
            channel.close()
        if self.pod_resources is not None:
            self.pod_resources.stop()

    def serve_pod_resources(self, socket: Path | None = None) -> PodResourcesServer:
        """Serve PodResources on ``socket`` (default ``<kubelet root>/pod-resources/kubelet.sock``,
        the kubelet root being the registry directory's parent) from :attr:`pods`."""
        if self.pod_resources is None:
            path = self.registry_dir.parent / POD_RESOURCES_SOCKET if socket is None else socket
            self.pod_resources = PodResourcesServer(path, self.pods)
        self.pod_resources.start()
        return self.pod_resources

    def __enter__(self) -> FakeKubelet:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # --- discovery -------------------------------------------------------------------------

    def sockets(self) -> list[Path]:
        """The sockets in the registry directory and below, as the plugin watcher sees them."""
        found: list[Path] = []
        if not self.registry_dir.is_dir():
            return found
        for root, dirs, files in os.walk(self.registry_dir):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for name in sorted(files):
                path = Path(root) / name
                if name.startswith("."):
                    continue
                try:
                    if stat.S_ISSOCK(path.lstat().st_mode):
                        found.append(path)
                except FileNotFoundError:
                    continue
        return found

    def wait_for_socket(self, timeout: float = 10.0) -> Path:
        """The first socket to appear in the registry directory (polling)."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.sockets()
            if found:
                return found[0]
            if time.monotonic() >= deadline:
                raise FakeKubeletError(
                    f"no plugin socket appeared in {self.registry_dir} within {timeout:g} s"
                )
            time.sleep(_POLL_INTERVAL)

    # --- registration ----------------------------------------------------------------------

    def register(self, socket_path: Path | None = None) -> Registration:
        """Register the plugin behind ``socket_path`` (default: the only socket found).

        Raises :class:`RegistrationRefused` (after telling the plugin) when its answer is not
        acceptable, :class:`FakeKubeletError` when the registration socket cannot be called.
        """
        if socket_path is None:
            found = self.sockets()
            if len(found) != 1:
                raise FakeKubeletError(
                    f"expected one plugin socket in {self.registry_dir}, found {len(found)}"
                )
            socket_path = found[0]
        with grpc.insecure_channel(_target(socket_path)) as channel:
            try:
                grpc.channel_ready_future(channel).result(timeout=self.dial_timeout)
            except grpc.FutureTimeoutError as exc:
                raise FakeKubeletError(f"cannot connect to {socket_path}") from exc
            get_info = channel.unary_unary(
                _GET_INFO,
                request_serializer=reg.InfoRequest.SerializeToString,
                response_deserializer=reg.PluginInfo.FromString,
            )
            try:
                info = get_info(reg.InfoRequest(), timeout=self.get_info_timeout)
            except grpc.RpcError as exc:
                raise FakeKubeletError(
                    f"GetInfo on {socket_path} failed: {_code(exc)}: {_details(exc)}"
                ) from exc
            try:
                registration = self._validate(socket_path, info)
            except RegistrationRefused as exc:
                self._notify(channel, False, str(exc))
                raise
            self._notify(channel, True, "")
        with self._lock:
            self.record.append((time.monotonic(), f"registered {registration.driver}"))
        return registration

    def _validate(self, socket_path: Path, info: reg.PluginInfo) -> Registration:
        """The kubelet's checks (``operation_generator.go``, ``dra_plugin_manager.go``
        ``validateSupportedServices``); connects to the endpoint."""
        if info.type != DRA_PLUGIN_TYPE:
            raise RegistrationRefused(f"no handler registered for plugin type: {info.type}")
        if not info.name:
            raise RegistrationRefused("plugin name is empty")
        versions = tuple(info.supported_versions)
        if not versions:
            raise RegistrationRefused(
                "empty list of supported gRPC services (aka supported versions)"
            )
        chosen = next((v for v in versions if v in self.services), None)
        if chosen is None:
            raise RegistrationRefused(
                f"none of services supported by the plugin {list(versions)} are supported by "
                f"the kubelet {list(self.services)}"
            )
        endpoint = Path(info.endpoint) if info.endpoint else socket_path
        try:
            is_socket = stat.S_ISSOCK(endpoint.stat().st_mode)
        except OSError:
            is_socket = False
        if not is_socket:
            raise RegistrationRefused(f"endpoint {endpoint} of {info.name} is not a socket")
        channel = grpc.insecure_channel(_target(endpoint))
        try:
            grpc.channel_ready_future(channel).result(timeout=self.dial_timeout)
        except grpc.FutureTimeoutError:
            channel.close()
            raise RegistrationRefused(f"cannot connect to endpoint {endpoint}") from None
        health = next((h for h in self.health_services if h in versions), None)
        registration = Registration(
            driver=info.name,
            endpoint=endpoint,
            registration_socket=socket_path,
            supported_versions=versions,
            version=_SERVICE_VERSION[chosen],
            health_version=None if health is None else _HEALTH_VERSION[health],
        )
        with self._lock:
            old = self._channels.pop(info.name, None)
            self._channels[info.name] = channel
            self._registrations[info.name] = registration
        if old is not None:  # "an updated version of plugin has been found": replace it
            old.close()
        return registration

    def _notify(self, channel: Any, registered: bool, error: str) -> None:
        notify = channel.unary_unary(
            _NOTIFY,
            request_serializer=reg.RegistrationStatus.SerializeToString,
            response_deserializer=reg.RegistrationStatusResponse.FromString,
        )
        try:
            notify(
                reg.RegistrationStatus(plugin_registered=registered, error=error),
                timeout=NOTIFY_TIMEOUT,
            )
        except grpc.RpcError as exc:
            if registered:
                raise FakeKubeletError(
                    f"NotifyRegistrationStatus failed: {_code(exc)}: {_details(exc)}"
                ) from exc
            # A refused plugin that does not take the news changes nothing.

    def registrations(self) -> dict[str, Registration]:
        """The registered drivers by name."""
        with self._lock:
            return dict(self._registrations)

    def _driver(self, driver: str | None) -> tuple[Registration, Any]:
        with self._lock:
            if driver is None:
                if len(self._registrations) != 1:
                    raise FakeKubeletError(
                        f"name the driver: {len(self._registrations)} are registered"
                    )
                driver = next(iter(self._registrations))
            registration = self._registrations.get(driver)
            channel = self._channels.get(driver)
        if registration is None or channel is None:
            raise FakeKubeletError(f"DRA driver {driver} is not registered")
        return registration, channel

    # --- DRA calls -------------------------------------------------------------------------

    def prepare(
        self,
        claims: Sequence[ClaimRef],
        *,
        driver: str | None = None,
        version: Version | None = None,
        call_timeout: float | None = None,
    ) -> dict[str, PrepareResult]:
        """``NodePrepareResources`` for ``claims``: the answer per claim UID."""
        ver, response = self._dra_call(
            "NodePrepareResources", claims, driver, version, call_timeout
        )
        registration, _ = self._driver(driver)
        refs = {c.uid: c for c in claims}
        results: dict[str, PrepareResult] = {}
        for uid, entry in response.claims.items():
            devices = tuple(
                Device(
                    request_names=tuple(d.request_names),
                    pool_name=d.pool_name,
                    device_name=d.device_name,
                    cdi_device_ids=tuple(d.cdi_device_ids),
                    share_id=d.share_id if ver == "v1" and d.HasField("share_id") else None,
                )
                for d in entry.devices
            )
            results[uid] = PrepareResult(devices=devices, error=entry.error)
            if not entry.error:  # the kubelet caches what a driver prepared (its claim info)
                ref = refs[uid]
                self.pods.claim_prepared(
                    CachedClaim(
                        ref.namespace,
                        ref.name,
                        uid,
                        registration.driver,
                        tuple(
                            ClaimDevice(d.pool_name, d.device_name, d.cdi_device_ids, d.share_id)
                            for d in devices
                        ),
                    )
                )
        return results

    def unprepare(
        self,
        claims: Sequence[ClaimRef],
        *,
        driver: str | None = None,
        version: Version | None = None,
        call_timeout: float | None = None,
    ) -> dict[str, str]:
        """``NodeUnprepareResources`` for ``claims``: the error per claim UID (``""``: done)."""
        _, response = self._dra_call(
            "NodeUnprepareResources", claims, driver, version, call_timeout
        )
        for uid, entry in response.claims.items():
            if not entry.error:
                self.pods.claim_unprepared(uid)
        return {uid: entry.error for uid, entry in response.claims.items()}

    def _dra_call(
        self,
        method: _DraMethod,
        claims: Sequence[ClaimRef],
        driver: str | None,
        version: Version | None,
        call_timeout: float | None,
    ) -> tuple[Version, Any]:
        """One DRA call for ``claims`` in the negotiated (or asked) version; the version and the
        answer, whose claim UIDs the kubelet's checks accepted."""
        registration, channel = self._driver(driver)
        ver = version or registration.version
        pb = _MESSAGES[ver]
        request_type = getattr(pb, f"{method}Request")
        response_type = getattr(pb, f"{method}Response")
        call = channel.unary_unary(
            _DRA_PATHS[ver, method],
            request_serializer=request_type.SerializeToString,
            response_deserializer=response_type.FromString,
        )
        request = request_type(
            claims=[pb.Claim(namespace=c.namespace, uid=c.uid, name=c.name) for c in claims]
        )
        try:
            wait = self.call_timeout if call_timeout is None else call_timeout
            response = call(request, timeout=wait)
        except grpc.RpcError as exc:
            raise KubeletCallError(
                f"{method}: {_code(exc)}: {_details(exc)}", code=_code(exc)
            ) from exc
        self._check_keys(method, claims, response.claims.keys())
        return ver, response

    @staticmethod
    def _check_keys(what: str, claims: Sequence[ClaimRef], keys: Any) -> None:
        """The kubelet's checks of an answer map (pkg/kubelet/cm/dra/manager.go)."""
        asked = {c.uid for c in claims}
        unknown = sorted(set(keys) - asked)
        if unknown:
            raise KubeletCallError(f"{what} returned result for unknown claim UID {unknown[0]}")
        missing = len(asked) - len(set(keys))
        if missing > 0:
            raise KubeletCallError(f"{what} skipped {missing} ResourceClaims")

    # --- device health ---------------------------------------------------------------------

    def watch_health(
        self, *, driver: str | None = None, version: HealthVersion | None = None
    ) -> HealthWatch:
        """Open ``NodeWatchResources`` in the version the registration chose (or ``version``);
        :class:`FakeKubeletError` when the plugin advertised no health service."""
        registration, channel = self._driver(driver)
        chosen = version or registration.health_version
        if chosen is None:
            raise FakeKubeletError(
                f"DRA driver {registration.driver} advertised no health service: "
                f"{list(registration.supported_versions)}"
            )
        return HealthWatch(channel, chosen)

    # --- async wrappers --------------------------------------------------------------------

    async def aregister(self, socket_path: Path | None = None) -> Registration:
        """:meth:`register` in a worker thread."""
        return await anyio.to_thread.run_sync(self.register, socket_path)

    async def await_socket(self, within: float = 10.0) -> Path:
        """:meth:`wait_for_socket` in a worker thread."""
        return await anyio.to_thread.run_sync(self.wait_for_socket, within)

    async def aprepare(
        self,
        claims: Sequence[ClaimRef],
        *,
        driver: str | None = None,
        version: Version | None = None,
        call_timeout: float | None = None,
    ) -> dict[str, PrepareResult]:
        """:meth:`prepare` in a worker thread."""
        call = partial(
            self.prepare, claims, driver=driver, version=version, call_timeout=call_timeout
        )
        return await anyio.to_thread.run_sync(call)

    async def aunprepare(
        self,
        claims: Sequence[ClaimRef],
        *,
        driver: str | None = None,
        version: Version | None = None,
        call_timeout: float | None = None,
    ) -> dict[str, str]:
        """:meth:`unprepare` in a worker thread."""
        call = partial(
            self.unprepare, claims, driver=driver, version=version, call_timeout=call_timeout
        )
        return await anyio.to_thread.run_sync(call)
