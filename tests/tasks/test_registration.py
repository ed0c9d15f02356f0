"""The registration socket, driven by a grpcio kubelet (Google protobuf, literal method paths).

Checks the exact ``GetInfo`` answer the kubelet validates, that it is answered quickly any number
of times, that ``NotifyRegistrationStatus`` drives ``/readyz`` through the real
:class:`~dracpu.tasks.http.Readiness`, and the socket-file rules (docs/architecture.md, "DRA
socket").
"""

from __future__ import annotations

import logging
import os
import socket
import stat
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import grpc
import pytest

from dracpu._gen.pluginregistration import v1 as gen_reg
from dracpu.errors import DracpuError
from dracpu.tasks import registration
from dracpu.tasks.http import Readiness, ReadinessFlag
from dracpu.tasks.registration import RegistrationState
from tests.peers import load_pb2, unix_target

__all__ = ["ADVERTISED"]

pytestmark = pytest.mark.anyio

G_REG = load_pb2("pluginregistration/v1/api.proto")
GET_INFO = "/pluginregistration.Registration/GetInfo"
NOTIFY = "/pluginregistration.Registration/NotifyRegistrationStatus"
# What GetInfo must advertise, written out: the DRAPlugin versions first (a 1.34 kubelet takes
# the first of OUR entries it knows), then the device-health services.
ADVERTISED = (
    "v1.DRAPlugin",
    "v1beta1.DRAPlugin",
    "v1.DRAResourceHealth",
    "v1alpha1.DRAResourceHealth",
)
TASK = "registration"


