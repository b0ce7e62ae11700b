"""`dot_product_attention`: softmax attention with jax.nn.dot_product_attention's arguments, run by `attention`.

    o = softmax(scale * q k^T + bias, over the keys the masks keep) v, per query head (GQA: head n reads kv
    head n // (N // K)).
jax.nn's masks are top-left aligned: with `is_causal`, query i sees keys j <= i, and `local_window_size`
(left, right) keeps i - left <= j <= i + right. When Tq == Tk that is `attention`'s (bottom-right aligned)
causal and sliding window; otherwise they become an explicit [Tq, Tk] mask. `query_seq_lengths` /
`key_value_seq_lengths` become padding segments (segment id -1: seen by and seeing nothing). One difference
from jax.nn: a query that sees no key outputs zeros (jax.nn's XLA path averages every value).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from hybrax.core import checks, default_executor
from hybrax.core.validate import check_bool, check_integer, check_rank, check_shape, describe
from hybrax.ops.attention.api import Attention, AttentionConfig
from hybrax.ops.attention.mask import PADDING_SEGMENT, MaskInfo

# jax.nn's `implementation` names -> the config of the implementation that runs it.
IMPLEMENTATIONS = {"xla": AttentionConfig(platform="xla"), "cudnn": AttentionConfig(platform="cuda", backend="cudnn")}


def _to_4d(name: str, array: Any) -> Any:
    """jax.nn's rule: fewer than 4 dims gain leading ones."""
    if array is None:
        return None
    if jnp.ndim(array) > 4:
        raise ValueError(f"{name} must have at most 4 dims, broadcastable to [batch, num_heads, q_len, kv_len], "
                         f"got {describe(jnp.shape(array))}")
    return jnp.reshape(array, (1,) * (4 - jnp.ndim(array)) + tuple(jnp.shape(array)))


def _broadcast_pairwise(name: str, array: Any, batch: int, heads: int, q_len: int, kv_len: int) -> Any:
    """A bias or mask broadcastable to [B, N, Tq, Tk] as `attention` takes it: [B | 1, N | 1, Tq, Tk]."""
    array = _to_4d(name, array)
    if array is None:
        return None
    full = (batch, heads, q_len, kv_len)
    if any(size not in (1, want) for size, want in zip(jnp.shape(array), full)):
        raise ValueError(f"{name} must broadcast to [batch, num_heads, q_len, kv_len] = {describe(full)}, "
                         f"got {describe(jnp.shape(array))}")
    return jnp.broadcast_to(array, (*jnp.shape(array)[:2], q_len, kv_len))


def _window(local_window_size: Any) -> tuple[int, int] | None:
    if local_window_size is None:
        return None
    pair = (local_window_size, local_window_size) if isinstance(local_window_size, int) else local_window_size
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2
            and all(isinstance(w, int) and not isinstance(w, bool) and w >= 0 for w in pair)):
        raise ValueError(f"local_window_size must be an int >= 0 or a pair (left, right) of ints >= 0, "
                         f"got {local_window_size!r}")
    return int(pair[0]), int(pair[1])


def _top_left_mask(q_len: int, kv_len: int, is_causal: bool, window: tuple[int, int] | None) -> jnp.ndarray:
    """jax.nn's causal and window masks [1, 1, Tq, Tk] for Tq != Tk (query i at key position i)."""
    offset = jnp.arange(kv_len)[None, :] - jnp.arange(q_len)[:, None]  # j - i
    keep = jnp.ones((q_len, kv_len), bool)
    if is_causal:
        keep &= offset <= 0
    if window is not None:
        keep &= (offset >= -window[0]) & (offset <= window[1])
    return keep[None, None]


def _segments(name: str, lengths: Any, ids: Any, batch: int, length: int) -> Any:
    """Segment ids [B, length] with the positions at or past `lengths` [B] as padding; ids None: one segment."""
    if lengths is None:
        return ids
    check_shape(name, lengths, (batch,), "[batch]")
    check_integer(name, lengths)
    checks.check_values(name, lengths, lambda n: (n >= 0) & (n <= length), f"in [0, {length}]")
    ids = jnp.zeros((batch, length), jnp.int32) if ids is None else ids
    return jnp.where(jnp.arange(length)[None, :] < jnp.asarray(lengths)[:, None], ids, PADDING_SEGMENT)


def _mask_info(mask: Any, segment_ids: Any, kv_segment_ids: Any, query_seq_lengths: Any,
               key_value_seq_lengths: Any, q_shape: tuple[int, ...], kv_len: int) -> MaskInfo | None:
    batch, q_len = q_shape[:2]
    if kv_segment_ids is not None and segment_ids is None:
        raise ValueError("kv_segment_ids needs segment_ids (the queries' segments) too")
    if segment_ids is not None:
        kv_segment_ids = segment_ids if kv_segment_ids is None else kv_segment_ids
        check_shape("segment_ids", segment_ids, (batch, q_len), "[batch, q_len]")
        check_shape("kv_segment_ids", kv_segment_ids, (batch, kv_len), "[batch, kv_len]")
        check_integer("segment_ids", segment_ids)
        check_integer("kv_segment_ids", kv_segment_ids)
    q_ids = _segments("query_seq_lengths", query_seq_lengths, segment_ids, batch, q_len)
    kv_ids = _segments("key_value_seq_lengths", key_value_seq_lengths, kv_segment_ids, batch, kv_len)
    if q_ids is not None or kv_ids is not None:
        q_ids = jnp.zeros((batch, q_len), jnp.int32) if q_ids is None else q_ids
        kv_ids = jnp.zeros((batch, kv_len), jnp.int32) if kv_ids is None else kv_ids
        segments = MaskInfo.from_segments(q_ids, kv_ids)
        if mask is None:
            return segments
        return MaskInfo(q_segment_ids=segments.q_segment_ids, kv_segment_ids=segments.kv_segment_ids,
                        attention_mask=mask)
    return None if mask is None else MaskInfo.from_attention_mask(mask)


