"""KDA chunked forward, stage 1a (Pallas, Triton lowering): the diagonal 16x16 blocks of A.

One program per (16-row sub-chunk, value head, batch): many small programs, so that the serial
column loop of one sub-chunk overlaps with the others'. With G the chunk-local cumulative log decay,

    A_kk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)   (j < i)    ->  (I + A_kk)^-1 is stored
    A_qk[i, j] =        sum_c q_ic k_jc exp(G_ic - G_jc)   (j <= i)   ->  stored

Column j needs exp(min(G_i - G_j, 0)) over one [16, K] tile (row j of k and G read straight from
the input block); no exponent is positive (the min only touches entries above the diagonal, masked
after, where it keeps exp from overflowing to inf * 0), so gates of -1000 underflow to 0. The
inverse doubles its inverted blocks: with X the inverse of the block diagonal of size s,
[[A, 0], [L21, B]]^-1 = [[A^-1, 0], [-B^-1 L21 A^-1, B^-1]] = X - X L_s X where L_s keeps only the
L21 blocks, so every step is a masked full-tile matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import SUB, index_grid, mm, solve_precision


def unit_lower_inverse(strict_lower: jax.Array, precision) -> jax.Array:
    """(I + L)^-1 for a strictly lower n x n L (n a power of two), log2(n) doubling rounds."""
    n = strict_lower.shape[0]
    rows, cols = index_grid(n)
    inverse = (rows == cols).astype(jnp.float32)
    size = 1
    while size < n:
        link = ((rows // (2 * size)) == (cols // (2 * size))) & ((rows // size) > (cols // size))
        coupling = mm(jnp.where(link, strict_lower, 0.0), inverse, jnp.float32, precision)
        inverse = inverse - mm(inverse, coupling, jnp.float32, precision)
        size *= 2
    return inverse


def diagonal_blocks(k_beta, q, gates, k_ref, g_ref) -> tuple[jax.Array, jax.Array]:
    """A_kk (j < i) and A_qk (j <= i) of one sub-chunk, column by column (k_ref, g_ref: its rows)."""
    rows, cols = index_grid(SUB)

    def column(j, blocks):
        akk, aqk = blocks
        key = k_ref[j, :].astype(jnp.float32)
        decayed = key[None, :] * jnp.exp(jnp.minimum(gates - g_ref[j, :][None, :], 0.0))
        akk = jnp.where(cols == j, jnp.sum(k_beta * decayed, axis=1)[:, None], akk)
        aqk = jnp.where(cols == j, jnp.sum(q * decayed, axis=1)[:, None], aqk)
        return akk, aqk

    zeros = jnp.zeros((SUB, SUB), jnp.float32)
    akk, aqk = lax.fori_loop(0, SUB, column, (zeros, zeros))
    return jnp.where(rows > cols, akk, 0.0), jnp.where(rows >= cols, aqk, 0.0)


def _diagonal_kernel(q_ref, k_ref, g_ref, beta_ref, inverse_ref, aqk_ref, *, precision):
    keys = k_ref[...].astype(jnp.float32)
    k_beta = keys * beta_ref[...].astype(jnp.float32)[:, None]
    akk, aqk = diagonal_blocks(k_beta, q_ref[...].astype(jnp.float32), g_ref[...], k_ref, g_ref)
    inverse_ref[...] = unit_lower_inverse(akk, precision)
    aqk_ref[...] = aqk


@functools.partial(jax.jit, static_argnames=("num_warps", "interpret"))
def chunk_diagonal(
    q: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array, *, num_warps: int = 4, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """q, k [B, T, H, K] (normalized; q scaled); g [B, T, HV, K] chunk-local cumulative log decay (fp32);
    beta [B, T, HV]. T a multiple of 16, K a power of two >= 16, HV a multiple of H.

    Returns the diagonal blocks of (I + A_kk)^-1 and of A_qk, each [B, T, HV, 16] fp32 (row t holds
    row t % 16 of its sub-chunk's block).
    """
    batch, length, heads, dk = q.shape
    value_heads = g.shape[2]
    group = value_heads // heads
    qk_spec = pl.BlockSpec((None, SUB, None, dk), lambda s, h, b: (b, s, h // group, 0))
    block_spec = pl.BlockSpec((None, SUB, None, SUB), lambda s, h, b: (b, s, h, 0))
    out = jax.ShapeDtypeStruct((batch, length, value_heads, SUB), jnp.float32)
    return pl.pallas_call(
        functools.partial(_diagonal_kernel, precision=solve_precision(interpret)),
        grid=(length // SUB, value_heads, batch),
        in_specs=[
            qk_spec, qk_spec, pl.BlockSpec((None, SUB, None, dk), lambda s, h, b: (b, s, h, 0)),
            pl.BlockSpec((None, SUB, None), lambda s, h, b: (b, s, h)),
        ],
        out_specs=[block_spec, block_spec],
        out_shape=[out, out],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_diagonal",
    )(q, k, g, beta)
