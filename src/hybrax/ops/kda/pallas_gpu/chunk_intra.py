"""KDA chunked forward, stage 1 (Pallas, Triton lowering): everything within a chunk, in one kernel.

One program per (chunk, value head, batch). With G the chunk-local cumulative log decay,

    A_kk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)   (j < i)    ->  T = (I + A_kk)^-1 is stored
    A_qk[i, j] =        sum_c q_ic k_jc exp(G_ic - G_jc)   (j <= i)   ->  stored

and then, from T in registers, the WY form and the decayed keys and queries (`chunk_wy.write_wy`).
q and k come in raw: their L2 norms and the scale enter as row and column factors of the scores and
row factors of the WY form (`row_factors`), so the forward writes no normalized copies first.

A_kk and A_qk are built whole ([C, C]) from one masked matmul per 16-row sub-chunk a and K slice: for
row i in a (first row r) and column j in sub-chunk b (first row s), exp(G_i - G_j) factors into
exp(G_i - G_r) <= 1 (rows of a, zeros elsewhere), a per-channel link exp(G_r - G_s) <= 1 (b < a; 1 for
b = a; columns of later sub-chunks, above the diagonal, get zeros) and exp(G_s - G_j) >= 1, bounded by
b's own decay. Two [C, BK] exps per K slice (each row against its own sub-chunk's first row) serve
every sub-chunk (earlier forms loaded two per sub-chunk). A steep chunk (some sub-chunk decays
by more than exp(STEEP) in some channel: gates of -1000, -1e30, -inf) takes the whole tile column by column
instead, and its WY form too, from the per-token gates, each decay a sum of only the gates between its two
positions (`chunk_gates`): the kernel never overflows, never cancels two large cumulative gates, and
very negative gates underflow to exactly 0.
Three quarters of each dot's left operand is zeros: on the H200 the tensor cores absorb that, and this
took stage 1 from 1.07 ms (16x16 block dots, then a separate WY kernel) to 0.80 ms at
(1, 8192, 32, 128) bf16 (H200 measurements). [16, C] row blocks stacked into the tile afterwards do a
quarter of the dot work but took 1.82 ms there against 0.75: Triton's stacking (join, transpose,
reshape) costs far more than the zeros. T follows on the whole tile by growing inverted diagonal blocks
(`unit_lower_inverse`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.common.delta import inverse_l2_norm
from hybrax.ops.kda.pallas_gpu.chunk_gates import EXACT_BLOCK_K, STEEP, pair_exponents, steep_chunk
from hybrax.ops.kda.pallas_gpu.chunk_wy import write_wy_either, wy_specs
from hybrax.ops.kda.pallas_gpu.tiles import (
    SUB, PackedChunks, chunk_rows_spec, chunk_windows, index_grid, packed_chunk_specs, pipeline_stages, split_packed,
    token_column_spec, token_rows_spec,
)
from hybrax.ops.pallas_shared import dot_settings, mm, mm_t, pallas_call, solve_precision


def unit_lower_inverse(strict_lower: jax.Array, precision) -> jax.Array:
    """(I + L)^-1 for a strictly lower n x n L (n a power of two >= 2), from the inverse X of its block
    diagonal, the blocks growing from 2 rows: the inverse of [[1, 0], [l, 1]] is [[1, 0], [-l, 1]] (no
    dots); then blocks 4x as large at once while they fit, else 2x.

    With L_off the part of L below X's blocks within blocks of 4 (or 2) of them, I + L = (I + N)(I + L_d)
    for N = L_off X, so (I + L)^-1 = X (I + N)^-1, and N is nilpotent: N^4 = 0 (N^2 = 0 for 2 blocks), so
    (I + N)^-1 = (I - N)(I + N^2) (or I - N). Four dots, three deep, grow the blocks 4x (two rounds of
    doubling: four dots, four deep)."""
    n = strict_lower.shape[0]
    rows, cols = index_grid(n)
    pairs = ((rows // 2) == (cols // 2)) & (rows > cols)
    inverse = (rows == cols).astype(jnp.float32) - jnp.where(pairs, strict_lower, 0.0)
    size = 2
    while size < n:
        growth = 4 if 4 * size <= n else 2
        below = ((rows // (growth * size)) == (cols // (growth * size))) & ((rows // size) > (cols // size))
        coupling = mm(jnp.where(below, strict_lower, 0.0), inverse, jnp.float32, precision)
        first = inverse - mm(inverse, coupling, jnp.float32, precision)
        if growth == 4:
            first = first + mm(first, mm(coupling, coupling, jnp.float32, precision), jnp.float32, precision)
        inverse = first
        size *= growth
    return inverse


class SubChunkDecay(NamedTuple):
    """exp(G_i - G_j) for the [C, BK] gates of one K slice, as factors: for row i in sub-chunk a (first
    row r) and column j in sub-chunk b <= a (first row s), exp(G_i - G_r) exp(G_r - G_s) exp(G_s - G_j)."""

    sub_chunk: jax.Array  # [C, BK] each row's sub-chunk
    down: jax.Array  # exp(G_i - G_s(i)) <= 1: each row from its own sub-chunk's first row
    up: jax.Array  # exp(G_s(j) - G_j) >= 1, bounded by the sub-chunk's decay (clamped at exp(STEEP))
    starts: list[jax.Array]  # [1, BK] G at each sub-chunk's first row

    def link(self, a: int) -> jax.Array:
        """[C, BK]: on the rows of sub-chunk b, exp(G_r - G_s) <= 1 for b < a, 1 for b = a, 0 after."""
        link = (self.sub_chunk == a).astype(jnp.float32)
        for b in range(a):
            link = jnp.where(self.sub_chunk == b, jnp.exp(self.starts[a] - self.starts[b]), link)
        return link


def sub_chunk_decay(g_ref, gates: jax.Array, slice_k) -> SubChunkDecay:
    """The factors of one K slice's [C, BK] gates (two [C, BK] exps serve every sub-chunk)."""
    sub_chunk = lax.broadcasted_iota(jnp.int32, gates.shape, 0) // SUB
    starts = [g_ref[a * SUB, slice_k][None, :] for a in range(gates.shape[0] // SUB)]
    own_start = functools.reduce(
        lambda tile, a: jnp.where(sub_chunk == a, starts[a], tile), range(len(starts) - 1), starts[-1]
    )
    down = jnp.exp(gates - own_start)
    up = jnp.exp(jnp.minimum(own_start - gates, STEEP))
    return SubChunkDecay(sub_chunk, down, up, starts)


def _exact_scores(q_ref, k_ref, raw_ref, *, block_k: int) -> tuple[jax.Array, jax.Array]:
    """Unscaled A_kk and A_qk [C, C] of a steep chunk, column by column from the last, each column's decays
    exp(sum_{j < t <= i} g_t) summed from the per-token gates (`pair_exponents`: no factor above 1; 1 on the
    diagonal and above it, where callers drop the entries). K in slices of `block_k`: whole [C, K] fp32 tiles of
    q, k and the gates would hold registers that every program pays for (at sm_90, this rarely taken branch
    alone spilled more than half of the kernel's spill bytes; `chunk_gates.EXACT_BLOCK_K`)."""
    chunk, dk = q_ref.shape
    _, cols = index_grid(chunk)

    def slice_scores(index, scores):
        slice_k = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        keys, queries = k_ref[:, slice_k].astype(jnp.float32), q_ref[:, slice_k].astype(jnp.float32)

        def column(step, carry):
            akk, aqk, exponents = carry
            j = chunk - 1 - step
            exponents = pair_exponents(exponents, raw_ref, j, slice_k)
            decayed = k_ref[j, slice_k].astype(jnp.float32)[None, :] * jnp.exp(exponents)
            akk = akk + jnp.where(cols == j, jnp.sum(keys * decayed, axis=1)[:, None], 0.0)
            aqk = aqk + jnp.where(cols == j, jnp.sum(queries * decayed, axis=1)[:, None], 0.0)
            return akk, aqk, exponents

        akk, aqk, _ = lax.fori_loop(0, chunk, column, (*scores, jnp.zeros(keys.shape, jnp.float32)))
        return akk, aqk

    zeros = jnp.zeros((chunk, chunk), jnp.float32)
    return lax.fori_loop(0, dk // block_k, slice_scores, (zeros, zeros))


def _factored_scores(q_ref, k_ref, g_ref, *, block_k: int, precision) -> tuple[jax.Array, jax.Array]:
    """Unscaled A_kk and A_qk [C, C] from `SubChunkDecay`'s factors, K in slices of `block_k` (wrong in
    steep chunks, whose clamped factors callers replace by `_exact_scores`). All four sub-chunks' passes
    share one loop over K: ptxas for sm_90 spills 428/348 bytes per thread for it (none with one loop per
    sub-chunk, which reads every K slice four times), yet on the H200 one loop took 0.689 ms, two
    sub-chunks per loop 0.923 and one 1.507 (H200 measurements)."""
    chunk, dk = q_ref.shape

    def accumulate(index, scores):
        akk, aqk = scores
        cols = pl.ds(pl.multiple_of(index * block_k, block_k), block_k)
        decay = sub_chunk_decay(g_ref, g_ref[:, cols], cols)
        keys, queries = k_ref[:, cols].astype(jnp.float32), q_ref[:, cols].astype(jnp.float32)
        keys_down, queries_down, keys_up = keys * decay.down, queries * decay.down, keys * decay.up
        for a in range(chunk // SUB):
            in_a = decay.sub_chunk == a
            right = keys_up * decay.link(a)
            akk = akk + mm_t(jnp.where(in_a, keys_down, 0.0), right, jnp.float32, precision)
            aqk = aqk + mm_t(jnp.where(in_a, queries_down, 0.0), right, jnp.float32, precision)
        return akk, aqk

    zeros = jnp.zeros((chunk, chunk), jnp.float32)
    return lax.fori_loop(0, dk // block_k, accumulate, (zeros, zeros))


def row_factors(q_ref, k_ref, scale: float, l2_normalize: bool, block_k: int) -> tuple[jax.Array, jax.Array]:
    """[C] fp32 factors that take the rows of q and k to `prepare_qk`'s: scale / |q_i| and 1 / |k_i|, from
    the K slices of `block_k` after the scores, read in straight-line code with one row sum after them (a
    loop with a row sum per slice put a barrier before each slice's reads, so each waited out a memory round
    trip). On the H200 (stage 1 alone) that loop took 0.712-0.728 ms; whole [C, K] tiles
    1.45, the loop before the scores 0.89, the squares summed in the score loops 0.723-0.730: at 255
    registers, values live across the score loop cost more than loads."""
    ones = jnp.ones(q_ref.shape[:1], jnp.float32)
    if not l2_normalize:
        return scale * ones, ones

    def squares(ref):  # [C, block_k] sums of squares over the K slices, one row sum after them
        slices = [ref[:, pl.ds(index * block_k, block_k)] for index in range(ref.shape[1] // block_k)]
        return jnp.sum(functools.reduce(jnp.add, [jnp.square(x.astype(jnp.float32)) for x in slices]), axis=1)

    return scale * inverse_l2_norm(squares(q_ref)), inverse_l2_norm(squares(k_ref))


def _intra_kernel(
    q_ref, k_ref, v_ref, g_ref, raw_ref, beta_ref, *refs, with_inverse: bool, packed: bool,
    scale: float, l2_normalize: bool, block_k: int, block_v: int, precision, compute_dtype, wy_precision,
):
    packed_refs, out_refs = split_packed(refs, packed)
    inverse_ref, aqk_ref, *wy_refs = out_refs if with_inverse else (None, *out_refs)
    chunk = g_ref.shape[0]
    q_ref, k_ref, v_ref, raw_ref, beta_ref = chunk_windows((q_ref, k_ref, v_ref, raw_ref, beta_ref), packed_refs, chunk)
    rows, cols = index_grid(chunk)
    steep = steep_chunk(g_ref)
    betas = beta_ref[...].astype(jnp.float32)[:, None]  # read early: a plain load after barriers waits
    akk, aqk = lax.cond(
        steep,
        lambda: _exact_scores(q_ref, k_ref, raw_ref, block_k=min(block_k, EXACT_BLOCK_K)),
        lambda: _factored_scores(q_ref, k_ref, g_ref, block_k=block_k, precision=precision),
    )
    # q and k enter raw: the scores of the normalized, scaled rows are the raw scores with each row and
    # column scaled (A_kk[i, j] / (|k_i| |k_j|)), and the WY form takes its rows scaled, so no pass over
    # memory writes normalized copies first (`prepare_qk`).
    query_norms, key_norms = row_factors(q_ref, k_ref, scale, l2_normalize, block_k)
    key_rows, key_cols = key_norms[:, None], key_norms[None, :]
    aqk = aqk * query_norms[:, None] * key_cols
    aqk_ref[...] = jnp.where(rows >= cols, aqk, 0.0).astype(aqk_ref.dtype)  # stored first: its registers free
    inverse = unit_lower_inverse(jnp.where(rows > cols, akk * (betas * key_rows) * key_cols, 0.0), precision)
    if with_inverse:
        inverse_ref[...] = inverse.astype(inverse_ref.dtype)
    write_wy_either(
        steep, g_ref, raw_ref, inverse, betas, q_ref, k_ref, v_ref, *wy_refs,
        query_rows=query_norms[:, None], key_rows=key_rows,
        block_k=block_k, block_v=block_v, compute_dtype=compute_dtype, precision=wy_precision,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "l2_normalize", "chunk", "with_inverse", "block_k", "block_v", "num_warps", "num_stages",
        "interpret",
    ),
)
def chunk_intra(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, raw_g: jax.Array, beta: jax.Array,
    packed: PackedChunks | None = None, *,
    scale: float = 1.0, l2_normalize: bool = False, chunk: int = 64, with_inverse: bool = True, block_k: int = 32,
    block_v: int = 64, num_warps: int = 4, num_stages: int | None = None, interpret: bool = False,
) -> tuple[tuple[jax.Array, jax.Array], tuple[jax.Array, ...]]:
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] chunk-local cumulative log decay G (fp32, stage 0's);
    raw_g [B, T, HV, K] the per-token log decays (stage 0's input, fp32: what steep chunks read); beta
    [B, T, HV]. T a multiple of the chunk, K and V powers of two >= 16, HV a multiple of H. The kernel takes q
    and k as `prepare_qk(q, k, scale, l2_normalize)` would give them (the defaults: as they come).

    Returns (T = (I + A_kk)^-1, A_qk), each [B, T, HV, chunk] (row t: row t % chunk of its chunk's
    matrix, zeros above the diagonal; T None without `with_inverse`: only the backward reads it), and
    `chunk_wy`'s (w, u, kg, qg, decay), in the inputs' dtype (decay fp32).

    With `packed`, q, k, v, raw_g and beta hold packed sequences ([1, T', ...], any T'), read in place, and g
    and every result are in the padded layout ([1, NT * chunk, ...]).
    """
    dk, dv = q.shape[3], v.shape[3]
    batch, length, value_heads = g.shape[:3]
    group = value_heads // q.shape[2]
    compute_dtype, wy_precision = dot_settings(q.dtype, interpret)
    kernel = functools.partial(
        _intra_kernel, with_inverse=with_inverse, packed=packed is not None, scale=scale, l2_normalize=l2_normalize,
        block_k=min(block_k, dk), block_v=min(block_v, dv), precision=solve_precision(interpret, q.dtype),
        compute_dtype=compute_dtype, wy_precision=wy_precision,
    )
    rows = functools.partial(chunk_rows_spec, chunk)
    tokens = functools.partial(token_rows_spec, chunk, packed_length=None if packed is None else q.shape[1])
    in_specs = [
        tokens(dk, group), tokens(dk, group), tokens(dv), rows(dk), tokens(dk),
        token_column_spec(chunk, None if packed is None else q.shape[1]), *packed_chunk_specs(packed, length // chunk),
    ]
    wy_out_specs, wy_out_shape = wy_specs(chunk, length, q, v)
    square = jax.ShapeDtypeStruct((batch, length, value_heads, chunk), q.dtype)
    squares = 2 if with_inverse else 1
    outputs = pallas_call(
        kernel,
        grid=(value_heads, length // chunk, batch),
        in_specs=in_specs,
        out_specs=[*[rows(chunk)] * squares, *wy_out_specs],
        out_shape=[*[square] * squares, *wy_out_shape],
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps, num_stages=num_stages or pipeline_stages(q.dtype, dk)
        ),
        interpret=interpret,
        name="kda_chunk_intra",
    )(q, k, v, g, raw_g, beta, *(packed or ()))
    return (outputs[0] if with_inverse else None, outputs[squares - 1]), tuple(outputs[squares:])
