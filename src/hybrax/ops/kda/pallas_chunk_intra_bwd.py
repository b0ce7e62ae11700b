"""KDA chunked backward, through A_kk and A_qk (Pallas, Triton lowering).

One program per (chunk, value head, batch). With E_ijc = exp(G_ic - G_jc), P = dA_qk (j <= i) and
D = dA_kk (j < i), A_qk[i, j] = sum_c q_ic k_jc E_ijc and A_kk[i, j] = beta_i sum_c k_ic k_jc E_ijc give

    row side   Y_q[i] = sum_j P_ij k_j E_ij,   Y_k[i] = sum_j D_ij k_j E_ij
    column     Z[j]   = sum_i (P_ij q_i + beta_i D_ij k_i) E_ij
    dq = Y_q,  dk = beta Y_k + Z,  dbeta = sum_c k Y_k,  dG = q Y_q + beta k Y_k - k Z

Taken from whole [C, C] tiles, as the forward's `pallas_chunk_intra` builds them: per K slice and per
sub-chunk a (16 rows), the rows of a against every column in [C, C] x [C, BK] dots, with
exp(G_i - G_j) in `SubChunkDecay`'s factors (rows outside a are dropped by the row factor, zero there).
A chunk with a steep sub-chunk (decay above STEEP within 16 rows: the factors would overflow) takes
every slice column by column from exp(min(G_i - G_j, 0)) instead. Each K slice's rows of dq, dk, dG
are final when its pass ends. On the H200 at (1, 8192, 32, 128) the whole-tile form took 1.245 ms
against 1.346 for 16x16 block pairs (BENCHMARKS.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_chunk_intra import steep_chunk, sub_chunk_decay
from hybrax.ops.kda.pallas_tiles import (
    SUB, chunk_column_spec, chunk_rows_spec, index_grid, mm, mm_tn, pipeline_stages, solve_precision,
)


def _exact_slice(p, d, queries, keys, beta_keys, gates, k_ref, g_ref, slice_k):
    """(Y_q, Y_k, Z) of one K slice column by column from exp(min(G_i - G_j, 0)): no factor above 1."""
    chunk = p.shape[0]
    _, columns = index_grid(chunk)
    rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)

    def column(j, sums):
        y_q, y_k, z = sums
        decay = jnp.exp(jnp.minimum(gates - g_ref[j, slice_k][None, :], 0.0))
        decayed_key = k_ref[j, slice_k].astype(jnp.float32)[None, :] * decay
        p_column, d_column = (jnp.sum(jnp.where(columns == j, x, 0.0), axis=1)[:, None] for x in (p, d))
        z_row = jnp.sum((p_column * queries + d_column * beta_keys) * decay, axis=0)
        return y_q + p_column * decayed_key, y_k + d_column * decayed_key, jnp.where(rows == j, z_row[None, :], z)

    zeros = jnp.zeros(gates.shape, jnp.float32)
    return lax.fori_loop(0, chunk, column, (zeros, zeros, zeros))


def _factored_slice(p, d, queries, keys, beta_keys, gates, g_ref, slice_k, precision):
    """(Y_q, Y_k, Z) of one K slice from `SubChunkDecay`'s factors, per sub-chunk a: a's rows of Y
    against every column, and every row of Z against a's rows (wrong in steep chunks)."""
    decay = sub_chunk_decay(g_ref, gates, slice_k)
    keys_up, queries_down, beta_keys_down = keys * decay.up, queries * decay.down, beta_keys * decay.down
    y_q = y_k = z = jnp.zeros(gates.shape, jnp.float32)
    for a in range(gates.shape[0] // SUB):
        in_a = decay.sub_chunk == a
        link = decay.link(a)
        right = keys_up * link
        y_q = y_q + jnp.where(in_a, mm(p, right, jnp.float32, precision) * decay.down, 0.0)
        y_k = y_k + jnp.where(in_a, mm(d, right, jnp.float32, precision) * decay.down, 0.0)
        column = mm_tn(p, jnp.where(in_a, queries_down, 0.0), jnp.float32, precision)
        column = column + mm_tn(d, jnp.where(in_a, beta_keys_down, 0.0), jnp.float32, precision)
        z = z + column * decay.up * link
    return y_q, y_k, z


def _intra_bwd_kernel(
    q_ref, k_ref, g_ref, beta_ref, daqk_ref, dakk_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, *, block_k, precision
):
    chunk = q_ref.shape[0]
    steep = steep_chunk(g_ref)
    betas = beta_ref[...].astype(jnp.float32)[:, None]
    # Z's dA_kk term sums d_ij beta_i k_i over rows i: beta goes with the keys, so no [C, C] tile of
    # d beta is held.
    p, d = daqk_ref[...], dakk_ref[...]

    def slice_pass(index, dbeta):
        slice_k = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        gates = g_ref[:, slice_k]
        queries, keys = q_ref[:, slice_k].astype(jnp.float32), k_ref[:, slice_k].astype(jnp.float32)
        beta_keys = betas * keys
        # In a steep chunk the factored pass runs on clamped factors and its (wrong) result is discarded
        # for the exact one's: zeroed copies of p and d for it would hold 64 more registers per thread.
        factored = _factored_slice(p, d, queries, keys, beta_keys, gates, g_ref, slice_k, precision)
        y_q, y_k, z = lax.cond(
            steep, lambda: _exact_slice(p, d, queries, keys, beta_keys, gates, k_ref, g_ref, slice_k),
            lambda: factored,
        )
        dq_ref[:, slice_k] = y_q
        dk_ref[:, slice_k] = betas * y_k + z
        # betas * keys again, not beta_keys: keeping that tile live to here spilled more (600 bytes vs 572).
        dg_ref[:, slice_k] = queries * y_q + betas * keys * y_k - keys * z
        return dbeta + jnp.sum(keys * y_k, axis=1)

    dbeta_ref[...] = lax.fori_loop(0, q_ref.shape[1] // block_k, slice_pass, jnp.zeros((chunk,), jnp.float32))


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "num_warps", "num_stages", "interpret"))
def chunk_intra_bwd(
    q: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array, daqk: jax.Array, dakk: jax.Array, *,
    chunk: int = 64, block_k: int = 16, num_warps: int = 4, num_stages: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """q, k [B, T, H, K] (prepared); g [B, T, HV, K] (G, fp32); beta [B, T, HV]; dA_qk, dA_kk
    [B, T, HV, chunk] fp32 (masked).

    Returns dq, dk, dG [B, T, HV, K] and dbeta [B, T, HV], fp32, per value head.
    """
    batch, length, heads, dk = q.shape
    value_heads = g.shape[2]
    group = value_heads // heads
    block_k = min(block_k, dk)

    def rows_spec(width, group=1):
        return chunk_rows_spec(chunk, width, group)

    beta_spec = chunk_column_spec(chunk)
    token_shape = (batch, length, value_heads)
    keys_out = jax.ShapeDtypeStruct((*token_shape, dk), jnp.float32)
    kernel = functools.partial(_intra_bwd_kernel, block_k=block_k, precision=solve_precision(interpret, q.dtype))
    return pl.pallas_call(
        kernel,
        grid=(length // chunk, value_heads, batch),
        in_specs=[
            rows_spec(dk, group), rows_spec(dk, group), rows_spec(dk), beta_spec,
            rows_spec(chunk), rows_spec(chunk),
        ],
        out_specs=[rows_spec(dk), rows_spec(dk), rows_spec(dk), beta_spec],
        out_shape=[keys_out, keys_out, keys_out, jax.ShapeDtypeStruct(token_shape, jnp.float32)],
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps, num_stages=num_stages or pipeline_stages(q.dtype, dk)
        ),
        interpret=interpret,
        name="kda_chunk_intra_bwd",
    )(q, k, g, beta, daqk, dakk)
