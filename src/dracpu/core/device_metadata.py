"""KEP-5304 device metadata of prepared claims: the files a workload reads to learn about its
CPUs, and the CDI specs that mount them into its containers (pure: names, JSON, no I/O).

The format and the layout are those of the Go kubelet-plugin helper upstream's driver uses
(``k8s.io/dynamic-resource-allocation`` ``kubeletplugin/metadata.go``, ``api/metadata``;
dra-driver-cpu ``pkg/driver/driver.go``, ``pkg/driver/dra_hooks.go``): per request of a claim,
a ``metadata.resource.k8s.io/v1beta1`` document (:func:`document`) and a CDI spec of kind
``dra.cpu/metadata`` that bind-mounts it where the pod finds it (:func:`claim_files`). The
names, paths, attributes and which CPUs a grouped result got are ``docs/architecture.md``,
"Device metadata".
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dracpu.core.cdi_spec import CDI_VERSION, check_claim_uid, is_valid_claim_uid
from dracpu.core.checkpoint_schema import PreparedClaim
from dracpu.core.commands import DeviceResult
from dracpu.core.cpuset import EMPTY, CpuSet
from dracpu.core.devices import (
    ATTR_CACHE_L3_ID,
    ATTR_CORE_ID,
    ATTR_CORE_TYPE,
    ATTR_CPU_ID,
    ATTR_LEGACY_NUMA_NODE_ID,
    ATTR_SMT_ENABLED,
    ATTR_SOCKET_ID,
    DRIVER_NAME,
    cpu_attributes,
)
from dracpu.core.node_config import NodeConfig
from dracpu.core.slices import wire_attribute
from dracpu.errors import ClaimError

__all__ = [
    "ATTR_ALLOCATED_NUM_CPUS",
    "CONTAINER_DIR",
    "MAX_ATTRIBUTES",
    "METADATA_API_VERSION",
    "METADATA_CDI_KIND",
    "METADATA_DIR_NAME",
    "METADATA_KIND",
    "METADATA_SPEC_PREFIX",
    "PER_CPU_ATTRIBUTES",
    "POD_CLAIM_NAME_ANNOTATION",
    "MetadataFile",
    "check_names",
    "claim_files",
    "container_path",
    "device_entry",
    "document",
    "host_path",
    "metadata_device_id",
    "metadata_file_name",
    "metadata_file_owner",
    "metadata_ids_by_device",
    "metadata_spec",
    "metadata_spec_file_name",
    "metadata_spec_owner",
    "requests_of",
    "result_cpus",
]

# --- names of the format (k8s.io/dynamic-resource-allocation) ----------------------------------

# api/metadata/v1beta1/register.go: GroupName "metadata.resource.k8s.io", version v1beta1; the
# one version upstream's driver asks the helper to write (pkg/driver/driver.go).
METADATA_API_VERSION = "metadata.resource.k8s.io/v1beta1"
METADATA_KIND = "DeviceMetadata"
# api/metadata/types.go ContainerDir, ResourceClaimsSubDir, ResourceClaimTemplatesSubDir,
# MetadataFileSuffix ("<driver>-metadata.json", helpers.go MetadataFileName).
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
_CLAIMS_SUBDIR = "resourceclaims"
_TEMPLATES_SUBDIR = "resourceclaimtemplates"
_CONTAINER_FILE_NAME = f"{DRIVER_NAME}-metadata.json"
# kubeletplugin/metadata.go metadataSubDir: the metadata files' dir under the plugin data dir.
METADATA_DIR_NAME = "dra-device-metadata"
# k8s.io/api resource/v1 PodResourceClaimAnnotation: set by the resourceclaim controller on a
# claim it made from a template, to the pod's name for it (pod.spec.resourceClaims[].name).
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
# kubeletplugin/metadata.go writeCDISpec: kind "<driver>/metadata", device "<uid>_<request>",
# file cdiSpecFilePath "<driver>_metadata_<uid>_<request>.json", mount options ro + bind. The
# helper writes cdiVersion 0.5.0 too (cdiVersionStr): mounts are valid from 0.3.0.
METADATA_CDI_KIND = f"{DRIVER_NAME}/metadata"
METADATA_SPEC_PREFIX = f"{DRIVER_NAME}_metadata_"
_SPEC_SUFFIX = ".json"
_MOUNT_OPTIONS = ("ro", "bind")

# Upstream pkg/device/attributes.go AttributeAllocatedNumCPUs: metadata-only.
ATTR_ALLOCATED_NUM_CPUS = "dra.cpu/allocatedNumCPUs"
# Ours: one entry per allocated CPU of a grouped device, from the CPU's own attribute.
PER_CPU_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dra.cpu/allocatedCPUIDs", ATTR_CPU_ID),
    ("dra.cpu/allocatedCoreIDs", ATTR_CORE_ID),
    ("dra.cpu/allocatedSocketIDs", ATTR_SOCKET_ID),
    ("dra.cpu/allocatedNUMANodeIDs", ATTR_LEGACY_NUMA_NODE_ID),
    ("dra.cpu/allocatedCacheL3IDs", ATTR_CACHE_L3_ID),
    ("dra.cpu/allocatedCoreTypes", ATTR_CORE_TYPE),
    ("dra.cpu/allocatedSMTEnabled", ATTR_SMT_ENABLED),
)
# api/metadata/v1beta1 Device.attributes: +k8s:maxProperties=32 (zz_generated.validations.go).
MAX_ATTRIBUTES = 32

# A name that goes into a path: Kubernetes names (DNS subdomains and labels: claim names,
# request names, pod claim names) all match; "/", "." and ".." cannot.
_SEGMENT_RE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_MAX_SEGMENT = 253
_UID_AND_REQUEST = (
    r"([0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12})_(.+)"
)
_SPEC_NAME_RE = re.compile(
    re.escape(METADATA_SPEC_PREFIX) + _UID_AND_REQUEST + re.escape(_SPEC_SUFFIX)
)
_FILE_NAME_RE = re.compile(_UID_AND_REQUEST + re.escape(_SPEC_SUFFIX))


# --- names and paths ------------------------------------------------------------------------------


def _segment_ok(text: object) -> bool:
    return isinstance(text, str) and len(text) <= _MAX_SEGMENT and bool(_SEGMENT_RE.fullmatch(text))


def requests_of(results: Iterable[DeviceResult]) -> tuple[str, ...]:
    """The requests that get a metadata file: those with a result, sorted."""
    return tuple(sorted({result.request for result in results}))


def check_names(
    claim_uid: str,
    name: str,
    pod_claim_name: str | None,
    results: Iterable[DeviceResult],
) -> None:
    """Raise :class:`ClaimError` when a name would not make a single path segment (they all
    become parts of host or container paths)."""
    check_claim_uid(claim_uid)
    where = f"claim {claim_uid}"
    if not _segment_ok(name):
        raise ClaimError(f"{where}: its name {name!r} cannot name a device metadata path")
    if pod_claim_name is not None and not _segment_ok(pod_claim_name):
        raise ClaimError(
            f"{where}: annotation {POD_CLAIM_NAME_ANNOTATION} {pod_claim_name!r} cannot name a "
            "device metadata path"
        )
    for request in requests_of(results):
        if not _segment_ok(request):
            raise ClaimError(f"{where}: request {request!r} cannot name a device metadata path")


def container_path(claim: PreparedClaim, request: str) -> str:
    """Where a container reads the request's metadata (helper ``containerFilePath``)."""
    if claim.pod_claim_name:
        return f"{CONTAINER_DIR}/{_TEMPLATES_SUBDIR}/{claim.pod_claim_name}/{request}/" + (
            _CONTAINER_FILE_NAME
        )
    return f"{CONTAINER_DIR}/{_CLAIMS_SUBDIR}/{claim.name}/{request}/{_CONTAINER_FILE_NAME}"


