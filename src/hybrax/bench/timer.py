"""The one timer of every benchmark: the median over rounds of the mean time per call of back-to-back calls.

A round makes `reps` calls back to back and then waits for the last result. JAX dispatches asynchronously, so on
a GPU or TPU the host queues the calls ahead of the device and a round's time over `reps` is the device's time
per call, once a call takes longer than its dispatch (some microseconds: decode benchmarks therefore run many
steps inside one jitted call); on the CPU it is the wall clock. `reps` is chosen so that a round lasts at least
`Budget.round_ms`.

PyTorch functions (the fla anchor) are captured `reps` calls at a time into a CUDA graph and replayed, each
replay timed by CUDA events: the device's time without PyTorch's per-call launch cost, which one dispatch of a
jitted JAX program does not pay either. Where capture fails the same calls run eagerly between the events.

This module imports only the standard library at import time (JAX and PyTorch inside the functions).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Budget:
    """How long to measure: `rounds` rounds of at least `round_ms` each, at most `max_reps` calls per round."""

    rounds: int = 7
    round_ms: float = 50.0
    max_reps: int = 100
    warmup: int = 2


SMOKE_BUDGET = Budget(rounds=2, round_ms=0.0, max_reps=1, warmup=1)


@dataclasses.dataclass(frozen=True)
class Timing:
    """median_ms per call; spread = (slowest - fastest round) / median; method: "jax", "cuda_graph" or
    "cuda_events"."""

    median_ms: float
    spread: float
    rounds: int
    reps: int
    method: str

    def as_dict(self) -> dict[str, Any]:
        return {"method": self.method, "rounds": self.rounds, "reps": self.reps, "spread": round(self.spread, 4)}


def _summary(per_call_ms: list[float], reps: int, method: str) -> Timing:
    median = statistics.median(per_call_ms)
    spread = (max(per_call_ms) - min(per_call_ms)) / median if median > 0 else 0.0
    return Timing(median, spread, len(per_call_ms), reps, method)


def _reps(one_call_ms: float, budget: Budget) -> int:
    if one_call_ms <= 0:
        return budget.max_reps
    return max(1, min(budget.max_reps, math.ceil(budget.round_ms / one_call_ms)))


def time_jax(run: Callable[[], Any], budget: Budget = Budget()) -> Timing:
    """Time `run()` (a call of jitted JAX code; its result is waited for with jax.block_until_ready)."""
    import jax

    for _ in range(budget.warmup):  # the first call compiles
        jax.block_until_ready(run())
    start = time.perf_counter()
    jax.block_until_ready(run())
    reps = _reps((time.perf_counter() - start) * 1e3, budget)
    per_call = []
    for _ in range(budget.rounds):
        start = time.perf_counter()
        for _ in range(reps):
            out = run()
        jax.block_until_ready(out)
        per_call.append((time.perf_counter() - start) * 1e3 / reps)
    return _summary(per_call, reps, "jax")


def time_torch(run: Callable[[], Any], budget: Budget = Budget()) -> Timing:
    """Time `run()` (PyTorch work on the current CUDA device) by CUDA-graph replay, or eagerly between CUDA events
    where the work cannot be captured."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as graph capture wants (and autotuning)
        for _ in range(max(budget.warmup, 3)):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    run()
    end.record()
    end.synchronize()
    reps = _reps(start.elapsed_time(end), budget)
    replay, method = _captured(run, reps)
    replay()
    per_call = []
    for _ in range(budget.rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / reps)
    return _summary(per_call, reps, method)


def _captured(run: Callable[[], Any], reps: int) -> tuple[Callable[[], Any], str]:
    """A replay of `reps` calls of `run` from a CUDA graph, or the eager calls where capture fails."""
    import torch

    def eager() -> None:
        for _ in range(reps):
            run()

    graph = torch.cuda.CUDAGraph()
    try:
        # Thread-local capture: JAX's runtime threads may still launch or free work of their own meanwhile.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            eager()
    except Exception:  # noqa: BLE001 - work that syncs with the host (e.g. reads a length) cannot be captured
        torch.cuda.synchronize()
        return eager, "cuda_events"
    return graph.replay, "cuda_graph"


def time_call(run: Callable[[], Any], framework: str, budget: Budget = Budget()) -> Timing:
    """`time_jax` or `time_torch`, by the framework that `run` uses."""
    if framework == "torch":
        return time_torch(run, budget)
    if framework == "jax":
        return time_jax(run, budget)
    raise ValueError(f"framework must be 'jax' or 'torch', got {framework!r}")