def _check_sinks(sinks: Any, heads: int) -> None:
    shape = tuple(jnp.shape(sinks))
    if len(shape) not in (1, 2) or (len(shape) == 2 and shape[0] != heads):
        raise ValueError(f"sinks must have shape [num_heads, num_sinks] = [{heads}, *] or [num_sinks], "
                         f"got {describe(shape)}")


def _platform_and_cfg(implementation: Any, platform: Any, cfg: Any) -> tuple[Any, Any]:
    if implementation is None:
        return platform, cfg
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {sorted(IMPLEMENTATIONS)} or None, got {implementation!r}")
    if platform is not None or cfg is not None:
        raise ValueError("give implementation (jax.nn's choice) or platform / cfg (hybrax's), not both")
    return None, IMPLEMENTATIONS[implementation]


def dot_product_attention(
    query: Float[Array, "batch q_len num_heads head_dim"],
    key: Float[Array, "batch kv_len num_kv_heads head_dim"],
    value: Float[Array, "batch kv_len num_kv_heads v_head_dim"],
    bias: Float[Array, "#batch #num_heads #q_len #kv_len"] | None = None,
    mask: Bool[Array, "#batch #num_heads #q_len #kv_len"] | None = None,
    *,
    scale: float | None = None,
    is_causal: bool = False,
    query_seq_lengths: Int[Array, " batch"] | None = None,
    key_value_seq_lengths: Int[Array, " batch"] | None = None,
    local_window_size: int | tuple[int, int] | None = None,
    implementation: str | None = None,
    return_residual: bool = False,
    logits_soft_cap: float | None = None,
    sinks: Float[Array, "num_heads num_sinks"] | Float[Array, " num_sinks"] | None = None,
    segment_ids: Int[Array, "batch q_len"] | None = None,
    kv_segment_ids: Int[Array, "batch kv_len"] | None = None,
    platform: str | None = None,
    cfg: AttentionConfig | None = None,
) -> Float[Array, "batch q_len num_heads v_head_dim"]:
    """Softmax attention with jax.nn.dot_product_attention's signature; see the module docstring.

    Args:
        query: [B, Tq, N, H] (or unbatched [Tq, N, H]); key, value: [B, Tk, K, H] / [B, Tk, K, Hv], K dividing N.
        bias: added to the scaled logits; 4 dims (fewer gain leading ones) broadcastable to [B, N, Tq, Tk].
        mask: bool, True keeps; broadcastable to [B, N, Tq, Tk].
        scale: of the logits; None: H ** -0.5.
        is_causal: query i sees keys j <= i. local_window_size: w or (left, right): i - left <= j <= i + right.
        query_seq_lengths, key_value_seq_lengths: int32 [B]: positions at or past them are padding (padded
            queries output zeros).
        implementation: None (hybrax's choice), "xla" or "cudnn".
        return_residual: jax.nn's logsumexp output; not available (False only).
        logits_soft_cap: c: logits -> c tanh(logits / c), after the bias.
        sinks: [N, S] or [S] logits that join each row's softmax denominator without a value.
        segment_ids: [B, Tq] ints; a query sees keys of its own segment (kv_segment_ids [B, Tk], default
            segment_ids); -1 is padding.
        platform, cfg: hybrax's choice of implementation and knobs (instead of `implementation`).

    Returns:
        [B, Tq, N, Hv] (unbatched: [Tq, N, Hv]) in the inputs' dtype.
    """
    if return_residual:
        raise ValueError("return_residual=True (the logsumexp) is not available; call with return_residual=False")
    platform, cfg = _platform_and_cfg(implementation, platform, cfg)
    unbatched = jnp.ndim(query) == 3
    if unbatched:
        for name, array in (("key", key), ("value", value)):
            check_rank(name, array, 3, "[kv_len, num_kv_heads, head_dim] (query is unbatched)")
        query, key, value = (x[None] for x in (query, key, value))
    check_rank("query", query, 4, "[batch, q_len, num_heads, head_dim] or [q_len, num_heads, head_dim]")
    check_rank("key", key, 4, "[batch, kv_len, num_kv_heads, head_dim]")
    for name, array in (("query", query), ("key", key), ("value", value)):
        checks.check_finite(name, array)
    batch, q_len, heads, _ = jnp.shape(query)
    kv_len = jnp.shape(key)[1]
    window = _window(local_window_size)
    if sinks is not None:
        _check_sinks(sinks, heads)
    if not isinstance(is_causal, bool):
        raise ValueError(f"is_causal must be a bool, got {is_causal!r}")
    if mask is not None:
        check_bool("mask", mask)
    mask = _broadcast_pairwise("mask", mask, batch, heads, q_len, kv_len)
    if q_len != kv_len and (is_causal or window is not None):
        aligned = _top_left_mask(q_len, kv_len, is_causal, window)
        mask = aligned if mask is None else mask & aligned
        is_causal, window = False, None
    output = default_executor()(
        Attention(), query, key, value, _broadcast_pairwise("bias", bias, batch, heads, q_len, kv_len), None, sinks,
        mask_info=_mask_info(mask, segment_ids, kv_segment_ids, query_seq_lengths, key_value_seq_lengths,
                             (batch, q_len), kv_len),
        softmax_scale=scale, logits_soft_cap=logits_soft_cap, causal=is_causal, sliding_window=window,
        platform=platform, cfg=cfg,
    )
    return output[0] if unbatched else output
