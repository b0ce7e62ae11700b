"""KDA chunked forward, stage 1 (Pallas, Triton lowering): everything local to one chunk.

One program per (chunk, value head, batch). It takes the chunk's q, k, v, per-channel log decay g
and beta and produces what the inter-chunk pass and the output stage need, so that neither
touches the gates again:

    G    = cumsum(g) within the chunk (fp32)                       (never leaves the chip)
    w    = T (beta k exp(G)),  u = T (beta v),  T = (I + A_kk)^-1   (the WY / UT form)
    kg   = k exp(G_last - G)        keys decayed to the chunk's end (state update)
    qg   = scale q exp(G)           queries decayed from the chunk's start (output)
    A_qk = scale q_i . (k_j exp(G_i - G_j)),  j <= i               (intra-chunk attention)
    decay = exp(G_last)             the chunk's total per-channel decay

A_kk[i, j] = beta_i k_i . (k_j exp(G_i - G_j)) for j < i. No exponent here is ever positive: the
chunk is cut into sub-chunks of 16 rows; a block below the diagonal splits exp(G_i - G_j) at
the row r just before sub-chunk a (j <= r < i) into exp(G_i - G_r) exp(G_r - G_j), two factors
<= 1, and a diagonal block takes exp(min(G_i - G_j, 0)) element by element over [16, 16, K].
So gates of -1000 underflow to 0 instead of overflowing. The triangular inverse is blocked
forward substitution: 16x16 diagonal blocks by row recurrence, off-diagonal blocks by matmuls.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.xla_scan import l2_normalize as unit_rows

SUB = 16  # sub-chunk rows: the smallest tile a Triton dot takes


def _mm(a: jax.Array, b: jax.Array, dtype, precision) -> jax.Array:
    """a @ b with operands cast to `dtype`, accumulated in fp32."""
    return jnp.dot(a.astype(dtype), b.astype(dtype), precision=precision, preferred_element_type=jnp.float32)


def _mm_t(a: jax.Array, b: jax.Array, dtype, precision) -> jax.Array:
    """a @ b.T (contracting the last axis of both)."""
    return lax.dot_general(
        a.astype(dtype), b.astype(dtype), (((1,), (1,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def _row(x: jax.Array, index: int) -> jax.Array:
    """Row `index` of a register tile as a vector (Triton tiles cannot be sliced)."""
    rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return jnp.sum(jnp.where(rows == index, x, 0.0), axis=0)


def _unit_lower_inverse(strict_lower: jax.Array) -> jax.Array:
    """(I + L)^-1 for a strictly lower 16x16 L, by forward substitution over its rows."""
    n = strict_lower.shape[0]
    rows = lax.broadcasted_iota(jnp.int32, (n, n), 0)
    inverse = (rows == lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(jnp.float32)
    for i in range(1, n):
        # Row i of the inverse is e_i - sum_{j<i} L[i, j] * (row j of the inverse); rows j < i are final.
        coeffs = _row(strict_lower, i)
        update = jnp.sum(coeffs[:, None] * inverse, axis=0)
        inverse = jnp.where(rows == i, inverse - update[None, :], inverse)
    return inverse


def _diagonal_blocks(k_beta: jax.Array, q: jax.Array, k: jax.Array, gates: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A_kk (j < i) and A_qk (j <= i) on one sub-chunk: sum_c left[i, c] k[j, c] exp(G[i, c] - G[j, c]).

    Both share the [16, 16, K] exponentials, the costliest part of the stage.
    """
    decay = jnp.exp(jnp.minimum(gates[:, None, :] - gates[None, :, :], 0.0))
    k_decayed = k[None, :, :] * decay
    akk = jnp.sum(k_beta[:, None, :] * k_decayed, axis=2)
    aqk = jnp.sum(q[:, None, :] * k_decayed, axis=2)
    rows = lax.broadcasted_iota(jnp.int32, akk.shape, 0)
    cols = lax.broadcasted_iota(jnp.int32, akk.shape, 1)
    return jnp.where(rows > cols, akk, 0.0), jnp.where(rows >= cols, aqk, 0.0)


