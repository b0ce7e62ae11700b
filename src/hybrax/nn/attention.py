"""`Attention`: causal softmax attention with grouped KV heads and rotary embeddings, as flash-linear-attention's
`fla.layers.Attention`, for training and for serving from a KV cache pool by slot.

For x [B, T, hidden], H query heads and KV key/value heads of D (H a multiple of KV):
    q, k, v = x W_q (+ b_q), x W_k (+ b_k), x W_v (+ b_v)      [B, T, H | KV, D]
    q, k = rmsnorm(q), rmsnorm(k)                                with qk_norm, per head
    q, k = rope(q, p), rope(k, p)                                p the token's position in its sequence; rotate-half
                                                                 pairs (i, i + D/2) by p * theta^(-2i/D)
    o_i = softmax_j (q_i . k_j / sqrt(D), sinks) v_j             j <= i in i's sequence (i - j <= sliding_window)
    y = o W_o
Sinks (`sinks=True`) are one learned logit per head that joins each softmax's denominator without a value.
`sliding_window` w keeps the w positions before each token and its own (fla's window_size is w + 1).

Serving: each slot owns a row of max_len keys and values (`empty_cache`) and its length; `prefill` writes new prompts
from position 0 (`hybrax.serving.attention_prefill.attention_prefill_pool`, the packed layout KDA's prefill takes)
and `decode` appends one token per request (`attention_decode_pool`), slot -1 marking a padded row.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hybrax.nn.norm import RMSNorm
from hybrax.core.packing import check_hidden, packing, sequence_lengths
from hybrax.nn.weights import linear_targets, load_parameters
from hybrax.ops.attention.api import attention
from hybrax.ops.attention.mask import MaskInfo
from hybrax.serving.attention_pool import attention_decode_pool
from hybrax.serving.attention_prefill import attention_prefill_pool


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class AttentionCache:
    """An attention layer's pools by slot: keys k and values v [S, max_len, KV, D], and lengths [S] int32 (the
    tokens each row holds)."""

    k: Float[Array, "num_slots max_len num_kv_heads head_dim"]
    v: Float[Array, "num_slots max_len num_kv_heads head_dim"]
    lengths: Int[Array, " num_slots"]


def rotary(x: Float[Array, "batch seq_len heads dim"], positions: Int[Array, "batch seq_len"], theta: float
           ) -> Float[Array, "batch seq_len heads dim"]:
    """Rotate-half rotary embedding in fp32, returned in x's dtype: pairs (i, i + D/2) turn by p * theta^(-2i/D)."""
    half = x.shape[-1] // 2
    inverse_frequency = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / x.shape[-1])
    angle = positions.astype(jnp.float32)[..., None, None] * inverse_frequency
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class KvCacheServing:
    """prefill and decode of an attention layer through its KV cache pools (`AttentionCache`), for a layer with
    hidden_size, _qkv(x, positions) -> (q, k, v), _output(o) -> y and _pool_options() (the keywords its softmax
    takes in `attention_prefill_pool` and `attention_decode_pool`)."""

    @staticmethod
    def _check_cache(cache: Any) -> None:
        if not isinstance(cache, AttentionCache):
            raise ValueError(f"cache must be this layer's AttentionCache (from empty_cache), "
                             f"got {type(cache).__name__}")

    def prefill(self, x: Float[Array, "batch seq_len hidden"], cache: AttentionCache,
                slots: Int[Array, " num_sequences"], *, cu_seqlens: Int[Array, " n_plus_1"] | None = None
                ) -> tuple[Float[Array, "batch seq_len hidden"], AttentionCache]:
        """New prompts into their slots: the rows of x [B, T, hidden] (slots [B]) or N packed ones (B = 1,
        cu_seqlens [N + 1], slots [N]); each starts its row from position 0, whatever it held. Slot -1: a padded
        sequence (reads and writes nothing, outputs zeros).

        Returns:
            (y [B, T, hidden_size], the cache with each slot holding its prompt and its length).
        """
        check_hidden("x", x, self.hidden_size)
        self._check_cache(cache)
        batch, length = x.shape[:2]
        positions = packing(x, cu_seqlens).token_positions(batch, length)
        q, k, v = self._qkv(x, positions)
        o, k_pool, v_pool = attention_prefill_pool(q, k, v, cache.k, cache.v, slots, cu_seqlens=cu_seqlens,
                                                   **self._pool_options())
        lengths = set_rows(cache.lengths, slots, sequence_lengths(batch, length, cu_seqlens))
        return self._output(o), AttentionCache(k_pool, v_pool, lengths)

    def decode(self, x: Float[Array, "batch 1 hidden"], cache: AttentionCache, slots: Int[Array, " batch"]
               ) -> tuple[Float[Array, "batch 1 hidden"], AttentionCache]:
        """One token for each of B requests, x [B, 1, hidden], at position = its slot's length (slot -1: a padded
        row, outputs zeros).

        Returns:
            (y [B, 1, hidden_size], the cache with the tokens appended and the lengths advanced).
        """
        check_hidden("x", x, self.hidden_size, tokens=1)
        self._check_cache(cache)
        cached = read_rows(cache.lengths, slots)
        q, k, v = self._qkv(x, cached[:, None])
        o, k_pool, v_pool = attention_decode_pool(q, k, v, cache.k, cache.v, slots, cached, **self._pool_options())
        lengths = set_rows(cache.lengths, slots, cached + 1)
        return self._output(o), AttentionCache(k_pool, v_pool, lengths)


