"""The host cgroups' cpusets: confining the listed cgroups to the shared pool plus the reserved
CPUs, and putting back what they held (the effect :class:`~dracpu.core.effects.ConfineHostCgroups`
of the state owner; which paths and which CPUs are decided in the core,
:mod:`dracpu.core.host_cgroups`).

The hierarchy is looked at on every confinement (cgroup v1 where ``cpuset/cpuset.cpus`` is,
else v2); what each cgroup held before dracpu first wrote it is recorded, durable, in
``<state-dir>/host-cgroups.json`` (:data:`RECORD_FILE`) and given back when the cgroup is no
longer listed and at :meth:`HostCgroups.release`. Nothing here fails the command: a cgroup that
cannot be confined is reported in :meth:`HostCgroups.status` with the reason. Calls come from
the state owner's one worker thread at a time; :meth:`status` is read from the event loop (a
tuple replaced whole). The rules (v1 and v2, the record, why not the checkpoint) are
``docs/architecture.md``, "Host cgroups", and ``docs/host-cgroups.md``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from dracpu.core.cpuset import CpuSet
from dracpu.core.host_cgroups import pods_cgroup_name, v1_wanted, v1_write_order
from dracpu.errors import CpuSetParseError

__all__ = ["RECORD_FILE", "CgroupState", "HostCgroups", "cgroup_root"]

logger = logging.getLogger(__name__)

# The record of what the confined cgroups held, in the state dir.
RECORD_FILE = "host-cgroups.json"
_RECORD_VERSION = 1
V1 = "v1"
V2 = "v2"
# The files (cgroup v1 cpuset hierarchy and cgroup v2: Documentation/admin-guide/cgroup-v1/
# cpusets.rst, cgroup-v2.rst).
_CPUS = "cpuset.cpus"
_CONTROLLERS = "cgroup.controllers"
_SUBTREE_CONTROL = "cgroup.subtree_control"
_V1_MOUNT = "cpuset"  # <cgroup root>/cpuset: the v1 cpuset hierarchy (and hybrid nodes')


def cgroup_root(host_root: Path) -> Path:
    """Where the host's cgroup fs is: ``<host-root>/sys/fs/cgroup``."""
    return host_root / "sys" / "fs" / "cgroup"


@dataclass(frozen=True, slots=True)
class CgroupState:
    """A listed cgroup (or one given back that could not be) after the last confinement:
    ``cpus`` what it holds now from dracpu (``None``: not confined), ``problem`` why not
    (``""``: confined)."""

    path: str
    cpus: CpuSet | None
    problem: str = ""


class _Failed(Exception):
    """One cgroup cannot be confined or given back; the message says why."""


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="ascii")
    except OSError as exc:
        raise _Failed(f"cannot read {path}: {exc.strerror or exc}") from None


def _read_cpus(path: Path) -> CpuSet:
    text = _read(path)
    try:
        return CpuSet.parse(text)
    except CpuSetParseError as exc:
        raise _Failed(f"{path}: {exc}") from None


def _write(path: Path, text: str) -> None:
    """One ``write`` of ``text`` (cgroup files take a value in one call), never creating a
    file: a cgroup's files are the kernel's."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
        try:
            os.write(fd, f"{text}\n".encode("ascii"))
        finally:
            os.close(fd)
    except OSError as exc:
        raise _Failed(f"cannot write {text or '(empty)'} to {path}: {exc.strerror or exc}") from exc


def _subtree(top: Path, path: str) -> dict[str, Path]:
    """``path`` and every cgroup below it (directories, not following links), by path under
    the root; :class:`_Failed` when one of them is the pods' cgroup."""
    found = {path: top}
    stack = [(path, top)]
    while stack:
        name, directory = stack.pop()
        try:
            entries = list(os.scandir(directory))
        except OSError as exc:
            raise _Failed(f"cannot list {directory}: {exc.strerror or exc}") from None
        for entry in entries:
            if not entry.is_dir(follow_symlinks=False):
                continue
            below = f"{name}/{entry.name}"
            if pods_cgroup_name(entry.name):
                raise _Failed(
                    f"it holds {below}, the kubelet's cgroup of the pods: confining it would "
                    "confine every pod, exclusive ones included"
                )
            found[below] = Path(entry.path)
            stack.append((below, Path(entry.path)))
    return found


