"""`attention_prefill_pool`: new prompts into an attention layer's KV cache pool, by slot, in KDA's prefill layout.

A batch of B prompts of T tokens (slots [B]), or N prompts packed in a batch of one (cu_seqlens [N + 1], slots [N],
as `kda_prefill_pool` takes them). Each prompt starts its slot's row afresh: token i of a prompt writes its key
and value at position i of row slots[n] (whatever the row held before: a recycled slot), and attends causally to
the tokens of its own prompt (within `sliding_window`, with `attention`'s soft cap and sinks):

    out_i = softmax_j<=i (scale q_i . k_j) v_j        over the prompt's tokens j (and i - j <= sliding_window)

so that `attention_decode_pool` continues each request from cached length = its prompt's length. Slot -1 marks a
padded prompt and tokens past cu_seqlens[-1] are padding: they read nothing, write nothing and output zeros.
Prompts must fit their rows (length <= max_len; checked when concrete, writes past the end dropped under jit).
The attention itself is `hybrax.attention` over the packed tokens with segment ids (flash kernels on a GPU).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from hybrax.core.packing import from_cu_seqlens
from hybrax.core.validate import check_cu_seqlens, is_concrete
from hybrax.ops.attention.api import attention
from hybrax.ops.attention.mask import MaskInfo
from hybrax.serving.attention_pool import check_query_key, check_sliding_window, check_values_and_pools
from hybrax.serving.prefill import check_slots


def _check_fit(slots: Any, cu_seqlens: Any, length: int, max_len: int) -> None:
    """When concrete: every real prompt (T tokens each, or as cu_seqlens says) fits its row."""
    if not (is_concrete(slots) and is_concrete(cu_seqlens)):
        return
    lengths = np.full(np.shape(slots), length) if cu_seqlens is None else np.diff(np.asarray(cu_seqlens))
    real = lengths[np.asarray(slots) >= 0]
    if np.any(real > max_len):
        raise ValueError(f"prompts must fit their rows: lengths <= max_len = {max_len} (the pools' dim 1), got "
                         f"lengths {real.tolist()} for the prompts with a slot")


def _token_places(slots: jax.Array, batch: int, length: int, cu_seqlens: jax.Array | None
                  ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(segment ids [B, T] (-1: padding), each token's slot [B, T] (-1: padding), its position in its prompt)."""
    if cu_seqlens is None:
        token_slots = jnp.broadcast_to(slots[:, None], (batch, length))
        positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
        return None, token_slots, positions
    pack = from_cu_seqlens(cu_seqlens, batch, length)
    sequence = pack.segments  # -1 past the last sequence
    token_slots = jnp.where(sequence >= 0, slots[jnp.maximum(sequence, 0)], -1)
    return jnp.where(token_slots >= 0, sequence, -1), token_slots, pack.positions


def attention_prefill_pool(
    q: Float[Array, "batch seq_len num_heads head_dim"],
    k: Float[Array, "batch seq_len num_kv_heads head_dim"],
    v: Float[Array, "batch seq_len num_kv_heads v_head_dim"],
    k_pool: Float[Array, "num_slots max_len num_kv_heads head_dim"],
    v_pool: Float[Array, "num_slots max_len num_kv_heads v_head_dim"],
    slots: Int[Array, " num_sequences"],
    /,
    *,
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None = None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Float[Array, "num_heads num_sinks"] | None = None,
    platform: str | None = None,
) -> tuple[Float[Array, "batch seq_len num_heads v_head_dim"], Float[Array, "num_slots max_len num_kv_heads head_dim"],
           Float[Array, "num_slots max_len num_kv_heads v_head_dim"]]:
    """Prefill B prompts (or N packed ones with cu_seqlens, batch 1) into their rows of the KV pools; see the module
    doc. `sliding_window` w keeps the keys of the w positions before each token and its own, as
    `attention_decode_pool`; `platform` goes to `attention`.

    Returns:
        (output [B, T, H, Dv] in q's dtype, k_pool, v_pool with the prompts written).
    """
    check_query_key(q, k, length="seq_len")
    check_values_and_pools(q, k, v, k_pool, v_pool, length="seq_len")
    batch, length = jnp.shape(q)[:2]
    num_slots, max_len = jnp.shape(k_pool)[:2]
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, length, "q")
    count = batch if cu_seqlens is None else jnp.shape(cu_seqlens)[0] - 1
    check_slots(slots, None, count, num_slots, packed=cu_seqlens is not None)
    check_sliding_window(sliding_window)
    _check_fit(slots, cu_seqlens, length, max_len)

    slots = jnp.asarray(slots, jnp.int32)
    slots = jnp.where((slots >= 0) & (slots < num_slots), slots, -1)  # under jit, anything else is padding too
    cu_seqlens = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
    segments, token_slots, positions = _token_places(slots, batch, length, cu_seqlens)
    real = token_slots >= 0
    mask_info = None if segments is None else MaskInfo.from_segments(segments)
    out = attention(q, k, v, None, None, softmax_aux, mask_info=mask_info, causal=True,
                    sliding_window=None if sliding_window is None else (sliding_window, 0),
                    softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap, platform=platform)
    out = jnp.where(real[:, :, None, None], out, jnp.zeros((), out.dtype)).astype(q.dtype)
    rows = jnp.where(real, token_slots, num_slots)  # out of bounds: dropped
    k_pool = k_pool.at[rows, positions].set(k.astype(k_pool.dtype), mode="drop")
    v_pool = v_pool.at[rows, positions].set(v.astype(v_pool.dtype), mode="drop")
    return out, k_pool, v_pool
