"""One node as upstream's Helm chart deploys the driver, with dracpu's image in place of upstream's.

Run by ``test_upstream_chart.py`` as ``unshare --mount --pid ... python -m
tests.integration.chart_scenario PARAMS_JSON`` (private mount and process namespaces, as root, as
a pod has): the chart's paths are made real there and nowhere else. ``/var`` is a fresh tmpfs
with the kubelet root (the test's directory, bound on ``/var/lib/kubelet`` or on the chart's
``kubeletRootDir``), ``/var/run/cdi``, ``/var/run/nri`` and the service account's token and CA
(the in-cluster configuration the chart relies on); ``/etc`` gets an overlay holding
``/etc/dracpu/config.yaml`` (the chart's ConfigMap) when the chart renders one; ``/sys`` is a
simulated machine's sysfs (the chart mounts none: the container reads the node's). The fakes (API
server over TLS, the runtime on the NRI socket, the kubelet) run here; the driver is
``<layout>/dracpu`` (a link to the installed command, as the image's ``/dracpu``) with the
chart's arguments verbatim, and without any capability (``setpriv``: an empty bounding set, no
new privileges), as the hardened DaemonSet runs it.

With ``image`` set, the driver is that image instead, run by podman as the chart's pod would
be (host network and UTS namespace, no capability, no new privileges, the chart's mounts as
volumes, the image's own ``/dracpu``): then nothing is mounted here and the kubelet root is the
test's directory at the same path inside and out (``--kubelet-root-dir``, as the chart renders a
non-default ``kubeletRootDir``), so that the plugin's socket paths mean the same on both sides.

It walks one claim through the node and prints one JSON object of what it saw; the test
asserts on it. Everything it starts is stopped before it exits.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio

from dracpu.core.devices import CpuDeviceMode
from dracpu.sim.fake_apiserver import open_fake_apiserver
from dracpu.sim.fake_kubelet import FakeKubelet
from dracpu.sim.fake_runtime import open_fake_runtime
from dracpu.sim.node import DaemonProcess, NodeSim, SimPaths, http_get, wait_until
from dracpu.sim.topologies import fixture, write_sysfs

TOPOLOGY = "dual-socket-smt2"
SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
READY_TIMEOUT = 60.0


def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True)


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _pki(directory: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1: (ca, cert, key)."""
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    _openssl("req", "-x509", *ec, "-keyout", directory / "ca.key", "-out", directory / "ca.crt",
             "-days", "2", "-subj", "/CN=chart test ca")  # fmt: skip
    _openssl("req", *ec, "-keyout", directory / "server.key", "-out", directory / "server.csr",
             "-subj", "/CN=127.0.0.1")  # fmt: skip
    (directory / "server.ext").write_text(
        "subjectAltName=IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n"
    )
    _openssl("x509", "-req", "-in", directory / "server.csr", "-CA", directory / "ca.crt",
             "-CAkey", directory / "ca.key", "-CAcreateserial", "-out", directory / "server.crt",
             "-days", "2", "-extfile", directory / "server.ext")  # fmt: skip
    return directory / "ca.crt", directory / "server.crt", directory / "server.key"


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _setup_mounts(base: Path, paths: SimPaths, kubelet_root: str, config: str | None) -> None:
    _mount("-t", "tmpfs", "tmpfs", "/var")
    for directory in (kubelet_root, "/var/run/cdi", "/var/run/nri", str(SERVICE_ACCOUNT)):
        Path(directory).mkdir(parents=True, exist_ok=True)
    _mount("--bind", str(paths.kubelet_root), kubelet_root)
    _mount("--bind", str(paths.cdi_dir), "/var/run/cdi")
    _mount("--bind", str(paths.nri_socket.parent), "/var/run/nri")
    _mount("--bind", str(paths.host_root / "sys"), "/sys")
    if config is not None:
        upper, work = base / "etc-upper", base / "etc-work"
        upper.mkdir()
        work.mkdir()
        _mount("-t", "overlay", "overlay", "-o", f"lowerdir=/etc,upperdir={upper},workdir={work}",
               "/etc")  # fmt: skip
        Path("/etc/dracpu").mkdir()
        Path("/etc/dracpu/config.yaml").write_text(config)


