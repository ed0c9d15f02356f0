"""The node's state machine for ``dracpu run``: restore at start, and the effect executor.

:class:`NodeMachine` is what the state owner runs on a real node (design §3). The pure part is
:mod:`dracpu.core.state`; this module is its shell:

- :meth:`NodeMachine.restore` builds the start state, before the state owner serves anyone:

  1. read the topology under ``<host-root>/sys`` (in a worker thread) and build the
     :class:`~dracpu.core.state.NodeConfig` (reserved CPUs, device mode, grouping, memory
     pinning);
  2. load the checkpoint (missing: no claims; corrupt: moved aside, logged, no claims; unreadable:
     :class:`~dracpu.errors.CheckpointError`, the start fails rather than forget claims) and keep
     the claims that still fit the node (the others are logged and dropped from the checkpoint);
  3. adopt the claims whose CDI spec of ours exists but which the checkpoint lacks
     (:class:`~dracpu.core.commands.AdoptClaims`: an upgrade from the upstream driver, a lost
     checkpoint);
  4. :class:`~dracpu.core.commands.Resync`: rewrite the CDI spec of every prepared claim (a
     reboot empties ``/var/run/cdi``), delete the specs of ours that no prepared claim owns,
     and hand the devices to the slice publisher.

  NRI ``Synchronize`` then re-pins every running container once the NRI task connects.

- :meth:`NodeMachine.execute` runs every effect of :mod:`dracpu.core.effects`:
  ``WriteCdiSpec`` / ``DeleteCdiSpec`` / ``PruneCdiSpecs`` through :mod:`dracpu.adapters.cdi_files`
  and ``WriteCheckpoint`` through :mod:`dracpu.adapters.checkpoint_file` (in the file thread,
  a :class:`~dracpu.tasks.serial_thread.SerialThread`: they fsync), ``UpdateContainers`` to the
  NRI task (:meth:`NriLink.submit <dracpu.tasks.nri_plugin.NriLink.submit>`, which never
  blocks), ``PublishSlices`` to the slice publisher (the devices of the topology, then a
  republish request) and to :attr:`NodeMachine.health`, the devices' health the kubelet
  watches (:mod:`dracpu.tasks.device_health`).
  :meth:`NodeMachine.execute_batch` runs a command's whole commit phase the same way, in order,
  but each run of consecutive file effects in ONE hop to the file thread (a Prepare's CDI spec
  and checkpoint: one hop instead of two), and tells the owner which effects began.

- :meth:`NodeMachine.desired_specs` is the CDI watcher's view of which specs must exist: the
  committed claims, corrected by the CDI writes and deletes of the command being applied. The
  owner writes a claim's spec (and deletes one) *before* it commits the new state; without the
  correction the watcher would see a fresh spec as an orphan, or put back a spec an Unprepare
  just removed.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import anyio
import anyio.to_thread
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from dracpu.adapters import cdi_files, checkpoint_file
from dracpu.adapters.sysfs import read_topology
from dracpu.config import Config
from dracpu.core import state as node_state
from dracpu.core.commands import (
    AdoptClaims,
    AdoptedClaim,
    Command,
    InvalidateContainers,
    Resync,
)
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import (
    ClaimsAdopted,
    DeleteCdiSpec,
    Effect,
    PruneCdiSpecs,
    PublishSlices,
    Reply,
    Resynced,
    UpdateContainers,
    WriteCdiSpec,
    WriteCheckpoint,
)
from dracpu.core.slices import Device, published_devices
from dracpu.core.state import NodeConfig, NodeState
from dracpu.core.topology import Topology
from dracpu.errors import CdiError, DracpuError
from dracpu.tasks.device_health import DeviceHealthBoard
from dracpu.tasks.serial_thread import SerialThread
from dracpu.tasks.slice_publisher import request_republish
from dracpu.tasks.state_owner import Request, StateOwner

__all__ = ["FILE_THREAD_NAME", "ContainerUpdates", "NodeMachine"]

logger = logging.getLogger(__name__)

ContainerUpdates = Callable[[UpdateContainers], None]
"""Takes the owner's unsolicited container updates without blocking and without failing
(:meth:`dracpu.tasks.nri_plugin.NriLink.submit`)."""

# The effects that do file I/O (and fsync): run in the file thread, never on the event loop.
_FILE_EFFECTS = (WriteCdiSpec, DeleteCdiSpec, PruneCdiSpecs, WriteCheckpoint)
# The name of that thread (thread listings, py-spy dumps).
FILE_THREAD_NAME = "dracpu-files"
# A claim's CDI change before a batch marked it: none (the key was absent).
_UNMARKED = object()


class NodeMachine:
    """The node's state machine: restore, ``apply``, ``execute``, ``rollback``, ``follow_up``.

    ``republish``: the sending end of the slice publisher's republish channel
    (:func:`dracpu.tasks.slice_publisher.republish_channel`); ``update_containers``: where
    ``UpdateContainers`` effects go (``None``: they are dropped with a debug log, the next NRI
    ``Synchronize`` re-pins every container anyway). Call :meth:`restore` once, then run
    :meth:`state_owner` (which hands :meth:`apply`, :meth:`execute`, :meth:`execute_batch`,
    :meth:`rollback` and :meth:`follow_up` to the owner and reads its committed state).
    """

    def __init__(
        self,
        config: Config,
        *,
        republish: MemoryObjectSendStream[str] | None = None,
        update_containers: ContainerUpdates | None = None,
    ) -> None:
        self.config = config
        self._republish = republish
        self._update_containers = update_containers
        self._devices: tuple[Device, ...] = ()
        # The published devices' health (the DRA socket's health streams read it).
        self.health = DeviceHealthBoard()
        self._checkpoint = checkpoint_file.CheckpointStore(config.checkpoint_path)
        # The file effects' own thread: one at a time, in order (a CDI spec, then the checkpoint).
        # It lives as long as this machine (the daemon's life): the kubelet's calls come minutes
        # apart, and a new thread per call would cost ~0.13 ms each.
        self._files = SerialThread(FILE_THREAD_NAME, idle_seconds=None)
        weakref.finalize(self, self._files.close)
        # CDI writes (cpus) and deletes (None) of the command being applied, by claim UID.
        self._cdi_changes: dict[str, CpuSet | None] = {}
        self._committed: Callable[[], NodeState] | None = None
        self._restored: NodeState | None = None

    # --- what other tasks read -----------------------------------------------------------------

    def devices(self) -> Sequence[Device]:
        """The devices to publish (the slice publisher's ``desired`` source)."""
        return self._devices

    def watch_state(self, committed: Callable[[], NodeState]) -> None:
        """Read the committed state through ``committed`` (``lambda: owner.state``)."""
        self._committed = committed

    def state_owner(
        self, receive: MemoryObjectReceiveStream[Request[Command]], state: NodeState
    ) -> StateOwner[NodeState, Command, Effect]:
        """The state owner that runs this machine from ``state`` (what ``dracpu run`` runs):
        its apply, effects (file effects batched), rollback and follow-up; watched by
        :meth:`desired_specs`."""
        owner: StateOwner[NodeState, Command, Effect] = StateOwner(
            receive,
            state,
            self.apply,
            self.execute,
            rollback=self.rollback,
            follow_up=self.follow_up,
            execute_batch=self.execute_batch,
        )
        self.watch_state(lambda: owner.state)
        return owner

    def desired_specs(self) -> dict[str, CpuSet]:
        """The CDI specs that must exist now: ``{claim UID: cpus}`` (the CDI watcher's view).

        The committed claims, plus the specs the command in flight has written, minus the ones
        it has deleted (see the module docstring).
        """
        state = self._committed() if self._committed is not None else self._restored
        desired = {} if state is None else {uid: c.cpus for uid, c in state.claims.items()}
        for uid, cpus in self._cdi_changes.items():
            if cpus is None:
                desired.pop(uid, None)
            else:
                desired[uid] = cpus
        return desired

    # --- the state machine ---------------------------------------------------------------------

    def apply(self, state: NodeState, command: Command) -> tuple[NodeState, list[Effect]]:
        """:func:`dracpu.core.state.apply`; a new command starts a new set of CDI changes."""
        self._cdi_changes.clear()
        return node_state.apply(state, command)

    @staticmethod
    def rollback(old: NodeState, started: Sequence[Effect], error: DracpuError) -> list[Effect]:
        """:func:`dracpu.core.state.rollback`."""
        return node_state.rollback(old, started, error)

    @staticmethod
    def follow_up(effect: Effect, error: DracpuError) -> Command | None:
        """A failed ``UpdateContainers`` leaves those containers' cpusets unknown."""
        if isinstance(effect, UpdateContainers):
            return InvalidateContainers(tuple(u.container_id for u in effect.updates))
        return None

    async def execute(self, effect: Effect) -> None:
        """Run one effect; failures raise :class:`~dracpu.errors.DracpuError`."""
        match effect:
            case WriteCdiSpec() | DeleteCdiSpec() | PruneCdiSpecs() | WriteCheckpoint():
                self._mark(effect)
                await self._files.call(self._run_file_effect, effect)
            case UpdateContainers():
                if self._update_containers is None:
                    logger.debug(
                        "no NRI task: dropping updates of %d containers", len(effect.updates)
                    )
                else:
                    self._update_containers(effect)
            case PublishSlices(topology=topology):
                self._publish(topology)
            case Reply():
                raise DracpuError("a Reply is not an effect to execute")  # the owner answers it

    async def execute_batch(self, effects: Sequence[Effect], started: list[Effect]) -> None:
        """Run ``effects`` in order, as :meth:`execute` would one after the other, but each run
        of consecutive file effects in one hop to the file thread.

        Each effect is appended to ``started`` just before it begins, so after a failure (a
        :class:`~dracpu.errors.DracpuError`, or a cancellation) the last effect in ``started`` is
        the one that failed or was cut off, and the effects after it never began: they have left
        no trace, not even in :meth:`desired_specs`.
        """
        index = 0
        while index < len(effects):
            effect = effects[index]
            if not isinstance(effect, _FILE_EFFECTS):
                started.append(effect)
                await self.execute(effect)
                index += 1
                continue
            end = index + 1
            while end < len(effects) and isinstance(effects[end], _FILE_EFFECTS):
                end += 1
            await self._run_file_batch(effects[index:end], started)
            index = end

    async def _run_file_batch(self, batch: Sequence[Effect], started: list[Effect]) -> None:
        marks = [self._mark(effect) for effect in batch]
        before = len(started)
        try:
            await self._files.call(self._run_file_effects, batch, started)
        except BaseException:
            # The CDI changes of the effects that never began did not happen: take them back,
            # newest first (two effects of one batch may change the same claim's spec).
            for mark in reversed(marks[len(started) - before :]):
                if mark is not None:
                    uid, previous = mark
                    if previous is _UNMARKED:
                        self._cdi_changes.pop(uid, None)
                    else:
                        assert previous is None or isinstance(previous, CpuSet)
                        self._cdi_changes[uid] = previous
            raise

    def _mark(self, effect: Effect) -> tuple[str, object] | None:
        """Record a CDI write/delete in :attr:`_cdi_changes` (before it begins, so the watcher
        never takes a fresh spec for an orphan); the claim's previous mark."""
        match effect:
            case WriteCdiSpec(claim_uid=uid, cpus=cpus):
                previous = self._cdi_changes.get(uid, _UNMARKED)
                self._cdi_changes[uid] = cpus
            case DeleteCdiSpec(claim_uid=uid):
                previous = self._cdi_changes.get(uid, _UNMARKED)
                self._cdi_changes[uid] = None
            case _:
                return None
        return uid, previous

    def _run_file_effects(self, batch: Sequence[Effect], started: list[Effect]) -> None:
        """In the file thread: the file effects of ``batch`` in order (see execute_batch)."""
        for effect in batch:
            started.append(effect)
            self._run_file_effect(effect)

    def _run_file_effect(self, effect: Effect) -> None:
        """In the file thread: one file effect."""
        cdi_dir = self.config.cdi_dir
        match effect:
            case WriteCdiSpec(claim_uid=uid, cpus=cpus):
                cdi_files.write_spec(cdi_dir, uid, cpus)
            case DeleteCdiSpec(claim_uid=uid):
                cdi_files.delete_spec(cdi_dir, uid)
            case PruneCdiSpecs(keep=keep):
                removed = _prune(cdi_dir, keep)
                if removed:
                    logger.info("removed CDI specs no prepared claim owns: %s", removed)
            case WriteCheckpoint(checkpoint=data):
                self._checkpoint.write(data)
            case _:
                raise DracpuError(f"{type(effect).__name__} is not a file effect")

    def _set_devices(self, devices: Sequence[Device]) -> None:
        """The devices to publish now; their health follows."""
        self._devices = tuple(devices)
        self.health.set_devices(self._devices)

    def _publish(self, topology: Topology) -> None:
        config = self.config
        self._set_devices(
            published_devices(
                topology,
                reserved=config.reserved_cpus,
                mode=config.cpu_device_mode,
                group_by=config.group_by,
            )
        )
        if self._republish is not None:
            request_republish(self._republish, "resync")

    # --- restore ---------------------------------------------------------------------------------

    async def restore(self) -> NodeState:
        """The start state (see the module docstring); raises DracpuError when the node cannot
        be read (topology, an unreadable checkpoint)."""
        config = self.config
        read = partial(read_topology, config.host_root, pcie_roots=config.expose_pcie_roots)
        topology = await anyio.to_thread.run_sync(read)
        outside = config.reserved_cpus - topology.online
        if outside:
            logger.warning("reserved cpus %s are not online on this node; ignored", outside)
        node = NodeConfig.build(
            config.node_name,
            topology,
            reserved=config.reserved_cpus,
            mode=config.cpu_device_mode,
            group_by=config.group_by,
            pin_memory=config.memory_pinning,
        )
        logger.info(
            "topology: %d online cpus (%s), %d allocatable, %d devices",
            len(topology.online),
            topology.online,
            len(node.allocatable),
            len(node.devices),
        )
        # The devices are known now, whatever happens to the Resync below (which publishes
        # them again): a publisher must never see an empty device list for a working node.
        self._set_devices(tuple(node.devices.values()))
        data = await anyio.to_thread.run_sync(self._checkpoint.restore)
        state, refused = node_state.restore_state(node, data)
        for uid, reason in refused:
            claim = data.claims[uid]
            logger.error(
                "checkpointed claim %s (cpus %s, %s/%s) no longer fits this node and is dropped: "
                "%s",
                uid,
                claim.cpus,
                claim.namespace or "?",
                claim.name or "?",
                reason,
                extra={"claim_uid": uid},
            )
        logger.info(
            "restored %d prepared claims from %s", len(state.claims), config.checkpoint_path
        )
        self._restored = state
        state, adopted = await self._adopt(state)
        if refused and not adopted:  # the checkpoint must hold exactly the claims we keep
            state = await self._run(state, None, WriteCheckpoint(state.checkpoint()))
        state = await self._run(state, Resync())
        self._restored = state
        return state

    async def _adopt(self, state: NodeState) -> tuple[NodeState, bool]:
        """Adopt our CDI specs that the checkpoint lacks; whether the checkpoint was written."""
        try:
            specs = await anyio.to_thread.run_sync(cdi_files.list_our_specs, self.config.cdi_dir)
        except CdiError as exc:
            logger.error("cannot look for CDI specs to adopt: %s", exc)
            return state, False
        candidates: list[AdoptedClaim] = []
        for uid, cpus in sorted(specs.items()):
            if uid in state.claims:
                continue
            if isinstance(cpus, CdiError):
                logger.warning("CDI spec of claim %s cannot be adopted: %s", uid, cpus)
                continue
            candidates.append(AdoptedClaim(uid, cpus))
        if not candidates:
            return state, False
        before = state
        # The specs are the only record of these claims: if adopting them fails, starting
        # anyway would prune them (the Resync below) and a rollback would delete them. Fail the
        # start instead; the DaemonSet restarts us and the next try finds the specs untouched.
        state = await self._run(state, AdoptClaims(tuple(candidates)), must_succeed=True)
        return state, state is not before

    async def _run(
        self,
        state: NodeState,
        command: Command | None,
        *effects: Effect,
        must_succeed: bool = False,
    ) -> NodeState:
        """Apply ``command`` (or run ``effects``) like the state owner does, before it runs:
        the commit phase in order, a rollback when one fails (the old state is kept).

        ``must_succeed``: a failed commit phase is not rolled back but raised (the start fails).
        """
        if command is None:
            new, planned = state, [*effects, Reply(None)]
        else:
            new, planned = self.apply(state, command)
        commit, reply, after = node_state.commit_phase(planned)
        started: list[Effect] = []
        try:
            await self.execute_batch(commit, started)
        except DracpuError as error:
            what = type(command).__name__ if command is not None else type(started[-1]).__name__
            if must_succeed:
                raise DracpuError(f"start-up {what} failed, not starting: {error}") from error
            logger.error("start-up %s failed: %s", what, error)
            for undo in node_state.rollback(state, started, error):
                if isinstance(undo, Reply):
                    continue
                try:
                    await self.execute(undo)
                except DracpuError as undo_error:
                    logger.error("start-up rollback %s failed: %s", type(undo).__name__, undo_error)
            return state
        self._report(reply.value)
        for effect in after:
            try:
                await self.execute(effect)
            except DracpuError as error:
                logger.error("start-up %s failed: %s", type(effect).__name__, error)
        return new

    @staticmethod
    def _report(value: object) -> None:
        match value:
            case ClaimsAdopted(adopted=adopted, rejected=rejected):
                if adopted:
                    logger.warning(
                        "adopted %d claims from CDI specs the checkpoint lacked: %s",
                        len(adopted),
                        list(adopted),
                    )
                for uid, reason in rejected:
                    logger.error(
                        "cannot adopt the CDI spec of claim %s: %s (the spec is removed)",
                        uid,
                        reason,
                        extra={"claim_uid": uid},
                    )
            case Resynced(claims=claims):
                logger.info("CDI specs of %d prepared claims are in place", claims)
            case DracpuError():
                logger.error("start-up command refused: %s", value)
            case _:
                pass


def _prune(cdi_dir: Path, keep: frozenset[str]) -> list[str]:
    """Delete our specs whose claim is not in ``keep``; the removed claim UIDs (sync).

    Raises :class:`CdiError` naming every spec that could not be removed (after trying all).
    """
    scan = cdi_files.scan_dir(cdi_dir)
    removed: list[str] = []
    errors: list[str] = []
    for uid in sorted(scan.specs.keys() - keep):
        try:
            if cdi_files.delete_spec(cdi_dir, uid):
                removed.append(uid)
        except CdiError as exc:
            errors.append(str(exc))
    if errors:
        raise CdiError("; ".join(errors))
    return removed
