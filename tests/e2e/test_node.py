"""dracpu's features as a real kubelet, API server and scheduler see them: device metadata and
health in the pod, a claim shared by a pod's containers, opaque claim config, the
ValidatingAdmissionPolicy on dracpu's own token, rolling updates, SIGHUP, a pod deleted while
dracpu is down, and individual mode.

Run with the rest of the suite (``just e2e-local``, ``just e2e``; ``DRACPU_E2E=1``). Tests that
change the deployment (the config map, the DaemonSet) put it back afterwards, and wait until
dracpu is Ready with its slices again: the config map through :func:`daemon_config`, which
switches the device mode or the reserved CPUs by editing ``config.yaml`` and restarting or
signalling the daemons (how to run another mode on a cluster: `tests/e2e/README.md`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.cluster import (
    DAEMON_NAMESPACE,
    DAEMON_SELECTOR,
    Cluster,
    Target,
    claim_result,
)
from tests.e2e.kube import Kubectl, KubectlError, format_cpulist, parse_cpulist, poll
from tests.e2e.workloads import (
    CLAIM_REQUEST,
    CPU_CAPACITY,
    DRIVER,
    OBSERVE,
    SEEN_BY_INIT,
    SIDE_CONTAINER,
    WORK_CONTAINER,
    claim_sharing_pod,
    claim_template,
    exclusive_pod,
    shared_pod,
)

__all__: list[str] = []

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

# An NRI reply or a health update, seen through kubectl: seconds.
SOON = 60.0
# The kubelet syncs a changed config map into a running pod's volume at its next sync of the
# pod (a minute by default, plus its cache's time to live).
CONFIG_SYNC_TIMEOUT = 180.0
# A pod that cannot start because of its claim: the kubelet's Warning events.
PENDING_TIMEOUT = 120.0
# A claim whose pod went while dracpu was down: the kubelet retries Unprepare with a back-off;
# else the reconciliation releases it after --orphan-grace (5m) plus a listing (60s).
RELEASE_TIMEOUT = 420.0
# Where the kubelet puts a claim's device metadata in the container (KEP-5304): a claim made
# from a template is under its pod claim name (exclusive-pod.yaml's claim entry is "cpus").
METADATA_FILE = (
    "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/"
    f"{CLAIM_REQUEST}/{CLAIM_REQUEST}/{DRIVER}-metadata.json"
)
# The daemon's config file in its config map (deploy/kustomize/base/configmap.yaml).
CONFIG_MAP = "dracpu-config"
CONFIG_KEY = "config.yaml"
# The ValidatingAdmissionPolicy of deploy/kustomize/base.
POLICY = "dracpu-resourceslices-own-node"


def _start_exclusive(
    cluster: Cluster, target: Target, namespace: str, name: str = "exclusive", **config: Any
) -> frozenset[int]:
    cluster.create(claim_template(name, namespace, str(target.size), cpu_config=config or None))
    cluster.start(
        exclusive_pod(
            name, namespace, target.node.name, template=name, cpu_resources=str(target.size)
        )
    )
    return cluster.exclusive_cpus(namespace, name)


def _exclusive_beside_shared(
    cluster: Cluster, target: Target, namespace: str
) -> tuple[frozenset[int], str]:
    """An exclusive pod and a shared one beside it, on the rest; the claim's cpus and UID."""
    cpus = _start_exclusive(cluster, target, namespace)
    uid: str = cluster.claim_of(namespace, "exclusive")["metadata"]["uid"]
    cluster.start(shared_pod("shared", namespace, target.node.name))
    cluster.expect_cpus(namespace, "shared", target.node.shareable - cpus, timeout=SOON)
    return cpus, uid


# --- what the container is given besides its cpus -------------------------------------------


