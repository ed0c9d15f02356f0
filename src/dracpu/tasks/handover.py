"""The hand-over of the state dir from a running dracpu to its successor (a rolling update).

Two locks in the state dir (:class:`~dracpu.adapters.state_lock.FileLock`):

- ``dracpu.lock``, the owner's: held by the one instance that restores the state, writes the
  checkpoint, CDI specs and device metadata, serves the kubelet's sockets and pins containers;
- ``dracpu.successor.lock``: held by the one instance waiting to take over, from the moment it
  waits until its NRI ``Synchronize`` has been answered.

With ``maxSurge: 1`` the DaemonSet starts the new pod beside the old one and deletes the old one
only once the new one is Ready. So (``docs/architecture.md``, "Rolling update"):

1. the new instance finds the owner lock held, takes the successor lock, reports Ready as a
   standby (it touches nothing of the state) and polls the owner lock;
2. the old instance, stopping, finds the successor lock held: once its request sources are
   stopped (DRA and registration sockets, PodResources, CDI watcher), its state owner writes
   no file any more and it releases the owner lock (naming its pod in ``dracpu.leaving-pod``),
   while its NRI connection stays up and keeps pinning the containers the runtime creates;
3. the new instance takes the owner lock, restores the state the old one left, serves the
   kubelet's sockets, connects to NRI and, once the runtime has configured it, releases the
   successor lock;
4. the old instance, polling the successor lock, takes it and disconnects from NRI; the
   runtime then synchronizes the new one.

The new instance cannot synchronize while the old one runs: containerd blocks a plugin's
``Synchronize`` while any container is being stopped (``BlockPluginSync`` in its CRI stop path),
and the old instance's own container is being stopped (the kubelet waits for its exit). But
from the moment the new plugin waits to synchronize, containerd starts no container until it
has (a pending writer of that lock holds off its readers), and the ``Synchronize`` reply's
updates reach the spec of a container created meanwhile before it starts. So a container is
pinned by the old instance, or by the new one before it runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import anyio

from dracpu.adapters.state_lock import FileLock, StateLockError

__all__ = ["LEAVING_POD", "OWNER_LOCK", "POLL", "SETTLE", "SUCCESSOR_LOCK", "HandOver"]

logger = logging.getLogger(__name__)

OWNER_LOCK = "dracpu.lock"
SUCCESSOR_LOCK = "dracpu.successor.lock"
# Written by the instance that hands over, read and removed by its successor: the leaving
# instance's pod UID (the DaemonSet's POD_UID, from the downward API), whose containers the
# successor's Synchronize leaves out (CRI-O lists them while they stop).
LEAVING_POD = "dracpu.leaving-pod"
# How often a waiting instance looks at a lock (flock cannot be waited on with a timeout
# without a thread per wait; a look is one syscall).
POLL = 0.005
# After the successor's Configure: time for the runtime to ask for its Synchronize before the
# old instance disconnects.
SETTLE = 0.05


class HandOver:
    """This process's side of the state dir's hand-over (module docstring)."""

    def __init__(self, state_dir: Path, *, poll: float = POLL) -> None:
        self._owner = FileLock(state_dir / OWNER_LOCK)
        self._successor = FileLock(state_dir / SUCCESSOR_LOCK)
        self._leaving = state_dir / LEAVING_POD
        self._poll = poll
        self.usable = True  # False when the lock files cannot be made (a read-only state dir)
        # The pod of the instance this one took over from, when it said (wait_own).
        self.predecessor_pod: str | None = None

    def try_own(self) -> bool:
        """Own the state dir now if no other instance does (``True``). A state dir where the
        lock cannot be made is owned without it (said once): the daemon waits such a dir out
        as before, and there is no hand-over."""
        try:
            return self._owner.try_acquire()
        except StateLockError as exc:
            logger.warning("%s: no hand-over to or from another dracpu is possible", exc)
            self.usable = False
            return True

    def holder(self) -> str:
        return self._owner.holder()

    async def become_successor(self) -> None:
        """Be the one instance waiting to take over (another one waiting goes first)."""
        await self._until(self._successor.try_acquire)

    async def wait_own(self) -> None:
        """As the successor, wait until the owner hands over or exits."""
        await self._until(self._owner.try_acquire)
        try:
            self.predecessor_pod = self._leaving.read_text().strip() or None
            self._leaving.unlink()
        except OSError:  # none written (no POD_UID there, an older build): nothing to leave out
            self.predecessor_pod = None
        logger.info(
            "took over the state dir in %s (from pod %s)",
            self._owner.path.parent,
            self.predecessor_pod or "unknown",
        )

    def configured(self) -> None:
        """The runtime configured this instance, and asks for its ``Synchronize`` next: the
        predecessor may disconnect (see the module docstring: containerd synchronizes a new
        plugin only once the old one's container has stopped)."""
        if self._successor.held:
            self._successor.release()
            logger.info("NRI configured us: the previous dracpu may disconnect")

    def successor_waiting(self) -> bool:
        """Does another instance wait to take over? (A look, without taking anything.)"""
        if not self.usable or not self._owner.held:
            return False
        try:
            free = self._successor.try_acquire()
        except StateLockError:
            return False
        if free:
            self._successor.release()
        return not free

    def release(self, pod_uid: str | None = None) -> None:
        """Give the state dir up (the state owner writes no file any more), saying which pod
        leaves (``pod_uid``) for the successor's ``Synchronize``."""
        if pod_uid:
            try:
                self._leaving.write_text(pod_uid)
            except OSError as exc:
                logger.warning("cannot tell the next dracpu which pod leaves: %s", exc)
        self._owner.release()

    async def wait_successor(self, timeout: float) -> bool:  # noqa: ASYNC109
        """After :meth:`release`: wait until the runtime has configured the successor (it
        releases the successor lock), at most ``timeout`` seconds; whether it did. Then
        :data:`SETTLE` more: the runtime asks for the successor's ``Synchronize`` right after
        its ``Configure``, and from then on it starts no container until that is answered."""
        with anyio.move_on_after(timeout):
            await self._until(self._successor.try_acquire)
            self._successor.release()
            await anyio.sleep(SETTLE)
            return True
        return False

    async def _until(self, acquired: Callable[[], bool]) -> None:
        """Poll ``acquired`` (the lock is another process's: nothing in this one to wait on)."""
        while True:
            if acquired():
                return
            await anyio.sleep(self._poll)

    def close(self) -> None:
        self._successor.release()
        self._owner.release()
