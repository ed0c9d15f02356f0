"""Our CDI spec files on disk, written: atomic write, delete, prune (synchronous; the state
owner runs them in anyio's worker threads, and is the only writer of the CDI dir). Reading them
is :mod:`dracpu.adapters.file_scan`.

Runtimes watch the CDI directory with fsnotify for Write, Rename and Remove only (Create is not
watched on Linux; a Write counts only for a ``.json`` / ``.yaml`` name, a Rename or Remove of any
file makes them rescan) and read only ``*.json`` / ``*.yaml`` files (container-device-interface
``pkg/cdi/cache.go``, ``watch.watch``, and ``pkg/cdi/spec-dirs.go``, ``scanSpecDirs``). So a
spec is written to a temp file in the SAME directory whose name does not end in ``.json``
(``.dra.k8s.io-cpu_claim-<uid>.json.tmp-<random>``) and renamed over the final name (the Rename
event makes the runtime rescan; it never sees a half-written spec), and a file that holds the
bytes to write already is left alone (no rename, no rescan).

A written spec is NOT fsynced: the checkpoint is the durable record of the prepared claims (it is
made durable after the spec is written and before the kubelet is answered), and every start
rewrites the spec of every prepared claim that differs (``Resync``), so a spec that a power loss
cut short or lost is put back before any container can need it. A DELETE is made durable (the
directory is fsynced): a spec of ours that outlived its claim would be adopted at the next
start, holding CPUs the kubelet considers free. (On ``/var/run/cdi``, tmpfs, an fsync does
nothing at all; on a disk-backed CDI dir it is a disk flush: ``cdi.plain_write_2k_fsync`` in
``bench/bench_cdi.py``.)

Only files named exactly like ours (``dra.k8s.io-cpu_claim-<uuid>.json``) and our temp and probe
files are ever removed or replaced; other vendors' files are never opened for writing. Every
``OSError`` becomes a :class:`CdiError` naming the path.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path

from dracpu.adapters.file_scan import is_leftover, read_ours
from dracpu.core.cdi_spec import claim_uid_from_file_name, spec_bytes, spec_file_name
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CdiError

__all__ = [
    "DIR_MODE",
    "PROBE_PREFIX",
    "SPEC_MODE",
    "check_writable",
    "delete_spec",
    "ensure_dir",
    "is_our_probe_file",
    "probe_file_name",
    "prune",
    "spec_path",
    "temp_file_name",
    "temp_target",
    "write_atomically",
    "write_changed",
    "write_spec",
]

# Spec files are world-readable: the runtime (root) reads them, and so do rootless podman and
# node tools; they hold no secret. Upstream's file writer also used 0644 (pkg/driver/cdi.go).
SPEC_MODE = 0o644
# Mode of a CDI dir we create; the DaemonSet mounts /var/run/cdi as DirectoryOrCreate (0755) and
# upstream creates it with os.MkdirAll(dir, 0755).
DIR_MODE = 0o755
# Temp files: "." + final name + ".tmp-" + random hex. Hidden, and not ending in .json/.yaml, so
# runtimes ignore them (CDI loads only .json and .yaml).
_TEMP_MARK = ".tmp-"
_TEMP_RE = re.compile(r"\.(?P<final>.+)" + re.escape(_TEMP_MARK) + r"[0-9a-f]{8,64}")
# The probe the state owner writes (and removes at once) to learn whether files can be created
# in the CDI dir: hidden and not .json, so runtimes ignore it.
PROBE_PREFIX = ".dracpu-cdi-probe-"
_PROBE_RE = re.compile(re.escape(PROBE_PREFIX) + r"[0-9]+-[0-9a-f]{8,64}")

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

Fsync = Callable[[int], None]


# --- names -----------------------------------------------------------------------------------


def spec_path(cdi_dir: str | os.PathLike[str], claim_uid: str) -> Path:
    """``<cdi_dir>/dra.k8s.io-cpu_claim-<uid>.json`` (the uid is validated)."""
    return Path(cdi_dir) / spec_file_name(claim_uid)


def temp_file_name(claim_uid: str) -> str:
    """A fresh temp name for a claim's spec: ``.<final name>.tmp-<16 hex>``."""
    return "." + spec_file_name(claim_uid) + _TEMP_MARK + secrets.token_hex(8)


def temp_target(name: str) -> str | None:
    """The final name of a temp file name :func:`write_atomically` makes, else ``None``."""
    match = _TEMP_RE.fullmatch(name)
    return match.group("final") if match else None


def probe_file_name() -> str:
    """A fresh probe name: ``.dracpu-cdi-probe-<pid>-<16 hex>``."""
    return f"{PROBE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}"


def is_our_probe_file(name: str) -> bool:
    return _PROBE_RE.fullmatch(name) is not None


# --- directory -------------------------------------------------------------------------------


def ensure_dir(cdi_dir: str | os.PathLike[str]) -> None:
    """Create the CDI dir (and parents, mode 0755) if missing; it must be a directory."""
    path = Path(cdi_dir)
    try:
        path.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
    except FileExistsError as exc:  # exists, but is not a directory
        raise CdiError(f"CDI dir {str(path)!r} exists and is not a directory") from exc
    except OSError as exc:
        raise CdiError(f"cannot create CDI dir {str(path)!r}: {exc.strerror or exc}") from exc


