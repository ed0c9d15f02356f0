"""The two publication settings of ``dracpu run``: ``--expose-pcie-roots`` and
``publishNodeAllocatableResourceMapping`` (upstream ``internal/driverconfig``)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import pytest

from dracpu.config import Config, load_config
from dracpu.config.go_flags import add_run_arguments
from dracpu.errors import ConfigError

NODE = ["--node-name", "node-a"]


def load(argv: Sequence[str]) -> Config:
    parser = argparse.ArgumentParser(prog="dracpu run")
    add_run_arguments(parser)
    return load_config(parser.parse_args([*NODE, *argv]), {})


def config_file(tmp_path: Path, text: str) -> list[str]:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return ["--config", str(path)]


def test_both_are_off_by_default() -> None:
    config = load([])
    assert config.expose_pcie_roots is False
    assert config.publish_node_allocatable_resource_mapping is False


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--expose-pcie-roots"], True),
        (["--expose-pcie-roots=true"], True),
        (["--expose-pcie-roots=false"], False),
        (["--expose-pcie-roots=1"], True),  # Go's strconv.ParseBool, as upstream's flag
        (["--expose-pcie-roots=F"], False),
        (["--expose-pcie-roots", "--expose-pcie-roots=false"], False),  # the last one wins
    ],
)
def test_expose_pcie_roots_is_a_go_style_boolean_flag(argv: list[str], expected: bool) -> None:
    assert load(argv).expose_pcie_roots is expected


@pytest.mark.parametrize("value", ["false", "true"])
def test_expose_pcie_roots_is_refused_in_the_file(tmp_path: Path, value: str) -> None:
    # Upstream takes it only as a flag (its chart passes args.exposePCIeRoots as the flag, and
    # internal/driverconfig refuses the key in the file whatever its value).
    with pytest.raises(ConfigError, match="use --expose-pcie-roots"):
        load(config_file(tmp_path, f"exposePCIeRoots: {value}\n"))


@pytest.mark.parametrize(("text", "expected"), [("true", True), ("false", False), ("null", False)])
def test_publish_node_allocatable_resource_mapping_is_a_file_key(
    tmp_path: Path, text: str, expected: bool
) -> None:
    argv = config_file(tmp_path, f"publishNodeAllocatableResourceMapping: {text}\n")
    assert load(argv).publish_node_allocatable_resource_mapping is expected


def test_publish_node_allocatable_resource_mapping_has_no_flag() -> None:
    # Upstream has no flag for it (internal/driverconfig/flags.go): neither do we.
    parser = argparse.ArgumentParser(prog="dracpu run", exit_on_error=False)
    add_run_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args([*NODE, "--publish-node-allocatable-resource-mapping"])


def test_publish_node_allocatable_resource_mapping_refuses_non_booleans(tmp_path: Path) -> None:
    argv = config_file(tmp_path, "publishNodeAllocatableResourceMapping: 1\n")
    with pytest.raises(ConfigError, match="must be true or false, not a number"):
        load(argv)
