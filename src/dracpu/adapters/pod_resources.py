"""The kubelet's PodResources API (``v1.PodResourcesLister/List``) on its unix socket, and what
its answer says about our claims.

- :class:`PodResourcesClient`: one grpclib channel on ``<kubelet-root>/pod-resources/kubelet.sock``
  with the betterproto2 stub generated from ``proto/podresources/v1`` (wire-compatible with
  k8s.io/kubelet ``pkg/apis/podresources/v1/api.proto``). :meth:`PodResourcesClient.list` asks
  once; every failure is a :class:`~dracpu.errors.PodResourcesError` naming the socket and the
  cause in words, with the gRPC status when the kubelet answered one (``RESOURCE_EXHAUSTED`` is
  its rate limit: 100 requests per second, bursts of 10, for all its clients together,
  ``pkg/kubelet/apis/podresources/grpc/ratelimit.go``). After a failure the channel is closed
  and the next call connects anew (the kubelet may have restarted).
- :func:`claims_listed`: the answer as a :class:`PodResourcesListing`, pure. The kubelet lists
  its active pods, each container (sidecars and regular containers) with the prepared DRA claims
  it references in ``dynamic_resources`` (only when its ``KubeletPodResourcesDynamicResources``
  gate is on; ``pkg/kubelet/apis/podresources/server_v1.go``). A claim of our driver is known by
  the UID in its CDI device id (``dra.k8s.io/cpu=claim-<uid>``, the id our Prepare answered),
  else by namespace and name.
- :func:`claims_shown_by_default`: whether a kubelet of a version has that gate on by default
  (:data:`DYNAMIC_RESOURCES_BY_DEFAULT`), so that an answer without any claim means no pod holds
  one.

grpclib runs on asyncio only: this adapter is used by the pod-resources task on the daemon's
asyncio backend.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TypeVar, cast

import grpclib.client
import grpclib.const
import grpclib.exceptions

from dracpu import DRIVER_NAME
from dracpu._gen.podresources import v1 as podres
from dracpu.adapters.grpc_unix import H2ProtocolError
from dracpu.core.cdi_spec import CDI_KIND, DEVICE_PREFIX, is_valid_claim_uid
from dracpu.errors import PodResourcesError

__all__ = [
    "CALL_TIMEOUT",
    "DYNAMIC_RESOURCES_BY_DEFAULT",
    "ClaimUser",
    "PodResourcesClient",
    "PodResourcesListing",
    "claims_listed",
    "claims_shown_by_default",
]


T = TypeVar("T")

# How long one List may take (seconds). Consumers of the API (node-feature-discovery's
# topology-updater, the kubelet's own e2e client) use 10 s; a List is a read of the kubelet's
# memory, so 10 s without an answer means the kubelet is stuck.
CALL_TIMEOUT = 10.0

# Our CDI device ids: dra.k8s.io/cpu=claim-<uid> (dracpu.core.cdi_spec.device_id).
_OUR_CDI_ID = f"{CDI_KIND}={DEVICE_PREFIX}"

# The first kubelet minor version whose KubeletPodResourcesDynamicResources gate is on by default:
# alpha (off) from 1.27, beta and on from 1.34 (kubernetes pkg/features/kube_features.go,
# the gate's versioned specs; KEP-3695 plans GA in 1.36). An operator can still turn a beta gate
# off; the daemon cannot see the kubelet's flags.
DYNAMIC_RESOURCES_BY_DEFAULT = (1, 34)
_VERSION = re.compile(r"v?(\d+)\.(\d+)(?:\.\d+)?(?:[-+].*)?")


def claims_shown_by_default(kubelet_version: str) -> bool:
    """Whether a kubelet of this version (``status.nodeInfo.kubeletVersion``: ``v1.35.2``,
    ``v1.34.1-gke.1200``, ``v1.34.0+k3s1``) lists DRA claims by default; ``False`` for an older
    one and for a version that does not read as one."""
    match = _VERSION.fullmatch(kubelet_version.strip())
    if match is None:
        return False
    return (int(match[1]), int(match[2])) >= DYNAMIC_RESOURCES_BY_DEFAULT


@dataclass(frozen=True, slots=True)
class ClaimUser:
    """A container that references a claim: its pod (namespace, name) and its name."""

    pod_namespace: str
    pod_name: str
    container: str


@dataclass(frozen=True, slots=True)
class PodResourcesListing:
    """What one ``List`` answer says about our driver's claims.

    ``by_uid``: the containers referencing each claim, by the claim's UID; ``by_name``: claims
    of our driver listed without a CDI device id of ours, by (namespace, name); ``pods``: how
    many active pods are listed, ``active``: their (namespace, name); ``dynamic_resources``: the
    claim references of any driver. An answer with none at all cannot show claims
    (:attr:`reports_claims`).
    """

    by_uid: Mapping[str, tuple[ClaimUser, ...]]
    by_name: Mapping[tuple[str, str], tuple[ClaimUser, ...]]
    pods: int
    dynamic_resources: int
    active: frozenset[tuple[str, str]] = frozenset()

    @property
    def reports_claims(self) -> bool:
        """Whether the answer can show DRA claims: it holds at least one claim reference (of
        any driver). None at all reads the same whether the kubelet's
        ``KubeletPodResourcesDynamicResources`` gate is off or no pod holds a claim."""
        return self.dynamic_resources > 0


def _malformed(what: str) -> PodResourcesError:
    return PodResourcesError(f"the kubelet's List answer is malformed: {what}")


# betterproto2 keeps a field sent with another wire type as a value of another Python type: such
# an answer is refused as a whole, never half read (a reference skipped could release a claim).


def _items(value: object, kind: type[T], what: str) -> list[T]:
    if type(value) is not list:
        raise _malformed(f"{what} is {type(value).__name__}, not a list")
    for item in value:
        if type(item) is not kind:
            raise _malformed(f"an item of {what} is {type(item).__name__}, not {kind.__name__}")
    return cast(list[T], value)


def _text(value: object, what: str) -> str:
    if type(value) is not str:
        raise _malformed(f"{what} is {type(value).__name__}, not a string")
    return value


def claims_listed(
    response: podres.ListPodResourcesResponse, driver: str = DRIVER_NAME
) -> PodResourcesListing:
    """Our claims in a ``List`` answer (see :class:`PodResourcesListing`); raises
    :class:`~dracpu.errors.PodResourcesError` for an answer whose fields have the wrong types."""
    by_uid: dict[str, list[ClaimUser]] = {}
    by_name: dict[tuple[str, str], list[ClaimUser]] = {}
    dynamic = 0
    skip = len(_OUR_CDI_ID)
    pods = _items(response.pod_resources, podres.PodResources, "pod_resources")
    active: set[tuple[str, str]] = set()
    for pod in pods:
        active.add((_text(pod.namespace, "a pod namespace"), _text(pod.name, "a pod name")))
        for container in _items(pod.containers, podres.ContainerResources, "containers"):
            references = _items(
                container.dynamic_resources, podres.DynamicResource, "dynamic_resources"
            )
            dynamic += len(references)
            for reference in references:
                ours = False
                uids: list[str] = []
                resources = _items(
                    reference.claim_resources, podres.ClaimResource, "claim_resources"
                )
                for resource in resources:
                    if _text(resource.driver_name, "driver_name") != driver:
                        continue
                    ours = True
                    for device in _items(resource.cdi_devices, podres.CdiDevice, "cdi_devices"):
                        name = _text(device.name, "a CDI device name")
                        if name.startswith(_OUR_CDI_ID) and is_valid_claim_uid(name[skip:]):
                            uids.append(name[skip:])
                if not ours:
                    continue
                user = ClaimUser(
                    _text(pod.namespace, "a pod namespace"),
                    _text(pod.name, "a pod name"),
                    _text(container.name, "a container name"),
                )
                if uids:
                    for uid in dict.fromkeys(uids):
                        by_uid.setdefault(uid, []).append(user)
                else:
                    key = (
                        _text(reference.claim_namespace, "claim_namespace"),
                        _text(reference.claim_name, "claim_name"),
                    )
                    by_name.setdefault(key, []).append(user)
    return PodResourcesListing(
        by_uid=MappingProxyType({uid: tuple(users) for uid, users in by_uid.items()}),
        by_name=MappingProxyType({key: tuple(users) for key, users in by_name.items()}),
        pods=len(pods),
        dynamic_resources=dynamic,
        active=frozenset(active),
    )


class PodResourcesClient:
    """Asks the kubelet's PodResources socket ``socket`` for ``List``, one call at a time.

    Create and use it on the asyncio event loop (grpclib); :meth:`close` (or ``with``) closes
    the channel. ``timeout``: seconds one call may take.
    """

    def __init__(
        self, socket: Path, *, driver: str = DRIVER_NAME, timeout: float = CALL_TIMEOUT
    ) -> None:
        self.socket = socket
        self.driver = driver
        self.timeout = timeout
        self._channel: grpclib.client.Channel | None = None

    async def list(self) -> PodResourcesListing:
        """One ``List``: our claims in the kubelet's answer; raises
        :class:`~dracpu.errors.PodResourcesError` when it cannot be had."""
        response = await self.list_raw()
        return claims_listed(response, self.driver)

    async def list_raw(self) -> podres.ListPodResourcesResponse:
        """One ``List``: the kubelet's answer as the generated message."""
        if self._channel is None:
            self._channel = grpclib.client.Channel(path=str(self.socket))
        stub = podres.PodResourcesListerStub(self._channel)
        try:
            return await stub.list(podres.ListPodResourcesRequest(), timeout=self.timeout)
        except grpclib.exceptions.GRPCError as exc:
            self.close()
            code = exc.status.name
            if exc.status is grpclib.const.Status.DEADLINE_EXCEEDED:  # the kubelet's own clock
                raise self._late(code) from exc
            message = f": {exc.message}" if exc.message else ""
            raise PodResourcesError(
                f"PodResources List on {self.socket}: the kubelet answered {code}{message}",
                code=code,
            ) from exc
        except TimeoutError as exc:  # ours ran out first
            self.close()
            raise self._late(grpclib.const.Status.DEADLINE_EXCEEDED.name) from exc
        except OSError as exc:  # connect: missing socket, nobody listening, permissions
            self.close()
            reason = exc.strerror or str(exc) or type(exc).__name__
            raise PodResourcesError(f"cannot connect to {self.socket}: {reason}") from exc
        except (
            grpclib.exceptions.StreamTerminatedError,
            grpclib.exceptions.ProtocolError,
            H2ProtocolError,
        ) as exc:
            self.close()
            raise PodResourcesError(
                f"PodResources List on {self.socket}: the connection broke: {exc or type(exc)}"
            ) from exc
        except (ValueError, TypeError, IndexError, EOFError, struct.error) as exc:
            # betterproto2 cannot parse the answer
            self.close()
            raise _malformed(f"{type(exc).__name__}: {exc}") from exc

    def _late(self, code: str) -> PodResourcesError:
        """The call's deadline passed: the kubelet said so (it gets our ``grpc-timeout``), or
        our side gave up first; either way the same error."""
        return PodResourcesError(
            f"PodResources List on {self.socket}: no answer within {self.timeout:g} s", code=code
        )

    def close(self) -> None:
        """Close the channel; the next call connects anew."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def __enter__(self) -> PodResourcesClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
