"""The kubelet plugin-registration socket (``k8s.io/kubelet`` ``pkg/apis/pluginregistration/v1``).

Served by grpclib (:func:`dracpu.adapters.grpc_unix.open_grpc_server`) with the betterproto2
messages of ``dracpu._gen.pluginregistration.v1``. The kubelet's plugin watcher finds
``<kubelet-root>/plugins_registry/dra.cpu-reg.sock``, calls ``GetInfo`` (with a 1 s timeout),
validates the answer, connects to the DRA endpoint it names and reports the outcome with
``NotifyRegistrationStatus``. It repeats this whenever it restarts or the socket is re-created,
so ``GetInfo`` is answered from constant data, at once, any number of times.

The outcome drives readiness: a refused registration (``plugin_registered: false``) is logged as
an error and turns the readiness flag not ready with the kubelet's message (``/readyz`` fails);
a successful one logs it and turns the flag ready again.

Start order: the DRA socket must already be serving when this socket appears, because the
kubelet connects to the endpoint as soon as it has the answer (kubernetes
``pkg/kubelet/cm/dra/plugin``, the DRA plugin manager's registration handler).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import grpclib.const
import grpclib.server
from anyio import TASK_STATUS_IGNORED
from anyio.abc import TaskStatus

from dracpu import DRIVER_NAME
from dracpu._gen.pluginregistration import v1 as reg
from dracpu.adapters.grpc_unix import open_grpc_server, receive_request, with_stream_handlers

__all__ = [
    "PLUGIN_TYPE",
    "SUPPORTED_VERSIONS",
    "PluginInfo",
    "ReadinessSink",
    "Registrar",
    "RegistrationState",
    "run",
]

logger = logging.getLogger(__name__)

# k8s.io/kubelet pkg/apis/pluginregistration/v1 constants.go: the plugin type of DRA drivers.
PLUGIN_TYPE = "DRAPlugin"
# The services we offer on the DRA socket. The DRAPlugin versions come first, newest first: the
# kubelet takes the first entry of OUR list that it supports and ignores the strings it does
# not know (dra_plugin_manager.go validateSupportedServices), and 1.34+ kubelets know both. The
# strings are "<short version>.DRAPlugin" (k8s.io/kubelet pkg/apis/dra/{v1,v1beta1}/types.go
# DRAPluginService), not the proto service names. Then the device-health services
# (pkg/apis/dra-health/{v1,v1alpha1}/types.go DRAResourceHealthService): 1.36+ kubelets watch
# health only when one is listed (pickHealthService; from the 1.37 cycle on it picks v1 over
# v1alpha1 whatever the order), 1.34/1.35 kubelets watch v1alpha1 without looking at the list.
SUPPORTED_VERSIONS = (
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)


class ReadinessSink(Protocol):
    """Where the registration outcome goes (:class:`dracpu.tasks.http.ReadinessFlag` is one)."""

    def set_ready(self) -> None: ...

    def set_not_ready(self, reason: str) -> None: ...


@dataclass(frozen=True, slots=True)
class PluginInfo:
    """What ``GetInfo`` answers."""

    name: str
    endpoint: str
    supported_versions: tuple[str, ...] = SUPPORTED_VERSIONS
    type: str = PLUGIN_TYPE


class RegistrationState:
    """The last registration outcome the kubelet reported (read by tests and the simulator)."""

    def __init__(self) -> None:
        self.registered = False
        self.error = ""
        self.notifications = 0
        self._changed = anyio.Event()

    def record(self, registered: bool, error: str) -> None:
        self.registered, self.error = registered, error
        self.notifications += 1
        self._changed.set()
        self._changed = anyio.Event()

    async def wait_notified(self, count: int = 1) -> None:
        """Wait until the kubelet has reported at least ``count`` outcomes."""
        while self.notifications < count:
            await self._changed.wait()


class Registrar(reg.RegistrationBase):
    """The ``pluginregistration.Registration`` service (a grpclib servable)."""

    def __init__(
        self,
        info: PluginInfo,
        readiness: ReadinessSink | None = None,
        state: RegistrationState | None = None,
    ) -> None:
        self._info = reg.PluginInfo(
            type=info.type,
            name=info.name,
            endpoint=info.endpoint,
            supported_versions=list(info.supported_versions),
        )
        self._readiness = readiness
        self.state = RegistrationState() if state is None else state

    def __mapping__(self) -> dict[str, grpclib.const.Handler]:
        # Our stream handlers: a call without a request message is INVALID_ARGUMENT (the
        # generated glue would fail an assert: UNKNOWN).
        return with_stream_handlers(
            super().__mapping__(),
            {"GetInfo": self._get_info_call, "NotifyRegistrationStatus": self._notify_call},
        )

    async def _get_info_call(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        await stream.send_message(await self.get_info(await receive_request(stream)))

    async def _notify_call(self, stream: grpclib.server.Stream[Any, Any]) -> None:
        status = await receive_request(stream)
        await stream.send_message(await self.notify_registration_status(status))

    async def get_info(self, message: reg.InfoRequest) -> reg.PluginInfo:
        return self._info

    async def notify_registration_status(
        self, message: reg.RegistrationStatus
    ) -> reg.RegistrationStatusResponse:
        name = self._info.name
        # betterproto2 may keep a field of the wrong wire type as another Python type: only a
        # real true registers, only a string is a message.
        registered = message.plugin_registered is True
        reason = message.error if isinstance(message.error, str) else ""
        if registered:
            logger.info(
                "registered with the kubelet as DRA driver %s (endpoint %s)",
                name,
                self._info.endpoint,
                extra={"driver": name},
            )
            if self._readiness is not None:
                self._readiness.set_ready()
        else:
            error = reason or "no reason given"
            logger.error(
                "the kubelet refused to register DRA driver %s: %s",
                name,
                error,
                extra={"driver": name},
            )
            if self._readiness is not None:
                self._readiness.set_not_ready(f"kubelet registration failed: {error}")
        self.state.record(registered, reason)
        return reg.RegistrationStatusResponse()


async def run(
    socket_path: Path,
    endpoint: Path,
    readiness: ReadinessSink | None = None,
    *,
    driver_name: str = DRIVER_NAME,
    supported_versions: tuple[str, ...] = SUPPORTED_VERSIONS,
    state: RegistrationState | None = None,
    task_status: TaskStatus[RegistrationState] = TASK_STATUS_IGNORED,
) -> None:
    """Serve the registration socket at ``socket_path`` until cancelled.

    ``endpoint``: the DRA socket path the kubelet is told to call (already serving).
    ``readiness``: told about each registration outcome. ``task_status.started()`` gets the
    :class:`RegistrationState` once the socket is listening.

    Resource handling: the socket file is removed on exit.
    Error handling: a socket that cannot be made raises :class:`~dracpu.errors.DracpuError`
    before ``started``; the kubelet's calls never end the task.
    """
    registrar = Registrar(
        PluginInfo(name=driver_name, endpoint=str(endpoint), supported_versions=supported_versions),
        readiness,
        state,
    )
    async with open_grpc_server([registrar], socket_path):
        logger.info("registration socket %s is listening", socket_path)
        task_status.started(registrar.state)
        await anyio.sleep_forever()
