from __future__ import annotations

import contextlib
import functools
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest

from dracpu.adapters.backoff import backoff_delays
from dracpu.adapters.cdi_files import (
    is_our_probe_file,
    probe_file_name,
    read_spec,
    temp_file_name,
    touch_probe,
    write_spec,
)
from dracpu.core.cdi_spec import ClaimSpec, spec_bytes, spec_file_name
from dracpu.core.cpuset import CpuSet
from dracpu.errors import CdiError
from dracpu.tasks import cdi_watcher
from dracpu.tasks.cdi_watcher import ReconcileReport, reconcile
from dracpu.tasks.http import ReadinessFlag
from tests.mounts import read_only_bind
from tests.tasks.both_backends import anyio_backend  # noqa: F401 (a fixture)

A = "8ec6fd12-bb08-4936-a857-866f50153c21"
B = "0b7e3a52-4c1f-4d7e-9a31-2f9a4c1d5e60"
C = "5d0c1b7e-6a2f-4e3b-8c9d-1a2b3c4d5e6f"


def specs(claims: dict[str, CpuSet]) -> dict[str, ClaimSpec]:
    """What the specs of claims holding these CPUs say (no shared pool)."""
    return {uid: ClaimSpec(cpus) for uid, cpus in claims.items()}


CPUS_A = CpuSet.parse("2-3")
CPUS_B = CpuSet.parse("8,10")

VENDOR = {
    "nvidia.com-gpu.yaml": b"---\ncdiVersion: 0.5.0\nkind: nvidia.com/gpu\n",
    "dra.cpu.json": b'{"cdiVersion":"0.8.0","kind":"dra.k8s.io/cpu","devices":[]}',
    "dra.k8s.io-cpu_claim-not-a-uid.json": b"{}",
    f"dra.k8s.io-cpu_claim-{A}.yaml": b"a .yaml is not ours",
    f".dra.k8s.io-cpu_claim-{A}.json.tmp-": b"not our temp pattern",
}


def _put_vendor_files(directory: Path) -> dict[str, tuple[bytes, int]]:
    directory.mkdir(parents=True, exist_ok=True)
    for name, data in VENDOR.items():
        (directory / name).write_bytes(data)
    return _vendor_state(directory)


def _vendor_state(directory: Path) -> dict[str, tuple[bytes, int]]:
    return {
        name: ((directory / name).read_bytes(), (directory / name).stat().st_mtime_ns)
        for name in VENDOR
    }


def _ours(directory: Path) -> set[str]:
    return {n for n in os.listdir(directory) if n.startswith("dra.k8s.io-cpu_claim-")} - set(VENDOR)


def _age(path: Path, seconds: float) -> None:
    then = time.time() - seconds
    os.utime(path, (then, then))


# --- reconcile (one synchronous pass) ----------------------------------------------------------


def test_reconcile_creates_repairs_removes_and_leaves_vendors_alone(tmp_path: Path) -> None:
    vendor = _put_vendor_files(tmp_path)
    (tmp_path / spec_file_name(A)).write_bytes(b'{"cdiVersion": "0.5.0"}')  # malformed
    write_spec(tmp_path, C, CpuSet.parse("1"))  # orphan
    stale_temp = temp_file_name(A)
    (tmp_path / stale_temp).write_bytes(b"partial")
    _age(tmp_path / stale_temp, 3600)
    young_temp = temp_file_name(B)  # may belong to a write in progress
    (tmp_path / young_temp).write_bytes(b"partial")
    stale_probe = probe_file_name()
    touch_probe(tmp_path, stale_probe)
    _age(tmp_path / stale_probe, 3600)

    report = reconcile(tmp_path, specs({A: CPUS_A, B: CPUS_B}))

    assert report == ReconcileReport(
        created=(B,),
        repaired=(A,),
        removed=(C,),
        removed_leftovers=tuple(sorted([stale_temp, stale_probe])),
    )
    assert report.changed
    assert (tmp_path / spec_file_name(A)).read_bytes() == spec_bytes(A, CPUS_A)
    assert (tmp_path / spec_file_name(B)).read_bytes() == spec_bytes(B, CPUS_B)
    assert _ours(tmp_path) == {spec_file_name(A), spec_file_name(B)}
    assert (tmp_path / young_temp).exists()
    assert _vendor_state(tmp_path) == vendor


