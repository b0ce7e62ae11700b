"""KDA on XLA, chunked (the WY / UT form), with a custom VJP: the default for training.

Within a chunk of C tokens with log decays g (fp32), write G_i = sum_{s<=i} g_s and U for the
delta-rule updates. With the state S0 before the chunk (per value head, [K, V]):

    A_kk[i, j] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc)   (j < i)      T = (I + A_kk)^-1
    A_qk[i, j] = scale sum_c q_ic k_jc exp(G_ic - G_jc)    (j <= i)
    w = T (beta k exp(G)),  u = T (beta v),  U = u - w S0
    o = scale q exp(G) S0 + A_qk U  = P S0 + A_qk u,            P = scale q exp(G) - A_qk w
    S_C = exp(G_C) S0 + (k exp(G_C - G))^T U  = M S0 + N,       M = Diag(exp(G_C)) - kg^T w, N = kg^T u

Everything but the state pass S_{n+1} = M_n S_n + N_n is independent per chunk, so it runs for all
chunks at once; the pass is a scan over chunks of one [K, K] x [K, V] product.

Safe gates: every exponent is a sum of only the gates between its two positions (prefix sums,
suffix sums, or pairwise sums built with masked matmuls), never a difference of two long cumsums.
So exponents are <= 0 (no overflow), a gate of -1000 underflows to exactly what it should, and a
large cumulative decay costs no precision in the terms that matter. Per-channel decays take the
pairwise sums over sub-chunks of 16: blocks below the diagonal factor exp(G_i - G_j) at the row r
ending the previous sub-chunk (j <= r < i) into two factors <= 1 and use matmuls; diagonal blocks
form the [16, 16, K] exponents directly. A per-head decay needs only a [C, C] exponent matrix.
The pairwise sums are masked matmuls, so the gates enter clamped at GATE_FLOOR = -1e30: a gate of -inf
(log 0, a hard reset) would give 0 * -inf = NaN in them. The clamp is exact: an exponent that holds a clamped
gate is <= -1e30 and its exp is 0 in fp32, as the true one's (down to exp(-inf)) is; sums of up to 128 such
gates stay finite; and the gradient w.r.t. a gate below the floor is 0, as every term holding it carries its
exp, 0.

The backward stores the per-chunk states S_n only (never per-token states): it recomputes the
chunk-local quantities under `jax.vjp`, runs the state pass in reverse by hand, and maps the
cotangents back through the layout (padding, packing, GVA, l2norm) with `jax.vjp`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from hybrax.core import Invocation, register, vary_like
from hybrax.ops.kda.base import CHUNK_SIZES, GATE_FLOOR, OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.common.delta import EXACT, value_head_qk
from hybrax.ops.kda.common.layout import Layout, Segments, dense_layout, from_packed_rows, packed_layout, to_packed_rows

SUB_CHUNK = 16


def _mm(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=EXACT)


# ----------------------------------------------------------------------------- chunk-local math


def unit_lower_inverse(strict_lower: jax.Array) -> jax.Array:
    """(I + L)^-1 for strictly lower [..., n, n] L, n a power of two, by blocked forward substitution:
    diagonal blocks double in size each round, [[A, 0], [L21, B]]^-1 = [[A^-1, 0], [-B^-1 L21 A^-1, B^-1]],
    so log2(n) rounds of batched matmuls build the inverse."""
    *batch, n, _ = strict_lower.shape
    inverse = jnp.ones((*batch, n, 1, 1), strict_lower.dtype)  # the diagonal blocks, size 1
    size = 1
    while size < n:
        pairs = n // (2 * size)
        blocks = strict_lower.reshape(*batch, pairs, 2, size, pairs, 2, size)[..., 1, :, :, 0, :]
        below = jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., pairs, size, size]
        halves = inverse.reshape(*batch, pairs, 2, size, size)
        top, bottom = halves[..., 0, :, :], halves[..., 1, :, :]
        corner = -_mm("...ij,...jk,...kl->...il", bottom, below, top)
        upper = jnp.concatenate([top, jnp.zeros_like(top)], axis=-1)
        inverse = jnp.concatenate([upper, jnp.concatenate([corner, bottom], axis=-1)], axis=-2)
        size *= 2
    return inverse[..., 0, :, :]


def _prefix_sums(g: jax.Array) -> jax.Array:
    """sum_{s <= i} g_s along axis -2."""
    return jnp.cumsum(g, axis=-2)


def _suffix_sums(g: jax.Array) -> jax.Array:
    """sum_{s > i} g_s along axis -2 (exclusive, so no subtraction of g_i)."""
    inclusive = jnp.flip(jnp.cumsum(jnp.flip(g, -2), axis=-2), -2)
    return jnp.concatenate([inclusive[..., 1:, :], jnp.zeros_like(inclusive[..., :1, :])], axis=-2)


def _between(n: int) -> np.ndarray:
    """mask[i, j, s] = j < s <= i: which gates lie between positions j and i."""
    s = np.arange(n)
    return ((s[None, None, :] > s[None, :, None]) & (s[None, None, :] <= s[:, None, None])).astype(np.float32)


def _head_scores(lefts: tuple[jax.Array, ...], k: jax.Array, g: jax.Array) -> tuple[jax.Array, ...]:
    """Per-head decay g [..., C, 1]: left_i . k_j exp(G_i - G_j) for every j <= i, [..., C, C] each."""
    exponent = _mm("ijs,...s->...ij", _between(g.shape[-2]), g[..., 0])
    decay = jnp.exp(exponent)  # <= 1; entries j > i are exp(0) and masked by the caller
    return tuple(_mm("...ik,...jk->...ij", left, k) * decay for left in lefts)


def _channel_scores(lefts: tuple[jax.Array, ...], k: jax.Array, g: jax.Array) -> tuple[jax.Array, ...]:
    """Per-channel decay g [..., C, K]: sum_c left_ic k_jc exp(G_ic - G_jc) for every j <= i, by sub-chunks."""
    *batch, chunk, dk = k.shape
    sub = min(SUB_CHUNK, chunk)
    count = chunk // sub
    split = lambda x: x.reshape(*batch, count, sub, x.shape[-1])  # noqa: E731
    g, k = split(g), split(k)
    totals = jnp.sum(g, axis=-2)  # [..., count, K]
    blocks = np.arange(count)
    # Gates strictly between sub-chunks b and a: sum of the totals of b < m < a.
    between = ((blocks[None, None, :] > blocks[None, :, None]) & (blocks[None, None, :] < blocks[:, None, None]))
    gap = _mm("abm,...mk->...abk", between.astype(np.float32), totals)
    # Off-diagonal blocks, b < a: exp(G_i - G_j) = exp(G_i - G_r) exp(G_r - G_j), r = last row of sub-chunk a - 1.
    right = k[..., None, :, :, :] * jnp.exp(_suffix_sums(g)[..., None, :, :, :] + gap[..., :, :, None, :])
    below = (blocks[:, None] > blocks[None, :]).astype(np.float32)[:, None, :, None]  # [a, 1, b, 1]
    # Diagonal blocks: the exponents themselves, [..., count, sub, sub, K].
    diagonal = jnp.exp(_mm("ijs,...ask->...aijk", _between(sub), g))
    on_diagonal = np.eye(count, dtype=np.float32)[:, None, :, None]
    scores = []
    for left in lefts:
        left = split(left)
        off = _mm("...aik,...abjk->...aibj", left * jnp.exp(_prefix_sums(g)), right) * below
        diag = _mm("...aik,...ajk,...aijk->...aij", left, k, diagonal)
        full = off + diag[..., :, :, None, :] * on_diagonal
        scores.append(full.reshape(*batch, chunk, chunk))
    return tuple(scores)


class ChunkTerms(NamedTuple):
    """What the state pass and the output need from each chunk: o = P S + qu, S' = M S + N."""

    p: jax.Array  # [..., C, K]
    qu: jax.Array  # [..., C, V]  (A_qk u)
    m: jax.Array  # [..., K, K]
    n: jax.Array  # [..., K, V]


