"""Regenerate the code compiled from ``proto/``: ``src/dracpu/_gen`` and ``src/dracpu/sim/_pb2``.

Usage (from the repository root or anywhere)::

    .venv/bin/python scripts/gen_proto.py           # rewrite both trees
    .venv/bin/python scripts/gen_proto.py --check   # exit 1 (with a diff summary) if stale
    .venv/bin/python scripts/gen_proto.py --only sim --check --sim-out DIR   # one tree only

Two trees come out of the same protos:

* ``dracpu._gen``, the daemon's: betterproto2 messages + grpclib stubs of the kubelet's gRPC
  APIs (below), and under ``dracpu._gen.pb2`` Google ``protobuf`` messages of the NRI API and
  the ttrpc envelope (``ttrpc.Request``, ``ttrpc.Response``, ``google.rpc.Status``): the NRI
  plugin's hot path runs on the upb runtime, whose encoder and decoder are written in C;
* ``dracpu.sim._pb2``: Google ``protobuf`` messages of EVERY proto under ``proto/``, used only
  by the simulator's independent peers (fake runtime, fake kubelet), which share no code with
  the daemon (the fake runtime frames its messages itself).

The ``*_pb2.py`` trees (with ``*_pb2.pyi`` stubs) come from one protoc run each; the module path
follows the proto path (``nri/v1alpha1/api.proto`` -> ``<package>.nri.v1alpha1.api_pb2``), and
the absolute imports protoc writes between our protos (``from google.rpc import status_pb2``)
are rewritten to point inside the tree's package; imports of ``google.protobuf`` (the runtime's
well-known types) stay. Any other import of a top-level name that is one of our proto
directories fails loudly. Both pb2 trees register the same proto files in protobuf's default
descriptor pool; the runtime accepts a file registered again with identical contents, which
the ``--check`` freshness guarantees.

Each ``proto/<api>/<version>/*.proto`` file is compiled on its own by grpcio-tools' protoc with
the betterproto2-compiler plugin (``client_generation=async,server_generation=async``) and its
output package is placed at ``dracpu._gen.<api>.<version>``: the Python module path follows the
proto directory, not the proto ``package`` line. That keeps the wire names exactly upstream's
(``k8s.io.kubelet.pkg.apis.dra.v1``, ``pluginregistration``, ``v1``, ``nri.pkg.api.v1alpha1``)
while the Python packages stay short and never collide (the kubelet's PodResources and DRA
health APIs are both proto package ``v1``).

betterproto2 reaches the shared ``message_pool`` module through a relative import whose depth
follows the proto package; this script rewrites that one line for the new location and refuses
any other relative import, so a new cross-package dependency fails loudly instead of silently.
The output is deterministic: the same inputs and tool versions give the same bytes.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = [
    "API_PROTOS",
    "DAEMON_PB2_PACKAGE",
    "DAEMON_PB2_PROTOS",
    "SIM_PB2_PACKAGE",
    "generate",
    "generate_pb2",
    "main",
]

# Repository layout: protos in proto/, generated code committed in src/dracpu/_gen.
REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO_ROOT / "proto"
GEN_ROOT = REPO_ROOT / "src" / "dracpu" / "_gen"
# The Google-protobuf tree for the simulator's peers (committed, like _gen).
SIM_PB2_ROOT = REPO_ROOT / "src" / "dracpu" / "sim" / "_pb2"
SIM_PB2_PACKAGE = "dracpu.sim._pb2"
# The daemon's Google-protobuf tree, a subpackage of _gen (written and checked with it).
DAEMON_PB2_DIR = "pb2"
DAEMON_PB2_PACKAGE = "dracpu._gen.pb2"

# The proto files compiled by betterproto2 into _gen (relative to proto/). The generated Python
# package of each is named after its directory: dra/v1/api.proto -> dracpu._gen.dra.v1.
API_PROTOS: tuple[str, ...] = (
    "dra/v1/api.proto",
    "dra/v1beta1/api.proto",
    "dra_health/v1/api.proto",
    "dra_health/v1alpha1/api.proto",
    "pluginregistration/v1/api.proto",
    "podresources/v1/api.proto",
)
# The proto files of the daemon's pb2 tree: the NRI API and the ttrpc envelope it travels in.
DAEMON_PB2_PROTOS: tuple[str, ...] = (
    "google/rpc/status.proto",
    "nri/v1alpha1/api.proto",
    "ttrpc/request.proto",
)

# betterproto2-compiler options (betterproto2_compiler/settings.py, 0.10): async grpclib
# clients (<Service>Stub) and servers (<Service>Base).
PLUGIN_OPTIONS = "client_generation=async,server_generation=async"

# betterproto2-compiler pipes its output through `ruff check --fix` and `ruff format` found on
# PATH, with the ruff configuration discovered from the working directory. We run protoc in a
# scratch directory holding this file so the output does not depend on pyproject.toml or on a
# user-level ruff config; 100 columns and py311 match the project's own settings.
_RUFF_TOML = 'line-length = 100\ntarget-version = "py311"\n'

# The only relative import betterproto2 0.10 emits for a self-contained proto package.
_MESSAGE_POOL_IMPORT = re.compile(r"^from (\.+)message_pool import default_message_pool$", re.M)
_ANY_RELATIVE_IMPORT = re.compile(r"^\s*from \.", re.M)

_GEN_HEADER = "# Generated by scripts/gen_proto.py from proto/. DO NOT EDIT.\n"
_GEN_ROOT_INIT = (
    _GEN_HEADER
    + '"""Code generated from proto/ (see scripts/gen_proto.py).\n\n'
    + "betterproto2-compiler modules (Python path -> proto package):\n\n"
    + "{modules}\n"
    + "Google protobuf modules (proto file -> module): see dracpu._gen.pb2.\n"
    + '"""\n'
)