def metadata_file_name(claim_uid: str, request: str) -> str:
    """The metadata file's name in the metadata dir: ``<claimUID>_<request>.json``."""
    return f"{check_claim_uid(claim_uid)}_{request}{_SPEC_SUFFIX}"


def metadata_file_owner(name: str) -> str | None:
    """The claim UID of a metadata file name of ours, else ``None``."""
    return _owner(_FILE_NAME_RE, name)


def host_path(metadata_dir: str, claim_uid: str, request: str) -> str:
    """The metadata file on the host: ``<metadata-dir>/<claimUID>_<request>.json``."""
    return f"{metadata_dir.rstrip('/')}/{metadata_file_name(claim_uid, request)}"


def metadata_device_id(claim_uid: str, request: str) -> str:
    """The CDI id that mounts a request's metadata: ``dra.cpu/metadata=<claimUID>_<request>``."""
    return f"{METADATA_CDI_KIND}={check_claim_uid(claim_uid)}_{request}"


def metadata_spec_file_name(claim_uid: str, request: str) -> str:
    """``dra.cpu_metadata_<claimUID>_<request>.json``."""
    return f"{METADATA_SPEC_PREFIX}{check_claim_uid(claim_uid)}_{request}{_SPEC_SUFFIX}"


def metadata_spec_owner(name: str) -> str | None:
    """The claim UID of a metadata spec file name of ours, else ``None``."""
    return _owner(_SPEC_NAME_RE, name)


