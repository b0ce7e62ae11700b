"""The score tile shared by both XLA implementations: logits, visibility and dropout of the queries
at positions `q_pos` against the keys at `k_pos`.

The direct implementation calls these on the whole range, the blockwise one tile by tile, so both
compute the same math and draw the same dropout mask. Tiles are laid out [B, K, G, q, k]
(batch, kv head, query head within the group, query, key).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from hybrax.ops.attention.base import AttentionProblem
from hybrax.ops.attention.mask import PADDING_SEGMENT


def precision(dtype: jnp.dtype) -> jax.lax.Precision:
    """fp32 inputs must not be multiplied in reduced precision (tf32 on GPUs, bf16 passes on TPUs).

    The CPU multiplies fp32 exactly by default, and HIGHEST there only costs time (2x on attention).
    """
    wide = jnp.dtype(dtype).itemsize >= 4
    exact_by_default = jax.default_backend() == "cpu"
    return jax.lax.Precision.HIGHEST if wide and not exact_by_default else jax.lax.Precision.DEFAULT


def accumulation_dtype(p: AttentionProblem) -> jnp.dtype:
    return jnp.promote_types(p.dtype, jnp.float32)


def logits(
    p: AttentionProblem,
    q: Float[Array, "B q K G D"],
    k: Float[Array, "B k K D"],
    bias: Float[Array, "Bb Kb Gb q k"] | None,
) -> Float[Array, "B K G q k"]:
    """cap(scale * q k^T + bias) in the softmax dtype."""
    s = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=p.softmax_dtype,
                   precision=precision(p.dtype))
    s = s * jnp.asarray(p.softmax_scale, p.softmax_dtype)
    if bias is not None:
        s = s + bias
    if p.logits_soft_cap is not None:
        cap = jnp.asarray(p.logits_soft_cap, p.softmax_dtype)
        s = cap * jnp.tanh(s / cap)
    return s


def soft_cap_slope(p: AttentionProblem, logits: Float[Array, "*tile"]) -> Float[Array, "*tile"] | float:
    """d cap(x) / dx from the capped logits: 1 - tanh^2 = 1 - (logits / cap)^2."""
    if p.logits_soft_cap is None:
        return 1.0
    return 1.0 - jnp.square(logits / jnp.asarray(p.logits_soft_cap, logits.dtype))


def visible(
    p: AttentionProblem,
    q_pos: Int[Array, "q"],
    k_pos: Int[Array, "k"],
    mask: Bool[Array, "Bm Km Gm q k"] | None,
    q_segment_ids: Int[Array, "B q"] | None,
    kv_segment_ids: Int[Array, "B k"] | None,
) -> Bool[Array, "Bv Kv Gv q k"]:
    """Which keys each query sees; positions past the real lengths (tile padding) see nothing."""
    q_len, kv_len = p.query.shape[1], p.key.shape[1]
    aligned = (q_pos + (kv_len - q_len))[:, None]  # bottom-right: the last query meets the last key
    j = k_pos[None, :]
    seen = (q_pos[:, None] < q_len) & (j < kv_len)
    if p.window_left is not None:
        seen = seen & (j >= aligned - p.window_left)
    if p.window_right is not None:
        seen = seen & (j <= aligned + p.window_right)
    seen = seen[None, None, None]
    if q_segment_ids is not None:
        same = (q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]) & (
            q_segment_ids[:, :, None] != PADDING_SEGMENT)
        seen = seen & same[:, None, None]
    if mask is not None:
        seen = seen & mask
    return seen


def _mix(x: jax.Array) -> jax.Array:
    """A 32-bit integer finalizer (lowbias32): every input bit flips each output bit with p ~ 1/2."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _coordinate(index: jax.Array) -> jax.Array:
    return _mix(index.astype(jnp.uint32) + jnp.uint32(0x9E3779B9))


def dropout_keep(
    p: AttentionProblem, q_pos: Int[Array, "q"], k_pos: Int[Array, "k"]
) -> Bool[Array, "B K G q k"]:
    """Keep mask of dropout: a counter-based hash of (seed, batch, head, query, key), so any tiling
    draws the same mask and the backward pass recomputes it instead of storing it."""
    batch, _, num_kv_heads, group, _ = p.query.shape
    heads = jnp.arange(num_kv_heads * group).reshape(num_kv_heads, group)
    rows = dropout_row_hash(p.dropout_seed, jnp.arange(batch)[:, None, None, None], heads[None, :, :, None],
                            q_pos)
    return dropout_keep_of(rows[..., None], k_pos, p.dropout_prob)


def dropout_row_hash(seed: jax.Array, batch: jax.Array, head: jax.Array, q_pos: jax.Array) -> jax.Array:
    """uint32: the hash of (seed, batch, head, query position), broadcast together; the XLA implementations
    and the Pallas flash kernels draw their masks from it alike."""
    x = _mix(seed[0] ^ _coordinate(seed[1]))
    x = _mix(x ^ _coordinate(batch))
    x = _mix(x ^ _coordinate(head))
    return _mix(x ^ _coordinate(q_pos))


def dropout_keep_of(row_hash: jax.Array, k_pos: jax.Array, dropout_prob: float) -> jax.Array:
    """bool: which (row, key) weights survive, probability 1 - dropout_prob each."""
    threshold = min(round((1.0 - dropout_prob) * 2**32), 2**32 - 1)
    return _mix(row_hash ^ _coordinate(k_pos)) < jnp.uint32(threshold)


def apply_dropout(p: AttentionProblem, weights: jax.Array, keep: jax.Array | None) -> jax.Array:
    """Zero the dropped weights and scale the kept ones by 1 / (1 - dropout_prob)."""
    if keep is None:
        return weights
    return jnp.where(keep, weights / jnp.asarray(1.0 - p.dropout_prob, weights.dtype), 0)


def pad_axis(x: jax.Array | None, axis: int, size: int, value: Any = 0) -> jax.Array | None:
    """x padded with `value` at the end of `axis` to `size`."""
    if x is None or x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def row_delta(p: AttentionProblem, out: Float[Array, "B Tq K G Dv"], d_out: Float[Array, "B Tq K G Dv"]
              ) -> Float[Array, "B K G Tq"]:
    """delta_i = sum_j P_ij dP_ij = dO_i . O_i, the softmax backward's row term."""
    return jnp.moveaxis(jnp.sum(d_out.astype(p.softmax_dtype) * out.astype(p.softmax_dtype), axis=-1), 1, 3)


def sink_grads(p: AttentionProblem, lse: jax.Array, delta: jax.Array) -> jax.Array | None:
    """d softmax_aux: each sink's weight exp(aux - lse) times -delta, summed over batch and queries."""
    if p.softmax_aux is None:
        return None
    sink_weights = jnp.exp(p.softmax_aux[None, :, :, None, :] - lse[..., None])
    return -jnp.sum(sink_weights * delta[..., None], axis=(0, 3))
