"""The local cluster's files (tests/cluster), checked without building or starting anything.

`just e2e-local` runs them for real (in CI); these checks keep the pins and the scripts coherent
in the normal suite: every Kubernetes staging module replaced at the release's ``v0.N.M``, each
module's commands declared as tools and its ``go.sum`` present, the scripts valid bash (and
shellcheck-clean where shellcheck is installed), every variable they read documented.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CLUSTER = Path(__file__).resolve().parent / "cluster"
MODULES = CLUSTER / "modules"
SCRIPTS = [CLUSTER / "build", CLUSTER / "cluster", CLUSTER / "e2e"]
REPO = CLUSTER.parent.parent
# The commands each module builds (tests/cluster/build).
TOOLS = {
    "kubernetes": {
        "k8s.io/kubernetes/cmd/kube-apiserver",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-scheduler",
        "k8s.io/kubernetes/cmd/kubelet",
    },
    "containerd": {
        "github.com/containerd/containerd/v2/cmd/containerd",
        "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2",
        "github.com/containerd/containerd/v2/cmd/ctr",
    },
    "etcd": {"go.etcd.io/etcd/server/v3"},
}


def _go_mod(module: str) -> str:
    return (MODULES / module / "go.mod").read_text()


def _tools(text: str) -> set[str]:
    block = re.search(r"^tool \(\n(.*?)^\)", text, re.MULTILINE | re.DOTALL)
    single = re.findall(r"^tool ([^\s(]\S*)$", text, re.MULTILINE)
    return set(single) | (set(block.group(1).split()) if block else set())


def _required(text: str, path: str) -> str:
    match = re.search(rf"^\s*(?:require )?{re.escape(path)} (v\S+)", text, re.MULTILINE)
    assert match, f"{path} is not required"
    return match.group(1)


@pytest.mark.parametrize("module", sorted(TOOLS))
def test_each_module_pins_its_commands(module: str) -> None:
    text = _go_mod(module)
    assert _tools(text) == TOOLS[module]
    assert (MODULES / module / "go.sum").stat().st_size > 0
    assert re.search(r"^go 1\.\d+", text, re.MULTILINE)


def test_every_kubernetes_staging_module_is_replaced_at_the_release() -> None:
    text = _go_mod("kubernetes")
    release = _required(text, "k8s.io/kubernetes")
    match = re.fullmatch(r"v1\.(\d+)\.(\d+)", release)
    assert match, release
    staging = f"v0.{match[1]}.{match[2]}"
    replaces = dict(re.findall(r"^replace (k8s\.io/\S+) => k8s\.io/\S+ (v\S+)$", text, re.M))
    # Every k8s.io module k8s.io/kubernetes requires at v0.0.0 (its staging tree): the
    # 33 of 1.36 and later, with cri-streaming and streaming.
    assert {"k8s.io/api", "k8s.io/kubelet", "k8s.io/streaming", "k8s.io/cri-streaming"} <= set(
        replaces
    )
    assert len(replaces) == 33
    assert set(replaces.values()) == {staging}
    for line in re.findall(r"^replace (\S+) => (\S+) ", text, re.M):
        assert line[0] == line[1], f"{line}: a staging module replaced by another module"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_executable_bash(script: Path) -> None:
    assert os.access(script, os.X_OK)
    subprocess.run(["bash", "-n", str(script)], check=True, capture_output=True)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_scripts_pass_shellcheck() -> None:
    done = subprocess.run(
        ["shellcheck", *map(str, SCRIPTS), str(REPO / ".ci" / "run")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout


def test_the_readmes_document_every_variable_the_scripts_read() -> None:
    readme = (CLUSTER / "README.md").read_text()
    variables = {
        name
        for script in SCRIPTS
        for name in re.findall(r"\$\{([A-Z_]+):[-+=]", script.read_text())
    } - {"TMPDIR", "HOME", "PIP_CERT", "PIP_INDEX_URL"}
    assert {"DRACPU_CLUSTER_STATE", "KEEP_CLUSTER", "ARTIFACTS"} <= variables
    for name in sorted(variables):
        assert f"`{name}`" in readme, f"tests/cluster/README.md does not document {name}"


def test_the_justfile_and_ci_run_the_local_cluster() -> None:
    justfile = (REPO / "justfile").read_text()
    assert re.search(r"^e2e-local \*ARGS:\n    tests/cluster/e2e \{\{ARGS\}\}$", justfile, re.M)
    assert re.search(r"^cluster \*ARGS:\n    tests/cluster/cluster \{\{ARGS\}\}$", justfile, re.M)
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci.index("scripts/test") < ci.index("exec .venv/bin/just e2e-local")
