"""Our CDI spec files on disk: atomic write, delete, read, list (synchronous; callers run them
off the event loop: the state owner runs them in anyio's worker threads).

Runtimes watch the CDI directory with fsnotify for Write, Rename and Remove only (Create is not
watched on Linux; a Write counts only for a ``.json`` / ``.yaml`` name, a Rename or Remove of any
file makes them rescan) and read only ``*.json`` / ``*.yaml`` files (container-device-interface
``pkg/cdi/cache.go``, ``watch.watch``, and ``pkg/cdi/spec-dirs.go``, ``scanSpecDirs``). So a
spec is written to a temp file in the SAME directory whose name does not end in ``.json``
(``.dra.k8s.io-cpu_claim-<uid>.json.tmp-<random>``) and renamed over the final name (the Rename
event makes the runtime rescan; it never sees a half-written spec).

A written spec is NOT fsynced: the checkpoint is the durable record of the prepared claims (it is
made durable after the spec is written and before the kubelet is answered), and every start
rewrites the spec of every prepared claim (``Resync``), so a spec that a power loss cut short or
lost is put back before any container can need it. A DELETE is made durable (the directory is
fsynced): a spec of ours that outlived its claim would be adopted at the next start, holding CPUs
the kubelet considers free. (On ``/var/run/cdi``, tmpfs, an fsync does nothing at all; on a
disk-backed CDI dir it is a disk flush: ``cdi.plain_write_2k_fsync`` in ``bench/bench_cdi.py``.)

Only files named exactly like ours (``dra.k8s.io-cpu_claim-<uuid>.json``), our temp files and our
watch probes are ever removed or replaced; other vendors' files are never opened for writing. Reads
use ``O_NOFOLLOW | O_NONBLOCK`` and accept only regular files of bounded size, so a symlink, FIFO or
device planted under one of our names cannot redirect or hang us. Every ``OSError`` becomes a
:class:`CdiError` naming the path.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from dracpu.core.cdi_spec import (
    ClaimSpec,
    claim_uid_from_file_name,
    is_valid_claim_uid,
    parse_claim_spec,
    spec_bytes,
    spec_file_name,
)
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CdiError

__all__ = [
    "DIR_MODE",
    "MAX_SPEC_BYTES",
    "PROBE_PREFIX",
    "SPEC_MODE",
    "CdiDirScan",
    "check_not_full",
    "check_writable",
    "delete_spec",
    "dir_identity",
    "ensure_dir",
    "is_our_probe_file",
    "is_our_temp_file",
    "list_our_specs",
    "probe_file_name",
    "read_spec",
    "read_spec_bytes",
    "remove_our_file",
    "scan_dir",
    "spec_path",
    "temp_file_name",
    "temp_target",
    "touch_probe",
    "write_atomically",
    "write_spec",
]

# Spec files are world-readable: the runtime (root) reads them, and so do rootless podman and
# node tools; they hold no secret. Upstream's file writer also used 0644 (pkg/driver/cdi.go).
SPEC_MODE = 0o644
# Mode of a CDI dir we create; the DaemonSet mounts /var/run/cdi as DirectoryOrCreate (0755) and
# upstream creates it with os.MkdirAll(dir, 0755).
DIR_MODE = 0o755
# Largest spec we agree to read. Ours are a few hundred bytes (a worst-case cpuset of every other
# CPU up to id 16383 is ~50 KB); anything bigger under our name is not ours.
MAX_SPEC_BYTES = 1 << 20
# Temp files: "." + final name + ".tmp-" + random hex. Hidden, and not ending in .json/.yaml, so
# runtimes ignore them (CDI loads only .json and .yaml).
_TEMP_MARK = ".tmp-"
_TEMP_RE = re.compile(r"\.(?P<final>.+)" + re.escape(_TEMP_MARK) + r"[0-9a-f]{8,64}")
# Watch probes (tasks/cdi_watcher.py): a hidden, non-.json file the watcher creates to prove its
# watch is live.
PROBE_PREFIX = ".dracpu-cdi-probe-"
_PROBE_RE = re.compile(re.escape(PROBE_PREFIX) + r"[0-9]+-[0-9a-f]{8,64}")

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
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


def is_our_temp_file(name: str) -> bool:
    """True for a temp file name of one of our claims' specs (:func:`temp_file_name`)."""
    final = temp_target(name)
    return final is not None and claim_uid_from_file_name(final) is not None


def probe_file_name() -> str:
    """A fresh watch-probe name: ``.dracpu-cdi-probe-<pid>-<16 hex>``."""
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


