"""A whole simulated node around the REAL ``dracpu run`` process.

One module, longer than most: the start order of the peers and the parts the node plays
(scheduler, kubelet, runtime applying CDI) are one scenario API that every daemon test uses; the
daemon process itself is apart (:mod:`dracpu.sim.daemon_process`).

:func:`open_node_sim` starts, in this order:

1. the fake API server (:mod:`dracpu.sim.fake_apiserver`) with a Node object (its kubelet's
   version in its status), and its kubeconfig;
2. a fake sysfs tree of a named machine (:data:`dracpu.sim.topologies.FIXTURES`);
3. the fake container runtime listening on the NRI socket (:mod:`dracpu.sim.fake_runtime`),
   with any shared containers that "already run";
4. ``python -m dracpu run`` as a subprocess, pointed at all of the above and at a temporary
   kubelet root, CDI dir and state dir (logs: JSON lines in ``<root>/logs/daemon-<n>.log``);
5. the fake kubelet (:mod:`dracpu.sim.fake_kubelet`, grpcio): it serves its PodResources socket
   (the pods the simulation runs, the claims it prepared), finds the registration socket and
   registers the plugin; then ``/readyz`` must answer 200.

The :class:`NodeSim` it yields plays the rest of the cluster: the scheduler
(:meth:`NodeSim.allocate` picks a published device with enough free capacity and writes the
ResourceClaim with ``status.allocation``), the kubelet (:meth:`NodeSim.prepare`,
:meth:`NodeSim.unprepare`, :meth:`NodeSim.kubelet_restart`) and the runtime applying CDI
(:meth:`NodeSim.run_container` reads the claim's CDI spec file, as a runtime resolves
``dra.k8s.io/cpu=claim-<uid>``, and puts its env into the new container; the kubelet lists the
pod and its claims in PodResources until :meth:`NodeSim.remove_pod`). The daemon can be
stopped, killed and started again (:meth:`NodeSim.restart_daemon`) while the peers keep their
state, as on a real node::

    async with open_node_sim(topology="dual-socket-smt2") as sim:
        claim = sim.allocate("demo", cpus=4)
        answer = await sim.prepare(claim)
        pod, container = await sim.run_container("app", claims=[claim])
        assert sim.runtime.containers[container.id].cpus == sim.cdi_cpus(claim.uid)

Nothing here imports the daemon's code paths: the simulator talks to it only through its
sockets, files and HTTP port, like the real peers do.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence, Set
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import anyio.abc

from dracpu import DRIVER_NAME
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy
from dracpu.core.topology import Topology
from dracpu.sim.daemon_process import (
    READY_TIMEOUT,
    DaemonProcess,
    SimError,
    http_get,
    wait_until,
)
from dracpu.sim.fake_apiserver import FakeApiServer, build_resource_claim, open_fake_apiserver
from dracpu.sim.fake_kubelet import ClaimRef, FakeKubelet, PrepareResult, Registration
from dracpu.sim.fake_runtime import FakeContainer, FakePod, FakeRuntime, open_fake_runtime
from dracpu.sim.hotplug import set_offline
from dracpu.sim.topologies import MachineSpec, build_topology, fixture, write_sysfs

__all__ = [
    "CAPACITY_CPU",
    "DEFAULT_NODE_NAME",
    "DEFAULT_TOPOLOGY",
    "DaemonProcess",
    "NodeSim",
    "SimClaim",
    "SimError",
    "SimPaths",
    "http_get",
    "open_node_sim",
    "wait_until",
]

logger = logging.getLogger(__name__)

DEFAULT_TOPOLOGY = "dual-socket-smt2"  # the README demo's machine
DEFAULT_NODE_NAME = "sim-node"
CAPACITY_CPU = "dra.cpu/cpu"  # the capacity grouped devices publish (dra-driver-cpu's name)
# containerd 2.4 embeds NRI v0.12.2, which takes unsolicited UpdateContainers (containerd/nri#301):
# Unprepare then widens the shared containers at once.
DEFAULT_RUNTIME_VERSION = "2.4.0"
# The kubelet the Node reports (status.nodeInfo.kubeletVersion): one whose
# KubeletPodResourcesDynamicResources gate is on by default (1.34+), as the fake kubelet's
# PodResources socket behaves unless told otherwise.
DEFAULT_KUBELET_VERSION = "v1.35.0"
# CDI spec files of our kind: <cdi-dir>/dra.k8s.io-cpu_claim-<uid>.json.
_CDI_PREFIX = "dra.k8s.io-cpu_claim-"
_CDI_KIND = "dra.k8s.io/cpu"
# k8s.io/api resource/v1 PodResourceClaimAnnotation (set by the resourceclaim controller).
_POD_CLAIM_NAME = "resource.kubernetes.io/pod-claim-name"


@dataclass(frozen=True, slots=True)
class SimPaths:
    """Where the simulated node lives (all under one temporary directory)."""

    root: Path

    @property
    def host_root(self) -> Path:
        return self.root / "host"

    @property
    def kubelet_root(self) -> Path:
        return self.root / "kubelet"

    @property
    def registry_dir(self) -> Path:
        return self.kubelet_root / "plugins_registry"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @property
    def state_dir(self) -> Path:
        return self.root / "state"

    @property
    def checkpoint_slots(self) -> tuple[Path, Path]:
        """The checkpoint's two slot files, which the daemon overwrites in turn."""
        return self.state_dir / "checkpoint.json", self.state_dir / "checkpoint.1.json"

    @property
    def checkpoint(self) -> Path:
        """The slot holding the newest checkpoint: of the slots that parse as JSON, the one with
        the highest ``sequence`` (read here as plain JSON, not by the daemon's code); slot 0 when
        none does."""
        newest, newest_sequence = self.checkpoint_slots[0], -1
        for path in self.checkpoint_slots:
            try:
                doc = json.loads(path.read_bytes())
            except (OSError, ValueError):
                continue
            sequence = doc.get("sequence", 0) if isinstance(doc, dict) else None
            if type(sequence) is int and sequence > newest_sequence:
                newest, newest_sequence = path, sequence
        return newest

    @property
    def nri_socket(self) -> Path:
        return self.root / "nri" / "nri.sock"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def cdi_spec(self, claim_uid: str) -> Path:
        return self.cdi_dir / f"{_CDI_PREFIX}{claim_uid}.json"


