"""KDA chunked backward, through A_kk and A_qk (Pallas, Triton lowering).

One program per (chunk, value head, batch). With E_ijc = exp(G_ic - G_jc), P = dA_qk (j <= i) and
D = dA_kk (j < i), A_qk[i, j] = sum_c q_ic k_jc E_ijc and A_kk[i, j] = beta_i sum_c k_ic k_jc E_ijc give

    row side   Y_q[i] = sum_j P_ij k_j E_ij,   Y_k[i] = sum_j D_ij k_j E_ij
    column     Z[j]   = sum_i (P_ij q_i + beta_i D_ij k_i) E_ij
    dq = Y_q,  dk = beta Y_k + Z,  dbeta = sum_c k Y_k,  dG = q Y_q + beta k Y_k - k Z

Taken from whole [C, C] tiles, as the forward's `chunk_intra` builds them: per K slice and per
sub-chunk a (16 rows), the rows of a against every column in [C, C] x [C, BK] dots, with
exp(G_i - G_j) split at a's first row r (exp(G_i - G_r) on the rows, exp(G_r - G_j) on the columns;
rows outside a are dropped by the row factor, zero there). A steep chunk (`chunk_gates`: a sub-chunk
decays by more than exp(STEEP), where the split factors would overflow and differences of G cancel) takes every
pair column by column instead, each decay summed from the per-token gates. Each K slice's rows of dq, dk, dG
are final when its pass ends. On the H200 at (1, 8192, 32, 128) this took 1.245 ms against 1.346 for 16x16
block pairs (H200 measurements).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_gpu.chunk_gates import STEEP, pair_exponents, steep_chunk
from hybrax.ops.kda.pallas_gpu.tiles import (
    SUB, PackedChunks, chunk_column_spec, chunk_rows_spec, chunk_windows, index_grid, packed_chunk_specs,
    pipeline_stages, split_packed, token_column_spec, token_rows_spec,
)
from hybrax.ops.pallas_shared import mm, mm_tn, pallas_call, solve_precision


def split_decay(g_ref, gates: jax.Array, slice_k, a: int) -> tuple[jax.Array, jax.Array]:
    """exp(G_i - G_j) split at r, the first row of sub-chunk a, for the [C, BK] gates of one K slice:
    exp(G_i - G_r) on the rows of a (zeros elsewhere, so a [C, C] dot keeps only a's rows) and
    exp(G_r - G_j) on every row, clamped at exp(STEEP) (only ever above the diagonal, where P and D are zero:
    steep chunks take `_exact_pairs`).
    (Stage 1's `SubChunkDecay`, two exps per K slice for all sub-chunks, made this kernel slower on the
    H200: 1.220-1.292 ms against 1.114.)"""
    start = g_ref[a * SUB, slice_k][None, :]
    in_a = lax.broadcasted_iota(jnp.int32, gates.shape, 0) // SUB == a
    to_start = jnp.where(in_a, jnp.exp(jnp.where(in_a, gates - start, 0.0)), 0.0)
    return to_start, jnp.exp(jnp.minimum(start - gates, STEEP))


def _factored_pairs(p, r, d, queries, keys, slice_k, g_ref, precision):
    """(Y_q, Y_k, Z) of one K slice of a chunk that is not steep, from `split_decay`'s factors per sub-chunk."""
    gates = g_ref[:, slice_k]
    sub_chunk = lax.broadcasted_iota(jnp.int32, gates.shape, 0) // SUB
    zeros = jnp.zeros(gates.shape, jnp.float32)
    y_q, y_k, z = zeros, zeros, zeros
    for a in range(gates.shape[0] // SUB):
        in_a = sub_chunk == a
        to_start, from_start = split_decay(g_ref, gates, slice_k, a)
        right = keys * from_start
        y_q = y_q + jnp.where(in_a, mm(p, right, jnp.float32, precision), 0.0) * to_start
        y_k = y_k + jnp.where(in_a, mm(d, right, jnp.float32, precision), 0.0) * to_start
        column = mm_tn(p, queries * to_start, jnp.float32, precision)
        z = z + (column + mm_tn(r, keys * to_start, jnp.float32, precision)) * from_start
    return y_q, y_k, z


def _exact_pairs(p, r, d, queries, keys, slice_k, k_ref, raw_ref):
    """(Y_q, Y_k, Z) of one K slice of a steep chunk, column by column from the last, each column's decays
    exp(sum_{j < t <= i} g_t) summed from the per-token gates (`pair_exponents`; entries above the diagonal
    meet zeros of P and D)."""
    chunk = p.shape[0]
    _, columns = index_grid(chunk)
    rows = lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)

    def column(step, sums):
        y_q, y_k, z, exponents = sums
        j = chunk - 1 - step
        exponents = pair_exponents(exponents, raw_ref, j, slice_k)
        decay = jnp.exp(exponents)
        decayed_key = k_ref[j, slice_k].astype(jnp.float32)[None, :] * decay
        p_column, d_column, r_column = (jnp.sum(jnp.where(columns == j, x, 0.0), axis=1)[:, None] for x in (p, d, r))
        z_row = jnp.sum((p_column * queries + r_column * keys) * decay, axis=0)
        y_q, y_k = y_q + p_column * decayed_key, y_k + d_column * decayed_key
        return y_q, y_k, jnp.where(rows == j, z_row[None, :], z), exponents

    zeros = jnp.zeros(queries.shape, jnp.float32)
    return lax.fori_loop(0, chunk, column, (zeros,) * 4)[:3]


def _intra_bwd_kernel(
    q_ref, k_ref, g_ref, raw_ref, beta_ref, daqk_ref, dakk_ref, *refs, packed: bool, block_k, precision
):
    packed_refs, (dq_ref, dk_ref, dg_ref, dbeta_ref) = split_packed(refs, packed)
    q_ref, k_ref, raw_ref, beta_ref = chunk_windows((q_ref, k_ref, raw_ref, beta_ref), packed_refs, g_ref.shape[0])
    chunk = q_ref.shape[0]
    steep = steep_chunk(g_ref)
    betas = beta_ref[...].astype(jnp.float32)[:, None]
    p, d = daqk_ref[...], dakk_ref[...]
    r = d * betas

    def slice_pass(pairs, index, dbeta):
        slice_k = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        queries, keys = q_ref[:, slice_k].astype(jnp.float32), k_ref[:, slice_k].astype(jnp.float32)
        y_q, y_k, z = pairs(p, r, d, queries, keys, slice_k)
        dq_ref[:, slice_k] = y_q
        dk_ref[:, slice_k] = betas * y_k + z
        dg_ref[:, slice_k] = queries * y_q + betas * keys * y_k - keys * z
        return dbeta + jnp.sum(keys * y_k, axis=1)

    exact = functools.partial(_exact_pairs, k_ref=k_ref, raw_ref=raw_ref)
    factored = functools.partial(_factored_pairs, g_ref=g_ref, precision=precision)
    passes = lambda pairs: lax.fori_loop(  # noqa: E731
        0, q_ref.shape[1] // block_k, functools.partial(slice_pass, pairs), jnp.zeros((chunk,), jnp.float32)
    )
    dbeta_ref[...] = lax.cond(steep, lambda: passes(exact), lambda: passes(factored))


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "num_warps", "num_stages", "interpret"))
def chunk_intra_bwd(
    q: jax.Array, k: jax.Array, g: jax.Array, raw_g: jax.Array, beta: jax.Array, daqk: jax.Array, dakk: jax.Array,
    packed: PackedChunks | None = None, *, chunk: int = 64, block_k: int = 16, num_warps: int = 4,
    num_stages: int | None = None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """q, k [B, T, H, K] (prepared); g [B, T, HV, K] (G, fp32); raw_g [B, T, HV, K] the per-token gates (stage
    0's input, fp32: what steep chunks read); beta [B, T, HV]; dA_qk, dA_kk [B, T, HV, chunk] fp32 (masked).

    Returns dq, dk, dG [B, T, HV, K] and dbeta [B, T, HV], fp32, per value head. With `packed`, q, k, raw_g
    and beta are packed rows read in place (`chunk_intra`); the rest and the results are padded.
    """
    batch, length, heads, dk = g.shape[0], g.shape[1], q.shape[2], q.shape[3]
    value_heads = g.shape[2]
    group = value_heads // heads
    block_k = min(block_k, dk)
    packed_length = None if packed is None else q.shape[1]

    def rows_spec(width, group=1):
        return chunk_rows_spec(chunk, width, group)

    beta_spec = chunk_column_spec(chunk)
    token_shape = (batch, length, value_heads)
    keys_out = jax.ShapeDtypeStruct((*token_shape, dk), jnp.float32)
    kernel = functools.partial(
        _intra_bwd_kernel, packed=packed is not None, block_k=block_k, precision=solve_precision(interpret, q.dtype)
    )
    return pallas_call(
        kernel,
        grid=(value_heads, length // chunk, batch),
        in_specs=[
            token_rows_spec(chunk, dk, group, packed_length), token_rows_spec(chunk, dk, group, packed_length),
            rows_spec(dk), token_rows_spec(chunk, dk, 1, packed_length), token_column_spec(chunk, packed_length),
            rows_spec(chunk), rows_spec(chunk),
            *packed_chunk_specs(packed, length // chunk),
        ],
        out_specs=[rows_spec(dk), rows_spec(dk), rows_spec(dk), beta_spec],
        out_shape=[keys_out, keys_out, keys_out, jax.ShapeDtypeStruct(token_shape, jnp.float32)],
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps, num_stages=num_stages or pipeline_stages(q.dtype, dk)
        ),
        interpret=interpret,
        name="kda_chunk_intra_bwd",
    )(q, k, g, raw_g, beta, daqk, dakk, *(packed or ()))