def test_reconcile_is_idempotent(tmp_path: Path) -> None:
    desired = {A: CPUS_A, B: CPUS_B}
    reconcile(tmp_path, specs(desired))
    mtimes = {n: (tmp_path / n).stat().st_mtime_ns for n in os.listdir(tmp_path)}
    report = reconcile(tmp_path, specs(desired))
    assert report == ReconcileReport()
    assert not report.changed
    assert {n: (tmp_path / n).stat().st_mtime_ns for n in os.listdir(tmp_path)} == mtimes


def test_reconcile_writes_the_shared_pool_entry_of_a_shared_pool_claim(tmp_path: Path) -> None:
    write_spec(tmp_path, A, CPUS_A)  # as an earlier Prepare wrote it, without the pool
    report = reconcile(tmp_path, {A: ClaimSpec(CPUS_A, shared_pool=True)})
    assert report.repaired == (A,)
    assert (tmp_path / spec_file_name(A)).read_bytes() == spec_bytes(A, CPUS_A, shared_pool=True)
    assert not reconcile(tmp_path, {A: ClaimSpec(CPUS_A, shared_pool=True)}).changed


def test_reconcile_repairs_a_valid_spec_with_the_wrong_cpuset(tmp_path: Path) -> None:
    write_spec(tmp_path, A, CpuSet.parse("0-63"))
    assert reconcile(tmp_path, specs({A: CPUS_A})).repaired == (A,)
    assert read_spec(tmp_path, A) == CPUS_A


def test_reconcile_defers_young_orphans(tmp_path: Path) -> None:
    write_spec(tmp_path, B, CPUS_B)  # just written: maybe a claim being prepared
    write_spec(tmp_path, C, CPUS_B)
    _age(tmp_path / spec_file_name(C), 60)
    report = reconcile(tmp_path, {}, orphan_grace=5.0)
    assert report == ReconcileReport(removed=(C,), deferred=(B,))
    assert _ours(tmp_path) == {spec_file_name(B)}
    assert reconcile(tmp_path, {}).removed == (B,)  # no grace: at start-up


def test_reconcile_only_touches_the_named_claims(tmp_path: Path) -> None:
    write_spec(tmp_path, C, CPUS_A)  # orphan, not named
    report = reconcile(tmp_path, specs({A: CPUS_A, B: CPUS_B}), only={A})
    assert report == ReconcileReport(created=(A,))
    assert _ours(tmp_path) == {spec_file_name(A), spec_file_name(C)}


def test_reconcile_of_an_empty_state_removes_all_of_ours_only(tmp_path: Path) -> None:
    vendor = _put_vendor_files(tmp_path)
    write_spec(tmp_path, A, CPUS_A)
    write_spec(tmp_path, B, CPUS_B)
    assert reconcile(tmp_path, {}).removed == tuple(sorted((A, B)))
    assert _ours(tmp_path) == set()
    assert _vendor_state(tmp_path) == vendor


def test_reconcile_never_raises_for_a_bad_file(tmp_path: Path) -> None:
    (tmp_path / spec_file_name(A)).mkdir()  # desired, but a directory sits on its name
    (tmp_path / spec_file_name(C)).mkdir()  # orphan name, a directory
    os.mkfifo(tmp_path / spec_file_name(B))  # desired, a FIFO: replaced
    report = reconcile(tmp_path, specs({A: CPUS_A, B: CPUS_B, "bad/uid": CPUS_A, C + "x": CPUS_A}))
    assert report.repaired == (B,)
    assert read_spec(tmp_path, B) == CPUS_B
    assert len(report.errors) == 4
    joined = "\n".join(report.errors)
    assert spec_file_name(A) in joined
    assert spec_file_name(C) in joined
    assert "invalid claim UID 'bad/uid'" in joined


def test_reconcile_replaces_or_removes_symlinks_without_touching_targets(tmp_path: Path) -> None:
    target = tmp_path / "precious.json"
    target.write_bytes(b"keep me")
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    (cdi / spec_file_name(A)).symlink_to(target)
    (cdi / spec_file_name(B)).symlink_to(target)
    report = reconcile(cdi, specs({A: CPUS_A}))
    assert report == ReconcileReport(repaired=(A,), removed=(B,))
    assert target.read_bytes() == b"keep me"
    assert read_spec(cdi, A) == CPUS_A
    assert not (cdi / spec_file_name(B)).is_symlink()


def test_reconcile_creates_a_missing_dir_and_fails_on_a_file(tmp_path: Path) -> None:
    assert reconcile(tmp_path / "run" / "cdi", specs({A: CPUS_A})).created == (A,)
    (tmp_path / "file").write_bytes(b"")
    with pytest.raises(CdiError, match="cannot list CDI dir"):
        reconcile(tmp_path / "file", specs({A: CPUS_A}))


