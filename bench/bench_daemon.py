"""Start-up of the daemon: ``dracpu run`` launched as a process until ``/readyz`` answers 200.

* ``daemon.start_to_ready``: milliseconds from ``Popen`` to the first 200 from ``/readyz``
  (polled every 5 ms), over ``RUNS`` launches; ``rss_mib`` is the p50 of the process's VmRSS
  (``/proc/<pid>/status``) read right when it is ready;
* ``daemon.sigterm_to_exit``: milliseconds from SIGTERM to the process's exit.

Each launch gets fresh temporary directories and a free port; no cluster is needed (no task of
the skeleton talks to the API server). Run: ``.venv/bin/python bench/bench_daemon.py``.
"""

from __future__ import annotations

import http.client
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench._harness import emit, percentiles

__all__ = ["main"]

RUNS = 10
POLL_INTERVAL = 0.005
READY_TIMEOUT = 30.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ready(port: int) -> bool:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
    try:
        conn.request("GET", "/readyz")
        return conn.getresponse().status == 200
    except OSError:
        return False
    finally:
        conn.close()


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"no VmRSS for pid {pid}")


def _launch_once(root: Path) -> tuple[float, float, float]:
    """One launch: (ms to ready, RSS MiB when ready, ms from SIGTERM to exit)."""
    port = _free_port()
    dirs = {name: root / name for name in ("state", "kubelet", "cdi", "nri")}
    for directory in dirs.values():
        directory.mkdir()
    command = [
        sys.executable,
        "-m",
        "dracpu",
        "run",
        "--node-name=bench",
        f"--state-dir={dirs['state']}",
        f"--kubelet-root-dir={dirs['kubelet']}",
        f"--cdi-dir={dirs['cdi']}",
        f"--nri-socket={dirs['nri'] / 'nri.sock'}",
        f"--bind-address=127.0.0.1:{port}",
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(command, stderr=subprocess.DEVNULL, cwd=root)
    try:
        while not _ready(port):
            if proc.poll() is not None:
                raise RuntimeError(f"dracpu run exited with {proc.returncode} before ready")
            if time.perf_counter() - start > READY_TIMEOUT:
                raise RuntimeError("dracpu run was not ready in time")
            time.sleep(POLL_INTERVAL)
        ready_ms = (time.perf_counter() - start) * 1000
        rss = _rss_mib(proc.pid)
        stop = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        stop_ms = (time.perf_counter() - stop) * 1000
        if proc.returncode != 0:
            raise RuntimeError(f"dracpu run exited with {proc.returncode} after SIGTERM")
        return ready_ms, rss, stop_ms
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="dracpu-bench-") as tmp:
        _launch_once(Path(tmp))  # warm the bytecode cache
    ready, rss, stop = [], [], []
    for _ in range(RUNS):
        with tempfile.TemporaryDirectory(prefix="dracpu-bench-") as tmp:
            ready_ms, rss_mib, stop_ms = _launch_once(Path(tmp))
        ready.append(ready_ms)
        rss.append(rss_mib)
        stop.append(stop_ms)
    p50, p99 = percentiles(ready)
    emit(
        "daemon.start_to_ready",
        "ms",
        p50=round(p50, 1),
        p99=round(p99, 1),
        n=RUNS,
        rss_mib=round(statistics.median(rss), 1),
    )
    p50, p99 = percentiles(stop)
    emit("daemon.sigterm_to_exit", "ms", p50=round(p50, 1), p99=round(p99, 1), n=RUNS)


if __name__ == "__main__":
    main()
