"""The ``dracpu`` command: the driver, and ``inspect``, ``plan``, ``sim``, ``gatherinfo``,
``introspect``.

Invoked as upstream's binary is (kubernetes-sigs/dra-driver-cpu ``cmd/dracpu/app.go``):
``dracpu [flags]`` with no subcommand runs the driver, exactly as ``dracpu run [flags]``, with
Go-style flags (``-v=4``, ``--v=4``, ``-kubeconfig x``; root flags cannot be combined with a
subcommand); under the name ``dracpu-gatherinfo`` (upstream's alias) it is
``dracpu gatherinfo``. The image links ``/dracpu`` and ``/dracpu-gatherinfo`` to this command.

Bad flags, config values or sysfs contents end with one line on stderr and exit code 2; a plan
that cannot be met exits 1. Nothing here does work of its own: it parses, calls the library, and
prints.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
from collections.abc import Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from dracpu import __version__
from dracpu.errors import AllocationError, ConfigError, DracpuError

if TYPE_CHECKING:
    from dracpu.core.cpuset import CpuSet

__all__ = ["main"]

logger = logging.getLogger(__name__)

# Exit codes: 2 for bad input (argparse's own convention), 1 for a request that cannot be met.
EXIT_USAGE = 2
EXIT_UNSATISFIABLE = 1

SUBCOMMANDS = ("inspect", "plan", "run", "sim", "gatherinfo", "introspect")
# Upstream's image also has the binary as /dracpu-gatherinfo, which runs `dracpu gatherinfo`.
GATHERINFO_ALIAS = "dracpu-gatherinfo"
_HELP_OR_VERSION = ("-h", "--help", "--version")


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, not usage plus a line."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message}\n")


def _cpuset_arg(text: str) -> object:
    from dracpu.core.cpuset import CpuSet

    try:
        return CpuSet.parse(text)
    except DracpuError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _build_parser() -> argparse.ArgumentParser:
    from dracpu.config.go_flags import add_run_arguments
    from dracpu.core.allocator import Strategy
    from dracpu.core.devices import CpuDeviceMode, GroupBy

    parser = _Parser(
        prog="dracpu",
        description="A Kubernetes DRA driver for exclusive, topology-aligned CPUs "
        "(a drop-in for kubernetes-sigs/dra-driver-cpu).",
        epilog="`dracpu [flags]` without a subcommand runs the driver, as `dracpu run [flags]` "
        "does (`dracpu run -h` lists the flags).",
    )
    parser.add_argument("--version", action="version", version=f"dracpu {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def add_topology_args(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--host-root",
            type=Path,
            default=Path(os.environ.get("HOST_ROOT", "/")),
            help="read sysfs under <host-root>/sys (env HOST_ROOT; default /)",
        )
        p.add_argument(
            "--reserved-cpus",
            type=_cpuset_arg,
            default=None,
            metavar="SET",
            help="CPUs never published and never shared (Linux list syntax, e.g. 0-1)",
        )

    inspect = sub.add_parser(
        "inspect", help="show this node's CPU topology and the ResourceSlices it would publish"
    )
    add_topology_args(inspect)
    inspect.add_argument(
        "--cpu-device-mode",
        choices=[m.value for m in CpuDeviceMode],
        default=CpuDeviceMode.GROUPED.value,
    )
    inspect.add_argument(
        "--group-by", choices=[g.value for g in GroupBy], default=GroupBy.NUMANODE.value
    )
    inspect.add_argument(
        "--node-name", default=None, help="node (and pool) name; default: NODE_NAME or the hostname"
    )
    inspect.add_argument(
        "--expose-pcie-roots",
        action="store_true",
        help="read the PCIe roots and publish them (the daemon's flag)",
    )
    inspect.add_argument(
        "--publish-node-allocatable-resource-mapping",
        action="store_true",
        help="publish KEP-5517 nodeAllocatableResources (config publishNodeAllocatable...)",
    )
    inspect.add_argument(
        "--allocator",
        choices=["cpumanager", "external"],
        default=None,
        help="the config's allocator key: external adds dra.cpu/cpuIDs and dra.cpu/smtLayout",
    )
    inspect.add_argument("-o", "--output", choices=["text", "yaml", "json"], default="text")

    plan = sub.add_parser("plan", help="show which CPUs a grouped claim of N CPUs would get")
    add_topology_args(plan)
    plan.add_argument("--cpus", type=int, required=True, metavar="N", help="CPUs to allocate")
    plan.add_argument(
        "--available",
        type=_cpuset_arg,
        default=None,
        metavar="SET",
        help="free CPUs (default: every online CPU that is not reserved)",
    )
    plan.add_argument(
        "--policy", choices=[s.value for s in Strategy], default=Strategy.PACKED.value
    )
    plan.add_argument("--full-cores", action="store_true", help="never split a physical core")
    plan.add_argument("-o", "--output", choices=["text", "json"], default="text")

    run = sub.add_parser(
        "run",
        help="run the driver daemon (what the DaemonSet runs; also `dracpu [flags]`)",
        allow_abbrev=False,  # Go's flag package takes no abbreviations
    )
    parser.set_defaults(run_flags=add_run_arguments(run))

    gather = sub.add_parser(
        "gatherinfo",
        help="collect what a bug report needs from the running driver (upstream's report, "
        "plus the checkpoint, CDI specs, pins and recent log)",
    )
    where = gather.add_mutually_exclusive_group()
    where.add_argument(
        "--output-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="write the report into DIR (default: a new temporary file)",
    )
    where.add_argument("--stdout", action="store_true", help="write the report to stdout")
    gather.add_argument(
        "--pid",
        type=int,
        default=None,
        help="the driver's process (default: the process named dracpu)",
    )
    introspect = sub.add_parser("introspect", help="describe the driver without running it")
    what = introspect.add_subparsers(dest="what", required=True, parser_class=_Parser)
    what.add_parser("metrics", help="the dra_cpu_* metrics as JSON (upstream's format)")

    sim = sub.add_parser(
        "sim", help="run the real daemon on a simulated node and walk one claim through it"
    )
    sim.add_argument(
        "--topology", default="dual-socket-smt2", metavar="NAME", help="a machine of dracpu.sim"
    )
    sim.add_argument(
        "--cpus",
        type=int,
        default=None,
        metavar="N",
        help="CPUs of the demo claim (default: 4, fewer where one device has less room)",
    )
    sim.add_argument(
        "--cpu-device-mode",
        choices=[m.value for m in CpuDeviceMode],
        default=CpuDeviceMode.GROUPED.value,
    )
    sim.add_argument(
        "--group-by", choices=[g.value for g in GroupBy], default=GroupBy.NUMANODE.value
    )
    sim.add_argument("--reserved-cpus", default="", metavar="SET", help="the daemon's flag")
    sim.add_argument(
        "--runtime-version",
        default="2.4.0",
        metavar="V",
        help="containerd version the fake runtime claims (its NRI version follows; default 2.4.0)",
    )
    sim.add_argument("--shared", type=int, default=3, metavar="N", help="shared containers")
    sim.add_argument("--memory-pinning", action="store_true", help="the daemon's flag")
    sim.add_argument("--keep", action="store_true", help="keep the node's files and logs")
    sim.add_argument("-o", "--output", choices=["text", "json"], default="text")
    return parser


def _node_name(explicit: str | None) -> str:
    # The kubelet registers a node under its lower-cased hostname (when no --hostname-override).
    return explicit or os.environ.get("NODE_NAME") or socket.gethostname().lower()


def _warn_absent_reserved(command: str, online: CpuSet, reserved: CpuSet) -> None:
    """One stderr line when ``--reserved-cpus`` names CPUs that are not online here: they
    reserve nothing (the daemon warns the same way at start; a config file shared by nodes of
    different sizes may name them, so it is no error)."""
    outside = reserved - online
    if outside:
        print(
            f"dracpu {command}: warning: --reserved-cpus {reserved}: cpus {outside} are not "
            f"online on this node (online: {online or 'none'}); they reserve nothing",
            file=sys.stderr,
        )


def _cmd_inspect(args: argparse.Namespace) -> int:
    import yaml

    from dracpu.adapters.sysfs import read_topology
    from dracpu.core.claim_config import ALLOCATOR_EXTERNAL
    from dracpu.core.cpuset import CpuSet
    from dracpu.core.devices import CpuDeviceMode, GroupBy, published_devices
    from dracpu.core.external_attributes import left_out
    from dracpu.core.slices import SliceOptions, build_resource_slices
    from dracpu.core.topology_map import render_map

    topology = read_topology(args.host_root, pcie_roots=args.expose_pcie_roots)
    reserved = args.reserved_cpus or CpuSet()
    _warn_absent_reserved("inspect", topology.online, reserved)
    external = args.allocator == ALLOCATOR_EXTERNAL
    devices = published_devices(
        topology,
        reserved=reserved,
        mode=CpuDeviceMode(args.cpu_device_mode),
        group_by=GroupBy(args.group_by),
        external=external,
    )
    if external:
        grouped = [(d.name, d.cpus) for d in devices if d.grouped]
        for reason in left_out(topology, grouped):
            print(f"dracpu inspect: warning: {reason}", file=sys.stderr)
    options = SliceOptions(
        node_allocatable=args.publish_node_allocatable_resource_mapping,
        expose_pcie_roots=args.expose_pcie_roots,
    )
    slices = build_resource_slices(_node_name(args.node_name), devices, options=options)
    if args.output == "json":
        print(json.dumps(slices, indent=2))
    elif args.output == "yaml":
        # libyaml's emitter when present: faster than the pure-Python one, same text.
        dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
        print(yaml.dump_all(slices, Dumper=dumper, sort_keys=False), end="")
    else:
        text = render_map(
            topology, reserved=reserved, devices=devices, slices=slices, options=options
        )
        print(text, end="")
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    from dracpu.adapters.sysfs import read_topology
    from dracpu.core.allocator import AllocationPolicy, Strategy, allocate, describe_plan
    from dracpu.core.cpuset import CpuSet

    topology = read_topology(args.host_root)
    reserved = args.reserved_cpus or CpuSet()
    _warn_absent_reserved("plan", topology.online, reserved)
    if args.cpus < 1:
        raise ConfigError(f"invalid CPU count {args.cpus}: --cpus must be at least 1")
    available = (args.available if args.available is not None else topology.online) - reserved
    policy = AllocationPolicy(strategy=Strategy(args.policy), full_cores=args.full_cores)
    try:
        cpus = allocate(topology, available, args.cpus, policy)
    except AllocationError as exc:
        # The request is valid but this node cannot meet it (not enough free CPUs, a count no
        # whole cores make): exit 1, as documented.
        print(f"dracpu plan: {exc}", file=sys.stderr)
        return EXIT_UNSATISFIABLE
    plan = describe_plan(topology, cpus)
    if args.output == "json":
        print(json.dumps(plan, indent=2))
    else:
        print(
            f"cpus: {plan['cpus']}\n"
            f"numa nodes: {plan['numaNodes']}  l3 caches: {plan['l3Caches']}  "
            f"cores: {len(plan['cores'])} ({' '.join(plan['cores'])})"
        )
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from dracpu.adapters.mounts import volatile_reason
    from dracpu.adapters.sysfs_overlay import OVERLAY_DIR, build_overlay_root, load_overlay
    from dracpu.config import load_config
    from dracpu.daemon import main as daemon_main
    from dracpu.logs import setup_logging
    from dracpu.tasks.reload import ConfigSource

    environ = dict(os.environ)
    config = load_config(args, environ)
    source = ConfigSource(config, partial(load_config, args, environ))
    unmatched = setup_logging(config.log_format, config.verbosity, vmodule=config.vmodule)
    for notice in config.notices:
        logger.warning("%s", notice)
    if unmatched:
        logger.warning(
            "-vmodule: %s match no module of dracpu (Go file names do not); ignored",
            ", ".join(unmatched),
        )
    reason = volatile_reason(config.state_dir)
    if reason is not None:
        logger.warning(
            "--state-dir %s does not outlive this pod (%s): prepared claims will not survive "
            "a pod restart; mount a hostPath there, as deploy/ does",
            config.state_dir,
            reason,
        )
    if config.sysfs_overlay is not None:
        overlay = load_overlay(config.sysfs_overlay)
        root = build_overlay_root(config.host_root, overlay, config.state_dir / OVERLAY_DIR)
        logger.info(
            "sysfs overlay %s: %d file(s) laid over %s/sys, read from %s",
            config.sysfs_overlay,
            len(overlay.files),
            config.host_root,
            root,
        )
        config = replace(config, host_root=root)
        source = replace(source, overlay=overlay.files)
    return daemon_main(config, source)


def _cmd_gatherinfo(args: argparse.Namespace) -> int:
    from dracpu.diagnostics.gatherinfo import gather

    return gather(output_dir=args.output_dir, stdout=args.stdout, pid=args.pid)


def _cmd_introspect(args: argparse.Namespace) -> int:
    from dracpu.tasks.dra_cpu_metrics import descriptors

    print(json.dumps(descriptors(), indent=2))
    return 0


def _cmd_sim(args: argparse.Namespace) -> int:
    from dracpu.core.devices import CpuDeviceMode, GroupBy

    try:
        from dracpu.sim.demo import DemoOptions
        from dracpu.sim.demo import main as demo_main
    except ImportError as exc:  # the image leaves the simulator and its peers out
        raise DracpuError(
            f"the simulator is not installed here ({exc}); run `scripts/dracpu sim` from a checkout"
        ) from exc

    options = DemoOptions(
        topology=args.topology,
        cpus=args.cpus,
        mode=CpuDeviceMode(args.cpu_device_mode),
        group_by=GroupBy(args.group_by),
        reserved=args.reserved_cpus,
        runtime_version=args.runtime_version,
        shared=args.shared,
        memory_pinning=args.memory_pinning,
        keep=args.keep,
    )
    return demo_main(options, output=args.output)


def _driver_argv(argv: Sequence[str], prog: str) -> list[str]:
    """The argument list with the subcommand upstream's invocations imply made explicit:
    ``dracpu-gatherinfo ...`` is ``gatherinfo ...``; flags (or nothing) alone are ``run``."""
    if os.path.basename(prog) == GATHERINFO_ALIAS:
        return ["gatherinfo", *argv]
    if not argv or (argv[0].startswith("-") and argv[0] not in _HELP_OR_VERSION):
        return ["run", *argv]
    return list(argv)


def main(argv: Sequence[str] | None = None, *, prog: str | None = None) -> int:
    """The command. ``argv``: the arguments (default ``sys.argv[1:]``); ``prog``: the name it
    was invoked as (default ``sys.argv[0]``)."""
    words = _driver_argv(
        sys.argv[1:] if argv is None else argv, sys.argv[0] if prog is None else prog
    )
    parser = _build_parser()
    if words[0] == "run":
        from dracpu.config.go_flags import go_style_flags

        words = ["run", *go_style_flags(words[1:], parser.get_default("run_flags"))]
    args, extra = parser.parse_known_args(words)
    if extra:
        if args.command == "run" and extra[0] in SUBCOMMANDS:
            parser.exit(
                EXIT_USAGE, "dracpu: error: root flags cannot be combined with subcommands\n"
            )
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handlers = {
        "inspect": _cmd_inspect,
        "plan": _cmd_plan,
        "run": _cmd_run,
        "sim": _cmd_sim,
        "gatherinfo": _cmd_gatherinfo,
        "introspect": _cmd_introspect,
    }
    handler = handlers[args.command]
    try:
        return handler(args)
    except DracpuError as exc:
        print(f"dracpu {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `dracpu inspect | head`: the reader went away; not an error of ours.
        sys.stderr.close()
        return 0
