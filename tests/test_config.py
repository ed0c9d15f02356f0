from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from dracpu.config import UNIX_PATH_MAX, Config, load_config
from dracpu.config.go_flags import DEPRECATED_FLAGS, add_run_arguments, go_style_flags
from dracpu.config.values import BindAddress
from dracpu.core.cpuset import CpuSet
from dracpu.core.devices import CpuDeviceMode, GroupBy
from dracpu.errors import ConfigError

NO_ENV: Mapping[str, str] = {}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dracpu run")
    add_run_arguments(parser)
    return parser


def _load(argv: Sequence[str], env: Mapping[str, str] = NO_ENV) -> Config:
    return load_config(_parser().parse_args(list(argv)), env)


def _file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


def _error(argv: Sequence[str], env: Mapping[str, str] = NO_ENV) -> str:
    with pytest.raises(ConfigError) as info:
        _load(argv, env)
    message = str(info.value)
    assert "\n" not in message
    return message


# --- defaults and derived paths -----------------------------------------------------------------


def test_defaults_are_the_documented_ones() -> None:
    config = _load(["--node-name", "node-a"])
    assert config == Config(node_name="node-a")
    assert config.kubeconfig is None
    assert config.cpu_device_mode is CpuDeviceMode.GROUPED
    assert config.group_by is GroupBy.NUMANODE
    assert config.reserved_cpus == CpuSet()
    assert config.kubelet_root_dir == Path("/var/lib/kubelet")
    assert config.cdi_dir == Path("/var/run/cdi")
    assert config.nri_socket == Path("/var/run/nri/nri.sock")
    assert config.state_dir == Path("/var/lib/dracpu")
    assert config.host_root == Path("/")
    assert config.bind_address == BindAddress("", 8080)
    assert (config.log_format, config.verbosity, config.memory_pinning) == ("text", 0, False)
    assert (config.nri_plugin_name, config.nri_plugin_index) == ("dra.cpu", "00")
    assert (config.podresources_interval, config.orphan_grace) == (60.0, 300.0)


def test_derived_paths() -> None:
    config = _load(["--node-name", "n", "--kubelet-root-dir", "/k/", "--state-dir", "/s"])
    assert config.registration_socket == Path("/k/plugins_registry/dra.cpu-reg.sock")
    assert config.dra_socket == Path("/k/plugins/dra.cpu/dra.sock")
    assert config.pod_resources_socket == Path("/k/pod-resources/kubelet.sock")
    assert config.checkpoint_path == Path("/s/checkpoint.json")


def test_every_flag() -> None:
    config = _load(
        [
            "--hostname-override=node-b",
            "--kubeconfig=/etc/kube.conf",
            "--cpu-device-mode=individual",
            "--group-by=socket",
            "--reserved-cpus=0-1,8",
            "--kubelet-root-dir=/k",
            "--cdi-dir=/cdi",
            "--nri-socket=/nri/nri.sock",
            "--state-dir=/state",
            "--host-root=/host",
            "--bind-address=127.0.0.1:9000",
            "--log-format=json",
            "--v=4",
            "--memory-pinning",
            "--nri-plugin-name=cpu",
            "--nri-plugin-index=10",
        ]
    )
    assert config == Config(
        node_name="node-b",
        kubeconfig=Path("/etc/kube.conf"),
        cpu_device_mode=CpuDeviceMode.INDIVIDUAL,
        group_by=GroupBy.SOCKET,
        reserved_cpus=CpuSet.parse("0-1,8"),
        kubelet_root_dir=Path("/k"),
        cdi_dir=Path("/cdi"),
        nri_socket=Path("/nri/nri.sock"),
        state_dir=Path("/state"),
        host_root=Path("/host"),
        bind_address=BindAddress("127.0.0.1", 9000),
        log_format="json",
        verbosity=4,
        memory_pinning=True,
        nri_plugin_name="cpu",
        nri_plugin_index="10",
    )


@pytest.mark.parametrize(
    ("argv", "verbosity"),
    [
        (["-v=4"], 4),
        (["--v=4"], 4),
        (["-v", "4"], 4),
        (["--v", "2"], 2),
        (["-v4"], 4),
        (["-v"], 1),
        (["-vvv"], 3),
        (["-v", "-v"], 2),
        (["-v=0"], 0),
    ],
)
def test_verbosity_flag_forms(argv: list[str], verbosity: int) -> None:
    assert _load(["--node-name", "n", *argv]).verbosity == verbosity


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        (["--memory-pinning"], True),
        (["--memory-pinning=true"], True),
        (["--memory-pinning=false"], False),
        (["--memory-pinning=0"], False),
        (["--memory-pinning", "True"], True),
    ],
)
def test_memory_pinning_takes_go_booleans(argv: list[str], value: bool) -> None:
    assert _load(["--node-name", "n", *argv]).memory_pinning is value