def dir_identity(cdi_dir: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of the CDI dir, ``None`` when it is missing or not a directory.

    A watch is tied to the inode: when the dir is removed and re-created, the watcher restarts.
    """
    try:
        st = os.stat(cdi_dir)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return st.st_dev, st.st_ino


def _fsync_dir(path: str | os.PathLike[str], fsync: Fsync) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fsync(fd)
    finally:
        os.close(fd)


# --- write and delete ------------------------------------------------------------------------


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_spec(
    cdi_dir: str | os.PathLike[str], claim_uid: str, cpus: CpuSet, shared_pool: bool = False
) -> Path:
    """Atomically write the spec of a claim (``shared_pool``: with ``DRA_SHARED_POOL_<uid>``);
    return its path.

    Temp file in the same dir (mode 0644, never a ``.json`` name) → write → rename over
    ``dra.k8s.io-cpu_claim-<uid>.json``; no fsync (see the module docstring). The dir is
    created if missing. On any failure the temp file is removed and an existing spec is left as
    it was; a spec that holds these bytes already is no failure when no file can be created
    (:func:`write_atomically`).
    """
    data = spec_bytes(claim_uid, cpus, shared_pool)  # checks uid and cpuset before the disk
    directory = os.fspath(cdi_dir)
    return Path(
        write_atomically(directory, spec_file_name(claim_uid), data, "CDI spec", ensure_dir)
    )


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
    left as it was, and :class:`CdiError` says ``cannot write <what> '<path>': <reason>``; when
    no temp file can be created but the file holds ``data`` already, there is nothing to do.

    On the Prepare path: plain string paths (pathlib's parsing was a large part of a spec
    write's Python time, ``cdi.write_spec`` in ``bench/bench_cdi.py``).
    """
    final = os.path.join(directory, name)
    temp = os.path.join(directory, "." + name + _TEMP_MARK + secrets.token_hex(8))
    try:
        fd = _create(temp, directory, make_dir)
    except OSError as exc:  # the temp file's random name would only make the message vary
        if _holds(final, data):
            # Nothing to write (a rollback of a delete that never happened, on a read-only or
            # full file system): no failure.
            return final
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


def _holds(path: str, data: bytes) -> bool:
    """Whether the regular file ``path`` holds exactly ``data``."""
    try:
        with open(path, "rb") as file:
            return os.fstat(file.fileno()).st_size == len(data) and file.read() == data
    except OSError:
        return False


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


def remove_our_file(cdi_dir: str | os.PathLike[str], name: str) -> bool:
    """Remove one of OUR files by base name (spec, temp or probe); refuse any other name."""
    if not (
        claim_uid_from_file_name(name) is not None
        or is_our_temp_file(name)
        or is_our_probe_file(name)
    ):
        raise CdiError(f"refusing to remove {name!r}: not a dracpu CDI file name")
    path = Path(cdi_dir) / name
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CdiError(f"cannot remove {str(path)!r}: {exc.strerror or exc}") from exc
    return True


def touch_probe(cdi_dir: str | os.PathLike[str], name: str) -> None:
    """Create or update a watch-probe file (one byte, mode 0644).

    Failing to is failing to create files in the dir at all (read-only, full, missing): the
    error says so, naming the dir (the probe's name is ours alone).
    """
    if not is_our_probe_file(name):
        raise CdiError(f"refusing to write {name!r}: not a dracpu probe name")
    path = Path(cdi_dir) / name
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, SPEC_MODE)
        try:
            os.write(fd, b"x")  # a write gives an event even where a bare create would not
        finally:
            os.close(fd)
    except OSError as exc:
        raise CdiError(
            f"cannot create files in CDI dir {os.fspath(cdi_dir)!r}: {exc.strerror or exc}"
        ) from exc


def check_not_full(cdi_dir: str | os.PathLike[str]) -> None:
    """Raise :class:`CdiError` when the CDI dir's file system is read-only, has no free block
    or no free inode (``statvfs``; root's reserved blocks counted as free): no spec can be
    written then. Touches no file, so the runtimes' CDI watches see nothing."""
    directory = os.fspath(cdi_dir)
    try:
        st = os.statvfs(directory)
    except OSError as exc:
        raise CdiError(f"cannot check CDI dir {directory!r}: {exc.strerror or exc}") from exc
    if st.f_flag & os.ST_RDONLY:
        raise CdiError(f"CDI dir {directory!r} is on a read-only file system")
    if st.f_blocks > 0 and st.f_bfree == 0:
        raise CdiError(f"CDI dir {directory!r} is on a full file system (no free block)")
    if st.f_files > 0 and st.f_ffree == 0:  # some file systems report no inode counts: 0
        raise CdiError(f"CDI dir {directory!r} is on a full file system (no free inode)")


def check_writable(cdi_dir: str | os.PathLike[str], probe: str) -> None:
    """Prove that specs can be written into the CDI dir now: create it if missing, write the
    probe file ``probe`` and remove it again. :class:`CdiError` says why not (read-only, full,
    not a directory, ...)."""
    ensure_dir(cdi_dir)
    try:
        touch_probe(cdi_dir, probe)
    except CdiError:
        with contextlib.suppress(CdiError):  # created but not written (a full file system)
            remove_our_file(cdi_dir, probe)
        raise
    remove_our_file(cdi_dir, probe)


# --- read ------------------------------------------------------------------------------------


