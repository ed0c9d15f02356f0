"""The kubelet sockets' files (``dracpu.adapters.socket_files``): modes, the temporary name, what
an earlier run left at the path, removal on exit. Checked with plain unix sockets as peers."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

import pytest

from dracpu.adapters.socket_files import (
    DIR_MODE,
    SOCKET_MODE,
    UNIX_PATH_MAX,
    listening_socket,
    remove_leftover,
)
from dracpu.errors import DracpuError

__all__: list[str] = []


def _connects(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as peer:
        try:
            peer.connect(str(path))
        except OSError:
            return False
        return True


def _dead_socket(path: Path) -> None:
    """A socket file nobody listens on: what a crashed instance leaves."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as crashed:
        crashed.bind(str(path))


def test_the_socket_listens_under_a_dot_name_until_published(tmp_path: Path) -> None:
    path = tmp_path / "plugins" / "dra.cpu" / "dra.sock"
    with listening_socket(path) as listener:
        [temp] = list(path.parent.iterdir())
        assert temp.name.startswith(".")  # the kubelet's plugin watcher skips dot-files
        assert stat.S_IMODE(temp.lstat().st_mode) == SOCKET_MODE == 0o600
        assert not path.exists()
        assert _connects(temp)  # listening already: it is served before it is published

        listener.publish()

        assert [p.name for p in path.parent.iterdir()] == ["dra.sock"]
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert stat.S_IMODE(path.lstat().st_mode) == 0o600
        assert _connects(path)
    assert list(path.parent.iterdir()) == []
    assert not _connects(path)


def test_missing_directories_are_created_0700(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "dra.sock"
    old = os.umask(0)  # whatever the umask (here: none), the mode is exactly 0700
    try:
        with listening_socket(path):
            modes = [stat.S_IMODE(d.stat().st_mode) for d in (path.parent, path.parent.parent)]
    finally:
        os.umask(old)
    assert modes == [DIR_MODE, DIR_MODE] == [0o700, 0o700]


def test_a_private_directory_is_narrowed_a_shared_one_kept(tmp_path: Path) -> None:
    private = tmp_path / "plugins" / "dra.cpu"
    shared = tmp_path / "plugins_registry"
    for directory in (private, shared):
        directory.mkdir(parents=True)
        directory.chmod(0o755)
    with listening_socket(private / "dra.sock", private_dir=True):
        private_mode = stat.S_IMODE(private.stat().st_mode)
    with listening_socket(shared / "dra.cpu-reg.sock"):
        shared_mode = stat.S_IMODE(shared.stat().st_mode)
    assert (private_mode, shared_mode) == (0o700, 0o755)


@pytest.mark.parametrize("kind", ["socket", "regular file", "dangling symlink", "symlink"])
def test_whatever_an_earlier_run_left_is_removed_and_reported(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "dra.sock"
    target = tmp_path / "target"
    target.write_text("kept")
    if kind == "socket":
        _dead_socket(path)
    elif kind == "regular file":
        path.write_text("left over")
    elif kind == "dangling symlink":
        path.symlink_to(tmp_path / "gone")
    else:
        path.symlink_to(target)
    expected = "symbolic link" if "symlink" in kind else kind
    before = path.lstat().st_ino

    with listening_socket(path) as listener:
        listener.publish()
        assert stat.S_ISSOCK(path.lstat().st_mode)
        assert path.lstat().st_ino != before
        assert _connects(path)

    assert target.read_text() == "kept"  # a link is removed, never followed
    assert remove_leftover(path) is None  # and ours is gone
    path.write_text("x")
    assert remove_leftover(path) == "regular file"
    if kind != "regular file":
        if kind == "socket":
            _dead_socket(path)
        else:
            path.symlink_to(target)
        assert remove_leftover(path) == expected


def test_a_directory_in_the_way_is_an_error_naming_it_and_is_kept(tmp_path: Path) -> None:
    path = tmp_path / "dra.sock"
    path.mkdir()
    (path / "inside").write_text("kept")
    with listening_socket(path) as listener, pytest.raises(DracpuError) as caught:
        listener.publish()
    assert str(path) in str(caught.value)
    assert "is a directory" in str(caught.value)
    assert (path / "inside").read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["dra.sock"]  # the temporary is gone too


def test_a_socket_another_process_put_there_meanwhile_is_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "dra.sock"
    with listening_socket(path) as listener:
        listener.publish()
        path.unlink()
        newer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        newer.bind(str(path))  # a newer instance took the path over
    try:
        assert stat.S_ISSOCK(path.lstat().st_mode)
    finally:
        newer.close()


def test_an_unpublished_socket_leaves_nothing_behind(tmp_path: Path) -> None:
    path = tmp_path / "dra.sock"
    with pytest.raises(RuntimeError), listening_socket(path):
        raise RuntimeError("serving failed before the socket was published")
    assert list(tmp_path.iterdir()) == []


def test_a_path_too_long_for_a_unix_socket_is_refused_before_anything_is_made(
    tmp_path: Path,
) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "dra.sock"
    assert len(os.fsencode(deep)) > UNIX_PATH_MAX
    with pytest.raises(DracpuError, match=f"unix sockets allow at most {UNIX_PATH_MAX}"):
        listening_socket(deep).__enter__()
    assert not deep.parent.parent.exists()


def test_a_long_path_gets_a_short_temporary_name(tmp_path: Path) -> None:
    """The temporary dot-name must fit where the final name fits."""
    room = UNIX_PATH_MAX - len(os.fsencode(tmp_path)) - 1  # the "/" takes one byte
    path = tmp_path / ("s" * room)
    assert len(os.fsencode(path)) == UNIX_PATH_MAX
    with listening_socket(path) as listener:
        [temp] = list(tmp_path.iterdir())
        assert temp.name.startswith(".")
        assert len(os.fsencode(temp)) <= UNIX_PATH_MAX
        listener.publish()
        assert _connects(path)