_PB2_HEADER = "# Generated by scripts/gen_proto.py from proto/ (Google protobuf). DO NOT EDIT.\n"
_PB2_ROOT_INIT = (
    _PB2_HEADER
    + '"""Google-protobuf code generated from proto/ by grpcio-tools\' protoc.\n\n'
    + "{purpose}\n"
    + "Regenerate with scripts/gen_proto.py. Modules (proto file -> module):\n\n"
    + "{modules}"
    + '"""\n'
)
_SIM_PB2_PURPOSE = (
    "For the simulator's independent peers only (fake runtime, fake kubelet): they share no\n"
    "code with the daemon, whose own tree is dracpu._gen.\n"
)
_DAEMON_PB2_PURPOSE = (
    "The daemon's NRI messages and ttrpc envelopes (dracpu.adapters.nri_messages and\n"
    "dracpu.adapters.ttrpc_envelopes), on the protobuf runtime's upb backend.\n"
)
# protoc's import of another generated module: ``from a.b import c_pb2 as alias``.
_PB2_IMPORT = re.compile(r"^from ([A-Za-z_][\w.]*) import (\w+_pb2)\b", re.M)
# Well-known types come with the protobuf runtime (google/protobuf/any.proto, imported by
# google/rpc/status.proto); grpcio-tools ships their .proto files for protoc's include path.
_RUNTIME_PACKAGE = "google.protobuf"


class GenerationError(Exception):
    """protoc failed or produced output this script does not know how to place."""


def _plugin_path() -> Path:
    """The betterproto2 protoc plugin installed next to this interpreter."""
    candidate = Path(sys.executable).parent / "protoc-gen-python_betterproto2"
    if candidate.exists():
        return candidate
    found = shutil.which("protoc-gen-python_betterproto2")
    if found is None:
        raise GenerationError(
            "protoc-gen-python_betterproto2 not found (install betterproto2-compiler)"
        )
    return Path(found)


def _proto_package(proto_text: str, proto_rel: str) -> str:
    match = re.search(r"^package\s+([A-Za-z0-9_.]+)\s*;", proto_text, re.M)
    if match is None:
        raise GenerationError(f"{proto_rel}: no package line")
    return match.group(1)


def _run_protoc(proto_rel: str, out_dir: Path, work_dir: Path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"--plugin=protoc-gen-python_betterproto2={_plugin_path()}",
        f"-I{PROTO_ROOT}",
        f"--python_betterproto2_out={out_dir}",
        f"--python_betterproto2_opt={PLUGIN_OPTIONS}",
        str(PROTO_ROOT / proto_rel),
    ]
    # The plugin runs `ruff`: take the one installed beside this interpreter.
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=work_dir, env=env, check=False)
    if result.returncode != 0:
        raise GenerationError(f"protoc failed for {proto_rel}:\n{result.stderr.strip()}")


def _relocate(source: str, proto_rel: str, target_parts: tuple[str, ...]) -> str:
    """Point the message_pool import of a generated package at ``dracpu._gen.message_pool``."""
    # From package dracpu._gen.<a>.<b>, "." is the package itself; one more dot per level.
    dots = "." * (len(target_parts) + 1)
    new_source, count = _MESSAGE_POOL_IMPORT.subn(
        f"from {dots}message_pool import default_message_pool", source
    )
    if count != 1:
        raise GenerationError(f"{proto_rel}: expected one message_pool import, found {count}")
    others = [
        line
        for line in new_source.splitlines()
        if _ANY_RELATIVE_IMPORT.match(line) and "message_pool" not in line
    ]
    if others:
        raise GenerationError(
            f"{proto_rel}: cross-package relative imports are not supported: {others}"
        )
    return new_source


