"""The chunked backend: matmuls inside chunks of C tokens, the [K, V] state passed from chunk to chunk.

Numerical safety: no exponent is ever formed from a difference of cumulative gate sums. Decays enter as
products of per-token factors exp(g_t) over stretches of tokens that lie between the two positions
they relate, so decaying gates only ever give factors in [0, 1] (no overflow, no inf * 0), a gate of
-1000 gives an exact zero, and the relative rounding is that of a product of at most C factors.
- Inter-chunk: token i reads the incoming state through the product of the factors from the chunk
  start to i; token j enters the outgoing state through the product of the factors after j.
- Intra-chunk with per-channel gates: the chunk is split in halves recursively (log2 C levels). For a
  pair of neighbouring blocks, the later block's queries are scaled by the product from the blocks'
  seam to i and the earlier block's keys by the product from j to the seam: both are <= 1, their
  product is the exact decay from j to i, and each block pair is one matmul. The diagonal (i = j) is
  undecayed. Every pair j < i is covered at exactly one level. The products for blocks of 2h tokens
  come from those for blocks of h by one multiplication (`_coarsen`).
- Intra-chunk with a per-head scalar gate only: one [C, C] score matrix times the pairwise decay
  exp(sum_{t=j+1..i} g_t), whose exponent is a masked cumulative sum (<= 0, summed directly).
Packed sequences (`cu_seqlens`) are laid out so that each one starts on a chunk boundary
(`hybrax.core.packing.chunk_layout`: at most N*(C-1) padding tokens in all; exact, no masks inside
chunks); the state is reset to the sequence's initial state at its first chunk. Padding tokens have
zero keys, values and log gates, so they leave the state unchanged.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from hybrax.core import register, vary_like
from hybrax.core.packing import ChunkLayout, chunk_layout
from hybrax.ops.recurrent.base import OP_ID, RecurrentAttentionConfig
from hybrax.ops.recurrent.engine import decay_state, forward, vjp_rules

CHUNK_SIZES = (16, 32, 64, 128)
GROUP_TOKENS = 1024  # tokens (per head) whose chunks are processed together; see _grouped_chunk_parts


def _times(x: jax.Array, factor: jax.Array | None) -> jax.Array:
    return x if factor is None else x * factor


class _BlockDecays(NamedTuple):
    """Per-token decay products inside blocks of tokens along axis -2 (values in (0, 1] for decaying gates)."""

    upto: jax.Array  # product over the block's tokens up to and including t
    after: jax.Array  # product over the block's tokens after t


def _split_pairs(x: jax.Array, half: int) -> jax.Array:
    """[..., C, D] -> [..., C / (2 half), 2 (earlier, later), half, D]."""
    return x.reshape(x.shape[:-2] + (x.shape[-2] // (2 * half), 2, half, x.shape[-1]))


def _merge_pairs(pair: jax.Array) -> jax.Array:
    return pair.reshape(pair.shape[:-4] + (-1, pair.shape[-1]))


def _coarsen(d: _BlockDecays, half: int) -> _BlockDecays:
    """Products in blocks of 2*half tokens from those in blocks of half: multiply in the other half's total."""
    upto, after = _split_pairs(d.upto, half), _split_pairs(d.after, half)
    is_later = (jnp.arange(2) == 1)[:, None, None]
    earlier_total, later_total = upto[..., 0:1, -1:, :], upto[..., 1:2, -1:, :]
    upto = upto * jnp.where(is_later, earlier_total, 1)
    after = after * jnp.where(is_later, 1, later_total)
    return _BlockDecays(_merge_pairs(upto), _merge_pairs(after))


def _block_decays(decay: jax.Array | None, chunk: int) -> list[_BlockDecays | None]:
    """Products for blocks of 1, 2, 4, ..., chunk tokens, built by multiplying (no exp, no long sums)."""
    if decay is None:
        return [None] * (chunk.bit_length())
    # The barriers keep XLA from fusing each level's whole chain of products (and the exp) into every
    # consumer, which recomputes it once per level.
    levels = [jax.lax.optimization_barrier(_BlockDecays(decay, jnp.ones_like(decay)))]
    while len(levels) < chunk.bit_length():
        levels.append(jax.lax.optimization_barrier(_coarsen(levels[-1], 1 << (len(levels) - 1))))
    return levels


