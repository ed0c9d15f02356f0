"""CDI spec costs on the Prepare path and in the watcher.

Run: ``.venv/bin/python bench/bench_cdi.py [--dir DIR]``. Figures (ms, p50/p99); each file figure
is measured on a disk directory (``--dir``, default: the system temp dir) and, when ``/dev/shm``
exists, on tmpfs (what ``/var/run/cdi`` is on a node); ``fs`` names the file system:

* ``cdi.write_spec``: one atomic spec write (temp file in the CDI dir, write, rename; no fsync:
  the checkpoint is the durable record), what Prepare pays per claim;
* ``cdi.write_spec_unchanged``: the same for a spec that holds those bytes already (read and
  compared, left alone: a Resync or repair of a claim whose spec is in place);
* ``cdi.plain_write_2k_fsync``: open + write 2 KiB + fsync + close of a plain file, the floor the
  DRA Prepare benchmark compares with;
* ``cdi.delete_spec``: what Unprepare pays per claim;
* ``cdi.drift_check_200``: one full CDI watcher pass over 200 prepared claims whose files are in
  place (each claim's CDI spec and device metadata read and compared with what the state owner
  would write: ``file_scan.scan`` + ``file_drift.drifted_claims``);
* ``cdi.spec_bytes`` / ``cdi.parse_spec``: the pure build+encode and parse of one spec.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import sys
import tempfile
import uuid
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import measure
from dracpu.adapters import file_scan, metadata_files
from dracpu.adapters.cdi_files import delete_spec, write_spec
from dracpu.core.cdi_spec import parse_spec, spec_bytes
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode
from dracpu.core.file_drift import drifted_claims
from dracpu.core.node_config import NodeConfig
from dracpu.core.state_values import NodeState
from dracpu.sim.topologies import FIXTURES, build_topology

__all__ = ["main"]

SAMPLES = 300
WARMUP = 3
# A claim of 8 CPUs spread over two ranges: a typical env value.
CPUS = CpuSet.parse("4-7,68-71")
OTHER_CPUS = CpuSet.parse("8-11,72-75")
# The floor file: 2 KiB, about the size of a checkpoint of a few claims.
PLAIN_SIZE = 2048
# A busy node: 200 prepared claims.
CLAIMS = 200


def _fs_type(path: Path) -> str:
    """File system type of the mount holding ``path`` (longest mount point prefix)."""
    best, kind = "", "unknown"
    resolved = str(path.resolve())
    with open("/proc/mounts") as mounts:
        for line in mounts:
            fields = line.split()
            if len(fields) < 3:
                continue
            point = fields[1]
            inside = resolved == point or resolved.startswith(point.rstrip("/") + "/")
            if inside and len(point) > len(best):
                best, kind = point, fields[2]
    return kind


def bench_dir(base: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="dracpu-bench-cdi-", dir=base))
    try:
        fs = _fs_type(work)
        uid = str(uuid.uuid4())
        cdi = work / "cdi"
        # Two contents in turn: a spec that holds the bytes already is only read, not written.
        contents = itertools.cycle((CPUS, OTHER_CPUS))
        measure("cdi.write_spec", lambda: write_spec(cdi, uid, next(contents)), n=SAMPLES, fs=fs)
        measure("cdi.write_spec_unchanged", lambda: write_spec(cdi, uid, CPUS), n=SAMPLES, fs=fs)

        plain = work / "plain"
        payload = os.urandom(PLAIN_SIZE)

        def plain_write() -> None:
            fd = os.open(plain, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, payload)
                os.fsync(fd)
            finally:
                os.close(fd)

        measure("cdi.plain_write_2k_fsync", plain_write, n=SAMPLES, fs=fs)

        doomed = [str(uuid.uuid4()) for _ in range(SAMPLES + WARMUP)]
        for claim in doomed:
            write_spec(cdi, claim, CPUS)
        next_claim = iter(doomed).__next__
        measure(
            "cdi.delete_spec", lambda: delete_spec(cdi, next_claim()), n=SAMPLES, warmup=WARMUP,
            fs=fs,
        )  # fmt: skip

        state, cdi_many, metadata = _claims(work)

        def drift_check() -> None:
            found = file_scan.scan(cdi_many, metadata)
            specs = {u: c for u, c in found.specs.items() if isinstance(c, bytes)}
            meta = str(metadata)
            drift = drifted_claims(state, meta, specs, found.metadata_specs, found.metadata_files)
            assert not drift, drift

        measure(f"cdi.drift_check_{CLAIMS}", drift_check, n=50, fs=fs)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _claims(work: Path) -> tuple[NodeState, Path, Path]:
    """A node of 200 one-CPU claims (individual devices of big-1024), their files written."""
    node = "bench-node"
    config = NodeConfig.build(
        node, build_topology(FIXTURES["big-1024"]), mode=CpuDeviceMode.INDIVIDUAL
    )
    devices = list(config.devices.values())[:CLAIMS]
    claims = {}
    for i, device in enumerate(devices):
        uid = str(uuid.UUID(int=i + 1))
        result = DeviceResult("cpus", node, device.name)
        claims[uid] = PreparedClaim(uid, device.cpus, "ns", f"claim-{i}", None, (result,))
    cdi, metadata = work / "many", work / "metadata"
    for claim in claims.values():
        write_spec(cdi, claim.claim_uid, claim.cpus)
        metadata_files.write_claim(metadata, cdi, config, claim)
    state = NodeState(
        config=config,
        claims=MappingProxyType(claims),
        claimed=CpuSet.union(c.cpus for c in claims.values()),
    )
    return state, cdi, metadata


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = parser.parse_args()

    uid = str(uuid.uuid4())
    data = spec_bytes(uid, CPUS)
    measure("cdi.spec_bytes", lambda: spec_bytes(uid, CPUS), n=SAMPLES * 10)
    measure("cdi.parse_spec", lambda: parse_spec(data), n=SAMPLES * 10)

    bench_dir(args.dir)
    shm = Path("/dev/shm")
    if shm.is_dir() and _fs_type(shm) == "tmpfs":
        bench_dir(shm)


if __name__ == "__main__":
    main()