def _sockets(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "kubelet"
    return root / "plugins_registry" / "dra.cpu-reg.sock", root / "plugins" / "dra.cpu" / "dra.sock"


@asynccontextmanager
async def serving(
    reg_socket: Path, endpoint: Path, readiness: Readiness
) -> AsyncIterator[RegistrationState]:
    flag = readiness.flag(TASK)
    async with anyio.create_task_group() as tg:
        state = await tg.start(partial(registration.run, reg_socket, endpoint, flag))
        flag.set_ready()  # what the supervisor does once the task has started
        yield state
        tg.cancel_scope.cancel()


def _get_info(path: Path, calls: int = 1) -> list[tuple[Any, float]]:
    """``calls`` GetInfo calls, each with the kubelet's 1 s deadline: (answer, seconds)."""
    answers = []
    with grpc.insecure_channel(unix_target(path)) as channel:
        get_info = channel.unary_unary(
            GET_INFO,
            request_serializer=G_REG.InfoRequest.SerializeToString,
            response_deserializer=G_REG.PluginInfo.FromString,
        )
        for _ in range(calls):
            start = time.perf_counter()
            info = get_info(G_REG.InfoRequest(), timeout=1.0)
            answers.append((info, time.perf_counter() - start))
    return answers


def _notify(path: Path, registered: bool, error: str = "") -> None:
    with grpc.insecure_channel(unix_target(path)) as channel:
        notify = channel.unary_unary(
            NOTIFY,
            request_serializer=G_REG.RegistrationStatus.SerializeToString,
            response_deserializer=G_REG.RegistrationStatusResponse.FromString,
        )
        notify(G_REG.RegistrationStatus(plugin_registered=registered, error=error), timeout=5.0)


async def test_get_info_answers_exactly_what_the_kubelet_validates(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)
    async with serving(reg_socket, endpoint, Readiness()):
        [(info, _)] = await anyio.to_thread.run_sync(_get_info, reg_socket)

    assert info.type == "DRAPlugin"
    assert info.name == "dra.cpu"
    assert info.endpoint == str(endpoint)
    assert list(info.supported_versions) == list(ADVERTISED)
    # and nothing else on the wire: exactly these four fields
    assert G_REG.PluginInfo.FromString(info.SerializeToString()) == G_REG.PluginInfo(
        type="DRAPlugin",
        name="dra.cpu",
        endpoint=str(endpoint),
        supported_versions=list(ADVERTISED),
    )


async def test_get_info_is_fast_and_repeatable(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)
    async with serving(reg_socket, endpoint, Readiness()):
        answers = await anyio.to_thread.run_sync(_get_info, reg_socket, 50)
        again = await anyio.to_thread.run_sync(_get_info, reg_socket, 1)  # a new connection

    first = answers[0][0]
    assert all(info == first for info, _ in answers + again)
    # every call beat the kubelet's 1 s deadline (it would have raised otherwise); typical
    # calls take a few milliseconds even on the shared test machine
    assert sorted(t for _, t in answers)[len(answers) // 2] < 0.25


async def test_refused_registration_fails_readyz_and_success_restores_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="dracpu")
    reg_socket, endpoint = _sockets(tmp_path)
    readiness = Readiness()
    async with serving(reg_socket, endpoint, readiness) as state:
        assert readiness.is_ready()

        await anyio.to_thread.run_sync(
            _notify, reg_socket, False, "none of services supported by the plugin"
        )
        assert state.notifications == 1
        assert (state.registered, state.error) == (
            False,
            "none of services supported by the plugin",
        )
        assert not readiness.is_ready()
        assert (
            "[-]registration not ready: kubelet registration failed: none of services supported "
            "by the plugin" in readiness.report()
        )
        assert "readyz check failed" in readiness.report()
        errors = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert [r.getMessage() for r in errors] == [
            "the kubelet refused to register DRA driver dra.cpu: none of services supported by "
            "the plugin"
        ]

        await anyio.to_thread.run_sync(_notify, reg_socket, True)
        assert (state.registered, state.error, state.notifications) == (True, "", 2)
        assert readiness.is_ready()
        assert "readyz check passed" in readiness.report()
        assert "registered with the kubelet as DRA driver dra.cpu" in caplog.text


async def test_refusal_without_a_message_still_says_why(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)
    flag = ReadinessFlag(TASK)
    flag.set_ready()
    async with anyio.create_task_group() as tg:
        await tg.start(partial(registration.run, reg_socket, endpoint, flag))
        await anyio.to_thread.run_sync(_notify, reg_socket, False, "")
        tg.cancel_scope.cancel()
    assert not flag.ready
    assert flag.reason == "kubelet registration failed: no reason given"


async def test_wait_notified(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)
    async with serving(reg_socket, endpoint, Readiness()) as state:
        async with anyio.create_task_group() as tg:

            async def kubelet() -> None:
                await anyio.to_thread.run_sync(_notify, reg_socket, True)

            tg.start_soon(kubelet)
            with anyio.fail_after(10):
                await state.wait_notified(1)
        assert state.registered


# --- the socket file ----------------------------------------------------------------------------


async def test_socket_is_0600_dir_created_0700_removed_on_exit(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)
    async with serving(reg_socket, endpoint, Readiness()):
        info = reg_socket.lstat()
        assert stat.S_ISSOCK(info.st_mode)
        assert stat.S_IMODE(info.st_mode) == 0o600
        assert stat.S_IMODE(reg_socket.parent.stat().st_mode) == 0o700
        assert stat.S_IMODE(reg_socket.parent.parent.stat().st_mode) == 0o700
        assert [p.name for p in reg_socket.parent.iterdir()] == ["dra.cpu-reg.sock"]
    assert not reg_socket.exists()
    assert list(reg_socket.parent.iterdir()) == []


async def test_shared_registry_dir_keeps_its_mode(tmp_path: Path) -> None:
    # plugins_registry belongs to the kubelet and is shared with other plugins: never changed
    reg_socket, endpoint = _sockets(tmp_path)
    reg_socket.parent.mkdir(parents=True)
    reg_socket.parent.chmod(0o750)
    other = reg_socket.parent / "csi.example.com-reg.sock"
    other.write_text("")  # another plugin's file stays untouched
    async with serving(reg_socket, endpoint, Readiness()):
        assert stat.S_IMODE(reg_socket.stat().st_mode) == 0o600
        assert stat.S_IMODE(reg_socket.parent.stat().st_mode) == 0o750
    assert sorted(p.name for p in reg_socket.parent.iterdir()) == ["csi.example.com-reg.sock"]


async def test_stale_socket_is_replaced(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)
    reg_socket.parent.mkdir(parents=True)
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(reg_socket))
    stale.close()
    before = reg_socket.lstat().st_ino
    async with serving(reg_socket, endpoint, Readiness()):
        assert reg_socket.lstat().st_ino != before
        [(info, _)] = await anyio.to_thread.run_sync(_get_info, reg_socket)
        assert info.name == "dra.cpu"
    assert not reg_socket.exists()


async def test_socket_replaced_by_another_process_is_left_alone(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)
    async with serving(reg_socket, endpoint, Readiness()):
        reg_socket.unlink()
        newer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        newer.bind(str(reg_socket))  # a newer instance took the path over
    try:
        assert stat.S_ISSOCK(reg_socket.lstat().st_mode)
    finally:
        newer.close()


@pytest.mark.parametrize(
    "leave",
    [
        pytest.param(lambda p: p.write_text("x"), id="regular file"),
        pytest.param(lambda p: p.symlink_to(p.parent / "gone.sock"), id="dangling symlink"),
        pytest.param(lambda p: p.symlink_to(p.parent / "other"), id="symlink to a file"),
    ],
)
async def test_whatever_an_earlier_run_left_is_replaced(tmp_path: Path, leave: Any) -> None:
    """The kubelet's plugin guide: delete old sockets and listen anew. A symlink is removed, never
    followed: the file it points to stays."""
    reg_socket, endpoint = _sockets(tmp_path)
    reg_socket.parent.mkdir(parents=True)
    other = reg_socket.parent / "other"
    other.write_text("someone else's")
    leave(reg_socket)
    async with serving(reg_socket, endpoint, Readiness()):
        assert stat.S_ISSOCK(reg_socket.lstat().st_mode)
        [(info, _)] = await anyio.to_thread.run_sync(_get_info, reg_socket)
        assert info.name == "dra.cpu"
    assert not reg_socket.exists()
    assert other.read_text() == "someone else's"