def test_device_metadata_and_health_reach_the_container(
    cluster: Cluster, target: Target, namespace: str
) -> None:
    node = target.node
    cpus = _start_exclusive(cluster, target, namespace)
    claim = cluster.claim_of(namespace, "exclusive")
    result = claim_result(claim, node.name)

    # KEP-5304: the kubelet mounted our metadata file (named by our CDI spec) where a workload
    # finds it, and it describes exactly the allocated device and the claim's cpus.
    text = cluster.kube.run(
        "exec", "-n", namespace, "exclusive", "-c", WORK_CONTAINER, "--", "cat", METADATA_FILE
    )
    document = json.loads(text)
    assert document["kind"] == "DeviceMetadata"
    assert document["metadata"]["uid"] == claim["metadata"]["uid"]
    assert document["podClaimName"] == CLAIM_REQUEST
    (request,) = document["requests"]
    assert request["name"] == CLAIM_REQUEST
    (device,) = request["devices"]
    assert (device["driver"], device["pool"], device["name"]) == (
        DRIVER,
        node.name,
        result["device"],
    )
    allocated = device["attributes"]["dra.cpu/allocatedCPUIDs"]["ints"]
    assert frozenset(allocated) == cpus, f"metadata cpus {allocated}, pinned to {cpus}"

    # KEP-4680: the kubelet shows the health our stream reports for the claim's device.
    def health() -> list[dict[str, Any]]:
        pod = cluster.kube.get("pod", "exclusive", "-n", namespace)
        (status,) = [s for s in pod["status"]["containerStatuses"] if s["name"] == WORK_CONTAINER]
        found: list[dict[str, Any]] = status.get("allocatedResourcesStatus") or []
        return found

    statuses = poll(health, bool, timeout=SOON, what="allocatedResourcesStatus of the pod")
    assert len(statuses) == 1, statuses
    assert statuses[0]["name"] == f"claim:{CLAIM_REQUEST}"
    (resource,) = statuses[0]["resources"]
    assert resource["health"] == "Healthy"
    # The kubelet names the device by its first CDI device id: our spec's, for this claim.
    assert claim["metadata"]["uid"] in resource["resourceID"]


# --- a claim used by several containers of its pod ------------------------------------------


def test_a_claim_is_shared_by_its_pods_init_and_app_containers(
    cluster: Cluster, target: Target, namespace: str
) -> None:
    """docs/pods.md: an init container and two app containers of the pod the claim is reserved
    for all run on the claim's CPUs (a driver that refused the claim's second user would leave
    the pod Pending with a failed CreateContainer), and a plain pod stays off them."""
    cluster.create(claim_template("sharing", namespace, str(target.size)))
    cluster.start(
        claim_sharing_pod(
            "sharing",
            namespace,
            target.node.name,
            template="sharing",
            cpu_resources=str(target.size),
        )
    )
    cpus = cluster.exclusive_cpus(namespace, "sharing")  # the work container, env and pins
    key = f"DRA_CPUSET_{cluster.claim_of(namespace, 'sharing')['metadata']['uid']}"
    side = cluster.kube.exec_python(namespace, "sharing", SIDE_CONTAINER, OBSERVE)
    init = json.loads(
        cluster.kube.run(
            "exec", "-n", namespace, "sharing", "-c", WORK_CONTAINER, "--", "cat", SEEN_BY_INIT
        )
    )
    for name, seen in (("init", init), (SIDE_CONTAINER, side)):
        assert parse_cpulist(seen["self"]) == cpus, f"{name}: {seen}, the claim's cpus {cpus}"
        assert parse_cpulist(seen["pid1"]) == cpus, f"{name}: {seen}, the claim's cpus {cpus}"
        assert seen["dra"] == {key: format_cpulist(cpus)}, f"{name}: {seen}"
    cluster.start(shared_pod("shared", namespace, target.node.name))
    cluster.expect_cpus(namespace, "shared", target.node.shareable - cpus, timeout=SOON)


# --- opaque config ---------------------------------------------------------------------------


def test_opaque_config_chooses_the_cpus(cluster: Cluster, target: Target, namespace: str) -> None:
    node = target.node
    # The highest shareable CPUs: not what the default (packed, lowest first) would take.
    wanted = frozenset(sorted(node.shareable)[-target.size :])
    cpus = _start_exclusive(
        cluster, target, namespace, "chosen", cpuset=format_cpulist(wanted), policy="spread"
    )
    assert cpus == wanted
    checkpoint = cluster.checkpoint(node.name)
    uid = cluster.claim_of(namespace, "chosen")["metadata"]["uid"]
    assert parse_cpulist(checkpoint[uid]["cpus"]) == wanted


