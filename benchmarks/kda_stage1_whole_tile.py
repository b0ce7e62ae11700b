"""Would stage 1 of the KDA forward be faster from whole [C, C] tiles? (an experiment; H200)

The library's stage 1 (`pallas_chunk_solve` + `pallas_chunk_wy`) builds A_kk and A_qk from 16x16
blocks (ten block pairs x two dots per K slice, then 16x16 inverses and their merge) and is
latency-bound on those small dependent dots. This variant builds the whole [C, C] matrices with
C/16 masked [C, BK] x [BK, C] dots per K slice (one per sub-chunk a: the rows of a against every
column, with exp(G_i - G_j) split at a's first row as in `pallas_chunk_solve`; only a's rows are
nonzero on the left, so 3/4 of each product is zeros that the tensor cores absorb), inverts I + A_kk
by doubling on the whole tile (log2 C rounds of two [C, C] dots), and fuses stage 1b (w, u, kg, qg,
decay). Steep sub-chunks (a decay above STEEP within 16 rows) take their diagonal blocks column by
column, as in the library.

    # CPU: check it against the library's stage 1 in interpret mode (small shapes)
    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kda_stage1_whole_tile.py --check
    # GPU: time both at (1, 8192, 32, 128) bf16, and the forward's error with each
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/kda_stage1_whole_tile.py
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
from kda_chunk_gpu import make_inputs, recurrence_fp32, rel, time_jax  # noqa: E402
from timing import print_table  # noqa: E402

from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum  # noqa: E402
from hybrax.ops.kda.pallas_chunk_fwd import prepare_qk  # noqa: E402
from hybrax.ops.kda.pallas_chunk_output import chunk_output  # noqa: E402
from hybrax.ops.kda.pallas_chunk_solve import STEEP, chunk_solve, unit_lower_inverse  # noqa: E402
from hybrax.ops.kda.pallas_chunk_state import chunk_state  # noqa: E402
from hybrax.ops.kda.pallas_chunk_wy import chunk_wy  # noqa: E402
from hybrax.ops.kda.pallas_tiles import (  # noqa: E402
    SUB, chunk_column_spec, chunk_rows_spec, dot_settings, index_grid, mm, mm_t, solve_precision,
)


def _exact_diagonal(q_ref, k_ref, g_ref) -> tuple[jax.Array, jax.Array]:
    """A_kk, A_qk (unscaled) column by column from exp(min(G_i - G_j, 0)); callers keep the diagonal blocks."""
    keys, queries, gates = (ref[...].astype(jnp.float32) for ref in (k_ref, q_ref, g_ref))
    _, cols = index_grid(q_ref.shape[0])

    def column(j, blocks):
        akk, aqk = blocks
        decayed = k_ref[j, :].astype(jnp.float32)[None, :] * jnp.exp(jnp.minimum(gates - g_ref[j, :][None, :], 0.0))
        akk = jnp.where(cols == j, jnp.sum(keys * decayed, axis=1)[:, None], akk)
        aqk = jnp.where(cols == j, jnp.sum(queries * decayed, axis=1)[:, None], aqk)
        return akk, aqk

    zeros = jnp.zeros((q_ref.shape[0],) * 2, jnp.float32)
    return lax.fori_loop(0, q_ref.shape[0], column, (zeros, zeros))


def _whole_tile_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, inverse_ref, aqk_ref, w_ref, u_ref, kg_ref, qg_ref, decay_ref,
    *, block_k, block_v, precision, compute_dtype, wy_precision,
):
    chunk, dk = q_ref.shape
    dv = v_ref.shape[1]
    n_sub = chunk // SUB
    rows, cols = index_grid(chunk)

    def accumulate(index, sums):
        akk, aqk = sums
        slice_k = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        gates = g_ref[:, slice_k]
        keys, queries = k_ref[:, slice_k].astype(jnp.float32), q_ref[:, slice_k].astype(jnp.float32)
        sub_chunk = lax.broadcasted_iota(jnp.int32, gates.shape, 0) // SUB
        for a in range(n_sub):
            start = g_ref[a * SUB, slice_k][None, :]
            in_a = sub_chunk == a
            to_start = jnp.where(in_a, jnp.exp(jnp.where(in_a, gates - start, 0.0)), 0.0)
            right = keys * jnp.exp(jnp.minimum(start - gates, STEEP))
            akk = akk + mm_t(keys * to_start, right, jnp.float32, precision)
            aqk = aqk + mm_t(queries * to_start, right, jnp.float32, precision)
        return akk, aqk

    zeros = jnp.zeros((chunk, chunk), jnp.float32)
    akk, aqk = lax.fori_loop(0, dk // block_k, accumulate, (zeros, zeros))
    steep = functools.reduce(
        jnp.logical_or, [jnp.max(g_ref[a * SUB, :] - g_ref[a * SUB + SUB - 1, :]) > STEEP for a in range(n_sub)]
    )
    exact_kk, exact_qk = lax.cond(steep, lambda: _exact_diagonal(q_ref, k_ref, g_ref), lambda: (akk, aqk))
    diagonal = (rows // SUB) == (cols // SUB)
    akk, aqk = jnp.where(diagonal, exact_kk, akk), jnp.where(diagonal, exact_qk, aqk)
    betas = beta_ref[...].astype(jnp.float32)[:, None]
    inverse = unit_lower_inverse(jnp.where(rows > cols, akk * betas, 0.0), precision)
    inverse_ref[...] = inverse.astype(inverse_ref.dtype)
    aqk_ref[...] = jnp.where(rows >= cols, aqk, 0.0).astype(aqk_ref.dtype)

    def wy_keys(index, carry):
        slice_k = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        gates = g_ref[:, slice_k]
        last = g_ref[chunk - 1, slice_k]
        keys = k_ref[:, slice_k].astype(jnp.float32)
        w_ref[:, slice_k] = mm(inverse, keys * betas * jnp.exp(gates), compute_dtype, wy_precision).astype(w_ref.dtype)
        kg_ref[:, slice_k] = (keys * jnp.exp(last[None, :] - gates)).astype(kg_ref.dtype)
        qg_ref[:, slice_k] = (q_ref[:, slice_k].astype(jnp.float32) * jnp.exp(gates)).astype(qg_ref.dtype)
        decay_ref[slice_k] = jnp.exp(last)
        return carry

    def wy_values(index, carry):
        slice_v = pl.ds(pl.multiple_of(index * block_v, block_v), block_v)
        values = v_ref[:, slice_v].astype(jnp.float32)
        u_ref[:, slice_v] = mm(inverse, values * betas, compute_dtype, wy_precision).astype(u_ref.dtype)
        return carry

    lax.fori_loop(0, dk // block_k, wy_keys, 0)
    lax.fori_loop(0, dv // block_v, wy_values, 0)


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "block_v", "num_warps", "interpret"))
def stage1_whole_tile(q, k, v, g, beta, *, chunk=64, block_k=32, block_v=64, num_warps=4, interpret=False):
    """The library's chunk_solve + chunk_wy in one kernel: (T, A_qk), (w, u, kg, qg, decay)."""
    batch, length, heads, dk = q.shape
    dv, value_heads = v.shape[3], v.shape[2]
    group = value_heads // heads
    compute_dtype, wy_precision = dot_settings(q.dtype, interpret)
    kernel = functools.partial(
        _whole_tile_kernel, block_k=min(block_k, dk), block_v=min(block_v, dv),
        precision=solve_precision(interpret, q.dtype), compute_dtype=compute_dtype, wy_precision=wy_precision,
    )
    tokens = (batch, length, value_heads)
    rows = functools.partial(chunk_rows_spec, chunk)
    inverse, aqk, w, u, kg, qg, decay = pl.pallas_call(
        kernel,
        grid=(length // chunk, value_heads, batch),
        in_specs=[rows(dk, group), rows(dk, group), rows(dv), rows(dk), chunk_column_spec(chunk)],
        out_specs=[
            rows(chunk), rows(chunk), rows(dk), rows(dv), rows(dk), rows(dk),
            pl.BlockSpec((None, None, None, dk), lambda t, h, b: (b, t, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*tokens, chunk), q.dtype), jax.ShapeDtypeStruct((*tokens, chunk), q.dtype),
            jax.ShapeDtypeStruct((*tokens, dk), q.dtype), jax.ShapeDtypeStruct((*tokens, dv), q.dtype),
            jax.ShapeDtypeStruct((*tokens, dk), q.dtype), jax.ShapeDtypeStruct((*tokens, dk), q.dtype),
            jax.ShapeDtypeStruct((batch, length // chunk, value_heads, dk), jnp.float32),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_stage1_whole_tile",
    )(q, k, v, g, beta)
    return (inverse, aqk), (w, u, kg, qg, decay)


def library_stage1(q, k, v, g, beta, *, interpret=False):
    inverse, aqk = chunk_solve(q, k, g, beta, interpret=interpret)
    return (inverse, aqk), chunk_wy(q, k, v, g, beta, inverse, interpret=interpret)


def check_on_cpu() -> None:
    """Both stage 1s on the same small inputs in interpret mode (fp32), mild and -1000 gates."""
    for hard in (False, True):
        q, k, v, g, beta = (x.astype(jnp.float32) for x in make_inputs(3, 1, 128, 2, 64))
        if hard:
            g = jnp.where(jax.random.bernoulli(jax.random.key(7), 0.1, g.shape[:3])[..., None], -1000.0, g)
        qn, kn = prepare_qk(q, k, 64**-0.5, True)
        gates = chunk_local_cumsum(g, chunk=64, interpret=True)
        want = jax.tree.leaves(library_stage1(qn, kn, v, gates, beta, interpret=True))
        for block_k in (16, 64):
            got = jax.tree.leaves(stage1_whole_tile(qn, kn, v, gates, beta, block_k=block_k, interpret=True))
            errors = [rel(a, b) if jnp.any(b != 0) else float(jnp.max(jnp.abs(a))) for a, b in zip(got, want)]
            print(f"hard gates {hard}, block_k {block_k}: errors (T, A_qk, w, u, kg, qg, decay)",
                  " ".join(f"{e:.1e}" for e in errors))
            assert max(errors) < 1e-5, errors


def forward_error(stage1, q, k, v, g, beta, ref_out, scale):
    qn, kn = prepare_qk(q, k, scale, True)
    gates = chunk_local_cumsum(g, chunk=64)
    (_, aqk), (w, u, kg, qg, decay) = stage1(qn, kn, v, gates, beta)
    h, v_new, _ = chunk_state(w, u, kg, decay, None)
    return rel(chunk_output(qg, h, aqk, v_new).astype(jnp.float32), ref_out)


def time_on_gpu() -> None:
    shape = (1, 8192, 32, 128)
    scale = shape[3] ** -0.5
    q, k, v, g, beta = make_inputs(0, *shape)
    ref_out, _ = recurrence_fp32(q, k, v, g, beta)
    qn, kn = prepare_qk(q, k, scale, True)
    gates = chunk_local_cumsum(g, chunk=64)
    variants = {"library (solve k16w2 + wy w4)": library_stage1}
    for block_k, num_warps in ((16, 2), (16, 4), (32, 4), (32, 8), (64, 4), (64, 8)):
        variants[f"whole tile k{block_k}w{num_warps}"] = functools.partial(
            stage1_whole_tile, block_k=block_k, num_warps=num_warps
        )
    rows = []
    for name, stage1 in variants.items():
        try:
            fn = jax.jit(stage1)
            row = {"variant": name, "stage1_ms": f"{time_jax(fn, qn, kn, v, gates, beta):.3f}",
                   "err_out": f"{forward_error(fn, q, k, v, g, beta, ref_out, scale):.1e}"}
        except Exception as exc:  # keep the other variants' numbers
            row = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:160]}
        print(row, flush=True)
        rows.append(row)
    print_table(rows, ["variant", "stage1_ms", "err_out", "error"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with the library on the CPU (interpret)")
    check_on_cpu() if parser.parse_args().check else time_on_gpu()
