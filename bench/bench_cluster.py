"""Pod start with a claim and without, and the kubelet's own DRA histograms, on the real cluster.

Needs the local cluster with dracpu deployed (``just cluster up && just cluster deploy``); it
uses that cluster's own kubeconfig (``$DRACPU_CLUSTER_STATE/admin.kubeconfig``), never
``KUBECONFIG``, so it cannot start pods on another cluster. Without it, it says so on stderr and
prints nothing.

* ``cluster.pod_start.claim`` / ``cluster.pod_start.plain``: milliseconds from the pod's creation
  (the API call returned) to the watch event that shows it Running, for a busybox pod holding a
  1-CPU claim from a ResourceClaimTemplate and for the identical pod without the claim; ``n``
  pairs, interleaved (the order alternates), each pod deleted and gone before the next;
* ``cluster.pod_start.ratio``: the claim's p50 over the plain pod's (and the p99s');
* ``cluster.kubelet.PrepareResources`` / ``cluster.kubelet.UnprepareResources``: the kubelet's
  ``dra_operations_duration_seconds`` over the run (all claims of a pod, as the kubelet times
  them), and ``cluster.kubelet.grpc.<method>``: its ``dra_grpc_operations_duration_seconds`` for
  driver ``dra.cpu`` (one gRPC call to dracpu): count, mean (sum / count) and the p50 / p99 as
  the histogram's bucket bounds (the smallest bound holding that share of the calls), scraped
  from the kubelet's ``/metrics`` (on loopback, with the kubeconfig's client certificate) before
  and after the pods.

Run: ``.venv/bin/python bench/bench_cluster.py [--pairs N]``. Not a test: nothing here asserts a
number.
"""

from __future__ import annotations

import argparse
import math
import os
import ssl
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kubernetes import client, config, watch
from kubernetes.client.exceptions import ApiException
from prometheus_client.parser import text_string_to_metric_families

from bench._harness import emit, percentiles

__all__ = ["main"]

IMAGE = "docker.io/library/busybox:dracpu"  # tests/cluster/cluster deploy imports it
DRIVER = "dra.cpu"
START_TIMEOUT = 180  # seconds a pod may take to run
# Histogram families of the kubelet (pkg/kubelet/metrics, subsystem "dra").
OPERATIONS = "dra_operations_duration_seconds"
GRPC = "dra_grpc_operations_duration_seconds"


@dataclass
class Series:
    """One series of a histogram: cumulative counts by upper bound, and the sum."""

    buckets: dict[float, float] = field(default_factory=dict)
    total: float = 0.0


Histogram = dict[str, Series]  # by the series' labels, "k=v,k=v"


def _pod(name: str, namespace: str, node: str, claim: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "work",
        "image": IMAGE,
        "imagePullPolicy": "Never",
        "command": ["sleep", "3600"],
        "resources": {
            "requests": {"cpu": "1", "memory": "32Mi"},
            "limits": {"cpu": "1", "memory": "32Mi"},
        },
    }
    spec: dict[str, Any] = {
        "hostNetwork": True,
        "terminationGracePeriodSeconds": 1,
        "nodeSelector": {"kubernetes.io/hostname": node},
        "tolerations": [{"operator": "Exists"}],
        "containers": [container],
    }
    if claim:
        spec["resourceClaims"] = [{"name": "cpus", "resourceClaimTemplateName": "one-cpu"}]
        container["resources"]["claims"] = [{"name": "cpus"}]
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def _template(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": "one-cpu", "namespace": namespace},
        "spec": {
            "spec": {
                "devices": {
                    "requests": [
                        {
                            "name": "cpus",
                            "exactly": {
                                "deviceClassName": DRIVER,
                                "capacity": {"requests": {f"{DRIVER}/cpu": "1"}},
                            },
                        }
                    ]
                }
            }
        },
    }


def _start(core: client.CoreV1Api, namespace: str, pod: dict[str, Any]) -> float:
    """Create the pod; milliseconds until a watch event shows it Running."""
    name = pod["metadata"]["name"]
    stream = watch.Watch()  # type: ignore[no-untyped-call]
    start = time.perf_counter()
    created = core.create_namespaced_pod(namespace, pod)  # type: ignore[arg-type]
    assert created.metadata is not None
    for event in stream.stream(  # type: ignore[no-untyped-call]
        core.list_namespaced_pod,
        namespace,
        field_selector=f"metadata.name={name}",
        resource_version=created.metadata.resource_version,
        timeout_seconds=START_TIMEOUT,
    ):
        if event["object"].status.phase == "Running":
            stream.stop()  # type: ignore[no-untyped-call]
            return (time.perf_counter() - start) * 1000
    raise RuntimeError(f"pod {namespace}/{name} did not run within {START_TIMEOUT} s")


def _delete(core: client.CoreV1Api, namespace: str, name: str) -> None:
    """Delete the pod and wait until it is gone: the kubelet removes it once its containers
    stopped and its claim is unprepared, so the next pod finds the CPU free (a forced deletion
    would return before that, and the next claim be refused for the CPU still held)."""
    core.delete_namespaced_pod(name, namespace)
    deadline = time.monotonic() + START_TIMEOUT
    while time.monotonic() < deadline:
        try:
            core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return
            raise
        time.sleep(0.2)
    raise RuntimeError(f"pod {namespace}/{name} was not gone within {START_TIMEOUT} s")


