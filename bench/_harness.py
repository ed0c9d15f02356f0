"""Shared helpers for benchmarks: time a callable, print one JSON object per figure.

Each figure is ``{"name", "unit", "p50", "p99", "n", ...extra}``. Benchmarks are not
tests: nothing here asserts a number.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

__all__ = ["cpu_list", "emit", "measure", "measure_async", "percentiles", "rss_mib"]


def percentiles(samples_ms: list[float]) -> tuple[float, float]:
    """p50 and p99 (nearest-rank) of the samples."""
    ordered = sorted(samples_ms)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, max(0, round(0.99 * len(ordered)) - 1))]
    return p50, p99


def emit(name: str, unit: str, **fields: Any) -> None:
    """Print one figure as a JSON line."""
    print(json.dumps({"name": name, "unit": unit, **fields}), flush=True)
    sys.stdout.flush()


def measure(name: str, fn: Callable[[], object], *, n: int, warmup: int = 3, **extra: Any) -> None:
    """Call ``fn`` ``n`` times, print p50/p99 in milliseconds."""
    for _ in range(warmup):
        fn()
    samples: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    p50, p99 = percentiles(samples)
    emit(name, "ms", p50=round(p50, 4), p99=round(p99, 4), n=n, **extra)


async def measure_async(
    name: str, fn: Callable[[], Awaitable[object]], *, n: int, warmup: int = 3, **extra: Any
) -> None:
    """Await ``fn()`` ``n`` times, print p50/p99 in milliseconds."""
    for _ in range(warmup):
        await fn()
    samples: list[float] = []
    for _ in range(n):
        start = time.perf_counter()
        await fn()
        samples.append((time.perf_counter() - start) * 1000)
    p50, p99 = percentiles(samples)
    emit(name, "ms", p50=round(p50, 4), p99=round(p99, 4), n=n, **extra)


def rss_mib(pid: int) -> float:
    """The resident set of process ``pid`` in MiB (``VmRSS`` of ``/proc/<pid>/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024  # the kernel reports kB
    raise RuntimeError(f"no VmRSS for pid {pid}")


def cpu_list(text: str) -> set[int]:
    """A Linux cpu list (``0-3,8``) as a set, parsed here, not with dracpu's ``CpuSet``: a
    benchmark that checks the daemon's cpusets must not share its parser."""
    result: set[int] = set()
    for part in filter(None, text.split(",")):
        low, _, high = part.partition("-")
        result.update(range(int(low), int(high or low) + 1))
    return result
