"""`MultiheadLatentAttention`: DeepSeek-V3's and Kimi Linear's multi-head latent attention (MLA), as
flash-linear-attention's `fla.layers.MultiheadLatentAttention`, for training and for serving from a KV cache pool.

For x [B, T, hidden] and H heads, with query/key heads of D = qk_nope_head_dim + qk_rope_head_dim and value heads
of Dv = v_head_dim:
    q = x W_q                            [B, T, H, D]  (q_lora_rank r: q = rmsnorm(x W_qa) W_qb, the low-rank form)
    c = rmsnorm(x W_kva)                 [B, T, kv_lora_rank]  the compressed latent of keys and values
    k_nope, v = c W_kvb                  [B, T, H, qk_nope_head_dim | Dv]
    k_rope = x W_kr                      [B, T, 1, qk_rope_head_dim]  one decoupled rotary key shared by the heads
    q = [q_nope, rope(q_rope, p)];  k = [k_nope, rope(k_rope, p)]  p the token's position in its sequence; rotate-half
                                                                   pairs as `hybrax.nn.Attention`; rope_theta None:
                                                                   no rotation (NoPE, Kimi Linear's MLA layers)
    o_i = softmax_j (scale q_i . k_j) v_j   j <= i in i's sequence (i - j <= sliding_window); scale 1/sqrt(D)
    y = o W_o                            [B, T, H Dv] W_o
The rmsnorms carry learned weights. The attention is `hybrax.attention` (keys of D, values of Dv).

Serving stores the keys and values expanded per head, an `AttentionCache` of k [S, max_len, H, D] and
v [S, max_len, H, Dv]: the simplest correct form, and H (D + Dv) numbers per token where the latent form would keep
kv_lora_rank + qk_rope_head_dim (absorbing W_kvb into the query and the output is not done). `prefill` writes new
prompts from position 0 (`hybrax.serving.attention_prefill_pool`) and `decode` appends one token per request
(`attention_decode_pool`), slot -1 marking a padded row.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from hybrax.core.packing import check_hidden, packing
from hybrax.core.validate import check_positive_number
from hybrax.nn.attention import AttentionCache, KvCacheServing, rotary
from hybrax.nn.norm import RMSNorm
from hybrax.nn.weights import linear_targets, load_parameters
from hybrax.ops.attention.api import attention
from hybrax.ops.attention.mask import MaskInfo


def _check_dims(**dims: int | None) -> None:
    for name, value in dims.items():
        if value is not None and not (isinstance(value, int) and value >= 1):
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")


class MultiheadLatentAttention(KvCacheServing, nnx.Module):
    """Causal multi-head latent attention over x [B, T, hidden_size] (see the module doc). `q_lora_rank` None: a
    full-rank query projection; `rope_theta` None: no rotary embedding; `sliding_window` w keeps the w positions
    before each token and its own (fla's window_size is w + 1); `softmax_scale` None: 1 / sqrt(qk_nope_head_dim +
    qk_rope_head_dim) (a YaRN-scaled checkpoint passes that times mscale^2); `norm_eps` the latents' rmsnorms';
    `dtype` the computation dtype (None: as flax, the promoted input and parameter dtype)."""

    def __init__(self, hidden_size: int, num_heads: int, *, kv_lora_rank: int, qk_nope_head_dim: int,
                 qk_rope_head_dim: int, v_head_dim: int, q_lora_rank: int | None = None,
                 rope_theta: float | None = 10000.0, sliding_window: int | None = None,
                 softmax_scale: float | None = None, norm_eps: float = 1e-5, dtype: Any = None,
                 param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        _check_dims(num_heads=num_heads, kv_lora_rank=kv_lora_rank, qk_nope_head_dim=qk_nope_head_dim,
                    qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim, q_lora_rank=q_lora_rank)
        if rope_theta is not None and qk_rope_head_dim % 2:
            raise ValueError(f"rotary embeddings need an even qk_rope_head_dim, got {qk_rope_head_dim}")
        if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 0):
            raise ValueError(f"sliding_window must be an int >= 0 or None, got {sliding_window!r}")
        self.hidden_size, self.num_heads, self.q_lora_rank, self.kv_lora_rank = (hidden_size, num_heads,
                                                                                 q_lora_rank, kv_lora_rank)
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.rope_theta, self.sliding_window, self.dtype = rope_theta, sliding_window, dtype
        self.softmax_scale = (self.qk_head_dim**-0.5 if softmax_scale is None
                              else check_positive_number("softmax_scale", softmax_scale))
        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        norm = functools.partial(RMSNorm, eps=norm_eps, dtype=dtype, param_dtype=param_dtype)
        if q_lora_rank is None:
            self.q_proj = linear(hidden_size, num_heads * self.qk_head_dim)
        else:
            self.q_a_proj, self.q_a_norm = linear(hidden_size, q_lora_rank), norm(q_lora_rank)
            self.q_b_proj = linear(q_lora_rank, num_heads * self.qk_head_dim)
        self.k_rope = linear(hidden_size, qk_rope_head_dim)
        self.kv_a_proj, self.kv_a_norm = linear(hidden_size, kv_lora_rank), norm(kv_lora_rank)
        self.kv_b_proj = linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim))
        self.o_proj = linear(num_heads * v_head_dim, hidden_size)

    def _query(self, x: jax.Array) -> jax.Array:
        if self.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))

    def _qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k [B, T, H, D] and v [B, T, H, Dv] of tokens at positions [B, T]."""
        batch, length = x.shape[:2]
        q_nope, q_rope = jnp.split(self._query(x).reshape(batch, length, self.num_heads, self.qk_head_dim),
                                   [self.qk_nope_head_dim], axis=-1)
        kv = self.kv_b_proj(self.kv_a_norm(self.kv_a_proj(x)))
        k_nope, v = jnp.split(kv.reshape(batch, length, self.num_heads, -1), [self.qk_nope_head_dim], axis=-1)
        k_rope = self.k_rope(x)[:, :, None]
        if self.rope_theta is not None:
            q_rope, k_rope = rotary(q_rope, positions, self.rope_theta), rotary(k_rope, positions, self.rope_theta)
        k_rope = jnp.broadcast_to(k_rope, (batch, length, self.num_heads, self.qk_rope_head_dim))
        return jnp.concatenate([q_nope, q_rope], axis=-1), jnp.concatenate([k_nope, k_rope], axis=-1), v

    def _output(self, o: jax.Array) -> jax.Array:
        return self.o_proj(o.reshape(*o.shape[:2], self.num_heads * self.v_head_dim))

    def _pool_options(self) -> dict[str, Any]:
        return {"sliding_window": self.sliding_window, "softmax_scale": self.softmax_scale}

    def __call__(self, x: Float[Array, "batch seq_len hidden"], *, cu_seqlens: Int[Array, " n_plus_1"] | None = None,
                 segment_ids: Int[Array, "batch seq_len"] | None = None, max_segments: int | None = None
                 ) -> Float[Array, "batch seq_len hidden"]:
        """The layer on x [B, T, hidden_size]: one sequence per row, or packed ones (cu_seqlens [N + 1] with B = 1,
        or segment_ids [B, T]; `hybrax.core.packing`). max_segments is accepted for a call uniform with the
        recurrent layers (attention needs no bound on the segments). Padding tokens output zeros.

        Returns:
            y [B, T, hidden_size].
        """
        check_hidden("x", x, self.hidden_size)
        pack = packing(x, cu_seqlens, segment_ids)
        q, k, v = self._qkv(x, pack.token_positions(*x.shape[:2]))
        mask_info = None if pack.segments is None else MaskInfo.from_segments(pack.segments)
        window = None if self.sliding_window is None else (self.sliding_window, 0)
        o = attention(q, k, v, mask_info=mask_info, causal=True, sliding_window=window,
                      softmax_scale=self.softmax_scale)
        return pack.zero_padding(self._output(o))

    # ------------------------------------------------------------------ serving

    def empty_cache(self, num_slots: int, *, max_len: int, dtype: Any = None) -> AttentionCache:
        """Zeroed pools for num_slots requests of up to max_len tokens: keys [S, max_len, H, D] and values
        [S, max_len, H, Dv] in `dtype` (default: the layer's dtype, else fp32)."""
        if not (isinstance(num_slots, int) and num_slots >= 1):
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if not (isinstance(max_len, int) and max_len >= 1):
            raise ValueError(f"max_len must be an int >= 1 (tokens per slot), got {max_len!r}")
        dtype = dtype or self.dtype or jnp.float32
        rows = (num_slots, max_len, self.num_heads)
        return AttentionCache(jnp.zeros((*rows, self.qk_head_dim), dtype), jnp.zeros((*rows, self.v_head_dim), dtype),
                              jnp.zeros((num_slots,), jnp.int32))

    # ------------------------------------------------------------------ weights

    def load_fla_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the weights of flash-linear-attention's `MultiheadLatentAttention` (PyTorch layouts, NumPy arrays):
        `q_proj.weight` [H D, hidden] (or with q_lora_rank r: `q_proj.0.weight` [r, hidden], `q_proj.1.weight` [r]
        (the norm), `q_proj.2.weight` [H D, r]), `k_rope.weight` [qk_rope_head_dim, hidden], `kv_proj.0.weight`
        [kv_lora_rank, hidden], `kv_proj.1.weight` [kv_lora_rank] (the norm), `kv_proj.2.weight`
        [H (qk_nope_head_dim + Dv), kv_lora_rank] (each head's nope key then its value), `o_proj.weight`
        [hidden, H Dv]. Every name must be there and no other; shapes are checked before anything is written.
        A DeepSeek-V3 or Kimi Linear checkpoint names them otherwise: `mla_to_fla` renames one layer's dict."""
        if self.q_lora_rank is None:
            query = linear_targets(self.q_proj, "q_proj.")
        else:
            query = {**linear_targets(self.q_a_proj, "q_proj.0."), **linear_targets(self.q_b_proj, "q_proj.2."),
                     "q_proj.1.weight": (self.q_a_norm.weight, (self.q_lora_rank,), None)}
        targets = {**query, **linear_targets(self.k_rope, "k_rope."), **linear_targets(self.kv_a_proj, "kv_proj.0."),
                   "kv_proj.1.weight": (self.kv_a_norm.weight, (self.kv_lora_rank,), None),
                   **linear_targets(self.kv_b_proj, "kv_proj.2."), **linear_targets(self.o_proj, "o_proj.")}
        load_parameters(type(self).__name__, state_dict, targets)


HF_NAMES = {"q_a_proj.weight": "q_proj.0.weight", "q_a_layernorm.weight": "q_proj.1.weight",
            "q_b_proj.weight": "q_proj.2.weight", "kv_a_layernorm.weight": "kv_proj.1.weight",
            "kv_b_proj.weight": "kv_proj.2.weight"}


def mla_to_fla(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One DeepSeek-V3 / Kimi Linear MLA layer's weights (Hugging Face names without the
    `model.layers.{i}.self_attn.` prefix) under fla's names: `q_proj` stays, `q_a_proj` / `q_a_layernorm` /
    `q_b_proj` become `q_proj.0` / `.1` / `.2`, `kv_a_layernorm` / `kv_b_proj` become `kv_proj.1` / `.2`, and the
    rows of `kv_a_proj_with_mqa` [kv_lora_rank + qk_rope_head_dim, hidden] split into `kv_proj.0` (the first
    kv_lora_rank, the size of `kv_a_layernorm.weight`) and `k_rope`. Checkpoints whose config sets rope_interleave
    (DeepSeek-V3's) rotate interleaved pairs (2i, 2i + 1), which this rotate-half layer does not; NoPE ones (Kimi
    Linear) load as they are."""
    converted = {HF_NAMES.get(name, name): np.asarray(value) for name, value in state_dict.items()}
    if "kv_a_proj_with_mqa.weight" in converted:
        if "kv_proj.1.weight" not in converted:
            raise ValueError("mla_to_fla needs kv_a_layernorm.weight to split kv_a_proj_with_mqa.weight (its size is "
                             "kv_lora_rank)")
        rank = converted["kv_proj.1.weight"].shape[0]
        both = converted.pop("kv_a_proj_with_mqa.weight")
        converted["kv_proj.0.weight"], converted["k_rope.weight"] = both[:rank], both[rank:]
    return converted
