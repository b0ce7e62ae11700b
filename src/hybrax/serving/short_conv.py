"""The short convolution of Kimi-style layers (causal, depthwise, width W = 4, then SiLU), served from a
conv-state pool indexed by the same slots as the KDA state pool.

    y_t = silu(bias + sum_w weight[:, w] * x_{t - (W - 1) + w})          per channel

A sequence's conv state is its last W - 1 inputs, [D, W - 1] oldest first (vLLM's
causal_conv1d layout: pool [num_slots, D, W - 1], weight [D, W]); inputs before a sequence's
first token come from its state row (zeros where has_initial_state is False). The pool is fp32,
like the KDA state pool (it holds fp32, bf16 and fp16 inputs exactly); x, weight and bias may
be any floating dtype, and the sums run in fp32. Slot -1 marks a padded row: it reads
nothing, writes nothing and outputs zeros; so does any slot outside [0, num_slots) under jit, where it cannot
be checked (eager calls refuse it). Valid slots must be distinct. XLA only: the convolution moves
B*D*W numbers per token against the KDA state's B*HV*K*V, so a fused kernel would save under 1%
of a decode step's traffic.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from hybrax.core.packing import token_sequence
from hybrax.core.validate import check_cu_seqlens, check_dtype, check_floating, check_rank, check_shape
from hybrax.serving.kda_pool import pool_rows
from hybrax.serving.prefill import check_slots, gather_rows

ACTIVATIONS = ("silu", None)


def _check_conv(x: Any, pool: Any, weight: Any, bias: Any, activation: Any) -> None:
    dim = jnp.shape(x)[-1]
    check_rank("weight", weight, 2, "[dim, width]")
    width = jnp.shape(weight)[1]
    check_shape("weight", weight, (dim, width), "[dim, width] (dim of x)")
    check_shape("conv_pool", pool, (None, dim, width - 1), "[num_slots, dim, width - 1]")
    check_dtype("conv_pool", pool, jnp.float32, "the conv state, as the KDA state pool")
    check_floating("x", x)
    check_floating("weight", weight)
    if bias is not None:
        check_shape("bias", bias, (dim,), "[dim]")
        check_floating("bias", bias)
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")


def _activate(y: jax.Array, bias: Any, activation: str | None) -> jax.Array:
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return jax.nn.silu(y) if activation == "silu" else y


def _write_rows(pool: jax.Array, slots: jax.Array, rows: jax.Array) -> jax.Array:
    target = jnp.where(slots >= 0, slots, pool.shape[0])
    return pool.at[target].set(rows.astype(pool.dtype), mode="drop")


def short_conv_decode(
    x: Float[Array, "batch dim"],
    conv_pool: Float[Array, "num_slots dim width_minus_1"],
    weight: Float[Array, "dim width"],
    slots: Int[Array, " batch"],
    /,
    *,
    bias: Float[Array, " dim"] | None = None,
    activation: str | None = "silu",
) -> tuple[Float[Array, "batch dim"], Float[Array, "num_slots dim width_minus_1"]]:
    """One token for each of B requests: returns (y [B, D] in x's dtype, the updated pool). slots [B]: each
    request's row, -1 (or under jit any slot outside [0, num_slots)) for a padded one."""
    check_rank("x", x, 2, "[batch, dim]")
    _check_conv(x, conv_pool, weight, bias, activation)
    check_slots(slots, None, jnp.shape(x)[0], jnp.shape(conv_pool)[0])
    slots = pool_rows(slots, jnp.shape(conv_pool)[0])
    window = jnp.concatenate([gather_rows(conv_pool, slots, None).astype(jnp.float32),
                              x.astype(jnp.float32)[:, :, None]], axis=2)
    y = _activate(jnp.sum(window * weight.astype(jnp.float32), axis=2), bias, activation)
    y = jnp.where((slots >= 0)[:, None], y, 0.0).astype(x.dtype)
    return y, _write_rows(conv_pool, slots, window[:, :, 1:])


def _extended_lookup(x: jax.Array, history: jax.Array, starts: jax.Array, sequence: jax.Array,
                     offset: jax.Array) -> jax.Array:
    """Input `offset` tokens from the start of `sequence` (negative: from its history), [..., D]."""
    taps = history.shape[1]
    from_x = offset >= 0
    token = jnp.clip(starts[sequence] + offset, 0, x.shape[0] - 1)
    past = history[sequence, jnp.clip(taps + offset, 0, taps - 1)]
    return jnp.where(from_x[..., None], x[token], past)


def short_conv_prefill(
    x: Float[Array, "batch seq_len dim"],
    conv_pool: Float[Array, "num_slots dim width_minus_1"],
    weight: Float[Array, "dim width"],
    slots: Int[Array, " num_sequences"],
    /,
    *,
    bias: Float[Array, " dim"] | None = None,
    has_initial_state: Bool[Array, " num_sequences"] | None = None,
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None = None,
    activation: str | None = "silu",
) -> tuple[Float[Array, "batch seq_len dim"], Float[Array, "num_slots dim width_minus_1"]]:
    """B sequences of T tokens (or N packed ones in a batch of one with cu_seqlens): returns (y in
    x's dtype, the pool with each valid row holding its sequence's last W - 1 inputs). slots [N]: each sequence's
    row, -1 (or under jit any slot outside [0, num_slots)) for a padded one."""
    check_rank("x", x, 3, "[batch, seq_len, dim]")
    _check_conv(x, conv_pool, weight, bias, activation)
    batch, length, dim = jnp.shape(x)
    packed = cu_seqlens is not None
    if not packed:  # B dense sequences are B packed ones of T tokens each
        cu_seqlens = jnp.arange(batch + 1, dtype=jnp.int32) * length
    else:
        check_cu_seqlens(cu_seqlens, batch, length, "x")
    num_sequences = jnp.shape(cu_seqlens)[0] - 1
    check_slots(slots, has_initial_state, num_sequences, jnp.shape(conv_pool)[0], packed=packed)
    slots, cu_seqlens = pool_rows(slots, jnp.shape(conv_pool)[0]), jnp.asarray(cu_seqlens, jnp.int32)
    taps = jnp.shape(weight)[1] - 1
    tokens = x.reshape(batch * length, dim).astype(jnp.float32)
    history = jnp.swapaxes(gather_rows(conv_pool, slots, has_initial_state), 1, 2).astype(jnp.float32)  # [N, W-1, D]
    starts = cu_seqlens[:-1]

    sequence = token_sequence(cu_seqlens, batch * length)
    inside = sequence < num_sequences
    sequence = jnp.minimum(sequence, num_sequences - 1)
    position = jnp.arange(batch * length, dtype=jnp.int32) - starts[sequence]
    taps_back = jnp.arange(-taps, 1, dtype=jnp.int32)  # the window, oldest first
    window = _extended_lookup(tokens, history, starts, sequence[:, None], position[:, None] + taps_back)
    y = _activate(jnp.einsum("tkd,dk->td", window, weight.astype(jnp.float32)), bias, activation)
    valid = inside & (slots[sequence] >= 0)
    y = jnp.where(valid[:, None], y, 0.0).astype(x.dtype).reshape(batch, length, dim)

    lengths = cu_seqlens[1:] - starts
    last = _extended_lookup(tokens, history, starts, jnp.arange(num_sequences)[:, None],
                            lengths[:, None] + jnp.arange(-taps, 0, dtype=jnp.int32))  # [N, W-1, D]
    return y, _write_rows(conv_pool, slots, jnp.swapaxes(last, 1, 2))
