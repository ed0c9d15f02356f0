"""``dracpu sim``: a scripted demo of one exclusive claim on a simulated node.

It runs the REAL ``dracpu run`` on :func:`dracpu.sim.node.open_node_sim` and walks one claim
through its life, checking every step and printing what happened:

1. the daemon is ready: every task started and the fake kubelet registered it;
2. its ResourceSlices are in the fake API server (which validated them);
3. the containers that ran before it are pinned to the shared pool at NRI ``Synchronize``;
4. the simulator, playing the scheduler, allocates a claim of N CPUs from a published device
   (``--cpus``; by default 4, or as many as one device can give while the shared containers
   keep a CPU);
5. the kubelet prepares it: the CPUs, the CDI spec, the claim's ``status.devices`` cpuset;
6. the runtime creates the pod's container with the CDI env: it gets exactly the claim's CPUs,
   and every shared container shrinks to the rest;
7. a second claim's pod ends and the kubelet never unprepares it (a lost call): the kubelet's
   PodResources stops listing it while it still lists the first claim's pod, and the daemon
   releases the orphan after the grace (the demo's daemon lists every 500 ms with a grace of
   2 s), its CPUs shared again (those that are not isolated: isolated CPUs are never shared);
   the first claim stays;
8. the first pod ends and the kubelet unprepares its claim: the CDI spec goes and the shared
   containers get the CPUs back (at once when the runtime's NRI takes unsolicited updates, else
   at the next container event, which the demo then causes);
9. a CPU that a published device counts goes offline in the fake sysfs (the highest one that
   has a NUMA node: a CPU linked to none is in no device but ``cpudevmachine``): the kubelet's
   health stream reports its device
   unhealthy within a second; SIGHUP: the daemon reads the topology again and republishes the
   slices (the device gone, or the group's capacity one smaller, a new pool generation), and
   the health stream follows (:func:`_hotplug`).

A step whose outcome is not the expected one stops the demo with exit code 1 and says what was
wrong. ``-o json`` prints one JSON document instead of the transcript.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TextIO

import anyio

from dracpu.core.allocator import describe_plan
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy
from dracpu.errors import DracpuError, leaf_errors
from dracpu.sim.fake_kubelet import HealthList, HealthWatch
from dracpu.sim.node import (
    DEFAULT_RUNTIME_VERSION,
    DEFAULT_TOPOLOGY,
    NodeSim,
    SimError,
    open_node_sim,
    wait_until,
)
from dracpu.sim.topologies import fixture

__all__ = ["DemoOptions", "Step", "main", "run_demo"]

EXIT_OK = 0
EXIT_FAILED = 1  # the node did not behave as expected
EXIT_USAGE = 2  # bad options (dracpu's CLI convention)
# How long the status PATCH after a Prepare answer may take (a local fake API server).
STATUS_TIMEOUT = 5.0
# How long the demo waits for the shared containers to widen after an Unprepare.
WIDEN_TIMEOUT = 5.0
# With an old runtime: how long the demo checks that nothing widens before the next event.
DEFERRED_CHECK = 0.3
# How long the health stream and the republish after a CPU goes offline may take (the online
# CPUs are read every second; a 1024-CPU node's slices take a few hundred ms).
HOTPLUG_TIMEOUT = 15.0
DEMO_NAMESPACE = "demo"
# The pod-resources sync of the demo's daemon: quick, so the orphan goes within seconds (the
# defaults are a List a minute and a grace of 5 minutes).
LIST_INTERVAL = "500ms"
ORPHAN_GRACE = 2.0
DEMO_FLAGS = (f"--podresources-interval={LIST_INTERVAL}", f"--orphan-grace={ORPHAN_GRACE:g}s")
# How long the demo waits for the orphan to go: the grace, two Lists and slack for a busy host.
ORPHAN_TIMEOUT = ORPHAN_GRACE + 10.0
# The demo claim's size when --cpus is not given (where one device has room for it).
DEFAULT_CPUS = 4


@dataclass(frozen=True, slots=True)
class DemoOptions:
    """What ``dracpu sim`` was asked to simulate."""

    topology: str = DEFAULT_TOPOLOGY
    cpus: int | None = None  # None: DEFAULT_CPUS, fewer where one device has less room
    mode: CpuDeviceMode = CpuDeviceMode.GROUPED
    group_by: GroupBy = GroupBy.NUMANODE
    reserved: str = ""
    runtime_version: str = DEFAULT_RUNTIME_VERSION
    shared: int = 3
    memory_pinning: bool = False
    keep: bool = False


@dataclass(slots=True)
class Step:
    """One step of the transcript: a title, the lines that show it, the facts as data."""

    title: str
    lines: list[str] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise SimError(what)


def _cpus(text: str) -> CpuSet:
    return CpuSet.parse(text) if text else CpuSet()


def _container_label(sim: NodeSim, container_id: str) -> str:
    container = sim.runtime.containers[container_id]
    pod = sim.runtime.pods[container.pod_id]
    return f"{pod.namespace}/{pod.name}/{container.name}"


def _where(sim: NodeSim, cpus: CpuSet) -> str:
    plan = describe_plan(sim.topology, cpus)
    cores = len(plan["cores"])
    numa = ",".join(str(n) for n in plan["numaNodes"])
    l3 = ",".join(str(n) for n in plan["l3Caches"])
    return f"{cores} cores, NUMA node {numa}, L3 {l3}"


async def run_demo(
    options: DemoOptions, emit: Callable[[Step], None], *, root: Path | None = None
) -> list[Step]:
    """Run the scripted demo; ``emit`` gets each step as it completes. Raises
    :class:`~dracpu.sim.node.SimError` (or another DracpuError) when a step goes wrong.
    ``root``: where the node's files go (kept there); ``None``: a temporary directory, kept
    only with ``options.keep``."""
    steps: list[Step] = []

    def done(step: Step) -> None:
        steps.append(step)
        emit(step)

    async with open_node_sim(
        topology=options.topology,
        mode=options.mode,
        group_by=options.group_by,
        reserved=options.reserved,
        memory_pinning=options.memory_pinning,
        runtime_version=options.runtime_version,
        shared_containers=options.shared,
        extra_args=DEMO_FLAGS,
        start=False,
        root=root,
        keep=options.keep,
    ) as sim:
        done(await _start(sim, options))
        done(await _slices(sim))
        done(_synchronized(sim))
        claim_step, claim, hint = _allocate(sim, options)
        done(claim_step)
        prepare_step, held = await _prepare(sim, claim, hint)
        done(prepare_step)
        create_step, pod = await _create(sim, claim, held)
        done(create_step)
        done(await _orphan(sim, claim))
        done(await _unprepare(sim, claim, pod, held))
        done(await _hotplug(sim, options))
    return steps


async def _start(sim: NodeSim, options: DemoOptions) -> Step:
    seconds = await sim.start_daemon()
    _, body = await sim.daemon.get("/readyz")
    tasks = [line[3:].split(" ")[0] for line in body.splitlines() if line.startswith("[+]")]
    registration = sim.registration
    plugin = await sim.runtime.wait_plugin(10)
    step = Step(
        f"dracpu run is ready ({seconds:.1f} s after launch, pid {sim.daemon.pid})",
        [
            f"tasks ready: {', '.join(tasks)}",
            f"kubelet (grpcio) registered {registration.driver if registration else '?'} "
            f"(DRA {registration.version if registration else '?'})",
            f"runtime: containerd {options.runtime_version} (NRI {sim.runtime.nri_version}), "
            f"plugin {plugin.index}-{plugin.name} connected",
        ],
        {
            "pid": sim.daemon.pid,
            "secondsToReady": round(seconds, 3),
            "tasks": tasks,
            "nriVersion": sim.runtime.nri_version,
        },
    )
    return step


async def _slices(sim: NodeSim) -> Step:
    devices = await sim.wait_published()
    slices = sim.slices()
    lines = [
        f"{s['metadata']['name']}: {len(s['spec'].get('devices') or [])} devices, pool "
        f"{s['spec']['pool']['name']} generation {s['spec']['pool']['generation']}"
        for s in slices
    ]
    shown = devices if len(devices) <= 8 else devices[:6]
    for device in shown:
        attributes = device.get("attributes") or {}
        numa = attributes.get("resource.kubernetes.io/numaNode", {}).get("int")
        socket = attributes.get("dra.cpu/socketID", {}).get("int")
        capacity = (device.get("capacity") or {}).get("dra.cpu/cpu", {}).get("value")
        cpu = attributes.get("dra.cpu/cpuID", {}).get("int")
        detail = f"dra.cpu/cpu {capacity}" if capacity is not None else f"cpu {cpu}"
        lines.append(f"  {device['name']:<15} numaNode {numa}  socket {socket}  {detail}")
    if len(shown) < len(devices):
        lines.append(f"  ... and {len(devices) - len(shown)} more")
    return Step(
        "ResourceSlices published (the fake API server validated them)",
        lines,
        {"slices": [s["metadata"]["name"] for s in slices], "devices": len(devices)},
    )


def _synchronized(sim: NodeSim) -> Step:
    shared = sim.shared_ids()
    pools = {cid: sim.cpus_of(cid) for cid in shared}
    _expect(
        len(set(pools.values())) <= 1 and all(pools.values()),
        f"the shared containers were not all pinned to one pool: {pools}",
    )
    pool = next(iter(pools.values()), "")
    return Step(
        "Containers that ran before dracpu are pinned to the shared pool at NRI Synchronize",
        [f"{_container_label(sim, cid):<26} cpus {pools[cid]}" for cid in shared]
        or ["(no shared containers)"],
        {"sharedPool": pool, "containers": pools},
    )


def _room(sim: NodeSim, options: DemoOptions) -> int:
    """The most CPUs one claim can get from one published device while the shared containers
    keep a CPU (the daemon refuses a Prepare that would leave them none)."""
    free = sim.free_capacity()
    largest = max(free.values(), default=0) if free else len(sim.published())
    shareable = sim.topology.online - _cpus(options.reserved) - sim.topology.isolated
    return max(0, min(largest, len(shareable) - 1 if sim.shared_ids() else largest))


def _allocate(sim: NodeSim, options: DemoOptions) -> tuple[Step, Any, str]:
    """The scheduler's allocation of the demo claim; also the hint to add to a refusal when
    ``--cpus`` asked for more than the node has room for."""
    room = _room(sim, options)
    count = min(DEFAULT_CPUS, room) if options.cpus is None else options.cpus
    _expect(
        count > 0, "no published device has a CPU to spare while the shared containers keep one"
    )
    hint = f"; choose a smaller --cpus (at most {room} fit here)" if count > room else ""
    try:
        claim = sim.allocate("demo", count, namespace=DEMO_NAMESPACE)
    except SimError as exc:
        raise SimError(f"{exc}{hint}") from exc
    result = claim.results[0]
    if "consumedCapacity" in result:
        how = (
            f"{count} CPUs of {result['device']} "
            f"(consumedCapacity dra.cpu/cpu={result['consumedCapacity']['dra.cpu/cpu']})"
        )
    else:
        how = f"devices {', '.join(claim.devices)}"
    step = Step(
        f"The scheduler allocates claim {claim.namespace}/{claim.name}: {how}",
        [f"claim UID {claim.uid}"],
        {"claim": claim.uid, "results": claim.results},
    )
    return step, claim, hint


def _admit(sim: NodeSim, pod_name: str, claim: Any) -> None:
    """The kubelet admits a pod before it prepares the pod's claims, so its PodResources lists
    the claim from the Prepare on (not only once the container runs: under load that can be
    later than the daemon's orphan grace)."""
    sim.kubelet.pods.add_pod(DEMO_NAMESPACE, pod_name, {"main": [claim.uid]})


async def _prepare(sim: NodeSim, claim: Any, hint: str) -> tuple[Step, CpuSet]:
    _admit(sim, "demo-app", claim)
    started = time.monotonic()
    answer = (await sim.prepare(claim))[claim.uid]
    took = time.monotonic() - started
    _expect(answer.error == "", f"NodePrepareResources failed: {answer.error}{hint}")
    text = sim.cdi_cpus(claim.uid)
    _expect(text is not None, f"no CDI spec for claim {claim.uid}")
    held = _cpus(text or "")
    _expect(
        len(held)
        == sum(int(r.get("consumedCapacity", {}).get("dra.cpu/cpu", 1)) for r in claim.results),
        f"claim {claim.uid} got cpus {held}",
    )
    # The daemon records the cpuset in the claim's status after answering (best effort).
    await wait_until(
        "the claim status to carry the cpuset",
        lambda: str(held) in sim.claim_status_cpusets(claim),
        timeout=STATUS_TIMEOUT,
    )
    status = sim.claim_status_cpusets(claim)
    return Step(
        f"kubelet NodePrepareResources: cpus {held} ({_where(sim, held)}) in {took * 1000:.0f} ms",
        [
            f"CDI device {answer.devices[0].cdi_device_ids[0]}",
            f"CDI spec {sim.paths.cdi_spec(claim.uid).name}: DRA_CPUSET_{claim.uid}={held}",
            f"ResourceClaim status.devices data.cpuset: "
            f"{', '.join(dict.fromkeys(status)) or '(not recorded)'}",
        ],
        {"cpus": str(held), "cdiDeviceIds": list(answer.devices[0].cdi_device_ids)},
    ), held


async def _create(sim: NodeSim, claim: Any, held: CpuSet) -> tuple[Step, Any]:
    before = {cid: sim.cpus_of(cid) for cid in sim.shared_ids()}
    pod, container = await sim.run_container("demo-app", claims=[claim], namespace=DEMO_NAMESPACE)
    pinned = _cpus(container.cpus)
    _expect(pinned == held, f"the claim's container got cpus {pinned}, not {held}")
    lines = [
        f"{_container_label(sim, container.id):<26} cpus {pinned} (exclusive)"
        + (f", mems {container.mems}" if container.mems else "")
    ]
    after: dict[str, str] = {}
    for cid, old in before.items():
        new = sim.cpus_of(cid)
        after[cid] = new
        _expect(
            _cpus(new).isdisjoint(held),
            f"shared container {cid} still runs on claimed cpus: {new}",
        )
        lines.append(f"{_container_label(sim, cid):<26} cpus {old} -> {new}")
    return Step(
        "The runtime creates the pod's container with the CDI env (NRI CreateContainer)",
        lines,
        {"container": container.id, "cpus": str(pinned), "shared": after},
    ), pod


def _room_for_another_claim(sim: NodeSim) -> bool:
    """Whether a claim of one more CPU leaves the shared containers a CPU."""
    pools = [_cpus(sim.cpus_of(cid)) for cid in sim.shared_ids()]
    return not pools or min(len(pool) for pool in pools) >= 2


async def _orphan(sim: NodeSim, keeper: Any) -> Step:
    if not _room_for_another_claim(sim):
        return Step(
            "Orphan release skipped: a second claim would leave the shared containers no CPU",
            [],
            {"skipped": True},
        )
    lost = sim.allocate("lost", 1, namespace=DEMO_NAMESPACE)
    _admit(sim, "lost-app", lost)
    answer = (await sim.prepare(lost))[lost.uid]
    _expect(answer.error == "", f"NodePrepareResources of claim lost failed: {answer.error}")
    held = _cpus(sim.cdi_cpus(lost.uid) or "")
    pod, container = await sim.run_container("lost-app", claims=[lost], namespace=DEMO_NAMESPACE)
    _expect(_cpus(container.cpus) == held, f"claim lost's container got cpus {container.cpus}")
    label = _container_label(sim, container.id)
    narrow = {cid: sim.cpus_of(cid) for cid in sim.shared_ids()}
    # The listings miss the claim from the moment the kubelet drops the pod, at the start of
    # remove_pod: the grace counts from before the call.
    started = time.monotonic()
    await sim.remove_pod(pod)  # ... and the kubelet never calls NodeUnprepareResources
    await wait_until(
        "the orphan claim to be released",
        lambda: sim.cdi_cpus(lost.uid) is None,
        timeout=ORPHAN_TIMEOUT,
    )
    took = time.monotonic() - started
    sim.deallocate(lost)
    _expect(took >= ORPHAN_GRACE, f"claim lost was released {took:.1f} s after its pod ended")
    _expect(sim.cdi_cpus(keeper.uid) is not None, "the first claim went although its pod runs")
    prefix = f"released orphan claim {lost.uid} "

    def warnings() -> list[str]:
        return [m for m in sim.daemon.messages("warning") if m.startswith(prefix)]

    await wait_until("the daemon to log the release", lambda: bool(warnings()), timeout=5)
    warning = warnings()
    _expect(len(warning) == 1, f"the daemon logged {len(warning)} warnings naming claim lost")
    lines = [
        f"{label:<26} cpus {held} (exclusive), claim {lost.namespace}/{lost.name} {lost.uid}",
        "the pod ends; the kubelet's PodResources List no longer shows the claim (it still "
        f"shows {keeper.namespace}/{keeper.name}: its pod runs)",
        f"daemon: {warning[0].split(':')[0]}",
        f"CDI spec removed; claim {keeper.namespace}/{keeper.name} still prepared",
    ]
    shared = _shared_again(sim, held, lines)

    def widened() -> bool:
        return all(shared <= _cpus(sim.cpus_of(cid)) for cid in narrow)

    if shared and await _unsolicited_updates(sim):
        await wait_until("the shared containers to widen", widened, timeout=WIDEN_TIMEOUT)
        lines += [
            f"{_container_label(sim, cid):<26} cpus {old} -> {sim.cpus_of(cid)}"
            for cid, old in narrow.items()
        ]
    elif shared:
        lines.append(f"cpus {shared} are shared again from the next container event")
    return Step(
        "A pod ends but the kubelet never unprepares its claim: the daemon releases the orphan "
        f"{took:.1f} s later (List every {LIST_INTERVAL}, --orphan-grace {ORPHAN_GRACE:g}s)",
        lines,
        {"claim": lost.uid, "cpus": str(held), "releasedAfter": round(took, 3)},
    )


def _shared_again(sim: NodeSim, held: CpuSet, lines: list[str]) -> CpuSet:
    """The CPUs of a released claim the shared containers get back: not its isolated ones,
    which are never shared (said in ``lines``)."""
    isolated = held & sim.topology.isolated
    if isolated:
        lines.append(f"cpus {isolated} are isolated: free again, never shared")
    return held - isolated


async def _unsolicited_updates(sim: NodeSim) -> bool:
    """Whether the daemon will widen shared containers at once (from its ``/metrics``)."""
    _, metrics = await sim.daemon.get("/metrics")
    for line in metrics.splitlines():
        if line.startswith("dracpu_nri_runtime_info{"):
            return 'unsolicited_updates="true"' in line
    raise SimError("the daemon's /metrics has no dracpu_nri_runtime_info")


async def _unprepare(sim: NodeSim, claim: Any, pod: Any, held: CpuSet) -> Step:
    narrow = {cid: sim.cpus_of(cid) for cid in sim.shared_ids()}
    await sim.remove_pod(pod)
    errors = await sim.unprepare(claim)
    _expect(errors == {claim.uid: ""}, f"NodeUnprepareResources failed: {errors}")
    _expect(sim.cdi_cpus(claim.uid) is None, "the CDI spec is still there after Unprepare")
    sim.deallocate(claim)
    lines = ["CDI spec removed", f"cpus {held} are free again"]
    shared = _shared_again(sim, held, lines)

    def widened() -> bool:
        return all(shared <= _cpus(sim.cpus_of(cid)) for cid in narrow)

    if not shared or not narrow:
        how = "(nothing to widen: no shareable CPU was held)" if narrow else "(none run)"
    elif await _unsolicited_updates(sim):
        how = "at once (unsolicited NRI UpdateContainers)"
        await wait_until("the shared containers to widen", widened, timeout=WIDEN_TIMEOUT)
    else:
        how = (
            f"at the next container event (NRI {sim.runtime.nri_version} cannot take "
            "unsolicited updates safely)"
        )
        await anyio.sleep(DEFERRED_CHECK)
        _expect(not widened(), "the shared containers were widened without an event")
        _, probe = await sim.run_container("next-pod", namespace=DEMO_NAMESPACE)
        lines.append(f"{_container_label(sim, probe.id):<26} cpus {probe.cpus} (a new container)")
        _expect(widened(), "the shared containers were not widened at the next event")
    for cid, old in narrow.items():
        lines.append(f"{_container_label(sim, cid):<26} cpus {old} -> {sim.cpus_of(cid)}")
    return Step(
        f"The pod ends; kubelet NodeUnprepareResources; shared containers widened {how}",
        lines,
        {"widened": how, "shared": {cid: sim.cpus_of(cid) for cid in narrow}},
    )


def _capacities(devices: list[dict[str, Any]]) -> dict[str, str]:
    """Each published device with its ``dra.cpu/cpu`` capacity (individual: ``1``)."""
    return {
        d["name"]: (d.get("capacity") or {}).get("dra.cpu/cpu", {}).get("value", "1")
        for d in devices
    }


async def _health(watch: HealthWatch, done: Callable[[HealthList], bool], what: str) -> HealthList:
    deadline = time.monotonic() + HOTPLUG_TIMEOUT
    while time.monotonic() < deadline:
        health = await watch.anext(HOTPLUG_TIMEOUT)
        _expect(health is not None, "the daemon ended the health stream")
        assert health is not None
        if done(health):
            return health
    raise SimError(f"the health stream did not report {what} within {HOTPLUG_TIMEOUT:g} s")


async def _hotplug(sim: NodeSim, options: DemoOptions) -> Step:
    # A CPU linked to no NUMA node is in no device but cpudevmachine (docs/devices.md): one
    # that has a node makes a device unhealthy in every mode and grouping.
    counted = CpuSet(c for c, info in sim.topology.cpus.items() if info.numa_node >= 0)
    cpu = max((sim.topology.online - _cpus(options.reserved)) & counted)
    before = _capacities(sim.published())
    generation = max(int(s["spec"]["pool"]["generation"]) for s in sim.slices())
    with sim.kubelet.watch_health() as watch:
        first = await _health(watch, lambda h: not h.unhealthy(), "every device healthy")
        offline = time.monotonic()
        sim.set_offline(sim.spec.offline | CpuSet([cpu]))
        broken = await _health(watch, lambda h: bool(h.unhealthy()), "an unhealthy device")
        seconds = broken.received - offline
        sim.sighup()
        await wait_until(
            "the republished ResourceSlices",
            lambda: max(int(s["spec"]["pool"]["generation"]) for s in sim.slices()) > generation,
            timeout=HOTPLUG_TIMEOUT,
        )
        after = _capacities(await sim.wait_published())
        healed = await _health(watch, lambda h: h.devices != broken.devices, "the new devices")
    _expect(len(sim.slices()) > 0, "no ResourceSlice after the republish")
    gone = sorted(before.keys() - after.keys())
    resized = sorted(n for n in after if n in before and after[n] != before[n])
    _expect(bool(gone or resized), f"the slices did not change after cpu {cpu} went offline")
    [(device, message)] = broken.unhealthy().items()
    lines = [
        f'kubelet health stream ({watch.version}): {device} UNHEALTHY, "{message}" '
        f"({seconds:.1f} s after the CPU went offline, before any signal)",
        f"SIGHUP: ResourceSlices republished, pool generation {generation} -> "
        f"{max(int(s['spec']['pool']['generation']) for s in sim.slices())}",
    ]
    lines += [f"  {name}: removed (its CPU is offline)" for name in gone]
    lines += [f"  {name}: dra.cpu/cpu {before[name]} -> {after[name]}" for name in resized]
    lines.append(
        f"kubelet health stream: {len(healed.devices)} devices (was {len(first.devices)}), "
        f"{len(healed.unhealthy())} unhealthy"
    )
    shared = sim.shared_ids()
    if shared and await _unsolicited_updates(sim):
        await wait_until(
            "the shared containers to leave the offline CPU",
            lambda: all(cpu not in _cpus(sim.cpus_of(cid)) for cid in shared),
            timeout=HOTPLUG_TIMEOUT,
        )
        lines += [
            f"{_container_label(sim, cid):<26} cpus -> {sim.cpus_of(cid)} (re-pinned at once)"
            for cid in shared
        ]
    elif shared:
        lines.append("shared containers get the new pool at their next container event")
    return Step(
        f"cpu {cpu} goes offline (CPU hotplug in the fake sysfs), then SIGHUP",
        lines,
        {
            "cpu": cpu,
            "unhealthy": broken.unhealthy(),
            "removed": gone,
            "resized": {name: [before[name], after[name]] for name in resized},
            "healthAfter": healed.health(),
        },
    )


# --- the command ------------------------------------------------------------------------------


def _print_step(out: TextIO) -> Callable[[Step], None]:
    count = 0

    def emit(step: Step) -> None:
        nonlocal count
        count += 1
        print(f"[{count}] {step.title}", file=out)
        for line in step.lines:
            print(f"    {line}", file=out)
        out.flush()

    return emit


def main(options: DemoOptions, *, output: str = "text", out: TextIO | None = None) -> int:
    """Run the demo and print it (``output``: ``text`` or ``json``); the exit code."""
    stream = out if out is not None else sys.stdout
    spec = fixture(options.topology)  # ConfigError (exit 2) for an unknown name, before anything
    if options.cpus is not None and options.cpus < 1:
        print(f"dracpu sim: error: --cpus must be at least 1, not {options.cpus}", file=sys.stderr)
        return EXIT_USAGE
    started = time.monotonic()
    steps: list[Step] = []
    show = _print_step(stream) if output == "text" else None
    if show is not None:
        print(
            f"dracpu sim: the real `dracpu run` on a simulated node ({options.topology}: "
            f"{spec.description})",
            file=stream,
        )

    def emit(step: Step) -> None:
        steps.append(step)
        if show is not None:
            show(step)

    failure = ""
    # --keep: the node's files go where this run can name them, whatever happens to it.
    kept = Path(tempfile.mkdtemp(prefix="dracpu-sim-")) if options.keep else None
    try:
        anyio.run(partial(run_demo, options, emit, root=kept), backend="asyncio")
    except* DracpuError as group:  # the peers' task groups wrap what a step raised
        failure = "; ".join(str(error) for error in leaf_errors(group))
    elapsed = time.monotonic() - started
    if output == "json":
        document = {
            "ok": not failure,
            "topology": options.topology,
            "seconds": round(elapsed, 3),
            "steps": [{"title": s.title, **s.data} for s in steps],
        }
        if failure:
            document["error"] = failure
        if kept is not None:
            document["kept"] = str(kept)
        print(json.dumps(document, indent=2), file=stream)
    else:
        if failure:
            print(f"FAILED: {failure}", file=stream)
        else:
            print(f"OK: {len(steps)} steps checked in {elapsed:.1f} s", file=stream)
        if kept is not None:
            print(f"node files and daemon logs kept in {kept}", file=stream)
    return EXIT_FAILED if failure else EXIT_OK
