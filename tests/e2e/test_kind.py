"""dracpu on a real cluster: slices, exclusive cpusets, the shared pool, refusals, restart.

Run by ``just e2e-local`` (``tests/cluster/e2e``: the real components as processes on this
machine, ``deploy/kustomize/overlays/local``, no CPU reserved) or ``just e2e``
(``tests/e2e/run.sh``: a kind cluster from ``kind-config.yaml``, ``deploy/kustomize/overlays/kind``,
CPU 0 reserved); both set ``DRACPU_E2E=1``. Skipped otherwise. Tests that need more CPUs than
the node has (the local machine has 2) skip, saying so.

Every test works in its own namespace on one node (``target.node``: the first worker) and
asserts what the kernel says inside the containers: ``Cpus_allowed_list`` of the container's
own process and of a process started by ``kubectl exec``, against the ``DRA_CPUSET_<claimUID>``
env the runtime injected from the driver's CDI spec and against the node's sysfs (read by a
probe pod). CPU sets are compared as Python sets parsed by ``tests/e2e/kube.py``.

The shared pool: a best-effort container runs on ``shareable - claimed`` (allocatable = online
minus reserved; shareable = allocatable minus isolated). It shrinks in the same NRI reply that
creates an exclusive container. When a claim is unprepared it widens at once if the daemon
sends unsolicited NRI updates (runtime NRI >= v0.12.1, containerd >= 2.3), otherwise at the next
container event on the node; which one the daemon chose is read from its log, and the test
asserts that behaviour (the pinned node image, kind v0.32.0's kindest/node:v1.36.1, runs
containerd 2.3.1 with NRI v0.12.0: the next-event path).
"""

from __future__ import annotations

import uuid
from functools import partial
from typing import Any

import pytest

from tests.e2e.cluster import Cluster, Target, claim_result, grouped_device_numa
from tests.e2e.kube import format_cpulist, parse_cpulist, parse_quantity, poll
from tests.e2e.workloads import (
    CPU_CAPACITY,
    DRIVER,
    claim_template,
    exclusive_pod,
    shared_pod,
)

__all__: list[str] = []

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# Attributes every grouped-by-NUMA device carries (docs/devices.md), with their value type.
NUMA_ATTRIBUTE = "resource.kubernetes.io/numaNode"
GROUPED_ATTRIBUTES = {
    NUMA_ATTRIBUTE: "int",
    "dra.cpu/socketID": "int",
    "dra.cpu/smtEnabled": "bool",
    "dra.cpu/numCPUs": "int",
    "dra.cpu/numaNodeID": "int",
    "dra.net/numaNode": "int",
}
# Ours (docs/devices.md): how many of a group's CPUs are isolated.
ISOLATED_ATTRIBUTE = "dra.cpu/numIsolatedCPUs"
# An NRI reply carries the updates of the shared containers, so after the exclusive container
# runs they are already moved; this only covers kubectl and the kernel being slow to show it.
SAME_REPLY_TIMEOUT = 30.0
# Widening after Unprepare: at once (unsolicited updates), or after a poke pod's creation.
WIDEN_TIMEOUT = 120.0
# The scheduler's DRA plugin when no device can satisfy a claim (kubernetes
# pkg/scheduler/framework/plugins/dynamicresources: statusUnschedulable(..., "cannot allocate all
# claims", ...)).
CANNOT_ALLOCATE = "cannot allocate all claims"
# How long a pod whose claim cannot be allocated is watched to stay Pending.
PENDING_TIMEOUT = 120.0
# Why a test cannot run on a small node, such as the local cluster's 2-CPU machine
# (tests/cluster): dracpu refuses a claim that would leave the shared pool empty.
NO_ROOM_FOR_TWO_CLAIMS = (
    "the node cannot hold two exclusive claims and a shared CPU at once (2 CPUs need 3)"
)
NO_ROOM_FOR_TWO_CPUS = "the node cannot hold a 2-CPU claim and a shared CPU at once (needs 3)"


def _status_cpuset(claim: dict[str, Any], result: dict[str, Any]) -> str | None:
    """``data.cpuset`` of our entry in the claim's ``status.devices``, if written yet."""
    for entry in (claim.get("status") or {}).get("devices") or []:
        if all(entry.get(k) == result.get(k) for k in ("driver", "pool", "device", "shareID")):
            cpuset = (entry.get("data") or {}).get("cpuset")
            return str(cpuset) if cpuset is not None else None
    return None


# --- 1. ResourceSlices -----------------------------------------------------------------------


