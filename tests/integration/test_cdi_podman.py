"""Our CDI specs, read by a real CDI consumer: podman.

podman resolves ``--device dra.k8s.io/cpu=claim-<uid>`` with the CDI library vendored in it and
injects the spec's env into the container, the same path containerd and CRI-O take for a DRA
claim; and ``--device dra.cpu/metadata=<uid>_<request>`` bind-mounts a claim's device metadata
file (KEP-5304) read-only where a workload looks for it. podman 4.3 (Debian 12) reads specs
only from the default dirs ``/etc/cdi`` and ``/var/run/cdi`` (it has no spec-dir flag or
setting), so each podman call runs in a private
mount namespace (``unshare -m``) where a fresh tmpfs covers ``/run`` and the test's CDI dir is
bind-mounted on ``/run/cdi``: the host's dirs are never touched.

Needs root, podman, runc, ``unshare`` and a static busybox (Debian ``busybox-static``) for the
image; skipped with the reason otherwise, or when podman cannot start containers in this
environment (the skip shows podman's error).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import struct
import subprocess
import tarfile
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from dracpu.adapters.cdi_files import spec_path, write_spec
from dracpu.adapters.metadata_files import write_claim
from dracpu.core.cdi_spec import device_id, parse_env, spec_file_name
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import CpuSet
from dracpu.core.device_metadata import claim_files, container_path, metadata_device_id
from dracpu.core.node_config import NodeConfig
from dracpu.sim.topologies import FIXTURES, build_topology

IMAGE = "localhost/dracpu-busybox:test"
# Mounts a tmpfs over /run (so /run/cdi can exist without creating it on the host), binds the CDI
# dir given as $1 there, then runs the rest of the arguments.
NAMESPACE_SCRIPT = """
set -e
run=$(readlink -f /var/run)
mount -t tmpfs tmpfs "$run"
mkdir "$run/cdi"
mount --bind "$1" "$run/cdi"
shift
exec "$@"
"""
PODMAN_TIMEOUT = 120


def _is_static_elf(path: str) -> bool:
    """True for a 64-bit little-endian ELF without a PT_INTERP program header."""
    with open(path, "rb") as f:
        header = f.read(64)
        if len(header) < 64 or header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return False
        (phoff,) = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != 3 for i in range(phnum))


def _missing_tool() -> str | None:
    if os.geteuid() != 0:
        return "needs root (podman with a private mount namespace)"
    for tool in ("podman", "runc", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    busybox = shutil.which("busybox")
    if busybox is None or not _is_static_elf(busybox):
        return "a static busybox is not installed (Debian package busybox-static)"
    return None


@dataclass(frozen=True)
class Podman:
    root: Path
    conf: Path
    version: str

    def run(self, cdi_dir: Path, podman_args: Sequence[str]) -> subprocess.CompletedProcess[str]:
        command = [
            "unshare", "-m", "--propagation", "private",
            "sh", "-c", NAMESPACE_SCRIPT, "sh", str(cdi_dir),
            "podman",
            "--root", str(self.root / "storage"),
            "--runroot", str(self.root / "runroot"),
            "--storage-driver", "vfs",
            "--cgroup-manager", "cgroupfs",
            "--events-backend", "none",
            *podman_args,
        ]  # fmt: skip
        env = {**os.environ, "CONTAINERS_CONF": str(self.conf)}
        return subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=PODMAN_TIMEOUT, check=False
        )

    def run_env(self, cdi_dir: Path, devices: Sequence[str]) -> subprocess.CompletedProcess[str]:
        """``env`` in a container that asks for the given CDI devices."""
        return self.run_in(cdi_dir, devices, ["env"])

    def run_in(
        self, cdi_dir: Path, devices: Sequence[str], argv: Sequence[str]
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` in a container that asks for the given CDI devices."""
        flags = [arg for device in devices for arg in ("--device", device)]
        return self.run(cdi_dir, ["run", "--rm", "--pull", "never", *flags, IMAGE, *argv])


def _ulimit(kind: int) -> int:
    # Containers may not raise a limit here (no CAP_SYS_RESOURCE in some sandboxes): stay at or
    # below the current soft limit.
    soft, _ = resource.getrlimit(kind)
    return 1024 if soft == resource.RLIM_INFINITY else min(soft, 1024)


