"""What the CPU comparisons with ejkernel share (they run in ejkernel's own jax 0.10 environment, where hybrax and
so hybrax.bench are not installed): a wall-clock median, the subprocess in that environment, a table."""

from __future__ import annotations

import json
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent


def median_ms(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` in ms, blocking on its result (the CPU's clock, as hybrax.bench.timer's on the
    CPU)."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def run_in_ejkernel_env(script: str, *args: str) -> dict[str, Any]:
    """Run `script` (a path under benchmarks/) with ejkernel's Python; it prints one JSON line last."""
    python = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "ejkernel_env.sh")], check=True, capture_output=True, text=True
    ).stdout.strip()
    done = subprocess.run(
        [python, str(ROOT / "benchmarks" / script), *args],
        capture_output=True, text=True, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"},
    )
    if done.returncode:
        raise RuntimeError(f"{script} failed under ejkernel:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    for r in rows:
        print("  ".join(str(r.get(c, "")).ljust(widths[c]) for c in columns))
    sys.stdout.flush()
