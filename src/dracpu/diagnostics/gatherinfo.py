"""``dracpu gatherinfo``: what a user attaches to a bug report, from the running driver.

Upstream's tool (kubernetes-sigs/dra-driver-cpu ``internal/gatherinfo``, run as ``kubectl exec
<pod> -- /dracpu gatherinfo --stdout``) finds the driver process by its name (``dracpu`` in
``/proc/<pid>/comm``), rebuilds the driver's configuration from its command line and config
file, reads the CPU topology, and writes one YAML document (``---`` first, so reports of several
nodes concatenate): ``toolVersion``, ``layoutVersion: v1``, ``cpuDetails`` (a topology summary
and one entry per CPU) and ``driverConfig`` (upstream's keys; zero values left out). We write the
same, and under ``dracpu`` what only we have: the process, every setting, the checkpoint's
claims, our CDI specs, what the confined host cgroups held before dracpu wrote them, and the
daemon's debug dump (the pins last sent, the containers the runtime reported, what each listed
host cgroup is confined to or why not, the recent log; :mod:`dracpu.tasks.debug_dump`), asked
for with SIGUSR1.

Files are read in the driver's mount namespace (``/proc/<pid>/root``), as upstream does, so the
tool also works from the host. A part that cannot be read is reported in place (``error``), the
rest is still written: a report is most wanted when something is broken. No driver process at
all is an error (exit 1), as upstream.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from dracpu import __version__
from dracpu.adapters.checkpoint_file import read_newest
from dracpu.adapters.file_scan import list_our_specs
from dracpu.adapters.host_cgroups import RECORD_FILE
from dracpu.adapters.sysfs import read_topology
from dracpu.adapters.sysfs_overlay import build_overlay_root, load_overlay
from dracpu.config import Config, load_config
from dracpu.config.go_flags import add_run_arguments, go_style_flags
from dracpu.config.settings import SETTINGS, Setting
from dracpu.core.topology import Topology
from dracpu.errors import DracpuError
from dracpu.tasks.debug_dump import DUMP_FILE, DUMP_SIGNAL

__all__ = ["LAYOUT_VERSION", "DriverProcess", "find_driver", "gather", "report"]

# Upstream's report layout (internal/gatherinfo LayoutVersion) and process name.
LAYOUT_VERSION = "v1"
DRIVER_PROCESS_NAME = "dracpu"
PROC = Path("/proc")
# How long to wait for the daemon to write its debug dump after SIGUSR1.
DUMP_TIMEOUT = 5.0
DUMP_POLL = 0.05
# The report file's name under --output-dir (upstream: dracpu-gatherinfo-<time>-<pid>.yaml).
_FILE_TIME = "%Y%m%d-%H%M%S"


class GatherError(DracpuError):
    """No report can be made (no driver process, or the output cannot be written)."""


@dataclass(frozen=True, slots=True)
class DriverProcess:
    """The running driver as ``/proc`` shows it."""

    pid: int
    cmdline: tuple[str, ...]
    arguments: tuple[str, ...]
    """The command's own arguments (the interpreter and the program name taken off)."""
    environ: Mapping[str, str]

    def path(self, name: Path) -> Path:
        """``name`` (absolute) as seen in the driver's mount namespace."""
        return PROC / str(self.pid) / "root" / name.relative_to("/")


def _read_nul_list(path: Path) -> list[str]:
    data = path.read_bytes()
    return [part.decode(errors="replace") for part in data.split(b"\0")[:-1]] if data else []


def driver_arguments(cmdline: list[str]) -> list[str] | None:
    """The dracpu arguments of a process's command line, ``None`` if it is not dracpu's:
    ``/dracpu ...``, ``<python> /dracpu ...`` (a script), ``<python> -m dracpu ...``."""
    for index, word in enumerate(cmdline[:2]):
        if os.path.basename(word) == DRIVER_PROCESS_NAME:
            return cmdline[index + 1 :]
    for index in range(len(cmdline) - 1):
        if cmdline[index : index + 2] == ["-m", "dracpu"]:
            return cmdline[index + 2 :]
    return None


def _describe(pid: int) -> DriverProcess | None:
    base = PROC / str(pid)
    try:
        cmdline = _read_nul_list(base / "cmdline")
        environ = dict(
            item.partition("=")[::2] for item in _read_nul_list(base / "environ") if "=" in item
        )
    except OSError:
        return None
    arguments = driver_arguments(cmdline)
    if arguments is None:
        return None
    return DriverProcess(pid, tuple(cmdline), tuple(arguments), environ)


