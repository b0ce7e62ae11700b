"""`KimiDeltaAttention`: the Kimi Delta Attention layer as flash-linear-attention's `fla.layers.KimiDeltaAttention`.

For x [B, T, hidden], H query/key heads of K, HV value heads of V = K * expand_v:
    q, k = silu(conv(x W_q)), silu(conv(x W_k))           [B, T, H, K]  (causal depthwise short convolutions;
    v = silu(conv(x W_v))                                  [B, T, HV, V]  without them, silu of the projections)
    g = (x W_fa) W_fb                                      [B, T, HV, K]  the low-rank gate input
    decay = -exp(A_log) * softplus(g + dt_bias)                           (lower_bound * sigmoid(exp(A_log) *
                                                                           (g + dt_bias)) with lower_bound set)
    beta = sigmoid(x W_b)                                  [B, T, HV]     (2 sigmoid(.) with allow_neg_eigval)
    o = KDA(l2norm(q), l2norm(k), v, beta, decay)          `hybrax.kernel_delta_attention`
    y = (rmsnorm(o) * w_norm * sigmoid((x W_ga) W_gb + b_gb)) W_o        per value head, then [B, T, HV * V] W_o
Parameters start as fla's: A_log = log U(1, 16) per value head, dt_bias = softplus^-1(dt) with dt log-uniform in
[1e-3, 0.1] (at least 1e-4) per value head and key channel, both fp32 (leave them out of weight decay, as fla does);
the norm weight ones; projections flax's default (LeCun normal), convolutions PyTorch's (uniform +-1/sqrt(W)).

Serving: each slot owns a KDA state row (fp32 [S, HV, K, V], or V-first [S, HV, V, K]) and the last W - 1 inputs of
the three convolutions, concatenated (fp32 [S, 2 H K + HV V, W - 1]): `prefill` starts new prompts in their slots
(chunked KDA, `hybrax.serving.kda_prefill_pool`) and `decode` advances a token per request by slot
(`kda_decode_pool`); slot -1 marks a padded row that reads and writes nothing and outputs zeros.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from hybrax.core.validate import check_number
from hybrax.nn.conv import QkvShortConvs, ShortConvolution, conv_targets
from hybrax.nn.norm import GatedRMSNorm
from hybrax.core.packing import check_hidden, packing
from hybrax.nn.weights import linear_targets, load_parameters
from hybrax.ops.kda.api import kernel_delta_attention
from hybrax.serving.kda_pool import kda_decode_pool
from hybrax.serving.prefill import kda_prefill_pool
from hybrax.serving.short_conv import short_conv_decode, short_conv_prefill


MODES = ("chunk", "fused_recurrent")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["conv", "state"], meta_fields=["state_v_first"])
@dataclasses.dataclass(frozen=True)
class KdaCache:
    """A KDA layer's pools by slot: conv [S, 2 H K + HV V, W - 1] fp32 (the q, k and v convolutions' last inputs;
    None without short convolutions) and state [S, HV, K, V] fp32 ([S, HV, V, K] when state_v_first)."""

    conv: Float[Array, "num_slots conv_dim width_minus_1"] | None
    state: Float[Array, "num_slots num_v_heads d1 d2"]
    state_v_first: bool = False


def fla_a_log(key: jax.Array, heads: int) -> jax.Array:
    """fla's A_log: log of U(1, 16) per value head."""
    return jnp.log(jax.random.uniform(key, (heads,), jnp.float32, 1.0, 16.0))


def fla_dt_bias(key: jax.Array, size: int) -> jax.Array:
    """fla's dt_bias: softplus^-1(dt) for dt log-uniform in [1e-3, 0.1], at least 1e-4."""
    log_dt = jax.random.uniform(key, (size,), jnp.float32, math.log(1e-3), math.log(0.1))
    dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))