def _owner(pattern: re.Pattern[str], name: str) -> str | None:
    match = pattern.fullmatch(name)
    if match is None or not _segment_ok(match.group(2)):
        return None
    return match.group(1)


# --- the document ---------------------------------------------------------------------------------


def result_cpus(config: NodeConfig, claim: PreparedClaim) -> tuple[CpuSet, ...]:
    """The CPUs of each of the claim's results, in result order (see the module docstring)."""
    explicit = CpuSet.union(r.cpuset for r in claim.results if r.cpuset is not None)
    given: dict[str, CpuSet] = {}
    out: list[CpuSet] = []
    for result in claim.results:
        device = config.devices.get(result.device)
        if result.cpuset is not None:
            cpus = result.cpuset & claim.cpus
        elif device is None:
            cpus = EMPTY  # no longer published (a topology change): unknown
        elif not device.grouped:
            cpus = device.cpus & claim.cpus
        else:
            left = (device.cpus & claim.cpus) - explicit - given.get(device.name, EMPTY)
            cpus = left.lowest(min(result.consumed_cpus or 0, len(left)))
            given[device.name] = given.get(device.name, EMPTY) | cpus
        out.append(cpus)
    return tuple(out)


def device_entry(config: NodeConfig, result: DeviceResult, cpus: CpuSet) -> dict[str, Any]:
    """One ``devices[]`` entry: the published device's attributes and ours (module docstring).

    A device no longer published (a topology change since Prepare) keeps what the result says.
    """
    device = config.devices.get(result.device)
    attributes: dict[str, Any] = {}
    if device is not None:
        attributes.update((key, wire_attribute(v)) for key, v in device.attributes.items())
    grouped = device.grouped if device is not None else result.consumed_cpus is not None
    if grouped and result.consumed_cpus is not None:
        attributes[ATTR_ALLOCATED_NUM_CPUS] = {"int": result.consumed_cpus}
    if grouped and cpus:
        per_cpu = [cpu_attributes(config.topology, cpu) for cpu in cpus]
        for key, source in PER_CPU_ATTRIBUTES:
            values = [entry[source] for entry in per_cpu]
            kind = (
                "bools"
                if isinstance(values[0], bool)
                else "ints"
                if isinstance(values[0], int)
                else "strings"
            )
            attributes[key] = {kind: values}
    entry: dict[str, Any] = {"driver": DRIVER_NAME, "pool": result.pool, "name": result.device}
    if attributes:
        entry["attributes"] = dict(sorted(attributes.items()))  # Go writes map keys sorted
    return entry


