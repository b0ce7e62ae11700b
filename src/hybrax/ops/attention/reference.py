"""Float64 reference of `attention`, straight from the math, on the public argument layout.

`attention_math(xp, ...)` runs with `xp = numpy` (the tests' oracle) or `xp = jax.numpy` under
float64 (`jax.enable_x64`), whose autodiff is the oracle for gradients. Dropout is randomness, not
math: the caller passes the keep mask [B, H, Tq, Tk].
"""

from __future__ import annotations

from typing import Any

import numpy as np


def _per_query_head(x: Any, num_heads: int, xp: Any) -> Any:
    """[b, heads, ...] with heads in (H, H_kv, 1) -> H heads (query head h uses kv head h // G); 1 broadcasts."""
    heads = x.shape[1]
    return x if heads in (1, num_heads) else xp.repeat(x, num_heads // heads, axis=1)


def visible_keys(
    q_len: int, kv_len: int, *, causal: bool = False, sliding_window: Any = None,
    q_segment_ids: Any = None, kv_segment_ids: Any = None, mask: Any = None, num_heads: int = 1,
) -> np.ndarray:
    """bool [B | 1, H | 1, Tq, Tk]: key j is visible to query i (aligned at i + Tk - Tq)."""
    i = np.arange(q_len)[:, None] + (kv_len - q_len)
    j = np.arange(kv_len)[None, :]
    seen = np.ones((q_len, kv_len), bool)
    if causal:
        seen &= j <= i
    if sliding_window is not None:
        left, right = (sliding_window, sliding_window) if np.isscalar(sliding_window) else sliding_window
        seen &= (j >= i - left) & (j <= i + right)
    seen = seen[None, None]
    if q_segment_ids is not None:
        qs = np.asarray(q_segment_ids)
        ks = qs if kv_segment_ids is None else np.asarray(kv_segment_ids)
        seen = seen & ((qs[:, :, None] == ks[:, None, :]) & (qs[:, :, None] != -1))[:, None]
    if mask is not None:
        seen = seen & _per_query_head(np.asarray(mask, bool), num_heads, np)
    return seen


def attention_math(
    xp: Any, query: Any, key: Any, value: Any, bias: Any = None, softmax_aux: Any = None, *,
    seen: Any, softmax_scale: float | None = None, logits_soft_cap: float | None = None,
    dropout_keep: Any = None, dropout_prob: float = 0.0,
) -> Any:
    """out [B, Tq, H, Dv] = softmax over visible keys and sinks of cap(scale q.k + bias), times v."""
    num_heads, head_dim = query.shape[2], query.shape[3]
    key = _per_query_head(xp.swapaxes(key, 1, 2), num_heads, xp)  # [B, H, Tk, D]
    value = _per_query_head(xp.swapaxes(value, 1, 2), num_heads, xp)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    logits = scale * xp.einsum("bqhd,bhkd->bhqk", query, key)
    if bias is not None:
        logits = logits + _per_query_head(bias, num_heads, xp)
    if logits_soft_cap is not None:
        logits = logits_soft_cap * xp.tanh(logits / logits_soft_cap)
    seen = xp.broadcast_to(xp.asarray(seen), logits.shape)
    row_max = xp.max(xp.where(seen, logits, -np.inf), axis=-1, keepdims=True)
    if softmax_aux is not None:
        sinks = xp.broadcast_to(softmax_aux, (num_heads, softmax_aux.shape[-1]))[None, :, None, :]
        row_max = xp.maximum(row_max, xp.max(sinks, axis=-1, keepdims=True))
    row_max = xp.where(xp.isfinite(row_max), row_max, 0.0)
    # where-inside-where: hidden logits never reach exp, so autodiff stays finite.
    exps = xp.where(seen, xp.exp(xp.where(seen, logits, row_max) - row_max), 0.0)
    denominator = xp.sum(exps, axis=-1, keepdims=True)
    if softmax_aux is not None:
        denominator = denominator + xp.sum(xp.exp(sinks - row_max), axis=-1, keepdims=True)
    weights = exps / xp.where(denominator > 0, denominator, 1.0)
    if dropout_keep is not None:
        weights = xp.where(dropout_keep, weights / (1.0 - dropout_prob), 0.0)
    return xp.einsum("bhqk,bhkv->bqhv", weights, value)


def attention(
    query: Any, key: Any, value: Any, bias: Any = None, softmax_aux: Any = None, *,
    causal: bool = False, sliding_window: Any = None, q_segment_ids: Any = None, kv_segment_ids: Any = None,
    mask: Any = None, softmax_scale: float | None = None, logits_soft_cap: float | None = None,
    dropout_keep: Any = None, dropout_prob: float = 0.0,
) -> np.ndarray:
    """The float64 NumPy result; arguments as `hybrax.attention`'s (mask: bool [B|1, H|H_kv|1, Tq, Tk])."""
    f64 = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    query, key, value = f64(query), f64(key), f64(value)
    seen = visible_keys(
        query.shape[1], key.shape[1], causal=causal, sliding_window=sliding_window,
        q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids, mask=mask, num_heads=query.shape[2],
    )
    return attention_math(
        np, query, key, value, f64(bias), f64(softmax_aux), seen=seen, softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap, dropout_keep=dropout_keep, dropout_prob=dropout_prob,
    )