def _kubelet_metrics(core: client.CoreV1Api, node: str) -> str:
    """The kubelet's /metrics, fetched directly (the API server's node proxy refuses a loopback
    node address) with the kubeconfig's client certificate, its serving certificate checked
    against the kubeconfig's CA."""
    found = core.read_node(node)
    assert found.status is not None
    assert found.status.addresses is not None
    assert found.status.daemon_endpoints is not None
    assert found.status.daemon_endpoints.kubelet_endpoint is not None
    address = next(a.address for a in found.status.addresses if a.type == "InternalIP")
    port = found.status.daemon_endpoints.kubelet_endpoint.port
    settings = client.Configuration.get_default_copy()
    context = ssl.create_default_context(cafile=settings.ssl_ca_cert)
    assert settings.cert_file is not None, "the kubeconfig has no client certificate"
    context.load_cert_chain(settings.cert_file, settings.key_file)
    with urllib.request.urlopen(
        f"https://{address}:{port}/metrics", context=context, timeout=30
    ) as response:
        text: str = response.read().decode()
    return text


def _scrape(core: client.CoreV1Api, node: str) -> dict[str, Histogram]:
    """The kubelet's DRA histograms, by family and series (its labels)."""
    text = _kubelet_metrics(core, node)
    found: dict[str, Histogram] = {OPERATIONS: {}, GRPC: {}}
    for family in text_string_to_metric_families(text):
        if family.name not in found:
            continue
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k != "le"}
            if family.name == GRPC and labels.get("driver_name") != DRIVER:
                continue
            key = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
            series = found[family.name].setdefault(key, Series())
            if sample.name.endswith("_bucket"):
                series.buckets[float(sample.labels["le"])] = sample.value
            elif sample.name.endswith("_sum"):
                series.total = sample.value
    return found


def _emit_histogram(name: str, before: Series | None, after: Series) -> None:
    """What the run added to one series: count, mean and the bucket bounds of p50 and p99."""
    before = before or Series()
    delta = {b: count - before.buckets.get(b, 0.0) for b, count in after.buckets.items()}
    count = delta.get(math.inf, 0.0)
    if count <= 0:
        return

    def quantile(q: float) -> float:
        return next(b for b in sorted(delta) if delta[b] >= q * count) * 1000

    emit(
        name,
        "ms",
        n=int(count),
        mean=round((after.total - before.total) / count * 1000, 3),
        p50_le=quantile(0.5),
        p99_le=quantile(0.99),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=20, help="pods of each kind (default 20)")
    args = parser.parse_args()
    state = Path(os.environ.get("DRACPU_CLUSTER_STATE", "/var/tmp/dracpu-cluster"))
    kubeconfig = state / "admin.kubeconfig"
    try:
        config.load_kube_config(config_file=str(kubeconfig))  # type: ignore[no-untyped-call]
        core = client.CoreV1Api()
        (node,) = [str(n.metadata.name) for n in core.list_node().items if n.metadata]
    except Exception as exc:  # any failure here means: no cluster to measure
        print(
            f"bench_cluster: no local cluster ({kubeconfig}: {exc}); run "
            "`just cluster up && just cluster deploy` first",
            file=sys.stderr,
        )
        return
    namespace = f"bench-{uuid.uuid4().hex[:6]}"
    core.create_namespace({"metadata": {"name": namespace}})  # type: ignore[arg-type]
    try:
        client.CustomObjectsApi().create_namespaced_custom_object(
            "resource.k8s.io", "v1", namespace, "resourceclaimtemplates", _template(namespace)
        )
        before = _scrape(core, node)
        samples: dict[bool, list[float]] = {True: [], False: []}
        for index in range(args.pairs):
            for claim in (True, False) if index % 2 == 0 else (False, True):
                name = f"{'claim' if claim else 'plain'}-{index}"
                samples[claim].append(_start(core, namespace, _pod(name, namespace, node, claim)))
                _delete(core, namespace, name)
        after = _scrape(core, node)
    finally:
        core.delete_namespace(namespace)
    figures = {}
    for claim, label in ((True, "claim"), (False, "plain")):
        p50, p99 = percentiles(samples[claim])
        figures[claim] = (p50, p99)
        emit(f"cluster.pod_start.{label}", "ms", p50=round(p50, 1), p99=round(p99, 1), n=args.pairs)
    emit(
        "cluster.pod_start.ratio",
        "x",
        p50=round(figures[True][0] / figures[False][0], 3),
        p99=round(figures[True][1] / figures[False][1], 3),
        n=args.pairs,
    )
    for key, series in sorted(after[OPERATIONS].items()):
        labels = dict(part.split("=", 1) for part in key.split(","))
        if labels.get("is_error") == "false":
            _emit_histogram(
                f"cluster.kubelet.{labels['operation_name']}",
                before[OPERATIONS].get(key),
                series,
            )
    for key, series in sorted(after[GRPC].items()):
        labels = dict(part.split("=", 1) for part in key.split(","))
        method = labels["method_name"].rsplit("/", 1)[-1]
        _emit_histogram(
            f"cluster.kubelet.grpc.{method}.{labels['grpc_status_code']}",
            before[GRPC].get(key),
            series,
        )


if __name__ == "__main__":
    main()
