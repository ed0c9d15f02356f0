"""SIGHUP reads the settings and the topology again: the ``Resync`` command it sends, and the
log lines of its answer.

:meth:`Reloader.command` (run by :mod:`dracpu.tasks.signals` for each SIGHUP) reads:

1. **the settings**, through :class:`ConfigSource`: flags, environment and config file with the
   same rules and precedence as at start (:func:`dracpu.config.load_config`: defaults <
   environment < config file < explicit flags; the flags and the environment of a process do
   not change, so only the file can). Settings are of two kinds:

   - *applied now*, those the settings table marks (``Setting.sighup``): ``reservedCPUs``
     (the state machine checks it against the claims: :mod:`dracpu.core.reconfigure`),
     ``memoryPinning`` (the default of claims prepared from now on), ``confineHostCgroups`` (a
     cgroup no longer listed gets back what it held before dracpu confined it), ``verbosity``,
     ``logFormat`` and ``--vmodule`` (the logging is set up again);
   - *structural*, every other one, and the content of the sysfs overlay's file: the running
     value stays in force and one error line per setting names it, its running and its new
     value. A restart applies them.

   A file that no longer loads (bad YAML, a bad value) is one error line; the running settings
   stay and the topology is read all the same.
2. **the topology**, from sysfs under the host root the daemon reads (the overlay tree when
   there is one), in a worker thread. One that cannot be read is one error line; the old
   topology stays, and the rest of the Resync (CDI specs, prune, publish) still runs.

:func:`report` logs the owner's answer in one line (:meth:`dracpu.core.effects.Resynced.describe`:
CPUs online and offline, isolation, reserved CPUs, devices added, removed, resized, slices
republished, shared containers re-pinned, claims affected), at WARNING when a claim holds an
offline CPU or the reserved CPUs were not applied, plus one warning per such claim.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import anyio.to_thread

from dracpu.adapters.sysfs import read_topology
from dracpu.adapters.sysfs_overlay import load_overlay
from dracpu.config import Config, changed_settings
from dracpu.core.commands import Resync
from dracpu.core.effects import Resynced
from dracpu.core.topology import Topology
from dracpu.errors import ConfigError, TopologyError
from dracpu.logs import setup_logging

__all__ = ["ConfigSource", "Reloader", "report"]

logger = logging.getLogger(__name__)

_LOGGING = ("log_format", "verbosity", "vmodule")

ReadTopology = Callable[[Path, bool], Topology]
SetupLogging = Callable[[str, int, Sequence[tuple[str, int]]], object]


@dataclass(frozen=True, slots=True)
class ConfigSource:
    """Where the daemon's settings came from, to read them again.

    ``loaded``: the settings as :func:`~dracpu.config.load_config` returned them at start (the
    ``host_root`` of the flags, not of the overlay tree built from it); ``load``: loads them
    again the same way; ``overlay``: the sysfs overlay's files as built at start (``None``:
    no overlay).
    """

    loaded: Config
    load: Callable[[], Config]
    overlay: Mapping[str, bytes] | None = None


def _read(host_root: Path, pcie_roots: bool) -> Topology:
    return read_topology(host_root, pcie_roots=pcie_roots)


def _setup_logging(log_format: str, verbosity: int, vmodule: Sequence[tuple[str, int]]) -> object:
    return setup_logging("json" if log_format == "json" else "text", verbosity, vmodule=vmodule)


class Reloader:
    """Builds a SIGHUP's :class:`~dracpu.core.commands.Resync` (see the module docstring).

    ``running``: the daemon's settings (``host_root`` where sysfs is read: the overlay tree
    when there is one). ``source``: where to read the settings again (``None``: only the
    topology is read). ``read`` and ``setup``: the topology reader and the logging setup
    (tests pass their own).
    """

    def __init__(
        self,
        running: Config,
        source: ConfigSource | None = None,
        *,
        read: ReadTopology = _read,
        setup: SetupLogging = _setup_logging,
    ) -> None:
        self._running = running
        self._source = source
        self._read = read
        self._setup = setup
        self._logging = tuple(
            getattr(running if source is None else source.loaded, name) for name in _LOGGING
        )

    async def command(self) -> Resync:
        """Read the settings and the topology again (in worker threads); the Resync to send."""
        settings = await self._settings()
        try:
            read = partial(self._read, self._running.host_root, self._running.expose_pcie_roots)
            topology: Topology | None = await anyio.to_thread.run_sync(read)
        except TopologyError as exc:
            logger.error("SIGHUP: cannot read the topology again, the old one stays: %s", exc)
            topology = None
        if settings is None:
            return Resync(topology=topology)
        return Resync(
            topology=topology,
            reserved=settings.reserved_cpus,
            pin_memory=settings.memory_pinning,
            host_cgroups=settings.confine_host_cgroups,
        )

    async def _settings(self) -> Config | None:
        """The settings read again with the structural ones refused (logged), or ``None``."""
        source = self._source
        if source is None:
            return None
        try:
            settings = await anyio.to_thread.run_sync(source.load)
        except ConfigError as exc:
            logger.error(
                "SIGHUP: the settings cannot be read again, the running ones stay: %s", exc
            )
            return None
        for setting, before, after in changed_settings(source.loaded, settings):
            if not setting.sighup:
                logger.error(
                    "SIGHUP: %s changed from %s to %s, which needs a restart; %s stays in force",
                    setting.label,
                    before,
                    after,
                    before,
                    extra={"setting": setting.label},
                )
        overlay = settings.sysfs_overlay
        if overlay is not None and overlay == source.loaded.sysfs_overlay:
            await self._check_overlay(overlay, source.overlay)
        self._apply_logging(settings)
        return settings

    async def _check_overlay(self, path: Path, built: Mapping[str, bytes] | None) -> None:
        """The overlay tree is built at start: a file whose content changed is refused."""
        try:
            overlay = await anyio.to_thread.run_sync(load_overlay, path)
        except ConfigError as exc:
            logger.error("SIGHUP: %s; the overlay built at start stays", exc)
            return
        if built is not None and dict(overlay.files) != dict(built):
            logger.error(
                "SIGHUP: sysfsOverlay %s changed, which needs a restart; the overlay built at "
                "start stays in force",
                path,
                extra={"setting": "sysfsOverlay"},
            )

    def _apply_logging(self, settings: Config) -> None:
        wanted = tuple(getattr(settings, name) for name in _LOGGING)
        if wanted == self._logging:
            return
        log_format, verbosity, vmodule = wanted
        self._setup(log_format, verbosity, vmodule)
        before = dict(zip(_LOGGING, self._logging, strict=True))
        self._logging = wanted
        logger.info(
            "SIGHUP: logging set up again: log format %s, verbosity %s (was %s, %s)",
            log_format,
            verbosity,
            before["log_format"],
            before["verbosity"],
        )


def report(result: object) -> None:
    """Log the owner's answer to a SIGHUP's Resync (see the module docstring)."""
    if not isinstance(result, Resynced):
        logger.info("resync done: %s", result)
        return
    changed = result.changed
    worrying = changed is not None and bool(changed.stranded or changed.reserved_refused)
    logger.log(logging.WARNING if worrying else logging.INFO, "resync done: %s", result.describe())
    if changed is None:
        return
    for claim in changed.stranded:
        logger.warning("%s", claim.warning(), extra={"claim_uid": claim.claim_uid})