def chunk_terms(q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, g: jax.Array, scale: float) -> ChunkTerms:
    """Chunk-local WY / UT form. q, k [..., C, K] (normalized); v [..., C, V]; beta [..., C]; g [..., C, Kd]."""
    chunk, dk = q.shape[-2:]
    q = q * scale
    k_beta = k * beta[..., None]
    scores = _head_scores if g.shape[-1] == 1 else _channel_scores
    a_kk, a_qk = scores((k_beta, q), k, g)
    rows = np.arange(chunk)
    a_kk = a_kk * (rows[:, None] > rows[None, :])
    a_qk = a_qk * (rows[:, None] >= rows[None, :])
    solve = unit_lower_inverse(a_kk)
    prefix = jnp.exp(_prefix_sums(g))
    w = _mm("...ij,...jk->...ik", solve, k_beta * prefix)
    u = _mm("...ij,...jv->...iv", solve, v * beta[..., None])
    p = q * prefix - _mm("...ij,...jk->...ik", a_qk, w)
    k_to_end = k * jnp.exp(_suffix_sums(g))
    to_end = jnp.exp(jnp.sum(g, axis=-2))  # [..., Kd]
    m = jnp.eye(dk, dtype=jnp.float32) * to_end[..., None, :] - _mm("...ck,...cj->...kj", k_to_end, w)
    return ChunkTerms(p, _mm("...ij,...jv->...iv", a_qk, u), m, _mm("...ck,...cv->...kv", k_to_end, u))