@pytest.mark.parametrize("argv", [["-v=x"], ["-v", "-1"], ["--memory-pinning=yes"]])
def test_malformed_flag_syntax_is_refused_by_the_parser(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["--node-name", "n", *argv])
    assert info.value.code == 2


# --- precedence ---------------------------------------------------------------------------------


def test_file_overrides_defaults_and_explicit_flags_override_the_file(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        "cpuDeviceMode: individual\ngroupBy: socket\nreservedCPUs: '0-3'\nstateDir: /from-file\n",
    )
    config = _load(["--config", path, "--node-name", "n", "--group-by", "machine"])
    assert config.cpu_device_mode is CpuDeviceMode.INDIVIDUAL  # file over default
    assert config.group_by is GroupBy.MACHINE  # flag over file
    assert config.reserved_cpus == CpuSet.parse("0-3")
    assert config.state_dir == Path("/from-file")
    assert config.cdi_dir == Path("/var/run/cdi")  # neither: default


def test_a_flag_left_out_does_not_override_the_file(tmp_path: Path) -> None:
    # argparse defaults are SUPPRESS: a flag not given must not reset the file's value.
    path = _file(tmp_path, "memoryPinning: true\nverbosity: 3\nlogFormat: json\n")
    config = _load(["--config", path, "--node-name", "n"])
    assert (config.memory_pinning, config.verbosity, config.log_format) == (True, 3, "json")


def test_environment_is_below_the_file_and_the_flags(tmp_path: Path) -> None:
    env = {"NODE_NAME": "from-env", "HOST_ROOT": "/env-root", "KUBECONFIG": "/env/kube"}
    assert _load([], env).node_name == "from-env"
    assert _load([], env).host_root == Path("/env-root")
    assert _load([], env).kubeconfig == Path("/env/kube")
    path = _file(tmp_path, "hostnameOverride: from-file\nhostRoot: /file-root\n")
    from_file = _load(["--config", path], env)
    assert (from_file.node_name, from_file.host_root) == ("from-file", Path("/file-root"))
    from_flag = _load(["--config", path, "--node-name", "from-flag", "--host-root", "/f"], env)
    assert (from_flag.node_name, from_flag.host_root) == ("from-flag", Path("/f"))


def test_empty_values_mean_not_given(tmp_path: Path) -> None:
    path = _file(tmp_path, 'hostnameOverride: ""\nkubeconfig: ""\ngroupBy: null\n')
    config = _load(["--config", path], {"NODE_NAME": "from-env", "KUBECONFIG": ""})
    assert config.node_name == "from-env"
    assert config.kubeconfig is None
    assert config.group_by is GroupBy.NUMANODE


def test_upstream_config_file_loads(tmp_path: Path) -> None:
    # Every key of kubernetes-sigs/dra-driver-cpu's config file, with upstream's meaning.
    path = _file(
        tmp_path,
        "apiVersion: v1alpha1\n"
        "cpuDeviceMode: grouped\n"
        "groupBy: socket\n"
        'reservedCPUs: "0-1,64-65"\n'
        "hostnameOverride: worker-7\n"
        "kubeconfig: /etc/dracpu/kubeconfig\n"
        'sysfsOverlay: ""\n'
        "publishNodeAllocatableResourceMapping: false\n"
        "allocator: cpumanager\n",
    )
    config = _load(["--config", path, "--expose-pcie-roots=false"])
    assert config == Config(
        node_name="worker-7",
        kubeconfig=Path("/etc/dracpu/kubeconfig"),
        cpu_device_mode=CpuDeviceMode.GROUPED,
        group_by=GroupBy.SOCKET,
        reserved_cpus=CpuSet.parse("0-1,64-65"),
        allocator="cpumanager",
    )