class KimiDeltaAttention(QkvShortConvs, nnx.Module):
    """Kimi Delta Attention over x [B, T, hidden_size] (see the module doc). `num_v_heads` (default num_heads) a
    multiple of num_heads; value heads of head_dim * expand_v; `lower_bound` (a number <= 0) selects the bounded
    gate; `mode` the training path's algorithm, as fla's: "chunk" (chunked KDA) or "fused_recurrent" (the
    token-by-token scan: cheaper to compile, for short sequences); `dtype` the computation dtype (None: as flax, the
    promoted input and parameter dtype), `param_dtype` the parameters' (A_log and dt_bias stay fp32)."""

    cache_type = KdaCache

    def __init__(self, hidden_size: int, num_heads: int, head_dim: int, *, num_v_heads: int | None = None,
                 expand_v: float = 1.0, mode: str = "chunk", use_short_conv: bool = True, conv_size: int = 4,
                 conv_bias: bool = False, allow_neg_eigval: bool = False, lower_bound: float | None = None,
                 norm_eps: float = 1e-5, dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
        num_v_heads = num_heads if num_v_heads is None else num_v_heads
        if num_v_heads < num_heads or num_v_heads % num_heads:
            raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_heads ({num_heads})")
        head_v_dim = head_dim * expand_v
        if head_v_dim != int(head_v_dim) or head_v_dim < 1:
            raise ValueError(f"head_dim * expand_v must be a whole number >= 1, got {head_dim} * {expand_v}")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if lower_bound is not None:
            lower_bound = check_number("lower_bound", lower_bound, "a number <= 0 or None", lambda b: b <= 0)
        self.hidden_size, self.num_heads, self.num_v_heads = hidden_size, num_heads, num_v_heads
        self.head_dim, self.head_v_dim = head_dim, int(head_v_dim)
        self.key_dim, self.value_dim = num_heads * head_dim, num_v_heads * self.head_v_dim
        self.use_short_conv, self.allow_neg_eigval, self.lower_bound = use_short_conv, allow_neg_eigval, lower_bound
        self.mode, self.dtype = mode, dtype

        linear = functools.partial(nnx.Linear, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        self.q_proj = linear(hidden_size, self.key_dim)
        self.k_proj = linear(hidden_size, self.key_dim)
        self.v_proj = linear(hidden_size, self.value_dim)
        if use_short_conv:
            conv = functools.partial(ShortConvolution, kernel_size=conv_size, bias=conv_bias, activation="silu",
                                     dtype=dtype, param_dtype=param_dtype, rngs=rngs)
            self.q_conv1d, self.k_conv1d, self.v_conv1d = conv(self.key_dim), conv(self.key_dim), conv(self.value_dim)
        self.f_a_proj = linear(hidden_size, self.head_v_dim)
        self.f_b_proj = linear(self.head_v_dim, num_v_heads * head_dim)
        self.b_proj = linear(hidden_size, num_v_heads)
        self.A_log = nnx.Param(fla_a_log(rngs.params(), num_v_heads))
        self.dt_bias = nnx.Param(fla_dt_bias(rngs.params(), num_v_heads * head_dim))
        self.g_a_proj = linear(hidden_size, self.head_v_dim)
        self.g_b_proj = nnx.Linear(self.head_v_dim, self.value_dim, use_bias=True, dtype=dtype,
                                   param_dtype=param_dtype, rngs=rngs)
        self.o_norm = GatedRMSNorm(self.head_v_dim, eps=norm_eps, activation="sigmoid", param_dtype=param_dtype)
        self.o_proj = linear(self.value_dim, hidden_size)

    # ------------------------------------------------------------------ pieces

    def _heads(self, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        batch, length = q.shape[:2]
        return (q.reshape(batch, length, self.num_heads, self.head_dim),
                k.reshape(batch, length, self.num_heads, self.head_dim),
                v.reshape(batch, length, self.num_v_heads, self.head_v_dim))

    def _gate_and_beta(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The raw gate [B, T, HV, K] and beta [B, T, HV] (logits, or 2 sigmoid(.) with allow_neg_eigval)."""
        g = self.f_b_proj(self.f_a_proj(x)).reshape(*x.shape[:2], self.num_v_heads, self.head_dim)
        beta = self.b_proj(x)
        if self.allow_neg_eigval:
            beta = 2.0 * jax.nn.sigmoid(beta.astype(jnp.float32))
        return g, beta

    def _gate_options(self) -> dict[str, Any]:
        return dict(a_log=self.A_log[...], dt_bias=self.dt_bias[...].reshape(self.num_v_heads, self.head_dim),
                    lower_bound=self.lower_bound, beta_is_logits=not self.allow_neg_eigval)

    def _output(self, x: jax.Array, o: jax.Array) -> jax.Array:
        batch, length = x.shape[:2]
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(batch, length, self.num_v_heads, self.head_v_dim)
        return self.o_proj(self.o_norm(o, gate).reshape(batch, length, self.value_dim))

    def _split_qkv(self, qkv: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        return self._heads(*jnp.split(qkv, [self.key_dim, 2 * self.key_dim], axis=-1))

    # ------------------------------------------------------------------ training

    def __call__(self, x: Float[Array, "batch seq_len hidden"], *, cu_seqlens: Int[Array, " n_plus_1"] | None = None,
                 segment_ids: Int[Array, "batch seq_len"] | None = None, max_segments: int | None = None
                 ) -> Float[Array, "batch seq_len hidden"]:
        """The layer on x [B, T, hidden_size]: one sequence per row, or packed ones (cu_seqlens [N + 1] with B = 1,
        or segment_ids [B, T]; `hybrax.core.packing`). Under jit, segment_ids need `max_segments`, a static bound on
        their runs. Padding tokens output zeros.

        Returns:
            y [B, T, hidden_size].
        """
        check_hidden("x", x, self.hidden_size)
        pack = packing(x, cu_seqlens, segment_ids, max_segments=max_segments, with_cu_seqlens=True)
        q, k, v = self._projections(x)
        if self.use_short_conv:
            q, k, v = (conv.convolve(t, pack.segments) for t, conv in zip((q, k, v), self._convs()))
        else:
            q, k, v = jax.nn.silu(q), jax.nn.silu(k), jax.nn.silu(v)
        q, k, v = self._heads(q, k, v)
        g, beta = self._gate_and_beta(x)
        inputs = (q, k, v, beta, g)
        if pack.cu_seqlens is not None:  # KDA's packed form: the B rows as one row of B * T tokens
            inputs = tuple(t.reshape(1, -1, *t.shape[2:]) for t in inputs)
        o = kernel_delta_attention(*inputs, cu_seqlens=pack.cu_seqlens, use_chunked=self.mode == "chunk",
                                   **self._gate_options())
        return pack.zero_padding(self._output(x, o.reshape(*x.shape[:2], *o.shape[2:])))

    # ------------------------------------------------------------------ serving

    def empty_cache(self, num_slots: int, *, max_len: int | None = None, state_v_first: bool = False) -> KdaCache:
        """Zeroed pools for num_slots requests. max_len is ignored (the state does not grow with the sequence): it
        lets one call make every layer's cache."""
        conv = None
        if self.use_short_conv:
            width = self.q_conv1d.kernel_size
            conv = jnp.zeros((num_slots, 2 * self.key_dim + self.value_dim, width - 1), jnp.float32)
        row = (self.head_v_dim, self.head_dim) if state_v_first else (self.head_dim, self.head_v_dim)
        return KdaCache(conv, jnp.zeros((num_slots, self.num_v_heads, *row), jnp.float32), state_v_first)

    def prefill(self, x: Float[Array, "batch seq_len hidden"], cache: KdaCache, slots: Int[Array, " num_sequences"],
                *, cu_seqlens: Int[Array, " n_plus_1"] | None = None) -> tuple[Float[Array, "batch seq_len hidden"],
                                                                                KdaCache]:
        """New prompts into their slots: the rows of x [B, T, hidden] (slots [B]) or N packed ones (B = 1,
        cu_seqlens [N + 1], slots [N]); each starts from an empty state, whatever its slot held. Slot -1: a padded
        sequence (reads and writes nothing, outputs zeros).

        Returns:
            (y [B, T, hidden_size], the cache with each slot holding its prompt's final states).
        """
        check_hidden("x", x, self.hidden_size)
        self._check_cache(cache)
        fresh = jnp.zeros(jnp.shape(slots), bool)
        qkv = jnp.concatenate(self._projections(x), axis=-1)
        conv = cache.conv
        if self.use_short_conv:
            weight, bias = self._conv_weights()
            qkv, conv = short_conv_prefill(qkv, conv, weight, slots, bias=bias, has_initial_state=fresh,
                                           cu_seqlens=cu_seqlens)
        else:
            qkv = jax.nn.silu(qkv)
        g, beta = self._gate_and_beta(x)
        o, state = kda_prefill_pool(*self._split_qkv(qkv), g, beta, cache.state, slots, has_initial_state=fresh,
                                    cu_seqlens=cu_seqlens, gate=self._gate_name(),
                                    state_v_first=cache.state_v_first, **self._gate_options())
        return self._output(x, o), KdaCache(conv, state, cache.state_v_first)

    def decode(self, x: Float[Array, "batch 1 hidden"], cache: KdaCache, slots: Int[Array, " batch"]
               ) -> tuple[Float[Array, "batch 1 hidden"], KdaCache]:
        """One token for each of B requests, x [B, 1, hidden], by slot (-1: a padded row, outputs zeros).

        Returns:
            (y [B, 1, hidden_size], the cache with each request's slot advanced).
        """
        check_hidden("x", x, self.hidden_size, tokens=1)
        self._check_cache(cache)
        qkv = jnp.concatenate(self._projections(x), axis=-1)[:, 0]
        conv = cache.conv
        if self.use_short_conv:
            weight, bias = self._conv_weights()
            qkv, conv = short_conv_decode(qkv, conv, weight, slots, bias=bias)
        else:
            qkv = jax.nn.silu(qkv)
        g, beta = self._gate_and_beta(x)
        o, state = kda_decode_pool(*self._split_qkv(qkv[:, None]), g, beta, cache.state, slots,
                                   gate=self._gate_name(), state_v_first=cache.state_v_first, **self._gate_options())
        return self._output(x, o), KdaCache(conv, state, cache.state_v_first)

    def _gate_name(self) -> str:
        return "softplus" if self.lower_bound is None else "bounded"

    # ------------------------------------------------------------------ weights

    def load_fla_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load the weights of flash-linear-attention's `KimiDeltaAttention` (the same configuration), by fla's names
        and PyTorch layouts, as NumPy arrays: `q_proj.weight`, `k_proj.weight` [H K, hidden], `v_proj.weight`
        [HV V, hidden], `q_conv1d.weight`, `k_conv1d.weight` [H K, 1, W], `v_conv1d.weight` [HV V, 1, W] (and their
        `.bias` with conv_bias), `f_proj.0.weight` [V, hidden], `f_proj.1.weight` [HV K, V], `b_proj.weight`
        [HV, hidden], `A_log` [HV], `dt_bias` [HV K], `g_proj.0.weight` [V, hidden], `g_proj.1.weight` [HV V, V],
        `g_proj.1.bias` [HV V], `o_norm.weight` [V], `o_proj.weight` [hidden, HV V]. Every name must be there and
        no other; shapes are checked before anything is written.

        A Kimi-Linear checkpoint (moonshotai/Kimi-Linear-48B-A3B: `model.layers.{i}.self_attn.*` of its KDA
        layers) names the same weights `q_proj`, `k_proj`, `v_proj`, `q_conv1d`, `k_conv1d`, `v_conv1d`, `b_proj`,
        `dt_bias`, `o_norm`, `o_proj` as fla does, and `f_a_proj` / `f_b_proj` / `g_a_proj` / `g_b_proj` for
        `f_proj.0` / `f_proj.1` / `g_proj.0` / `g_proj.1`; its `g_b_proj` has no bias (fla's is zero then) and its
        `A_log` is [1, 1, HV, 1]. `kimi_linear_to_fla` renames one layer's dict (prefix stripped) this way.
        """
        targets = {
            **linear_targets(self.q_proj, "q_proj."), **linear_targets(self.k_proj, "k_proj."),
            **linear_targets(self.v_proj, "v_proj."),
            **linear_targets(self.f_a_proj, "f_proj.0."), **linear_targets(self.f_b_proj, "f_proj.1."),
            **linear_targets(self.b_proj, "b_proj."),
            "A_log": (self.A_log, (self.num_v_heads,), None),
            "dt_bias": (self.dt_bias, (self.num_v_heads * self.head_dim,), None),
            **linear_targets(self.g_a_proj, "g_proj.0."), **linear_targets(self.g_b_proj, "g_proj.1."),
            "o_norm.weight": (self.o_norm.weight, (self.head_v_dim,), None),
            **linear_targets(self.o_proj, "o_proj."),
        }
        if self.use_short_conv:
            for name, conv in zip(("q_conv1d.", "k_conv1d.", "v_conv1d."), self._convs()):
                targets.update(conv_targets(conv, name))
        load_parameters(type(self).__name__, state_dict, targets)

    def fla_state_dict(self) -> dict[str, np.ndarray]:
        """The layer's weights as flash-linear-attention's `KimiDeltaAttention` names and lays them out (the names and
        PyTorch shapes `load_fla_state_dict` lists), so that fla's layer of the same configuration can load them
        (`torch.from_numpy` each, then `load_state_dict`); `load_fla_state_dict` of the result restores every
        parameter exactly.

        Returns:
            {fla name: NumPy array}, in the parameter's dtype where NumPy has it as a float; bfloat16 (which neither
            NumPy's float checks nor PyTorch's from_numpy take) widened, exactly, to float32.
        """
        linears = {"q_proj": self.q_proj, "k_proj": self.k_proj, "v_proj": self.v_proj, "f_proj.0": self.f_a_proj,
                   "f_proj.1": self.f_b_proj, "b_proj": self.b_proj, "g_proj.0": self.g_a_proj,
                   "g_proj.1": self.g_b_proj, "o_proj": self.o_proj}
        found = {"A_log": self.A_log[...], "dt_bias": self.dt_bias[...], "o_norm.weight": self.o_norm.weight[...]}
        for name, linear in linears.items():  # nnx kernels are [in, out], PyTorch weights [out, in]
            found[f"{name}.weight"] = linear.kernel[...].T
            if linear.bias is not None:
                found[f"{name}.bias"] = linear.bias[...]
        if self.use_short_conv:
            for name, conv in zip(("q_conv1d", "k_conv1d", "v_conv1d"), self._convs()):
                found[f"{name}.weight"] = conv.weight[...][:, None]  # nn.Conv1d's depthwise [D, 1, W]
                if conv.bias is not None:
                    found[f"{name}.bias"] = conv.bias[...]
        return {name: np.asarray(value if np.issubdtype(value.dtype, np.floating) else value.astype(jnp.float32))
                for name, value in found.items()}


KIMI_LINEAR_NAMES = {"f_a_proj.weight": "f_proj.0.weight", "f_b_proj.weight": "f_proj.1.weight",
                     "g_a_proj.weight": "g_proj.0.weight", "g_b_proj.weight": "g_proj.1.weight"}


def kimi_linear_to_fla(state_dict: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """One Kimi-Linear KDA layer's weights (names without the `model.layers.{i}.self_attn.` prefix) under fla's
    names: the low-rank gates renamed, a zero `g_proj.1.bias` (Kimi's output gate has none) and `A_log` flattened
    to [HV]."""
    converted = {KIMI_LINEAR_NAMES.get(name, name): np.asarray(value) for name, value in state_dict.items()}
    if "A_log" in converted:
        converted["A_log"] = converted["A_log"].reshape(-1)
    if "g_proj.1.weight" in converted and "g_proj.1.bias" not in converted:
        gate_weight = converted["g_proj.1.weight"]
        converted["g_proj.1.bias"] = np.zeros(gate_weight.shape[:1], gate_weight.dtype)
    return converted