def find_driver(pid: int | None = None) -> DriverProcess:
    """The driver process: ``pid`` if given, else the lowest pid named ``dracpu`` whose command
    runs the driver (not a ``gatherinfo`` like this one)."""
    if pid is not None:
        found = _describe(pid)
        if found is None:
            raise GatherError(f"process {pid} is not a running dracpu")
        return found
    candidates = []
    for entry in PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if comm == DRIVER_PROCESS_NAME:
            candidates.append(int(entry.name))
    for candidate in sorted(candidates):
        found = _describe(candidate)
        if found is not None and "gatherinfo" not in found.arguments[:1]:
            return found
    raise GatherError(f"no running {DRIVER_PROCESS_NAME!r} process found under {PROC}")


def driver_config(process: DriverProcess) -> Config:
    """The driver's settings, from its command line, environment and config file."""
    arguments = list(process.arguments)
    if arguments[:1] == ["run"]:
        arguments = arguments[1:]
    parser = argparse.ArgumentParser(add_help=False, exit_on_error=False)
    flags = add_run_arguments(parser)
    try:
        args, _ = parser.parse_known_args(go_style_flags(arguments, flags))
    except (argparse.ArgumentError, SystemExit) as exc:
        raise DracpuError(f"cannot parse the driver's flags {arguments}: {exc}") from exc
    config_file = getattr(args, "config", "")
    if config_file and os.path.isabs(config_file):
        args.config = str(process.path(Path(config_file)))
    return load_config(args, process.environ)


def _topology_report(topology: Topology) -> dict[str, Any]:
    cores = {info.core_key for info in topology.cpus.values()}
    cpus = []
    for cpu in sorted(topology.cpus):
        info = topology.info(cpu)
        others = [c for c in topology.siblings(cpu) if c != cpu]
        cpus.append(
            {
                "cpuID": cpu,
                "coreID": info.core_id,
                "socketID": info.socket_id,
                "clusterID": info.cluster_id,
                "numaNodeID": info.numa_node,
                "numaNodeCPUSet": str(topology.numa_nodes[info.numa_node]),
                "sibling": others[0] if others else -1,
                "coreType": str(info.core_type),
                "uncoreCacheID": -1 if info.l3_id is None else info.l3_id,
            }
        )
    return {
        "topology": {
            "numCPUs": len(topology.cpus),
            "numCores": len(cores),
            "numUncoreCache": len(topology.l3_caches),
            "numSockets": len(topology.sockets),
            "numNUMANodes": len(topology.numa_nodes),
            "smtEnabled": topology.smt_enabled,
        },
        "cpus": cpus,
    }


def _upstream_config(config: Config) -> dict[str, Any]:
    """Upstream's ``driverConfig`` keys, zero values left out (its json ``omitempty``)."""
    values: dict[str, Any] = {
        "kubeconfig": str(config.kubeconfig or ""),
        "hostnameOverride": config.node_name if config.node_name_source != "hostname" else "",
        "bindAddress": str(config.bind_address),
        "reservedCPUs": str(config.reserved_cpus),
        "cpuDeviceMode": str(config.cpu_device_mode),
        "groupBy": str(config.group_by),
        "exposePCIeRoots": config.expose_pcie_roots,
        "sysfsOverlay": str(config.sysfs_overlay or ""),
        "kubeletRootDir": str(config.kubelet_root_dir),
        "publishNodeAllocatableResourceMapping": config.publish_node_allocatable_resource_mapping,
        "allocator": config.allocator or "",
    }
    return {key: value for key, value in values.items() if value}


def _our_config(config: Config) -> dict[str, Any]:
    """Every setting by its Config field (the table's order), and where the node name came
    from."""
    values: dict[str, Any] = {s.name: _plain(s, getattr(config, s.name)) for s in SETTINGS}
    values["node_name_source"] = config.node_name_source
    return values


def _plain(setting: Setting, value: object) -> Any:
    if value is None or isinstance(value, bool | int | float):
        return value
    return setting.shown(value)  # a plain str also for a StrEnum, which YAML cannot dump


def _part(read: Callable[[], Any]) -> Any:
    """``read()``, or ``{"error": ...}`` when it fails: one broken part spoils no other."""
    try:
        return read()
    except (DracpuError, OSError, ValueError) as exc:
        return {"error": str(exc)}


def _topology(process: DriverProcess, config: Config) -> Topology:
    host_root = process.path(config.host_root)
    if config.sysfs_overlay is None:
        return read_topology(host_root)
    overlay = load_overlay(process.path(config.sysfs_overlay))
    with tempfile.TemporaryDirectory(prefix="dracpu-gatherinfo-") as scratch:
        return read_topology(build_overlay_root(host_root, overlay, Path(scratch) / "root"))


