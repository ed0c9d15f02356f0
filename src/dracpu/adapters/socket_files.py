"""The files of the unix sockets the kubelet connects to: where they go, who may open them, and
what an earlier run left behind.

:func:`listening_socket` makes a listening unix socket for ``path`` for the life of a ``with``
block, following the rules the kubelet's plugin watcher sets (kubernetes
``pkg/kubelet/pluginmanager/pluginwatcher/README.md``: a plugin "has to delete old sockets if
they exist and listen anew under the same filename"; dot-files are ignored):

- the socket's directory is created if missing (mode 0700, missing parents too). With
  ``private_dir=True`` an existing directory is narrowed to 0700 (our own
  ``<kubelet-root>/plugins/dra.cpu``); a directory shared with others (the kubelet's
  ``plugins_registry``, which every plugin uses) is never changed, only created;
- the socket is bound under a temporary dot-name in the same directory (the watcher ignores
  dot-files), chmod'ed to 0600 BEFORE ``listen`` (until then nobody can connect), and put into
  listening state. The caller starts serving it, then calls :meth:`UnixListener.publish`, which
  removes whatever an earlier run left at ``path`` (a socket, a regular file, a symbolic link,
  dangling or not; a directory is an error naming the path) and renames the socket over
  ``path`` in one step: the watcher sees a socket appear that already listens;
- on exit the listening socket is closed and the socket file removed, unless another process has
  meanwhile put its own file at ``path`` (a newer instance of the daemon must keep its socket).

Synchronous file-system calls: each is a single metadata operation on a local directory, done
once at start and once at stop.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from dracpu.errors import DracpuError

__all__ = [
    "BACKLOG",
    "DIR_MODE",
    "SOCKET_MODE",
    "UNIX_PATH_MAX",
    "UnixListener",
    "listening_socket",
    "remove_leftover",
]

logger = logging.getLogger(__name__)

# Every socket the daemon creates is readable and writable by its owner (root) alone, in a
# directory only its owner may enter: the kubelet runs as root, nobody else may prepare claims.
SOCKET_MODE = 0o600
DIR_MODE = 0o700
# sun_path of struct sockaddr_un holds 108 bytes on Linux including the terminating NUL
# (unix(7)); upstream checks the same limit (dra-driver-cpu pkg/driver/driver.go unixPathMax).
UNIX_PATH_MAX = 107
# Pending connections the kernel queues for us (grpclib's own default for Server.start); the
# kubelet keeps one connection per plugin socket.
BACKLOG = 100

_temp_counter = itertools.count()


def _check_path(path: Path) -> None:
    length = len(os.fsencode(path))
    if length > UNIX_PATH_MAX:
        raise DracpuError(
            f"socket path {str(path)!r} is {length} bytes long; unix sockets allow at most "
            f"{UNIX_PATH_MAX}"
        )


def _prepare_dir(directory: Path, *, private: bool) -> None:
    """Create ``directory`` (and missing parents) with mode 0700; narrow it if ``private``."""
    try:
        missing: list[Path] = []
        current = directory
        while not current.exists():
            missing.append(current)
            current = current.parent
        for created in reversed(missing):
            with contextlib.suppress(FileExistsError):
                created.mkdir(mode=DIR_MODE)
            created.chmod(DIR_MODE)  # mkdir's mode is narrowed by the umask, never widened
        if not directory.is_dir():
            raise DracpuError(f"socket directory {str(directory)!r} is not a directory")
        if private and stat.S_IMODE(directory.stat().st_mode) != DIR_MODE:
            directory.chmod(DIR_MODE)
    except OSError as exc:
        raise DracpuError(
            f"cannot prepare socket directory {str(directory)!r}: {exc.strerror or exc}"
        ) from exc


def _kind(mode: int) -> str:
    if stat.S_ISSOCK(mode):
        return "socket"
    if stat.S_ISLNK(mode):
        return "symbolic link"
    if stat.S_ISREG(mode):
        return "regular file"
    return "file"


def remove_leftover(path: Path) -> str | None:
    """Remove whatever is at ``path`` (not following a symbolic link): what it was, or ``None``
    if nothing was there.

    Raises :class:`DracpuError` naming ``path`` if it is a directory (never removed: it is not
    something a socket left) or cannot be removed.
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DracpuError(f"cannot inspect {str(path)!r}: {exc.strerror or exc}") from exc
    if stat.S_ISDIR(info.st_mode):
        raise DracpuError(
            f"{str(path)!r} is a directory; the socket cannot be placed there (remove it)"
        )
    try:
        path.unlink()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise DracpuError(f"cannot remove {str(path)!r}: {exc.strerror or exc}") from exc
    return _kind(info.st_mode)