@dataclass(slots=True)
class SimClaim:
    """A ResourceClaim the simulated scheduler allocated (or a test wrote)."""

    namespace: str
    name: str
    uid: str
    results: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ref(self) -> ClaimRef:
        """The reference the kubelet sends."""
        return ClaimRef(namespace=self.namespace, uid=self.uid, name=self.name)

    @property
    def devices(self) -> list[str]:
        return [str(r["device"]) for r in self.results]


class NodeSim:
    """The simulated node around one ``dracpu run`` process (see the module docstring)."""

    def __init__(
        self,
        *,
        paths: SimPaths,
        api: FakeApiServer,
        runtime: FakeRuntime,
        kubelet: FakeKubelet,
        spec: MachineSpec,
        topology_name: str,
        node_name: str,
        mode: CpuDeviceMode,
        daemon_args: Sequence[str],
    ) -> None:
        self.paths = paths
        self.api = api
        self.runtime = runtime
        self.kubelet = kubelet
        self.spec = spec
        self.topology_name = topology_name
        self.topology: Topology = build_topology(spec)
        self.node_name = node_name
        self.mode = mode
        self.daemon_args = list(daemon_args)
        self.daemons: list[DaemonProcess] = []
        self.registration: Registration | None = None
        self._consumed: dict[str, int] = {}  # grouped device -> CPUs the sim's claims consume
        self._taken: set[str] = set()  # individual devices the sim's claims hold
        self._claims: dict[str, SimClaim] = {}  # uid -> claims allocated by allocate()
        self._sandboxes: set[str] = set()  # pods run_container started a sandbox for

    # --- the daemon --------------------------------------------------------------------------

    @property
    def daemon(self) -> DaemonProcess:
        """The current (last started) daemon process."""
        if not self.daemons:
            raise SimError("no dracpu run process was started")
        return self.daemons[-1]

    def command(self) -> list[str]:
        """The ``dracpu run`` command line the simulator launches."""
        return [sys.executable, "-m", "dracpu", "run", *self.daemon_args]

    async def start_daemon(self, *, register: bool = True, wait_ready: bool = True) -> float:
        """Launch ``dracpu run``; with ``register`` let the fake kubelet register it; with
        ``wait_ready`` wait for ``/readyz`` 200. The seconds from launch to ready (or 0)."""
        if self.daemons and self.daemon.returncode is None:
            raise SimError(f"dracpu run is already running (pid {self.daemon.pid})")
        # A socket a killed daemon left behind is no sign of the new one: the kubelet's plugin
        # watcher registers a socket when it is created (fsnotify), which the new daemon does by
        # renaming a fresh socket over the path.
        stale = self._socket_inodes()
        daemon = await self._launch()
        if register:
            await self.register(stale)
        if not wait_ready:
            return 0.0
        return await daemon.wait_ready()

    async def start_successor(self) -> DaemonProcess:
        """A rolling update's new pod beside the running one (``maxSurge: 1``): a second
        ``dracpu run`` on the same node, returned once it answers ``/readyz`` 200 as the
        standby; :attr:`daemon` is the new one from now on."""
        if not self.daemons or self.daemon.returncode is not None:
            raise SimError("no running dracpu run to succeed")
        daemon = await self._launch()
        await daemon.wait_ready()
        return daemon

    async def _launch(self) -> DaemonProcess:
        self.paths.logs.mkdir(parents=True, exist_ok=True)
        log_path = self.paths.logs / f"daemon-{len(self.daemons) + 1}.log"
        log_file = log_path.open("wb")
        env = {
            k: v for k, v in os.environ.items() if k not in {"NODE_NAME", "HOST_ROOT", "KUBECONFIG"}
        }
        try:
            process = await anyio.open_process(
                self.command(), stdin=None, stdout=log_file, stderr=log_file, env=env
            )
        except BaseException:
            log_file.close()
            raise
        daemon = DaemonProcess(process, log_path, log_file)
        self.daemons.append(daemon)
        return daemon

    def _socket_inodes(self) -> set[int]:
        inodes: set[int] = set()
        for path in self.kubelet.sockets():
            with contextlib.suppress(FileNotFoundError):
                inodes.add(path.lstat().st_ino)
        return inodes

    async def register(self, stale: Set[int] = frozenset()) -> Registration:
        """The kubelet's plugin watcher: wait for a registration socket (not one of the
        ``stale`` inodes a killed daemon left), register it."""
        daemon = self.daemon
        await wait_until(
            "the registration socket",
            lambda: bool(self._socket_inodes() - stale),
            timeout=READY_TIMEOUT,
            failed=daemon.exited,
        )
        self.registration = await self.kubelet.aregister()
        return self.registration

    async def stop_daemon(self, signum: signal.Signals = signal.SIGTERM) -> int:
        """Stop the current daemon; its exit code."""
        return await self.daemon.stop(signum)

    async def restart_daemon(self, *, kill: bool = False, register: bool = True) -> float:
        """Stop (SIGTERM) or crash (SIGKILL) the daemon and start a new one; seconds to ready."""
        await (self.daemon.kill() if kill else self.daemon.stop())
        return await self.start_daemon(register=register)

    def sighup(self) -> None:
        """Send SIGHUP to the daemon: it reads its config file and the topology again."""
        self.daemon.process.send_signal(signal.SIGHUP)

    # --- the machine ---------------------------------------------------------------------------

    def set_offline(self, cpus: CpuSet) -> None:
        """CPU hotplug: exactly ``cpus`` are offline from now on in the node's sysfs
        (:func:`dracpu.sim.hotplug.set_offline`); :attr:`topology` follows."""
        self.spec = set_offline(self.spec, self.paths.host_root, cpus)
        self.topology = build_topology(self.spec)

    # --- the API server: slices and claims ---------------------------------------------------

    def slices(self) -> list[dict[str, Any]]:
        """Our ResourceSlices as the API server stores them."""
        return self.api.resource_slices(driver=DRIVER_NAME, node_name=self.node_name)

    def published(self) -> list[dict[str, Any]]:
        """Every device of our slices (the newest pool generation only)."""
        slices = self.slices()
        if not slices:
            return []
        newest = max(int(s["spec"]["pool"]["generation"]) for s in slices)
        return [
            device
            for s in slices
            if int(s["spec"]["pool"]["generation"]) == newest
            for device in s["spec"].get("devices") or []
        ]

    async def wait_published(self, timeout: float = 20.0) -> list[dict[str, Any]]:  # noqa: ASYNC109
        """Wait until the pool is complete (every slice of the newest generation is there)."""

        def complete() -> bool:
            slices = self.slices()
            if not slices:
                return False
            newest = max(int(s["spec"]["pool"]["generation"]) for s in slices)
            current = [s for s in slices if int(s["spec"]["pool"]["generation"]) == newest]
            return len(current) == int(current[0]["spec"]["pool"]["resourceSliceCount"])

        await wait_until("the ResourceSlices", complete, timeout=timeout, failed=self.daemon.exited)
        return self.published()

    def _capacity(self, device: Mapping[str, Any]) -> int | None:
        value = (device.get("capacity") or {}).get(CAPACITY_CPU, {}).get("value")
        return int(value) if isinstance(value, str) and value.isdigit() else None

    def free_capacity(self) -> dict[str, int]:
        """Grouped devices: CPUs not consumed by the claims this scheduler allocated."""
        free: dict[str, int] = {}
        for device in self.published():
            capacity = self._capacity(device)
            if capacity is not None:
                free[device["name"]] = capacity - self._consumed.get(device["name"], 0)
        return free

    def allocate(
        self,
        name: str,
        cpus: int,
        *,
        namespace: str = "default",
        device: str | None = None,
        request: str = "cpus",
        reserved_for: Iterable[FakePod] = (),
        configs: Sequence[Mapping[str, Any]] = (),
        pod_claim_name: str | None = None,
    ) -> SimClaim:
        """Play the scheduler: allocate ``cpus`` CPUs from the published devices and write the
        ResourceClaim (allocated, for this node). Grouped mode: the first device (or
        ``device``) with enough free capacity, ``consumedCapacity`` and a ``shareID``;
        individual mode: the first ``cpus`` free devices in published order. ``reserved_for``:
        the pods it is bound to (``status.reservedFor``; the scheduler reserves a claim for
        each pod it schedules with it, before the kubelet prepares it). ``configs``: the
        allocation's ``devices.config`` entries (``{"source", "requests", "opaque"}``).
        ``pod_claim_name``: the claim was made from a template, for the pod's claim of that
        name (the ``resource.kubernetes.io/pod-claim-name`` annotation)."""
        devices = self.published()
        if not devices:
            raise SimError("no device is published: the scheduler cannot allocate")
        grouped = any(self._capacity(d) is not None for d in devices)
        results: list[dict[str, Any]] = []
        if grouped:
            free = self.free_capacity()
            names = [device] if device is not None else list(free)
            chosen = next((n for n in names if free.get(n, 0) >= cpus), None)
            if chosen is None:
                raise SimError(f"no published device has {cpus} free CPUs: {free}")
            self._consumed[chosen] = self._consumed.get(chosen, 0) + cpus
            results.append(
                {
                    "request": request,
                    "driver": DRIVER_NAME,
                    "pool": self.node_name,
                    "device": chosen,
                    "shareID": str(uuid.uuid4()),
                    "consumedCapacity": {CAPACITY_CPU: str(cpus)},
                }
            )
        else:
            free_names = [d["name"] for d in devices if d["name"] not in self._taken]
            if len(free_names) < cpus:
                raise SimError(f"only {len(free_names)} devices are free, {cpus} asked")
            for chosen in free_names[:cpus]:
                self._taken.add(chosen)
                results.append(
                    {
                        "request": request,
                        "driver": DRIVER_NAME,
                        "pool": self.node_name,
                        "device": chosen,
                    }
                )
        annotations = {_POD_CLAIM_NAME: pod_claim_name} if pod_claim_name else None
        claim = self.write_claim(
            name,
            results,
            namespace=namespace,
            reserved_for=reserved_for,
            configs=configs,
            annotations=annotations,
        )
        self._claims[claim.uid] = claim
        return claim

    def write_claim(
        self,
        name: str,
        results: Sequence[Mapping[str, Any]],
        *,
        namespace: str = "default",
        uid: str | None = None,
        allocated: bool = True,
        reserved_for: Iterable[FakePod] = (),
        configs: Sequence[Mapping[str, Any]] = (),
        annotations: Mapping[str, str] | None = None,
    ) -> SimClaim:
        """Write a ResourceClaim with exactly these ``results`` and ``configs`` (tests of bad
        input); no capacity bookkeeping."""
        obj = build_resource_claim(
            namespace,
            name,
            results,
            uid=uid,
            configs=configs,
            node_name=self.node_name,
            allocated=allocated,
            reserved_for=[
                {"resource": "pods", "name": pod.name, "uid": pod.uid} for pod in reserved_for
            ],
            annotations=annotations,
        )
        stored = self.api.add_resource_claim(obj)
        return SimClaim(namespace, name, stored["metadata"]["uid"], [dict(r) for r in results])

    def deallocate(self, claim: SimClaim) -> None:
        """The claim's pods are gone: delete the claim and free what the scheduler gave it."""
        with contextlib.suppress(KeyError):
            self.api.delete_resource_claim(claim.namespace, claim.name)
        if self._claims.pop(claim.uid, None) is None:
            return
        for result in claim.results:
            name = str(result["device"])
            consumed = (result.get("consumedCapacity") or {}).get(CAPACITY_CPU)
            if consumed is not None:
                self._consumed[name] = self._consumed.get(name, 0) - int(consumed)
            else:
                self._taken.discard(name)

    def claim_status_cpusets(self, claim: SimClaim) -> list[str]:
        """The ``data.cpuset`` the daemon recorded in the claim's ``status.devices``."""
        obj = self.api.resource_claim(claim.namespace, claim.name)
        return [
            str((entry.get("data") or {}).get("cpuset"))
            for entry in (obj.get("status") or {}).get("devices") or []
            if entry.get("driver") == DRIVER_NAME
        ]

    # --- the kubelet -------------------------------------------------------------------------

    async def prepare(self, *claims: SimClaim | ClaimRef) -> dict[str, PrepareResult]:
        """``NodePrepareResources`` of these claims in one call; the answer per claim UID."""
        return await self.kubelet.aprepare([_ref(c) for c in claims])

    async def unprepare(self, *claims: SimClaim | ClaimRef) -> dict[str, str]:
        """``NodeUnprepareResources`` of these claims in one call; the error per claim UID."""
        return await self.kubelet.aunprepare([_ref(c) for c in claims])

    async def kubelet_restart(self) -> list[str]:
        """A restarting kubelet: it wipes the node's ResourceSlices and registers the plugin
        again. The names of the slices it deleted."""
        deleted = self.api.kubelet_restart(self.node_name)
        await self.register()
        return deleted

    # --- CDI, as the runtime reads it ----------------------------------------------------------

    def cdi_env(self, claim_uid: str) -> list[str]:
        """The env a runtime injects for ``dra.k8s.io/cpu=claim-<uid>``: read from the spec file
        (plain JSON, not dracpu's parser). Raises :class:`SimError` if there is no such device."""
        path = self.paths.cdi_spec(claim_uid)
        try:
            spec = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SimError(f"cannot read CDI spec {path}: {exc}") from exc
        if spec.get("kind") != _CDI_KIND:
            raise SimError(f"CDI spec {path} has kind {spec.get('kind')!r}")
        env: list[str] = list((spec.get("containerEdits") or {}).get("env") or [])
        for device in spec.get("devices") or []:
            if device.get("name") == f"claim-{claim_uid}":
                env.extend((device.get("containerEdits") or {}).get("env") or [])
                return env
        raise SimError(f"CDI spec {path} has no device claim-{claim_uid}")

    def cdi_cpus(self, claim_uid: str) -> str | None:
        """The cpuset in the claim's CDI spec (``DRA_CPUSET_<uid>``), ``None`` without a file
        (also one removed while it is read: a release in progress)."""
        try:
            env = self.cdi_env(claim_uid)
        except SimError as exc:
            if isinstance(exc.__cause__, FileNotFoundError):
                return None
            raise
        key = f"DRA_CPUSET_{claim_uid}="
        for entry in env:
            if entry.startswith(key):
                return entry[len(key) :]
        raise SimError(f"CDI spec of claim {claim_uid} has no {key.rstrip('=')} env")

    def cdi_claims(self) -> list[str]:
        """The claim UIDs of our CDI spec files."""
        if not self.paths.cdi_dir.is_dir():
            return []
        return sorted(
            p.name[len(_CDI_PREFIX) : -len(".json")]
            for p in self.paths.cdi_dir.iterdir()
            if p.name.startswith(_CDI_PREFIX) and p.name.endswith(".json")
        )

    # --- containers ------------------------------------------------------------------------------

    def shared_container(
        self, pod_name: str, name: str = "main", *, cpus: str = ""
    ) -> FakeContainer:
        """A container that runs already (before the daemon or unknown to it): in the table,
        not announced to the plugin (it learns of it at Synchronize)."""
        pod = self.runtime.add_pod(pod_name, namespace="default")
        self.kubelet.pods.add_pod("default", pod_name, {name: ()})
        return self.runtime.add_container(pod, name, cpus=cpus)

    async def run_container(
        self,
        pod_name: str,
        name: str = "main",
        *,
        claims: Iterable[SimClaim] = (),
        namespace: str = "default",
        pod: FakePod | None = None,
    ) -> tuple[FakePod, FakeContainer]:
        """Create and start a container through the runtime (NRI CreateContainer/Start), with
        the CDI env of ``claims`` injected as the runtime would, in a new pod ``pod_name`` (or
        in ``pod``, made with ``runtime.add_pod``: a pod a claim was reserved for, or one this
        method started a container in already: its next container). The reply's adjustment and
        updates are applied to the runtime's table. The kubelet lists the pod in PodResources,
        this container referencing ``claims`` beside the pod's earlier ones."""
        env: list[str] = []
        uids: list[str] = []
        for claim in claims:
            env.extend(self.cdi_env(claim.uid))
            uids.append(claim.uid)
        if pod is None:
            pod = self.runtime.add_pod(pod_name, namespace=namespace)
        listed = self.kubelet.pods.pods().get((pod.namespace, pod.name), {})
        self.kubelet.pods.add_pod(pod.namespace, pod.name, {**listed, name: uids})
        if pod.id not in self._sandboxes:
            self._sandboxes.add(pod.id)
            await self.runtime.run_pod_sandbox(pod)
        container = self.runtime.new_container(pod, name, env=env)
        await self.runtime.create_container(pod, container)
        await self.runtime.start_container(container.id)
        return pod, self.runtime.containers[container.id]

    async def remove_pod(self, pod: FakePod) -> None:
        """Stop and remove the pod's containers and the pod (NRI events); the kubelet no longer
        lists it (its claims stay prepared until :meth:`unprepare`)."""
        self.kubelet.pods.remove_pod(pod.namespace, pod.name)
        self._sandboxes.discard(pod.id)
        await self.runtime.stop_pod_sandbox(pod.id)
        await self.runtime.remove_pod_sandbox(pod.id)

    def cpus_of(self, container_id: str) -> str:
        """The cpuset the runtime last applied to a container."""
        return self.runtime.containers[container_id].cpus

    def shared_ids(self, *, exclude: Iterable[str] = ()) -> list[str]:
        """Ids of the runtime's containers without a ``DRA_CPUSET_`` env."""
        skip = set(exclude)
        return [
            cid
            for cid, c in sorted(self.runtime.containers.items())
            if cid not in skip and not any(e.startswith("DRA_CPUSET_") for e in c.env)
        ]


