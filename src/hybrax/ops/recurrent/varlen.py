"""Packed variable-length sequences (`cu_seqlens`, batch 1): where each token's sequence starts and ends.

Everything here works on traced `cu_seqlens` (under jit), using only its static length N + 1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Int


def token_segments(cu_seqlens: Int[Array, "n1"], seq_len: int) -> tuple[Int[Array, "t"], Bool[Array, "t"]]:
    """(sequence index of each token, whether the token starts its sequence); empty sequences own no token."""
    positions = jnp.arange(seq_len, dtype=cu_seqlens.dtype)
    segment = jnp.searchsorted(cu_seqlens, positions, side="right") - 1
    return segment, positions == cu_seqlens[segment]


def is_last_token(cu_seqlens: Int[Array, "n1"], seq_len: int) -> Bool[Array, "t"]:
    """Whether each token ends its sequence."""
    _, starts = token_segments(cu_seqlens, seq_len)
    return jnp.concatenate([starts[1:], jnp.ones((1,), bool)])


def reversed_cu_seqlens(cu_seqlens: Int[Array, "n1"], seq_len: int) -> Int[Array, "n1"]:
    """Offsets of the packed batch read backwards in time: sequence n becomes sequence N-1-n."""
    return seq_len - cu_seqlens[::-1]


def segmented_suffix_sum(values: jax.Array, is_last: Bool[Array, "t"]) -> jax.Array:
    """sum_{s >= t, s in t's sequence} values[:, s] along axis 1 (a segmented scan, no cancellation)."""

    def combine(earlier, later):
        later_value, later_reset = later
        return jnp.where(later_reset, later_value, earlier[0] + later_value), earlier[1] | later_reset

    reset = jnp.broadcast_to(is_last.reshape((1, -1) + (1,) * (values.ndim - 2)), values.shape)
    flipped = (jnp.flip(values, 1), jnp.flip(reset, 1))
    total, _ = jax.lax.associative_scan(combine, flipped, axis=1)
    return jnp.flip(total, 1)
