"""Shared inputs of the attention tests: the implementations under test and one random call."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybrax import Attention, AttentionConfig, MaskInfo, attention
from hybrax.ops.attention import reference, scores
from tests.helpers import to64

def normal(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """N(0, 1) draws from NumPy: jax.random would compile a sampler for every new shape (~0.5 s each)."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, np.float32), dtype)


# Small tiles so the blockwise and flash tests cover several tiles, ragged last tiles and skipped tiles.
XLA_IMPLS = {
    "direct": AttentionConfig("xla", "direct"),
    "blockwise": AttentionConfig("xla", "blockwise", block_q=8, block_k=16),
}
IMPLS = {**XLA_IMPLS, "flash": AttentionConfig("pallas", "flash", block_q=16, block_k=16)}


def impl_cases(cases: dict[str, dict], impls: dict[str, AttentionConfig] = IMPLS) -> list[tuple[str, str]]:
    """(case, impl) pairs: every case for every implementation (of `impls`)."""
    return [(case, impl) for case in cases for impl in impls]


@dataclasses.dataclass
class Call:
    """One call: arrays (q, k, v, bias, sinks), keyword options, and what the reference needs."""

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None = None
    sinks: jax.Array | None = None
    options: dict[str, Any] = dataclasses.field(default_factory=dict)  # keyword args of attention
    mask: np.ndarray | None = None  # for the reference: the mask inside options["mask_info"]
    segments: tuple[np.ndarray, np.ndarray] | None = None

    def run(self, cfg: AttentionConfig, **overrides: Any) -> jax.Array:
        return attention(self.query, self.key, self.value, self.bias, self.options.get("dropout_rng"),
                         self.sinks, **self._keywords(), cfg=cfg, **overrides)

    def run_jit(self, cfg: AttentionConfig, **overrides: Any) -> jax.Array:
        """`run` under jit, with the arrays as arguments (closed-over constants would be folded)."""

        def fn(q, k, v, bias, sinks):
            return dataclasses.replace(self, query=q, key=k, value=v, bias=bias, sinks=sinks).run(cfg, **overrides)

        return jax.jit(fn)(self.query, self.key, self.value, self.bias, self.sinks)

    def _keywords(self) -> dict[str, Any]:
        return {k: v for k, v in self.options.items() if k != "dropout_rng"}

    def dropout_keep(self) -> np.ndarray | None:
        """The implementations' dropout mask as [B, H, Tq, Tk], for the reference."""
        if not self.options.get("dropout_prob") or self.options.get("deterministic", True):
            return None
        p = Attention().prepare(self.query, self.key, self.value, self.bias, self.options["dropout_rng"],
                                self.sinks, **self._keywords())
        keep = scores.dropout_keep(p, jnp.arange(self.query.shape[1]), jnp.arange(self.key.shape[1]))
        b, k, g, tq, tk = keep.shape
        return np.asarray(keep).reshape(b, k * g, tq, tk)

    def seen(self) -> np.ndarray:
        q_ids, kv_ids = self.segments if self.segments is not None else (None, None)
        window = self.options.get("sliding_window")
        return reference.visible_keys(
            self.query.shape[1], self.key.shape[1], causal=self.options.get("causal", False),
            sliding_window=window, q_segment_ids=q_ids, kv_segment_ids=kv_ids, mask=self.mask,
            num_heads=self.query.shape[2],
        )

    def reference_kwargs(self) -> dict[str, Any]:
        return dict(
            softmax_scale=self.options.get("softmax_scale"), logits_soft_cap=self.options.get("logits_soft_cap"),
            dropout_keep=self.dropout_keep(), dropout_prob=self.options.get("dropout_prob", 0.0),
        )

    def reference(self) -> np.ndarray:
        """float64 NumPy output on the (possibly bf16-rounded) inputs."""
        return reference.attention_math(
            np, to64(self.query), to64(self.key), to64(self.value), to64(self.bias), to64(self.sinks),
            seen=self.seen(), **self.reference_kwargs(),
        )


def make_call(
    *, batch: int = 2, q_len: int = 19, kv_len: int = 27, heads: int = 4, kv_heads: int = 2, head_dim: int = 16,
    v_dim: int = 8, dtype: Any = jnp.float32, seed: int = 0, bias_heads: int | None = None,
    bias_batch: int | None = None, sinks: tuple[int, ...] | None = None, segments: bool = False,
    mask_heads: int | None = None, **options: Any,
) -> Call:
    """Random inputs; bias_heads / mask_heads / sinks choose those optional inputs' shapes."""
    call = Call(
        normal(seed, (batch, q_len, heads, head_dim), dtype),
        normal(seed + 1, (batch, kv_len, kv_heads, head_dim), dtype),
        normal(seed + 2, (batch, kv_len, kv_heads, v_dim), dtype),
        options=dict(options),
    )
    if bias_heads is not None:
        call.bias = normal(seed + 3, (bias_batch or batch, bias_heads, q_len, kv_len), dtype)
    if sinks is not None:
        call.sinks = normal(seed + 4, sinks, dtype)
    rng = np.random.default_rng(seed)
    if segments:
        # Two segments and some padding (-1) in each sequence: some queries see nothing.
        q_ids = np.sort(rng.integers(-1, 2, (batch, q_len)), axis=1).astype(np.int32)
        kv_ids = np.sort(rng.integers(-1, 2, (batch, kv_len)), axis=1).astype(np.int32)
        call.segments = (q_ids, kv_ids)
        call.options["mask_info"] = MaskInfo.from_segments(jnp.asarray(q_ids), jnp.asarray(kv_ids))
    if mask_heads is not None:
        call.mask = rng.random((batch, mask_heads, q_len, kv_len)) < 0.7
        call.mask[:, :, 0, :] = False  # a fully hidden row
        call.options["mask_info"] = MaskInfo.from_attention_mask(jnp.asarray(call.mask))
    return call


DIFFERENTIABLE = ("query", "key", "value", "bias", "sinks")


def differentiable_arrays(call: Call) -> dict:
    """The call's differentiable arrays that are present, by name."""
    return {name: getattr(call, name) for name in DIFFERENTIABLE if getattr(call, name) is not None}


def reference_grads(call: Call, cotangent: jax.Array) -> dict:
    """jax.grad (jitted) of sum(reference output * cotangent) in float64, by array name."""
    with jax.enable_x64(True):
        seen, kwargs = call.seen(), call.reference_kwargs()

        def loss(arrays):
            out = reference.attention_math(
                jnp, arrays["query"], arrays["key"], arrays["value"], arrays.get("bias"), arrays.get("sinks"),
                seen=seen, **kwargs)
            return jnp.sum(out * jnp.asarray(cotangent, jnp.float64))

        arrays = {name: jnp.asarray(to64(a)) for name, a in differentiable_arrays(call).items()}
        return {name: np.asarray(g) for name, g in jax.jit(jax.grad(loss))(arrays).items()}
