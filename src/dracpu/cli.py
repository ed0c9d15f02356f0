"""The ``dracpu`` command: ``inspect``, ``plan``, ``run`` and ``sim`` (design §5).

Bad flags, config values or sysfs contents end with one line on stderr and exit code 2; a plan
that cannot be met exits 1. Nothing here does work of its own: it parses, calls the library, and
prints.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import NoReturn

from dracpu import __version__
from dracpu.errors import AllocationError, DracpuError

__all__ = ["main"]

# Exit codes: 2 for bad input (argparse's own convention), 1 for a request that cannot be met.
EXIT_USAGE = 2
EXIT_UNSATISFIABLE = 1


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
    from dracpu.config import add_run_arguments
    from dracpu.core.allocator import Strategy
    from dracpu.core.slices import CpuDeviceMode, GroupBy

    parser = _Parser(prog="dracpu", description=__doc__.splitlines()[0] if __doc__ else None)
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

    run = sub.add_parser("run", help="run the driver daemon (what the DaemonSet runs)")
    add_run_arguments(run)

    sim = sub.add_parser(
        "sim", help="run the real daemon on a simulated node and walk one claim through it"
    )
    sim.add_argument(
        "--topology", default="dual-socket-smt2", metavar="NAME", help="a machine of dracpu.sim"
    )
    sim.add_argument("--cpus", type=int, default=4, metavar="N", help="CPUs of the demo claim")
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


def _cmd_inspect(args: argparse.Namespace) -> int:
    import yaml

    from dracpu.adapters.sysfs import read_topology
    from dracpu.core.cpuset import CpuSet
    from dracpu.core.slices import (
        CpuDeviceMode,
        GroupBy,
        SliceOptions,
        build_resource_slices,
        published_devices,
    )
    from dracpu.core.topology_map import render_map

    topology = read_topology(args.host_root, pcie_roots=args.expose_pcie_roots)
    reserved = args.reserved_cpus or CpuSet()
    devices = published_devices(
        topology,
        reserved=reserved,
        mode=CpuDeviceMode(args.cpu_device_mode),
        group_by=GroupBy(args.group_by),
    )
    options = SliceOptions(
        node_allocatable=args.publish_node_allocatable_resource_mapping,
        expose_pcie_roots=args.expose_pcie_roots,
    )
    slices = build_resource_slices(_node_name(args.node_name), devices, options=options)
    if args.output == "json":
        print(json.dumps(slices, indent=2))
    elif args.output == "yaml":
        # libyaml's emitter when present: 4x faster on a 1024-CPU node, same text.
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
    from dracpu.errors import InsufficientCpusError

    topology = read_topology(args.host_root)
    reserved = args.reserved_cpus or CpuSet()
    available = (args.available if args.available is not None else topology.online) - reserved
    policy = AllocationPolicy(strategy=Strategy(args.policy), full_cores=args.full_cores)
    try:
        cpus = allocate(topology, available, args.cpus, policy)
    except AllocationError as exc:
        if not isinstance(exc, InsufficientCpusError):
            raise  # an invalid request (--cpus 0, a count no whole cores make): bad input, exit 2
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
    from dracpu.config import load_config
    from dracpu.daemon import main as daemon_main

    config = load_config(args, os.environ)
    return daemon_main(config)


def _cmd_sim(args: argparse.Namespace) -> int:
    from dracpu.core.slices import CpuDeviceMode, GroupBy
    from dracpu.sim.demo import DemoOptions
    from dracpu.sim.demo import main as demo_main

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


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    handlers = {"inspect": _cmd_inspect, "plan": _cmd_plan, "run": _cmd_run, "sim": _cmd_sim}
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
