"""Which claims' files on disk differ from what the state owner would write for them (pure): the
CDI watcher's verdict, after which it asks the owner to put those claims' files right
(:class:`~dracpu.core.commands.RepairNodeFiles`).

A prepared claim's CDI spec must hold exactly :func:`~dracpu.core.cdi_spec.spec_bytes` of its
CPUs; a file named like ours that holds anything else (edited, cut short, written by another
driver: upstream's are named like ours) differs. A prepared claim with results must have each of
its metadata files and metadata CDI specs holding exactly
:func:`~dracpu.core.device_metadata.claim_files`' bytes (a claim adopted from its CDI spec has
none to check: whatever metadata is there is kept). A claim that is not prepared must have no
file of ours at all. The verdict may be stale by the time the owner acts on it: the owner
decides again from its state then, so a claim being prepared or unprepared meanwhile only costs a
look that finds its files in place.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from dracpu.core.cdi_spec import spec_bytes
from dracpu.core.device_metadata import claim_files, metadata_file_owner, metadata_spec_owner
from dracpu.core.state_values import NodeState
from dracpu.errors import DracpuError

__all__ = ["drifted_claims"]


def drifted_claims(
    state: NodeState,
    metadata_dir: str,
    specs: Mapping[str, bytes | None],
    metadata_specs: Mapping[str, bytes | None],
    metadata_files: Mapping[str, bytes | None],
    *,
    only: Collection[str] | None = None,
) -> frozenset[str]:
    """The claim UIDs whose files differ (see the module docstring), among ``only`` (``None``:
    every prepared claim and every claim that has a file of ours).

    ``specs``: each claim's CDI spec found (``None``: it cannot be read);
    ``metadata_specs`` and ``metadata_files``: the metadata CDI specs and metadata files found,
    by file name (``None``: unreadable). They must have been read for the same ``only``.
    """
    owners = {uid for name in metadata_specs if (uid := metadata_spec_owner(name))}
    owners |= {uid for name in metadata_files if (uid := metadata_file_owner(name))}
    if only is None:
        uids: Collection[str] = state.claims.keys() | specs.keys() | owners
    else:
        uids = only
    drifted: set[str] = set()
    for uid in uids:
        claim = state.claims.get(uid)
        if claim is None:
            if uid in specs or uid in owners:
                drifted.add(uid)
            continue
        try:
            expected = spec_bytes(uid, claim.cpus, claim.shared_pool)
            files = claim_files(state.config, claim, metadata_dir)
        except DracpuError:
            continue  # no file can be written for it: Prepare refuses such a claim
        if specs.get(uid) != expected:
            drifted.add(uid)
            continue
        for item in files:
            name = item.host_path.rsplit("/", 1)[-1]
            if (
                metadata_files.get(name) != item.document
                or metadata_specs.get(item.spec_name) != item.spec
            ):
                drifted.add(uid)
                break
    return frozenset(drifted)
