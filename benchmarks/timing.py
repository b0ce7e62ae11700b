"""Shared timing and anchor plumbing for the benchmark scripts (JAX side, any JAX version)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from typing import Any, Callable

ROOT = pathlib.Path(__file__).resolve().parent.parent


def median_ms(fn: Callable[[], Any], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time of `fn()` in ms, blocking on its result (CPU timing; GPU uses events). hybrax.demo
    has its own: this module also runs in the ejkernel environment, where hybrax is not installed."""
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def copy_bandwidth() -> float:
    """Bytes read plus written per second by a 1 GiB device-to-device copy (torch, do_bench median)."""
    import torch
    from triton.testing import do_bench

    x = torch.randn(2**28, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() * 4 / (do_bench(lambda: y.copy_(x), warmup=25, rep=200, return_mode="median") * 1e-3)


# Triton's autotuning results (`<cache>/<hash>/<kernel>.autotune.json`, which fla's kernels write since
# FLA_CACHE_RESULTS defaults to on), kept from earlier GPU runs. Seeded into a fresh Triton cache, they
# spare fla its autotuning on a new machine (~100 s per head count and direction on the H200: most of a
# 10-minute device call); the hash covers Triton's version, the kernel's source and its configs.
AUTOTUNE_DIR = ROOT / "benchmarks" / "triton_autotune"


def seed_triton_cache() -> pathlib.Path:
    """Point Triton at a fresh cache folder holding AUTOTUNE_DIR's results; call before importing torch."""
    cache = pathlib.Path(os.environ.get("TRITON_CACHE_DIR") or "/tmp/hybrax-triton-cache")
    if AUTOTUNE_DIR.is_dir():
        shutil.copytree(AUTOTUNE_DIR, cache, dirs_exist_ok=True)
    os.environ["TRITON_CACHE_DIR"] = str(cache)
    return cache


def save_triton_autotune(cache: pathlib.Path) -> None:
    """Pack the cache's autotuning results into $OUT/triton_autotune.tar (to be unpacked into AUTOTUNE_DIR).

    One archive, since a device call brings back at most 8 files from $OUT.
    """
    if not os.environ.get("OUT"):
        return
    with tarfile.open(pathlib.Path(os.environ["OUT"], "triton_autotune.tar"), "w") as archive:
        for result in sorted(cache.glob("*/*.autotune.json")):
            archive.add(result, arcname=str(result.relative_to(cache)))


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