async def test_start_refuses_a_directory_in_the_way_naming_it(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)
    reg_socket.mkdir(parents=True)
    (reg_socket / "inside").write_text("kept")
    async with anyio.create_task_group() as tg:
        with pytest.raises(DracpuError, match=f"{reg_socket}.* is a directory"):
            await tg.start(partial(registration.run, reg_socket, endpoint, None))
    assert (reg_socket / "inside").read_text() == "kept"
    assert [p.name for p in reg_socket.parent.iterdir()] == ["dra.cpu-reg.sock"]  # no temp left


async def test_start_refuses_a_path_too_long_for_a_unix_socket(tmp_path: Path) -> None:
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "dra.cpu-reg.sock"
    assert len(os.fsencode(deep)) > 107
    async with anyio.create_task_group() as tg:
        with pytest.raises(DracpuError, match="unix sockets allow at most 107"):
            await tg.start(partial(registration.run, deep, deep, None))
    assert not deep.parent.exists()


def test_method_paths_and_types_are_the_generated_service_s() -> None:
    registrar = registration.Registrar(registration.PluginInfo(name="dra.cpu", endpoint="/x"))
    ours = registrar.__mapping__()
    generated = gen_reg.RegistrationBase().__mapping__()
    assert {path: h[1:] for path, h in ours.items()} == {
        path: h[1:] for path, h in generated.items()
    }
    assert {GET_INFO, NOTIFY} == set(ours)


async def test_a_call_without_a_request_message_is_invalid_argument(tmp_path: Path) -> None:
    reg_socket, endpoint = _sockets(tmp_path)

    def empty_stream() -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(unix_target(reg_socket)) as channel:
            # A client-streaming call that sends nothing: the request stream ends at once.
            call = channel.stream_unary(GET_INFO)
            with pytest.raises(grpc.RpcError) as info:
                call(iter(()), timeout=5.0)
            return info.value.code(), info.value.details()

    async with serving(reg_socket, endpoint, Readiness()):
        code, details = await anyio.to_thread.run_sync(empty_stream)
        [(info, _)] = await anyio.to_thread.run_sync(_get_info, reg_socket)

    assert (code, details) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "the call carries no request message",
    )
    assert info.name == "dra.cpu"


@pytest.mark.parametrize(
    ("data", "registered", "error"),
    [
        (bytes.fromhex("0801 1202 6f6b"), True, "ok"),
        # betterproto2 keeps plugin_registered sent as a string as ["..."] (truthy): not true
        (bytes.fromhex("0a0179"), False, ""),
        # error sent as a varint: betterproto2 keeps the int; no message
        (bytes.fromhex("0800 1005"), False, ""),
    ],
)
async def test_notify_reads_only_well_typed_fields(
    tmp_path: Path, data: bytes, registered: bool, error: str
) -> None:
    reg_socket, endpoint = _sockets(tmp_path)

    def notify_raw() -> bytes:
        with grpc.insecure_channel(unix_target(reg_socket)) as channel:
            reply: bytes = channel.unary_unary(NOTIFY)(data, timeout=5.0)
            return reply

    async with serving(reg_socket, endpoint, Readiness()) as state:
        reply = await anyio.to_thread.run_sync(notify_raw)
        assert (state.registered, state.error, state.notifications) == (registered, error, 1)
    assert reply == b""


async def test_undecodable_notify_is_invalid_argument_and_serving_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reg_socket, endpoint = _sockets(tmp_path)

    def notify_raw(data: bytes) -> tuple[grpc.StatusCode, str]:
        with grpc.insecure_channel(unix_target(reg_socket)) as channel:
            with pytest.raises(grpc.RpcError) as info:
                channel.unary_unary(NOTIFY)(data, timeout=5.0)
            return info.value.code(), info.value.details()

    async with serving(reg_socket, endpoint, Readiness()) as state:
        cut = await anyio.to_thread.run_sync(notify_raw, b"\x08\xff")  # a varint cut short
        bad_text = await anyio.to_thread.run_sync(notify_raw, b"\x12\x02\xff\xfe")  # not UTF-8
        [(info, _)] = await anyio.to_thread.run_sync(_get_info, reg_socket)
        assert state.notifications == 0

    for code, details in (cut, bad_text):
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert details.startswith("cannot decode RegistrationStatus: "), details
    assert info.name == "dra.cpu"
    refused = [r for r in caplog.records if "cannot decode RegistrationStatus" in r.getMessage()]
    assert [r.levelname for r in refused] == ["WARNING", "WARNING"]