class HostCgroups:
    """The listed host cgroups under ``root`` (the host's cgroup fs) and the record of what
    they held at ``record_path`` (see the module docstring)."""

    def __init__(self, root: Path, record_path: Path) -> None:
        self.root = root
        self.record_path = record_path
        self._found: dict[str, CpuSet] | None = None  # the record, read at first use
        self._found_in = ""  # its hierarchy
        self._status: tuple[CgroupState, ...] = ()
        self._enabled: set[Path] = set()  # v2 subtree_control files we added cpuset to
        self._checked: set[str] = set()  # v2 listed cgroups whose subtree holds no pods
        # The listed cgroups confined by this process, and the cpuset each was given.
        self._confined: dict[str, CpuSet] = {}

    def status(self) -> tuple[CgroupState, ...]:
        """Each listed cgroup (then each given back in vain) after the last call."""
        return self._status

    # --- the hierarchy -----------------------------------------------------------------------

    def _hierarchy(self) -> tuple[str, Path]:
        v1 = self.root / _V1_MOUNT
        if (v1 / _CPUS).is_file():
            return V1, v1
        if (self.root / _CONTROLLERS).is_file():
            return V2, self.root
        raise _Failed(
            f"no cgroup fs at {self.root}: neither a v1 cpuset hierarchy ({v1}) nor cgroup v2 "
            f"({self.root / _CONTROLLERS}); mount the host's /sys/fs/cgroup there, writable"
        )

    # --- the record --------------------------------------------------------------------------

    def _recorded(self) -> dict[str, CpuSet]:
        """What the confined cgroups held (read from the record file at first use)."""
        if self._found is None:
            self._found, self._found_in = self._load()
        return self._found

    def _record(self, hierarchy: str) -> dict[str, CpuSet]:
        """:meth:`_recorded`, dropped when it is of another hierarchy than ``hierarchy``."""
        found = self._recorded()
        if found and self._found_in != hierarchy:
            logger.warning(
                "%s holds cpusets of cgroup %s, but the node's cpuset hierarchy is cgroup %s "
                "now (a reboot?): the record is dropped",
                self.record_path,
                self._found_in,
                hierarchy,
            )
            found.clear()
            self._save()
        self._found_in = hierarchy
        return found

    def _load(self) -> tuple[dict[str, CpuSet], str]:
        try:
            raw = self.record_path.read_bytes()
        except FileNotFoundError:
            return {}, ""
        except OSError as exc:
            raise _Failed(f"cannot read {self.record_path}: {exc.strerror or exc}") from None
        try:
            doc = json.loads(raw)
            if doc.get("version") != _RECORD_VERSION or doc.get("hierarchy") not in (V1, V2):
                raise ValueError(f"unknown version or hierarchy: {doc!r:.80}")
            found = {str(p): CpuSet.parse(str(c)) for p, c in doc["found"].items()}
            return found, str(doc["hierarchy"])
        except (ValueError, TypeError, KeyError, AttributeError, CpuSetParseError) as exc:
            aside = self.record_path.with_name(f"{self.record_path.name}.corrupt")
            with contextlib.suppress(OSError):
                os.replace(self.record_path, aside)
            logger.error(
                "%s cannot be read (%s): moved aside to %s; the cgroups it named keep what "
                "they hold now",
                self.record_path,
                exc,
                aside,
            )
            return {}, ""

    def _save(self) -> None:
        """Make the record durable (or remove it when empty); :class:`_Failed` when it cannot."""
        found = self._found or {}
        path = self.record_path
        try:
            if not found:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return
            doc = {
                "version": _RECORD_VERSION,
                "hierarchy": self._found_in,
                "found": {p: str(c) for p, c in sorted(found.items())},
            }
            temporary = path.with_name(f".{path.name}.tmp")
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, json.dumps(doc, indent=1).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temporary, path)
            directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
        except OSError as exc:
            raise _Failed(
                f"cannot record what it holds in {path}: {exc.strerror or exc}; nothing is "
                "written to a cgroup before that is recorded"
            ) from None

    def _remember(self, found: dict[str, CpuSet], now: Mapping[str, CpuSet]) -> None:
        """Record the cgroups of ``now`` not recorded yet (before any is written)."""
        new = {path: cpus for path, cpus in now.items() if path not in found}
        if not new:
            return
        found.update(new)
        try:
            self._save()
        except _Failed:
            for path in new:
                del found[path]
            raise

    # --- confine -----------------------------------------------------------------------------

    def confine(self, cgroups: Iterable[str], cpus: CpuSet) -> None:
        """Keep ``cgroups`` at ``cpus`` and give back every recorded cgroup no longer listed
        (below none of ``cgroups``); the outcome is :meth:`status`."""
        listed = tuple(cgroups)
        try:
            if not listed and not self._recorded():
                self._status = ()
                return
            hierarchy, top = self._hierarchy()
            found = self._record(hierarchy)
        except _Failed as failure:
            self._status = tuple(CgroupState(path, None, str(failure)) for path in listed)
            self._confined.clear()
            return
        self._checked &= set(listed)
        self._confined = {p: c for p, c in self._confined.items() if p in listed}
        stale = [p for p in found if not any(p == c or p.startswith(f"{c}/") for c in listed)]
        states = [self._confine_one(hierarchy, top, found, path, cpus) for path in listed]
        states.extend(self._give_back(hierarchy, top, found, stale))
        self._status = tuple(states)

    def _confine_one(
        self, hierarchy: str, top: Path, found: dict[str, CpuSet], path: str, cpus: CpuSet
    ) -> CgroupState:
        try:
            if not cpus:
                raise _Failed("no CPU is shared or reserved to confine it to")
            directory = top / path
            if not directory.is_dir():
                raise _Failed(f"no such cgroup: {directory}")
            if hierarchy == V1:
                confined = self._confine_v1(top, found, path, cpus)
            else:
                confined = self._confine_v2(top, found, path, cpus)
        except _Failed as failure:
            self._confined.pop(path, None)
            return CgroupState(path, None, str(failure))
        if path not in self._confined:
            logger.info(
                "host cgroup %s (cgroup %s) confined to cpus %s, the shared pool plus the "
                "reserved cpus; it held %s, which is put back when it is no longer listed",
                path,
                hierarchy,
                confined,
                found[path] or "its parent's cpus",
            )
        self._confined[path] = confined
        return CgroupState(path, confined)

    def _changed_behind(self, path: str, now: CpuSet) -> None:
        """Say so when a listed cgroup no longer holds what this process gave it."""
        given = self._confined.get(path)
        if given is not None and now != given:
            logger.warning(
                "host cgroup %s holds cpus %s, not the %s dracpu gave it: another writer "
                "changed it (systemd, for a slice with AllowedCPUs=?); written again",
                path,
                now or "(empty)",
                given,
            )

    def _confine_v1(self, top: Path, found: dict[str, CpuSet], path: str, cpus: CpuSet) -> CpuSet:
        cgroups = _subtree(top / path, path)
        now = {name: _read_cpus(directory / _CPUS) for name, directory in cgroups.items()}
        self._changed_behind(path, now[path])
        parent = _read_cpus((top / path).parent / _CPUS)
        target = cpus & parent
        if not target:
            raise _Failed(f"its parent's cpuset ({parent}) holds none of cpus {cpus}")
        self._remember(found, now)
        wanted = v1_wanted(path, target, {name: found[name] for name in now})
        self._write_v1(top, v1_write_order(now, wanted), listed=path)
        return target

    def _write_v1(self, top: Path, writes: Iterable[tuple[str, CpuSet]], *, listed: str) -> None:
        for name, value in writes:
            try:
                _write(top / name / _CPUS, str(value))
            except _Failed:
                if name != listed and not (top / name).is_dir():
                    continue  # removed meanwhile: nothing runs there any more
                raise

    def _confine_v2(self, top: Path, found: dict[str, CpuSet], path: str, cpus: CpuSet) -> CpuSet:
        if path not in self._checked:
            _subtree(top / path, path)
            self._checked.add(path)
        self._enable_cpuset(top, path)
        file = top / path / _CPUS
        if not file.is_file():
            raise _Failed(f"{file} is missing although its parent enables the cpuset controller")
        now = _read_cpus(file)
        self._changed_behind(path, now)
        self._remember(found, {path: now})
        if now != cpus:
            _write(file, str(cpus))
        return cpus

    def _enable_cpuset(self, top: Path, path: str) -> None:
        """``+cpuset`` in the ``cgroup.subtree_control`` of every ancestor of ``path`` that does
        not enable it (cgroup v2 shows ``cpuset.cpus`` only where the parent enables it)."""
        parts = path.split("/")
        for depth in range(len(parts)):
            ancestor = top.joinpath(*parts[:depth])
            control = ancestor / _SUBTREE_CONTROL
            if "cpuset" in _read(control).split():
                continue
            if "cpuset" not in _read(ancestor / _CONTROLLERS).split():
                raise _Failed(
                    f"the cpuset controller is not available in {ancestor} "
                    f"({ancestor / _CONTROLLERS} does not list it)"
                )
            _write(control, "+cpuset")
            if control not in self._enabled:
                self._enabled.add(control)
                logger.info(
                    "enabled the cpuset controller in %s, which confining host cgroup %s "
                    "needs; it stays enabled (an empty cpuset.cpus uses its parent's cpus)",
                    control,
                    path,
                )

    # --- give back ---------------------------------------------------------------------------

    def release(self) -> None:
        """Give back every recorded cgroup (the daemon stops); what cannot be given back stays
        in the record (the next start puts it back) and in :meth:`status`."""
        try:
            if not self._recorded():
                self._status = ()
                return
            hierarchy, top = self._hierarchy()
            found = self._record(hierarchy)
        except _Failed as failure:
            logger.error("cannot give the host cgroups back what they held: %s", failure)
            return
        self._checked.clear()
        self._confined.clear()
        self._status = tuple(self._give_back(hierarchy, top, found, list(found)))

    def _give_back(
        self, hierarchy: str, top: Path, found: dict[str, CpuSet], paths: list[str]
    ) -> list[CgroupState]:
        """Write the recorded cpusets of ``paths`` again and drop them from the record; the
        ones that could not be (kept in the record to try again)."""
        if not paths:
            return []
        wanted = {p: found[p] for p in paths if (top / p).is_dir()}
        failed: dict[str, str] = {}
        if hierarchy == V1:
            try:
                now = {p: _read_cpus(top / p / _CPUS) for p in wanted}
                self._write_v1(top, v1_write_order(now, wanted), listed="")
            except _Failed as failure:
                failed = {p: str(failure) for p in wanted}
        else:
            for path, cpus in wanted.items():
                try:
                    _write(top / path / _CPUS, str(cpus))
                except _Failed as failure:
                    failed[path] = str(failure)
        for path in paths:
            if path not in failed:
                given = found.pop(path)
                if path in wanted:
                    logger.info("host cgroup %s given back cpus %s", path, given or "(empty)")
        try:
            self._save()
        except _Failed as failure:
            logger.error("%s", failure)
        return [
            CgroupState(path, None, f"cannot give back cpus {found[path] or '(empty)'}: {reason}")
            for path, reason in sorted(failed.items())
        ]
