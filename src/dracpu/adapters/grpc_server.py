"""grpclib servers on unix sockets, with the socket-file rules of design §5.

:func:`open_unix_server` serves grpclib handlers on a unix socket path for the life of an
``async with`` block:

- the socket's directory is created if missing (mode 0700); with ``private_dir=True`` an
  existing directory is narrowed to 0700 too (our own ``<kubelet-root>/plugins/dra.cpu``). A
  directory shared with others (the kubelet's ``plugins_registry``, which other plugins use as
  well) is never changed, only created;
- a stale socket file at the path (a crashed instance's) is replaced; anything that is not a
  socket is refused with an error, never deleted;
- the socket appears at its path only once it is listening and already mode 0600: it is bound
  under a temporary dot-name in the same directory (the kubelet's plugin watcher ignores
  dot-files), chmod'ed, put into listening state and served, then renamed over the final path
  in one step (the watcher sees it as a creation, as it would a fresh bind);
- on exit the server stops: in-flight calls are cancelled, open connections are closed (the
  kubelet sees the plugin go away) and the socket file is removed, unless another process has
  meanwhile replaced it.

The only module that touches grpclib's server (the kubelet plugin uses grpclib's handler types
and status codes only), and one of the two that use asyncio directly, with
:mod:`dracpu.tasks.serial_thread` (design §3: anyio everywhere else).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import stat
import weakref
from collections.abc import AsyncIterator, Collection
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.lowlevel
import grpclib.server
from grpclib._typing import IServable
from grpclib.protocol import H2Protocol

from dracpu.errors import DracpuError

__all__ = [
    "DIR_MODE",
    "SOCKET_MODE",
    "STOP_TIMEOUT",
    "UNIX_PATH_MAX",
    "Servable",
    "UnixServer",
    "open_unix_server",
    "remove_stale_socket",
]

logger = logging.getLogger(__name__)

# Design §5: every socket the daemon creates is mode 0600 in a 0700 directory.
SOCKET_MODE = 0o600
DIR_MODE = 0o700
# sun_path of struct sockaddr_un holds 108 bytes on Linux including the terminating NUL
# (unix(7)); upstream checks the same limit (dra-driver-cpu pkg/driver/driver.go unixPathMax).
UNIX_PATH_MAX = 107
# How long closing waits for the handlers of cancelled calls to finish (seconds). grpclib
# cancels them at close; they only need to send their trailers. Bounded so a stuck peer cannot
# hold up the daemon's 5 s stop.
STOP_TIMEOUT = 1.0
# Pending connections the kernel queues for us; the kubelet keeps one connection per plugin,
# grpclib's own default is 100.
BACKLOG = 100

_temp_counter = itertools.count()

Servable = IServable
"""A grpclib service object (anything with ``__mapping__``, e.g. a betterproto2 ``*Base``)."""


class _Server(grpclib.server.Server):
    """grpclib's server, remembering its connections so that closing can drop them.

    ``grpclib.server.Server.close`` stops listening and cancels the calls in flight but leaves
    the connections open (asyncio's ``Server.close_clients`` is 3.13+); an idle kubelet
    connection would outlive the server and leak its socket. grpclib makes one ``H2Protocol``
    per connection through ``_protocol_factory``.
    """

    def __init__(self, handlers: Collection[IServable]) -> None:
        super().__init__(handlers)
        self._connections: weakref.WeakSet[H2Protocol] = weakref.WeakSet()

    def _protocol_factory(self) -> H2Protocol:
        protocol = super()._protocol_factory()
        self._connections.add(protocol)
        return protocol

    def close_connections(self) -> int:
        """Close every connection still open; how many there were."""
        closed = 0
        for protocol in list(self._connections):
            connection = getattr(protocol, "connection", None)  # set by connection_made
            if connection is not None and not connection.is_closing():
                connection.close()
                closed += 1
        return closed


@dataclass(frozen=True, slots=True)
class UnixServer:
    """A running server: its socket path and the grpclib server (for its handlers' state)."""

    path: Path
    server: grpclib.server.Server


def _check_path(path: Path) -> None:
    if len(os.fsencode(path)) > UNIX_PATH_MAX:
        raise DracpuError(
            f"socket path {str(path)!r} is {len(os.fsencode(path))} bytes long; unix sockets "
            f"allow at most {UNIX_PATH_MAX}"
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


def remove_stale_socket(path: Path) -> bool:
    """Remove a socket file left at ``path``; ``True`` if one was removed.

    Raises :class:`DracpuError` if ``path`` exists and is not a socket (we never delete a file
    we did not make) or cannot be removed.
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise DracpuError(f"cannot inspect {str(path)!r}: {exc.strerror or exc}") from exc
    if not stat.S_ISSOCK(info.st_mode):
        raise DracpuError(f"{str(path)!r} exists and is not a socket; refusing to replace it")
    try:
        path.unlink()
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise DracpuError(
            f"cannot remove stale socket {str(path)!r}: {exc.strerror or exc}"
        ) from exc
    return True


def _temp_path(path: Path) -> Path:
    """A dot-name beside ``path``, no longer than ``path`` allows (the watcher skips dot-files)."""
    temp = path.with_name(f".{os.getpid()}.{next(_temp_counter)}.sock")
    if len(os.fsencode(temp)) > UNIX_PATH_MAX:
        temp = path.with_name(f".{next(_temp_counter)}")
    return temp


def _bind_private(temp: Path) -> socket.socket:
    """A listening unix socket bound at ``temp`` with mode 0600."""
    with contextlib.suppress(FileNotFoundError):
        temp.unlink()  # a leftover of a crashed start of the same pid (pid reuse)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(temp))
        os.chmod(temp, SOCKET_MODE)
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


def _remove_if_ours(path: Path, identity: tuple[int, int] | None) -> None:
    """Remove the socket file we made; leave a file another process put there since."""
    current = _identity(path)
    if current is None:
        return  # already gone
    if current != identity:
        logger.warning("socket %s was replaced by someone else; leaving it", path)
        return
    try:
        path.unlink()
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.error("cannot remove socket %s: %s", path, exc.strerror or exc)


@asynccontextmanager
async def open_unix_server(
    handlers: Collection[Servable],
    path: Path,
    *,
    private_dir: bool = False,
) -> AsyncIterator[UnixServer]:
    """Serve ``handlers`` on the unix socket ``path`` until the block exits.

    ``private_dir``: the directory belongs to us alone, so an existing one is narrowed to 0700.

    Raises :class:`DracpuError` (naming the path) when the path is too long, the directory cannot
    be made, a non-socket file is in the way, or binding fails. Resource handling: the listening
    socket, the server and the socket file are released on exit, also on cancellation.
    """
    _check_path(path)
    _prepare_dir(path.parent, private=private_dir)
    temp = _temp_path(path)
    sock = _bind_private(temp)
    server = _Server(handlers)
    started = placed = False
    identity = _identity(temp)
    try:
        try:
            await server.start(sock=sock, backlog=BACKLOG)
        except OSError as exc:
            raise DracpuError(f"cannot serve on {str(path)!r}: {exc.strerror or exc}") from exc
        started = True
        if remove_stale_socket(path):
            logger.info("removed a stale socket at %s", path)
        try:
            os.rename(temp, path)
        except OSError as exc:
            raise DracpuError(
                f"cannot move socket {str(temp)!r} to {str(path)!r}: {exc.strerror or exc}"
            ) from exc
        placed = True
        logger.debug("serving gRPC on %s", path)
        yield UnixServer(path, server)
    finally:
        with anyio.CancelScope(shield=True):
            if started:
                server.close()
                if server.close_connections():
                    await anyio.lowlevel.checkpoint()  # the transports finish closing
                with anyio.move_on_after(STOP_TIMEOUT):
                    await server.wait_closed()
            sock.close()
            if placed:
                _remove_if_ours(path, identity)
            else:
                with contextlib.suppress(OSError):
                    temp.unlink()