def _chart_args(params: dict[str, Any], port: int) -> list[str]:
    """``templates/daemonset.yaml``'s container args, as the chart renders them."""
    args = ["/dracpu", f"--v={params['log_level']}", f"--bind-address=:{port}",
            f"--expose-pcie-roots={str(params['expose_pcie_roots']).lower()}"]  # fmt: skip
    if params["kubelet_root_dir"] != "/var/lib/kubelet":
        args.append(f"--kubelet-root-dir={params['kubelet_root_dir']}")
    if params["config"] is not None:
        args.append("--config=/etc/dracpu/config.yaml")
    return args


def _podman_run(params: dict[str, Any], paths: SimPaths, base: Path, args: list[str]) -> list[str]:
    """``podman run`` of the image as the chart's pod: its volumes, hostNetwork, the args."""
    volumes = {
        paths.kubelet_root: params["kubelet_root_dir"],
        paths.cdi_dir: "/var/run/cdi",
        paths.nri_socket.parent: "/var/run/nri",
        paths.host_root / "sys": "/sys",  # the chart mounts none: the container sees the node's
        base / "serviceaccount": str(SERVICE_ACCOUNT),
    }
    if params["config"] is not None:
        volumes[base / "config.yaml"] = "/etc/dracpu/config.yaml"
    command = ["podman", "run", "--rm", "--name", params["container"], "--pull", "never",
               "--network", "host", "--uts", "host", "--cap-drop", "all",
               "--security-opt", "no-new-privileges"]  # fmt: skip
    for source, target in volumes.items():
        command += ["--volume", f"{source}:{target}:z"]
    for name in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
        command += ["--env", name]
    return [*command, params["image"], *args]


def _in_container(params: dict[str, Any], command: list[str]) -> list[str]:
    if params.get("image"):
        return ["podman", "exec", params["container"], *command]
    layout = Path(params["layout"])
    return [str(layout / Path(command[0]).name), *command[1:]]


async def scenario(params: dict[str, Any]) -> dict[str, Any]:
    base = Path(params["base"])
    paths = SimPaths(base / "node")
    for directory in (paths.kubelet_root, paths.cdi_dir, paths.nri_socket.parent, paths.logs):
        directory.mkdir(parents=True, exist_ok=True)
    spec = fixture(TOPOLOGY)
    write_sysfs(spec, paths.host_root)
    ca, cert, key = _pki(base)
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    image = params.get("image")
    if image:
        (base / "serviceaccount").mkdir()
        if params["config"] is not None:
            (base / "config.yaml").write_text(params["config"])
    else:
        _setup_mounts(base, paths, params["kubelet_root_dir"], params["config"])
    service_account = base / "serviceaccount" if image else SERVICE_ACCOUNT
    nri_socket = paths.nri_socket if image else Path("/var/run/nri/nri.sock")
    node_name = socket.gethostname().lower()  # the chart sets no node name: the hostname
    port = _free_port()
    seen: dict[str, Any] = {"node": node_name}
    async with (
        open_fake_apiserver(ssl_context=server, kubeconfig_dir=base) as api,
        open_fake_runtime(nri_socket) as runtime,
    ):
        api.add_node(node_name)
        shutil.copy(ca, service_account / "ca.crt")
        (service_account / "token").write_text("chart-test-token")
        (service_account / "namespace").write_text("kube-system")
        env = {k: v for k, v in os.environ.items() if k not in {"NODE_NAME", "HOST_ROOT"}}
        env["KUBERNETES_SERVICE_HOST"] = "127.0.0.1"
        env["KUBERNETES_SERVICE_PORT"] = api.url.rsplit(":", 1)[1]
        args = _chart_args(params, port)
        seen["args"] = args
        command = _podman_run(params, paths, base, args) if image else _in_container(params, args)
        if params["no_capabilities"] and not image:
            command = ["setpriv", "--bounding-set=-all", "--inh-caps=-all", "--no-new-privs",
                       *command]  # fmt: skip
        log_path = base / "daemon.log"
        with (
            log_path.open("wb") as log,
            FakeKubelet(Path(params["kubelet_root_dir"]) / "plugins_registry") as kubelet,
        ):
            process = await anyio.open_process(command, stdout=log, stderr=log, env=env)
            try:
                daemon = DaemonProcess(process, log_path, log)
                walked = await _walk(params, node_name, api, runtime, kubelet, paths, spec, port,
                                     daemon)  # fmt: skip
                seen.update(walked)
                seen["capabilities"] = await _capabilities(params, process.pid)
            finally:
                if process.returncode is None:
                    process.send_signal(signal.SIGTERM)
                    with anyio.fail_after(15):
                        seen["exit"] = await process.wait()
        seen["log"] = log_path.read_text(errors="replace").splitlines()
    return seen


