"""Translation between NRI messages and owner commands, and the unsolicited-update gate."""

from __future__ import annotations

import logging

import pytest

from dracpu.adapters import nri_messages as messages
from dracpu.adapters.nri_messages import Version, parse_version, unsolicited_updates_supported
from dracpu.core.commands import ClaimEnv
from dracpu.core.cpuset import CpuSet
from dracpu.core.effects import ContainerUpdate
from dracpu.errors import (
    CdiError,
    ClaimConflictError,
    ClaimError,
    DracpuError,
    InsufficientCpusError,
)
from dracpu.wire import nri
from dracpu.wire.ttrpc import Code

UID = "11111111-2222-4333-8444-555555555555"
OTHER = "66666666-7777-4888-9999-000000000000"


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("v0.12.1", Version(0, 12, 1)),
        ("0.12.1", Version(0, 12, 1)),
        ("v2.3.4", Version(2, 3, 4)),
        ("v2.4.0-beta.0", Version(2, 4, 0, release=False)),
        ("v0.12.1-0.20260720101010-abcdef123456", Version(0, 12, 1, release=False)),
        ("v2.3.1-5-gabc123", Version(2, 3, 1)),  # git describe: 5 commits after v2.3.1
        ("v2.3.1-5-gabc123.m", Version(2, 3, 1)),
        ("v0.12.2+incompatible", Version(0, 12, 2)),
        ("0.0.0-unknown", Version(0, 0, 0, release=False)),
        (" v1.2.3 ", Version(1, 2, 3)),
        ("(devel)", None),
        ("", None),
        ("v1.2", None),
        ("v01.2.3", None),
        ("latest", None),
    ],
)
def test_parse_version(text: str, version: Version | None) -> None:
    assert parse_version(text) == version


def test_prereleases_sort_before_their_release() -> None:
    pseudo = parse_version("v0.12.1-0.20260720101010-abcdef123456")
    assert pseudo is not None
    assert not pseudo.at_least((0, 12, 1))
    assert pseudo.at_least((0, 12, 0))
    after = parse_version("v0.12.3-0.20260901000000-abcdef123456")
    assert after is not None
    assert after.at_least((0, 12, 1))


@pytest.mark.parametrize(
    ("name", "version", "nri_version", "supported"),
    [
        # containerd 2.3.0-2.3.4 embed NRI v0.12.0: before containerd/nri#301.
        ("containerd", "v2.3.0", "v0.12.0", False),
        ("containerd", "v2.3.4", "v0.12.0", False),
        ("containerd", "v2.3.5", "v0.12.1", True),
        ("containerd", "2.4.0", "v0.12.2", True),
        ("containerd", "v2.4.0-beta.0", "v0.12.2", True),
        ("containerd", "v2.5.0-12-gdeadbee", "v0.13.0", True),
        ("containerd", "v2.3.5", "v0.12.1-0.20260710000000-0123456789ab", False),
        # Older runtimes do not report their NRI version (field added in NRI v0.12.0).
        ("containerd", "v1.7.30", "", False),
        ("containerd", "v2.1.4", "", False),
        # A containerd older than 2.3 claiming a fixed NRI is a custom build: not trusted.
        ("containerd", "v2.2.9", "v0.12.1", False),
        ("containerd", "devel", "v0.12.1", False),
        ("cri-o", "1.37.0", "v0.12.1", True),
        ("cri-o", "1.36.3", "v0.12.0", False),
        ("cri-o", "1.35.0", "", False),
        ("podman", "5.0.0", "v0.13.0", False),
        ("", "", "v0.13.0", False),
        ("containerd", "v2.4.0", "0.0.0-unknown", False),
        ("containerd", "v2.4.0", "(devel)", False),
    ],
)
def test_unsolicited_updates_gate(
    name: str, version: str, nri_version: str, supported: bool
) -> None:
    configure = nri.ConfigureRequest(
        runtime_name=name, runtime_version=version, nri_version=nri_version
    )
    assert unsolicited_updates_supported(configure) is supported


