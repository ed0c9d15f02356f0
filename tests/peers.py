"""Independent protocol peers for tests: Google ``protobuf`` / ``grpcio`` modules from ``proto/``.

Every protocol boundary is tested against an implementation that shares no code with ours
(docs/architecture.md, "How it is tested"). Our daemon uses betterproto2 messages and grpclib;
the peers built here use Google's protobuf runtime (``*_pb2``) and grpcio (``*_pb2_grpc``),
compiled from the same ``proto/`` files by grpcio-tools' protoc. Nothing generated here is
committed.

Usage::

    from tests.peers import load_pb2, load_pb2_grpc, serialize, unix_target

    dra = load_pb2("dra/v1/api.proto")                   # kubelet side of DRA v1
    dra_grpc = load_pb2_grpc("dra/v1/api.proto")         # dra_grpc.DRAPluginStub(channel)
    reg = load_pb2("pluginregistration/v1/api.proto")    # reg.PluginInfo, reg.InfoRequest
    nri = load_pb2("nri/v1alpha1/api.proto")             # fake runtime: nri.CreateContainerRequest
    ttrpc = load_pb2("ttrpc/request.proto")              # ttrpc.Request / ttrpc.Response
    status = load_pb2("google/rpc/status.proto")         # google.rpc.Status

    request = dra.NodePrepareResourcesRequest(claims=[dra.Claim(namespace="ns", uid="u", name="c")])
    data = serialize(request)                            # deterministic bytes

    with grpc.insecure_channel(unix_target(socket_path)) as channel:   # sync grpcio client
        reply = dra_grpc.DRAPluginStub(channel).NodePrepareResources(request, timeout=5)

Names inside the modules are the proto names (``DRAPlugin``, ``LinuxCPU``, ``POSIXRlimit``), not
betterproto2's Python-cased ones (``DraPlugin``, ``LinuxCpu``, ``PosixRlimit``).

How it works: the first call compiles every ``*.proto`` under ``proto/`` in one protoc run into a
private temporary directory (removed at interpreter exit), appends that directory to
``sys.path`` and imports the requested module (``dra/v1/api.proto`` -> ``dra.v1.api_pb2``). Later
calls, in any test, reuse it: effectively a session-scoped fixture that also works at import time
of a test module and from threads. The top-level peer packages are ``dra``, ``pluginregistration``,
``podresources``, ``nri``, ``ttrpc`` and ``google.rpc``; a module that resolves outside the peer
directory (a clash with an installed package) is an error, never silently used.

grpcio in async tests: the sync client inside ``anyio.to_thread.run_sync`` is the simplest
(the grpclib server under test keeps running on the event loop); ``grpc.aio`` also works.
"""

from __future__ import annotations

import atexit
import importlib
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from types import ModuleType

import grpc_tools
from google.protobuf.message import Message
from grpc_tools import protoc

__all__ = [
    "PROTO_ROOT",
    "PeerBuildError",
    "load_pb2",
    "load_pb2_grpc",
    "module_name",
    "peer_protos",
    "peer_root",
    "serialize",
    "unix_target",
]

# The repository's own proto files (proto/); this file lives in <repo>/tests/.
PROTO_ROOT = Path(__file__).resolve().parent.parent / "proto"

# Well-known types (google/protobuf/any.proto, imported by google/rpc/status.proto) ship inside
# grpcio-tools.
_WELL_KNOWN_INCLUDE = Path(grpc_tools.__file__).resolve().parent / "_proto"

_lock = threading.Lock()
_root: Path | None = None


class PeerBuildError(RuntimeError):
    """protoc could not build the peer modules, or a peer module name is shadowed."""


def peer_protos() -> list[str]:
    """Every proto file under ``proto/``, relative to it, in a stable order."""
    return sorted(p.relative_to(PROTO_ROOT).as_posix() for p in PROTO_ROOT.rglob("*.proto"))


def module_name(proto_rel: str, *, grpc: bool = False) -> str:
    """The module protoc makes of a proto path: ``dra/v1/api.proto`` -> ``dra.v1.api_pb2``."""
    if not proto_rel.endswith(".proto"):
        raise ValueError(f"not a .proto path: {proto_rel!r}")
    stem = proto_rel.removesuffix(".proto").replace("-", "_").replace("/", ".")
    return f"{stem}_pb2_grpc" if grpc else f"{stem}_pb2"


def _build(out_dir: Path) -> None:
    protos = peer_protos()
    if not protos:
        raise PeerBuildError(f"no .proto files under {PROTO_ROOT}")
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{_WELL_KNOWN_INCLUDE}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    # protoc resolves the relative proto names against the -I directories, not the cwd.
    code = protoc.main(args)
    if code != 0:
        raise PeerBuildError(f"protoc exited with {code} building peers from {PROTO_ROOT}")


def peer_root() -> Path:
    """The directory holding the generated peer modules (built on first use, once per process)."""
    global _root
    with _lock:
        if _root is None:
            out_dir = Path(tempfile.mkdtemp(prefix="dracpu-peers-"))
            atexit.register(shutil.rmtree, out_dir, True)
            _build(out_dir)
            sys.path.append(str(out_dir))
            importlib.invalidate_caches()
            _root = out_dir
        return _root


def _load(proto_rel: str, *, grpc: bool) -> ModuleType:
    if not (PROTO_ROOT / proto_rel).is_file():
        raise FileNotFoundError(f"no proto file {proto_rel!r} under {PROTO_ROOT}")
    root = peer_root()
    name = module_name(proto_rel, grpc=grpc)
    module = importlib.import_module(name)
    origin = Path(module.__file__ or "").resolve()
    if not origin.is_relative_to(root.resolve()):
        raise PeerBuildError(f"peer module {name} resolved to {origin}, outside {root}")
    return module


def load_pb2(proto_rel: str) -> ModuleType:
    """Google-protobuf message classes of ``proto/<proto_rel>`` (e.g. ``"dra/v1/api.proto"``)."""
    return _load(proto_rel, grpc=False)


def load_pb2_grpc(proto_rel: str) -> ModuleType:
    """grpcio stubs and servicers of ``proto/<proto_rel>`` (``<Service>Stub``, ``add_*``)."""
    return _load(proto_rel, grpc=True)


def serialize(message: Message) -> bytes:
    """Deterministic wire bytes (map entries sorted by key), comparable with betterproto2's."""
    return message.SerializeToString(deterministic=True)


def unix_target(path: Path | str) -> str:
    """grpcio target for a unix socket path (what grpc-go's kubelet dials: ``unix:<path>``)."""
    return f"unix:{Path(path).resolve()}"