# --- the watcher task (real watchfiles on tmp_path) ------------------------------------------

# Short timings for tests; resync is long so that these tests prove the event path.
FAST: dict[str, float] = {"debounce_ms": 20, "step_ms": 5, "resync_interval": 30.0}


class Claims:
    """The desired-claims provider: what the state owner would hand out (``claims``: each
    claim's CPUs; no claim of these tests shares the pool)."""

    def __init__(self, claims: dict[str, CpuSet]) -> None:
        self.claims = dict(claims)
        self.calls = 0

    def __call__(self) -> dict[str, ClaimSpec]:
        self.calls += 1
        return specs(self.claims)


@contextlib.asynccontextmanager
async def watching(
    cdi: Path, claims: Claims, **options: object
) -> AsyncIterator[list[ReconcileReport]]:
    reports: list[ReconcileReport] = []
    settings = {**FAST, **options}
    async with anyio.create_task_group() as tg:
        await tg.start(
            functools.partial(cdi_watcher.run, cdi, claims, on_report=reports.append, **settings)  # type: ignore[arg-type]
        )
        yield reports
        tg.cancel_scope.cancel()


async def wait_until(condition: Callable[[], bool], within: float = 3.0) -> None:
    """Poll the file system until ``condition()`` holds (no event exists for it)."""
    with anyio.fail_after(within):
        while not condition():  # noqa: ASYNC110 - polling files, not waiting on a task
            await anyio.sleep(0.01)


def _spec_ok(cdi: Path, uid: str, cpus: CpuSet) -> Callable[[], bool]:
    def check() -> bool:
        try:
            return (cdi / spec_file_name(uid)).read_bytes() == spec_bytes(uid, cpus)
        except FileNotFoundError:
            return False

    return check


def _changed(reports: list[ReconcileReport]) -> list[ReconcileReport]:
    return [r for r in reports if r.changed]


