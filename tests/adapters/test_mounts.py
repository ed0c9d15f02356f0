"""Whether --state-dir outlives the pod, read from a mount table."""

from __future__ import annotations

from pathlib import Path

import pytest

from dracpu.adapters.mounts import Mount, mount_reason, parse_mountinfo, volatile_reason

# /proc/self/mountinfo of a container under containerd: an overlay root, a hostPath bind mount
# of the node's /var/lib/dracpu (ext4), an emptyDir with medium Memory, /etc/hosts from the host.
CONTAINER = """\
1880 1650 0:312 / / rw,relatime master:520 - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
1881 1880 0:315 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw
1890 1880 254:1 /var/lib/dracpu /var/lib/dracpu rw,relatime - ext4 /dev/vda1 rw
1891 1880 0:320 / /scratch rw,relatime - tmpfs tmpfs rw,size=1024k
1892 1880 254:1 /etc/hosts /etc/hosts rw,relatime - ext4 /dev/vda1 rw
1893 1880 0:321 / /mnt/with\\040space rw,relatime - tmpfs tmpfs rw
"""
# A kind node: the node's root is itself an overlay (docker), so a hostPath is a bind mount of
# an overlay directory; it still outlives the pod.
KIND = """\
700 600 0:50 / / rw,relatime - overlay overlay rw,lowerdir=/l,upperdir=/u,workdir=/w
710 700 0:40 /var/lib/dracpu /var/lib/dracpu rw,relatime - overlay overlay rw,lowerdir=/a
"""


def test_parse_reads_the_mount_point_and_type_and_unescapes() -> None:
    mounts = list(parse_mountinfo(CONTAINER + "garbage line\n"))
    assert mounts[0] == Mount("/", "overlay")
    assert mounts[2] == Mount("/var/lib/dracpu", "ext4")
    assert mounts[-1] == Mount("/mnt/with space", "tmpfs")
    assert len(mounts) == 6


@pytest.mark.parametrize(
    ("path", "table", "expected"),
    [
        ("/var/lib/dracpu", CONTAINER, None),  # a hostPath: kept
        ("/var/lib/dracpu/sub", CONTAINER, None),
        ("/var/lib/dracpu", KIND, None),  # a bind mount of an overlay: kept
        ("/var/lib/other", CONTAINER, "it is on the container's own root filesystem (overlay)"),
        ("/scratch/state", CONTAINER, "it is on a tmpfs (memory) mounted at /scratch"),
        ("/mnt/with space/x", CONTAINER, "it is on a tmpfs (memory) mounted at /mnt/with space"),
        (
            "/var/lib/dracpu-not",
            CONTAINER,
            "it is on the container's own root filesystem (overlay)",
        ),
    ],
)
def test_mount_reason(path: str, table: str, expected: str | None) -> None:
    assert mount_reason(path, table) == expected


def test_a_host_root_on_ext4_is_kept() -> None:
    table = "27 1 254:0 / / rw,relatime - ext4 /dev/vda rw\n"
    assert mount_reason("/var/lib/dracpu", table) is None


def test_the_real_table_is_read_and_a_missing_dir_is_judged_by_its_parent() -> None:
    table = list(parse_mountinfo(Path("/proc/self/mountinfo").read_text()))
    assert any(m.mount_point == "/" for m in table)
    shm = [m for m in table if m.mount_point == "/dev/shm" and m.fs_type == "tmpfs"]
    if not shm:
        pytest.skip("this machine has no tmpfs at /dev/shm")
    assert volatile_reason(Path("/dev/shm/no-such-dir/state")) == (
        "it is on a tmpfs (memory) mounted at /dev/shm"
    )
