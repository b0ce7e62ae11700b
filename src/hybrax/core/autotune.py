"""Autotuning: time each candidate config on random inputs of the invocation's shapes.

Each candidate is compiled, warmed up and timed (median of `iterations` runs); its output is
compared with the heuristic config's, and a candidate that fails to compile or disagrees is
discarded, never chosen. Only shapes and dtypes are needed, so this runs at trace time.
"""

from __future__ import annotations

import dataclasses
import statistics
import sys
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from hybrax.core.config import KernelConfig


def tolerance(dtype: Any) -> float:
    """Relative-error bound for two configs of one op that should agree up to rounding."""
    dtype = jnp.dtype(dtype)
    if dtype == jnp.float64:
        return 1e-9
    if dtype == jnp.float32:
        # GPU matmuls on fp32 inputs may use tf32.
        return 3e-3
    return 3e-2


def relative_error(out: Any, ref: Any) -> float:
    """max over leaves of ||out - ref|| / ||ref|| in float64."""
    worst = 0.0
    for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref), strict=True):
        a = np.asarray(a, np.float64)
        b = np.asarray(b, np.float64)
        if not np.all(np.isfinite(a)):
            return float("inf")
        worst = max(worst, float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)))
    return worst


@dataclasses.dataclass(frozen=True)
class Trial:
    cfg: KernelConfig
    time_s: float | None  # None: discarded
    error: float | None
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class Autotuner:
    warmup: int = 2
    iterations: int = 7
    progress: bool = True

    def _time(self, fn: Any, problem: Any) -> float:
        for _ in range(self.warmup):
            jax.block_until_ready(fn(problem))
        times = []
        for _ in range(self.iterations):
            start = time.perf_counter()
            jax.block_until_ready(fn(problem))
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    def _say(self, text: str) -> None:
        if self.progress:
            print(f"[hybrax autotune] {text}", file=sys.stderr, flush=True)

    def tune(self, kernel: Any, inv: Any, candidates: Sequence[KernelConfig]) -> tuple[KernelConfig, list[Trial]]:
        """The fastest candidate that agrees with the heuristic config, and every trial."""
        # The executor may be running inside a trace (jit, grad): evaluate eagerly on concrete inputs.
        with jax.ensure_compile_time_eval():
            return self._tune(kernel, inv, candidates)

    def _tune(self, kernel: Any, inv: Any, candidates: Sequence[KernelConfig]) -> tuple[KernelConfig, list[Trial]]:
        baseline_cfg = kernel.heuristic_cfg(inv)
        problem = kernel.autotune_problem(inv, jax.random.key(0))
        baseline = jax.jit(lambda p: kernel.execute(p, baseline_cfg))(problem)
        out_dtype = jax.tree.leaves(baseline)[0].dtype
        trials = []
        for index, cfg in enumerate(candidates):
            fn = jax.jit(lambda p, cfg=cfg: kernel.execute(p, cfg))
            try:
                error = relative_error(fn(problem), baseline)
            except Exception as exc:  # a candidate that cannot compile or run is skipped
                trials.append(Trial(cfg, None, None, f"failed: {type(exc).__name__}: {exc}"[:300]))
                self._say(f"{inv.op_id} {index + 1}/{len(candidates)} {cfg}: {trials[-1].reason}")
                continue
            if not error <= tolerance(out_dtype):
                trials.append(Trial(cfg, None, error, "disagrees with the heuristic config"))
                self._say(f"{inv.op_id} {index + 1}/{len(candidates)} {cfg}: discarded, error {error:.2e}")
                continue
            trials.append(Trial(cfg, self._time(fn, problem), error))
            self._say(f"{inv.op_id} {index + 1}/{len(candidates)} {cfg}: {trials[-1].time_s * 1e3:.3f} ms")
        timed = [t for t in trials if t.time_s is not None]
        if not timed:
            return baseline_cfg, trials
        best = min(timed, key=lambda t: t.time_s)
        return best.cfg, trials