def test_every_node_publishes_its_numa_groups(cluster: Cluster, target: Target) -> None:
    for node, facts in sorted(target.nodes.items()):
        slices = cluster.slices(node)
        assert slices, f"no ResourceSlice of {DRIVER} for node {node}"
        assert {s["spec"]["pool"]["name"] for s in slices} == {node}, "pool named after the node"
        generation = max(s["spec"]["pool"]["generation"] for s in slices)
        current = [s for s in slices if s["spec"]["pool"]["generation"] == generation]
        for piece in current:
            assert piece["spec"]["pool"]["resourceSliceCount"] == len(current)
            assert len(piece["spec"].get("devices", [])) <= 128

        devices = cluster.devices(node)
        expected = facts.grouped_devices()
        assert sorted(devices) == sorted(expected), f"node {node}: devices by NUMA node"
        for name, (numa, count) in expected.items():
            device = devices[name]
            capacity = device["capacity"][CPU_CAPACITY]
            assert parse_quantity(capacity["value"]) == count, f"{node}/{name}: capacity"
            assert device.get("allowMultipleAllocations") is True, f"{node}/{name}"
            attributes = device["attributes"]
            for key, kind in GROUPED_ATTRIBUTES.items():
                assert kind in attributes.get(key, {}), f"{node}/{name}: {key} ({kind})"
            assert attributes[NUMA_ATTRIBUTE]["int"] == numa
            assert attributes["dra.cpu/numCPUs"]["int"] == count
            isolated = len(facts.numa[numa] & facts.allocatable & facts.isolated)
            assert attributes[ISOLATED_ATTRIBUTE]["int"] == isolated, f"{node}/{name}"
            # Whole CPUs, by default the whole group (what a request without capacity.requests
            # consumes, as with upstream's policy-less capacity); kept since kind-config.yaml
            # enables DRAConsumableCapacity (a server without it would have dropped the
            # device's allowMultipleAllocations too).
            policy = capacity.get("requestPolicy")
            assert policy is not None, f"{node}/{name}: no requestPolicy"
            assert parse_quantity(policy["default"]) == count, f"{node}/{name}: {policy}"
            assert parse_quantity(policy["validRange"]["min"]) == 1, f"{node}/{name}: {policy}"
            if count >= 2:
                assert parse_quantity(policy["validRange"]["step"]) == 1, f"{node}/{name}"

        # The probe pod (best effort, started while no claim existed) ran on the shared pool:
        # every online CPU but the reserved and isolated ones.
        assert facts.probe_allowed == facts.shareable, (
            f"node {node}: probe ran on {format_cpulist(facts.probe_allowed)!r}, expected "
            f"{format_cpulist(facts.shareable)!r}"
        )


# --- 2. one exclusive claim ------------------------------------------------------------------


def test_claimed_cpus_pin_the_container(cluster: Cluster, target: Target, namespace: str) -> None:
    node, size = target.node, target.size
    cluster.create(claim_template("cpus", namespace, str(size)))
    cluster.start(
        exclusive_pod("exclusive", namespace, node.name, template="cpus", cpu_resources=str(size))
    )

    cpus = cluster.exclusive_cpus(namespace, "exclusive")  # env == Cpus_allowed_list (both)
    assert len(cpus) == size
    assert not cpus & node.reserved, f"reserved cpus {format_cpulist(node.reserved)} handed out"
    assert cpus <= node.allocatable

    claim = cluster.claim_of(namespace, "exclusive")
    result = claim_result(claim, node.name)
    numa = grouped_device_numa(result["device"])
    assert cpus <= node.numa[numa], f"cpus {format_cpulist(cpus)} outside NUMA node {numa}"
    assert parse_quantity(result["consumedCapacity"][CPU_CAPACITY]) == size

    # The driver records the cpuset in the claim's status.devices (docs/devices.md).
    name = claim["metadata"]["name"]
    recorded = poll(
        lambda: _status_cpuset(cluster.kube.get("resourceclaim", name, "-n", namespace), result),
        lambda value: value is not None,
        timeout=SAME_REPLY_TIMEOUT,
        what=f"status.devices[].data.cpuset of claim {namespace}/{name}",
    )
    assert recorded is not None
    assert parse_cpulist(recorded) == cpus


# --- 3. the shared pool follows the claims ---------------------------------------------------