def document(config: NodeConfig, claim: PreparedClaim, request: str) -> dict[str, Any]:
    """The ``DeviceMetadata`` of one request of a prepared claim, JSON-ready."""
    cpus = result_cpus(config, claim)
    devices = [
        device_entry(config, result, cpus[index])
        for index, result in enumerate(claim.results)
        if result.request == request
    ]
    doc: dict[str, Any] = {
        "kind": METADATA_KIND,
        "apiVersion": METADATA_API_VERSION,
        "metadata": {
            "name": claim.name,
            "namespace": claim.namespace,
            "uid": claim.claim_uid,
            "generation": 1,
        },
    }
    if claim.pod_claim_name:
        doc["podClaimName"] = claim.pod_claim_name
    doc["requests"] = [{"name": request, "devices": devices}]
    return doc


def _encode(obj: Mapping[str, Any]) -> bytes:
    # One compact JSON object and a newline: a stream of one document, which a reader of the
    # helper's stream and a reader of one object both take. The helper pretty-prints; Python's
    # indenting encoder is pure Python, far slower than the C one on a document of many devices
    # (docs/performance.md), and the files are for programs.
    return (json.dumps(obj, separators=(",", ":"), ensure_ascii=False) + "\n").encode()


def metadata_spec(claim_uid: str, request: str, host: str, container: str) -> dict[str, Any]:
    """The CDI spec that bind-mounts ``host`` read-only at ``container`` (helper
    ``writeCDISpec``)."""
    return {
        "cdiVersion": CDI_VERSION,
        "kind": METADATA_CDI_KIND,
        "devices": [
            {
                "name": f"{check_claim_uid(claim_uid)}_{request}",
                "containerEdits": {
                    "mounts": [
                        {
                            "hostPath": host,
                            "containerPath": container,
                            "options": list(_MOUNT_OPTIONS),
                        }
                    ]
                },
            }
        ],
    }


@dataclass(frozen=True, slots=True)
class MetadataFile:
    """One request's files: the metadata document at ``host_path`` and the CDI spec
    ``spec_name`` (in the CDI dir) that mounts it."""

    request: str
    host_path: str
    document: bytes
    spec_name: str
    spec: bytes


def claim_files(
    config: NodeConfig, claim: PreparedClaim, metadata_dir: str
) -> tuple[MetadataFile, ...]:
    """The metadata files of a prepared claim, one per request with a result, sorted by
    request; none for a claim without results (adopted from its CDI spec: its requests and
    names are unknown). Raises :class:`ClaimError` for names that cannot make paths."""
    if not claim.results:
        return ()
    check_names(claim.claim_uid, claim.name, claim.pod_claim_name, claim.results)
    files: list[MetadataFile] = []
    for request in requests_of(claim.results):
        host = host_path(metadata_dir, claim.claim_uid, request)
        spec = metadata_spec(claim.claim_uid, request, host, container_path(claim, request))
        files.append(
            MetadataFile(
                request=request,
                host_path=host,
                document=_encode(document(config, claim, request)),
                spec_name=metadata_spec_file_name(claim.claim_uid, request),
                spec=_encode(spec),
            )
        )
    return tuple(files)


def metadata_ids_by_device(claim_uid: str, requests: Sequence[str]) -> tuple[str | None, ...]:
    """For the devices of a Prepare answer (their request names, in answer order): the
    metadata CDI id each one carries, on the first device of each request only (as the helper
    injects it), ``None`` for the others."""
    seen: set[str] = set()
    out: list[str | None] = []
    for request in requests:
        if request in seen or not is_valid_claim_uid(claim_uid):
            out.append(None)
        else:
            seen.add(request)
            out.append(metadata_device_id(claim_uid, request))
    return tuple(out)