def _checkpoint(process: DriverProcess, config: Config) -> Any:
    stored = read_newest(process.path(config.checkpoint_path))
    if stored is None:
        return {"claims": []}
    return {
        "sequence": stored.sequence,
        "claims": [
            {
                "uid": uid,
                "namespace": claim.namespace,
                "name": claim.name,
                "cpus": str(claim.cpus),
                "mems": None if claim.mems is None else str(claim.mems),
                "devices": [result.device for result in claim.results],
                "podUids": sorted(claim.pod_uids),
                "podNames": sorted(claim.pod_names),
                "copierPods": sorted(claim.copiers),
                "sharedPool": claim.shared_pool,
            }
            for uid, claim in sorted(stored.data.claims.items())
        ],
    }


def _cdi_specs(process: DriverProcess, config: Config) -> Any:
    """Each of our specs: the claim's cpuset (with `` and the shared pool`` for a claim whose
    spec names the pool), or the error reading it."""
    return {
        uid: {"error": str(spec)}
        if isinstance(spec, Exception)
        else f"{spec.cpus} and the shared pool"
        if spec.shared_pool
        else str(spec.cpus)
        for uid, spec in sorted(list_our_specs(process.path(config.cdi_dir)).items())
    }


def _host_cgroups_found(process: DriverProcess, config: Config) -> Any:
    """The record of what the confined host cgroups held before dracpu wrote them
    (:mod:`dracpu.adapters.host_cgroups`); ``None`` when there is none (nothing confined)."""
    path = process.path(config.state_dir / RECORD_FILE)
    if not path.exists():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def _catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (``SigCgt`` in its status, proc(5))."""
    for line in (PROC / str(pid) / "status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    return False


def _debug_dump(process: DriverProcess, config: Config) -> Any:
    path = process.path(config.state_dir / DUMP_FILE)
    if not _catches(process.pid, DUMP_SIGNAL):
        return {"error": f"process {process.pid} does not handle {DUMP_SIGNAL.name} (yet)"}
    before = path.stat().st_mtime_ns if path.exists() else None
    os.kill(process.pid, DUMP_SIGNAL)
    deadline = time.monotonic() + DUMP_TIMEOUT
    while time.monotonic() < deadline:
        if path.exists() and path.stat().st_mtime_ns != before:
            return json.loads(path.read_text(encoding="utf-8"))
        time.sleep(DUMP_POLL)
    return {"error": f"the daemon wrote no dump to {path} within {DUMP_TIMEOUT:g} s"}


def report(process: DriverProcess) -> dict[str, Any]:
    """The whole report (see the module doc)."""
    doc: dict[str, Any] = {
        "toolVersion": {
            "dracpuVersion": __version__,
            "pythonVersion": platform.python_version(),
        },
        "layoutVersion": LAYOUT_VERSION,
    }
    try:
        config = driver_config(process)
    except DracpuError as exc:
        doc["driverConfig"] = {"error": str(exc)}
        doc["dracpu"] = {"process": {"pid": process.pid, "cmdline": list(process.cmdline)}}
        return doc
    doc["cpuDetails"] = _part(lambda: _topology_report(_topology(process, config)))
    doc["driverConfig"] = _upstream_config(config)
    doc["dracpu"] = {
        "process": {"pid": process.pid, "cmdline": list(process.cmdline)},
        "config": _our_config(config),
        "checkpoint": _part(lambda: _checkpoint(process, config)),
        "cdiSpecs": _part(lambda: _cdi_specs(process, config)),
        "hostCgroupsFound": _part(lambda: _host_cgroups_found(process, config)),
        "debugDump": _part(lambda: _debug_dump(process, config)),
    }
    return doc


def render(doc: Mapping[str, Any]) -> str:
    """The YAML document, ``---`` first (upstream: reports of several nodes concatenate)."""
    return "---\n" + yaml.safe_dump(dict(doc), sort_keys=False, width=1000)


def gather(*, output_dir: Path | None, stdout: bool, pid: int | None) -> int:
    """Write the report to stdout, into ``output_dir``, or into a new temporary file (its path
    is printed); exit code 0, or 1 with one line on stderr."""
    try:
        text = render(report(find_driver(pid)))
        if stdout:
            sys.stdout.write(text)
            return 0
        name = f"dracpu-gatherinfo-{time.strftime(_FILE_TIME)}-{os.getpid()}.yaml"
        if output_dir is None:
            fd, path_text = tempfile.mkstemp(prefix="dracpu-gatherinfo-", suffix=".yaml")
            path = Path(path_text)
        else:
            output_dir.mkdir(parents=True, exist_ok=True)
            path = output_dir / name
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
    except (DracpuError, OSError) as exc:
        print(f"dracpu gatherinfo: error: {exc}", file=sys.stderr)
        return 1
    print(f"debug info collected: {path}")
    return 0