def generate() -> dict[str, bytes]:
    """Compile every API proto; return the desired ``_gen`` tree as {relative path: bytes}."""
    files: dict[str, bytes] = {}
    modules: list[str] = []
    message_pool: bytes | None = None
    with tempfile.TemporaryDirectory(prefix="dracpu-gen-") as tmp:
        work_dir = Path(tmp) / "work"
        work_dir.mkdir()
        (work_dir / "ruff.toml").write_text(_RUFF_TOML, encoding="utf-8")
        for index, proto_rel in enumerate(API_PROTOS):
            proto_path = PROTO_ROOT / proto_rel
            package = _proto_package(proto_path.read_text(encoding="utf-8"), proto_rel)
            out_dir = Path(tmp) / str(index)
            out_dir.mkdir()
            _run_protoc(proto_rel, out_dir, work_dir)
            generated = out_dir.joinpath(*package.split("."), "__init__.py")
            if not generated.is_file():
                raise GenerationError(f"{proto_rel}: protoc wrote no {generated}")
            target_parts = tuple(Path(proto_rel).parent.parts)
            source = _relocate(generated.read_text(encoding="utf-8"), proto_rel, target_parts)
            files["/".join((*target_parts, "__init__.py"))] = source.encode("utf-8")
            modules.append(f"    dracpu._gen.{'.'.join(target_parts)} -> {package}\n")
            # Intermediate packages (e.g. dracpu._gen.dra) are empty markers.
            for depth in range(1, len(target_parts)):
                marker = "/".join((*target_parts[:depth], "__init__.py"))
                files.setdefault(marker, _GEN_HEADER.encode("utf-8"))
            pool = (out_dir / "message_pool.py").read_bytes()
            if message_pool is not None and pool != message_pool:
                raise GenerationError(f"{proto_rel}: message_pool.py differs between runs")
            message_pool = pool
    if message_pool is None:
        raise GenerationError("no proto files to compile")
    files["message_pool.py"] = message_pool
    files["__init__.py"] = _GEN_ROOT_INIT.format(modules="".join(modules)).encode("utf-8")
    pb2 = generate_pb2(DAEMON_PB2_PACKAGE, DAEMON_PB2_PROTOS, _DAEMON_PB2_PURPOSE)
    files.update((f"{DAEMON_PB2_DIR}/{rel}", data) for rel, data in pb2.items())
    return dict(sorted(files.items()))


def generate_sim() -> dict[str, bytes]:
    """The simulator's ``_pb2`` tree: every proto under ``proto/``."""
    return generate_pb2(SIM_PB2_PACKAGE, tuple(_all_protos()), _SIM_PB2_PURPOSE)


def _all_protos() -> list[str]:
    """Every proto file under ``proto/``, relative to it, sorted (the pb2 tree has them all)."""
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))


def _well_known_include() -> Path:
    import grpc_tools  # dev dependency: imported only to generate

    return Path(grpc_tools.__file__).resolve().parent / "_proto"


def _rewrite_pb2_imports(source: str, rel: str, own_modules: frozenset[str], target: str) -> str:
    """Point protoc's absolute imports of our own modules into the package ``target``."""

    def replace(match: re.Match[str]) -> str:
        package, module = match.group(1), match.group(2)
        if f"{package}.{module}" in own_modules:
            return f"from {target}.{package} import {module}"
        if package == _RUNTIME_PACKAGE or package.startswith(_RUNTIME_PACKAGE + "."):
            return match.group(0)
        raise GenerationError(f"{rel}: import of unknown generated module {package}.{module}")

    new_source = _PB2_IMPORT.sub(replace, source)
    tops = {name.split(".", 1)[0] for name in own_modules} - {"google"}
    for line in new_source.splitlines():
        words = line.split()
        if len(words) >= 2 and words[0] in ("from", "import"):
            top = words[1].split(".", 1)[0]
            if top in tops:
                raise GenerationError(f"{rel}: unrewritten import of a generated module: {line}")
    return new_source


