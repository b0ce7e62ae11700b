"""Would KDA decode move its state faster with several requests per program? (an experiment; H200)

The library's decode kernel (`pallas_decode.fused_recurrent_decode`) runs one program per (value
block, head, request): load the [K, BV] state tile, update it, store it. At B >= 64 it moved state
at 76-83% of the copy bandwidth. Here one program walks `rows` requests in a loop, so that Triton's
software pipeliner (num_stages >= 2) can issue the next request's state load while the current one
computes (the loop's loads depend only on the loop index). Same math as the benchmark's step: L2
norm, scale, the bounded gate, beta logits, K-first state [B, H, K, V] updated in place.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kda_decode_pipelined.py --check   # vs the library
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/kda_decode_pipelined.py
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_decode_gpu import DIM, LOWER_BOUND, decode_loop, make_inputs, pallas_step, rel, time_loop  # noqa: E402
from timing import print_table  # noqa: E402

from hybrax.ops.kda.pallas_decode import _log_decay  # noqa: E402
from hybrax.ops.kda.xla_scan import l2_normalize  # noqa: E402


def _pipelined_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, state_in_ref, o_ref, state_ref,
    *, block_v: int, rows: int, group: int, scale: float,
):
    del state_in_ref  # aliased to state_ref
    j, head, block = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)

    def request(i, carry):
        b = block * rows + i
        state = state_ref[b, head, :, cols]
        q = l2_normalize(q_ref[b, 0, head // group, :].astype(jnp.float32))
        k = l2_normalize(k_ref[b, 0, head // group, :].astype(jnp.float32))
        decay = _log_decay(
            g_ref[b, 0, head, :].astype(jnp.float32), a_log_ref, dt_bias_ref, LOWER_BOUND, head, "bounded"
        )
        beta = jax.nn.sigmoid(beta_ref[b, 0, head].astype(jnp.float32))
        state = state * jnp.exp(decay)[:, None]
        error = v_ref[b, 0, head, cols].astype(jnp.float32) - jnp.sum(state * k[:, None], axis=0)
        state = state + k[:, None] * (beta * error)[None, :]
        o_ref[b, 0, head, cols] = jnp.sum(state * (q * scale)[:, None], axis=0).astype(o_ref.dtype)
        state_ref[b, head, :, cols] = state
        return carry

    lax.fori_loop(0, rows, request, 0)


@functools.partial(jax.jit, static_argnames=("rows", "block_v", "num_warps", "num_stages", "interpret"))
def pipelined_step(inputs, state, *, rows=4, block_v=64, num_warps=4, num_stages=2, interpret=False):
    """One decode step of B requests, `rows` per program (B a multiple of rows); (o, new state)."""
    q, k, v, g, beta, a_log, dt_bias = inputs
    batch, _, heads, dv = v.shape
    kernel = functools.partial(
        _pipelined_kernel, block_v=min(block_v, dv), rows=rows, group=heads // q.shape[2], scale=q.shape[-1] ** -0.5
    )
    return pl.pallas_call(
        kernel,
        grid=(dv // min(block_v, dv), heads, batch // rows),
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        input_output_aliases={7: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_decode_pipelined",
    )(q, k, v, g, beta, a_log, dt_bias, state)


def check_on_cpu() -> None:
    inputs, state = make_inputs(0, 8, 2, 32)
    want = pallas_step(inputs, state, block_v=16, interpret=True)
    for rows in (1, 4, 8):
        got = pipelined_step(inputs, state, rows=rows, block_v=16, interpret=True)
        errors = [rel(a, b) for a, b in zip(got, want)]
        print(f"rows {rows}: errors (o, state) " + " ".join(f"{e:.1e}" for e in errors))
        assert max(errors) < 1e-6, errors


def time_on_gpu() -> None:
    from kda_decode_gpu import copy_bandwidth

    copy = copy_bandwidth()
    table = []
    for batch, heads, steps in ((64, 32, 200), (256, 32, 60), (1024, 16, 60)):
        inputs, state = make_inputs(batch, batch, heads, DIM)
        traffic = 2 * batch * heads * DIM * DIM * 4
        variants = {"library bv64w4": functools.partial(pallas_step, block_v=64, num_warps=4)}
        for rows in (2, 4, 8):
            for num_stages in (1, 2, 3):
                variants[f"rows{rows} s{num_stages}"] = functools.partial(
                    pipelined_step, rows=rows, num_stages=num_stages
                )
        for name, step in variants.items():
            try:
                seconds, state = time_loop(decode_loop(step, steps), state, inputs, steps)
                row = {"B": batch, "H": heads, "variant": name, "us": f"{seconds * 1e6:.1f}",
                       "of_copy": f"{traffic / seconds / copy:.0%}"}
            except Exception as exc:  # keep the other variants' numbers
                row = {"B": batch, "H": heads, "variant": name, "error": f"{type(exc).__name__}: {exc}"[:160]}
            print(row, flush=True)
            table.append(row)
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s")
    print_table(table, ["B", "H", "variant", "us", "of_copy", "error"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with the library on the CPU (interpret)")
    check_on_cpu() if parser.parse_args().check else time_on_gpu()