async def _capabilities(params: dict[str, Any], pid: int) -> dict[str, str]:
    """The driver's capability sets (in the image: of the container's first process)."""
    if params.get("image"):
        answer = await anyio.run_process(_in_container(params, ["cat", "/proc/1/status"]))
        status = answer.stdout.decode().splitlines()
    else:
        status = (await anyio.Path(f"/proc/{pid}/status").read_text()).splitlines()
    return {
        line.split(":")[0]: line.split()[1]
        for line in status
        if line.startswith(("CapEff", "CapPrm", "CapBnd"))
    }


async def _walk(
    params: dict[str, Any],
    node_name: str,
    api: Any,
    runtime: Any,
    kubelet: FakeKubelet,
    paths: SimPaths,
    spec: Any,
    port: int,
    daemon: DaemonProcess,
) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    exited = daemon.exited

    async def ready() -> bool:
        try:
            return (await http_get(port, "/readyz"))[0] == 200
        except OSError:
            return False

    await wait_until("the registration socket", lambda: bool(kubelet.sockets()),
                     timeout=READY_TIMEOUT, failed=exited)  # fmt: skip
    await kubelet.aregister()
    with anyio.fail_after(READY_TIMEOUT):
        while not await ready():
            if exited():
                raise RuntimeError(f"dracpu {exited()}")
            await anyio.sleep(0.05)
    seen["readyz"] = await http_get(port, "/readyz")
    seen["healthz"] = await http_get(port, "/healthz")
    sim = NodeSim(
        paths=paths,
        api=api,
        runtime=runtime,
        kubelet=kubelet,
        spec=spec,
        topology_name=TOPOLOGY,
        node_name=node_name,
        mode=CpuDeviceMode.GROUPED,
        daemon_args=[],
    )
    sim.daemons.append(daemon)
    await sim.wait_published()
    seen["devices"] = sorted(d["name"] for d in sim.published())
    seen["attributes"] = {d["name"]: d.get("attributes", {}) for d in sim.published()}
    # An external allocator's claim (upstream 0.3 `allocator: external`): the CPUs it chose, in
    # the allocation's opaque config.
    cpuset = params.get("cpuset")
    parameters = {"apiVersion": "v1alpha1", "cpuConfig": {"cpuset": cpuset}}
    opaque = {"driver": "dra.cpu", "parameters": parameters}
    configs = [{"source": "FromClaim", "requests": ["cpus"], "opaque": opaque}] if cpuset else []
    claim = sim.allocate("chart", cpus=4, configs=configs)
    answer = await sim.prepare(claim)
    seen["prepare_error"] = answer[claim.uid].error
    seen["cdi_cpus"] = sim.cdi_cpus(claim.uid)
    _, container = await sim.run_container("app", claims=[claim])
    seen["container_cpus"] = sim.cpus_of(container.id)
    seen["metrics"] = [
        line for line in (await http_get(port, "/metrics"))[1].splitlines()
        if line.startswith("dra_cpu_") and not line.startswith("dra_cpu_prepare_claim_duration")
    ]  # fmt: skip
    # As upstream's troubleshooting guide runs it (kubectl exec <pod> -- /dracpu gatherinfo):
    # the driver is found by its process name, in the namespace's own process table.
    command = _in_container(
        params,
        ["/dracpu", "gatherinfo", "--stdout"]
        if params["gatherinfo"] == "subcommand"
        else ["/dracpu-gatherinfo", "--stdout"],
    )
    with anyio.fail_after(60):
        gather = await anyio.run_process(command, check=False)
    seen["gatherinfo"] = {
        "rc": gather.returncode,
        "out": gather.stdout.decode(),
        "err": gather.stderr.decode(),
    }
    seen["claim"] = claim.uid
    seen["container"] = container.id
    seen["unprepare_error"] = (await sim.unprepare(claim))[claim.uid]
    return seen


def main() -> None:
    params = json.loads(sys.argv[1])
    result = anyio.run(scenario, params, backend="asyncio")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
