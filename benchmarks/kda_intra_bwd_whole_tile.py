"""Would the KDA backward's pass through A_qk and A_kk be faster from whole [C, C] tiles? (an experiment; H200)

The library's `pallas_chunk_intra_bwd` takes dA_qk and dA_kk in 16x16 blocks (four dots per block pair
per K slice). This variant takes them whole: per K slice and per sub-chunk a, the rows of a of
P = dA_qk and D = dA_kk against every column ([C, C] x [C, BK] dots; 3/4 of each left operand is
zeros), with exp(G_i - G_j) split at a's first row as in the library. In a chunk with a steep
sub-chunk (decay above STEEP within 16 rows) the diagonal blocks leave the dots and are taken column
by column instead.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kda_intra_bwd_whole_tile.py --check   # vs the library
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/kda_intra_bwd_whole_tile.py
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
from kda_chunk_gpu import make_inputs, rel, time_jax  # noqa: E402
from timing import print_table  # noqa: E402

from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum  # noqa: E402
from hybrax.ops.kda.pallas_chunk_fwd import prepare_qk  # noqa: E402
from hybrax.ops.kda.pallas_chunk_intra_bwd import chunk_intra_bwd  # noqa: E402
from hybrax.ops.kda.pallas_chunk_intra import STEEP  # noqa: E402
from hybrax.ops.kda.pallas_tiles import (  # noqa: E402
    SUB, chunk_column_spec, chunk_rows_spec, index_grid, mm, mm_tn, solve_precision,
)


def _exact_diagonal(p, d, r, queries, keys, gates, k_ref, g_ref, slice_k, diagonal):
    """(Y_q, Y_k, Z) of the diagonal blocks only, column by column from exp(min(G_i - G_j, 0))."""
    chunk = p.shape[0]
    _, columns = index_grid(chunk)
    rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)

    def column(j, sums):
        y_q, y_k, z = sums
        pick = (columns == j) & diagonal
        decay = jnp.exp(jnp.minimum(gates - g_ref[j, slice_k][None, :], 0.0))
        decayed_key = k_ref[j, slice_k].astype(jnp.float32)[None, :] * decay
        p_column, d_column, r_column = (jnp.sum(jnp.where(pick, x, 0.0), axis=1)[:, None] for x in (p, d, r))
        z_row = jnp.sum((p_column * queries + r_column * keys) * decay, axis=0)
        return y_q + p_column * decayed_key, y_k + d_column * decayed_key, jnp.where(rows == j, z_row[None, :], z)

    zeros = jnp.zeros(gates.shape, jnp.float32)
    return lax.fori_loop(0, chunk, column, (zeros, zeros, zeros))


def _whole_tile_kernel(
    q_ref, k_ref, g_ref, beta_ref, daqk_ref, dakk_ref, dq_ref, dk_ref, dg_ref, dbeta_ref,
    *, block_k, precision, masked,
):
    chunk = q_ref.shape[0]
    n_sub = chunk // SUB
    rows, cols = index_grid(chunk)
    diagonal = (rows // SUB) == (cols // SUB)
    steep = functools.reduce(
        jnp.logical_or, [jnp.max(g_ref[a * SUB, :] - g_ref[a * SUB + SUB - 1, :]) > STEEP for a in range(n_sub)]
    )
    betas = beta_ref[...].astype(jnp.float32)[:, None]
    p, d = daqk_ref[...], dakk_ref[...]
    r = d * betas
    # In a steep chunk the diagonal blocks leave the factored dots (their clamped factors are wrong there).
    factored = [jnp.where(steep & diagonal, 0.0, x) for x in (p, d, r)]

    def slice_pass(index, dbeta):
        slice_k = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        gates = g_ref[:, slice_k]
        queries, keys = q_ref[:, slice_k].astype(jnp.float32), k_ref[:, slice_k].astype(jnp.float32)
        sub_chunk = lax.broadcasted_iota(jnp.int32, gates.shape, 0) // SUB
        row_block = rows // SUB
        zeros = jnp.zeros(gates.shape, jnp.float32)
        y_q, y_k, z = zeros, zeros, zeros
        for a in range(n_sub):
            start = g_ref[a * SUB, slice_k][None, :]
            in_a = sub_chunk == a
            to_start = jnp.where(in_a, jnp.exp(jnp.where(in_a, gates - start, 0.0)), 0.0)
            from_start = jnp.exp(jnp.minimum(start - gates, STEEP))
            right = keys * from_start
            if masked:
                p_a, d_a, r_a = (jnp.where(row_block == a, x, 0.0) for x in factored)
                y_q = y_q + mm(p_a, right, jnp.float32, precision) * to_start
                y_k = y_k + mm(d_a, right, jnp.float32, precision) * to_start
            else:  # rows outside a are dropped by to_start (zero there) instead of masked operands
                p_a, r_a = factored[0], factored[2]
                y_q = y_q + jnp.where(in_a, mm(p_a, right, jnp.float32, precision), 0.0) * to_start
                y_k = y_k + jnp.where(in_a, mm(factored[1], right, jnp.float32, precision), 0.0) * to_start
            column = mm_tn(p_a, queries * to_start, jnp.float32, precision)
            z = z + (column + mm_tn(r_a, keys * to_start, jnp.float32, precision)) * from_start
        exact = lax.cond(
            steep,
            lambda: _exact_diagonal(p, d, r, queries, keys, gates, k_ref, g_ref, slice_k, diagonal),
            lambda: (zeros, zeros, zeros),
        )
        y_q, y_k, z = y_q + exact[0], y_k + exact[1], z + exact[2]
        dq_ref[:, slice_k] = y_q
        dk_ref[:, slice_k] = betas * y_k + z
        dg_ref[:, slice_k] = queries * y_q + betas * keys * y_k - keys * z
        return dbeta + jnp.sum(keys * y_k, axis=1)

    dbeta_ref[...] = lax.fori_loop(0, q_ref.shape[1] // block_k, slice_pass, jnp.zeros((chunk,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "num_warps", "masked", "interpret"))
def intra_bwd_whole_tile(
    q, k, g, beta, daqk, dakk, *, chunk=64, block_k=32, num_warps=4, masked=False, interpret=False
):
    """`chunk_intra_bwd`'s contract: dq, dk, dG [B, T, HV, K] and dbeta [B, T, HV], fp32."""
    batch, length, heads, dk = q.shape
    value_heads = g.shape[2]
    group = value_heads // heads
    rows = functools.partial(chunk_rows_spec, chunk)
    keys_out = jax.ShapeDtypeStruct((batch, length, value_heads, dk), jnp.float32)
    kernel = functools.partial(
        _whole_tile_kernel, block_k=min(block_k, dk), precision=solve_precision(interpret, q.dtype), masked=masked
    )
    return pl.pallas_call(
        kernel,
        grid=(length // chunk, value_heads, batch),
        in_specs=[rows(dk, group), rows(dk, group), rows(dk), chunk_column_spec(chunk), rows(chunk), rows(chunk)],
        out_specs=[rows(dk), rows(dk), rows(dk), chunk_column_spec(chunk)],
        out_shape=[keys_out, keys_out, keys_out, jax.ShapeDtypeStruct((batch, length, value_heads), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_intra_bwd_whole_tile",
    )(q, k, g, beta, daqk, dakk)


def _inputs(shape, dtype, hard=False):
    """Prepared q, k, G, beta and random masked dA_qk, dA_kk as the backward sees them."""
    q, k, v, g, beta = make_inputs(3, *shape)
    q, k = q.astype(dtype), k.astype(dtype)
    if hard:
        g = jnp.where(jax.random.bernoulli(jax.random.key(7), 0.1, g.shape[:3])[..., None], -1000.0, g)
    qn, kn = prepare_qk(q, k, shape[3] ** -0.5, True)
    gates = chunk_local_cumsum(g, chunk=64, interpret=jax.default_backend() != "gpu")
    rows = jnp.arange(shape[1]) % 64
    lower = rows[:, None] >= jnp.arange(64)[None, :]
    daqk = jnp.where(lower[None, :, None, :], jax.random.normal(jax.random.key(8), (*shape[:3], 64)), 0.0)
    strict = rows[:, None] > jnp.arange(64)[None, :]
    dakk = jnp.where(strict[None, :, None, :], jax.random.normal(jax.random.key(9), (*shape[:3], 64)), 0.0)
    return qn, kn, gates, beta, daqk, dakk


def check_on_cpu() -> None:
    for hard in (False, True):
        args = _inputs((1, 128, 2, 64), jnp.float32, hard)
        want = chunk_intra_bwd(*args, interpret=True)
        for block_k, masked in ((16, False), (64, False), (16, True)):
            got = intra_bwd_whole_tile(*args, block_k=block_k, masked=masked, interpret=True)
            errors = [rel(a, b) for a, b in zip(got, want)]
            print(f"hard gates {hard}, block_k {block_k}: errors (dq, dk, dG, dbeta)",
                  " ".join(f"{e:.1e}" for e in errors))
            assert max(errors) < 1e-5, errors


def time_on_gpu() -> None:
    args = _inputs((1, 8192, 32, 128), jnp.bfloat16)
    want = jax.block_until_ready(chunk_intra_bwd(*args))
    variants = {"library (k32w4)": chunk_intra_bwd}
    for block_k, num_warps, masked in ((16, 4, False), (32, 4, False), (16, 2, False), (32, 8, False), (16, 4, True)):
        variants[f"whole tile k{block_k}w{num_warps}{' masked' if masked else ''}"] = functools.partial(
            intra_bwd_whole_tile, block_k=block_k, num_warps=num_warps, masked=masked
        )
    rows = []
    for name, fn in variants.items():
        try:
            fn = jax.jit(fn)
            got = fn(*args)
            row = {"variant": name, "ms": f"{time_jax(fn, *args):.3f}",
                   "err_vs_library": "/".join(f"{rel(a, b):.0e}" for a, b in zip(got, want))}
        except Exception as exc:  # keep the other variants' numbers
            row = {"variant": name, "error": f"{type(exc).__name__}: {exc}"[:160]}
        print(row, flush=True)
        rows.append(row)
    print_table(rows, ["variant", "ms", "err_vs_library", "error"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true", help="compare with the library on the CPU (interpret)")
    check_on_cpu() if parser.parse_args().check else time_on_gpu()
