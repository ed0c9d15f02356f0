"""The node state's files: CDI specs, device metadata, the checkpoint and the confined host
cgroups' cpusets, the way the state owner, their one writer, uses them.

The state owner (:mod:`dracpu.tasks.state_owner`) runs the file effects of
:mod:`dracpu.core.effects` (``WriteCdiSpec``, ``DeleteCdiSpec``, ``PruneCdiSpecs``,
``WriteDeviceMetadata``, ``DeleteDeviceMetadata``, ``PruneDeviceMetadata``, ``WriteCheckpoint``,
``ConfineHostCgroups``) through :meth:`NodeFiles.run_batch`, and reads the files back at start
(:meth:`NodeFiles.restore_checkpoint`, :meth:`NodeFiles.our_specs`); it tests a state dir or CDI
dir that cannot be written with :meth:`NodeFiles.write_checkpoint` and
:meth:`NodeFiles.check_cdi_dir`. Every call blocks (a written checkpoint is ``fdatasync``-ed, a
deleted spec's directory ``fsync``-ed): the owner makes them in a worker thread, never on the
event loop. The formats and the crash-safety rules are :mod:`dracpu.adapters.cdi_files`,
:mod:`dracpu.adapters.metadata_files`, :mod:`dracpu.adapters.checkpoint_file` and
:mod:`dracpu.adapters.host_cgroups`; failures are their :class:`~dracpu.errors.CdiError` and
:class:`~dracpu.errors.CheckpointError` (a host cgroup that cannot be confined is no failure:
:meth:`NodeFiles.host_cgroups` reports it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from dracpu.adapters import cdi_files, checkpoint_file, file_scan, metadata_files
from dracpu.adapters.host_cgroups import CgroupState, HostCgroups
from dracpu.core.cdi_spec import ClaimSpec
from dracpu.core.checkpoint_schema import CheckpointData
from dracpu.core.effects import (
    ConfineHostCgroups,
    DeleteCdiSpec,
    DeleteDeviceMetadata,
    Effect,
    PruneCdiSpecs,
    PruneDeviceMetadata,
    WriteCdiSpec,
    WriteCheckpoint,
    WriteDeviceMetadata,
)
from dracpu.errors import CdiError, DracpuError

__all__ = ["FILE_EFFECTS", "NodeFiles"]

logger = logging.getLogger(__name__)

# The effects that do file I/O (and fsync): run in a worker thread, never on the event loop.
FILE_EFFECTS = (
    WriteCdiSpec,
    DeleteCdiSpec,
    PruneCdiSpecs,
    WriteDeviceMetadata,
    DeleteDeviceMetadata,
    PruneDeviceMetadata,
    WriteCheckpoint,
    ConfineHostCgroups,
)


class NodeFiles:
    """The CDI specs of our claims in ``cdi_dir``, their device metadata in ``metadata_dir``
    (and its CDI specs in ``cdi_dir``), the checkpoint at ``checkpoint_path`` and the host
    cgroups (``None``: a ``ConfineHostCgroups`` does nothing)."""

    def __init__(
        self,
        cdi_dir: Path,
        checkpoint_path: Path,
        metadata_dir: Path,
        host_cgroups: HostCgroups | None = None,
    ) -> None:
        self.cdi_dir = cdi_dir
        self.metadata_dir = metadata_dir
        self._checkpoint = checkpoint_file.CheckpointStore(checkpoint_path)
        self._host_cgroups = host_cgroups

    @property
    def checkpoint_path(self) -> Path:
        return self._checkpoint.path

    def run_batch(self, batch: Sequence[Effect], started: list[Effect]) -> None:
        """Run the file effects of ``batch`` in order, appending each to ``started`` just before
        it begins: after a failure the last one in ``started`` is the one that failed, and the
        ones after it never began."""
        for effect in batch:
            started.append(effect)
            self.run(effect)

    def run(self, effect: Effect) -> None:
        """One file effect; raises :class:`~dracpu.errors.DracpuError` when it fails."""
        match effect:
            case WriteCdiSpec(claim_uid=uid, cpus=cpus, shared_pool=shared_pool):
                cdi_files.write_spec(self.cdi_dir, uid, cpus, shared_pool)
            case DeleteCdiSpec(claim_uid=uid):
                cdi_files.delete_spec(self.cdi_dir, uid)
            case PruneCdiSpecs(keep=keep):
                removed = cdi_files.prune(self.cdi_dir, keep)
                if removed:
                    logger.info("removed CDI files no prepared claim owns: %s", removed)
            case WriteDeviceMetadata(claim=claim, config=config):
                metadata_files.write_claim(self.metadata_dir, self.cdi_dir, config, claim)
            case DeleteDeviceMetadata(claim_uid=uid, requests=requests):
                metadata_files.delete_claim(self.metadata_dir, self.cdi_dir, uid, requests)
            case PruneDeviceMetadata(keep=keep):
                gone = metadata_files.prune(self.metadata_dir, self.cdi_dir, keep)
                if gone:
                    logger.info("removed device metadata no prepared claim owns: %s", gone)
            case WriteCheckpoint(checkpoint=data):
                # The same content as the newest checkpoint is the rollback of a write that
                # failed and left nothing: no write, hence no error on a disk still full.
                self._checkpoint.write(data, skip_unchanged=True)
            case ConfineHostCgroups(cgroups=cgroups, cpus=cpus):
                if self._host_cgroups is not None:
                    self._host_cgroups.confine(cgroups, cpus)
            case _:
                raise DracpuError(f"{type(effect).__name__} is not a file effect")

    def host_cgroups(self) -> tuple[CgroupState, ...]:
        """The listed host cgroups after the last ``ConfineHostCgroups``: what each was confined
        to, or why not."""
        return () if self._host_cgroups is None else self._host_cgroups.status()

    def release_host_cgroups(self) -> None:
        """Give every confined host cgroup back what it held (the daemon stops)."""
        if self._host_cgroups is not None:
            self._host_cgroups.release()

    def write_checkpoint(self, data: CheckpointData) -> None:
        """Write ``data`` as the newest checkpoint even when it is so already (whether the
        state dir takes writes); :class:`~dracpu.errors.CheckpointError` when it cannot."""
        self._checkpoint.write(data)

    def restore_checkpoint(self) -> CheckpointData:
        """The newest valid checkpoint (missing: no claims; corrupt: moved aside, no claims);
        :class:`~dracpu.errors.CheckpointError` when a slot cannot be read at all."""
        return self._checkpoint.restore()

    def our_specs(self) -> dict[str, ClaimSpec | CdiError]:
        """Our CDI specs by claim UID: what each says, or why it cannot be read."""
        return file_scan.list_our_specs(self.cdi_dir)

    def check_cdi_dir(self, probe: bool) -> None:
        """:class:`~dracpu.errors.CdiError` when the CDI dir cannot take specs: ``probe``, a
        file created and removed in it (every runtime rescans the dir then); else a look at its
        file system that writes nothing (read-only, full)."""
        if probe:
            cdi_files.check_writable(self.cdi_dir)
        else:
            file_scan.check_not_full(self.cdi_dir)
