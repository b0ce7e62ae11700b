"""`attention_decode_pool`: the softmax attention layers of a hybrid model, served from a KV cache pool by slot.

Every live request owns a row of the cache pools k_pool [num_slots, max_len, KV, D] and v_pool
[num_slots, max_len, KV, Dv], the same slots that index its KDA state and conv state, holding the keys and values
of its first cached_lengths[b] tokens. A step brings T new tokens per request (T = 1: decode; T > 1: speculative
decoding, or a chunk of a prompt, with new_lengths[b] <= T of them real): their keys and values are written at
positions cached_lengths[b] ... of the request's row, and each new token attends causally to its row up to and
including itself (within `sliding_window`, with `attention`'s soft cap and sinks). Slot -1 marks a padded
request, and tokens past new_lengths are padding: they read nothing, write nothing and output zeros. Rows no
request names stay bit-for-bit unchanged; donate the pools to update them in place. The caller advances
cached_lengths by new_lengths after the step and keeps cached_lengths + new_lengths <= max_len (writes past the
end are dropped, and those tokens would not see themselves).

The attention runs through `hybrax.attention` on the gathered rows, with a mask of each token's visible
positions: whichever implementation the call resolves to for a masked call (`platform`). Gathering copies the
requests' rows once per step; a kernel that reads them in place is the way to go past that.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybrax.core.validate import check_floating, check_integer, check_rank, check_shape
from hybrax.ops.attention.api import attention
from hybrax.ops.attention.mask import MaskInfo
from hybrax.serving.prefill import check_slots, gather_rows


def _check(q: Any, k: Any, v: Any, k_pool: Any, v_pool: Any, slots: Any, cached_lengths: Any,
           new_lengths: Any, sliding_window: Any) -> None:
    check_rank("q", q, 4, "[batch, tokens, num_heads, head_dim]")
    batch, tokens, heads, head_dim = jnp.shape(q)
    check_rank("k", k, 4, "[batch, tokens, num_kv_heads, head_dim]")
    kv_heads = jnp.shape(k)[2]
    check_shape("k", k, (batch, tokens, kv_heads, head_dim), "[batch, tokens, num_kv_heads, head_dim] (q's)")
    if heads % kv_heads:
        raise ValueError(f"num_heads of q ({heads}) must be a multiple of num_kv_heads of k ({kv_heads})")
    check_rank("v", v, 4, "[batch, tokens, num_kv_heads, v_head_dim]")
    v_dim = jnp.shape(v)[3]
    check_shape("v", v, (batch, tokens, kv_heads, v_dim), "[batch, tokens, num_kv_heads, v_head_dim] (k's)")
    check_rank("k_pool", k_pool, 4, "[num_slots, max_len, num_kv_heads, head_dim]")
    num_slots, max_len = jnp.shape(k_pool)[:2]
    check_shape("k_pool", k_pool, (num_slots, max_len, kv_heads, head_dim),
                "[num_slots, max_len, num_kv_heads, head_dim] (k's heads and dim)")
    check_shape("v_pool", v_pool, (num_slots, max_len, kv_heads, v_dim),
                "[num_slots, max_len, num_kv_heads, v_head_dim] (k_pool's slots and length, v's heads and dim)")
    for name, array in (("q", q), ("k", k), ("v", v), ("k_pool", k_pool), ("v_pool", v_pool)):
        check_floating(name, array)
    check_slots(slots, None, batch)
    for name, lengths in (("cached_lengths", cached_lengths), ("new_lengths", new_lengths)):
        if lengths is not None:
            check_shape(name, lengths, (batch,), "[batch]")
            check_integer(name, lengths)
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 0):
        raise ValueError(f"sliding_window must be an int >= 0 (keys back from each token) or None, "
                         f"got {sliding_window!r}")


def _write(pool: jax.Array, rows: jax.Array, positions: jax.Array, new: jax.Array) -> jax.Array:
    """pool with new[b, t] at [rows[b, t], positions[b, t]]; rows past the pool (padding) are dropped."""
    return pool.at[rows, positions].set(new.astype(pool.dtype), mode="drop")


def attention_decode_pool(
    q: Float[Array, "batch tokens num_heads head_dim"],
    k: Float[Array, "batch tokens num_kv_heads head_dim"],
    v: Float[Array, "batch tokens num_kv_heads v_head_dim"],
    k_pool: Float[Array, "num_slots max_len num_kv_heads head_dim"],
    v_pool: Float[Array, "num_slots max_len num_kv_heads v_head_dim"],
    slots: Int[Array, " batch"],
    cached_lengths: Int[Array, " batch"],
    /,
    *,
    new_lengths: Int[Array, " batch"] | None = None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Float[Array, "num_heads num_sinks"] | None = None,
    platform: str | None = None,
) -> tuple[Float[Array, "batch tokens num_heads v_head_dim"], Float[Array, "num_slots max_len num_kv_heads head_dim"],
           Float[Array, "num_slots max_len num_kv_heads v_head_dim"]]:
    """T new tokens for each of B requests against their cached rows: returns (output [B, T, H, Dv] in q's
    dtype, k_pool, v_pool with the new tokens written). See the module doc; `sliding_window` w keeps the keys
    of the w positions before each token and its own."""
    _check(q, k, v, k_pool, v_pool, slots, cached_lengths, new_lengths, sliding_window)
    batch, tokens = jnp.shape(q)[:2]
    num_slots, max_len = jnp.shape(k_pool)[:2]
    slots, cached_lengths = jnp.asarray(slots, jnp.int32), jnp.asarray(cached_lengths, jnp.int32)
    new_lengths = jnp.full((batch,), tokens, jnp.int32) if new_lengths is None else jnp.asarray(new_lengths, jnp.int32)

    token = jnp.arange(tokens, dtype=jnp.int32)
    real = (slots >= 0)[:, None] & (token[None, :] < new_lengths[:, None])  # [B, T]
    positions = cached_lengths[:, None] + token[None, :]
    rows = jnp.where(real, slots[:, None], num_slots)
    k_pool, v_pool = _write(k_pool, rows, positions, k), _write(v_pool, rows, positions, v)

    key_position = jnp.arange(max_len, dtype=jnp.int32)[None, None, :]
    seen = real[:, :, None] & (key_position <= positions[:, :, None])  # [B, T, max_len]
    if sliding_window is not None:
        seen &= key_position >= positions[:, :, None] - sliding_window
    out = attention(
        q, gather_rows(k_pool, slots, None), gather_rows(v_pool, slots, None), None, None, softmax_aux,
        mask_info=MaskInfo.from_attention_mask(seen[:, None]), softmax_scale=softmax_scale,
        logits_soft_cap=logits_soft_cap, platform=platform,
    )
    return jnp.where(real[:, :, None, None], out, 0).astype(q.dtype), k_pool, v_pool