def test_container_command_reads_claims_from_env() -> None:
    pod = nri.Pod("sandbox-1", "web", "pod-uid", "prod")
    container = nri.Container(
        "ctr-1", "sandbox-1", "app", 1, ("PATH=/bin", f"DRA_CPUSET_{UID}=2-3,34-35")
    )
    command = messages.container_command(pod, container)
    assert command.id == "ctr-1"
    assert command.pod_uid == "pod-uid"
    assert command.pod_namespace == "prod"
    assert command.pod_name == "web"
    assert command.name == "app"
    assert command.claims == (ClaimEnv(UID, CpuSet.parse("2-3,34-35")),)
    assert command.env_error is None
    assert command.exclusive


def test_container_command_keeps_a_malformed_env_as_an_error() -> None:
    container = nri.Container("ctr-1", "s", "app", 0, (f"DRA_CPUSET_{UID}=garbage",))
    command = messages.container_command(nri.Pod(uid="u"), container)
    assert command.claims == ()
    assert command.env_error is not None
    assert UID in command.env_error


def test_container_command_without_pod() -> None:
    command = messages.container_command(None, nri.Container("ctr-1", name="app"))
    assert (command.pod_uid, command.pod_name, command.exclusive) == ("", "", False)


def test_synchronized_containers_take_their_pods_identity(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pods = [nri.Pod("s1", "web", "uid-1", "prod"), nri.Pod("s2", "db", "uid-2", "data")]
    containers = [
        nri.Container("c1", "s2", "pg", 3, (f"DRA_CPUSET_{OTHER}=4",)),
        nri.Container("c2", "s1", "nginx", 3, ()),
        nri.Container("c3", "gone", "orphan", 3, ()),
    ]
    with caplog.at_level(logging.WARNING, logger="dracpu.adapters.nri_messages"):
        result = messages.synchronized_containers(pods, containers)
    assert [(c.id, c.pod_uid, c.pod_namespace, c.pod_name) for c in result] == [
        ("c1", "uid-2", "data", "db"),
        ("c2", "uid-1", "prod", "web"),
        ("c3", "", "", ""),
    ]
    assert result[0].claims == (ClaimEnv(OTHER, CpuSet.parse("4")),)
    assert "pod sandbox gone" in caplog.text


def test_wire_updates_format_cpusets_and_refuse_empty_ones(
    caplog: pytest.LogCaptureFixture,
) -> None:
    updates = [
        ContainerUpdate("a", CpuSet.parse("1-31,33-63")),
        ContainerUpdate("b", CpuSet.parse("2-3"), CpuSet.parse("0")),
        ContainerUpdate("bad", CpuSet.parse("")),
        ContainerUpdate("c", CpuSet.parse("5"), CpuSet.parse("")),
    ]
    with caplog.at_level(logging.ERROR, logger="dracpu.adapters.nri_messages"):
        result = messages.wire_updates(updates)
    assert result == [
        nri.CpusetUpdate("a", "1-31,33-63"),
        nri.CpusetUpdate("b", "2-3", "0"),
        nri.CpusetUpdate("c", "5"),
    ]
    assert "empty cpuset for container bad" in caplog.text


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (ClaimError("spoofed"), Code.FAILED_PRECONDITION),
        (ClaimConflictError("shared claim"), Code.FAILED_PRECONDITION),
        (InsufficientCpusError("empty pool"), Code.FAILED_PRECONDITION),
        (CdiError("malformed env"), Code.FAILED_PRECONDITION),
        (DracpuError("the state owner did not answer"), Code.UNAVAILABLE),
    ],
)
def test_error_status_fails_the_operation(error: DracpuError, code: int) -> None:
    status, text = messages.error_status(error)
    assert status == code
    assert text == f"dra.cpu: {error}"


def test_describe_updates() -> None:
    updates = [nri.CpusetUpdate("a", "1-3"), nri.CpusetUpdate("b", "1-3")]
    assert messages.describe_updates(updates) == "2 containers -> 1-3"
    assert messages.describe_updates([]) == "0 containers -> nothing"
