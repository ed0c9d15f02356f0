"""Fixtures of the kind e2e suite, and the switch that keeps it out of the normal test run.

Tests marked ``e2e`` run only when ``DRACPU_E2E=1`` (``tests/e2e/run.sh`` sets it after it
created the cluster and deployed dracpu); otherwise they are skipped with the reason, which
``-ra`` prints. With ``DRACPU_E2E=1`` a missing kubectl or cluster is a failure, not a skip.

Fixtures: ``cluster`` (session) waits until dracpu is Ready and has published slices on every
node; ``target`` (session) probes every node's CPUs and picks the node the workload tests use;
``namespace`` (per test) is a fresh namespace, deleted afterwards (with its pods and claims),
whose pods, events, claims and the daemon logs are saved under the artifacts directory
(``DRACPU_E2E_ARTIFACTS``) when the test failed.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Generator, Iterator
from functools import partial
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, NodeFacts, Target, claim_size
from tests.e2e.kube import Kubectl, poll
from tests.e2e.workloads import overlay_reserved_cpus, probe_pod

__all__ = [
    "ARTIFACTS_ENV",
    "E2E_ENV",
    "NAMESPACE_LABEL",
    "NODE_ENV",
    "SKIP_REASON",
    "artifacts",
    "cluster",
    "namespace",
    "target",
]

# The switch (run.sh exports it); any other value leaves the e2e tests skipped.
E2E_ENV = "DRACPU_E2E"
# Where failed tests leave their diagnostics (run.sh points it into its artifacts directory).
ARTIFACTS_ENV = "DRACPU_E2E_ARTIFACTS"
# Optional: the node the workload tests use (default: the first worker, by name).
NODE_ENV = "DRACPU_E2E_NODE"
# Label of every namespace the suite creates, so leftovers can be found and deleted.
NAMESPACE_LABEL = "dracpu-e2e"
SKIP_REASON = (
    "kind e2e test: needs a kind cluster running dracpu; run `just e2e` (tests/e2e/run.sh, "
    f"which sets {E2E_ENV}=1)"
)
# How long dracpu may take to be Ready and publish its slices after a fresh deploy.
DEPLOY_TIMEOUT = 300.0

_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get(E2E_ENV) == "1":
        return
    skip = pytest.mark.skip(reason=SKIP_REASON)
    for item in items:
        if item.get_closest_marker("e2e") is not None:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Keep each phase's report on the item: the ``namespace`` fixture reads them."""
    report = yield
    item.stash.setdefault(_REPORTS, {})[report.when] = report
    return report


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    configured = os.environ.get(ARTIFACTS_ENV)
    if configured:
        path = Path(configured)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("e2e-artifacts")


@pytest.fixture(scope="session")
def cluster(artifacts: Path) -> Cluster:
    """The cluster, once dracpu is Ready and has published its slices on every node."""
    cluster = Cluster(Kubectl(), artifacts)
    nodes = cluster.node_names()
    assert nodes, "the cluster has no nodes"
    for node in nodes:
        cluster.ready_daemon(node, timeout=DEPLOY_TIMEOUT)
    for node in nodes:
        poll(
            partial(cluster.slices, node),
            bool,
            timeout=DEPLOY_TIMEOUT,
            what=f"ResourceSlices of driver dra.cpu for node {node}",
        )
    return cluster


@pytest.fixture(scope="session")
def target(cluster: Cluster, artifacts: Path) -> Target:
    """Every node's CPUs (a probe pod per node) and the node the workload tests use."""
    reserved = overlay_reserved_cpus()
    namespace = _create_namespace(cluster, "probe")
    nodes: dict[str, NodeFacts] = {}
    try:
        for index, node in enumerate(cluster.node_names()):
            log = cluster.run_to_completion(probe_pod(f"probe-{index}", namespace, node))
            nodes[node] = NodeFacts.from_probe(node, json.loads(log), reserved)
    except BaseException:
        cluster.dump(artifacts / namespace, namespace, cluster.node_names())
        raise
    finally:
        cluster.kube.delete("namespace", namespace, timeout=300)
    chosen = os.environ.get(NODE_ENV) or next(iter(cluster.worker_names() or cluster.node_names()))
    assert chosen in nodes, f"{NODE_ENV}={chosen!r} is not a node of the cluster ({list(nodes)})"
    return Target(node=nodes[chosen], nodes=nodes, size=claim_size(nodes[chosen]))


@pytest.fixture
def namespace(request: pytest.FixtureRequest, cluster: Cluster, target: Target) -> Iterator[str]:
    """A fresh namespace for one test; diagnostics saved if the test failed; then deleted."""
    name = _create_namespace(cluster, request.node.name)
    yield name
    reports = request.node.stash.get(_REPORTS, {})
    if any(r.failed for r in reports.values()):
        directory = cluster.artifacts / name
        cluster.dump(directory, name, [target.node.name])
        print(f"\ne2e diagnostics of {request.node.name}: {directory}")
    cluster.kube.delete("namespace", name, timeout=300)


def _create_namespace(cluster: Cluster, hint: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", hint.lower()).strip("-")[:40].rstrip("-")
    name = f"e2e-{slug}-{secrets.token_hex(3)}"
    cluster.create(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": name, "labels": {NAMESPACE_LABEL: "true"}},
        }
    )
    return name
