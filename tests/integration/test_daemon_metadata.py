"""Device metadata (KEP-5304) on the real daemon: for a grouped and an individual claim, the
metadata CDI id of the kubelet's answer is resolved the way a runtime resolves it (every spec
of the CDI dir, plain JSON), the file it mounts is read back and compared with the slices the
fake API server holds and with the machine's sysfs read by an independent reader; Unprepare
removes it; a restart puts back what was deleted while the daemon was down and removes what no
claim owns."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from dracpu.sim.fake_kubelet import PrepareResult
from dracpu.sim.node import NodeSim, SimClaim, open_node_sim
from tests.core import upstream_driver
from tests.core.test_device_metadata import PER_CPU  # the per-CPU lists and their fields
from tests.integration.conftest import cpus

pytestmark = pytest.mark.anyio

CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
METADATA_KIND = "dra.cpu/metadata"


def resolve(sim: NodeSim, cdi_id: str) -> dict[str, Any]:
    """The mount of a ``dra.cpu/metadata=<device>`` CDI id, found as a runtime finds it: the
    device of that name in a spec of that kind, whatever the file is called."""
    kind, _, name = cdi_id.partition("=")
    found: list[dict[str, Any]] = []
    for path in sorted(sim.paths.cdi_dir.glob("*.json")):
        spec = json.loads(path.read_text())
        if spec.get("kind") != kind:
            continue
        for device in spec["devices"]:
            if device["name"] == name:
                assert spec["cdiVersion"] == "0.5.0"
                [mount] = device["containerEdits"]["mounts"]
                found.append(mount)
    assert len(found) == 1, (cdi_id, found)
    return found[0]


def mounted(sim: NodeSim, answer: PrepareResult) -> dict[str, tuple[str, Any]]:
    """Per request: the container path and the document the answer's metadata ids mount. Each
    request's id is on its first device, and on no other."""
    seen: dict[str, tuple[str, Any]] = {}
    for device in answer.devices:
        ids = [i for i in device.cdi_device_ids if i.startswith(METADATA_KIND + "=")]
        [request] = device.request_names
        if request in seen:
            assert ids == []
            continue
        [cdi_id] = ids
        mount = resolve(sim, cdi_id)
        assert mount["options"] == ["ro", "bind"]
        text = Path(mount["hostPath"]).read_text()
        seen[request] = (mount["containerPath"], json.loads(text))  # ONE JSON object
    return seen


def published(sim: NodeSim) -> dict[str, dict[str, Any]]:
    return {d["name"]: d["attributes"] for d in sim.published()}


def metadata_files(sim: NodeSim) -> dict[str, bytes]:
    """Every metadata spec and metadata file of the node, by path."""
    root = sim.paths.kubelet_root / "plugins" / "dra.cpu" / "dra-device-metadata"
    paths = [*sim.paths.cdi_dir.glob("dra.cpu_metadata_*"), *root.rglob("*")]
    return {str(p): p.read_bytes() for p in sorted(paths) if p.is_file()}


def check_document(doc: Any, claim: SimClaim, request: str) -> list[dict[str, Any]]:
    assert doc["kind"] == "DeviceMetadata"
    assert doc["apiVersion"] == "metadata.resource.k8s.io/v1beta1"
    assert doc["metadata"] == {
        "name": claim.name,
        "namespace": claim.namespace,
        "uid": claim.uid,
        "generation": 1,
    }
    [entry] = doc["requests"]
    assert entry["name"] == request
    assert [(d["driver"], d["pool"]) for d in entry["devices"]] == [("dra.cpu", "sim-node")] * len(
        entry["devices"]
    )
    devices: list[dict[str, Any]] = entry["devices"]
    return devices