def _block_pair_level(q, k, v, decay_k: _BlockDecays | None, decay_v: _BlockDecays | None, half: int):
    """Contribution of earlier-half keys j to later-half queries i, for blocks of 2*half tokens."""

    def earlier(x):
        return _split_pairs(x, half)[..., 0, :, :]

    def later(x):
        return _split_pairs(x, half)[..., 1, :, :]

    q_later, k_earlier, v_earlier, out_scale = later(q), earlier(k), earlier(v), None
    if decay_k is not None:
        q_later, k_earlier = q_later * later(decay_k.upto), k_earlier * earlier(decay_k.after)
    if decay_v is not None:
        v_earlier, out_scale = v_earlier * earlier(decay_v.after), later(decay_v.upto)
    scores = jnp.einsum("...ik,...jk->...ij", q_later, k_earlier)
    out_later = _times(jnp.einsum("...ij,...jv->...iv", scores, v_earlier), out_scale)
    return _merge_pairs(jnp.stack([jnp.zeros_like(out_later), out_later], axis=-3))


def _intra_per_channel(q, k, v, decays_k: list, decays_v: list) -> jax.Array:
    out = jnp.einsum("...ck,...ck->...c", q, k)[..., None] * v
    for level in range(len(decays_k) - 1):
        out = out + _block_pair_level(q, k, v, decays_k[level], decays_v[level], 1 << level)
    return out


def _intra_scalar(q, k, v, log: jax.Array | None) -> jax.Array:
    """log: [..., C, 1] or None."""
    chunk = q.shape[-2]
    scores = jnp.einsum("...ik,...jk->...ij", q, k)
    causal = jnp.tri(chunk, dtype=bool)
    if log is None:
        return jnp.einsum("...ij,...jv->...iv", jnp.where(causal, scores, 0), v)
    strictly_later = jnp.tri(chunk, k=-1, dtype=bool)
    # pairwise[i, j] = sum of the gates of tokens j+1 .. i
    pairwise = jnp.cumsum(jnp.where(strictly_later, log[..., :, :], 0), axis=-2)
    return jnp.einsum("...ij,...jv->...iv", scores * jnp.where(causal, jnp.exp(pairwise), 0), v)