@pytest.fixture(scope="module")
def podman(tmp_path_factory: pytest.TempPathFactory) -> Podman:
    reason = _missing_tool()
    if reason is not None:
        pytest.skip(f"podman CDI test skipped: {reason}")
    root = tmp_path_factory.mktemp("podman")
    nofile, nproc = _ulimit(resource.RLIMIT_NOFILE), _ulimit(resource.RLIMIT_NPROC)
    conf = root / "containers.conf"
    conf.write_text(
        "[containers]\n"
        'netns = "none"\n'
        f'default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]\n'
        "[engine]\n"
        'runtime = "runc"\n'
    )
    rootfs = root / "rootfs.tar"
    busybox = shutil.which("busybox")
    assert busybox is not None
    with tarfile.open(rootfs, "w") as tar:
        tar.add(busybox, arcname="bin/busybox")
        for applet in ("sh", "env", "cat", "touch", "true"):
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type = tarfile.SYMTYPE
            link.linkname = "busybox"
            tar.addfile(link)
    version = subprocess.run(
        ["podman", "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[-1]
    tool = Podman(root, conf, version)
    empty_cdi = root / "empty-cdi"
    empty_cdi.mkdir()
    imported = tool.run(empty_cdi, ["import", str(rootfs), IMAGE])
    if imported.returncode != 0:
        pytest.skip(f"podman cannot import an image here: {imported.stderr.strip()}")
    control = tool.run_env(empty_cdi, [])
    if control.returncode != 0:
        pytest.skip(f"podman cannot run containers here: {control.stderr.strip()}")
    return tool


def _env_lines(result: subprocess.CompletedProcess[str]) -> list[str]:
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_podman_injects_the_env_of_our_spec(podman: Podman, tmp_path: Path) -> None:
    uid = str(uuid.uuid4())
    cpus = CpuSet.parse("0-3,8,10-11")
    write_spec(tmp_path, uid, cpus)
    lines = _env_lines(podman.run_env(tmp_path, [device_id(uid)]))
    assert f"DRA_CPUSET_{uid}=0-3,8,10-11" in lines
    assert parse_env(lines) == {uid: cpus}


def test_podman_injects_two_claims_into_one_container(podman: Podman, tmp_path: Path) -> None:
    claims = {str(uuid.uuid4()): CpuSet.parse("2-3"), str(uuid.uuid4()): CpuSet.parse("64,66")}
    for uid, cpus in claims.items():
        write_spec(tmp_path, uid, cpus)
    lines = _env_lines(podman.run_env(tmp_path, [device_id(uid) for uid in claims]))
    assert parse_env(lines) == claims


def test_podman_cannot_resolve_a_claim_without_our_spec(podman: Podman, tmp_path: Path) -> None:
    uid = str(uuid.uuid4())
    write_spec(tmp_path, str(uuid.uuid4()), CpuSet.parse("1"))  # another claim's spec only
    result = podman.run_env(tmp_path, [device_id(uid)])
    assert result.returncode != 0
    assert f"unresolvable CDI devices {device_id(uid)}" in result.stderr


def test_podman_4_3_accepts_cdi_0_5_0_but_not_0_6_0(podman: Podman, tmp_path: Path) -> None:
    # Why CDI_VERSION is 0.5.0 (docs/devices.md): the CDI library in podman 4.x and containerd
    # 1.7.0-1.7.11 rejects newer versions, and the claim's device becomes unresolvable.
    if not podman.version.startswith("4.3."):
        pytest.skip(f"the version limit is known for podman 4.3, not {podman.version}")
    uid = str(uuid.uuid4())
    write_spec(tmp_path, uid, CpuSet.parse("5"))
    path = spec_path(tmp_path, uid)
    assert parse_env(_env_lines(podman.run_env(tmp_path, [device_id(uid)]))) == {
        uid: CpuSet.parse("5")
    }
    path.write_bytes(path.read_bytes().replace(b'"0.5.0"', b'"0.6.0"'))
    assert path.name == spec_file_name(uid)
    result = podman.run_env(tmp_path, [device_id(uid)])
    assert result.returncode != 0
    assert f"unresolvable CDI devices {device_id(uid)}" in result.stderr


def test_podman_mounts_a_claim_s_device_metadata_read_only(podman: Podman, tmp_path: Path) -> None:
    uid = str(uuid.uuid4())
    config = NodeConfig.build("node-a", build_topology(FIXTURES["dual-socket-smt2"]))
    claim = PreparedClaim(
        uid,
        CpuSet.parse("2-3"),
        "team",
        "pod-1-cpus-x7k2p",
        None,
        (DeviceResult("cpus", "node-a", "cpudevnuma000", 2),),
        pod_claim_name="cpus",
    )
    cdi, metadata = tmp_path / "cdi", tmp_path / "plugin" / "dra-device-metadata"
    write_spec(cdi, uid, claim.cpus)
    write_claim(metadata, cdi, config, claim)
    [item] = claim_files(config, claim, str(metadata))
    inside = container_path(claim, "cpus")
    assert inside == (
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/cpus/cpus/"
        "dra.cpu-metadata.json"
    )
    devices = [device_id(uid), metadata_device_id(uid, "cpus")]
    # The kubelet passes both ids of the request's device; the runtime applies both specs.
    shown = podman.run_in(cdi, devices, ["cat", inside])
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.encode() == item.document
    assert json.loads(shown.stdout)["metadata"]["uid"] == uid
    assert parse_env(_env_lines(podman.run_env(cdi, devices))) == {uid: claim.cpus}
    # read-only: the workload cannot change what the driver wrote
    denied = podman.run_in(cdi, devices, ["touch", inside])
    assert denied.returncode != 0
    assert "Read-only file system" in denied.stderr + denied.stdout
    # without the spec, the device is unresolvable: the mount cannot silently go missing
    (cdi / item.spec_name).unlink()
    missing = podman.run_in(cdi, devices, ["true"])
    assert missing.returncode != 0
    assert "unresolvable CDI devices" in missing.stderr
    assert metadata_device_id(uid, "cpus") in missing.stderr