class Attention(KvCacheServing, nnx.Module):
    """Causal GQA attention over x [B, T, hidden_size] (see the module doc). `rope_theta` None: no rotary
    embedding; `qkv_bias`: biases on the q, k, v projections; `dtype` the computation dtype (None: as flax, the
    promoted input and parameter dtype)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 rope_theta: float | None = 10000.0, sliding_window: int | None = None, sinks: bool = False,
                 qk_norm: bool = False, qkv_bias: bool = False, norm_eps: float = 1e-5, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if rope_theta is not None and head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
        if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 0):
            raise ValueError(f"sliding_window must be an int >= 0 or None, got {sliding_window!r}")
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_dim = head_dim
        self.rope_theta, self.sliding_window, self.dtype = rope_theta, sliding_window, dtype
        linear = functools.partial(nnx.Linear, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(hidden_size, num_heads * head_dim, use_bias=qkv_bias)
        self.k_proj = linear(hidden_size, num_kv_heads * head_dim, use_bias=qkv_bias)
        self.v_proj = linear(hidden_size, num_kv_heads * head_dim, use_bias=qkv_bias)
        self.o_proj = linear(num_heads * head_dim, hidden_size, use_bias=False)
        self.q_norm = RMSNorm(head_dim, eps=norm_eps, param_dtype=param_dtype) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, eps=norm_eps, param_dtype=param_dtype) if qk_norm else None
        self.sinks = nnx.Param(jnp.zeros((num_heads,), jnp.float32)) if sinks else None

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        batch, length = x.shape[:2]
        q = self.q_proj(x).reshape(batch, length, self.num_heads, self.head_dim)
        k = self.k_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(batch, length, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rope_theta is not None:
            q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        return q, k, v

    def _softmax_aux(self) -> jax.Array | None:
        return None if self.sinks is None else self.sinks[...][:, None]

    def _output(self, o: jax.Array) -> jax.Array:
        return self.o_proj(o.reshape(*o.shape[:2], self.num_heads * self.head_dim))

    def _pool_options(self) -> dict[str, Any]:
        return {"sliding_window": self.sliding_window, "softmax_aux": self._softmax_aux()}

    def __call__(self, x: Float[Array, "batch seq_len hidden"], *, cu_seqlens: Int[Array, " n_plus_1"] | None = None,
                 segment_ids: Int[Array, "batch seq_len"] | None = None, max_segments: int | None = None
                 ) -> Float[Array, "batch seq_len hidden"]:
        """The layer on x [B, T, hidden_size]: one sequence per row, or packed ones (cu_seqlens [N + 1] with B = 1,
        or segment_ids [B, T]; `hybrax.core.packing`). max_segments is accepted for a call uniform with
        `KimiDeltaAttention` (attention needs no bound on the segments). Padding tokens output zeros.

        Returns:
            y [B, T, hidden_size].
        """
        check_hidden("x", x, self.hidden_size)
        pack = packing(x, cu_seqlens, segment_ids)
        q, k, v = self._qkv(x, pack.token_positions(*x.shape[:2]))
        mask_info = None if pack.segments is None else MaskInfo.from_segments(pack.segments)
        window = None if self.sliding_window is None else (self.sliding_window, 0)
        o = attention(q, k, v, None, None, self._softmax_aux(), mask_info=mask_info, causal=True,
                      sliding_window=window)
        return pack.zero_padding(self._output(o))

    # ------------------------------------------------------------------ serving

    def empty_cache(self, num_slots: int, *, max_len: int, dtype: Any = None) -> AttentionCache:
        """Zeroed pools for num_slots requests of up to max_len tokens; keys and values in `dtype` (default: the
        layer's dtype, else fp32)."""
        if not (isinstance(max_len, int) and max_len >= 1):
            raise ValueError(f"max_len must be an int >= 1 (tokens per slot), got {max_len!r}")
        dtype = dtype or self.dtype or jnp.float32
        shape = (num_slots, max_len, self.num_kv_heads, self.head_dim)
        return AttentionCache(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype), jnp.zeros((num_slots,), jnp.int32))

    # ------------------------------------------------------------------ weights

    def load_fla_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the weights of flash-linear-attention's `Attention` (PyTorch layouts, NumPy arrays): `q_proj.weight`
        [H D, hidden], `k_proj.weight`, `v_proj.weight` [KV D, hidden] (and their `.bias` with qkv_bias),
        `o_proj.weight` [hidden, H D], `q_norm.weight`, `k_norm.weight` [D] with qk_norm, and `sinks` [H] (a name
        fla lacks; gpt-oss's) with sinks. Every name must be there and no other."""
        targets = {**linear_targets(self.q_proj, "q_proj."), **linear_targets(self.k_proj, "k_proj."),
                   **linear_targets(self.v_proj, "v_proj."), **linear_targets(self.o_proj, "o_proj.")}
        if self.q_norm is not None:
            targets["q_norm.weight"] = (self.q_norm.weight, (self.head_dim,), None)
            targets["k_norm.weight"] = (self.k_norm.weight, (self.head_dim,), None)
        if self.sinks is not None:
            targets["sinks"] = (self.sinks, (self.num_heads,), None)
        load_parameters(type(self).__name__, state_dict, targets)


def read_rows(values: Int[Array, " num_slots"], slots: Int[Array, " batch"]) -> Int[Array, " batch"]:
    """values[slots], 0 for a padded row (slot -1, or under jit any slot outside the pool)."""
    slots = jnp.asarray(slots, jnp.int32)
    valid = (slots >= 0) & (slots < values.shape[0])
    return jnp.where(valid, values[jnp.clip(slots, 0, values.shape[0] - 1)], 0)


def set_rows(values: Int[Array, " num_slots"], slots: Int[Array, " batch"], new: Int[Array, " batch"]
             ) -> Int[Array, " num_slots"]:
    """values with values[slots[i]] = new[i] for the valid slots; padded rows write nothing."""
    slots = jnp.asarray(slots, jnp.int32)
    rows = jnp.where(slots >= 0, slots, values.shape[0])
    return values.at[rows].set(new.astype(values.dtype), mode="drop")