def test_an_invalid_opaque_config_fails_the_pod_with_the_drivers_error(
    cluster: Cluster, target: Target, namespace: str
) -> None:
    cluster.create(
        claim_template("bad", namespace, str(target.size), cpu_config={"policy": "dense"})
    )
    cluster.create(
        exclusive_pod(
            "bad", namespace, target.node.name, template="bad", cpu_resources=str(target.size)
        )
    )
    # docs/claim-config.md, "Errors": the claim and the field, in the kubelet's Warning.
    warnings = poll(
        partial(cluster.events, namespace, "bad", kind="Warning", text="cpuConfig.policy"),
        bool,
        timeout=PENDING_TIMEOUT,
        what=f"the kubelet to report the driver's refusal of {namespace}/bad's config",
    )
    message = warnings[-1]["message"]
    assert "'dense' is not one of packed, spread" in message, message
    assert cluster.kube.get("pod", "bad", "-n", namespace)["status"].get("phase") == "Pending"


# --- the ValidatingAdmissionPolicy, on dracpu's own credentials -------------------------------


def test_dracpus_token_may_write_only_its_own_nodes_slices(
    cluster: Cluster, target: Target, tmp_path: Path
) -> None:
    node = target.node.name
    daemon = cluster.kube.get("pod", cluster.ready_daemon(node), "-n", DAEMON_NAMESPACE)
    # A token of dracpu's service account bound to its pod, as the kubelet projects it: the API
    # server adds the pod's node name to its user's extra (ServiceAccountTokenPodNodeInfo).
    token = cluster.kube.run(
        "create",
        "token",
        "dracpu",
        "-n",
        DAEMON_NAMESPACE,
        "--bound-object-kind=Pod",
        f"--bound-object-name={daemon['metadata']['name']}",
        f"--bound-object-uid={daemon['metadata']['uid']}",
        "--duration=10m",
    ).strip()
    view = json.loads(cluster.kube.run("config", "view", "--minify", "--raw", "-o", "json"))
    (entry,) = view["clusters"]
    kubeconfig = tmp_path / "dracpu.kubeconfig"
    kubeconfig.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "e2e", "cluster": entry["cluster"]}],
                "users": [{"name": "dracpu", "user": {"token": token}}],
                "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": "dracpu"}}],
                "current-context": "e2e",
            }
        )
    )
    as_dracpu = Kubectl(kubeconfig=str(kubeconfig))
    review = json.loads(as_dracpu.run("auth", "whoami", "-o", "json"))
    assert review["status"]["userInfo"]["extra"]["authentication.kubernetes.io/node-name"] == [node]

    def slice_of(owner: str) -> str:
        return json.dumps(
            {
                "apiVersion": "resource.k8s.io/v1",
                "kind": "ResourceSlice",
                "metadata": {"name": f"e2e-policy-{owner}"},
                "spec": {
                    "driver": DRIVER,
                    "nodeName": owner,
                    "pool": {"name": owner, "generation": 1, "resourceSliceCount": 1},
                    "devices": [],
                },
            }
        )

    # Its own node's slice: RBAC and the policy let it through (a dry run: nothing stored).
    as_dracpu.run("create", "--dry-run=server", "-f", "-", stdin=slice_of(node))
    with pytest.raises(KubectlError) as refused:
        as_dracpu.run("create", "--dry-run=server", "-f", "-", stdin=slice_of("another-node"))
    message = str(refused.value)
    assert POLICY in message, message
    assert f"dracpu on node {node} may not write ResourceSlices of node 'another-node'" in message


# --- the daemon goes and comes back ----------------------------------------------------------


def test_a_rolling_update_keeps_the_pinning_and_the_checkpoint(
    cluster: Cluster, target: Target, namespace: str
) -> None:
    node = target.node
    before, uid = _exclusive_beside_shared(cluster, target, namespace)
    pod_uid = cluster.kube.get("pod", "exclusive", "-n", namespace)["metadata"]["uid"]
    recorded = cluster.checkpoint(node.name)[uid]
    assert parse_cpulist(recorded["cpus"]) == before
    assert recorded["podUids"] == [pod_uid]

    (old,) = cluster.daemon_pods(node.name)
    cluster.restart_daemons()
    cluster.ready_daemon(node.name, not_uid=old["metadata"]["uid"])

    assert cluster.checkpoint(node.name)[uid] == recorded
    assert cluster.exclusive_cpus(namespace, "exclusive") == before
    cluster.expect_cpus(namespace, "shared", node.shareable - before, timeout=SOON)
    # The new instance unprepares the claim the old one prepared.
    cluster.delete_pod(namespace, "exclusive")
    cluster.expect_cpus(
        namespace, "shared", node.shareable, timeout=SOON, poke_node=_poke(cluster, node.name)
    )
    assert uid not in cluster.checkpoint(node.name)