@pytest.mark.parametrize(
    ("text", "allocator", "notices"),
    [
        # upstream 0.3's values: groupBy machine requires allocator external there
        ("groupBy: machine\nallocator: external\n", "external", 0),
        ("groupBy: numanode\nallocator: external\n", "external", 0),
        # refused upstream; here our allocator picks inside the machine device, with a notice
        ("groupBy: machine\n", None, 1),
        ("groupBy: machine\nallocator: cpumanager\n", "cpumanager", 1),
        ("groupBy: machine\ncpuDeviceMode: individual\n", None, 0),
    ],
)
def test_the_allocator_key(tmp_path: Path, text: str, allocator: str | None, notices: int) -> None:
    config = _load(["--config", _file(tmp_path, text)])
    assert config.allocator == allocator
    assert len(config.notices) == notices
    if notices:
        assert config.notices[0].startswith(
            "groupBy machine without allocator external: upstream 0.3 refuses to start"
        )


def test_our_own_file_keys(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        "hostnameOverride: n\n"
        "cdiDir: /cdi\n"
        "nriSocket: /nri.sock\n"
        "stateDir: /state\n"
        "hostRoot: /host\n"
        "logFormat: json\n"
        "verbosity: 5\n"
        "memoryPinning: true\n"
        "nriPluginName: dra.cpu-test\n"
        "nriPluginIndex: 07\n"  # YAML reads an unquoted 07 as the number 7
        "podresourcesInterval: 90s\n"
        "orphanGrace: 600\n",  # a YAML number is seconds
    )
    config = _load(["--config", path])
    assert config == Config(
        node_name="n",
        cdi_dir=Path("/cdi"),
        nri_socket=Path("/nri.sock"),
        state_dir=Path("/state"),
        host_root=Path("/host"),
        log_format="json",
        verbosity=5,
        memory_pinning=True,
        nri_plugin_name="dra.cpu-test",
        nri_plugin_index="07",
        podresources_interval=90.0,
        orphan_grace=600.0,
    )


def test_empty_config_file_is_no_settings(tmp_path: Path) -> None:
    assert _load(["--config", _file(tmp_path, "# nothing\n"), "--node-name", "n"]) == Config("n")


# --- bind addresses -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "host", "port"),
    [
        (":8080", "", 8080),
        ("127.0.0.1:9000", "127.0.0.1", 9000),
        ("[::1]:8080", "::1", 8080),
        ("[::]:0", "::", 0),
        ("localhost:65535", "localhost", 65535),
    ],
)
def test_bind_address_parse_and_format(text: str, host: str, port: int) -> None:
    address = BindAddress.parse(text)
    assert (address.host, address.port) == (host, port)
    assert str(address) == text


# --- errors: one line naming the source and the value -------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (
            ["--cpu-device-mode", "bogus"],
            '--cpu-device-mode: invalid value "bogus": must be one of "grouped", "individual"',
        ),
        (
            ["--group-by", "numa"],
            '--group-by: invalid value "numa": must be one of "numanode", "socket", "machine"',
        ),
        (
            ["--reserved-cpus", "3-1"],
            "--reserved-cpus: invalid value \"3-1\": invalid cpuset '3-1': "
            "range '3-1' ends before it starts",
        ),
        (
            ["--kubelet-root-dir", "var/lib/kubelet"],
            '--kubelet-root-dir: invalid value "var/lib/kubelet": must be an absolute path',
        ),
        (["--state-dir", ""], '--state-dir: invalid value "": must not be empty'),
        (["--bind-address", "8080"], '--bind-address: invalid value "8080": missing ":<port>"'),
        (
            ["--bind-address", ":99999"],
            "--bind-address: invalid value \":99999\": port '99999' is not a number 0..65535",
        ),
        (
            ["--bind-address", "::1:80"],
            '--bind-address: invalid value "::1:80": an IPv6 address must be in brackets, '
            "e.g. [::1]:8080",
        ),
        (
            ["--bind-address", "[zz]:80"],
            '--bind-address: invalid value "[zz]:80": [zz] is not an IPv6 address',
        ),
        (["--log-format", "xml"], '--log-format: invalid value "xml": must be "text" or "json"'),
        (
            ["--nri-plugin-index", "7"],
            '--nri-plugin-index: invalid value "7": must be two digits, "00" to "99"',
        ),
        (
            ["--nri-plugin-name", "a b"],
            "--nri-plugin-name: invalid value \"a b\": must be letters, digits, '.', '_' or '-', "
            "starting with a letter or digit",
        ),
        (
            ["--node-name", "Node_1"],
            '--node-name: invalid value "Node_1": is not a valid node name (lowercase RFC 1123 '
            "subdomain: a-z, 0-9, '-' and '.')",
        ),
        (
            ["--vmodule", "nri_plugin"],
            '--vmodule: invalid value "nri_plugin": expect a comma-separated list of pattern=N '
            "(klog's -vmodule)",
        ),
        (
            ["--vmodule", "a=1,b=x"],
            '--vmodule: invalid value "a=1,b=x": expect a comma-separated list of pattern=N '
            "(klog's -vmodule)",
        ),
    ],
)
def test_bad_flag_values(argv: list[str], expected: str) -> None:
    node = [] if "--node-name" in argv else ["--node-name", "n"]
    assert _error([*node, *argv]) == expected


