"""The kind e2e suite's assets, checked without a cluster (the suite itself needs one).

* every manifest, and every object the suite builds from them, is a valid Kubernetes object;
* the kind config is what kind accepts and what dracpu needs (NRI socket and CDI directory where
  the DaemonSet mounts them, consumable capacity, kubelet without CPU manager, the same reserved
  CPU as the overlay, a node image pinned by digest);
* image and cluster names agree across run.sh, the overlay, the Containerfile and the manifests;
* run.sh parses, and with stub tools (never real ones) it refuses to start without its
  prerequisites, runs its steps in order when they are there, dumps diagnostics on failure and
  deletes the cluster unless asked to keep it;
* the e2e module imports and all its tests carry the ``e2e`` marker;
* the suite's own helpers (cpu lists, quantities, probe and observe scripts, the Cluster queries
  against a fake kubectl) compute the right thing.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from dracpu.config import Config
from tests.e2e import kube as kube_module
from tests.e2e.cluster import Cluster, NodeFacts, Target, claim_size, grouped_device_numa
from tests.e2e.kube import Kubectl, format_cpulist, parse_cpulist, parse_quantity, poll
from tests.e2e.model import FAULTS, ModelKubectl
from tests.e2e.workloads import (
    KIND_OVERLAY,
    MANIFESTS,
    OBSERVE,
    OVERLAYS,
    REPO,
    claim_sharing_pod,
    claim_template,
    exclusive_pod,
    load_manifest,
    overlay_image,
    overlay_reserved_cpus,
    probe_pod,
    shared_pod,
)
from tests.kustomize import build

E2E = REPO / "tests" / "e2e"
RUN_SH = E2E / "run.sh"
KIND_CONFIG = E2E / "kind-config.yaml"
BASE_DAEMONSET = REPO / "deploy" / "kustomize" / "base" / "daemonset.yaml"
# The Kubernetes version whose schemas we validate against: the newest kubernetes-validate ships.
K8S_VERSION = kubernetes_validate.latest_version()
# sigs.k8s.io/kind pkg/apis/config/v1alpha4/types.go (v0.32.0): Cluster and Node fields. kind
# decodes its config strictly, so any other key fails `kind create cluster`.
KIND_CLUSTER_KEYS = frozenset(
    {
        "kind",
        "apiVersion",
        "name",
        "nodes",
        "networking",
        "featureGates",
        "runtimeConfig",
        "kubeadmConfigPatches",
        "kubeadmConfigPatchesJSON6902",
        "containerdConfigPatches",
        "containerdConfigPatchesJSON6902",
    }
)
KIND_NODE_KEYS = frozenset(
    {
        "role",
        "image",
        "labels",
        "extraMounts",
        "extraPortMappings",
        "kubeadmConfigPatches",
        "kubeadmConfigPatchesJSON6902",
    }
)
# Feature gates the config may set, with the first Kubernetes minor that knows them
# (kubernetes/kubernetes pkg/features versioned_kube_features.go): a gate the version does not
# know stops the components.
KNOWN_GATES = {"DRAConsumableCapacity": 34, "DRAResourceClaimDeviceStatus": 32}
# A kind node image pinned as kind's release notes ask: tag and sha256 digest.
PINNED_NODE_IMAGE = re.compile(r"^kindest/node:v1\.(?P<minor>\d+)\.\d+@sha256:[0-9a-f]{64}$")
NRI_PLUGIN = "io.containerd.nri.v1.nri"  # containerd's NRI plugin id (v2 and v3 configs)
CRI_PLUGIN = "io.containerd.grpc.v1.cri"  # the CRI plugin in kind's config.toml (version 2)


def _run_sh_value(name: str) -> str:
    match = re.search(rf'^{name}="([^"]*)"', RUN_SH.read_text(), re.MULTILINE)
    assert match is not None, f"run.sh sets no {name}"
    return match.group(1)


def _kind_config() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(KIND_CONFIG.read_text())
    return config


def _manifest_docs() -> list[tuple[str, dict[str, Any]]]:
    docs: list[tuple[str, dict[str, Any]]] = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        docs.extend((path.name, doc) for doc in yaml.safe_load_all(path.read_text()) if doc)
    return docs


def _containers(obj: Mapping[str, Any]) -> list[dict[str, Any]]:
    if obj["kind"] != "Pod":
        return []
    containers: list[dict[str, Any]] = obj["spec"]["containers"]
    return containers


# --- manifests -------------------------------------------------------------------------------


def test_there_are_manifests() -> None:
    names = {name for name, _ in _manifest_docs()}
    assert {"probe-pod.yaml", "shared-pod.yaml", "claim-template.yaml", "exclusive-pod.yaml"} <= (
        names
    )


@pytest.mark.parametrize(
    "doc", [doc for _, doc in _manifest_docs()], ids=[name for name, _ in _manifest_docs()]
)
def test_manifests_validate_strictly(doc: dict[str, Any]) -> None:
    # strict=True rejects unknown fields; a missing schema is an error (warnings are errors too).
    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _built_objects() -> list[tuple[str, dict[str, Any]]]:
    return [
        ("probe", probe_pod("probe-0", "e2e-ns", "dracpu-e2e-worker")),
        ("shared", shared_pod("shared", "e2e-ns", "dracpu-e2e-worker")),
        (
            "shared-env",
            shared_pod("spoofed", "e2e-ns", "dracpu-e2e-worker", env={"DRA_CPUSET_x": "a-b"}),
        ),
        ("template", claim_template("cpus", "e2e-ns", "2")),
        ("template-milli", claim_template("fraction", "e2e-ns", "1500m")),
        (
            "exclusive",
            exclusive_pod("e", "e2e-ns", "dracpu-e2e-worker", template="cpus", cpu_resources="2"),
        ),
        (
            "exclusive-no-cpu",
            exclusive_pod("e", "e2e-ns", "dracpu-e2e-worker", template="cpus", cpu_resources=None),
        ),
        (
            "claim-sharing",
            claim_sharing_pod(
                "s", "e2e-ns", "dracpu-e2e-worker", template="cpus", cpu_resources="1"
            ),
        ),
    ]


@pytest.mark.parametrize(
    "obj", [obj for _, obj in _built_objects()], ids=[name for name, _ in _built_objects()]
)
def test_built_objects_validate_strictly(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_builders_set_what_the_tests_vary() -> None:
    pod = exclusive_pod("e-1", "ns", "node-a", template="t", cpu_resources="3")
    assert (pod["metadata"]["name"], pod["metadata"]["namespace"]) == ("e-1", "ns")
    assert pod["spec"]["nodeSelector"] == {"kubernetes.io/hostname": "node-a"}
    assert pod["spec"]["resourceClaims"] == [{"name": "cpus", "resourceClaimTemplateName": "t"}]
    (container,) = pod["spec"]["containers"]
    assert container["resources"]["claims"] == [{"name": "cpus"}]
    assert container["resources"]["requests"]["cpu"] == container["resources"]["limits"]["cpu"]
    assert container["resources"]["limits"]["cpu"] == "3"
    bare = exclusive_pod("e-2", "ns", "node-a", template="t", cpu_resources=None)
    assert "cpu" not in bare["spec"]["containers"][0]["resources"]["limits"]
    template = claim_template("t", "ns", "1500m")
    (request,) = template["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"] == {
        "deviceClassName": "dra.cpu",
        "capacity": {"requests": {"dra.cpu/cpu": "1500m"}},
    }
    env = shared_pod("s", "ns", "n", env={"DRA_CPUSET_x": "1"})["spec"]["containers"][0]["env"]
    assert env == [{"name": "DRA_CPUSET_x", "value": "1"}]
    sharing = claim_sharing_pod("c", "ns", "n", template="t", cpu_resources="1")["spec"]
    users = [*sharing["initContainers"], *sharing["containers"]]
    assert [c["name"] for c in users] == ["init", "work", "side"]
    assert all(c["resources"]["claims"] == [{"name": "cpus"}] for c in users)
    # Builders copy: the cached manifest is never changed.
    assert load_manifest("exclusive-pod.yaml")["metadata"]["name"] == "exclusive"


def test_every_pod_uses_the_loaded_image_and_never_pulls() -> None:
    image = overlay_image()
    assert image == overlay_image(OVERLAYS / "local") == _run_sh_value("IMAGE") == "dracpu:dev"
    pods = [doc for _, doc in _manifest_docs() if doc["kind"] == "Pod"]
    assert pods
    for pod in pods:
        for container in _containers(pod):
            assert container["image"] == image
            assert container["imagePullPolicy"] == "Never"  # kind load, no registry


def test_overlay_never_pulls_and_containerfile_builds_the_daemon() -> None:
    kustomization = yaml.safe_load((KIND_OVERLAY / "kustomization.yaml").read_text())
    ops = [op for patch in kustomization["patches"] for op in yaml.safe_load(patch["patch"])]
    assert {
        "op": "add",
        "path": "/spec/template/spec/containers/0/imagePullPolicy",
        "value": "Never",
    } in ops
    containerfile = (REPO / "Containerfile").read_text()
    assert re.search(r'^CMD \["/dracpu"\]$', containerfile, re.MULTILINE)
    assert "ENTRYPOINT" not in containerfile  # upstream's chart runs args[0] = /dracpu
    assert '-f "$context/Containerfile"' in RUN_SH.read_text()


# --- kind config -----------------------------------------------------------------------------


def test_kind_config_is_a_kind_cluster_config() -> None:
    config = _kind_config()
    assert config["kind"] == "Cluster"
    assert config["apiVersion"] == "kind.x-k8s.io/v1alpha4"
    assert set(config) <= KIND_CLUSTER_KEYS
    assert config["name"] == _run_sh_value("CLUSTER_NAME") == "dracpu-e2e"
    roles = [node["role"] for node in config["nodes"]]
    assert roles.count("control-plane") == 1
    assert roles.count("worker") >= 1
    for node in config["nodes"]:
        assert set(node) <= KIND_NODE_KEYS


def test_kind_nodes_run_one_pinned_image_that_knows_the_gates() -> None:
    config = _kind_config()
    images = {node["image"] for node in config["nodes"]}
    assert len(images) == 1, images
    (image,) = images
    match = PINNED_NODE_IMAGE.match(image)
    assert match is not None, f"{image!r} is not pinned by tag and digest"
    minor = int(match.group("minor"))
    assert minor >= 34, "resource.k8s.io/v1 (GA DRA) needs Kubernetes 1.34+"
    gates = config["featureGates"]
    assert gates.get("DRAConsumableCapacity") is True  # grouped devices need it before 1.36
    for gate, value in gates.items():
        assert isinstance(value, bool)
        assert gate in KNOWN_GATES, f"feature gate {gate} is not known to this test"
        assert minor >= KNOWN_GATES[gate], f"{gate} unknown to Kubernetes 1.{minor}"


def test_containerd_patch_enables_nri_and_cdi_where_the_daemonset_looks() -> None:
    daemonset = yaml.safe_load(BASE_DAEMONSET.read_text())
    pod = daemonset["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    host_paths = {
        m["mountPath"]: volumes[m["name"]]["hostPath"]["path"]
        for m in pod["containers"][0]["volumeMounts"]
        if "hostPath" in volumes[m["name"]]
    }
    patches = [tomllib.loads(p) for p in _kind_config()["containerdConfigPatches"]]
    merged: dict[str, Any] = {}
    for patch in patches:
        for plugin, table in patch["plugins"].items():
            merged.setdefault(plugin, {}).update(table)
    nri = merged[NRI_PLUGIN]
    assert nri["disable"] is False
    assert nri["disable_connections"] is False  # else no socket for an external plugin
    socket = Path(nri["socket_path"])
    # The daemon connects to its default --nri-socket (the overlay does not override it) inside
    # the hostPath the DaemonSet mounts at the same place.
    assert socket == Config(node_name="n").nri_socket
    assert host_paths[str(socket.parent)] == str(socket.parent)
    cri = merged[CRI_PLUGIN]
    assert cri["enable_cdi"] is True
    cdi_dir = str(Config(node_name="n").cdi_dir)
    assert cdi_dir in cri["cdi_spec_dirs"]
    assert host_paths[cdi_dir] == cdi_dir
    args = " ".join(_overlay_args())
    assert "--nri-socket" not in args
    assert "--cdi-dir" not in args
    (configmap,) = [o for o in build(KIND_OVERLAY) if o["kind"] == "ConfigMap"]
    assert not {"nriSocket", "cdiDir"} & set(yaml.safe_load(configmap["data"]["config.yaml"]))


def _overlay_args() -> list[str]:
    (daemonset,) = [o for o in build(KIND_OVERLAY) if o["kind"] == "DaemonSet"]
    container = daemonset["spec"]["template"]["spec"]["containers"][0]
    args: list[str] = container["command"] + container.get("args", [])
    return args


def test_kubelet_leaves_cpus_to_dracpu_and_reserves_the_same_cpu() -> None:
    patches = [yaml.safe_load(p) for p in _kind_config()["kubeadmConfigPatches"]]
    (kubelet,) = [p for p in patches if p["kind"] == "KubeletConfiguration"]
    assert kubelet["cpuManagerPolicy"] == "none"
    reserved = overlay_reserved_cpus(KIND_OVERLAY)
    assert parse_cpulist(kubelet["reservedSystemCPUs"]) == reserved == {0}


# --- run.sh ----------------------------------------------------------------------------------


def test_run_sh_is_executable_and_parses() -> None:
    assert os.access(RUN_SH, os.X_OK)
    subprocess.run(["bash", "-n", str(RUN_SH)], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_run_sh_passes_shellcheck() -> None:
    done = subprocess.run(["shellcheck", str(RUN_SH)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_readme_documents_every_variable_run_sh_reads() -> None:
    readme = (E2E / "README.md").read_text()
    variables = set(re.findall(r"\$\{([A-Z_]+):[-+]", RUN_SH.read_text())) - {"TMPDIR"}
    assert {"KEEP_CLUSTER", "KIND_NODE_IMAGE", "CONTAINER_ENGINE"} <= variables
    for name in sorted(variables):
        assert f"`{name}" in readme, f"tests/e2e/README.md does not document {name}"


# Stub tools for run.sh: each appends its command line to $STUB_LOG and acts on nothing. They
# let the test drive every branch of run.sh without Docker, kind or a cluster.
_STUBS = {
    "kind": """
