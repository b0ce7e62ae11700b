"""Run one op's benchmark: for every shape and mode, the anchors, then each of our implementations, one row each.

Per shape and mode: the op's extras (floors, baselines) once; each anchor's forward output (for the cross-check)
and its time; then for each implementation its output, its time, and a row with the ratios to every anchor that
ran, appended to the results as soon as the shape is done (a run cut short keeps what it measured). An anchor or
implementation that declines or fails is reported and skipped; the others go on.
"""

from __future__ import annotations

import dataclasses
import pathlib
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybrax.bench import anchors, base_revision, results
from hybrax.bench.shapes import Shape, parse
from hybrax.bench.timer import Budget, Timing, time_call
from hybrax.bench.workloads import WORKLOADS, Call, Declined, Workload

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class Options:
    """One run: op, implementations, shape names, anchors, dtype name, modes, the results folder, the timer's
    budget, whether rows are marked smoke, the command line to record, the commit to record where git cannot
    tell, and the rows of a base revision's run (`base_revision.run_base`) to compare with."""

    op: str
    impls: Sequence[str]
    shapes: Sequence[str]
    anchors: Sequence[str]
    dtype: str
    modes: Sequence[str]
    out: pathlib.Path
    budget: Budget
    smoke: bool
    command: str
    commit: str | None = None
    base_rows: dict[tuple, Any] = dataclasses.field(default_factory=dict)
    log: Callable[[str], None] = print


def relative_difference(ours: np.ndarray, theirs: np.ndarray) -> float:
    ours, theirs = (np.asarray(x, np.float64) for x in (ours, theirs))
    if ours.shape != theirs.shape:
        raise ValueError(f"outputs of shapes {ours.shape} and {theirs.shape} cannot be compared")
    return float(np.linalg.norm(ours - theirs) / max(np.linalg.norm(theirs), 1e-30))


def _measured(call: Call, measure: Callable[[Call], Timing], with_memory: bool) -> tuple[dict[str, Any], Any]:
    """(time_ms per step, timer, memory_mb) of a call, and its forward output taken before the timing."""
    output = call.output() if call.output else None
    timing = measure(call)
    found = {"time_ms": timing.median_ms / call.steps, "timer": {**timing.as_dict(), "steps": call.steps}}
    if with_memory and call.memory_mb:
        try:
            found["memory_mb"] = round(call.memory_mb(), 1)
        except Declined:
            pass
    return found, output


def _attempt(what: str, log: Callable[[str], None], build: Callable[[], Any]) -> Any:
    """build(), or None after saying why not (declined, or failed with the error's last line)."""
    try:
        return build()
    except Declined as reason:
        log(f"  {what}: declined: {reason}")
    except Exception as error:  # noqa: BLE001 - one failing implementation must not end the run
        detail = traceback.format_exception_only(type(error), error)[-1].strip()
        log(f"  {what}: failed: {detail[:400]}")
    return None


def _rounded(fields: dict[str, Any]) -> dict[str, Any]:
    """Numbers to 6 significant digits (what a timing can tell)."""
    return {key: float(f"{value:.6g}") if isinstance(value, float) else value for key, value in fields.items()}


def _throughput(workload: Workload, shape: Shape, mode: str, dtype: Any, time_ms: float) -> dict[str, float]:
    work = workload.work(shape, mode, dtype)
    seconds = time_ms * 1e-3
    found = {}
    if work.flops:
        found["tflops"] = float(f"{work.flops / seconds / 1e12:.4g}")
    if work.bytes:
        found["gbps"] = float(f"{work.bytes / seconds / 1e9:.4g}")
    return found


def _anchor_entries(found: dict[str, tuple[dict, Any]], time_ms: float, output: Any) -> dict[str, dict]:
    entries = {}
    for name, (measured, theirs) in found.items():
        entry = {**measured, "ratio": round(time_ms / measured["time_ms"], 4)}
        if output is not None and theirs is not None:
            entry["rel_diff"] = float(f"{relative_difference(output, theirs):.2e}")
        entries[name] = {**entry, "time_ms": round(measured["time_ms"], 6)}
    return entries


def _describe(row: dict[str, Any]) -> str:
    speed = " ".join(f"{row[k]} {unit}" for k, unit in (("tflops", "TFLOP/s"), ("gbps", "GB/s")) if k in row)
    theirs = "".join(f"; {name} {entry['time_ms']:.4g} ms (ours / {name} {entry['ratio']:.2f})"
                     for name, entry in row["anchors"].items())
    return f"  {row['impl']}: {row['time_ms']:.4g} ms {speed}{theirs}"


def run(options: Options) -> list[dict[str, Any]]:
    """Measure every (shape, mode, impl) of the options; returns the rows (also appended to the results)."""
    workload = WORKLOADS[options.op]
    dtype = DTYPES[options.dtype]
    device = jax.devices()[0]
    folder = results.device_dir(device.device_kind)
    commit, dirty = results.git_state()
    if commit is None and options.commit:
        commit = options.commit
    measure = lambda call: time_call(call.run, call.framework, options.budget)  # noqa: E731
    every_row = []
    for shape in map(parse, options.shapes):
        if shape.family not in workload.families:
            raise ValueError(f"--shapes: {options.op} takes shapes of families {workload.families}, "
                             f"got {shape.name!r}")
        inputs = workload.inputs(shape, dtype)
        rows = []
        for mode in options.modes:
            if mode not in workload.modes:
                options.log(f"{shape.name} {mode}: {options.op} is timed in modes {workload.modes}; skipped")
                continue
            options.log(f"{shape.name} {options.dtype} {mode} on {device.device_kind}")
            extras = _rounded((workload.extras and _attempt("extras", options.log, lambda: workload.extras(
                shape, inputs, mode, measure))) or {})
            found = {}
            for name in options.anchors:
                measured = _attempt(name, options.log, lambda: _measured(
                    anchors.build(name, options.op, shape, inputs, mode), measure, not options.smoke))
                if measured:
                    found[name] = measured
            versions = results.versions({k: v for name in found for k, v in anchors.versions(name).items()})
            for impl in options.impls:
                measured = _attempt(impl, options.log, lambda: _measured(
                    workload.ours(impl, shape, inputs, mode), measure, not options.smoke))
                if not measured:
                    continue
                (ours, output) = measured
                compared = _anchor_entries(found, ours["time_ms"], output)
                base = base_revision.anchor_entry(
                    options.base_rows, (options.op, impl, shape.name, options.dtype, mode), ours["time_ms"])
                if base:
                    compared["base"] = base
                row = {
                    "op": options.op, "impl": impl, "shape": shape.name, "dtype": options.dtype, "mode": mode,
                    "time_ms": round(ours["time_ms"], 6),
                    **_throughput(workload, shape, mode, dtype, ours["time_ms"]),
                    "anchors": compared,
                    "extras": {**extras, **({"memory_mb": ours["memory_mb"]} if "memory_mb" in ours else {})},
                    "timer": ours["timer"], "device": device.device_kind, "platform": device.platform,
                    "versions": versions, "commit": commit, "dirty": dirty, "command": options.command,
                }
                if options.smoke:
                    row["smoke"] = True
                options.log(_describe(row))
                rows.append(row)
        if rows:
            path = results.append(rows, options.out, folder, options.op)
            options.log(f"  {len(rows)} rows appended to {path}")
        every_row += rows
    return every_row