def test_shared_pool_shrinks_and_widens(cluster: Cluster, target: Target, namespace: str) -> None:
    node, size = target.node, target.size
    everything = node.shareable
    cluster.start(shared_pod("shared", namespace, node.name))
    # Pokes absorb a claim of an earlier test the kubelet may still be unpreparing.
    cluster.expect_cpus(namespace, "shared", everything, timeout=WIDEN_TIMEOUT, poke_node=node.name)

    cluster.create(claim_template("cpus", namespace, str(size)))
    cluster.start(
        exclusive_pod("exclusive", namespace, node.name, template="cpus", cpu_resources=str(size))
    )
    claimed = cluster.exclusive_cpus(namespace, "exclusive")
    rest = everything - claimed
    # The running shared container moved off the claimed cpus (same NRI reply) ...
    cluster.expect_cpus(namespace, "shared", rest, timeout=SAME_REPLY_TIMEOUT)
    # ... and a new one starts on what is left.
    cluster.start(shared_pod("shared-later", namespace, node.name))
    cluster.expect_cpus(namespace, "shared-later", rest, timeout=SAME_REPLY_TIMEOUT)

    at_once = cluster.widens_at_once(node.name)
    cluster.delete_pod(namespace, "exclusive")  # returns once the pod is gone (unprepared)
    if at_once:
        # Unprepare widened every shared container itself: nothing else happens on the node.
        for pod in ("shared", "shared-later"):
            cluster.expect_cpus(namespace, pod, everything, timeout=WIDEN_TIMEOUT)
    else:
        # The runtime cannot take unsolicited updates: the next container event widens them.
        cluster.expect_cpus(
            namespace, "shared", everything, timeout=WIDEN_TIMEOUT, poke_node=node.name
        )
        cluster.expect_cpus(namespace, "shared-later", everything, timeout=SAME_REPLY_TIMEOUT)


# --- 4. several claims, and claims that cannot be had ----------------------------------------


def test_claims_are_disjoint(cluster: Cluster, target: Target, namespace: str) -> None:
    if not target.room_for_two_claims:
        pytest.skip(NO_ROOM_FOR_TWO_CLAIMS)
    node, size = target.node, target.size
    cluster.create(claim_template("cpus", namespace, str(size)))
    held: dict[str, frozenset[int]] = {}
    for pod in ("exclusive-1", "exclusive-2"):
        cluster.start(
            exclusive_pod(pod, namespace, node.name, template="cpus", cpu_resources=str(size))
        )
        held[pod] = cluster.exclusive_cpus(namespace, pod)
    first, second = held["exclusive-1"], held["exclusive-2"]
    assert len(first) == len(second) == size
    assert not first & second, f"overlap: {format_cpulist(first)} / {format_cpulist(second)}"
    assert not (first | second) & node.reserved, "a claim got a reserved cpu"
    cluster.start(shared_pod("shared", namespace, node.name))
    cluster.expect_cpus(
        namespace, "shared", node.shareable - first - second, timeout=SAME_REPLY_TIMEOUT
    )


def test_oversized_claims_stay_pending(cluster: Cluster, target: Target, namespace: str) -> None:
    node, size = target.node, target.size
    cluster.create(claim_template("cpus", namespace, str(size)))
    cluster.start(
        exclusive_pod("exclusive", namespace, node.name, template="cpus", cpu_resources=str(size))
    )
    held = cluster.exclusive_cpus(namespace, "exclusive")

    # More CPUs than any NUMA group has, and more than any has free now: the scheduler cannot
    # allocate the claim, so the pod stays Pending and the driver is never asked.
    capacity = {name: count for name, (_, count) in node.grouped_devices().items()}
    free = cluster.free_capacity(node.name)
    over_capacity = max(capacity.values()) + 1
    over_free = int(max(free.values())) + 1
    assert over_free <= over_capacity
    for amount in sorted({over_free, over_capacity}):
        template, pod = f"cpus-{amount}", f"too-big-{amount}"
        cluster.create(claim_template(template, namespace, str(amount)))
        cluster.create(
            exclusive_pod(pod, namespace, node.name, template=template, cpu_resources=None)
        )
    for amount in sorted({over_free, over_capacity}):
        pod = f"too-big-{amount}"
        poll(
            partial(
                cluster.events, namespace, pod, reason="FailedScheduling", text=CANNOT_ALLOCATE
            ),
            bool,
            timeout=PENDING_TIMEOUT,
            what=f"FailedScheduling '{CANNOT_ALLOCATE}' for {namespace}/{pod} ({amount} CPUs)",
        )
        found = cluster.kube.get("pod", pod, "-n", namespace)
        assert found["status"].get("phase") == "Pending"
        assert not found["spec"].get("nodeName"), f"{pod} was scheduled"
        claim = cluster.claim_of(namespace, pod)
        assert not (claim.get("status") or {}).get("allocation"), f"{pod}'s claim was allocated"

    # The running claim was not disturbed.
    assert cluster.exclusive_cpus(namespace, "exclusive") == held


def test_refusals_carry_the_drivers_error(cluster: Cluster, target: Target, namespace: str) -> None:
    node = target.node
    # A container whose env names a claim this node never prepared is refused at creation
    # (fail closed), and so is a malformed DRA_CPUSET_* entry (upstream's e2e case).
    spoofed = str(uuid.uuid4())
    cluster.create(
        shared_pod(
            "spoofed",
            namespace,
            node.name,
            env={f"DRA_CPUSET_{spoofed}": str(min(node.shareable))},
        )
    )
    cluster.create(
        shared_pod("malformed", namespace, node.name, env={"DRA_CPUSET_malformed_claim": "a-b"})
    )
    for pod, needle in (("spoofed", spoofed), ("malformed", "malformed_claim")):
        message = cluster.wait_container_refused(namespace, pod, timeout=PENDING_TIMEOUT)
        assert needle in message, f"{pod}: the runtime's error does not carry ours: {message!r}"
    # Same pod without the env: it runs, so the refusals were the driver's.
    cluster.start(shared_pod("control", namespace, node.name))