def test_a_pod_deleted_while_dracpu_is_down_has_its_claim_released(
    cluster: Cluster, target: Target, namespace: str
) -> None:
    node = target.node
    _, uid = _exclusive_beside_shared(cluster, target, namespace)

    with _daemons_stopped(cluster, node.name):
        # The kubelet cannot reach the driver now: the pod goes, its claim stays prepared.
        cluster.kube.run("delete", "pod", "exclusive", "-n", namespace, "--wait=false")
        poll(
            lambda: cluster.kube.items(
                "pods", "-n", namespace, "--field-selector", "metadata.name=exclusive"
            ),
            lambda pods: not pods or _stopped(pods[0]),
            timeout=SOON,
            what=f"pod {namespace}/exclusive's container to stop",
        )

    # Back: the kubelet's retried Unprepare, or the PodResources reconciliation (the claim is
    # in no pod's listing), releases the claim: the checkpoint forgets it and the shared
    # container gets its cpus back.
    cluster.expect_cpus(
        namespace,
        "shared",
        node.shareable,
        timeout=RELEASE_TIMEOUT,
        poke_node=_poke(cluster, node.name),
    )
    poll(
        lambda: cluster.checkpoint(node.name),
        lambda claims: uid not in claims,
        timeout=SOON,
        what=f"claim {uid} to leave the checkpoint",
    )
    poll(
        lambda: cluster.kube.items(
            "pods", "-n", namespace, "--field-selector", "metadata.name=exclusive"
        ),
        lambda pods: not pods,
        timeout=RELEASE_TIMEOUT,
        what=f"pod {namespace}/exclusive to be gone",
    )
    log = cluster.daemon_logs(node.name)
    assert f"unprepared claim {namespace}/" in log or f"released orphan claim {namespace}/" in log


def _stopped(pod: dict[str, Any]) -> bool:
    """Have the pod's containers terminated? (Its phase stays Running until the kubelet has
    unprepared its claims, which it cannot while the driver is away.)"""
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(statuses) and all("terminated" in s.get("state", {}) for s in statuses)


@contextmanager
def _daemons_stopped(cluster: Cluster, node: str) -> Iterator[None]:
    """No dracpu on the node while inside: the DaemonSet selects no node, then again every one."""
    selector = "dracpu-e2e/paused"
    patch = json.dumps({"spec": {"template": {"spec": {"nodeSelector": {selector: "true"}}}}})
    cluster.kube.run("patch", "-n", DAEMON_NAMESPACE, "daemonset/dracpu", "-p", patch)
    try:
        poll(
            lambda: cluster.kube.items("pods", "-n", DAEMON_NAMESPACE, "-l", DAEMON_SELECTOR),
            lambda pods: not pods,
            timeout=SOON * 3,
            what="the dracpu pods to be gone",
        )
        yield
    finally:
        back = json.dumps({"spec": {"template": {"spec": {"nodeSelector": None}}}})
        cluster.kube.run("patch", "-n", DAEMON_NAMESPACE, "daemonset/dracpu", "-p", back)
        cluster.wait_deployed(timeout=SOON * 5)


# --- the config file: SIGHUP and another device mode -----------------------------------------


@contextmanager
def daemon_config(cluster: Cluster, change: Callable[[dict[str, Any]], None]) -> Iterator[str]:
    """The daemons' config file changed by ``change`` while inside (the new text is given);
    put back afterwards, the daemons restarted and Ready with their slices again."""
    configmap = cluster.kube.get("configmap", CONFIG_MAP, "-n", DAEMON_NAMESPACE)
    original = configmap["data"][CONFIG_KEY]
    config = yaml.safe_load(original) or {}
    change(config)
    changed = yaml.safe_dump(config, sort_keys=False)

    def put(text: str) -> None:
        patch = json.dumps({"data": {CONFIG_KEY: text}})
        cluster.kube.run("patch", "configmap", CONFIG_MAP, "-n", DAEMON_NAMESPACE, "-p", patch)

    put(changed)
    try:
        yield changed
    finally:
        put(original)
        cluster.restart_daemons()
        cluster.wait_deployed(timeout=SOON * 5)