case "$1" in
  version) echo "kind v$STUB_KIND_VERSION go1.25.1 linux/amd64" ;;
  get) [ "$2" = clusters ] && [ -n "$STUB_CLUSTERS" ] && echo "$STUB_CLUSTERS" ;;
  create)
    while [ $# -gt 0 ]; do
      [ "$1" = --kubeconfig ] && echo "apiVersion: v1" > "$2"
      shift
    done ;;
esac
exit 0
""",
    "docker": """
case "$1" in
  info)
    [ "$STUB_ENGINE_UP" = 1 ] || exit 1
    case "$*" in
      *CgroupVersion*) echo "$STUB_CGROUP" ;;
      *NCPU*) echo "$STUB_CPUS" ;;
    esac ;;
  build)
    for last; do :; done
    if [ -f "$last/Containerfile" ] && [ -d "$last/src/dracpu" ] && [ ! -e "$last/.venv" ]; then
      echo "context ok" >> "$STUB_LOG"
    fi ;;
esac
exit 0
""",
    "kubectl": "exit 0\n",
    "python": '[ "$1" = -c ] && exit 0\nexit "$STUB_PYTEST_RC"\n',
}
# Real tools run.sh uses once its checks passed.
_REAL_TOOLS = ("mkdir", "mktemp", "rm", "tail", "tar")


class RunSh:
    """run.sh with a PATH of stub tools (and, optionally, no tools at all)."""

    def __init__(self, root: Path) -> None:
        self.bin = root / "bin"
        self.bin.mkdir()
        self.log = root / "calls.log"
        self.artifacts = root / "artifacts"
        self.tmp = root / "tmp"
        self.tmp.mkdir()
        self.env = {
            "PATH": str(self.bin),
            "TMPDIR": str(self.tmp),
            "STUB_LOG": str(self.log),
            "STUB_KIND_VERSION": "0.32.0",
            "STUB_CLUSTERS": "",
            "STUB_ENGINE_UP": "1",
            "STUB_CGROUP": "2",
            "STUB_CPUS": "8",
            "STUB_PYTEST_RC": "0",
            "PYTHON": str(self.bin / "python"),
            "ARTIFACTS": str(self.artifacts),
        }

    def stub(self, *names: str) -> None:
        for name in names:
            path = self.bin / name
            path.write_text(f'#!/bin/sh\necho "{name} $*" >> "$STUB_LOG"\n{_STUBS[name]}')
            path.chmod(0o755)

    def real_tools(self) -> None:
        for tool in _REAL_TOOLS:
            found = shutil.which(tool)
            assert found is not None, f"{tool} is needed to test run.sh"
            (self.bin / tool).symlink_to(found)

    def run(self, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["/bin/bash", str(RUN_SH)],
            env={**self.env, **env},
            capture_output=True,
            text=True,
            timeout=60,
            cwd=self.tmp,
        )

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def run_sh(tmp_path: Path) -> RunSh:
    return RunSh(tmp_path)


def test_run_sh_without_any_tool_says_what_is_missing(run_sh: RunSh) -> None:
    done = run_sh.run()
    assert done.returncode == 2
    assert "not on PATH: docker (or podman), kind, kubectl" in done.stderr
    assert "Nothing was run" in done.stderr
    assert run_sh.calls() == []


def test_run_sh_without_a_container_engine_touches_nothing(run_sh: RunSh) -> None:
    run_sh.stub("kind", "kubectl", "python")
    done = run_sh.run()
    assert done.returncode == 2
    assert "not on PATH: docker (or podman)." in done.stderr
    assert run_sh.calls() == []


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"STUB_ENGINE_UP": "0"}, "is the docker daemon running"),
        ({"STUB_CGROUP": "1"}, "need cgroup v2"),
        ({"STUB_CPUS": "2"}, "has 2 CPUs; the suite needs 4"),
        ({"STUB_KIND_VERSION": "0.31.0"}, "older than v0.32.0"),
        ({"STUB_CLUSTERS": "other\ndracpu-e2e"}, "a kind cluster named dracpu-e2e exists"),
        ({"PYTHON": "/nonexistent/python"}, "no Python at /nonexistent/python"),
    ],
    ids=["engine-down", "cgroup-v1", "few-cpus", "old-kind", "cluster-exists", "no-python"],
)
def test_run_sh_refuses_before_creating_anything(
    run_sh: RunSh, env: dict[str, str], message: str
) -> None:
    run_sh.stub("kind", "kubectl", "docker", "python")
    done = run_sh.run(**env)
    assert done.returncode == 2, done.stderr
    assert message in done.stderr
    acting = [
        c for c in run_sh.calls() if not re.match(r"^(docker info|kind (version|get)|python -c)", c)
    ]
    assert acting == [], "run.sh acted before its checks passed"
    assert not run_sh.artifacts.exists()


def _steps(calls: list[str]) -> list[str]:
    """The calls that change something, reduced to their first words."""
    return [
        " ".join(call.split()[:3])
        for call in calls
        if not re.match(r"^(docker info|kind (version|get)|python -c)", call)
    ]


def test_run_sh_sets_up_tests_and_deletes_the_cluster(run_sh: RunSh) -> None:
    run_sh.stub("kind", "kubectl", "docker", "python")
    run_sh.real_tools()
    done = run_sh.run()
    assert done.returncode == 0, done.stderr
    calls = run_sh.calls()
    assert _steps(calls) == [
        "kind create cluster",
        "docker build -t",
        "context ok",
        "kind load docker-image",
        "kubectl apply -k",
        "kubectl -n dracpu",
        "python -m pytest",
        "kind delete cluster",
    ]
    kubeconfig = run_sh.artifacts / "kubeconfig"
    (create,) = [c for c in calls if c.startswith("kind create")]
    assert f"--config {KIND_CONFIG}" in create
    assert f"--kubeconfig {kubeconfig}" in create
    assert "--name dracpu-e2e" in create
    (build,) = [c for c in calls if c.startswith("docker build")]
    assert "-t dracpu:dev" in build
    assert "kind load docker-image dracpu:dev --name dracpu-e2e" in calls
    assert f"kubectl apply -k {REPO}/deploy/kustomize/overlays/kind" in calls
    (pytest_call,) = [c for c in calls if c.startswith("python -m pytest")]
    assert pytest_call.startswith("python -m pytest tests/e2e -m e2e")
    assert not (run_sh.artifacts / "diagnostics").exists()
    assert list(run_sh.tmp.iterdir()) == []  # the build context copy is gone


def test_run_sh_dumps_diagnostics_when_tests_fail(run_sh: RunSh) -> None:
    run_sh.stub("kind", "kubectl", "docker", "python")
    run_sh.real_tools()
    done = run_sh.run(STUB_PYTEST_RC="1", SKIP_BUILD="1")
    assert done.returncode == 1
    calls = run_sh.calls()
    assert not any(c.startswith("docker build") for c in calls)
    assert "kubectl get resourceslices -o yaml" in calls
    assert "kubectl get resourceclaims -A -o yaml" in calls
    assert any(c.startswith("kind export logs") for c in calls)
    assert (run_sh.artifacts / "diagnostics" / "resourceslices.yaml").exists()
    assert calls[-1] == "kind delete cluster --name dracpu-e2e"
    assert "failed (exit 1)" in done.stderr


def test_run_sh_keeps_the_cluster_when_asked(run_sh: RunSh) -> None:
    run_sh.stub("kind", "kubectl", "docker", "python")
    run_sh.real_tools()
    done = run_sh.run(KEEP_CLUSTER="1", SKIP_BUILD="1")
    assert done.returncode == 0, done.stderr
    assert not any(c.startswith("kind delete") for c in run_sh.calls())
    assert f"export KUBECONFIG={run_sh.artifacts / 'kubeconfig'}" in done.stderr


def test_run_sh_reuses_a_cluster_and_restarts_the_daemonset(run_sh: RunSh) -> None:
    run_sh.stub("kind", "kubectl", "docker", "python")
    run_sh.real_tools()
    done = run_sh.run(STUB_CLUSTERS="dracpu-e2e", REUSE_CLUSTER="1", SKIP_BUILD="1")
    assert done.returncode == 0, done.stderr
    steps = _steps(run_sh.calls())
    assert "kind create cluster" not in steps
    assert "kind delete cluster" not in steps
    assert "kubectl -n dracpu rollout restart daemonset/dracpu" in run_sh.calls()


# --- the e2e module --------------------------------------------------------------------------


def test_e2e_module_imports_and_every_test_is_marked() -> None:
    module = importlib.import_module("tests.e2e.test_kind")
    tests = [
        f for name, f in inspect.getmembers(module, inspect.isfunction) if name.startswith("test_")
    ]
    assert len(tests) >= 6
    marks = {mark.name for mark in module.pytestmark}
    assert "e2e" in marks


def test_e2e_tests_are_skipped_with_the_reason(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "DRACPU_E2E"}
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(E2E / "test_kind.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stdout
    module = importlib.import_module("tests.e2e.test_kind")
    count = sum(1 for name in vars(module) if name.startswith("test_"))
    assert re.search(rf"\b{count} skipped\b", done.stdout), done.stdout
    assert "run `just e2e-local`" in done.stdout  # -ra prints the reason


# --- the suite's helpers ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "cpus"),
    [("", set()), ("0", {0}), ("0-3,8", {0, 1, 2, 3, 8}), ("1,3-4\n", {1, 3, 4})],
)
def test_cpulists_parse_and_format(text: str, cpus: set[int]) -> None:
    assert parse_cpulist(text) == cpus
    assert parse_cpulist(format_cpulist(cpus)) == cpus
    assert format_cpulist(cpus) == text.strip()


@pytest.mark.parametrize("text", ["a-b", "3-1", "1,,2", "-1", "0-"])
def test_bad_cpulists_are_refused(text: str) -> None:
    with pytest.raises(ValueError, match=r"cpu list|backwards"):
        parse_cpulist(text)


def test_quantities() -> None:
    assert parse_quantity("2") == 2
    assert parse_quantity("1500m") == Fraction(3, 2)
    with pytest.raises(ValueError, match="quantity"):
        parse_quantity("1.5")


def test_poll_returns_the_first_good_value_or_names_what_it_waited_for() -> None:
    values = iter([1, 2, 3])
    assert poll(lambda: next(values), lambda v: v >= 2, timeout=5, what="x", interval=0) == 2
    with pytest.raises(AssertionError, match="waiting for the moon; last: 0"):
        poll(lambda: 0, bool, timeout=0, what="the moon", interval=0)


def _facts(numa: dict[int, str], isolated: str = "") -> NodeFacts:
    online = format_cpulist(set().union(*(parse_cpulist(v) for v in numa.values())))
    probe = {
        "online": online,
        "isolated": isolated,
        "numa": {str(k): v for k, v in numa.items()},
        "allowed": online,
    }
    return NodeFacts.from_probe("node", probe, frozenset({0}))


def test_node_facts_give_the_devices_the_driver_must_publish() -> None:
    facts = _facts({0: "0-3", 1: "4-7", 2: ""}, isolated="7")
    assert facts.allocatable == set(range(1, 8))
    assert facts.shareable == set(range(1, 7))
    # NUMA node 2 has no CPUs (memory only): no device; node 0 loses the reserved CPU 0.
    assert facts.grouped_devices() == {"cpudevnuma000": (0, 3), "cpudevnuma001": (1, 4)}
    assert grouped_device_numa("cpudevnuma001") == 1
    with pytest.raises(AssertionError, match="not a grouped-by-NUMA device"):
        grouped_device_numa("cpudev001")


def test_claim_size_fits_two_claims_and_a_shared_cpu_or_one_claim_and_a_shared_cpu() -> None:
    assert claim_size(_facts({0: "0-3"})) == 1  # 3 allocatable: 1 + 1 + 1 shared
    assert claim_size(_facts({0: "0-5"})) == 2  # 5 allocatable: 2 + 2 + 1 shared
    assert claim_size(_facts({0: "0-2", 1: "3-4"})) == 1  # two 2-CPU groups, 4 shareable
    three = _facts({0: "0-3"})
    roomy = Target(node=three, nodes={"node": three}, size=1)
    assert roomy.room_for_two_claims
    assert roomy.room_for_two_cpu_claim
    # 2 allocatable (the local cluster's 2-CPU node): one 1-CPU claim and a shared CPU, and
    # nothing more at once.
    two = _facts({0: "0-2"})
    assert claim_size(two) == 1
    small = Target(node=two, nodes={"node": two}, size=1)
    assert not small.room_for_two_claims
    assert not small.room_for_two_cpu_claim
    with pytest.raises(AssertionError, match="too few CPUs"):
        claim_size(_facts({0: "0-1"}))


def test_probe_script_reads_this_machine() -> None:
    (container,) = load_manifest("probe-pod.yaml")["spec"]["containers"]
    assert container["command"] == ["python3", "-c"]
    done = subprocess.run(
        [sys.executable, "-c", container["args"][0]],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    )
    facts = NodeFacts.from_probe("here", json.loads(done.stdout), frozenset())
    assert facts.online == parse_cpulist(Path("/sys/devices/system/cpu/online").read_text())
    assert facts.probe_allowed == os.sched_getaffinity(0)
    assert set().union(*facts.numa.values()) == facts.online


def test_observe_script_reports_cpus_and_claim_env() -> None:
    # Run as this test's child rather than PID 1 of a container: read our own process instead.
    script = OBSERVE.replace('"/proc/1/environ"', '"/proc/self/environ"').replace(
        "allowed(1)", 'allowed("self")'
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        env={"PATH": os.environ.get("PATH", ""), "DRA_CPUSET_abc": "1-2", "OTHER": "x"},
    )
    seen = json.loads(done.stdout)
    assert seen["dra"] == {"DRA_CPUSET_abc": "1-2"}
    assert parse_cpulist(seen["self"]) == parse_cpulist(seen["pid1"]) == os.sched_getaffinity(0)


# A fake kubectl: answers each command line from a JSON table.
_FAKE_KUBECTL = """
import json, os, sys
args = sys.argv[1:]
table = json.load(open(os.environ["FAKE_KUBECTL_TABLE"]))
key = " ".join(args)
if key not in table:
    sys.stderr.write("fake kubectl: no answer for " + key + "\\n")
    sys.exit(1)
