"""`GatedLinearAttention`: gated linear attention as flash-linear-attention's `fla.layers.GatedLinearAttention`.

For x [B, T, hidden], H query heads and KV key/value heads (H a multiple of KV), key_dim = hidden * expand_k and
value_dim = hidden * expand_v split into heads of K = key_dim / H and V = value_dim / H:
    q = x W_q                  [B, T, H, K]     (use_short_conv: silu(conv(.)) of each projection)
    k, v = x W_k, x W_v        [B, T, KV, K | V]
    gk = logsigmoid((x W_gk0) W_gk1 + b_gk1) / gate_logit_normalizer      [B, T, KV, K], at least clamp_min if set
    q, k = phi(q), phi(k)      with a feature_map phi
    S_t = S_{t-1} diag(exp(gk_t)) + k_t v_t^T;  o_t = S_t^T q_t / sqrt(K)  per query head; head h reads KV head
                                                                           h // (H / KV): k, v and gk are shared
    y = (rmsnorm(o) * w_norm * act(x W_g)) W_o                             per head, then [B, T, H V] W_o; act the
                                                                           output gate's (swish); no gate: rmsnorm(o)
The recurrence is `hybrax.gated_linear_attention`. Parameters start as flax's defaults (the projections LeCun
normal, the gate's bias zero, the norm weight ones; convolutions as PyTorch's, uniform +-1/sqrt(W)).

Serving: each slot owns a recurrent state row (fp32 [S, H, K, V], or V-first [S, H, V, K] as fla's layer keeps
it) and, with short convolutions, the last W - 1 inputs of the three of them, concatenated (fp32
[S, key_dim + KV K + KV V, W - 1]). `prefill` starts new prompts in their slots from a zero state (the
recurrence's final states scattered into the rows, the convolutions through `hybrax.serving.short_conv_prefill`)
and `decode` advances a token per request from its row (`short_conv_decode`, one step of the scan); slot -1 marks a
padded row that reads and writes nothing and outputs zeros. The state holds one row per query head, as fla's
does, although the heads of a KV group hold equal states.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from hybrax.core.packing import check_hidden, packing
from hybrax.core.validate import check_number
from hybrax.nn.conv import QkvShortConvs, ShortConvolution, conv_targets
from hybrax.nn.norm import GatedRMSNorm, RMSNorm
from hybrax.nn.weights import linear_targets, load_parameters
from hybrax.ops.recurrent.base import RecurrentAttentionConfig
from hybrax.ops.recurrent.gla import gated_linear_attention
from hybrax.serving.kda_pool import pool_rows, scatter_rows
from hybrax.serving.prefill import check_slots, gather_rows, padded_token_mask
from hybrax.serving.short_conv import short_conv_decode, short_conv_prefill

MODES = ("chunk", "fused_recurrent")
FEATURE_MAPS = {"relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid, "silu": jax.nn.silu, "swish": jax.nn.silu}
GATE_FUNCTIONS = ("swish", "silu", "sigmoid")
# The token-by-token scan: fla's "fused_recurrent" mode (cheaper to compile for short sequences) and every decode
# step (one token: nothing to chunk).
SCAN = RecurrentAttentionConfig(platform="xla", backend="scan")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["conv", "state"], meta_fields=["state_v_first"])
@dataclasses.dataclass(frozen=True)
class GlaCache:
    """A GLA layer's pools by slot: conv [S, key_dim + KV K + KV V, W - 1] fp32 (the q, k and v convolutions'
    last inputs; None without short convolutions) and state [S, H, K, V] fp32 ([S, H, V, K] when state_v_first)."""

    conv: Float[Array, "num_slots conv_dim width_minus_1"] | None
    state: Float[Array, "num_slots num_heads d1 d2"]
    state_v_first: bool = False


def _head_dim(name: str, hidden_size: int, expand: float, num_heads: int) -> int:
    """int(hidden_size * expand) (truncated, as fla does) split into num_heads heads."""
    dim = int(hidden_size * expand)
    if dim < num_heads or dim % num_heads:
        raise ValueError(f"hidden_size * {name} ({hidden_size} * {expand} = {dim}) must be a positive multiple of "
                         f"num_heads ({num_heads})")
    return dim // num_heads


class GatedLinearAttention(QkvShortConvs, nnx.Module):
    """Gated linear attention over x [B, T, hidden_size] (see the module doc), with fla's arguments: `num_kv_heads`
    (default num_heads) dividing num_heads; `feature_map` None or one of FEATURE_MAPS on q and k; `use_output_gate`
    with `gate_fn` ("swish", "silu" or "sigmoid"); `fuse_norm` only names the norm as fla does
    (`g_norm_swish_gate` for a fused swish gate, else `g_norm`); the norm always has a weight. `mode`: "chunk"
    (the executor's chunked kernels; fla's "fused_chunk" computes the same) or "fused_recurrent" (the
    token-by-token scan). `dtype` the computation dtype (None: as flax, the promoted input and parameter dtype),
    `param_dtype` the parameters'."""

    cache_type = GlaCache

    def __init__(self, hidden_size: int, num_heads: int, *, num_kv_heads: int | None = None, expand_k: float = 0.5,
                 expand_v: float = 1.0, mode: str = "chunk", feature_map: str | None = None,
                 use_short_conv: bool = False, conv_size: int = 4, conv_bias: bool = False,
                 use_output_gate: bool = True, gate_fn: str = "swish", fuse_norm: bool = True, norm_eps: float = 1e-5,
                 gate_logit_normalizer: float = 16, gate_low_rank_dim: int = 16, clamp_min: float | None = None,
                 dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if num_kv_heads < 1 or num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if feature_map is not None and feature_map not in FEATURE_MAPS:
            raise ValueError(f"feature_map must be None or one of {tuple(FEATURE_MAPS)}, got {feature_map!r}")
        if gate_fn not in GATE_FUNCTIONS:
            raise ValueError(f"gate_fn must be one of {GATE_FUNCTIONS}, got {gate_fn!r}")
        self.gate_logit_normalizer = check_number("gate_logit_normalizer", gate_logit_normalizer, "a number > 0",
                                                  lambda n: n > 0)
        if clamp_min is not None:
            clamp_min = check_number("clamp_min", clamp_min, "a number <= 0 (a log decay) or None", lambda c: c <= 0)
        self.hidden_size, self.num_heads, self.num_kv_heads = hidden_size, num_heads, num_kv_heads
        self.head_k_dim = _head_dim("expand_k", hidden_size, expand_k, num_heads)
        self.head_v_dim = _head_dim("expand_v", hidden_size, expand_v, num_heads)
        self.key_dim, self.value_dim = num_heads * self.head_k_dim, num_heads * self.head_v_dim
        self.kv_key_dim, self.kv_value_dim = num_kv_heads * self.head_k_dim, num_kv_heads * self.head_v_dim
        self.mode, self.feature_map, self.use_short_conv, self.clamp_min = mode, feature_map, use_short_conv, clamp_min
        self.use_output_gate, self.dtype = use_output_gate, dtype
        self.norm_name = "g_norm_swish_gate" if use_output_gate and gate_fn == "swish" and fuse_norm else "g_norm"

        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(hidden_size, self.key_dim)
        self.k_proj = linear(hidden_size, self.kv_key_dim)
        self.v_proj = linear(hidden_size, self.kv_value_dim)
        self.g_proj = linear(hidden_size, self.value_dim) if use_output_gate else None
        if use_short_conv:
            conv = functools.partial(ShortConvolution, kernel_size=conv_size, bias=conv_bias, activation="silu",
                                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.q_conv1d = conv(self.key_dim)
            self.k_conv1d, self.v_conv1d = conv(self.kv_key_dim), conv(self.kv_value_dim)
        self.gk_a_proj = linear(hidden_size, gate_low_rank_dim)
        self.gk_b_proj = nnx.Linear(gate_low_rank_dim, self.kv_key_dim, use_bias=True, dtype=dtype,
                                    param_dtype=param_dtype, rngs=rngs)
        self.o_norm = (GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation=gate_fn, param_dtype=param_dtype)
                       if use_output_gate else RMSNorm(self.head_v_dim, eps=norm_eps, param_dtype=param_dtype))
        self.o_proj = linear(self.value_dim, hidden_size)

    # ------------------------------------------------------------------ pieces

    def _heads(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q [B, T, H, K], k [B, T, KV, K], v [B, T, KV, V], with the feature map on q and k."""
        batch, length = q.shape[:2]
        q = q.reshape(batch, length, self.num_heads, self.head_k_dim)
        k = k.reshape(batch, length, self.num_kv_heads, self.head_k_dim)
        if self.feature_map is not None:
            q, k = FEATURE_MAPS[self.feature_map](q), FEATURE_MAPS[self.feature_map](k)
        return q, k, v.reshape(batch, length, self.num_kv_heads, self.head_v_dim)

    def _split_qkv(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self._heads(*jnp.split(qkv, [self.key_dim, self.key_dim + self.kv_key_dim], axis=-1))

    def _log_decay(self, x: jax.Array) -> jax.Array:
        """gk [B, T, H, K] fp32: each KV head's gate repeated over its group of query heads."""
        raw = self.gk_b_proj(self.gk_a_proj(x)).astype(jnp.float32)
        gk = jax.nn.log_sigmoid(raw) / self.gate_logit_normalizer
        if self.clamp_min is not None:
            gk = jnp.maximum(gk, self.clamp_min)
        gk = gk.reshape(*x.shape[:2], self.num_kv_heads, self.head_k_dim)
        return jnp.repeat(gk, self.num_heads // self.num_kv_heads, axis=2)

    def _recurrence(self, q: jax.Array, k: jax.Array, v: jax.Array, gk: jax.Array, *, scan: bool = False,
                    **options: Any) -> Any:
        cfg = SCAN if scan or self.mode == "fused_recurrent" else None
        return gated_linear_attention(q, k, v, gk, cfg=cfg, **options)

    def _output(self, x: jax.Array, o: jax.Array) -> jax.Array:
        batch, length = x.shape[:2]
        if self.use_output_gate:
            o = self.o_norm(o, self.g_proj(x).reshape(batch, length, self.num_heads, self.head_v_dim))
        else:
            o = self.o_norm(o)
        return self.o_proj(o.reshape(batch, length, self.value_dim))

    # ------------------------------------------------------------------ training

    def __call__(self, x: Float[Array, "batch seq_len hidden"], *, cu_seqlens: Int[Array, " n_plus_1"] | None = None,
                 segment_ids: Int[Array, "batch seq_len"] | None = None, max_segments: int | None = None
                 ) -> Float[Array, "batch seq_len hidden"]:
        """The layer on x [B, T, hidden_size]: one sequence per row, or packed ones (cu_seqlens [N + 1] with B = 1,
        or segment_ids [B, T]; `hybrax.core.packing`). Under jit, segment_ids need `max_segments`, a static bound
        on their runs. Padding tokens output zeros.

        Returns:
            y [B, T, hidden_size].
        """
        check_hidden("x", x, self.hidden_size)
        pack = packing(x, cu_seqlens, segment_ids, max_segments=max_segments, with_cu_seqlens=True)
        q, k, v = self._projections(x)
        if self.use_short_conv:
            q, k, v = (conv.convolve(t, pack.segments) for t, conv in zip((q, k, v), self._convs()))
        inputs = (*self._heads(q, k, v), self._log_decay(x))
        if pack.cu_seqlens is not None:  # the packed form: the B rows as one row of B * T tokens
            inputs = tuple(t.reshape(1, -1, *t.shape[2:]) for t in inputs)
        o, _ = self._recurrence(*inputs, cu_seqlens=pack.cu_seqlens)
        return pack.zero_padding(self._output(x, o.reshape(*x.shape[:2], *o.shape[2:])))

    # ------------------------------------------------------------------ serving

    def empty_cache(self, num_slots: int, *, max_len: int | None = None, state_v_first: bool = False) -> GlaCache:
        """Zeroed pools for num_slots requests. max_len is ignored (the state does not grow with the sequence): it
        lets one call make every layer's cache."""
        if not (isinstance(num_slots, int) and num_slots >= 1):
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        conv = None
        if self.use_short_conv:
            width = self.q_conv1d.kernel_size
            conv = jnp.zeros((num_slots, self.key_dim + self.kv_key_dim + self.kv_value_dim, width - 1), jnp.float32)
        row = (self.head_v_dim, self.head_k_dim) if state_v_first else (self.head_k_dim, self.head_v_dim)
        return GlaCache(conv, jnp.zeros((num_slots, self.num_heads, *row), jnp.float32), state_v_first)

    def _serving_qkv(self, x: jax.Array, conv: jax.Array | None, slots: jax.Array, cu_seqlens: Any, decode: bool
                     ) -> tuple[jax.Array, jax.Array | None]:
        """The concatenated q, k, v projections of x after the convolutions (continued from, and written back to,
        the slots' conv rows), and the new conv pool."""
        qkv = jnp.concatenate(self._projections(x), axis=-1)
        if not self.use_short_conv:
            return qkv, conv
        weight, bias = self._conv_weights()
        if decode:
            y, conv = short_conv_decode(qkv[:, 0], conv, weight, slots, bias=bias)
            return y[:, None], conv
        return short_conv_prefill(qkv, conv, weight, slots, bias=bias, has_initial_state=jnp.zeros(slots.shape, bool),
                                  cu_seqlens=cu_seqlens)

    def prefill(self, x: Float[Array, "batch seq_len hidden"], cache: GlaCache, slots: Int[Array, " num_sequences"],
                *, cu_seqlens: Int[Array, " n_plus_1"] | None = None) -> tuple[Float[Array, "batch seq_len hidden"],
                                                                                GlaCache]:
        """New prompts into their slots: the rows of x [B, T, hidden] (slots [B]) or N packed ones (B = 1,
        cu_seqlens [N + 1], slots [N]); each starts from a zero state, whatever its slot held. Slot -1: a padded
        sequence (reads and writes nothing, outputs zeros).

        Returns:
            (y [B, T, hidden_size], the cache with each slot holding its prompt's final states).
        """
        check_hidden("x", x, self.hidden_size)
        self._check_cache(cache)
        batch, length = x.shape[:2]
        num_sequences = batch if cu_seqlens is None else jnp.shape(cu_seqlens)[0] - 1
        check_slots(slots, None, num_sequences, cache.state.shape[0], packed=cu_seqlens is not None)
        slots = pool_rows(slots, cache.state.shape[0])
        cu_seqlens = None if cu_seqlens is None else jnp.asarray(cu_seqlens, jnp.int32)
        qkv, conv = self._serving_qkv(x, cache.conv, slots, cu_seqlens, decode=False)
        o, final = self._recurrence(*self._split_qkv(qkv), self._log_decay(x), output_final_state=True,
                                    state_v_first=cache.state_v_first, cu_seqlens=cu_seqlens)
        y = self._output(x, o)
        y = jnp.where(padded_token_mask(slots, batch, length, cu_seqlens)[..., None], y, jnp.zeros((), y.dtype))
        return y, GlaCache(conv, scatter_rows(cache.state, slots, final, False), cache.state_v_first)

    def decode(self, x: Float[Array, "batch 1 hidden"], cache: GlaCache, slots: Int[Array, " batch"]
               ) -> tuple[Float[Array, "batch 1 hidden"], GlaCache]:
        """One token for each of B requests, x [B, 1, hidden], by slot (-1: a padded row, outputs zeros).

        Returns:
            (y [B, 1, hidden_size], the cache with each request's slot advanced).
        """
        check_hidden("x", x, self.hidden_size, tokens=1)
        self._check_cache(cache)
        check_slots(slots, None, x.shape[0], cache.state.shape[0])
        slots = pool_rows(slots, cache.state.shape[0])
        qkv, conv = self._serving_qkv(x, cache.conv, slots, None, decode=True)
        o, final = self._recurrence(*self._split_qkv(qkv), self._log_decay(x), scan=True,  # one step: no chunks
                                    initial_state=gather_rows(cache.state, slots, None), output_final_state=True,
                                    state_v_first=cache.state_v_first)
        y = self._output(x, o)
        y = jnp.where((slots >= 0)[:, None, None], y, jnp.zeros((), y.dtype))
        return y, GlaCache(conv, scatter_rows(cache.state, slots, final, False), cache.state_v_first)

    # ------------------------------------------------------------------ weights

    def load_fla_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the weights of flash-linear-attention's `GatedLinearAttention` (the same configuration), by fla's
        names and PyTorch layouts, as NumPy arrays: `q_proj.weight` [key_dim, hidden], `k_proj.weight` [KV K,
        hidden], `v_proj.weight` [KV V, hidden], `g_proj.weight` [value_dim, hidden] with the output gate,
        `q_conv1d.weight` [key_dim, 1, W], `k_conv1d.weight` [KV K, 1, W], `v_conv1d.weight` [KV V, 1, W] (and
        their `.bias` with conv_bias) with short convolutions, `gk_proj.0.weight` [gate_low_rank_dim, hidden],
        `gk_proj.1.weight` [KV K, gate_low_rank_dim], `gk_proj.1.bias` [KV K], `g_norm_swish_gate.weight` (or
        `g_norm.weight`: see the class doc) [V], `o_proj.weight` [hidden, value_dim]. Every name must be there and
        no other; shapes are checked before anything is written."""
        targets = {
            **linear_targets(self.q_proj, "q_proj."), **linear_targets(self.k_proj, "k_proj."),
            **linear_targets(self.v_proj, "v_proj."),
            **linear_targets(self.gk_a_proj, "gk_proj.0."), **linear_targets(self.gk_b_proj, "gk_proj.1."),
            self.norm_name + ".weight": (self.o_norm.weight, (self.head_v_dim,), None),
            **linear_targets(self.o_proj, "o_proj."),
        }
        if self.use_output_gate:
            targets.update(linear_targets(self.g_proj, "g_proj."))
        if self.use_short_conv:
            for name, conv in zip(("q_conv1d.", "k_conv1d.", "v_conv1d."), self._convs()):
                targets.update(conv_targets(conv, name))
        load_parameters(type(self).__name__, state_dict, targets)