def test_sighup_applies_the_changed_reserved_cpus_and_republishes(
    cluster: Cluster, target: Target, namespace: str
) -> None:
    node = target.node
    cluster.start(shared_pod("shared", namespace, node.name))
    cluster.expect_cpus(
        namespace, "shared", node.shareable, timeout=SOON, poke_node=_poke(cluster, node.name)
    )
    generation = max(s["spec"]["pool"]["generation"] for s in cluster.slices(node.name))
    extra = max(node.shareable)  # one more reserved CPU: the highest shareable one
    reserved = node.reserved | {extra}

    def reserve(config: dict[str, Any]) -> None:
        config["reservedCPUs"] = format_cpulist(reserved)

    with daemon_config(cluster, reserve) as text:
        # The kubelet brings the new file into the running pod; then the signal reads it.
        poll(
            lambda: cluster.daemon_exec(node.name, "cat", f"/etc/dracpu/{CONFIG_KEY}"),
            lambda seen: seen == text,
            timeout=CONFIG_SYNC_TIMEOUT,
            what="the changed config file in the dracpu pod",
        )
        # The shell's builtin: the image has no kill program (docs/architecture.md, SIGHUP).
        cluster.daemon_exec(node.name, "sh", "-c", "kill -HUP 1")
        # Republished: a new pool generation whose devices leave the reserved CPU out ...
        devices = poll(
            lambda: _pool(cluster, node.name),
            lambda pool: pool[0] > generation,
            timeout=SOON,
            what=f"ResourceSlices of node {node.name} republished after SIGHUP",
        )[1]
        assert _published_cpus(devices) == len(node.allocatable) - 1, devices
        # ... and the shared pool without it, at once (reservedCPUs applies on SIGHUP).
        cluster.expect_cpus(
            namespace, "shared", node.shareable - {extra}, timeout=SOON, poke_node=node.name
        )
    cluster.expect_cpus(
        namespace, "shared", node.shareable, timeout=SOON, poke_node=_poke(cluster, node.name)
    )


def _published_cpus(devices: dict[str, dict[str, Any]]) -> int:
    """The CPUs the devices publish: a grouped device's capacity, one per individual device."""
    return sum(
        int(d["capacity"][CPU_CAPACITY]["value"]) if CPU_CAPACITY in d.get("capacity", {}) else 1
        for d in devices.values()
    )


def _poke(cluster: Cluster, node: str) -> str | None:
    """The node to poke while waiting for a widening: none when the daemon widens at once."""
    return None if cluster.widens_at_once(node) else node


def _pool(cluster: Cluster, node: str) -> tuple[int, dict[str, dict[str, Any]]]:
    slices = cluster.slices(node)
    generation = max((s["spec"]["pool"]["generation"] for s in slices), default=0)
    return generation, cluster.devices(node)


def test_individual_mode_pins_the_allocated_cpu(
    cluster: Cluster, target: Target, namespace: str
) -> None:
    node = target.node

    def individual(config: dict[str, Any]) -> None:
        config["cpuDeviceMode"] = "individual"

    with daemon_config(cluster, individual):
        cluster.restart_daemons()
        # One device per allocatable CPU, each naming its CPU.
        devices = poll(
            lambda: cluster.devices(node.name),
            lambda found: bool(found) and all(n.startswith("cpudev0") for n in found),
            timeout=SOON * 3,
            what=f"individual devices of node {node.name}",
        )
        by_name = {n: d["attributes"]["dra.cpu/cpuID"]["int"] for n, d in devices.items()}
        assert sorted(by_name.values()) == sorted(node.allocatable)

        cluster.start(shared_pod("shared", namespace, node.name))
        cluster.expect_cpus(
            namespace, "shared", node.shareable, timeout=SOON, poke_node=_poke(cluster, node.name)
        )
        cluster.create(claim_template("one", namespace, None))
        cluster.start(
            exclusive_pod("exclusive", namespace, node.name, template="one", cpu_resources="1")
        )
        cpus = cluster.exclusive_cpus(namespace, "exclusive")
        result = claim_result(cluster.claim_of(namespace, "exclusive"), node.name)
        # Exactly the CPU of the device the scheduler chose.
        assert cpus == {by_name[result["device"]]}
        cluster.expect_cpus(namespace, "shared", node.shareable - cpus, timeout=SOON)
        cluster.delete_pod(namespace, "exclusive")
        cluster.expect_cpus(
            namespace, "shared", node.shareable, timeout=SOON, poke_node=_poke(cluster, node.name)
        )
        cluster.delete_pod(namespace, "shared")