answer = table[key]
sys.stdout.write(answer if isinstance(answer, str) else json.dumps(answer))
"""


@pytest.fixture
def fake_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeCluster:
    return FakeCluster(tmp_path, monkeypatch)


class FakeCluster:
    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.table: dict[str, Any] = {}
        self.table_path = root / "table.json"
        binary = root / "kubectl"
        binary.write_text(f"#!{sys.executable}\n{_FAKE_KUBECTL}")
        binary.chmod(0o755)
        monkeypatch.setenv("FAKE_KUBECTL_TABLE", str(self.table_path))
        self.kube = Kubectl(binary=str(binary))
        self.cluster = Cluster(self.kube, root / "artifacts")

    def answer(self, command: str, value: Any) -> None:
        self.table[command] = value
        self.table_path.write_text(json.dumps(self.table))


def _slice(node: str, generation: int, devices: dict[str, str]) -> dict[str, Any]:
    return {
        "spec": {
            "driver": "dra.cpu",
            "nodeName": node,
            "pool": {"name": node, "generation": generation, "resourceSliceCount": 1},
            "devices": [
                {"name": name, "capacity": {"dra.cpu/cpu": {"value": value}}}
                for name, value in devices.items()
            ],
        }
    }


def _claim(pool: str, device: str, consumed: str, driver: str = "dra.cpu") -> dict[str, Any]:
    result = {"driver": driver, "pool": pool, "device": device, "request": "cpus"}
    result["consumedCapacity"] = {"dra.cpu/cpu": consumed}  # type: ignore[assignment]
    return {"status": {"allocation": {"devices": {"results": [result]}}}}


def test_free_capacity_subtracts_what_claims_on_the_pool_consume(fake_cluster: FakeCluster) -> None:
    fake_cluster.answer(
        "get resourceslices -o json",
        {
            "items": [
                _slice("w1", 1, {"cpudevnuma000": "3", "cpudevnuma001": "4"}),
                _slice("w1", 2, {"cpudevnuma000": "7", "cpudevnuma001": "8"}),  # newer
                _slice("w2", 5, {"cpudevnuma000": "9"}),
                {"spec": {"driver": "gpu.example.com", "nodeName": "w1", "pool": {}}},
            ]
        },
    )
    fake_cluster.answer(
        "get resourceclaims -A -o json",
        {
            "items": [
                _claim("w1", "cpudevnuma000", "2"),
                _claim("w1", "cpudevnuma000", "1500m"),
                _claim("w2", "cpudevnuma000", "4"),  # another node's pool
                _claim("w1", "cpudevnuma001", "3", driver="gpu.example.com"),
                {"status": {}},  # not allocated
            ]
        },
    )
    assert fake_cluster.cluster.free_capacity("w1") == {
        "cpudevnuma000": Fraction(7) - 2 - Fraction(3, 2),
        "cpudevnuma001": Fraction(8),
    }


def test_exclusive_cpus_checks_env_against_the_claim_and_the_kernel(
    fake_cluster: FakeCluster,
) -> None:
    fake_cluster.answer(
        "get pod e -n ns -o json",
        {"status": {"resourceClaimStatuses": [{"name": "cpus", "resourceClaimName": "e-cpus-x"}]}},
    )
    fake_cluster.answer(
        "get resourceclaim e-cpus-x -n ns -o json",
        {"metadata": {"name": "e-cpus-x", "uid": "u-1"}},
    )
    exec_key = f"exec -n ns e -c work -- python3 -c {OBSERVE}"
    fake_cluster.answer(exec_key, {"self": "2-3", "pid1": "2-3", "dra": {"DRA_CPUSET_u-1": "2-3"}})
    assert fake_cluster.cluster.exclusive_cpus("ns", "e") == {2, 3}
    fake_cluster.answer(exec_key, {"self": "1-3", "pid1": "2-3", "dra": {"DRA_CPUSET_u-1": "2-3"}})
    with pytest.raises(AssertionError, match="exec'd process not on DRA_CPUSET_u-1"):
        fake_cluster.cluster.exclusive_cpus("ns", "e")
    fake_cluster.answer(exec_key, {"self": "2-3", "pid1": "2-3", "dra": {"DRA_CPUSET_u-2": "2-3"}})
    with pytest.raises(AssertionError, match="expected DRA_CPUSET_u-1"):
        fake_cluster.cluster.exclusive_cpus("ns", "e")


def _daemon_pods_key(node: str) -> str:
    return (
        "get pods -n dracpu -l app.kubernetes.io/name=dracpu --field-selector "
        f"spec.nodeName={node} -o json"
    )


def test_widening_mode_comes_from_the_daemon_log_and_is_checked(
    fake_cluster: FakeCluster,
) -> None:
    fake_cluster.answer(
        _daemon_pods_key("w1"),
        {
            "items": [
                {"metadata": {"name": "dracpu-old", "deletionTimestamp": "2026-01-01T00:00:00Z"}},
                {"metadata": {"name": "dracpu-new"}},
            ]
        },
    )
    log = "NRI: configured by containerd v2.3.1 (NRI v0.12.0); unsolicited updates {}\n"
    fake_cluster.answer(
        "logs -n dracpu dracpu-new -c dracpu", log.format("off (at the next event)")
    )
    fake_cluster.answer(
        "get node w1 -o json",
        {"status": {"nodeInfo": {"containerRuntimeVersion": "containerd://2.3.1"}}},
    )
    assert fake_cluster.cluster.widens_at_once("w1") is False
    fake_cluster.answer("logs -n dracpu dracpu-new -c dracpu", log.format("on"))
    assert fake_cluster.cluster.widens_at_once("w1") is True
    fake_cluster.answer(
        "get node w1 -o json",
        {"status": {"nodeInfo": {"containerRuntimeVersion": "containerd://2.2.1"}}},
    )
    with pytest.raises(AssertionError, match="can deadlock"):
        fake_cluster.cluster.widens_at_once("w1")


def test_events_are_filtered_by_object_reason_type_and_text(fake_cluster: FakeCluster) -> None:
    def event(name: str, reason: str, kind: str, message: str, time: str) -> dict[str, Any]:
        return {
            "involvedObject": {"name": name},
            "reason": reason,
            "type": kind,
            "message": message,
            "lastTimestamp": time,
        }

    fake_cluster.answer(
        "get events -n ns -o json",
        {
            "items": [
                event("p", "FailedScheduling", "Warning", "cannot allocate all claims", "t2"),
                event("p", "Scheduled", "Normal", "ok", "t1"),
                event("q", "FailedScheduling", "Warning", "other pod", "t0"),
                event("p", "FailedPrepareDynamicResources", "Warning", "not a whole number", "t3"),
            ]
        },
    )
    cluster = fake_cluster.cluster
    assert [e["reason"] for e in cluster.events("ns", "p")] == [
        "Scheduled",
        "FailedScheduling",
        "FailedPrepareDynamicResources",
    ]
    assert len(cluster.events("ns", "p", reason="FailedScheduling")) == 1
    assert len(cluster.events("ns", "p", kind="Warning", text="whole number")) == 1
    assert cluster.events("ns", "q", kind="Normal") == []


# --- the suite against a model cluster -------------------------------------------------------

# The suite's tests, in file order, and the faults of the modelled driver each must catch.
_SUITE = (
    "test_claimed_cpus_pin_the_container",
    "test_shared_pool_shrinks_and_widens",
    "test_claims_are_disjoint",
    "test_oversized_claims_stay_pending",
    "test_refusals_carry_the_drivers_error",
    "test_fractional_claims_get_whole_cpus",
    "test_daemon_restart_keeps_pinning",
)
_CAUGHT_BY = {
    "accepts-spoofed-env": {"test_refusals_carry_the_drivers_error"},
    "forgets-claims-on-restart": {"test_daemon_restart_keeps_pinning"},
    "hands-out-reserved": {
        "test_claimed_cpus_pin_the_container",
        "test_claims_are_disjoint",
    },
    "never-widens": {"test_shared_pool_shrinks_and_widens", "test_daemon_restart_keeps_pinning"},
    "no-shrink": {
        "test_shared_pool_shrinks_and_widens",
        "test_claims_are_disjoint",
        "test_daemon_restart_keeps_pinning",
    },
}


def _run_suite(
    model: ModelKubectl,
    artifacts: Path,
    reserved: frozenset[int] | None = None,
    skipped: dict[str, str] | None = None,
) -> dict[str, str]:
    """Run the e2e tests against the model as the fixtures would; failures by test name (and
    the skips' reasons into ``skipped``). ``reserved``: the kind overlay's unless given."""
    suite = importlib.import_module("tests.e2e.test_kind")
    cluster = Cluster(model, artifacts)
    cluster.wait_deployed(timeout=5)
    target = cluster.discover(overlay_reserved_cpus(KIND_OVERLAY) if reserved is None else reserved)
    failures: dict[str, str] = {}
    try:
        suite.test_every_node_publishes_its_numa_groups(cluster, target)
    except AssertionError as exc:
        failures["test_every_node_publishes_its_numa_groups"] = str(exc)
    for name in _SUITE:
        namespace = cluster.create_namespace(name)
        try:
            getattr(suite, name)(cluster, target, namespace)
        except AssertionError as exc:
            failures[name] = str(exc)
        except pytest.skip.Exception as exc:
            if skipped is None:
                raise
            skipped[name] = str(exc.msg)
        model.delete("namespace", namespace)
    return failures


def test_model_faults_are_all_checked() -> None:
    assert set(_CAUGHT_BY) == FAULTS


@pytest.mark.parametrize("unsolicited", [False, True], ids=["widen-at-next-event", "widen-at-once"])
def test_the_suite_passes_against_a_cluster_that_keeps_dracpus_promises(
    tmp_path: Path, unsolicited: bool
) -> None:
    model = ModelKubectl(unsolicited=unsolicited)
    assert _run_suite(model, tmp_path) == {}
    assert model.namespaces == set()  # every namespace the suite made is gone
    # Diagnostics of a failed test can be written (against the model: empty files).
    namespace = Cluster(model, tmp_path).create_namespace("dump")
    Cluster(model, tmp_path).dump(tmp_path / "dump", namespace, ["dracpu-e2e-worker"])
    assert (tmp_path / "dump" / "pods.txt").exists()


def test_on_a_2_cpu_node_the_tests_that_need_3_skip_and_the_rest_pass(tmp_path: Path) -> None:
    # The local cluster's node: 2 CPUs, none reserved (deploy/kustomize/overlays/local).
    model = ModelKubectl(online="0-1", numa={0: "0-1"}, reserved="", unsolicited=True)
    skipped: dict[str, str] = {}
    assert _run_suite(model, tmp_path, overlay_reserved_cpus(OVERLAYS / "local"), skipped) == {}
    assert skipped == {
        "test_claims_are_disjoint": suite_module().NO_ROOM_FOR_TWO_CLAIMS,
        "test_fractional_claims_get_whole_cpus": suite_module().NO_ROOM_FOR_TWO_CPUS,
    }
    assert model.namespaces == set()


def suite_module() -> Any:
    return importlib.import_module("tests.e2e.test_kind")


@pytest.mark.parametrize("fault", sorted(_CAUGHT_BY))
def test_the_suite_fails_when_dracpu_misbehaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    suite = importlib.import_module("tests.e2e.test_kind")
    for name in ("SAME_REPLY_TIMEOUT", "WIDEN_TIMEOUT", "PENDING_TIMEOUT"):
        monkeypatch.setattr(suite, name, 0.3)
    monkeypatch.setattr(kube_module, "POLL_INTERVAL", 0.02)
    failures = _run_suite(ModelKubectl(faults=[fault]), tmp_path)
    assert set(failures) == _CAUGHT_BY[fault], failures


def test_the_model_widens_at_the_next_event_only_without_unsolicited_updates(
    tmp_path: Path,
) -> None:
    """The model itself: what test_shared_pool_shrinks_and_widens relies on to tell the two
    widening paths apart."""
    model = ModelKubectl(unsolicited=False)
    cluster = Cluster(model, tmp_path)
    target = cluster.discover(overlay_reserved_cpus(KIND_OVERLAY))
    node = target.node.name
    ns = cluster.create_namespace("model")
    cluster.start(shared_pod("shared", ns, node))
    cluster.create(claim_template("cpus", ns, "2"))
    cluster.start(exclusive_pod("e", ns, node, template="cpus", cpu_resources="2"))
    claimed = cluster.exclusive_cpus(ns, "e")
    assert cluster.observe(ns, "shared").self_cpus == target.node.shareable - claimed
    cluster.delete_pod(ns, "e")
    assert cluster.observe(ns, "shared").self_cpus == target.node.shareable - claimed
    cluster.poke(ns, node)
    assert cluster.observe(ns, "shared").self_cpus == target.node.shareable