def _load_on_host(argv: Sequence[str], env: Mapping[str, str], host: str) -> Config:
    return load_config(_parser().parse_args(list(argv)), env, hostname=lambda: host)


def test_missing_node_name_falls_back_to_the_lower_cased_hostname() -> None:
    config = _load_on_host([], {"NODE_NAME": ""}, "Worker-7.Example.COM")
    assert config.node_name == "worker-7.example.com"
    assert config.node_name_source == "hostname"


@pytest.mark.parametrize(
    ("argv", "env", "source"),
    [
        (["--node-name", "a"], {"NODE_NAME": "b"}, "--node-name"),
        (["--hostname-override=a"], {}, "--node-name"),
        ([], {"NODE_NAME": "a"}, "environment variable NODE_NAME"),
    ],
)
def test_an_explicit_node_name_wins_over_the_hostname(
    argv: list[str], env: dict[str, str], source: str
) -> None:
    config = _load_on_host(argv, env, "host")
    assert (config.node_name, config.node_name_source) == ("a", source)


def test_a_config_file_node_name_wins_over_the_hostname(tmp_path: Path) -> None:
    path = _file(tmp_path, "hostnameOverride: from-file\n")
    config = _load_on_host(["--config", path], {}, "host")
    assert config.node_name == "from-file"
    assert config.node_name_source == f"config file {path}: hostnameOverride"


def test_missing_node_name_and_empty_hostname() -> None:
    with pytest.raises(ConfigError) as info:
        _load_on_host([], {"NODE_NAME": ""}, "")
    assert str(info.value) == (
        "no node name: give --node-name (or --hostname-override), set NODE_NAME, "
        "or set hostnameOverride in the config file (the host name is empty)"
    )