def _fsync_dir(path: str | os.PathLike[str], fsync: Fsync) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def check_writable(cdi_dir: str | os.PathLike[str]) -> None:
    """Prove that specs can be written into the CDI dir now: create it if missing, write a
    probe file and remove it again. :class:`CdiError` says why not (read-only, full, not a
    directory, ...). The probe's removal makes every runtime rescan the dir: it is written only
    at start and while the dir is known not to take writes."""
    ensure_dir(cdi_dir)
    path = os.path.join(os.fspath(cdi_dir), probe_file_name())
    try:
        fd = os.open(path, _CREATE_FLAGS, SPEC_MODE)
        try:
            os.write(fd, b"x")  # a full file system may take the create and refuse the data
        finally:
            os.close(fd)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise CdiError(
            f"cannot create files in CDI dir {os.fspath(cdi_dir)!r}: {exc.strerror or exc}"
        ) from exc
    os.unlink(path)


# --- write and delete ------------------------------------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_spec(
    cdi_dir: str | os.PathLike[str], claim_uid: str, cpus: CpuSet, shared_pool: bool = False
) -> bool:
    """Write the spec of a claim (``shared_pool``: with ``DRA_SHARED_POOL_<uid>``) unless it
    holds these bytes already; whether it was written.

    Temp file in the same dir (mode 0644, never a ``.json`` name) → write → rename over
    ``dra.k8s.io-cpu_claim-<uid>.json``; no fsync (see the module docstring). The dir is
    created if missing. On any failure the temp file is removed and an existing spec is left as
    it was.
    """
    data = spec_bytes(claim_uid, cpus, shared_pool)  # checks uid and cpuset before the disk
    return write_changed(
        os.fspath(cdi_dir), spec_file_name(claim_uid), data, "CDI spec", ensure_dir
    )


def write_changed(
    directory: str, name: str, data: bytes, what: str, make_dir: Callable[[str], None]
) -> bool:
    """:func:`write_atomically` unless ``<directory>/<name>`` is a regular file that holds
    ``data`` already; whether it was written. A file that cannot be read is replaced."""
    try:
        if read_ours(os.path.join(directory, name), what) == data:
            return False
    except CdiError:
        pass  # a symlink, a directory, unreadable: replaced (a directory fails the rename)
    write_atomically(directory, name, data, what, make_dir)
    return True


def write_atomically(
    directory: str,
    name: str,
    data: bytes,
    what: str,
    make_dir: Callable[[str], None],
) -> str:
    """Write ``data`` to ``<directory>/<name>`` the way runtimes must see a CDI spec appear:
    a temp file ``.<name>.tmp-<random>`` in the same dir (mode 0644) → write → rename over the
    final name; no fsync. ``make_dir(directory)`` creates the dir when the temp file cannot be
    (it exists, almost always). On any failure the temp file is removed, an existing file is
    left as it was, and :class:`CdiError` says ``cannot write <what> '<path>': <reason>``.

    On the Prepare path: plain string paths (pathlib's parsing was a large part of a spec
    write's Python time, ``cdi.write_spec`` in ``bench/bench_cdi.py``).
    """
    final = os.path.join(directory, name)
    temp = os.path.join(directory, "." + name + _TEMP_MARK + secrets.token_hex(8))
    try:
        fd = _create(temp, directory, make_dir)
    except OSError as exc:  # the temp file's random name would only make the message vary
        raise CdiError(f"cannot write {what} {final!r}: {exc.strerror or exc}") from exc
    renamed = False
    try:
        try:
            os.fchmod(fd, SPEC_MODE)  # the umask must not narrow it
            _write_all(fd, data)
        finally:
            os.close(fd)
        os.rename(temp, final)
        renamed = True
    except OSError as exc:
        raise CdiError(f"cannot write {what} {final!r}: {exc.strerror or exc}") from exc
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(temp)
    return final


def _create(temp: str, directory: str, make_dir: Callable[[str], None]) -> int:
    """Create the temp file; create the dir if that is what is missing (or say it is not one)."""
    try:
        return os.open(temp, _CREATE_FLAGS, SPEC_MODE)
    except (FileNotFoundError, NotADirectoryError):
        make_dir(directory)  # CdiError if it cannot be made or is not a directory
        return os.open(temp, _CREATE_FLAGS, SPEC_MODE)


def delete_spec(
    cdi_dir: str | os.PathLike[str], claim_uid: str, *, fsync: Fsync = os.fsync
) -> bool:
    """Remove a claim's spec; ``True`` if a file was removed, ``False`` if there was none."""
    directory = os.fspath(cdi_dir)
    path = os.path.join(directory, spec_file_name(claim_uid))
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        # A read-only file system refuses the unlink (EROFS) before it looks the name up: a
        # spec that is not there was not to be removed (a rollback of a write that never
        # happened), and is no failure.
        if not os.path.lexists(path):
            return False
        raise CdiError(f"cannot remove CDI spec {path!r}: {exc.strerror or exc}") from exc
    with contextlib.suppress(OSError):  # removal is done; durability of a tmpfs entry is moot
        _fsync_dir(directory, fsync)
    return True


def prune(cdi_dir: str | os.PathLike[str], keep: frozenset[str]) -> list[str]:
    """Delete our specs whose claim is not in ``keep``, and the temp and probe files of writes
    cut short (the state owner prunes between its own writes: every one of ours is a
    leftover); the names removed. Raises :class:`CdiError` naming every file that could not
    be removed (after trying all)."""
    directory = os.fspath(cdi_dir)
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CdiError(f"cannot list CDI dir {directory!r}: {exc.strerror or exc}") from exc
    removed: list[str] = []
    errors: list[str] = []
    for name in names:
        uid = claim_uid_from_file_name(name)
        try:
            if uid is not None and uid not in keep:
                if delete_spec(directory, uid):
                    removed.append(name)
            elif uid is None and is_leftover(name) and _remove(os.path.join(directory, name)):
                removed.append(name)
        except CdiError as exc:
            errors.append(str(exc))
    if errors:
        raise CdiError("; ".join(errors))
    return removed


def _remove(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CdiError(f"cannot remove {path!r}: {exc.strerror or exc}") from exc
    return True
