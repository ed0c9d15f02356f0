"""``dracpu`` invoked as upstream's binary: flags alone run the driver, the gatherinfo alias,
Go-style flags, one-line errors, the start-up warnings."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dracpu import cli


def _dracpu(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dracpu", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=cwd,
    )


@pytest.mark.parametrize(
    ("argv", "prog", "expected"),
    [
        ([], "/dracpu", ["run"]),
        (["--v=4", "--bind-address=:8080"], "/dracpu", ["run", "--v=4", "--bind-address=:8080"]),
        (["-kubeconfig", "/k"], "dracpu", ["run", "-kubeconfig", "/k"]),
        (["run", "-v"], "dracpu", ["run", "-v"]),
        (["inspect", "-o", "json"], "dracpu", ["inspect", "-o", "json"]),
        (["--stdout"], "/dracpu-gatherinfo", ["gatherinfo", "--stdout"]),
        ([], "/usr/local/bin/dracpu-gatherinfo", ["gatherinfo"]),
        (["--help"], "dracpu", ["--help"]),
        (["--version"], "dracpu", ["--version"]),
    ],
)
def test_the_implied_subcommand(argv: list[str], prog: str, expected: list[str]) -> None:
    assert cli._driver_argv(argv, prog) == expected


def test_the_alias_runs_gatherinfo(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, object] = {}

    def gather(**options: object) -> int:
        seen.update(options)
        return 0

    monkeypatch.setattr("dracpu.diagnostics.gatherinfo.gather", gather)
    assert cli.main(["--stdout", "--pid", "7"], prog="/dracpu-gatherinfo") == 0
    assert seen == {"output_dir": None, "stdout": True, "pid": 7}


def test_gatherinfo_refuses_stdout_with_output_dir(tmp_path: Path) -> None:
    result = _dracpu("gatherinfo", "--stdout", "--output-dir", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1
    assert "not allowed with argument" in result.stderr


def test_root_flags_cannot_be_combined_with_a_subcommand(tmp_path: Path) -> None:
    result = _dracpu("--v=4", "gatherinfo", "--stdout", cwd=tmp_path)
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == "dracpu: error: root flags cannot be combined with subcommands\n"


def test_a_bad_root_flag_value_is_one_line_and_exit_2(tmp_path: Path) -> None:
    result = _dracpu("-v=4", "-cpu-device-mode=bogus", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (
        'dracpu run: error: --cpu-device-mode: invalid value "bogus": must be one of '
        '"grouped", "individual"\n'
    )


def test_an_unknown_flag_is_refused(tmp_path: Path) -> None:
    result = _dracpu("--v=4", "--no-such-flag=1", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr == "dracpu: error: unrecognized arguments: --no-such-flag=1\n"


def test_go_help_lists_the_drivers_flags(tmp_path: Path) -> None:
    result = _dracpu("-help", cwd=tmp_path)
    assert result.returncode == 0
    for flag in ("--kubelet-root-dir", "--expose-pcie-roots", "--vmodule", "--config"):
        assert flag in result.stdout


def test_start_up_warnings_are_logged_once_before_the_daemon_starts(tmp_path: Path) -> None:
    # A kubeconfig that is no kubeconfig ends the start right after the warnings (exit 1).
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("{}\n")
    result = _dracpu(
        "--cpu-device-mode=grouped",
        "--reserved-cpus=0",
        "-vmodule=nri_hooks=6,nri_plugin=4",
        f"-kubeconfig={kubeconfig}",
        "--node-name=n",
        f"--state-dir={tmp_path / 'state'}",
        "--bind-address=127.0.0.1:0",
        cwd=tmp_path,
    )
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    deprecated = [line for line in lines if "is deprecated (as upstream)" in line]
    assert [line.split("flag ", 1)[1].split(" ")[0] for line in deprecated] == [
        "--cpu-device-mode",
        "--reserved-cpus",
    ]
    vmodule = [line for line in lines if "-vmodule:" in line]
    assert len(vmodule) == 1
    assert "nri_hooks match no module of dracpu" in vmodule[0]
    assert "cannot load the kubeconfig" in result.stderr


def test_the_simulator_missing_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "dracpu.sim.demo", None)  # as in the image
    assert cli.main(["sim"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dracpu sim: error: the simulator is not installed here")
    assert err.count("\n") == 1