def test_a_hostname_that_is_no_node_name_is_refused() -> None:
    with pytest.raises(ConfigError) as info:
        _load_on_host([], {}, "bad_host")
    assert str(info.value) == (
        'hostname: invalid value "bad_host": is not a valid node name '
        "(lowercase RFC 1123 subdomain: a-z, 0-9, '-' and '.')"
    )


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"NODE_NAME": "UPPER"},
            'environment variable NODE_NAME: invalid value "UPPER": is not a valid node name '
            "(lowercase RFC 1123 subdomain: a-z, 0-9, '-' and '.')",
        ),
        (
            {"NODE_NAME": "n", "KUBECONFIG": "/a:/b"},
            'environment variable KUBECONFIG: invalid value "/a:/b": lists several files '
            "(':'-separated); give exactly one",
        ),
        (
            {"NODE_NAME": "n", "HOST_ROOT": "host"},
            'environment variable HOST_ROOT: invalid value "host": must be an absolute path',
        ),
    ],
)
def test_bad_environment_values(env: dict[str, str], expected: str) -> None:
    assert _error([], env) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("cpuDevMode: grouped\n", 'unknown key "cpuDevMode" (did you mean "cpuDeviceMode"?)'),
        (
            "CPUDeviceMode: grouped\n",
            'key "CPUDeviceMode" is spelled differently from the schema; use "cpuDeviceMode"',
        ),
        (
            "bindAddress: ':9090'\n",
            'key "bindAddress" is not settable in the config file; use --bind-address '
            "(with the Helm chart: its healthzPort value)",
        ),
        (
            "BindAddress: ':9090'\n",
            'key "BindAddress" is not settable in the config file; use --bind-address '
            "(with the Helm chart: its healthzPort value)",
        ),
        (
            "kubeletRootDir: /k\n",
            'key "kubeletRootDir" is not settable in the config file; use --kubelet-root-dir '
            "(with the Helm chart: its kubeletRootDir value)",
        ),
        (
            "exposePCIeRoots: false\n",
            'key "exposePCIeRoots" is not settable in the config file; use --expose-pcie-roots '
            "(with the Helm chart: its args.exposePCIeRoots value)",
        ),
        (
            "vmodule: a=1\n",
            'unknown key "vmodule"',
        ),
        (
            "allocator: kubelet\n",
            'allocator: invalid value "kubelet": must be "cpumanager" or "external"',
        ),
        ("sysfsOverlay: 3\n", "sysfsOverlay: invalid value 3: must be a string, not a number"),
        ("zzz: 1\n", 'unknown key "zzz"'),
        ("b_unknown: 1\na_unknown: 2\n", 'unknown key "a_unknown"; unknown key "b_unknown"'),
        (
            "cpuDeviceMode: bogus\n",
            'cpuDeviceMode: invalid value "bogus": must be one of "grouped", "individual"',
        ),
        ("reservedCPUs: 3\n", "reservedCPUs: invalid value 3: must be a string, not a number"),
        (
            "memoryPinning: 'yes'\n",
            'memoryPinning: invalid value "yes": must be true or false, not a string',
        ),
        ("verbosity: -1\n", "verbosity: invalid value -1: must be a number >= 0"),
        ("verbosity: true\n", "verbosity: invalid value true: must be a number >= 0"),
        (
            "nriPluginIndex: 100\n",
            'nriPluginIndex: invalid value 100: must be two digits, "00" to "99"',
        ),
        (
            "cdiDir: [a]\n",
            'cdiDir: invalid value ["a"]: must be a string, not a list',
        ),
        ("apiVersion: v1beta1\n", 'apiVersion: invalid value "v1beta1": must be "v1alpha1"'),
        ("orphanGrace: -1\n", "orphanGrace: invalid value -1: must not be negative"),
        (
            "orphanGrace: true\n",
            "orphanGrace: invalid value true: must be a duration (e.g. 90s, 5m) or a number of "
            "seconds, not a boolean",
        ),
        (
            "podresourcesInterval: 10ms\n",
            'podresourcesInterval: invalid value "10ms": must be 0 (off) or at least 100ms: the '
            "kubelet allows 100 PodResources requests per second to all its clients together",
        ),
        (
            "zzz: 1\nbindAddress: ':1'\nCPUDeviceMode: grouped\n",
            'key "CPUDeviceMode" is spelled differently from the schema; use "cpuDeviceMode"; '
            'key "bindAddress" is not settable in the config file; use --bind-address '
            '(with the Helm chart: its healthzPort value); unknown key "zzz"',
        ),
        (
            'publishNodeAllocatableResourceMapping: "yes"\n',
            'publishNodeAllocatableResourceMapping: invalid value "yes": must be true or false, '
            "not a string",
        ),
        ("- a\n- b\n", "must be a mapping of keys to values, not a list"),
        ("just text\n", "must be a mapping of keys to values, not a string"),
        (
            "groupBy: socket\ngroupBy: machine\n",
            'not valid YAML: duplicate key "groupBy" at line 2 column 1',
        ),
        (
            "a: [1\n",
            "not valid YAML: expected ',' or ']', but got '<stream end>' at line 2 column 1",
        ),
    ],
)
def test_bad_config_files(tmp_path: Path, text: str, expected: str) -> None:
    path = _file(tmp_path, text)
    assert _error(["--config", path, "--node-name", "n"]) == f"config file {path}: {expected}"


def test_unreadable_config_files(tmp_path: Path) -> None:
    missing = tmp_path / "missing.yaml"
    assert _error(["--config", str(missing), "--node-name", "n"]) == (
        f"config file {missing}: cannot read: No such file or directory"
    )
    assert _error(["--config", str(tmp_path), "--node-name", "n"]) == (
        f"config file {tmp_path}: cannot read: Is a directory"
    )
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    assert _error(["--config", str(binary), "--node-name", "n"]).startswith(
        f"config file {binary}: cannot read: 'utf-8' codec can't decode"
    )


def test_the_file_is_named_when_its_value_is_bad_even_if_a_flag_is_fine(tmp_path: Path) -> None:
    path = _file(tmp_path, "groupBy: rack\n")
    assert _error(["--config", path, "--node-name", "n", "--cpu-device-mode", "grouped"]) == (
        f'config file {path}: groupBy: invalid value "rack": must be one of "numanode", '
        '"socket", "machine"'
    )