@pytest.mark.anyio
async def test_start_reconciles_before_reporting_started(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    vendor = _put_vendor_files(cdi)
    write_spec(cdi, C, CPUS_A)  # orphan from before a restart
    async with watching(cdi, Claims({A: CPUS_A})) as reports:
        assert _ours(cdi) == {spec_file_name(A)}
        assert _changed(reports) == [ReconcileReport(created=(A,), removed=(C,))]
        assert not any(is_our_probe_file(n) for n in os.listdir(cdi))
    assert _vendor_state(cdi) == vendor


@pytest.mark.anyio
async def test_start_creates_the_dir(tmp_path: Path) -> None:
    cdi = tmp_path / "var" / "run" / "cdi"
    async with watching(cdi, Claims({A: CPUS_A})):
        assert _spec_ok(cdi, A, CPUS_A)()


@pytest.mark.anyio
async def test_deleted_spec_is_rewritten_once(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    async with watching(cdi, Claims({A: CPUS_A, B: CPUS_B})) as reports:
        before = len(reports)
        (cdi / spec_file_name(A)).unlink()
        await wait_until(_spec_ok(cdi, A, CPUS_A))
        # Our own rewrite produces events too: they must not cause another write.
        await anyio.sleep(0.3)
        assert _changed(reports[before:]) == [ReconcileReport(created=(A,))]
        assert _spec_ok(cdi, B, CPUS_B)()


@pytest.mark.anyio
async def test_edited_spec_is_restored(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    async with watching(cdi, Claims({A: CPUS_A})):
        path = cdi / spec_file_name(A)
        with path.open("r+b") as f:  # an in-place edit (Write events)
            f.write(b"garbage")
        await wait_until(_spec_ok(cdi, A, CPUS_A))
        # A valid spec granting other CPUs, moved in atomically (Rename events).
        forged = tmp_path / "forged"
        forged.write_bytes(spec_bytes(A, CpuSet.parse("0-63")))
        os.replace(forged, path)
        await wait_until(_spec_ok(cdi, A, CPUS_A))


@pytest.mark.anyio
async def test_orphan_spec_is_removed(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    async with watching(cdi, Claims({A: CPUS_A}), orphan_grace=0.0):
        write_spec(cdi, C, CPUS_B)
        await wait_until(lambda: not (cdi / spec_file_name(C)).exists())
        assert _spec_ok(cdi, A, CPUS_A)()


@pytest.mark.anyio
async def test_a_young_orphan_waits_for_a_later_pass(tmp_path: Path) -> None:
    # The state owner writes a spec before it commits the claim: a fresh orphan may be a claim
    # being prepared. Once it shows in desired(), it must survive.
    cdi = tmp_path / "cdi"
    claims = Claims({A: CPUS_A})
    async with watching(cdi, claims, orphan_grace=0.5, resync_interval=0.1) as reports:
        write_spec(cdi, B, CPUS_B)
        await wait_until(lambda: any(B in r.deferred for r in reports))
        claims.claims[B] = CPUS_B  # the owner commits the claim
        write_spec(cdi, C, CPUS_B)  # a real orphan
        await wait_until(lambda: not (cdi / spec_file_name(C)).exists())
        assert _spec_ok(cdi, B, CPUS_B)()
        assert not any(B in r.removed for r in reports)


@pytest.mark.anyio
async def test_vendor_specs_are_never_touched(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    async with watching(cdi, Claims({A: CPUS_A})) as reports:
        before = len(reports)
        vendor = _put_vendor_files(cdi)  # created while watching
        (cdi / "nvidia.com-gpu.yaml").write_bytes(b"edited by its owner")
        vendor["nvidia.com-gpu.yaml"] = (
            b"edited by its owner",
            (cdi / "nvidia.com-gpu.yaml").stat().st_mtime_ns,
        )
        (cdi / "dra.cpu.json").unlink()
        del vendor["dra.cpu.json"]
        await anyio.sleep(0.3)
        assert _changed(reports[before:]) == []
        for name, state in vendor.items():
            assert ((cdi / name).read_bytes(), (cdi / name).stat().st_mtime_ns) == state
        assert not (cdi / "dra.cpu.json").exists()


@pytest.mark.anyio
async def test_periodic_resync_writes_claims_that_appeared(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    claims = Claims({A: CPUS_A})
    async with watching(cdi, claims, resync_interval=0.2, orphan_grace=0.0):
        claims.claims[B] = CPUS_B  # no file event: only the resync can notice
        del claims.claims[A]
        await wait_until(_spec_ok(cdi, B, CPUS_B))
        await wait_until(lambda: not (cdi / spec_file_name(A)).exists())


@pytest.mark.anyio
async def test_dir_removed_and_recreated(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    async with watching(cdi, Claims({A: CPUS_A})):
        shutil.rmtree(cdi)
        await wait_until(_spec_ok(cdi, A, CPUS_A))
        # The new dir is watched again.
        (cdi / spec_file_name(A)).unlink()
        await wait_until(_spec_ok(cdi, A, CPUS_A))


@pytest.mark.anyio
async def test_polling_mode(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    async with watching(cdi, Claims({A: CPUS_A}), force_polling=True):
        (cdi / spec_file_name(A)).unlink()
        await wait_until(_spec_ok(cdi, A, CPUS_A))


# --- a dir that cannot be used ------------------------------------------------------------------

RETRY = functools.partial(backoff_delays, initial=0.05, cap=0.2, jitter=0.0)


@contextlib.asynccontextmanager
async def watching_with_health(
    cdi: Path, claims: Claims, **options: object
) -> AsyncIterator[ReadinessFlag]:
    """The watcher with its readiness flag; started() must come whatever the dir's state."""
    flag = ReadinessFlag("cdi-dir")
    settings = {**FAST, "retry_delays": RETRY, **options}
    async with anyio.create_task_group() as tg:
        with anyio.fail_after(10):
            await tg.start(
                functools.partial(cdi_watcher.run, cdi, claims, health=flag, **settings)  # type: ignore[arg-type]
            )
        yield flag
        tg.cancel_scope.cancel()


async def until_flag(flag: ReadinessFlag, ready: bool, within: float = 5.0) -> None:
    await wait_until(lambda: flag.ready is ready, within)


@pytest.mark.anyio
async def test_a_file_where_the_dir_should_be_is_waited_out(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=cdi_watcher.__name__)
    cdi = tmp_path / "cdi"
    cdi.write_bytes(b"")
    async with watching_with_health(cdi, Claims({A: CPUS_A})) as flag:
        assert (flag.ready, flag.reason) == (
            False,
            f"CDI dir {str(cdi)!r} exists and is not a directory",
        )
        await anyio.sleep(0.5)  # several tries: still alive, still saying so once
        cdi.unlink()  # the administrator removes the file
        await until_flag(flag, True)
        assert _spec_ok(cdi, A, CPUS_A)()
    lines = [
        (r.levelname, r.getMessage())
        for r in caplog.records
        if r.levelno >= logging.INFO and r.name == cdi_watcher.__name__
    ]
    assert lines[0] == (
        "ERROR",
        f"using CDI dir {cdi} failed, retrying in 0.1 s: CDI dir {str(cdi)!r} exists and is not a "
        "directory; Prepare fails until then",
    )
    assert lines[2][1].startswith(f"using CDI dir {cdi} works again after ")
    assert len(lines) == 3
    assert lines[1] == (
        "INFO",
        f"CDI specs reconciled: created ['{A}'], repaired [], removed orphans []",
    )


@pytest.mark.anyio
async def test_a_read_only_dir_at_start_is_waited_out(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    write_spec(cdi, C, CPUS_B)  # an orphan, left for when the dir is writable
    with read_only_bind(cdi) as mount:
        async with watching_with_health(cdi, Claims({A: CPUS_A}), orphan_grace=0.0) as flag:
            assert (flag.ready, flag.reason) == (
                False,
                f"cannot create files in CDI dir {str(cdi)!r}: Read-only file system",
            )
            with pytest.raises(CdiError, match="Read-only file system"):
                write_spec(cdi, A, CPUS_A)  # what a Prepare meets meanwhile
            mount.set_read_only(False)
            await until_flag(flag, True)
            assert _ours(cdi) == {spec_file_name(A)}
            assert _spec_ok(cdi, A, CPUS_A)()
            assert os.listdir(cdi) == [spec_file_name(A)]  # no probe, no temp file left


@pytest.mark.anyio
async def test_a_missing_dir_under_a_read_only_parent_is_waited_out(tmp_path: Path) -> None:
    parent = tmp_path / "run"
    parent.mkdir()
    cdi = parent / "cdi"
    with read_only_bind(parent) as mount:
        async with watching_with_health(cdi, Claims({A: CPUS_A})) as flag:
            assert (flag.ready, flag.reason) == (
                False,
                f"cannot create CDI dir {str(cdi)!r}: Read-only file system",
            )
            mount.set_read_only(False)
            await until_flag(flag, True)
            assert _spec_ok(cdi, A, CPUS_A)()


@pytest.mark.anyio
async def test_a_dir_turning_read_only_while_watched_is_noticed_and_waited_out(
    tmp_path: Path,
) -> None:
    cdi = tmp_path / "cdi"
    cdi.mkdir()
    claims = Claims({A: CPUS_A})
    with read_only_bind(cdi, read_only=False) as mount:
        async with watching_with_health(cdi, claims, resync_interval=0.2) as flag:
            assert flag.ready
            mount.set_read_only(True)  # a full pass sees it (statvfs): no write needed
            await until_flag(flag, False)
            assert flag.reason == f"CDI dir {str(cdi)!r} is on a read-only file system"
            claims.claims[B] = CPUS_B  # prepared meanwhile: written once the dir can be
            mount.set_read_only(False)
            await until_flag(flag, True)
            assert _spec_ok(cdi, B, CPUS_B)()


@pytest.mark.anyio
async def test_a_watch_that_never_reports_is_waited_out(tmp_path: Path) -> None:
    # A probe timeout far too short for any watch: inotify "fails", polling "fails" too.
    async with watching_with_health(tmp_path / "cdi", Claims({}), probe_timeout=1e-6) as flag:
        assert not flag.ready
        assert flag.reason.startswith(f"the watch of CDI dir {str(tmp_path / 'cdi')!r} reported ")
        await anyio.sleep(0.3)  # tries again, alive
    assert not any(is_our_probe_file(n) for n in os.listdir(tmp_path / "cdi"))


@pytest.mark.anyio
async def test_cancellation_is_prompt(tmp_path: Path) -> None:
    cdi = tmp_path / "cdi"
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            await tg.start(functools.partial(cdi_watcher.run, cdi, Claims({}), resync_interval=60))
            started = time.monotonic()
            tg.cancel_scope.cancel()
    # The watch thread waits up to resync_interval for events; the stop event must end it.
    assert time.monotonic() - started < 1.0


@pytest.mark.anyio
async def test_a_bad_file_is_reported_once_and_the_watch_goes_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cdi = tmp_path / "cdi"
    reports: list[ReconcileReport] = []
    claims = Claims({A: CPUS_A})
    async with watching_with_health(
        cdi, claims, on_report=reports.append, resync_interval=0.1
    ) as flag:
        path = cdi / spec_file_name(A)
        path.unlink()
        path.mkdir()  # a directory squats on the name: cannot be replaced
        await wait_until(lambda: len([r for r in reports if r.errors]) >= 3)
        assert flag.ready  # one file's problem, not the dir's: files can be created
        path.rmdir()
        await wait_until(_spec_ok(cdi, A, CPUS_A))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1
    assert errors[0].startswith(f"CDI reconcile: cannot write CDI spec {str(path)!r}: ")
