"""KDA chunked forward on the H200: hybrax Pallas vs flash-linear-attention's Triton chunk_kda.

Run on the GPU machine (fla-core 0.6.0 wheel carried in .whl/):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site:src python3 benchmarks/kda_chunk_gpu.py

For every shape it first checks correctness at full size (ours and fla against an fp32
recurrence on the same inputs, and ours against fla), then times the forward (median of
event-timed runs for torch, median over rounds of back-to-back jitted calls for JAX), the three
Pallas stages alone, and reports peak memory. A short table is printed last; the full numbers go
to $OUT/kda_chunk_gpu.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import print_table  # noqa: E402

from hybrax.ops.kda.pallas_chunk_fwd import kda_chunk_fwd  # noqa: E402
from hybrax.ops.kda.pallas_chunk_intra import chunk_intra  # noqa: E402
from hybrax.ops.kda.pallas_chunk_output import chunk_output  # noqa: E402
from hybrax.ops.kda.pallas_chunk_state import chunk_state  # noqa: E402

SHAPES = [(1, 8192, 32, 128), (8, 2048, 16, 128), (1, 32768, 16, 128), (2, 16384, 16, 128)]


def make_inputs(seed: int, batch: int, length: int, heads: int, dim: int):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(keys[i], (batch, length, heads, dim), jnp.bfloat16) for i in range(3))
    # Per-channel log decay as in fla's own benchmark (fp32), beta through a sigmoid.
    g = -0.5 * jax.random.uniform(keys[3], (batch, length, heads, dim), jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, length, heads), jnp.float32))
    return q, k, v, g, beta


@jax.jit
def recurrence_fp32(q, k, v, g, beta):
    """Token-by-token fp32 recurrence (elementwise, no tf32): the full-size oracle."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)

    def step(state, xs):
        qt, kt, vt, gt, bt = xs
        state = state * jnp.exp(gt)[..., None]
        error = vt - jnp.sum(state * kt[..., None], axis=-2)
        state = state + (bt[..., None] * kt)[..., None] * error[..., None, :]
        return state, jnp.sum(state * qt[..., None], axis=-2)

    batch, _, heads, dk = q.shape
    state = jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    final, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), final


START = time.perf_counter()


def log(text: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {text}", file=sys.stderr, flush=True)


def rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def time_jax(fn, *args, reps: int = 20, rounds: int = 7) -> float:
    """Median over rounds of the mean time of `reps` back-to-back calls (ms)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps * 1e3)
    return statistics.median(times)


def jax_memory_mb(fn, *args) -> float:
    """Arguments + outputs + temporaries of the compiled function (what it holds at its peak)."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes) / 2**20


def fla_runner(q, k, v, g, beta):
    import torch
    from fla.ops.kda import chunk_kda

    tq, tk, tv, tg, tb = (torch.utils.dlpack.from_dlpack(x) for x in (q, k, v, g, beta))
    return lambda: chunk_kda(tq, tk, tv, tg, tb, use_qk_l2norm_in_kernel=True, output_final_state=True)


def bench_shape(shape, check: bool, with_fla: bool, with_stages: bool) -> dict:
    import torch
    from triton.testing import do_bench

    batch, length, heads, dim = shape
    row = {"shape": f"({batch},{length},{heads},{dim})"}
    q, k, v, g, beta = make_inputs(0, *shape)
    scale = dim ** -0.5
    ours = jax.jit(lambda q, k, v, g, beta: kda_chunk_fwd(q, k, v, g, beta, scale=scale))

    if check:
        out, final = jax.block_until_ready(ours(q, k, v, g, beta))
        log(f"{shape} ours compiled and ran")
        ref_out, ref_final = jax.block_until_ready(recurrence_fp32(q, k, v, g, beta))
        row["err_ours"] = f"{rel(out.astype(jnp.float32), ref_out):.1e}"
        row["err_state"] = f"{rel(final, ref_final):.1e}"
        log(f"{shape} fp32 recurrence ran: {row}")
    row["pallas_ms"] = f"{time_jax(ours, q, k, v, g, beta):.3f}"
    log(f"{shape} timed ours: {row}")
    if with_fla:
        fla = fla_runner(q, k, v, g, beta)
        if check:
            fla_out, fla_final = fla()
            torch.cuda.synchronize()
            fla_out = np.asarray(jnp.from_dlpack(fla_out.float().contiguous()))
            row["err_fla"] = f"{rel(fla_out, ref_out):.1e}"
            row["ours_vs_fla"] = f"{rel(out.astype(jnp.float32), fla_out):.1e}"
        fla_ms = do_bench(fla, warmup=25, rep=100, return_mode="median")
        row["fla_ms"] = f"{fla_ms:.3f}"
        row["ratio"] = f"{float(row['pallas_ms']) / fla_ms:.2f}"
        log(f"{shape} timed fla: {row}")
    if with_stages:
        # Each stage alone, on the inputs it sees inside the pipeline.
        intra = jax.jit(lambda q, k, v, g, beta: chunk_intra(q, k, v, g, beta, scale=scale, l2_normalize=True))
        w, u, kg, qg, aqk, decay = intra(q, k, v, g, beta)
        state = jax.jit(lambda w, u, kg, decay: chunk_state(w, u, kg, decay, None))
        h, v_new, _ = state(w, u, kg, decay)
        output = jax.jit(chunk_output)
        row["intra_ms"] = f"{time_jax(intra, q, k, v, g, beta):.3f}"
        row["state_ms"] = f"{time_jax(state, w, u, kg, decay):.3f}"
        row["output_ms"] = f"{time_jax(output, qg, h, aqk, v_new):.3f}"
        log(f"{shape} timed stages: {row}")
    if not with_fla:
        return row
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fla()
    torch.cuda.synchronize()
    row["fla_fwd_MB"] = f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}"
    row["pallas_fwd_MB"] = f"{jax_memory_mb(ours, q, k, v, g, beta):.0f}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-check", action="store_true")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--no-stages", action="store_true")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="how many of SHAPES to run")
    args = parser.parse_args()
    import torch

    print(f"GPU: {torch.cuda.get_device_name()}  jax {jax.__version__}  torch {torch.__version__}", flush=True)
    rows = []
    for shape in SHAPES[: args.shapes]:
        try:
            rows.append(bench_shape(shape, not args.no_check, not args.no_fla, not args.no_stages))
        except Exception as exc:  # keep the other shapes' numbers
            traceback.print_exc()
            rows.append({"shape": str(shape), "error": f"{type(exc).__name__}: {exc}"[:200]})
        print(json.dumps(rows[-1]), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kda_chunk_gpu.json"), "w") as f:
            json.dump(rows, f, indent=1)
    columns = ["shape", "err_ours", "err_state", "err_fla", "ours_vs_fla", "fla_ms", "pallas_ms", "ratio",
               "intra_ms", "state_ms", "output_ms", "fla_fwd_MB", "pallas_fwd_MB", "error"]
    print_table(rows, [c for c in columns if any(c in r for r in rows)])


if __name__ == "__main__":
    main()
