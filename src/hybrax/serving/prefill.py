"""`kda_prefill_pool`: prefill through the chunked KDA path, starting from and ending in the pool.

Prefill hands over to decode exactly: each sequence's starting state is gathered from its pool row
(zeros where `has_initial_state` is False: a fresh request in a recycled row), the prompt runs
through `kernel_delta_attention` (the chunked path for long prompts), and the final states are
scattered back to the same rows, where `kda_decode_pool` picks them up. Slot -1 marks a padded
sequence: it reads nothing, writes nothing and outputs zeros. So does any slot outside [0, num_slots) under
jit, where it cannot be checked (eager calls refuse it), here and in the short convolution and attention pools.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from hybrax.core.packing import token_sequence
from hybrax.core.validate import check_bool, check_cu_seqlens, check_integer, check_rank, check_rows, check_shape
from hybrax.ops.kda.api import kernel_delta_attention
from hybrax.serving.kda_pool import check_gate, check_pool, pool_rows, scatter_rows, swap_layout


def gather_rows(pool: jax.Array, slots: jax.Array, has_initial_state: jax.Array | None) -> jax.Array:
    """pool[slots], with zeros for slot -1 and where has_initial_state is False."""
    keep = slots >= 0
    if has_initial_state is not None:
        keep = keep & has_initial_state
    rows = pool[jnp.maximum(slots, 0)]
    return jnp.where(keep.reshape(-1, *([1] * (rows.ndim - 1))), rows, jnp.zeros((), rows.dtype))


def padded_token_mask(slots: jax.Array, batch: int, length: int, cu_seqlens: jax.Array | None) -> jax.Array:
    """[batch, length] True where a token belongs to a sequence with a valid slot."""
    if cu_seqlens is None:
        return jnp.broadcast_to((slots >= 0)[:, None], (batch, length))
    sequence = token_sequence(cu_seqlens, length)
    inside = sequence < slots.shape[0]
    return (inside & (slots[jnp.minimum(sequence, slots.shape[0] - 1)] >= 0))[None]


def check_slots(slots: Any, has_initial_state: Any, count: int, num_slots: int, packed: bool = False) -> None:
    """slots (and has_initial_state) [count]: one per request, or per cu_seqlens segment when `packed`; each slot
    -1 or a distinct row of a pool of num_slots (checked when concrete)."""
    what = "[num_sequences] (one per cu_seqlens segment)" if packed else "[batch]"
    check_shape("slots", slots, (count,), what)
    check_integer("slots", slots)
    check_rows("slots", slots, num_slots)
    if has_initial_state is not None:
        check_shape("has_initial_state", has_initial_state, (count,), what)
        check_bool("has_initial_state", has_initial_state)


def kda_prefill_pool(
    q: Float[Array, "batch seq_len num_heads head_dim"],
    k: Float[Array, "batch seq_len num_heads head_dim"],
    v: Float[Array, "batch seq_len num_value_heads v_head_dim"],
    g: Float[Array, "batch seq_len num_value_heads gate_dim"],
    beta: Float[Array, "batch seq_len num_value_heads"],
    pool: Float[Array, "num_slots num_value_heads d1 d2"],
    slots: Int[Array, " num_sequences"],
    /,
    *,
    has_initial_state: Bool[Array, " num_sequences"] | None = None,
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None = None,
    a_log: Float[Array, " num_value_heads"] | None = None,
    dt_bias: Float[Array, "num_value_heads head_dim"] | None = None,
    lower_bound: float | None = None,
    gate: str = "activated",
    softmax_scale: float | None = None,
    beta_is_logits: bool = False,
    use_qk_l2norm: bool = True,
    state_v_first: bool = False,
    platform: str | None = None,
) -> tuple[Float[Array, "batch seq_len num_value_heads v_head_dim"], Float[Array, "num_slots num_value_heads d1 d2"]]:
    """Prefill B sequences (or N packed ones with cu_seqlens, batch 1) from their pool rows; returns
    (output in q's dtype, the pool with each valid row holding its sequence's final state).

    Arguments as `kda_decode_pool` (same gate forms and fp32 pool layouts); slots and has_initial_state (bool)
    [N] name one distinct row per sequence (-1, or under jit any slot outside [0, num_slots): a padded sequence);
    has_initial_state None: every sequence continues its row.
    """
    check_rank("q", q, 4, "[batch, seq_len, num_heads, head_dim]")
    check_rank("v", v, 4, "[batch, seq_len, num_value_heads, v_head_dim]")
    batch, length, _, dk = jnp.shape(q)
    value_heads, dv = jnp.shape(v)[2:]
    check_pool(pool, value_heads, dk, dv, state_v_first)  # named as the pool, not as the gathered initial_state
    check_gate(gate, g, a_log, dt_bias, lower_bound, value_heads, dk)
    if cu_seqlens is not None:
        check_cu_seqlens(cu_seqlens, batch, length, "q")
    num_sequences = batch if cu_seqlens is None else jnp.shape(cu_seqlens)[0] - 1
    check_slots(slots, has_initial_state, num_sequences, jnp.shape(pool)[0], packed=cu_seqlens is not None)
    slots = pool_rows(slots, jnp.shape(pool)[0])
    initial = swap_layout(gather_rows(pool, slots, has_initial_state), state_v_first)
    decay = g[..., 0] if jnp.shape(g)[-1] == 1 else g  # kernel_delta_attention takes per-head decay as [B, T, HV]
    o, final = kernel_delta_attention(
        q, k, v, beta, decay, initial, softmax_scale=softmax_scale, use_qk_l2norm=use_qk_l2norm, return_state=True,
        cu_seqlens=cu_seqlens, a_log=a_log, dt_bias=dt_bias, lower_bound=lower_bound, beta_is_logits=beta_is_logits,
        platform=platform,
    )
    valid = padded_token_mask(slots, batch, length, cu_seqlens)
    o = jnp.where(valid[..., None, None], o, jnp.zeros((), o.dtype))
    return o, scatter_rows(pool, slots, final, state_v_first)
