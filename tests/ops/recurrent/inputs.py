"""Shared inputs of the recurrent attention tests: the implementations under test and one random call."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from hybrax import RecurrentAttentionConfig, recurrent_attention
from hybrax.ops.recurrent.reference import recurrent_reference

# A chunk of 16 makes the small test lengths span several chunks with a ragged last one.
IMPLS = {
    "scan": RecurrentAttentionConfig("xla", "scan"),
    "chunked": RecurrentAttentionConfig("xla", "chunked", chunk_size=16),
}
# The Pallas forward (KDA's kernels, interpret mode off the GPU): no gv, reverse or cu_seqlens.
PALLAS = RecurrentAttentionConfig("pallas", "chunked", chunk_size=16)
ARG_NAMES = ("query", "key", "value", "g", "g_gamma", "gk", "gv", "initial_state", "cu_seqlens")


@dataclasses.dataclass
class Call:
    arrays: dict[str, Any]  # by ARG_NAMES; absent means None
    reverse: bool = False

    def args(self) -> list[Any]:
        return [self.arrays.get(name) for name in ARG_NAMES]

    def run(self, cfg: RecurrentAttentionConfig, **options: Any) -> tuple[jax.Array, jax.Array]:
        """Jitted: one compilation instead of many eager dispatches keeps the tests fast."""
        run = functools.partial(recurrent_attention, reverse=self.reverse, return_state=True, cfg=cfg, **options)
        return jax.jit(run)(*self.args())

    def reference(self) -> tuple[np.ndarray, np.ndarray]:
        return recurrent_reference(*self.args(), reverse=self.reverse)


def normal(seed: int, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
    """NumPy draws: eager jax.random would compile a program per shape, seconds per test on 2 cores."""
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


def log_decay(seed: int, shape: tuple[int, ...], strong_fraction: float = 0.0) -> jax.Array:
    """Log gates in (-inf, 0) around -0.13; a fraction of them -1000 (a decay of exactly zero in fp32)."""
    rng = np.random.default_rng(seed)
    gate = -np.logaddexp(0.0, -(rng.standard_normal(shape) + 2.0))  # log_sigmoid
    gate = np.where(rng.random(shape) < strong_fraction, -1000.0, gate)
    return jnp.asarray(gate, jnp.float32)


def make_call(
    seed: int = 0,
    *,
    batch: int = 2,
    seq_len: int = 37,
    heads: int = 4,
    kv_heads: int = 2,
    key_dim: int = 8,
    value_dim: int = 6,
    gates: tuple[str, ...] = ("g", "g_gamma", "gk", "gv"),
    g_per_key: bool = False,
    g_gamma_batched: bool = False,
    initial_state: bool = True,
    cu_seqlens: list[int] | None = None,
    dtype: Any = jnp.float32,
    reverse: bool = False,
    strong_fraction: float = 0.0,
) -> Call:
    if cu_seqlens is not None:
        batch, seq_len = 1, cu_seqlens[-1]
    arrays: dict[str, Any] = {
        "query": normal(seed, (batch, seq_len, heads, key_dim), dtype),
        "key": normal(seed + 1, (batch, seq_len, kv_heads, key_dim), dtype),
        "value": normal(seed + 2, (batch, seq_len, kv_heads, value_dim), dtype),
    }
    shapes = {
        "g": (batch, seq_len, heads) + ((key_dim,) if g_per_key else ()),
        "g_gamma": (batch, heads) if g_gamma_batched else (heads,),
        "gk": (batch, seq_len, heads, key_dim),
        "gv": (batch, seq_len, heads, value_dim),
    }
    for index, name in enumerate(gates):
        arrays[name] = log_decay(seed + 10 + index, shapes[name], strong_fraction)
    if initial_state:
        num_states = batch if cu_seqlens is None else len(cu_seqlens) - 1
        arrays["initial_state"] = normal(seed + 20, (num_states, heads, key_dim, value_dim))
    if cu_seqlens is not None:
        arrays["cu_seqlens"] = jnp.asarray(cu_seqlens, jnp.int32)
    return Call(arrays, reverse)