def test_socket_paths_longer_than_the_unix_limit_are_refused(tmp_path: Path) -> None:
    # <root>/plugins_registry/dra.cpu-reg.sock is the longest socket under the kubelet root.
    suffix = len("/plugins_registry/dra.cpu-reg.sock")
    fits = "/" + "r" * (UNIX_PATH_MAX - suffix - 1)
    assert _load(["--node-name", "n", "--kubelet-root-dir", fits]).kubelet_root_dir == Path(fits)
    too_long = fits + "x"
    socket = f"{too_long}/plugins_registry/dra.cpu-reg.sock"
    assert _error(["--node-name", "n", "--kubelet-root-dir", too_long]) == (
        f'--kubelet-root-dir: registration socket path "{socket}" is 108 bytes, over the '
        "107-byte limit of a Unix socket path"
    )
    path = _file(tmp_path, f"nriSocket: /{'n' * 107}\n")
    assert _error(["--config", path, "--node-name", "n"]) == (
        f'config file {path}: nriSocket: NRI socket path "/{"n" * 107}" is 108 bytes, over '
        "the 107-byte limit of a Unix socket path"
    )


# --- through the real command line --------------------------------------------------------------


def test_dracpu_run_with_a_bad_flag_exits_2_with_one_line(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dracpu", "run", "--node-name", "n", "--cpu-device-mode", "bogus"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stdout == ""
    assert result.stderr == (
        'dracpu run: error: --cpu-device-mode: invalid value "bogus": must be one of '
        '"grouped", "individual"\n'
    )


def test_dracpu_run_with_a_bad_config_file_exits_2_with_one_line(tmp_path: Path) -> None:
    path = _file(tmp_path, "cpuDevMode: grouped\n")
    result = subprocess.run(
        [sys.executable, "-m", "dracpu", "run", "--config", path, "--node-name", "n"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 2
    assert result.stderr == (
        f'dracpu run: error: config file {path}: unknown key "cpuDevMode" '
        '(did you mean "cpuDeviceMode"?)\n'
    )


# --- upstream's invocation: Go-style flags, deprecations, empty --config ------------------------


def _go_load(argv: Sequence[str], env: Mapping[str, str] = NO_ENV) -> Config:
    parser = argparse.ArgumentParser(prog="dracpu run", allow_abbrev=False)
    flags = add_run_arguments(parser)
    return load_config(parser.parse_args(go_style_flags(argv, flags)), env)


@pytest.mark.parametrize(
    "argv",
    [
        ["-kubeconfig", "/k.conf", "-v=4", "-reserved-cpus=0-1", "-hostname-override", "n"],
        ["--kubeconfig=/k.conf", "--v", "4", "--reserved-cpus", "0-1", "--hostname-override=n"],
        ["-kubeconfig=/k.conf", "--v=4", "-reserved-cpus", "0-1", "-hostname-override=n"],
    ],
)
def test_go_flag_spellings_mean_the_same(argv: list[str]) -> None:
    config = _go_load(argv)
    assert (config.kubeconfig, config.verbosity, config.reserved_cpus, config.node_name) == (
        Path("/k.conf"),
        4,
        CpuSet.parse("0-1"),
        "n",
    )


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["-memory-pinning"], True),
        (["-memory-pinning=true"], True),
        (["--memory-pinning=0"], False),
        (["-memory-pinning=F"], False),
    ],
)
def test_go_booleans_in_both_spellings(argv: list[str], expected: bool) -> None:
    assert _go_load(["--node-name", "n", *argv]).memory_pinning is expected


@pytest.mark.parametrize("argv", [["-expose-pcie-roots=false"], ["--expose-pcie-roots=False"]])
def test_the_charts_expose_pcie_roots_false_is_accepted(argv: list[str]) -> None:
    assert _go_load(["--node-name", "n", *argv]).expose_pcie_roots is False


def test_go_style_rewrites_only_known_long_flags() -> None:
    flags = frozenset({"--kubeconfig", "--v", "--vmodule"})
    argv = ["-kubeconfig", "-x", "-v=2", "-vv", "-vmodule=a=1", "-z", "--", "-kubeconfig"]
    assert go_style_flags(argv, flags) == [
        "--kubeconfig",
        "-x",  # a value (or an unknown flag) is left alone
        "--v=2",
        "-vv",  # argparse's own short-option form
        "--vmodule=a=1",
        "-z",
        "--",
        "-kubeconfig",  # after --, nothing is a flag
    ]