def _ref(claim: SimClaim | ClaimRef) -> ClaimRef:
    return claim.ref if isinstance(claim, SimClaim) else claim


def daemon_arguments(
    paths: SimPaths,
    kubeconfig: Path,
    *,
    node_name: str,
    mode: CpuDeviceMode,
    group_by: GroupBy,
    reserved: str,
    memory_pinning: bool,
    extra: Sequence[str],
) -> list[str]:
    """The ``dracpu run`` flags of a simulated node."""
    args = [
        f"--node-name={node_name}",
        f"--kubeconfig={kubeconfig}",
        f"--host-root={paths.host_root}",
        f"--kubelet-root-dir={paths.kubelet_root}",
        f"--cdi-dir={paths.cdi_dir}",
        f"--nri-socket={paths.nri_socket}",
        f"--state-dir={paths.state_dir}",
        "--bind-address=127.0.0.1:0",
        "--log-format=json",
        f"--cpu-device-mode={mode}",
        f"--group-by={group_by}",
    ]
    if reserved:
        args.append(f"--reserved-cpus={reserved}")
    if memory_pinning:
        args.append("--memory-pinning")
    return [*args, *extra]


@contextlib.asynccontextmanager
async def open_node_sim(
    *,
    topology: str = DEFAULT_TOPOLOGY,
    mode: CpuDeviceMode | str = CpuDeviceMode.GROUPED,
    group_by: GroupBy | str = GroupBy.NUMANODE,
    reserved: str = "",
    memory_pinning: bool = False,
    node_name: str = DEFAULT_NODE_NAME,
    runtime_name: str = "containerd",
    runtime_version: str = DEFAULT_RUNTIME_VERSION,
    kubelet_version: str | None = DEFAULT_KUBELET_VERSION,
    shared_containers: int = 0,
    extra_args: Sequence[str] = (),
    start: bool = True,
    pod_resources: bool = True,
    root: Path | None = None,
    keep: bool = False,
) -> AsyncIterator[NodeSim]:
    """Start a simulated node (see the module docstring) and yield it; everything stops (the
    daemon with SIGTERM) when the block exits.

    ``topology``: a name of :data:`~dracpu.sim.topologies.FIXTURES`; ``mode``, ``group_by``,
    ``reserved``, ``memory_pinning``, ``extra_args``: the daemon's flags. ``runtime_name`` /
    ``runtime_version``: what the fake runtime claims to be (it decides the NRI version).
    ``kubelet_version``: the Node's ``status.nodeInfo.kubeletVersion`` (``None``: no status).
    ``shared_containers``: pods with one container each that run before the daemon starts.
    ``start=False``: the peers run but no daemon is launched yet (call
    :meth:`NodeSim.start_daemon`). ``pod_resources=False``: the kubelet has no PodResources
    socket (``sim.kubelet.serve_pod_resources()`` opens it later). ``root``: where to put the
    node's files (default: a fresh temporary directory, removed at the end unless ``keep``).
    Asyncio backend only (aiohttp, the gRPC server).
    """
    spec = fixture(topology)
    device_mode, grouping = CpuDeviceMode(mode), GroupBy(group_by)
    made = root is None
    # Short paths: a unix socket path must fit in 107 bytes (pytest's tmp_path often does not).
    base = Path(tempfile.mkdtemp(prefix="dracpu-sim-")) if root is None else root
    paths = SimPaths(base)
    try:
        for directory in (paths.kubelet_root, paths.cdi_dir, paths.nri_socket.parent, paths.logs):
            directory.mkdir(parents=True, exist_ok=True)
        paths.host_root.mkdir(parents=True, exist_ok=True)
        write_sysfs(spec, paths.host_root)
        async with (
            open_fake_apiserver(kubeconfig_dir=paths.root) as api,
            open_fake_runtime(
                paths.nri_socket, runtime_name=runtime_name, runtime_version=runtime_version
            ) as runtime,
        ):
            api.add_node(node_name, kubelet_version=kubelet_version)
            with FakeKubelet(paths.registry_dir) as kubelet:
                if pod_resources:
                    kubelet.serve_pod_resources()
                sim = NodeSim(
                    paths=paths,
                    api=api,
                    runtime=runtime,
                    kubelet=kubelet,
                    spec=spec,
                    topology_name=topology,
                    node_name=node_name,
                    mode=device_mode,
                    daemon_args=daemon_arguments(
                        paths,
                        api.kubeconfig_path,
                        node_name=node_name,
                        mode=device_mode,
                        group_by=grouping,
                        reserved=reserved,
                        memory_pinning=memory_pinning,
                        extra=extra_args,
                    ),
                )
                for index in range(shared_containers):
                    sim.shared_container(f"shared-{index}")
                try:
                    if start:
                        await sim.start_daemon()
                    yield sim
                finally:
                    with anyio.CancelScope(shield=True):
                        for daemon in sim.daemons:
                            await daemon.aclose()
    finally:
        if made and not keep:
            shutil.rmtree(base, ignore_errors=True)