def _intra_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref,
    w_ref, u_ref, kg_ref, qg_ref, aqk_ref, decay_ref,
    *, scale: float, l2_normalize: bool, compute_dtype, precision,
):
    n_sub = q_ref.shape[0] // SUB
    exact = lax.Precision.HIGHEST
    # Pass 1: per sub-chunk gates, keys, queries; `starts[a]` is G at the row before sub-chunk a.
    gates, keys, queries, betas, values, starts = [], [], [], [], [], []
    carry = jnp.zeros((g_ref.shape[1],), jnp.float32)
    for a in range(n_sub):
        rows = pl.ds(a * SUB, SUB)
        cumulative = jnp.cumsum(g_ref[rows, :].astype(jnp.float32), axis=0) + carry[None, :]
        starts.append(carry)
        carry = _row(cumulative, SUB - 1)
        k = k_ref[rows, :].astype(jnp.float32)
        q = q_ref[rows, :].astype(jnp.float32)
        if l2_normalize:
            k, q = unit_rows(k), unit_rows(q)
        gates.append(cumulative)
        keys.append(k)
        queries.append(q * scale)
        betas.append(beta_ref[rows].astype(jnp.float32))
        values.append(v_ref[rows, :].astype(jnp.float32))
    last = carry
    decay_ref[...] = jnp.exp(last)

    # Pass 2: the blocks of A_kk (kept on chip) and A_qk (stored), row block by row block.
    akk = {}
    for a in range(n_sub):
        rows = pl.ds(a * SUB, SUB)
        k_beta = keys[a] * betas[a][:, None]
        kg_ref[rows, :] = (keys[a] * jnp.exp(last[None, :] - gates[a])).astype(kg_ref.dtype)
        qg_ref[rows, :] = (queries[a] * jnp.exp(gates[a])).astype(qg_ref.dtype)
        akk[a, a], aqk_diagonal = _diagonal_blocks(k_beta, queries[a], keys[a], gates[a])
        aqk_ref[rows, pl.ds(a * SUB, SUB)] = aqk_diagonal.astype(aqk_ref.dtype)
        to_start = jnp.exp(gates[a] - starts[a][None, :])
        for b in range(a):
            right = keys[b] * jnp.exp(starts[a][None, :] - gates[b])
            akk[a, b] = _mm_t(k_beta * to_start, right, jnp.float32, exact)
            aqk_ref[rows, pl.ds(b * SUB, SUB)] = _mm_t(queries[a] * to_start, right, compute_dtype, precision).astype(
                aqk_ref.dtype
            )
        for b in range(a + 1, n_sub):
            aqk_ref[rows, pl.ds(b * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)

    # Pass 3: T = (I + A_kk)^-1 by blocks, then w = T (beta k exp(G)) and u = T (beta v).
    inverse = {}
    for a in range(n_sub):
        inverse[a, a] = _unit_lower_inverse(akk[a, a])
        for b in range(a - 1, -1, -1):
            acc = sum(_mm(akk[a, c], inverse[c, b], jnp.float32, exact) for c in range(b, a))
            inverse[a, b] = -_mm(inverse[a, a], acc, jnp.float32, exact)
    for a in range(n_sub):
        rows = pl.ds(a * SUB, SUB)
        w = sum(
            _mm(inverse[a, b], keys[b] * (betas[b][:, None] * jnp.exp(gates[b])), jnp.float32, None)
            for b in range(a + 1)
        )
        u = sum(_mm(inverse[a, b], values[b] * betas[b][:, None], jnp.float32, None) for b in range(a + 1))
        w_ref[rows, :] = w.astype(w_ref.dtype)
        u_ref[rows, :] = u.astype(u_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "l2_normalize", "chunk", "num_warps", "interpret"))
def chunk_intra(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, *,
    scale: float, l2_normalize: bool, chunk: int = 64, num_warps: int = 8, interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Stage 1 on padded inputs: q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K]; beta [B, T, HV].

    T is a multiple of `chunk`; K, V powers of two >= 16; HV a multiple of H.
    Returns w, kg, qg [B, T, HV, K]; u [B, T, HV, V]; A_qk [B, T, HV, chunk]; decay [B, T/chunk, HV, K] fp32.
    """
    batch, length, heads, dk = q.shape
    dv, value_heads = v.shape[3], v.shape[2]
    group = value_heads // heads
    n_chunks = length // chunk
    dtype = q.dtype
    # bf16 inputs: bf16 tensor-core dots as flash-linear-attention does; fp32 inputs: exact fp32 dots.
    compute_dtype, precision = (jnp.float32, lax.Precision.HIGHEST) if dtype == jnp.float32 else (dtype, None)

    def qk_spec(width):
        return pl.BlockSpec((None, chunk, None, width), lambda t, h, b: (b, t, h // group, 0))

    def head_spec(width):
        return pl.BlockSpec((None, chunk, None, width), lambda t, h, b: (b, t, h, 0))

    kernel = functools.partial(
        _intra_kernel, scale=scale, l2_normalize=l2_normalize, compute_dtype=compute_dtype, precision=precision
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