def test_deprecated_flags_are_noticed_once_each_in_order(tmp_path: Path) -> None:
    overlay = tmp_path / "overlay.yaml"
    overlay.write_text("{}\n")
    config = _go_load(
        [
            "--group-by=socket",
            "-cpu-device-mode=grouped",
            "--group-by=numanode",
            "--reserved-cpus=1",
            "--hostname-override=n",
            f"--sysfs-overlay={overlay}",
            "--kubeconfig=/k",
        ]
    )
    assert config.group_by is GroupBy.NUMANODE  # the last one wins, as in Go
    assert config.notices == tuple(
        f"flag {flag} is deprecated (as upstream); set {key} in the config file instead"
        for flag, key in (
            ("--group-by", "groupBy"),
            ("--cpu-device-mode", "cpuDeviceMode"),
            ("--reserved-cpus", "reservedCPUs"),
            ("--hostname-override", "hostnameOverride"),
            ("--sysfs-overlay", "sysfsOverlay"),
        )
    )
    assert set(DEPRECATED_FLAGS) == {
        "--cpu-device-mode",
        "--group-by",
        "--reserved-cpus",
        "--hostname-override",
        "--sysfs-overlay",
    }


def test_our_node_name_flag_is_not_deprecated() -> None:
    assert _go_load(["--node-name=n", "--v=2"]).notices == ()


def test_an_empty_config_flag_means_no_file() -> None:
    assert _go_load(["--config=", "--node-name=n"]) == Config(node_name="n")


def test_sysfs_overlay_is_a_file_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert _go_load(["--node-name=n", "--sysfs-overlay=o.yaml"]).sysfs_overlay == (
        tmp_path / "o.yaml"
    )
    path = _file(tmp_path, "sysfsOverlay: /etc/dracpu/overlay.yaml\n")
    assert _go_load(["--node-name=n", "--config", path]).sysfs_overlay == Path(
        "/etc/dracpu/overlay.yaml"
    )
    assert _go_load(["--node-name=n", "--sysfs-overlay="]).sysfs_overlay is None


def test_vmodule_is_parsed_in_order() -> None:
    config = _go_load(["--node-name=n", "-vmodule=nri_plugin=4,tasks/*=2, state_owner=0"])
    assert config.vmodule == (("nri_plugin", 4), ("tasks/*", 2), ("state_owner", 0))


def test_a_file_setting_is_overridden_by_a_deprecated_flag(tmp_path: Path) -> None:
    path = _file(tmp_path, "apiVersion: v1alpha1\ngroupBy: socket\nreservedCPUs: '0'\n")
    config = _go_load(["--config", path, "--node-name=n", "--reserved-cpus=2-3"])
    assert (config.group_by, config.reserved_cpus) == (GroupBy.SOCKET, CpuSet.parse("2-3"))


# --- durations (--podresources-interval, --orphan-grace) -----------------------------------------


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("90s", 90.0),
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1.5h", 5400.0),
        ("2h45m0.5s", 9900.5),
        ("+5s", 5.0),
        ("1500us", 0.0015),
        ("1500\u00b5s", 0.0015),
        ("250000000ns", 0.25),
        ("0", 0.0),
        ("90", 90.0),  # a plain number is seconds
        ("2.5", 2.5),
        ("0s", 0.0),
    ],
)
def test_durations_are_go_durations_or_seconds(text: str, seconds: float) -> None:
    assert _load(["--node-name", "n", f"--orphan-grace={text}"]).orphan_grace == pytest.approx(
        seconds
    )
    if seconds == 0 or seconds >= 0.1:
        config = _load(["--node-name", "n", "--podresources-interval", text])
        assert config.podresources_interval == pytest.approx(seconds)


