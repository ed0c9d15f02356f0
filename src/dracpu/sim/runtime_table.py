"""The fake runtime's container table and the lifecycle events it relays to the plugin:
create, start, update, stop, remove, pod sandboxes (what the kubelet asks containerd for)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import suppress
from dataclasses import replace

import anyio
import anyio.abc
from google.protobuf.message import Message

from dracpu.sim._pb2.nri.v1alpha1 import api_pb2 as nri
from dracpu.sim.runtime_model import (
    _DEDICATED,
    _EVENTS_SINCE_V010,
    _FALLBACK_METHODS,
    CODE_UNIMPLEMENTED,
    CODE_UNKNOWN,
    NRI_V0_10,
    NRI_V0_12,
    FakeContainer,
    FakePod,
    FakeRuntimeError,
    M,
    PluginFailedError,
    RuntimeBase,
    _adjusted,
    _Result,
)


class ContainerTable(RuntimeBase):
    """Pods and containers, and the events that change them (a part of FakeRuntime)."""

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
            if container.starting:
                # containerd internal/cri/server/container_update_resources.go: a container
                # that is not RUNNING gets only its spec rewritten ("new resource limit will be
                # applied when container start"), but its task already exists: lost, no error.
                self._note("update-lost", f"{container.id}: starting, not running yet")
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

    def create_task(self, container_id: str) -> None:
        """The first step of containerd's ``StartContainer`` (``internal/cri/server/
        container_start.go``): ``container.NewTask``, where runc creates the container's cgroup
        from its spec, outside the NRI lock. Until :meth:`start_container` marks it RUNNING (the
        status update after ``task.Start``), an update of it is lost. CRI-O creates the
        container with runc in ``CreateContainer`` and updates a created container with
        ``runc update`` (``server/nri-api.go``): nothing to do for it here."""
        container = self._container(container_id)
        if container.state != nri.CONTAINER_CREATED:
            raise FakeRuntimeError(f"container {container_id} is not created")
        if self.runtime_name != "cri-o":
            self.containers[container_id] = replace(container, starting=True)

    async def start_container(self, container_id: str) -> None:
        """StartContainer then PostStartContainer; the container becomes RUNNING (and takes
        updates again, after :meth:`create_task`)."""
        container = self._container(container_id)
        pod = self._pod(container.pod_id)
        async with self._lock:
            self._set_state(container_id, nri.CONTAINER_RUNNING)
            self.containers[container_id] = replace(self.containers[container_id], starting=False)
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
