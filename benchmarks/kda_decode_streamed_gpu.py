"""Experiment: the KDA decode step with the state tiles streamed through shared memory (H200).

Why: the library's step (one program per [K, BV] tile) holds every tile in registers from its load to its
store, so the bytes in flight per SM are capped by the register file; it moves the state at 80-84% of the
copy bandwidth (BENCHMARKS.md), a loads-only kernel of the same grid at 87-92%. Here a fixed number of
programs each walk many tiles in a loop, and both reductions over K are one dot, [16, K] x [K, BV] (row 0
k * exp(g), row 1 q * exp(g), the rest zeros; fp32 through three tf32 passes, or one, the chunked kernels'
precision for bf16 inputs, ~1e-4 relative): a load that feeds a dot in
a loop is what Triton's software pipeliner turns into asynchronous copies into shared memory, issued
`num_stages - 1` tiles ahead. Same math as the library step (seed 003's bounded gate, beta logits).

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site:src python3 benchmarks/kda_decode_streamed_gpu.py
    JAX_PLATFORMS=cpu PYTHONPATH=src python3 benchmarks/kda_decode_streamed_gpu.py --smoke   # interpret mode

Prints, per case, µs per step in the decode loop of kda_decode_gpu.py and % of the copy bandwidth for the
library step and each streamed launch (programs per SM x block_v x num_warps x num_stages), and each
one's largest relative difference from the library step after one step.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_decode_gpu import (  # noqa: E402
    LOWER_BOUND, copy_bandwidth, decode_loop, make_inputs, pallas_step, rel, time_loop,
)

from hybrax.ops.kda.pallas_decode import _log_decay, launch_params  # noqa: E402
from hybrax.ops.kda.pallas_tiles import BF16_INPUT_PRECISION, EXACT, FP32_INPUT_PRECISION  # noqa: E402
from hybrax.ops.kda.xla_scan import l2_normalize  # noqa: E402

SMS = 132
LHS_ROWS = 16  # the smallest M of a Triton dot


def _streamed_kernel(scale_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, state_in_ref,
                     o_ref, state_ref, *, block_v: int, programs: int, precision, reductions: str):
    del state_in_ref  # aliased to state_ref
    batch, heads, dk, dv = state_ref.shape
    blocks = dv // block_v
    tiles = batch * heads * blocks
    program = pl.program_id(0)
    lhs_row = lax.broadcasted_iota(jnp.int32, (LHS_ROWS, dk), 0)
    out_row = lax.broadcasted_iota(jnp.int32, (LHS_ROWS, block_v), 0)

    def tile_step(i, carry):
        n = program + i * programs
        j, head, b = n % blocks, (n // blocks) % heads, n // (blocks * heads)
        cols = pl.ds(pl.multiple_of(j * block_v, block_v), block_v)
        state = state_ref[b, head, :, cols]
        q, k = (l2_normalize(ref[b, 0, head, :].astype(jnp.float32)) for ref in (q_ref, k_ref))
        q = q * scale_ref[0]
        v = v_ref[b, 0, head, cols].astype(jnp.float32)
        decay = jnp.exp(_log_decay(g_ref[b, 0, head, :], a_log_ref[head], dt_bias_ref[head, :], LOWER_BOUND, "bounded"))
        beta = jax.nn.sigmoid(beta_ref[b, 0, head])
        if reductions != "elementwise":
            lhs = jnp.where(lhs_row == 0, (k * decay)[None, :], jnp.where(lhs_row == 1, (q * decay)[None, :], 0.0))
            reduced = jnp.dot(lhs, state, precision=precision, preferred_element_type=jnp.float32)
            decayed_k = jnp.sum(jnp.where(out_row == 0, reduced, 0.0), axis=0)  # S'^T k
            decayed_q = jnp.sum(jnp.where(out_row == 1, reduced, 0.0), axis=0)  # S'^T q
        if reductions != "dot":  # the library step's reductions
            decayed = state * decay[:, None]
            exact_k, decayed_q = jnp.sum(decayed * k[:, None], axis=0), jnp.sum(decayed * q[:, None], axis=0)
            # "trigger": the dot only makes Triton stream the tile through shared memory; kept alive at 0 x.
            decayed_k = exact_k + 0.0 * decayed_k if reductions == "trigger" else exact_k
        update = beta * (v - decayed_k)
        o_ref[b, 0, head, cols] = (decayed_q + jnp.sum(k * q) * update).astype(o_ref.dtype)
        state_ref[b, head, :, cols] = state * decay[:, None] + k[:, None] * update[None, :]
        return carry

    count = (tiles - program + programs - 1) // programs
    lax.fori_loop(0, count, tile_step, 0)


def streamed_step(inputs, state, *, per_sm: int, block_v: int, num_warps: int, num_stages: int, interpret: bool,
                  reductions: str = "dot", one_pass: bool = False):
    """reductions: "dot" (both as the dot), "elementwise" (the library step's sums, no dot), "trigger" (the
    library's sums, and a dot that only makes Triton stream the tile through shared memory). `one_pass`: the
    dot in one tf32 pass (bf16 inputs' precision in the chunked kernels) instead of three."""
    q, k, v, g, beta, a_log, dt_bias = inputs
    batch, heads, _, dv = state.shape
    programs = min(SMS * per_sm, batch * heads * (dv // block_v))
    precision = EXACT if interpret else BF16_INPUT_PRECISION if one_pass else FP32_INPUT_PRECISION
    kernel = functools.partial(_streamed_kernel, block_v=block_v, programs=programs, reductions=reductions,
                               precision=precision)
    scale = jnp.full((1,), q.shape[-1] ** -0.5, jnp.float32)
    return pl.pallas_call(
        kernel, grid=(programs,),
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        input_output_aliases={8: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret, name="kda_decode_streamed",
    )(scale, q, k, v, g, beta, a_log, dt_bias, state)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpret mode")
    parser.add_argument("--cases", default="64x32,256x32,1024x16,8x32", help="requests x heads")
    # Offline ptxas for sm_90 (upstream Triton 3.6, B = 64): with the three-pass dot every launch takes 255
    # registers (two programs of 4 warps per SM, one of 8); bv64 w4 spills 840 bytes, bv32 w4 none. One tf32
    # pass ("t"): 162 registers at bv32 w4, three programs per SM. "n": no dot (the library's reductions),
    # the same loop without asynchronous copies; "d": the library's reductions and a one-pass dot that only
    # streams the tile through shared memory (178 registers at bv32 w4: two programs per SM).
    parser.add_argument("--launches", default="2x32x4x3,2x32x4x4,1x64x8x3,2x64x4x3,3x32x4x3t,3x32x4x4t,"
                        "2x64x4x3t,2x32x4x3d,2x64x4x3d,2x32x4x3n", help="programs per SM x block_v x num_warps x "
                        "num_stages [n: no dot | t: one-pass dot | d: dot as a trigger]")
    args = parser.parse_args()
    cases = [(2, 2)] if args.smoke else [tuple(int(x) for x in c.split("x")) for c in args.cases.split(",")]
    launches = [(tuple(int(x) for x in c.rstrip("ntd").split("x")), c[-1] if c[-1] in "ntd" else "")
                for c in args.launches.split(",")]
    copy = None if args.smoke else copy_bandwidth()
    for batch, heads in cases:
        inputs, state = make_inputs(batch * 7 + heads, batch, heads, 128)
        steps = 3 if args.smoke else max(60, 12800 // batch)
        library = functools.partial(pallas_step, interpret=args.smoke, **launch_params(batch * heads, 128))
        o_ref, new_ref = library(inputs, state)
        row = {"B": batch, "H": heads}
        bytes_moved = 2 * batch * heads * 128 * 128 * 4
        for name, step in [("library", library)] + [
            (f"s{per_sm}bv{bv}w{w}st{stages}{kind}", functools.partial(
                streamed_step, per_sm=per_sm, block_v=bv, num_warps=w, num_stages=stages, interpret=args.smoke,
                reductions={"n": "elementwise", "d": "trigger"}.get(kind, "dot"), one_pass=kind in "td"))
            for (per_sm, bv, w, stages), kind in launches
        ]:
            try:
                o, new = step(inputs, state)
                diff = max(rel(o, o_ref), rel(new, new_ref))
                repeats = 1 if args.smoke else 5
                seconds, _ = time_loop(decode_loop(step, steps), jnp.copy(state), inputs, steps, repeats=repeats)
            except Exception as exc:  # a launch that fails to compile: say so, keep the others
                row[name] = f"failed: {type(exc).__name__}: {str(exc)[:160]}"
                continue
            percent = "" if copy is None else f" {100 * bytes_moved / seconds / copy:.1f}%"
            row[name] = f"{seconds * 1e6:.2f}us{percent} diff {diff:.1e}"
        print(json.dumps(row), flush=True)
        if args.smoke:
            assert all("failed" not in str(value) and float(str(value).split("diff ")[-1]) < 1e-5
                       for key, value in row.items() if key not in ("B", "H")), row


if __name__ == "__main__":
    main()
