"""KDA chunked backward, through A_kk and A_qk (Pallas, Triton lowering).

One program per (chunk, value head, batch). With E_ijc = exp(G_ic - G_jc), P = dA_qk (j <= i) and
D = dA_kk (j < i), A_qk[i, j] = sum_c q_ic k_jc E_ijc and A_kk[i, j] = beta_i sum_c k_ic k_jc E_ijc give

    row side   Y_q[i] = sum_j P_ij k_j E_ij,   Y_k[i] = sum_j D_ij k_j E_ij
    column     Z[j]   = sum_i (P_ij q_i + beta_i D_ij k_i) E_ij
    dq = Y_q,  dk = beta Y_k + Z,  dbeta = sum_c k Y_k,  dG = q Y_q + beta k Y_k - k Z

Each 16x16 block (a, b), b <= a, is a pair of matmuls with exp(G_i - G_j) split at r, the first row
of sub-chunk a, as in the forward's `pallas_chunk_intra` (and, there too, a diagonal block of a steep
sub-chunk is taken column by column from exp(min(G_i - G_j, 0))). The K axis is taken in slices of
`block_k`; each slice's rows of dq, dk, dG are final when its pass ends.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_chunk_intra import STEEP
from hybrax.ops.kda.pallas_tiles import (
    SUB, chunk_column_spec, chunk_rows_spec, index_grid, mm, mm_tn, solve_precision, sub_column,
)


def _exact_diagonal(p, d, r, queries, keys, gates, k_ref, g_ref, first: int, cols):
    """The diagonal block's (Y_q, Y_k, Z) column by column (p, d, r = beta D: its [16, 16] blocks)."""
    _, columns = index_grid(SUB)
    rows = lax.broadcasted_iota(jnp.int32, (SUB, 1), 0)

    def column(j, sums):
        y_q, y_k, z = sums
        decay = jnp.exp(jnp.minimum(gates - g_ref[first + j, cols][None, :], 0.0))
        decayed_key = k_ref[first + j, cols].astype(jnp.float32)[None, :] * decay
        pick = columns == j
        p_column = jnp.sum(jnp.where(pick, p, 0.0), axis=1)[:, None]
        d_column = jnp.sum(jnp.where(pick, d, 0.0), axis=1)[:, None]
        r_column = jnp.sum(jnp.where(pick, r, 0.0), axis=1)[:, None]
        z_row = jnp.sum((p_column * queries + r_column * keys) * decay, axis=0)
        return y_q + p_column * decayed_key, y_k + d_column * decayed_key, jnp.where(rows == j, z_row[None, :], z)

    zeros = jnp.zeros(gates.shape, jnp.float32)
    return lax.fori_loop(0, SUB, column, (zeros, zeros, zeros))


def _intra_bwd_kernel(
    q_ref, k_ref, g_ref, beta_ref, daqk_ref, dakk_ref, dq_ref, dk_ref, dg_ref, dbeta_ref, *, block_k, precision
):
    n_sub = q_ref.shape[0] // SUB
    block = lambda ref, a, b: ref[pl.ds(a * SUB, SUB), pl.ds(b * SUB, SUB)]  # noqa: E731
    betas = [sub_column(beta_ref, a) for a in range(n_sub)]
    steep = [jnp.max(g_ref[a * SUB, :] - g_ref[a * SUB + SUB - 1, :]) > STEEP for a in range(n_sub)]

    def slice_pass(index, dbetas):
        cols = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        load = lambda ref, a: ref[pl.ds(a * SUB, SUB), cols].astype(jnp.float32)  # noqa: E731
        queries = [load(q_ref, a) for a in range(n_sub)]
        keys = [load(k_ref, a) for a in range(n_sub)]
        gates = [load(g_ref, a) for a in range(n_sub)]
        zeros = jnp.zeros(gates[0].shape, jnp.float32)
        y_q, y_k, z = [zeros] * n_sub, [zeros] * n_sub, [zeros] * n_sub
        for a in range(n_sub):
            start = g_ref[a * SUB, cols][None, :]
            to_start = jnp.exp(gates[a] - start)
            left_q, left_k = queries[a] * to_start, keys[a] * to_start
            row_q, row_k = zeros, zeros
            for b in range(a + 1):
                p, d = block(daqk_ref, a, b), block(dakk_ref, a, b)
                r = d * betas[a]
                # On the diagonal the exponent is >= 0; the clamp keeps a steep sub-chunk finite.
                from_start = jnp.exp(jnp.minimum(start - gates[b], STEEP))
                right = keys[b] * from_start

                def factored(p=p, d=d, r=r, right=right, from_start=from_start):
                    column = mm_tn(p, left_q, jnp.float32, precision) + mm_tn(r, left_k, jnp.float32, precision)
                    return (
                        mm(p, right, jnp.float32, precision) * to_start,
                        mm(d, right, jnp.float32, precision) * to_start,
                        column * from_start,
                    )

                if b < a:
                    terms = factored()
                else:
                    terms = lax.cond(
                        steep[a],
                        lambda p=p, d=d, r=r: _exact_diagonal(
                            p, d, r, queries[a], keys[a], gates[a], k_ref, g_ref, a * SUB, cols
                        ),
                        factored,
                    )
                row_q, row_k = row_q + terms[0], row_k + terms[1]
                z[b] = z[b] + terms[2]
            y_q[a], y_k[a] = row_q, row_k
        new_dbetas = []
        for a in range(n_sub):
            rows = pl.ds(a * SUB, SUB)
            dq_ref[rows, cols] = y_q[a]
            dk_ref[rows, cols] = betas[a] * y_k[a] + z[a]
            dg_ref[rows, cols] = queries[a] * y_q[a] + betas[a] * keys[a] * y_k[a] - keys[a] * z[a]
            new_dbetas.append(dbetas[a] + jnp.sum(keys[a] * y_k[a], axis=1))
        return tuple(new_dbetas)

    zeros = tuple(jnp.zeros((SUB,), jnp.float32) for _ in range(n_sub))
    dbetas = lax.fori_loop(0, q_ref.shape[1] // block_k, slice_pass, zeros)
    for a in range(n_sub):
        dbeta_ref[pl.ds(a * SUB, SUB)] = dbetas[a]


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "num_warps", "interpret"))
def chunk_intra_bwd(
    q: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array, daqk: jax.Array, dakk: jax.Array, *,
    chunk: int = 64, block_k: int = 32, num_warps: int = 4, interpret: bool = False,
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
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_intra_bwd",
    )(q, k, g, beta, daqk, dakk)
