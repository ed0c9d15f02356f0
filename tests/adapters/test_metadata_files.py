"""The device metadata files on disk: what a write leaves, what a delete and a prune remove, and
what they never touch (other claims, other vendors, symlink targets)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from dracpu.adapters import cdi_files, metadata_files
from dracpu.core.cdi_spec import spec_file_name
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.core.device_metadata import claim_files
from dracpu.core.node_config import NodeConfig
from dracpu.errors import CdiError
from dracpu.sim.topologies import FIXTURES, build_topology

__all__: list[str] = []

NODE = "node-a"
A = "aaaaaaaa-0000-4000-8000-000000000001"
B = "bbbbbbbb-0000-4000-8000-000000000002"
C = "cccccccc-0000-4000-8000-000000000003"
FOREIGN = "vendor.example-gpu.json"
CONFIG = NodeConfig.build(NODE, build_topology(FIXTURES["dual-socket-smt2"]))


def claim(uid: str, *requests: str, name: str = "c") -> PreparedClaim:
    results = tuple(DeviceResult(r, NODE, "cpudevnuma000", 1) for r in requests)
    cpus = CpuSet(sorted(CONFIG.devices["cpudevnuma000"].cpus)[: len(requests)])
    return PreparedClaim(uid, cpus, "ns", name, None, results)


@pytest.fixture
def dirs(tmp_path: Path) -> tuple[Path, Path]:
    return tmp_path / "kubelet" / "plugins" / "dra.cpu" / "dra-device-metadata", tmp_path / "cdi"


def names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir()) if directory.exists() else []


def test_a_write_leaves_each_request_s_file_and_the_spec_that_mounts_it(
    dirs: tuple[Path, Path],
) -> None:
    root, cdi = dirs
    prepared = claim(A, "main", "side")
    specs = metadata_files.write_claim(root, cdi, CONFIG, prepared)
    assert specs == [f"dra.cpu_metadata_{A}_main.json", f"dra.cpu_metadata_{A}_side.json"]
    assert names(cdi) == specs  # no temp file left
    assert names(root) == [f"{A}_main.json", f"{A}_side.json"]
    assert stat.S_IMODE(root.stat().st_mode) == 0o755
    for item in claim_files(CONFIG, prepared, str(root)):
        host = Path(item.host_path)
        assert host == root / f"{A}_{item.request}.json"
        assert host.read_bytes() == item.document
        assert (cdi / item.spec_name).read_bytes() == item.spec
        assert stat.S_IMODE(host.stat().st_mode) == 0o644
        assert stat.S_IMODE((cdi / item.spec_name).stat().st_mode) == 0o644
    # rewriting replaces the file (a restart's Resync): a new inode, so a container that
    # mounted the old one keeps reading it whole
    main = root / f"{A}_main.json"
    inode = main.stat().st_ino
    main.write_text("edited")
    metadata_files.write_claim(root, cdi, CONFIG, prepared)
    assert json.loads(main.read_text())["metadata"]["uid"] == A
    assert main.stat().st_ino != inode
    # ... and a file that already holds the same bytes is left as it is (no new file on the
    # kubelet's disk, no rename in the CDI dir for the runtimes to rescan)
    before = {p: p.stat().st_ino for p in [*root.iterdir(), *cdi.iterdir()]}
    metadata_files.write_claim(root, cdi, CONFIG, prepared)
    assert {p: p.stat().st_ino for p in [*root.iterdir(), *cdi.iterdir()]} == before


def test_a_write_says_which_file_it_could_not_write(dirs: tuple[Path, Path]) -> None:
    root, cdi = dirs
    root.parent.mkdir(parents=True)
    root.write_text("a file where the dir goes")
    with pytest.raises(CdiError, match=r"device metadata dir .* is not a directory"):
        metadata_files.write_claim(root, cdi, CONFIG, claim(A, "cpus"))
    assert names(cdi) == []  # no spec names a file that is not there


@pytest.mark.parametrize("requests", [("x", "y"), None], ids=["known", "looked-for"])
def test_a_delete_removes_that_claim_only(
    dirs: tuple[Path, Path], requests: tuple[str, ...] | None
) -> None:
    root, cdi = dirs
    metadata_files.write_claim(root, cdi, CONFIG, claim(A, "x", "y"))
    metadata_files.write_claim(root, cdi, CONFIG, claim(B, "x"))
    cdi_files.write_spec(cdi, A, CpuSet.parse("1"))  # the claim's own spec: not ours to remove
    (cdi / FOREIGN).write_text("{}")
    assert metadata_files.delete_claim(root, cdi, A, requests) is True
    assert names(cdi) == sorted([FOREIGN, f"dra.cpu_metadata_{B}_x.json", spec_file_name(A)])
    assert names(root) == [f"{B}_x.json"]
    # nothing left: still success
    assert metadata_files.delete_claim(root, cdi, A, requests) is False
    with pytest.raises(CdiError, match="invalid claim UID"):
        metadata_files.delete_claim(root, cdi, "../..")


def test_a_symlink_under_a_metadata_file_s_name_is_removed_not_followed(
    dirs: tuple[Path, Path], tmp_path: Path
) -> None:
    root, cdi = dirs
    precious = tmp_path / "precious"
    precious.write_text("keep")
    root.mkdir(parents=True)
    (root / f"{A}_cpus.json").symlink_to(precious)
    assert metadata_files.delete_claim(root, cdi, A, ["cpus"]) is True
    assert not os.path.lexists(root / f"{A}_cpus.json")
    assert precious.read_text() == "keep"


def test_prune_removes_what_no_kept_claim_owns_and_the_leftovers(dirs: tuple[Path, Path]) -> None:
    root, cdi = dirs
    for uid in (A, B):
        metadata_files.write_claim(root, cdi, CONFIG, claim(uid, "cpus"))
    cdi_files.write_spec(cdi, B, CpuSet.parse("1"))
    (cdi / FOREIGN).write_text("{}")
    leftovers = [
        cdi / f".dra.cpu_metadata_{A}_cpus.json.tmp-0123456789abcdef",
        root / f".{A}_cpus.json.tmp-0123456789abcdef",
    ]
    for path in leftovers:
        path.write_text("partial")
    (root / "README").write_text("not ours, not a claim's")

    removed = metadata_files.prune(root, cdi, frozenset({A}))

    assert sorted(removed) == sorted(
        [
            str(cdi / f"dra.cpu_metadata_{B}_cpus.json"),
            str(root / f"{B}_cpus.json"),
            *map(str, leftovers),
        ]
    )
    assert names(cdi) == sorted([FOREIGN, spec_file_name(B), f"dra.cpu_metadata_{A}_cpus.json"])
    assert names(root) == sorted([f"{A}_cpus.json", "README"])
    assert metadata_files.prune(root, cdi, frozenset({A})) == []
    assert metadata_files.prune(root / "missing", cdi / "missing", frozenset()) == []


def _helper_dir(root: Path, name: str, uid: str | None) -> Path:
    """A dir as the Go helper writes it: ``<ns>_<name>/<request>/metadata.json``, a stream of
    one pretty-printed document per version."""
    directory = root / name / "cpus"
    directory.mkdir(parents=True)
    if uid is None:
        (directory / "metadata.json").write_text("{ not json")
        return directory.parent
    doc = {"kind": "DeviceMetadata", "metadata": {"name": name, "uid": uid}}
    text = "".join(
        json.dumps({**doc, "apiVersion": f"metadata.resource.k8s.io/{v}"}, indent=2) + "\n"
        for v in ("v1beta1", "v1alpha1")
    )
    (directory / "metadata.json").write_text(text)
    return directory.parent


def test_prune_takes_the_go_helper_s_dirs_by_the_claim_they_name(dirs: tuple[Path, Path]) -> None:
    root, cdi = dirs
    orphan = _helper_dir(root, "ns_old", B)
    held = _helper_dir(root, "ns_held", A)
    unreadable = _helper_dir(root, "ns_broken", None)
    removed = metadata_files.prune(root, cdi, frozenset({A, C}))
    assert removed == [str(orphan)]
    assert names(root) == sorted([held.name, unreadable.name])