async def test_grouped_claims_metadata_is_the_slice_s_plus_the_allocated_cpus() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        model = upstream_driver.read_machine(sim.paths.host_root)
        templated = sim.allocate(
            "pod-0-cpus-7xk2q", 4, device="cpudevnuma001", pod_claim_name="cpus"
        )
        direct = sim.allocate("shared-cpus", 2, device="cpudevnuma000")
        answers = await sim.prepare(templated, direct)
        file = "cpus/dra.cpu-metadata.json"
        paths = {
            templated.uid: f"{CONTAINER_DIR}/resourceclaimtemplates/cpus/{file}",
            direct.uid: f"{CONTAINER_DIR}/resourceclaims/shared-cpus/{file}",
        }
        for claim, count in ((templated, 4), (direct, 2)):
            answer = answers[claim.uid]
            assert answer.error == ""
            [(request, (path, doc))] = mounted(sim, answer).items()
            assert (request, path) == ("cpus", paths[claim.uid])
            assert ("podClaimName" in doc) == (claim is templated)
            [entry] = check_document(doc, claim, "cpus")
            assert entry["name"] == claim.devices[0]
            attributes = dict(entry["attributes"])
            held = sorted(cpus(sim.cdi_cpus(claim.uid) or ""))
            assert attributes.pop("dra.cpu/allocatedNumCPUs") == {"int": count}
            for key, (kind, field) in PER_CPU.items():
                assert attributes.pop(key) == {kind: [getattr(model.cpus[c], field) for c in held]}
            assert attributes.pop("dra.cpu/allocatedSMTEnabled") == {"bools": [model.smt] * count}
            assert attributes == published(sim)[entry["name"]]

        unprepared = await sim.unprepare(templated, direct)
        assert unprepared == {templated.uid: "", direct.uid: ""}
        assert metadata_files(sim) == {}


async def test_individual_claims_metadata_is_the_slice_s() -> None:
    async with open_node_sim(mode="individual") as sim:
        await sim.wait_published()
        claim = sim.allocate("pinned", 3)
        answer = (await sim.prepare(claim))[claim.uid]
        assert answer.error == ""
        [(request, (path, doc))] = mounted(sim, answer).items()
        assert path == f"{CONTAINER_DIR}/resourceclaims/pinned/cpus/dra.cpu-metadata.json"
        devices = check_document(doc, claim, request)
        slices = published(sim)
        assert [d["name"] for d in devices] == claim.devices
        assert [d["attributes"] for d in devices] == [slices[name] for name in claim.devices]
        ids = sorted(d["attributes"]["dra.cpu/cpuID"]["int"] for d in devices)
        assert ids == sorted(cpus(sim.cdi_cpus(claim.uid) or ""))

        assert await sim.unprepare(claim) == {claim.uid: ""}
        assert metadata_files(sim) == {}


def lose_and_plant(sim: NodeSim, files: dict[str, bytes], held: str) -> list[Path]:
    """While the daemon is down: its metadata files are lost, and there appear metadata of a
    claim it does not hold and the temp file of a write cut short; the planted paths."""
    for path in files:
        Path(path).unlink()
    orphan = str(uuid.uuid4())
    root = sim.paths.kubelet_root / "plugins" / "dra.cpu" / "dra-device-metadata"
    (root / f"{orphan}_cpus.json").write_text("{}")
    stale = sim.paths.cdi_dir / f"dra.cpu_metadata_{orphan}_cpus.json"
    stale.write_text('{"cdiVersion":"0.5.0","kind":"dra.cpu/metadata","devices":[]}')
    temp = sim.paths.cdi_dir / f".dra.cpu_metadata_{held}_cpus.json.tmp-00ff00ff"
    temp.write_text("half")
    # what the Go helper leaves in its <namespace>_<name> layout for a claim long gone
    helper = root / "default_gone" / "cpus"
    helper.mkdir(parents=True)
    (helper / "metadata.json").write_text(
        json.dumps({"kind": "DeviceMetadata", "metadata": {"uid": str(uuid.uuid4())}}, indent=2)
    )
    return [root / f"{orphan}_cpus.json", stale, temp, helper.parent]


async def test_metadata_lost_while_the_daemon_was_down_is_back_after_a_restart() -> None:
    async with open_node_sim() as sim:
        await sim.wait_published()
        claims = [
            sim.allocate("a", 3, device="cpudevnuma002"),
            sim.allocate("b", 1, device="cpudevnuma003", pod_claim_name="cpus"),
        ]
        answers = await sim.prepare(*claims)
        assert all(a.error == "" for a in answers.values())
        before = metadata_files(sim)
        assert len(before) == 4  # per claim: one spec, one file
        assert await sim.stop_daemon() == 0

        planted = lose_and_plant(sim, before, claims[0].uid)

        await sim.start_daemon()

        assert metadata_files(sim) == before
        assert [p for p in planted if p.exists()] == []
        for claim in claims:
            assert list(mounted(sim, answers[claim.uid])) == ["cpus"]