@pytest.mark.parametrize(
    ("flag", "value", "reason"),
    [
        (
            "--orphan-grace",
            "5x",
            "unknown unit 'x' (use ns, us, ms, s, m or h, e.g. 500ms, 90s, 5m)",
        ),
        ("--orphan-grace", "-5s", "must not be negative"),
        ("--orphan-grace", "-1", "must not be negative"),
        ("--orphan-grace", "", "is not a duration (e.g. 500ms, 90s, 5m, 1h30m)"),
        ("--orphan-grace", "m", "is not a duration (e.g. 500ms, 90s, 5m, 1h30m)"),
        ("--orphan-grace", "1.5.5s", "is not a duration (e.g. 500ms, 90s, 5m, 1h30m)"),
        (
            "--orphan-grace",
            "5 m",
            "unknown unit ' m' (use ns, us, ms, s, m or h, e.g. 500ms, 90s, 5m)",
        ),
        (
            "--podresources-interval",
            "99ms",
            "must be 0 (off) or at least 100ms: the kubelet allows 100 PodResources requests per "
            "second to all its clients together",
        ),
        (
            "--podresources-interval",
            "1d",
            "unknown unit 'd' (use ns, us, ms, s, m or h, e.g. 500ms, 90s, 5m)",
        ),
    ],
)
def test_bad_durations_name_the_flag_and_the_value(flag: str, value: str, reason: str) -> None:
    assert _error(["--node-name", "n", f"{flag}={value}"]) == (
        f'{flag}: invalid value "{value}": {reason}'
    )


def test_duration_flags_win_over_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path, "podresourcesInterval: 2m\norphanGrace: 1h\n")
    config = _load(["--config", path, "--node-name", "n", "--orphan-grace", "90s"])
    assert (config.podresources_interval, config.orphan_grace) == (120.0, 90.0)


# --- host cgroups ---------------------------------------------------------------------------------


def test_host_cgroups_from_the_flag_and_the_file(tmp_path: Path) -> None:
    assert _load(["--node-name", "n"]).confine_host_cgroups == ()
    flag = _load(["--node-name", "n", "--confine-host-cgroups=system.slice, /kubelet.slice"])
    assert flag.confine_host_cgroups == ("system.slice", "kubelet.slice")
    assert _load(["--node-name", "n", "--confine-host-cgroups="]).confine_host_cgroups == ()
    path = _file(tmp_path, "confineHostCgroups: [system.slice, runtime.slice]\n")
    config = _load(["--node-name", "n", "--config", path])
    assert config.confine_host_cgroups == ("system.slice", "runtime.slice")
    # the flag wins over the file, as every flag given does
    config = _load(["--node-name", "n", "--config", path, "--confine-host-cgroups=a.slice"])
    assert config.confine_host_cgroups == ("a.slice",)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (
            "kubepods.slice",
            "invalid value \"kubepods.slice\": cgroup 'kubepods.slice' is, or is inside, the "
            "kubelet's cgroup of the pods ('kubepods.slice'): confining it would keep the pods off "
            "their exclusive CPUs",
        ),
        (
            "system.slice,/",
            "invalid value \"system.slice,/\": cgroup '/' is the cgroup root, which holds every "
            "process (the pods' too)",
        ),
        (
            "system.slice,,kubelet.slice",
            "invalid value \"system.slice,,kubelet.slice\": cgroup '' is the cgroup root, which "
            "holds every process (the pods' too)",
        ),
        (
            "../x",
            "invalid value \"../x\": cgroup '../x' must be a path below the cgroup root without "
            "empty, . or .. parts",
        ),
        (
            "system.slice,system.slice/a.service",
            "invalid value \"system.slice,system.slice/a.service\": cgroup 'system.slice/a.service'"
            " is inside 'system.slice', which is listed too",
        ),
    ],
)
def test_bad_host_cgroups_are_refused_with_one_line(
    tmp_path: Path, value: str, expected: str
) -> None:
    assert _error(["--node-name", "n", f"--confine-host-cgroups={value}"]) == (
        f"--confine-host-cgroups: {expected}"
    )


def test_bad_host_cgroups_in_the_file(tmp_path: Path) -> None:
    path = _file(tmp_path, "confineHostCgroups: [system.slice, 3]\n")
    assert _error(["--config", path, "--node-name", "n"]) == (
        f'config file {path}: confineHostCgroups: invalid value ["system.slice", 3]: must be a '
        "string, not a number"
    )
    path = _file(tmp_path, "confineHostCgroups: [kubelet.slice/kubelet-kubepods.slice]\n")
    assert _error(["--config", path, "--node-name", "n"]).startswith(
        f'config file {path}: confineHostCgroups: invalid value ["kubelet.slice/kubelet-kubepods'
        ".slice\"]: cgroup 'kubelet.slice/kubelet-kubepods.slice' is, or is inside, the "
        "kubelet's cgroup of the pods ('kubelet-kubepods.slice')"
    )
