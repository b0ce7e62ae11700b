"""KDA chunked forward, stage 1 (Pallas, Triton lowering): everything local to one chunk.

One program per (chunk, value head, batch). It takes the chunk's normalized, scaled queries q,
normalized keys k, values v, the chunk-local cumulative log decay G (fp32, from
`chunk_local_cumsum`) and beta, and produces what the inter-chunk pass and the output stage need,
so that neither touches the gates again:

    w    = T (beta k exp(G)),  u = T (beta v),  T = (I + A_kk)^-1   (the WY / UT form)
    kg   = k exp(G_last - G)        keys decayed to the chunk's end (state update)
    qg   = q exp(G)                 queries decayed from the chunk's start (output)
    A_qk = q_i . (k_j exp(G_i - G_j)),  j <= i                      (intra-chunk attention)
    decay = exp(G_last)             the chunk's total per-channel decay

A_kk[i, j] = beta_i k_i . (k_j exp(G_i - G_j)) for j < i. No exponent here is ever positive: the
chunk is cut into sub-chunks of 16 rows; a block below the diagonal splits exp(G_i - G_j) at the
row r just before sub-chunk a (j <= r < i) into exp(G_i - G_r) exp(G_r - G_j), two factors <= 1,
and takes a matmul. A diagonal block goes column by column: column j needs exp(min(G_i - G_j, 0))
over [16, K] only (row j of k and G read straight from the input block), so the working set stays
a few [16, K] tiles instead of a [16, 16, K] tensor. Gates of -1000 underflow to 0 instead of
overflowing. The triangular inverse is blocked: 16x16 diagonal blocks by doubling (log2(16)
rounds of two matmuls on masked full tiles: Triton tiles cannot be sliced), the blocks below them
by forward substitution with matmuls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

SUB = 16  # sub-chunk rows: the smallest tile a Triton dot takes
EXACT = lax.Precision.HIGHEST  # fp32 dots without tf32 rounding
# The fp32 dots of A_kk and its inverse on the GPU: three tf32 passes on the tensor cores keep
# fp32 accuracy; Triton's exact fp32 dot runs on the FMA units and made this stage 2.7x slower
# (benchmarks/kda_intra_ablation.py). The CPU (interpret mode) has no tf32 and computes them exactly.
GPU_SOLVE_PRECISION = lax.DotAlgorithmPreset.TF32_TF32_F32_X3


def _mm(a: jax.Array, b: jax.Array, dtype, precision) -> jax.Array:
    """a @ b with operands cast to `dtype`, accumulated in fp32."""
    return jnp.dot(a.astype(dtype), b.astype(dtype), precision=precision, preferred_element_type=jnp.float32)


def _mm_t(a: jax.Array, b: jax.Array, dtype, precision) -> jax.Array:
    """a @ b.T (contracting the last axis of both)."""
    return lax.dot_general(
        a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def _grid(n: int) -> tuple[jax.Array, jax.Array]:
    return lax.broadcasted_iota(jnp.int32, (n, n), 0), lax.broadcasted_iota(jnp.int32, (n, n), 1)


def _unit_lower_inverse(strict_lower: jax.Array, precision) -> jax.Array:
    """(I + L)^-1 for a strictly lower n x n L (n a power of two) by doubling the inverted blocks.

    With X the inverse of the block diagonal of size s, the blocks of size 2s are
    [[A, 0], [L21, B]]^-1 = [[A^-1, 0], [-B^-1 L21 A^-1, B^-1]], i.e. X - X L_s X where L_s keeps
    only the L21 blocks. Masks select L_s, so every step is a full-tile matmul.
    """
    n = strict_lower.shape[0]
    rows, cols = _grid(n)
    inverse = (rows == cols).astype(jnp.float32)
    size = 1
    while size < n:
        link = ((rows // (2 * size)) == (cols // (2 * size))) & ((rows // size) > (cols // size))
        coupling = _mm(jnp.where(link, strict_lower, 0.0), inverse, jnp.float32, precision)
        inverse = inverse - _mm(inverse, coupling, jnp.float32, precision)
        size *= 2
    return inverse


def _diagonal_blocks(k_beta, q, gates, k_ref, g_ref, first_row: int) -> tuple[jax.Array, jax.Array]:
    """A_kk (j < i) and A_qk (j <= i) on one sub-chunk, column by column.

    Column j: sum_c left[i, c] k[j, c] exp(min(G[i, c] - G[j, c], 0)); the min only touches
    entries above the diagonal (masked after), where it keeps exp from overflowing to inf * 0.
    """
    rows, cols = _grid(SUB)

    def column(j, blocks):
        akk, aqk = blocks
        key = k_ref[first_row + j, :].astype(jnp.float32)
        gate = g_ref[first_row + j, :]
        decayed = key[None, :] * jnp.exp(jnp.minimum(gates - gate[None, :], 0.0))
        akk = jnp.where(cols == j, jnp.sum(k_beta * decayed, axis=1)[:, None], akk)
        aqk = jnp.where(cols == j, jnp.sum(q * decayed, axis=1)[:, None], aqk)
        return akk, aqk

    zeros = jnp.zeros((SUB, SUB), jnp.float32)
    akk, aqk = lax.fori_loop(0, SUB, column, (zeros, zeros))
    return jnp.where(rows > cols, akk, 0.0), jnp.where(rows >= cols, aqk, 0.0)


def _intra_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref,
    w_ref, u_ref, kg_ref, qg_ref, aqk_ref, decay_ref,
    *, compute_dtype, precision, solve_precision,
):
    # Only the [16, 16] blocks of A_kk and of its inverse live across the passes; [16, K] tiles are
    # read again from the input blocks (cached) where needed: holding them all spills registers.
    chunk = q_ref.shape[0]
    n_sub = chunk // SUB
    last = g_ref[chunk - 1, :]
    decay_ref[...] = jnp.exp(last)

    def tile(ref, a):
        return ref[pl.ds(a * SUB, SUB), :].astype(jnp.float32)

    def beta_column(a):
        return beta_ref[pl.ds(a * SUB, SUB)].astype(jnp.float32)[:, None]

    # Pass 1, sub-chunk by sub-chunk: kg and qg; A_kk (kept on chip) and A_qk (stored) by blocks.
    akk = {}
    for a in range(n_sub):
        rows = pl.ds(a * SUB, SUB)
        gates, keys, queries, betas = tile(g_ref, a), tile(k_ref, a), tile(q_ref, a), beta_column(a)
        kg_ref[rows, :] = (keys * jnp.exp(last[None, :] - gates)).astype(kg_ref.dtype)
        qg_ref[rows, :] = (queries * jnp.exp(gates)).astype(qg_ref.dtype)
        akk[a, a], aqk_diagonal = _diagonal_blocks(keys * betas, queries, gates, k_ref, g_ref, a * SUB)
        aqk_ref[rows, pl.ds(a * SUB, SUB)] = aqk_diagonal.astype(aqk_ref.dtype)
        if a:
            # Blocks left of the diagonal split their decays at G of the row before sub-chunk a.
            start = g_ref[a * SUB - 1, :][None, :]
            to_start = jnp.exp(gates - start)
            left_kk, left_qk = keys * betas * to_start, queries * to_start
        for b in range(a):
            right = tile(k_ref, b) * jnp.exp(start - tile(g_ref, b))
            akk[a, b] = _mm_t(left_kk, right, jnp.float32, solve_precision)
            aqk_ref[rows, pl.ds(b * SUB, SUB)] = _mm_t(left_qk, right, compute_dtype, precision).astype(aqk_ref.dtype)
        for b in range(a + 1, n_sub):
            aqk_ref[rows, pl.ds(b * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)

    # Pass 2: T = (I + A_kk)^-1 by blocks.
    inverse = {}
    for a in range(n_sub):
        inverse[a, a] = _unit_lower_inverse(akk[a, a], solve_precision)
        for b in range(a - 1, -1, -1):
            acc = sum(_mm(akk[a, c], inverse[c, b], jnp.float32, solve_precision) for c in range(b, a))
            inverse[a, b] = -_mm(inverse[a, a], acc, jnp.float32, solve_precision)

    # Pass 3: w = T (beta k exp(G)) and u = T (beta v).
    for a in range(n_sub):
        rows = pl.ds(a * SUB, SUB)
        w = sum(
            _mm(inverse[a, b], tile(k_ref, b) * beta_column(b) * jnp.exp(tile(g_ref, b)), compute_dtype, precision)
            for b in range(a + 1)
        )
        u = sum(_mm(inverse[a, b], tile(v_ref, b) * beta_column(b), compute_dtype, precision) for b in range(a + 1))
        w_ref[rows, :] = w.astype(w_ref.dtype)
        u_ref[rows, :] = u.astype(u_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def chunk_intra(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
    chunk: int = 64, num_warps: int = 4, interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Stage 1 on padded inputs: q, k [B, T, H, K] (normalized; q scaled); v [B, T, HV, V];
    g [B, T, HV, K] the chunk-local cumulative log decay (fp32); beta [B, T, HV].

    T is a multiple of `chunk`; K, V powers of two >= 16; HV a multiple of H.
    Returns w, kg, qg [B, T, HV, K]; u [B, T, HV, V]; A_qk [B, T, HV, chunk]; decay [B, T/chunk, HV, K] fp32.
    """
    batch, length, heads, dk = q.shape
    dv, value_heads = v.shape[3], v.shape[2]
    group = value_heads // heads
    n_chunks = length // chunk
    dtype = q.dtype
    # bf16 inputs: bf16 tensor-core dots as flash-linear-attention does; fp32 inputs: exact fp32 dots.
    compute_dtype, precision = (jnp.float32, EXACT) if dtype == jnp.float32 else (dtype, None)

    def qk_spec(width):
        return pl.BlockSpec((None, chunk, None, width), lambda t, h, b: (b, t, h // group, 0))

    def head_spec(width):
        return pl.BlockSpec((None, chunk, None, width), lambda t, h, b: (b, t, h, 0))

    solve_precision = EXACT if interpret else GPU_SOLVE_PRECISION
    kernel = functools.partial(
        _intra_kernel, compute_dtype=compute_dtype, precision=precision, solve_precision=solve_precision
    )
    token_shape = (batch, length, value_heads)
    return pl.pallas_call(
        kernel,
        grid=(n_chunks, value_heads, batch),
        in_specs=[
            qk_spec(dk), qk_spec(dk), head_spec(dv), head_spec(dk),
            pl.BlockSpec((None, chunk, None), lambda t, h, b: (b, t, h)),
        ],
        out_specs=[
            head_spec(dk), head_spec(dv), head_spec(dk), head_spec(dk), head_spec(chunk),
            pl.BlockSpec((None, None, None, dk), lambda t, h, b: (b, t, h, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*token_shape, dk), dtype),  # w
            jax.ShapeDtypeStruct((*token_shape, dv), dtype),  # u
            jax.ShapeDtypeStruct((*token_shape, dk), dtype),  # kg
            jax.ShapeDtypeStruct((*token_shape, dk), dtype),  # qg
            jax.ShapeDtypeStruct((*token_shape, chunk), dtype),  # A_qk
            jax.ShapeDtypeStruct((batch, n_chunks, value_heads, dk), jnp.float32),  # decay
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_intra",
    )(q, k, v, g, beta)