def test_fractional_claims_get_whole_cpus(cluster: Cluster, target: Target, namespace: str) -> None:
    if not target.room_for_two_cpu_claim:
        pytest.skip(NO_ROOM_FOR_TWO_CPUS)
    node = target.node
    # 1.5 CPUs: with requestPolicy (whole CPUs, validRange min 1 step 1) the scheduler rounds
    # the request up and the pod gets 2 CPUs; without one (a server that dropped it) the claim
    # is allocated as asked and the driver refuses it at Prepare, which the kubelet reports.
    devices = cluster.devices(node.name)
    with_policy = all("requestPolicy" in d["capacity"][CPU_CAPACITY] for d in devices.values())
    cluster.create(claim_template("fraction", namespace, "1500m"))
    fractional = exclusive_pod(
        "fractional", namespace, node.name, template="fraction", cpu_resources=None
    )
    if with_policy:
        cluster.start(fractional)
        cpus = cluster.exclusive_cpus(namespace, "fractional")
        assert len(cpus) == 2, f"1500m rounded to {format_cpulist(cpus)!r}"
        result = claim_result(cluster.claim_of(namespace, "fractional"), node.name)
        assert parse_quantity(result["consumedCapacity"][CPU_CAPACITY]) == 2
    else:
        cluster.create(fractional)
        warnings = poll(
            partial(cluster.events, namespace, "fractional", kind="Warning", text="whole number"),
            bool,
            timeout=PENDING_TIMEOUT,
            what=f"the kubelet to report the driver's refusal of {namespace}/fractional",
        )
        assert "1500m" in warnings[-1]["message"]
        found = cluster.kube.get("pod", "fractional", "-n", namespace)
        assert found["status"].get("phase") != "Running"


# --- 5. the daemon restarts ------------------------------------------------------------------


def test_daemon_restart_keeps_pinning(cluster: Cluster, target: Target, namespace: str) -> None:
    node, size = target.node, target.size
    everything = node.shareable
    cluster.create(claim_template("cpus", namespace, str(size)))
    cluster.start(
        exclusive_pod("before", namespace, node.name, template="cpus", cpu_resources=str(size))
    )
    before = cluster.exclusive_cpus(namespace, "before")
    cluster.start(shared_pod("shared", namespace, node.name))
    cluster.expect_cpus(
        namespace, "shared", everything - before, timeout=WIDEN_TIMEOUT, poke_node=node.name
    )

    (old,) = cluster.daemon_pods(node.name)
    cluster.kube.delete("pod", old["metadata"]["name"], namespace="dracpu")
    cluster.ready_daemon(node.name, not_uid=old["metadata"]["uid"])

    # The restarted daemon restored the claim (checkpoint) and re-pinned every container
    # (NRI Synchronize): nothing moved.
    assert cluster.exclusive_cpus(namespace, "before") == before
    cluster.expect_cpus(namespace, "shared", everything - before, timeout=SAME_REPLY_TIMEOUT)
    poll(
        lambda: cluster.devices(node.name),
        lambda devices: sorted(devices) == sorted(node.grouped_devices()),
        timeout=WIDEN_TIMEOUT,
        what=f"the restarted daemon's ResourceSlices of node {node.name}",
    )

    # New claims still work, beside the one prepared before the restart (where the node has
    # room for both: on a 2-CPU node the restart and the release below are what is checked).
    after: frozenset[int] = frozenset()
    if target.room_for_two_claims:
        cluster.start(
            exclusive_pod("after", namespace, node.name, template="cpus", cpu_resources=str(size))
        )
        after = cluster.exclusive_cpus(namespace, "after")
        assert len(after) == size
        assert not after & before, f"overlap: {format_cpulist(after)} / {format_cpulist(before)}"
        cluster.expect_cpus(
            namespace, "shared", everything - before - after, timeout=SAME_REPLY_TIMEOUT
        )

    # The claim prepared by the previous daemon is unprepared by this one.
    at_once = cluster.widens_at_once(node.name)
    cluster.delete_pod(namespace, "before")
    cluster.expect_cpus(
        namespace,
        "shared",
        everything - after,
        timeout=WIDEN_TIMEOUT,
        poke_node=None if at_once else node.name,
    )
    if after:
        assert cluster.exclusive_cpus(namespace, "after") == after