def _to_chunks(x: jax.Array | None, chunk: int, packed: ChunkLayout | None) -> jax.Array | None:
    """[B,T,H,D] -> [B,H,Nc,C,D], zero-padded."""
    if x is None:
        return None
    batch, seq_len, heads, dim = x.shape
    if packed is None:
        num_chunks = -(-seq_len // chunk)
        x = jnp.pad(x, ((0, 0), (0, num_chunks * chunk - seq_len), (0, 0), (0, 0)))
    else:
        num_chunks = packed.num_chunks
        x = jnp.take(x, packed.source, axis=1, mode="fill", fill_value=0)  # zeros for rows of no token
    return x.reshape(batch, num_chunks, chunk, heads, dim).transpose(0, 3, 1, 2, 4)


def _from_chunks(x: jax.Array, seq_len: int, packed: ChunkLayout | None) -> jax.Array:
    batch, heads, num_chunks, chunk, dim = x.shape
    x = x.transpose(0, 2, 3, 1, 4).reshape(batch, num_chunks * chunk, heads, dim)
    return x[:, :seq_len] if packed is None else x[:, packed.destination]


def _pass_states(local, decay_k, decay_v, h0, packed: ChunkLayout | None):
    """(state entering each chunk [B,H,Nc,K,V], final states) from each chunk's own contribution `local`."""
    batch, heads, _, key_dim, value_dim = local.shape
    chunk_axis_first = lambda x: None if x is None else jnp.moveaxis(x, 2, 0)  # noqa: E731
    xs = tuple(map(chunk_axis_first, (local, decay_k, decay_v)))
    if packed is None:
        start = vary_like(jnp.zeros((batch, heads, key_dim, value_dim), local.dtype), local) if h0 is None else h0
        resets = None
    else:
        h0 = jnp.zeros((packed.nonempty.shape[0], heads, key_dim, value_dim), local.dtype) if h0 is None else h0
        start = vary_like(jnp.zeros((1, heads, key_dim, value_dim), local.dtype), local, h0)
        resets = (packed.first, h0[packed.chunk_sequence][:, None])

    def step(state, x):
        (local_c, decay_k_c, decay_v_c), reset = x[:3], x[3]
        if reset is not None:
            state = jnp.where(reset[0], reset[1], state)
        return decay_state(state, decay_k_c, decay_v_c) + local_c, state

    final, entering = jax.lax.scan(step, start, (*xs, resets))
    entering = jnp.moveaxis(entering, 0, 2)
    if packed is None:
        return entering, final
    last = packed.last_chunk
    pick = lambda x: None if x is None else jnp.moveaxis(x[0], 1, 0)[last]  # noqa: E731  [N,H,...]
    after_last = decay_state(pick(entering), pick(decay_k), pick(decay_v)) + pick(local)
    return entering, jnp.where(packed.nonempty[:, None, None, None], after_last, h0)


def _normalize_sides(log_k, log_v):
    """A per-head scalar gate belongs on the key axis (the cheap scalar path), whichever side it came on."""
    if log_v is not None and log_v.shape[-1] == 1:
        return (log_v if log_k is None else log_k + log_v), None
    return log_k, log_v


class _ChunkParts(NamedTuple):
    """What each chunk computes on its own, before the states are passed between chunks."""

    out: jax.Array  # intra-chunk output [..., C, V]
    local: jax.Array  # the chunk's own contribution to its outgoing state [..., K, V]
    q_in: jax.Array  # queries scaled by the decay since the chunk start [..., C, K]
    decay_k: jax.Array | None  # decay over the whole chunk [..., K] (or [..., 1])
    decay_v: jax.Array | None  # [..., V]
    out_scale: jax.Array | None  # value-axis decay since the chunk start [..., C, V]


def _chunk_parts(q, k, v, log_k, log_v) -> _ChunkParts:
    chunk = q.shape[-2]
    decays_k = _block_decays(None if log_k is None else jnp.exp(log_k), chunk)
    decays_v = _block_decays(None if log_v is None else jnp.exp(log_v), chunk)
    if log_v is None and (log_k is None or log_k.shape[-1] == 1):
        out = _intra_scalar(q, k, v, log_k)
    else:
        out = _intra_per_channel(q, k, v, decays_k, decays_v)
    in_chunk_k, in_chunk_v = decays_k[-1], decays_v[-1]
    q_in, k_out, v_out, decay_k, decay_v, out_scale = q, k, v, None, None, None
    if in_chunk_k is not None:
        q_in, k_out, decay_k = q * in_chunk_k.upto, k * in_chunk_k.after, in_chunk_k.upto[..., -1, :]
    if in_chunk_v is not None:
        v_out, decay_v, out_scale = v * in_chunk_v.after, in_chunk_v.upto[..., -1, :], in_chunk_v.upto
    local = jnp.einsum("...ck,...cv->...kv", k_out, v_out)
    return _ChunkParts(out, local, q_in, decay_k, decay_v, out_scale)


def _grouped_chunk_parts(arrays: tuple, chunk: int) -> _ChunkParts:
    """`_chunk_parts` over [B,H,Nc,C,D] arrays, GROUP_TOKENS tokens at a time (`lax.map`): the dozens of
    full-size intermediates of the intra-chunk levels then stay in cache (~2x faster on a CPU at T=2048-4096)."""
    lead = arrays[0].shape[:3]
    rows = lead[0] * lead[1] * lead[2]
    group = max(1, GROUP_TOKENS // chunk)
    if rows <= group:
        return _chunk_parts(*arrays)
    num_groups = -(-rows // group)

    def grouped(x):  # [B,H,Nc,C,D] -> [groups, group, C, D]; zero rows pad (zero log gates: decay 1)
        if x is None:
            return None
        x = x.reshape((rows,) + x.shape[3:])
        x = jnp.pad(x, ((0, num_groups * group - rows),) + ((0, 0),) * (x.ndim - 1))
        return x.reshape((num_groups, group) + x.shape[1:])

    def ungrouped(x):
        if x is None:
            return None
        return x.reshape((num_groups * group,) + x.shape[2:])[:rows].reshape(lead + x.shape[2:])

    parts = jax.lax.map(lambda xs: _chunk_parts(*xs), tuple(map(grouped, arrays)))
    return _ChunkParts(*map(ungrouped, parts))


def chunked_recurrence(q, k, v, log_k, log_v, h0, cu_seqlens, cfg: RecurrentAttentionConfig):
    """The engine contract of `engine.py`: (o [B,T,H,V], final state)."""
    chunk = cfg.chunk_size
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk}")
    seq_len = q.shape[1]
    log_k, log_v = _normalize_sides(log_k, log_v)
    packed = None if cu_seqlens is None else chunk_layout(cu_seqlens, seq_len, chunk)
    chunks = tuple(_to_chunks(x, chunk, packed) for x in (q, k, v, log_k, log_v))
    parts = _grouped_chunk_parts(chunks, chunk)
    entering, final = _pass_states(parts.local, parts.decay_k, parts.decay_v, h0, packed)
    out = parts.out + _times(jnp.einsum("...ck,...kv->...cv", parts.q_in, entering), parts.out_scale)
    return _from_chunks(out, seq_len, packed), final


def _heuristic(inv) -> RecurrentAttentionConfig:
    seq_len = inv.arrays["query"].shape[1]
    return RecurrentAttentionConfig(chunk_size=64 if seq_len >= 64 else 16)


_fwd, vjp_backward = vjp_rules(chunked_recurrence)  # the backward also serves the Pallas forward


@register(OP_ID, "xla", "chunked", heuristic_cfg=_heuristic,
          candidate_cfgs=lambda inv: [RecurrentAttentionConfig(chunk_size=c) for c in CHUNK_SIZES],
          fwd=_fwd, bwd=vjp_backward)
def chunked(problem, cfg: RecurrentAttentionConfig):
    return forward(chunked_recurrence, problem, cfg)