def generate_pb2(package: str, protos: tuple[str, ...], purpose: str) -> dict[str, bytes]:
    """Compile ``protos`` with Google's generators into a tree for ``package``: {path: bytes}."""
    if not protos:
        raise GenerationError(f"no .proto files under {PROTO_ROOT}")
    with tempfile.TemporaryDirectory(prefix="dracpu-pb2-") as tmp:
        out_dir = Path(tmp)
        cmd = [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{PROTO_ROOT}",
            f"-I{_well_known_include()}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            *protos,
        ]
        result = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp, check=False)
        if result.returncode != 0:
            raise GenerationError(f"protoc (pb2) failed:\n{result.stderr.strip()}")
        raw = {
            path.relative_to(out_dir).as_posix(): path.read_text(encoding="utf-8")
            for path in sorted(out_dir.rglob("*"))
            if path.is_file()
        }
    own_modules = frozenset(
        rel.removesuffix(".py").replace("/", ".") for rel in raw if rel.endswith("_pb2.py")
    )
    files: dict[str, bytes] = {}
    for rel, source in raw.items():
        if not rel.endswith((".py", ".pyi")):
            raise GenerationError(f"protoc wrote an unexpected file {rel}")
        files[rel] = _rewrite_pb2_imports(source, rel, own_modules, package).encode("utf-8")
    # Every directory is a regular package, so imports never depend on namespace packages.
    directories = {Path(rel).parent.as_posix() for rel in files}
    for directory in list(directories):
        parts = Path(directory).parts
        directories.update("/".join(parts[:depth]) for depth in range(1, len(parts)))
    for directory in sorted(directories - {"", "."}):
        files[f"{directory}/__init__.py"] = _PB2_HEADER.encode("utf-8")
    modules = "".join(
        f"    {proto} -> {package}.{proto.removesuffix('.proto').replace('/', '.')}_pb2\n"
        for proto in protos
    )
    init = _PB2_ROOT_INIT.format(purpose=purpose, modules=modules)
    files["__init__.py"] = init.encode("utf-8")
    return dict(sorted(files.items()))


def _existing(root: Path) -> dict[str, bytes]:
    """The committed tree, ignoring bytecode caches."""
    if not root.is_dir():
        return {}
    return {
        path.relative_to(root).as_posix(): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file() and "__pycache__" not in path.parts
    }


def _diff_summary(want: dict[str, bytes], have: dict[str, bytes], max_lines: int = 40) -> str:
    lines: list[str] = []
    for rel in sorted(set(want) | set(have)):
        if rel not in have:
            lines.append(f"missing: {rel}")
        elif rel not in want:
            lines.append(f"extra:   {rel}")
        elif want[rel] != have[rel]:
            lines.append(f"differs: {rel}")
            diff = difflib.unified_diff(
                have[rel].decode("utf-8", "replace").splitlines(),
                want[rel].decode("utf-8", "replace").splitlines(),
                f"committed/{rel}",
                f"regenerated/{rel}",
                lineterm="",
            )
            lines.extend(f"    {line}" for line in list(diff)[:max_lines])
    return "\n".join(lines)


def _write(root: Path, want: dict[str, bytes]) -> None:
    have = _existing(root)
    for rel in sorted(set(have) - set(want)):
        (root / rel).unlink()
    for rel, data in want.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if have.get(rel) != data:
            path.write_bytes(data)
    # Drop directories left empty (apart from bytecode caches) by removed packages.
    for directory in sorted((p for p in root.rglob("*") if p.is_dir()), reverse=True):
        if directory.name == "__pycache__":
            continue
        leftovers = [p for p in directory.iterdir() if p.name != "__pycache__"]
        if not leftovers:
            shutil.rmtree(directory)


def _check(name: str, out: Path, want: dict[str, bytes]) -> bool:
    summary = _diff_summary(want, _existing(out))
    if summary:
        print(
            f"gen_proto: {out} is stale; run .venv/bin/python scripts/gen_proto.py",
            file=sys.stderr,
        )
        print(summary, file=sys.stderr)
        return False
    print(f"gen_proto: {out} ({name}) is up to date ({len(want)} files)")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="regenerate in memory and exit 1 (with a diff summary) if a tree differs",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=GEN_ROOT,
        help="the daemon's tree to write or check (default: src/dracpu/_gen)",
    )
    parser.add_argument(
        "--sim-out",
        type=Path,
        default=SIM_PB2_ROOT,
        help="the simulator's Google-protobuf tree to write or check (default: "
        "src/dracpu/sim/_pb2)",
    )
    parser.add_argument(
        "--only",
        choices=("gen", "sim"),
        default=None,
        help="handle only one of the two trees (default: both)",
    )
    args = parser.parse_args(argv)
    targets: list[tuple[str, Path, Callable[[], dict[str, bytes]]]] = []
    if args.only in (None, "gen"):
        targets.append(("gen", args.out, generate))
    if args.only in (None, "sim"):
        targets.append(("sim", args.sim_out, generate_sim))
    wanted: list[tuple[str, Path, dict[str, bytes]]] = []
    for name, out, build in targets:
        try:
            wanted.append((name, out, build()))
        except GenerationError as exc:
            print(f"gen_proto: {exc}", file=sys.stderr)
            return 2
    if args.check:
        fresh = [_check(name, out, want) for name, out, want in wanted]
        return 0 if all(fresh) else 1
    for _name, out, want in wanted:
        _write(out, want)
        print(f"gen_proto: wrote {len(want)} files to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