def _read_regular(path: Path) -> bytes:
    """Read a regular file without following a symlink or blocking on a FIFO; bounded size."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CdiError(f"CDI spec {str(path)!r} is a symlink, not a regular file") from exc
        if isinstance(exc, FileNotFoundError):
            raise
        raise CdiError(f"cannot open CDI spec {str(path)!r}: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CdiError(f"CDI spec {str(path)!r} is not a regular file")
        if st.st_size > MAX_SPEC_BYTES:
            raise CdiError(f"CDI spec {str(path)!r} is too large ({st.st_size} bytes)")
        chunks: list[bytes] = []
        total = 0
        while True:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            total += len(chunk)
            if total > MAX_SPEC_BYTES:
                raise CdiError(f"CDI spec {str(path)!r} is too large (> {MAX_SPEC_BYTES} bytes)")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise CdiError(f"cannot read CDI spec {str(path)!r}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def read_spec_bytes(cdi_dir: str | os.PathLike[str], claim_uid: str) -> bytes | None:
    """The raw content of a claim's spec file, ``None`` when it does not exist."""
    try:
        return _read_regular(spec_path(cdi_dir, claim_uid))
    except FileNotFoundError:
        return None


def read_spec(cdi_dir: str | os.PathLike[str], claim_uid: str) -> CpuSet | None:
    """The cpuset in a claim's spec file, ``None`` when it does not exist.

    Raises :class:`CdiError` when the file is unreadable, malformed, or names another claim.
    """
    path = spec_path(cdi_dir, claim_uid)
    data = read_spec_bytes(cdi_dir, claim_uid)
    if data is None:
        return None
    return _parse_file(path, claim_uid, data).cpus


def _parse_file(path: Path, claim_uid: str, data: bytes) -> ClaimSpec:
    try:
        uid, spec = parse_claim_spec(data)
    except CdiError as exc:
        raise CdiError(f"CDI spec {str(path)!r}: {exc}") from exc
    if uid != claim_uid:
        raise CdiError(f"CDI spec {str(path)!r} is for claim {uid}, not {claim_uid}")
    return spec


@dataclass(frozen=True, slots=True)
class CdiDirScan:
    """What :func:`scan_dir` found: our spec files (content or read error), temp and probe files.

    ``specs`` maps claim UID → bytes, or the :class:`CdiError` when the file could not be read.
    ``ages`` maps the claim UID of each spec in ``specs`` to the age of the file (seconds since
    its last modification; 0 when unknown). ``leftovers`` maps the name of each of our temp /
    probe files to its age.
    """

    specs: dict[str, bytes | CdiError] = field(default_factory=dict)
    ages: dict[str, float] = field(default_factory=dict)
    leftovers: dict[str, float] = field(default_factory=dict)


def _age(path: Path, now: float) -> float | None:
    """Seconds since ``path`` (not followed) was modified; ``None`` when it is gone."""
    try:
        return max(0.0, now - os.lstat(path).st_mtime)
    except FileNotFoundError:
        return None
    except OSError:
        return 0.0


def scan_dir(cdi_dir: str | os.PathLike[str], *, only: Collection[str] | None = None) -> CdiDirScan:
    """Read our spec files (all, or only those of the claim UIDs in ``only``).

    A missing dir is empty. Other vendors' files are not opened. With ``only``, the directory is
    not listed and no leftovers are reported.
    """
    directory = Path(cdi_dir)
    scan = CdiDirScan()
    now = time.time()
    if only is None:
        try:
            names = os.listdir(directory)
        except FileNotFoundError:
            return scan
        except OSError as exc:
            raise CdiError(
                f"cannot list CDI dir {str(directory)!r}: {exc.strerror or exc}"
            ) from exc
    else:
        names = [spec_file_name(uid) for uid in only if is_valid_claim_uid(uid)]
    for name in names:
        path = directory / name
        owner = claim_uid_from_file_name(name)
        if owner is not None:
            age = _age(path, now)
            if age is None:
                continue  # absent, or removed since listing
            try:
                scan.specs[owner] = _read_regular(path)
            except FileNotFoundError:
                continue
            except CdiError as exc:
                scan.specs[owner] = exc
            scan.ages[owner] = age
        elif is_our_temp_file(name) or is_our_probe_file(name):
            age = _age(path, now)
            if age is not None:
                scan.leftovers[name] = age
    return scan


def list_our_specs(cdi_dir: str | os.PathLike[str]) -> dict[str, ClaimSpec | CdiError]:
    """Every spec file of ours in the dir: claim UID → what it says, or the error
    reading/parsing it."""
    directory = Path(cdi_dir)
    result: dict[str, ClaimSpec | CdiError] = {}
    for uid, content in scan_dir(directory).specs.items():
        if isinstance(content, CdiError):
            result[uid] = content
            continue
        try:
            result[uid] = _parse_file(directory / spec_file_name(uid), uid, content)
        except CdiError as exc:
            result[uid] = exc
    return result
