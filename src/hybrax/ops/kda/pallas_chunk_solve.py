"""KDA chunked forward, stage 1b (Pallas, Triton lowering): the blocks of A below the diagonal, and
the full triangular inverse T = (I + A_kk)^-1 of each chunk.

One program per (chunk, value head, batch). A block (a, b), b < a, of 16-row sub-chunks splits
exp(G_i - G_j) at the row r just before sub-chunk a (j <= r < i) into exp(G_i - G_r) exp(G_r - G_j),
two factors <= 1, and takes a matmul:

    A_kk[a, b] = (beta k exp(G - G_r))_a (k exp(G_r - G))_b^T,   A_qk[a, b] = (q exp(G - G_r))_a (...)_b^T

With the diagonal blocks' inverses from stage 1a, T's blocks below the diagonal follow by forward
substitution: T[a, b] = -T[a, a] sum_{b <= c < a} A_kk[a, c] T[c, b]. T is stored whole ([C, C], zeros
above the diagonal) so that stage 1c applies it with one matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import SUB, dot_settings, mm, mm_t, solve_precision, sub_column, sub_tile


def _solve_kernel(
    q_ref, k_ref, g_ref, beta_ref, inverse_diagonal_ref, aqk_diagonal_ref, inverse_ref, aqk_ref,
    *, compute_dtype, precision, fp32_precision,
):
    n_sub = q_ref.shape[0] // SUB
    akk, inverse = {}, {}
    for a in range(n_sub):
        rows = pl.ds(a * SUB, SUB)
        inverse[a, a] = sub_tile(inverse_diagonal_ref, a)
        aqk_ref[rows, pl.ds(a * SUB, SUB)] = aqk_diagonal_ref[rows, :].astype(aqk_ref.dtype)
        for b in range(a + 1, n_sub):
            aqk_ref[rows, pl.ds(b * SUB, SUB)] = jnp.zeros((SUB, SUB), aqk_ref.dtype)
            inverse_ref[rows, pl.ds(b * SUB, SUB)] = jnp.zeros((SUB, SUB), inverse_ref.dtype)
        if not a:
            continue
        start = g_ref[a * SUB - 1, :][None, :]
        to_start = jnp.exp(sub_tile(g_ref, a) - start)
        left_kk = sub_tile(k_ref, a) * sub_column(beta_ref, a) * to_start
        left_qk = sub_tile(q_ref, a) * to_start
        for b in range(a):
            right = sub_tile(k_ref, b) * jnp.exp(start - sub_tile(g_ref, b))
            akk[a, b] = mm_t(left_kk, right, jnp.float32, fp32_precision)
            aqk_ref[rows, pl.ds(b * SUB, SUB)] = mm_t(left_qk, right, compute_dtype, precision).astype(aqk_ref.dtype)

    for a in range(n_sub):
        rows = pl.ds(a * SUB, SUB)
        for b in range(a - 1, -1, -1):
            acc = sum(mm(akk[a, c], inverse[c, b], jnp.float32, fp32_precision) for c in range(b, a))
            inverse[a, b] = -mm(inverse[a, a], acc, jnp.float32, fp32_precision)
        for b in range(a + 1):
            inverse_ref[rows, pl.ds(b * SUB, SUB)] = inverse[a, b].astype(inverse_ref.dtype)


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def chunk_solve(
    q: jax.Array, k: jax.Array, g: jax.Array, beta: jax.Array, inverse_diagonal: jax.Array,
    aqk_diagonal: jax.Array, *, chunk: int = 64, num_warps: int = 4, interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """q, k [B, T, H, K]; g [B, T, HV, K]; beta [B, T, HV]; the diagonal blocks [B, T, HV, 16] of stage 1a.

    Returns T = (I + A_kk)^-1 and A_qk, each [B, T, HV, chunk] (row t: row t % chunk of its chunk's
    matrix), in the inputs' dtype.
    """
    batch, length, heads, dk = q.shape
    value_heads = g.shape[2]
    group = value_heads // heads
    compute_dtype, precision = dot_settings(q.dtype, interpret)

    def rows_spec(width, head=lambda h: h):
        return pl.BlockSpec((None, chunk, None, width), lambda t, h, b: (b, t, head(h), 0))

    out = jax.ShapeDtypeStruct((batch, length, value_heads, chunk), q.dtype)
    kernel = functools.partial(
        _solve_kernel, compute_dtype=compute_dtype, precision=precision, fp32_precision=solve_precision(interpret)
    )
    return pl.pallas_call(
        kernel,
        grid=(length // chunk, value_heads, batch),
        in_specs=[
            rows_spec(dk, lambda h: h // group), rows_spec(dk, lambda h: h // group), rows_spec(dk),
            pl.BlockSpec((None, chunk, None), lambda t, h, b: (b, t, h)), rows_spec(SUB), rows_spec(SUB),
        ],
        out_specs=[rows_spec(chunk), rows_spec(chunk)],
        out_shape=[out, out],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_solve",
    )(q, k, g, beta, inverse_diagonal, aqk_diagonal)