# ----------------------------------------------------------------------------- the state pass


def state_pass(m: jax.Array, n: jax.Array, initial: jax.Array, segments: Segments) -> tuple[jax.Array, jax.Array]:
    """m [R, HV, Nc, K, K], n [R, HV, Nc, K, V], initial [R, Ns, HV, K, V].
    Returns the state entering each chunk [R, HV, Nc, K, V] and the final states [R, Ns, HV, K, V]."""

    def body(carry, chunk):
        state, finals = carry
        m, n, index, first, last = chunk
        state = jnp.where(first, initial[:, index], state)
        entering = state
        state = _mm("rhij,rhjv->rhiv", m, state) + n
        finals = finals.at[:, index].set(jnp.where(last, state, finals[:, index]))
        return (state, finals), entering

    chunks = (jnp.moveaxis(m, 2, 0), jnp.moveaxis(n, 2, 0), *segments)
    (_, finals), entering = lax.scan(body, (initial[:, 0], initial), chunks)
    return jnp.moveaxis(entering, 0, 2), finals


def state_pass_transpose(
    m: jax.Array, entering: jax.Array, from_output: jax.Array, d_finals: jax.Array, segments: Segments
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The state pass in reverse. from_output [R, HV, Nc, K, V] is P^T dO per chunk.
    Returns (dM, dN, d_initial)."""

    def body(carry, chunk):
        d_next, d_seq = carry  # d_next: cotangent of the state leaving this chunk; d_seq: per sequence
        m, state, local, index, first, last = chunk
        owed = d_seq[:, index]
        d_out = d_next + jnp.where(last, owed, 0.0)
        d_seq = d_seq.at[:, index].set(jnp.where(last, 0.0, owed))
        d_in = local + _mm("rhji,rhjv->rhiv", m, d_out)
        # A chunk that restarts the state sends its cotangent to the initial state, not backwards.
        d_seq = d_seq.at[:, index].add(jnp.where(first, d_in, 0.0))
        dm = _mm("rhiv,rhjv->rhij", d_out, state)
        return (jnp.where(first, 0.0, d_in), d_seq), (dm, d_out)

    chunks = (*(jnp.moveaxis(x, 2, 0) for x in (m, entering, from_output)), *segments)
    (_, d_initial), (dm, dn) = lax.scan(body, (jnp.zeros_like(entering[:, :, 0]), d_finals), chunks, reverse=True)
    return jnp.moveaxis(dm, 0, 2), jnp.moveaxis(dn, 0, 2), d_initial


# ----------------------------------------------------------------------------- layout


class Chunked(NamedTuple):
    """Inputs in chunks, fp32: q, k, g [R, HV, Nc, C, K | Kd]; v [R, HV, Nc, C, V]; beta [R, HV, Nc, C];
    initial [R, Ns, HV, K, V]. R = B rows of one sequence each, or one row of Ns packed sequences."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    beta: jax.Array
    g: jax.Array
    initial: jax.Array


def _layout(problem: KdaProblem, chunk: int) -> Layout:
    length = problem.q.shape[1]
    if problem.cu_seqlens is None:
        return dense_layout(length, chunk)
    return packed_layout(problem.cu_seqlens, length, chunk)


def _to_chunks(x: jax.Array, layout: Layout, chunk: int) -> jax.Array:
    """[B, T, HV, ...] -> [R, HV, Nc, C, ...], zero-padded (zero tokens leave the state untouched)."""
    padded = layout.num_chunks * chunk
    if layout.destination is None:
        x = jnp.pad(x, [(0, 0), (0, padded - x.shape[1])] + [(0, 0)] * (x.ndim - 2))
    else:
        x = to_packed_rows(x, layout)
    x = x.reshape(x.shape[0], layout.num_chunks, chunk, *x.shape[2:])
    return jnp.moveaxis(x, 3, 1)


def _from_chunks(o: jax.Array, layout: Layout, length: int) -> jax.Array:
    """[R, HV, Nc, C, V] -> [B, T, HV, V]; tokens of no sequence read zeros."""
    o = jnp.moveaxis(o, 1, 3)
    o = o.reshape(o.shape[0], -1, *o.shape[3:])
    if layout.destination is None:
        return o[:, :length]
    return from_packed_rows(o, layout)


def _chunked_inputs(problem: KdaProblem, layout: Layout, chunk: int) -> Chunked:
    q, k = value_head_qk(problem)
    shape = problem.state_shape
    initial = problem.initial_states()
    rows = problem.q.shape[0] if problem.cu_seqlens is None else 1
    initial = initial.reshape(rows, shape[0] // rows, *shape[1:])
    to_chunks = lambda x: _to_chunks(x, layout, chunk)  # noqa: E731
    return Chunked(
        to_chunks(q), to_chunks(k), to_chunks(problem.v.astype(jnp.float32)), to_chunks(problem.beta),
        to_chunks(jnp.maximum(problem.decay, GATE_FLOOR)), initial,
    )


def _outputs(problem: KdaProblem, layout: Layout, o: jax.Array, finals: jax.Array) -> tuple[jax.Array, jax.Array]:
    o = _from_chunks(o, layout, problem.q.shape[1]).astype(problem.q.dtype)
    return o, finals.reshape(problem.state_shape)


# ----------------------------------------------------------------------------- forward, backward


def _forward(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[tuple[jax.Array, jax.Array], jax.Array]:
    """((o, final state), the state entering each chunk)."""
    layout = _layout(problem, cfg.chunk_size)
    x = _chunked_inputs(problem, layout, cfg.chunk_size)
    terms = chunk_terms(x.q, x.k, x.v, x.beta, x.g, problem.scale)
    entering, finals = state_pass(terms.m, terms.n, x.initial, layout.segments)
    o = _mm("...ck,...kv->...cv", terms.p, entering) + terms.qu
    return _outputs(problem, layout, o, finals), entering


def chunked_forward_with_residuals(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple:
    result, entering = _forward(problem, cfg)
    return result, (problem, entering)


def chunked_backward(
    cfg: KernelDeltaAttentionConfig, residuals: tuple[KdaProblem, jax.Array], ct: tuple
) -> KdaProblem:
    """The gradient from the problem and the fp32 states entering each chunk [R, HV, Nc, K, V]
    (the residuals of `chunked_forward_with_residuals`)."""
    problem, entering = residuals
    chunk = cfg.chunk_size
    layout = _layout(problem, chunk)
    x, inputs_vjp = jax.vjp(lambda p: _chunked_inputs(p, layout, chunk), problem)
    terms, terms_vjp = jax.vjp(
        lambda q, k, v, beta, g: chunk_terms(q, k, v, beta, g, problem.scale), x.q, x.k, x.v, x.beta, x.g
    )
    o_shape = (*entering.shape[:-2], chunk, problem.v.shape[3])
    _, outputs_vjp = jax.vjp(  # linear: any primal point will do; zeros varying as the cotangent does
        lambda o, finals: _outputs(problem, layout, o, finals),
        *vary_like((jnp.zeros(o_shape, jnp.float32), jnp.zeros(x.initial.shape, jnp.float32)), ct),
    )
    d_o, d_finals = outputs_vjp(ct)
    d_m, d_n, d_initial = state_pass_transpose(
        terms.m, entering, _mm("...ck,...cv->...kv", terms.p, d_o), d_finals, layout.segments
    )
    d_terms = ChunkTerms(_mm("...cv,...kv->...ck", d_o, entering), d_o, d_m, d_n)
    (d_problem,) = inputs_vjp(Chunked(*terms_vjp(d_terms), d_initial))
    return d_problem


def _heuristic(inv: Invocation) -> KernelDeltaAttentionConfig:
    return KernelDeltaAttentionConfig(chunk_size=inv.static["chunk_size"])


def _candidates(inv: Invocation) -> list[KernelDeltaAttentionConfig]:
    return [KernelDeltaAttentionConfig(chunk_size=c) for c in CHUNK_SIZES]


def _supports(inv: Invocation) -> str | None:
    return None if inv.static["use_chunked"] else "use_chunked=False asks for the recurrent scan"


@register(OP_ID, "xla", "chunked", heuristic_cfg=_heuristic, candidate_cfgs=_candidates,
          supports=_supports, fwd=chunked_forward_with_residuals, bwd=chunked_backward)
def kda_chunked(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    return _forward(problem, cfg)[0]
