"""The KEP-5304 device metadata of prepared claims on disk: write, delete, prune (synchronous;
the state owner runs them in its file thread, never on the event loop).

Per request of a claim (names and formats: :mod:`dracpu.core.device_metadata`):

- ``<metadata-dir>/<claimUID>_<request>.json``, mode 0644 in a dir of mode 0755 (the helper's
  modes: the runtime bind-mounts the file into containers of any user). One flat dir: a file
  per request and no dir per claim, since creating and removing directories on the kubelet's
  disk costs more than the rest of the metadata (``docs/performance.md``);
- ``<cdi-dir>/dra.cpu_metadata_<claimUID>_<request>.json``, the CDI spec that mounts it.

Writes are atomic as CDI spec writes are (:func:`dracpu.adapters.cdi_files.write_atomically`:
temp file in the same dir, rename), the metadata file before the spec that names it, so a
runtime that sees the spec finds the file. Deletes go the other way: the specs first. Nothing
is fsynced: the checkpoint is the durable record of the prepared claims, and the start-up
Resync writes every prepared claim's metadata again and prunes what no claim owns (a spec that
outlived its claim is never adopted, unlike a claim's own CDI spec).

Only our names are ever removed: metadata specs ``dra.cpu_metadata_<uuid>_<request>.json``,
metadata files ``<uuid>_<request>.json``, their temp files, and the dirs the Go helper keys by
``<namespace>_<name>`` (left by upstream's driver before a swap) once the metadata in them names
no prepared claim. Reads use ``O_NOFOLLOW | O_NONBLOCK`` and a size
bound. Every ``OSError`` becomes a :class:`~dracpu.errors.CdiError` naming the path.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable

from dracpu.adapters.cdi_files import ensure_dir, temp_target, write_changed
from dracpu.adapters.file_scan import read_ours
from dracpu.core.cdi_spec import is_valid_claim_uid
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.device_metadata import (
    claim_files,
    metadata_file_name,
    metadata_file_owner,
    metadata_spec_file_name,
    metadata_spec_owner,
)
from dracpu.core.node_config import NodeConfig
from dracpu.errors import CdiError

__all__ = [
    "DIR_MODE",
    "delete_claim",
    "prune",
    "write_claim",
]

# The helper's metadataDirPerms (kubeletplugin/metadata.go): the runtime reads the files.
DIR_MODE = 0o755
# The Go helper's file in each request dir (kubeletplugin/metadata.go metadataFilePath).
_HELPER_FILE_NAME = "metadata.json"


def _make_dir(directory: str) -> None:
    try:
        os.makedirs(directory, DIR_MODE, exist_ok=True)
    except FileExistsError as exc:  # a file in the way
        raise CdiError(f"device metadata dir {directory!r} is not a directory") from exc
    except OSError as exc:
        raise CdiError(
            f"cannot create device metadata dir {directory!r}: {exc.strerror or exc}"
        ) from exc


def write_claim(
    metadata_dir: str | os.PathLike[str],
    cdi_dir: str | os.PathLike[str],
    config: NodeConfig,
    claim: PreparedClaim,
) -> list[str]:
    """Write a prepared claim's metadata files and their CDI specs; the spec file names.

    A file that already holds exactly these bytes is left alone: a Resync or a repeated Prepare
    then creates nothing on the kubelet's disk (a new file there is the dearest part of the
    metadata) and makes the runtimes rescan nothing (every rename in the CDI dir does).
    """
    cdi = os.fspath(cdi_dir)
    specs: list[str] = []
    for item in claim_files(config, claim, os.fspath(metadata_dir)):
        directory, name = os.path.split(item.host_path)
        write_changed(directory, name, item.document, "device metadata", _make_dir)
        write_changed(cdi, item.spec_name, item.spec, "device metadata CDI spec", ensure_dir)
        specs.append(item.spec_name)
    return specs


def _names(directory: str, what: str) -> list[str]:
    try:
        return os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    except OSError as exc:
        raise CdiError(f"cannot list {what} {directory!r}: {exc.strerror or exc}") from exc


def _unlink(path: str, what: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        if not os.path.lexists(path):  # a read-only file system refuses before it looks
            return False
        raise CdiError(f"cannot remove {what} {path!r}: {exc.strerror or exc}") from exc
    return True


def _remove_tree(path: str) -> bool:
    """Remove a dir with what is in it (a symlink or file in its place: just that)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CdiError(f"cannot remove device metadata {path!r}: {exc.strerror or exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        return _unlink(path, "device metadata")
    try:
        shutil.rmtree(path)  # fd-based on Linux: a symlink inside is removed, not followed
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise CdiError(f"cannot remove device metadata {path!r}: {exc.strerror or exc}") from exc
    return True


def _claim_names(
    directory: str, owner: Callable[[str], str | None], claim_uid: str, what: str
) -> list[str]:
    """The names in ``directory`` that ``owner`` gives to ``claim_uid``."""
    return sorted(name for name in _names(directory, what) if owner(name) == claim_uid)


def delete_claim(
    metadata_dir: str | os.PathLike[str],
    cdi_dir: str | os.PathLike[str],
    claim_uid: str,
    requests: Iterable[str] | None = None,
) -> bool:
    """Remove a claim's metadata CDI specs, then its metadata files; whether anything was
    there. ``requests``: the requests it has metadata for; ``None``: look for them (a listing of
    both dirs)."""
    if not is_valid_claim_uid(claim_uid):
        raise CdiError(f"invalid claim UID {claim_uid!r}: expected an RFC 4122 UUID")
    cdi, root = os.fspath(cdi_dir), os.fspath(metadata_dir)
    if requests is None:
        specs = _claim_names(cdi, metadata_spec_owner, claim_uid, "CDI dir")
        files = _claim_names(root, metadata_file_owner, claim_uid, "device metadata dir")
    else:
        wanted = sorted(requests)
        specs = [metadata_spec_file_name(claim_uid, r) for r in wanted]
        files = [metadata_file_name(claim_uid, r) for r in wanted]
    removed = False
    for name in specs:
        removed |= _unlink(os.path.join(cdi, name), "device metadata CDI spec")
    for name in files:
        removed |= _unlink(os.path.join(root, name), "device metadata")
    return removed


def prune(
    metadata_dir: str | os.PathLike[str], cdi_dir: str | os.PathLike[str], keep: frozenset[str]
) -> list[str]:
    """Remove the metadata of every claim not in ``keep`` and the leftovers of interrupted
    writes; the paths removed. Raises :class:`CdiError` naming every path that could not be
    removed (after trying all).

    Runs as part of a Resync, when no metadata write of the owner is in flight: every temp file
    of ours is a leftover.
    """
    cdi, root = os.fspath(cdi_dir), os.fspath(metadata_dir)
    removed: list[str] = []
    errors: list[str] = []

    def remove(path: str, tree: bool = False) -> None:
        try:
            gone = _remove_tree(path) if tree else _unlink(path, "device metadata")
        except CdiError as exc:
            errors.append(str(exc))
            return
        if gone:
            removed.append(path)

    for directory, owner in ((cdi, metadata_spec_owner), (root, metadata_file_owner)):
        for name in sorted(_names(directory, "device metadata dir")):
            uid = owner(name)
            if uid is not None:
                if uid not in keep:
                    remove(os.path.join(directory, name))
            elif (final := temp_target(name)) is not None and owner(final) is not None:
                remove(os.path.join(directory, name))
            elif directory == root and not name.startswith("."):
                owners = _helper_dir_owners(os.path.join(root, name))
                if owners and owners.isdisjoint(keep):
                    remove(os.path.join(root, name), tree=True)
    if errors:
        raise CdiError("; ".join(errors))
    return removed


def _helper_dir_owners(path: str) -> set[str]:
    """The claim UIDs the metadata files of a Go helper's ``<ns>_<name>`` dir name (each
    ``<request>/metadata.json`` is a stream of JSON objects, one per version, of the same
    claim); empty when none can be read, or ``path`` is no dir (left alone then: it is not
    known to be an orphan)."""
    owners: set[str] = set()
    for request in _names(path, "device metadata dir"):
        data = _read_small(os.path.join(path, request, _HELPER_FILE_NAME))
        if data is None:
            continue
        try:
            first, _ = json.JSONDecoder().raw_decode(data.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            continue
        uid = (first.get("metadata") or {}).get("uid") if isinstance(first, dict) else None
        if is_valid_claim_uid(uid):
            assert isinstance(uid, str)
            owners.add(uid)
    return owners


def _read_small(path: str) -> bytes | None:
    """A regular file of ours, not through a symlink; ``None`` when there is none or it
    cannot be read."""
    try:
        return read_ours(path, "device metadata")
    except CdiError:
        return None
