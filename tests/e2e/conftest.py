"""Fixtures of the e2e suite (kind or the local cluster), and the switch that keeps it out of
the normal test run.

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

import os
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster, Target
from tests.e2e.kube import Kubectl
from tests.e2e.workloads import overlay_reserved_cpus

__all__ = [
    "ARTIFACTS_ENV",
    "E2E_ENV",
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
SKIP_REASON = (
    "e2e test: needs a cluster running dracpu; run `just e2e-local` (a local one-node cluster, "
    f"tests/cluster) or `just e2e` (kind, tests/e2e/run.sh), which set {E2E_ENV}=1"
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
    cluster.wait_deployed(timeout=DEPLOY_TIMEOUT)
    return cluster


@pytest.fixture(scope="session")
def target(cluster: Cluster) -> Target:
    """Every node's CPUs (a probe pod per node) and the node the workload tests use."""
    return cluster.discover(overlay_reserved_cpus(), node=os.environ.get(NODE_ENV))


@pytest.fixture
def namespace(request: pytest.FixtureRequest, cluster: Cluster, target: Target) -> Iterator[str]:
    """A fresh namespace for one test; diagnostics saved if the test failed; then deleted."""
    name = cluster.create_namespace(request.node.name)
    yield name
    reports = request.node.stash.get(_REPORTS, {})
    if any(r.failed for r in reports.values()):
        directory = cluster.artifacts / name
        cluster.dump(directory, name, [target.node.name])
        print(f"\ne2e diagnostics of {request.node.name}: {directory}")
    cluster.kube.delete("namespace", name, timeout=300)
