"""KDA chunked forward, stage 1a (Pallas, Triton lowering): A_kk, A_qk and T = (I + A_kk)^-1 per chunk.

One program per (chunk, value head, batch). With G the chunk-local cumulative log decay,

    A_kk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)   (j < i)    ->  T = (I + A_kk)^-1 is stored
    A_qk[i, j] =        sum_c q_ic k_jc exp(G_ic - G_jc)   (j <= i)   ->  stored

Every 16x16 block (a, b), b <= a, of 16-row sub-chunks is one matmul: exp(G_i - G_j) splits at r, the
first row of sub-chunk a, into exp(G_i - G_r) <= 1 (rows of a) and exp(G_r - G_j) (rows of b). Below
the diagonal (j < r) the second factor is <= 1 too. On the diagonal it is >= 1 and bounded by the
sub-chunk's own decay, exp(G_r - G_last): where that exceeds exp(STEEP) in some channel (gates of
-1000), the diagonal block is computed column by column from exp(min(G_i - G_j, 0)) instead, so the
kernel never overflows and very negative gates underflow to exactly 0. The K axis is taken in slices
of `block_k` columns: the 2 x 10 accumulating blocks and one slice of q, k, G stay in registers.

T follows by blocks: each diagonal block's inverse by doubling (every step a masked full-tile
matmul), then forward substitution T[a, b] = -T[a, a] sum_{b <= c < a} A_kk[a, c] T[c, b]. T and
A_qk are stored whole ([C, C], zeros above the diagonal) so that stage 1b applies them with one matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import (
    SUB, chunk_column_spec, chunk_rows_spec, index_grid, mm, mm_t, solve_precision, sub_column,
)

# The largest decay within one sub-chunk (G_r - G_last in any channel) that the diagonal blocks take
# as a matmul: exp(60) = 1e26 keeps the factors and their products far from fp32's limits (3e38).
STEEP = 60.0


def unit_lower_inverse(strict_lower: jax.Array, precision) -> jax.Array:
    """(I + L)^-1 for a strictly lower n x n L (n a power of two), log2(n) doubling rounds: with X the
    inverse of the block diagonal of size s, [[A, 0], [L21, B]]^-1 = X - X L_s X (L_s: the L21 blocks)."""
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


def exact_diagonal_block(q_ref, k_ref, g_ref, first: int) -> tuple[jax.Array, jax.Array]:
    """Unscaled A_kk and A_qk of the sub-chunk at row `first`, column by column from
    exp(min(G_i - G_j, 0)): no factor above 1 (the min only touches entries above the diagonal)."""
    rows = pl.ds(first, SUB)
    _, cols = index_grid(SUB)
    keys, queries, gates = (ref[rows, :].astype(jnp.float32) for ref in (k_ref, q_ref, g_ref))

    def column(j, blocks):
        akk, aqk = blocks
        decayed = k_ref[first + j, :].astype(jnp.float32)[None, :] * jnp.exp(
            jnp.minimum(gates - g_ref[first + j, :][None, :], 0.0)
        )
        akk = jnp.where(cols == j, jnp.sum(keys * decayed, axis=1)[:, None], akk)
        aqk = jnp.where(cols == j, jnp.sum(queries * decayed, axis=1)[:, None], aqk)
        return akk, aqk

    zeros = jnp.zeros((SUB, SUB), jnp.float32)
    return lax.fori_loop(0, SUB, column, (zeros, zeros))


def _blocks(q_ref, k_ref, g_ref, *, block_k: int, precision) -> tuple[dict, dict]:
    """The unscaled blocks (a, b), b <= a, of A_kk and A_qk, accumulated over K slices."""
    n_sub = q_ref.shape[0] // SUB
    pairs = [(a, b) for a in range(n_sub) for b in range(a + 1)]

    def accumulate(index, blocks):
        cols = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        load = lambda ref, a: ref[pl.ds(a * SUB, SUB), cols].astype(jnp.float32)  # noqa: E731
        keys = [load(k_ref, a) for a in range(n_sub)]
        gates = [load(g_ref, a) for a in range(n_sub)]
        akk, aqk = list(blocks[0]), list(blocks[1])
        for a in range(n_sub):
            start = g_ref[a * SUB, cols][None, :]
            to_start = jnp.exp(gates[a] - start)
            left_k, left_q = keys[a] * to_start, load(q_ref, a) * to_start
            for b in range(a + 1):
                # On the diagonal the exponent is >= 0; the clamp keeps a steep sub-chunk finite
                # (its block is then recomputed exactly).
                right = keys[b] * jnp.exp(jnp.minimum(start - gates[b], STEEP))
                slot = pairs.index((a, b))
                akk[slot] = akk[slot] + mm_t(left_k, right, jnp.float32, precision)
                aqk[slot] = aqk[slot] + mm_t(left_q, right, jnp.float32, precision)
        return tuple(akk), tuple(aqk)

    zeros = tuple(jnp.zeros((SUB, SUB), jnp.float32) for _ in pairs)
    akk, aqk = lax.fori_loop(0, q_ref.shape[1] // block_k, accumulate, (zeros, zeros))
    return dict(zip(pairs, akk)), dict(zip(pairs, aqk))


def _solve_kernel(q_ref, k_ref, g_ref, beta_ref, inverse_ref, aqk_ref, *, block_k, precision):
    n_sub = q_ref.shape[0] // SUB
    akk, aqk = _blocks(q_ref, k_ref, g_ref, block_k=block_k, precision=precision)
    rows, cols = index_grid(SUB)
    inverse = {}
    for a in range(n_sub):
        first = a * SUB
        steep = jnp.max(g_ref[first, :] - g_ref[first + SUB - 1, :]) > STEEP
        akk[a, a], aqk[a, a] = lax.cond(
            steep, lambda: exact_diagonal_block(q_ref, k_ref, g_ref, first), lambda: (akk[a, a], aqk[a, a])
        )
        betas = sub_column(beta_ref, a)
        for b in range(a + 1):
            akk[a, b] = akk[a, b] * betas
        inverse[a, a] = unit_lower_inverse(jnp.where(rows > cols, akk[a, a], 0.0), precision)
        aqk[a, a] = jnp.where(rows >= cols, aqk[a, a], 0.0)

    for a in range(n_sub):
        rows_a = pl.ds(a * SUB, SUB)
        for b in range(a - 1, -1, -1):
            acc = sum(mm(akk[a, c], inverse[c, b], jnp.float32, precision) for c in range(b, a))
            inverse[a, b] = -mm(inverse[a, a], acc, jnp.float32, precision)
        for b in range(n_sub):
            cols_b = pl.ds(b * SUB, SUB)
            zeros = jnp.zeros((SUB, SUB), jnp.float32)
            inverse_ref[rows_a, cols_b] = inverse.get((a, b), zeros).astype(inverse_ref.dtype)
            aqk_ref[rows_a, cols_b] = aqk.get((a, b), zeros).astype(aqk_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "num_warps", "precision", "interpret"))
def chunk_solve(
    q: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array, *, chunk: int = 64, block_k: int = 16,
    num_warps: int = 2, precision=None, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q, k [B, T, H, K] (normalized; q scaled); g [B, T, HV, K] chunk-local cumulative log decay (fp32);
    beta [B, T, HV]. T a multiple of the chunk, K a power of two >= 16, HV a multiple of H.
    `precision` of the fp32 dots: by default `solve_precision` for q's dtype.

    Returns T = (I + A_kk)^-1 and A_qk, each [B, T, HV, chunk] (row t: row t % chunk of its chunk's
    matrix), in the inputs' dtype.
    """
    batch, length, heads, dk = q.shape
    value_heads = g.shape[2]
    group = value_heads // heads
    block_k = min(block_k, dk)
    if precision is None:
        precision = solve_precision(interpret, q.dtype)

    out = jax.ShapeDtypeStruct((batch, length, value_heads, chunk), q.dtype)
    return pl.pallas_call(
        functools.partial(_solve_kernel, block_k=block_k, precision=precision),
        grid=(length // chunk, value_heads, batch),
        in_specs=[
            chunk_rows_spec(chunk, dk, group), chunk_rows_spec(chunk, dk, group), chunk_rows_spec(chunk, dk),
            chunk_column_spec(chunk),
        ],
        out_specs=[chunk_rows_spec(chunk, chunk)] * 2,
        out_shape=[out, out],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_solve",
    )(q, k, g, beta)
