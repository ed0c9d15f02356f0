"""The one error tree of dracpu.

Every error we raise on purpose is a :class:`DracpuError`. Library exceptions are translated at
the adapter that calls the library (``raise SomeDracpuError(...) from exc``), so nothing above the
adapters ever sees a ``kubernetes`` or ``OSError`` exception it has to interpret.

Errors that involve a peer say whose fault they are (:class:`LocalProtocolError` versus
:class:`RemoteProtocolError`), as h11 does.
"""

from __future__ import annotations

from typing import TypeVar

__all__ = [
    "AllocationError",
    "CdiError",
    "CheckpointError",
    "ClaimConflictError",
    "ClaimError",
    "ClaimNotReservedError",
    "ConfigError",
    "CpuSetParseError",
    "DracpuError",
    "InsufficientCpusError",
    "KubeAPIError",
    "KubeClientError",
    "KubeConflictError",
    "KubeNotFoundError",
    "KubeServerError",
    "LocalProtocolError",
    "PodResourcesError",
    "ProtocolError",
    "QuantityError",
    "RemoteProtocolError",
    "TopologyError",
    "leaf_errors",
]


class DracpuError(Exception):
    """Base of every error dracpu raises on purpose."""


class ConfigError(DracpuError):
    """A flag, config-file key or environment value is invalid. The CLI exits with code 2."""


class CpuSetParseError(DracpuError, ValueError):
    """Text is not a valid Linux CPU list (``"0-3,8"``)."""


class TopologyError(DracpuError):
    """The CPU topology under ``<host-root>/sys`` is missing or malformed (names the file)."""


class ProtocolError(DracpuError):
    """A wire protocol (mux, ttrpc, NRI) was violated."""


class LocalProtocolError(ProtocolError):
    """We were asked to send something the protocol forbids: our bug, not the peer's."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something the protocol forbids: drop the connection, keep serving."""


class AllocationError(DracpuError):
    """CPUs cannot be allocated as requested."""


class InsufficientCpusError(AllocationError):
    """Fewer free CPUs than requested (or none fitting the policy)."""


class ClaimConflictError(AllocationError):
    """A claim conflicts with node state: overlapping CPUs, same UID with other devices, ..."""


class ClaimError(DracpuError):
    """A ResourceClaim cannot be prepared: not allocated, bad capacity, unknown device, ..."""


class ClaimNotReservedError(ClaimError):
    """A container shows the env of a prepared claim that is not reserved for its pod (a copy).

    ``noted``: every such claim had noted the pod as a copier already (a fresh look at the claim
    found it not reserved before): the refusal was reported once, and no look is needed."""

    def __init__(self, message: str, *, noted: bool = False) -> None:
        super().__init__(message)
        self.noted = noted


class CdiError(DracpuError):
    """A CDI spec, or a device metadata file one mounts, cannot be written, read or removed."""


class CheckpointError(DracpuError):
    """The checkpoint file is corrupt, truncated, of an unknown version or cannot be written."""


class KubeAPIError(DracpuError):
    """The Kubernetes API server answered with an error or could not be reached.

    The message names the operation (``get resourceclaim ns/name``), the server's URL and the
    cause: the status, reason and server's message of an answer, or in words why none came.
    ``status`` is the HTTP status, ``None`` when there was no answer.
    """

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class KubeClientError(KubeAPIError):
    """A 4xx answer: our request was wrong or the object is in another state."""


class KubeNotFoundError(KubeClientError):
    """404: the object does not exist."""


class KubeConflictError(KubeClientError):
    """409: a resourceVersion conflict or an object that already exists."""


class KubeServerError(KubeAPIError):
    """A 5xx or 429 answer, or no answer (connection refused or reset, TLS failure, timeout,
    DNS failure, proxy refusal): transient, retried with backoff."""


class PodResourcesError(DracpuError):
    """The kubelet's PodResources API could not be asked, answered with an error, or answered
    something that cannot be read. The message names the socket and the cause; ``code`` is the
    gRPC status name the kubelet answered (``"RESOURCE_EXHAUSTED"``: its rate limit), ``None``
    when no answer came."""

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


# --- added for dracpu.core.quantity -------------------------------------------------------------


class QuantityError(DracpuError, ValueError):
    """Text is not a Kubernetes quantity (``resource.Quantity``), or not one the caller allows."""


_E = TypeVar("_E", bound=BaseException)


def leaf_errors(group: BaseExceptionGroup[_E]) -> list[_E]:
    """The errors inside ``group`` and the groups nested in it, in order (task groups nest)."""
    leaves: list[_E] = []
    for error in group.exceptions:
        if isinstance(error, BaseExceptionGroup):
            leaves.extend(leaf_errors(error))
        else:
            leaves.append(error)
    return leaves
