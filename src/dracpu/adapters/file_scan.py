"""Our node files as they are on disk, read only: the claims' CDI specs and their device
metadata (CDI specs and files). What the CDI watcher reads to notice drift, and what start-up
adoption and ``gatherinfo`` read; the writes are :mod:`dracpu.adapters.cdi_files` and
:mod:`dracpu.adapters.metadata_files`, run by the state owner alone.

Reads use ``O_NOFOLLOW | O_NONBLOCK`` and accept only regular files of bounded size, so a
symlink, FIFO or device planted under one of our names cannot redirect or hang us; other
vendors' files are never opened. Every ``OSError`` becomes a :class:`CdiError` naming the path.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from dracpu.core.cdi_spec import (
    ClaimSpec,
    claim_uid_from_file_name,
    is_valid_claim_uid,
    parse_claim_spec,
    spec_file_name,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.device_metadata import metadata_file_owner, metadata_spec_owner
from dracpu.errors import CdiError

__all__ = [
    "MAX_FILE_BYTES",
    "NodeFilesScan",
    "check_not_full",
    "dir_identity",
    "is_leftover",
    "list_our_specs",
    "read_ours",
    "read_spec",
    "scan",
]

# Largest file of ours we agree to read. A claim's CDI spec is a few hundred bytes (a worst-case
# cpuset of every other CPU up to id 16383 is ~50 KB), a metadata document of a 16384-CPU group
# well below this; anything bigger under our name is not ours.
MAX_FILE_BYTES = 4 << 20

_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
# The temp files our writes make: "." + final name + ".tmp-" + random hex (cdi_files), and the
# watch probes of earlier versions.
_TEMP_MARK = ".tmp-"
_PROBE_PREFIX = ".dracpu-cdi-probe-"


def read_ours(path: str | os.PathLike[str], what: str = "CDI spec") -> bytes | None:
    """A regular file of at most :data:`MAX_FILE_BYTES`, read without following a symlink or
    blocking on a FIFO; ``None`` when there is none. :class:`CdiError` names the path and what
    is wrong (a symlink, not a regular file, too large, unreadable)."""
    text = os.fspath(path)
    try:
        fd = os.open(text, _READ_FLAGS)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CdiError(f"{what} {text!r} is a symlink, not a regular file") from exc
        if exc.errno == errno.ENOTDIR:
            return None
        raise CdiError(f"cannot open {what} {text!r}: {exc.strerror or exc}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CdiError(f"{what} {text!r} is not a regular file")
        if st.st_size > MAX_FILE_BYTES:
            raise CdiError(f"{what} {text!r} is too large ({st.st_size} bytes)")
        chunks: list[bytes] = []
        total = 0
        while chunk := os.read(fd, 65536):
            total += len(chunk)
            if total > MAX_FILE_BYTES:
                raise CdiError(f"{what} {text!r} is too large (> {MAX_FILE_BYTES} bytes)")
            chunks.append(chunk)
        return b"".join(chunks)
    except OSError as exc:
        raise CdiError(f"cannot read {what} {text!r}: {exc.strerror or exc}") from exc
    finally:
        os.close(fd)


def read_spec(cdi_dir: str | os.PathLike[str], claim_uid: str) -> CpuSet | None:
    """The cpuset in a claim's spec file, ``None`` when it does not exist. Raises
    :class:`CdiError` when the file is unreadable, malformed, or names another claim."""
    path = os.path.join(os.fspath(cdi_dir), spec_file_name(claim_uid))
    data = read_ours(path)
    return None if data is None else _parse_spec(path, claim_uid, data).cpus


def _parse_spec(path: str, claim_uid: str, data: bytes) -> ClaimSpec:
    try:
        uid, spec = parse_claim_spec(data)
    except CdiError as exc:
        raise CdiError(f"CDI spec {path!r}: {exc}") from exc
    if uid != claim_uid:
        raise CdiError(f"CDI spec {path!r} is for claim {uid}, not {claim_uid}")
    return spec


def is_leftover(name: str) -> bool:
    """A temp file one of our writes left when it was cut short (a crash), or an old watch
    probe: a hidden name ending in ``.tmp-<hex>`` whose final name is ours."""
    if name.startswith(_PROBE_PREFIX):
        return True
    final, mark, tail = name.rpartition(_TEMP_MARK)
    if not mark or not final.startswith(".") or not tail.isalnum():
        return False
    final = final[1:]
    return (
        claim_uid_from_file_name(final) is not None
        or metadata_spec_owner(final) is not None
        or metadata_file_owner(final) is not None
    )


@dataclass(frozen=True, slots=True)
class NodeFilesScan:
    """What :func:`scan` found of ours: each claim's CDI spec (content, or why it cannot be
    read), the metadata CDI specs and metadata files by name (content, ``None`` when unreadable),
    and whether a leftover of a cut-short write lies in either dir."""

    specs: dict[str, bytes | CdiError]
    metadata_specs: dict[str, bytes | None]
    metadata_files: dict[str, bytes | None]
    leftovers: bool


def _list(directory: str, what: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CdiError(f"cannot list {what} {directory!r}: {exc.strerror or exc}") from exc


def _read_specs(cdi: str, uids: Iterable[str]) -> dict[str, bytes | CdiError]:
    specs: dict[str, bytes | CdiError] = {}
    for uid in uids:
        try:
            content = read_ours(os.path.join(cdi, spec_file_name(uid)))
        except CdiError as exc:
            specs[uid] = exc
            continue
        if content is not None:
            specs[uid] = content
    return specs


def _read_owned(
    directory: str,
    names: Iterable[str],
    owner: Callable[[str], str | None],
    wanted: set[str] | None,
) -> dict[str, bytes | None]:
    files: dict[str, bytes | None] = {}
    for name in names:
        uid = owner(name)
        if uid is not None and (wanted is None or uid in wanted):
            try:
                files[name] = read_ours(os.path.join(directory, name), "device metadata")
            except CdiError:
                files[name] = None
    return files


def scan(
    cdi_dir: str | os.PathLike[str],
    metadata_dir: str | os.PathLike[str] | None = None,
    *,
    only: Collection[str] | None = None,
) -> NodeFilesScan:
    """Read our files: every claim's (``only=None``), or only those of the claim UIDs in
    ``only``. A missing dir is empty; ``metadata_dir=None`` reads no metadata. Raises
    :class:`CdiError` when a dir cannot be listed."""
    cdi = os.fspath(cdi_dir)
    names = _list(cdi, "CDI dir")
    wanted = None if only is None else {uid for uid in only if is_valid_claim_uid(uid)}
    if wanted is None:
        uids: Iterable[str] = filter(None, map(claim_uid_from_file_name, names))
    else:
        uids = sorted(wanted)
    root = None if metadata_dir is None else os.fspath(metadata_dir)
    files = [] if root is None else _list(root, "device metadata dir")
    return NodeFilesScan(
        specs=_read_specs(cdi, uids),
        metadata_specs=_read_owned(cdi, names, metadata_spec_owner, wanted),
        metadata_files=(
            {} if root is None else _read_owned(root, files, metadata_file_owner, wanted)
        ),
        leftovers=only is None and any(map(is_leftover, [*names, *files])),
    )


def list_our_specs(cdi_dir: str | os.PathLike[str]) -> dict[str, ClaimSpec | CdiError]:
    """Every spec file of ours in the dir: claim UID → what it says, or the error reading or
    parsing it."""
    directory = os.fspath(cdi_dir)
    result: dict[str, ClaimSpec | CdiError] = {}
    for uid, content in scan(directory).specs.items():
        if isinstance(content, CdiError):
            result[uid] = content
            continue
        try:
            result[uid] = _parse_spec(os.path.join(directory, spec_file_name(uid)), uid, content)
        except CdiError as exc:
            result[uid] = exc
    return result


def dir_identity(directory: str | os.PathLike[str]) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of a dir, ``None`` when it is missing or not a directory (a watch
    is tied to the inode: when the dir is removed and made again, the watcher starts again)."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    if not stat.S_ISDIR(st.st_mode):
        return None
    return st.st_dev, st.st_ino


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
