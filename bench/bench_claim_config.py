"""What reading a claim's opaque configs adds to a Prepare (:mod:`dracpu.core.claim_config`).

Figures (one JSON line each, milliseconds): :func:`~dracpu.core.claim_config.claim_overrides`
of a claim already read by :func:`~dracpu.core.claims.read_claim`, as the kubelet plugin calls it
once per claim before sending PrepareClaim to the state owner:

- ``claim_config.none``: a grouped claim without configs (the common case: nothing to read);
- ``claim_config.grouped``: one grouped result, a DeviceClass config (``fullCores``, ``memory``)
  and the claim's (``policy``, and an other driver's config to skip);
- ``claim_config.cpuset``: one machine-mode result with the claim's ``cpuset``;
- ``claim_config.individual_32``: 32 individual results (the API's most per claim) under one
  config for all requests and one naming a request: every result folds both.

Run: ``.venv/bin/python bench/bench_claim_config.py [--n 20000]``.
"""

from __future__ import annotations

import argparse
import sys
import uuid
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import measure
from dracpu.core.claim_config import claim_overrides
from dracpu.core.claims import ClaimAllocation, read_claim
from dracpu.sim.fake_apiserver import build_resource_claim

NODE = "node-a"


def _config(source: str, requests: list[str], driver: str = "dra.cpu", **cpu: Any) -> Any:
    return {
        "source": source,
        "requests": requests,
        "opaque": {
            "driver": driver,
            "parameters": {"apiVersion": "v1alpha1", "cpuConfig": cpu},
        },
    }


def _allocation(results: list[dict[str, Any]], configs: list[dict[str, Any]]) -> ClaimAllocation:
    uid = str(uuid.uuid4())
    claim = build_resource_claim("bench", "claim", results, uid=uid, configs=configs)
    return read_claim(claim, uid=uid, pool=NODE)


def _grouped(device: str, cpus: int) -> dict[str, Any]:
    return {
        "request": "cpus",
        "driver": "dra.cpu",
        "pool": NODE,
        "device": device,
        "shareID": str(uuid.uuid4()),
        "consumedCapacity": {"dra.cpu/cpu": str(cpus)},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--n", type=int, default=20000)
    args = parser.parse_args()

    none = _allocation([_grouped("cpudevnuma000", 4)], [])
    grouped = _allocation(
        [_grouped("cpudevnuma000", 4)],
        [
            _config("FromClass", ["cpus"], fullCores=True, memory="pin"),
            _config("FromClaim", [], driver="gpu.example.com"),
            _config("FromClaim", ["cpus"], policy="packed"),
        ],
    )
    cpuset = _allocation(
        [_grouped("cpudevmachine", 4)], [_config("FromClaim", ["cpus"], cpuset="4-7")]
    )
    individual = _allocation(
        [
            {"request": f"r{i % 4}", "driver": "dra.cpu", "pool": NODE, "device": f"cpudev{i:03d}"}
            for i in range(32)
        ],
        [_config("FromClaim", [], memory="pin"), _config("FromClaim", ["r1"], policy="spread")],
    )
    for name, allocation in (
        ("claim_config.none", none),
        ("claim_config.grouped", grouped),
        ("claim_config.cpuset", cpuset),
        ("claim_config.individual_32", individual),
    ):
        measure(name, partial(claim_overrides, allocation), n=args.n, warmup=100)


if __name__ == "__main__":
    main()