def _temp_path(path: Path) -> Path:
    """A dot-name beside ``path``, no longer than ``path`` allows (the watcher skips dot-files)."""
    temp = path.with_name(f".{os.getpid()}.{next(_temp_counter)}.sock")
    if len(os.fsencode(temp)) > UNIX_PATH_MAX:
        temp = path.with_name(f".{next(_temp_counter)}")
    return temp


def _bind_private(temp: Path) -> socket.socket:
    """A non-blocking unix socket bound at ``temp``, mode 0600, listening."""
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()  # a leftover of a crashed start of the same pid (pid reuse)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(temp))
        os.chmod(temp, SOCKET_MODE)  # before listen(): nobody can connect until then
        sock.listen(BACKLOG)
        sock.setblocking(False)
    except OSError as exc:
        sock.close()
        with contextlib.suppress(OSError):
            temp.unlink()
        raise DracpuError(f"cannot bind unix socket {str(temp)!r}: {exc.strerror or exc}") from exc
    return sock


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        info = path.lstat()
    except OSError:
        return None
    return info.st_dev, info.st_ino


@dataclass(eq=False, slots=True)
class UnixListener:
    """A listening unix socket, bound under a temporary name until :meth:`publish`."""

    path: Path
    socket: socket.socket
    _temp: Path
    _identity: tuple[int, int] | None
    published: bool = False

    def publish(self) -> None:
        """Remove what an earlier run left at :attr:`path` and move the socket there.

        Raises :class:`DracpuError` naming the path if a directory is in the way or the rename
        fails.
        """
        left = remove_leftover(self.path)
        if left is not None:
            logger.info("removed a stale %s at %s", left, self.path, extra={"path": str(self.path)})
        try:
            os.rename(self._temp, self.path)
        except OSError as exc:
            raise DracpuError(
                f"cannot move socket {str(self._temp)!r} to {str(self.path)!r}: "
                f"{exc.strerror or exc}"
            ) from exc
        self.published = True

    def _remove(self) -> None:
        """Remove our socket file; leave a file another process put at the path since."""
        if not self.published:
            with contextlib.suppress(OSError):
                self._temp.unlink()
            return
        current = _identity(self.path)
        if current is None:
            return  # already gone
        if current != self._identity:
            logger.warning("socket %s was replaced by someone else; leaving it", self.path)
            return
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            logger.error("cannot remove socket %s: %s", self.path, exc.strerror or exc)


@contextlib.contextmanager
def listening_socket(path: Path, *, private_dir: bool = False) -> Iterator[UnixListener]:
    """A listening unix socket for ``path`` (see the module docstring), until the block exits.

    ``private_dir``: the directory belongs to us alone, so an existing one is narrowed to 0700.

    Raises :class:`DracpuError` naming the path when it is too long, the directory cannot be
    made or binding fails. Resource handling: the socket is closed and its file removed on exit
    (see :meth:`UnixListener._remove`), also when the block raises.
    """
    _check_path(path)
    _prepare_dir(path.parent, private=private_dir)
    temp = _temp_path(path)
    sock = _bind_private(temp)
    listener = UnixListener(path, sock, temp, _identity(temp))
    try:
        yield listener
    finally:
        sock.close()
        listener._remove()
