"""KDA decode with the delta rule's rank-1 update deferred one step (Pallas, Triton lowering).

The plain step (`pallas_decode.py`) must finish both reductions over K before it may store its state tile:
S_new = D S + k u^T with u = beta (v - (D S)^T k). Here the pool keeps each row as a base and the update it
still owes, state = base + key update^T, and a step

    stores   base' = D (base + key update^T)                    at once, before any reduction,
    reduces  (D S)^T x = base^T (D x) + (key . D x) update      for x = k and q (the loaded base, not base'),
    owes     key' = k, update' = beta (v - (D S)^T k),          o = (D S)^T q + (k . q) update'.

The state read and written once per step either way; what changes is that no store waits on the reductions
(the memory traffic of the next tiles overlaps the reductions of this one). `materialize` turns (base, key,
update) back into states; a pool starts with nothing owed (zeros). One token per request, K-first state.

The pending keys are written per request ([B, HV, K], program 0 of each head) and scattered to the slots after
the kernel: every program of a head reads its row's key, so none may overwrite it in place. The updates
[S, HV, V] are written in place, each program its own value block.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from hybrax.ops.kda.pallas_decode import (
    GATES, fused_log_decay, gate_params, load_token, normalized_with_dot, tile_reason,
)
from hybrax.ops.pallas_shared import pallas_call


class Owed(NamedTuple):
    """The rank-1 updates a deferred pool owes its rows: row s's state is base[s] + key[s] update[s]^T."""

    key: Float[Array, "S HV K"]
    update: Float[Array, "S HV V"]


def nothing_owed(base: Float[Array, "S HV K V"]) -> Owed:
    """A deferred pool's start: the base holds the states, nothing owed."""
    num_slots, heads, dk, dv = base.shape
    return Owed(jnp.zeros((num_slots, heads, dk), jnp.float32), jnp.zeros((num_slots, heads, dv), jnp.float32))


def materialize(base: Float[Array, "S HV K V"], owed: Owed) -> Float[Array, "S HV K V"]:
    """The states of a deferred pool: base + key update^T, row by row."""
    return base + owed.key[..., :, None] * owed.update[..., None, :]


def _deferred_kernel(
    scalars_ref, slots_ref, q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, owed_key_ref,
    owed_update_in_ref, base_in_ref, o_ref, key_ref, owed_update_ref, base_ref, *, gate: str,
    beta_is_logits: bool, use_qk_l2norm: bool, block_v: int, group: int,
):
    del owed_update_in_ref, base_in_ref  # aliased to owed_update_ref and base_ref: read and written through them
    j, head, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    cols = pl.ds(j * block_v, block_v)
    scale, lower_bound = scalars_ref[0], scalars_ref[1]
    slot = b if slots_ref is None else slots_ref[b]

    def advance():
        tile = base_ref.at[slot, head, :, cols]
        base, owed_key, owed_update = tile[...], owed_key_ref[slot, head, :], owed_update_ref[slot, head, cols]
        q, k, v, raw_gate, beta = load_token(q_ref, k_ref, v_ref, g_ref, beta_ref, b, 0, head, group, cols)
        a_log, dt_bias = gate_params(a_log_ref, dt_bias_ref, head)
        decay = jnp.exp(fused_log_decay(raw_gate, a_log, dt_bias, lower_bound, gate))
        tile[...] = (base + owed_key[:, None] * owed_update[None, :]) * decay[:, None]  # first: waits on nothing
        q, k, k_dot_q = normalized_with_dot(q, k, scale, use_qk_l2norm)
        beta = jax.nn.sigmoid(beta) if beta_is_logits else beta
        decayed_k, decayed_q = decay * k, decay * q
        # (D S)^T x from the loaded base and the owed update. Sums kept [1] (Triton's scalars, as in
        # normalized_with_dot).
        owed_k = jnp.sum(owed_key * decayed_k, keepdims=True)
        owed_q = jnp.sum(owed_key * decayed_q, keepdims=True)
        state_k = jnp.sum(base * decayed_k[:, None], axis=0) + owed_k * owed_update
        state_q = jnp.sum(base * decayed_q[:, None], axis=0) + owed_q * owed_update
        update = beta * (v - state_k)
        o_ref[b, 0, head, cols] = (state_q + k_dot_q * update).astype(o_ref.dtype)
        owed_update_ref[slot, head, cols] = update

        @pl.when(j == 0)
        def _():
            key_ref[b, head, :] = k

    if slots_ref is None:
        advance()
        return
    pl.when(slot >= 0)(advance)

    @pl.when(slot < 0)
    def _():
        o_ref[b, 0, head, cols] = jnp.zeros((block_v,), o_ref.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("gate", "beta_is_logits", "use_qk_l2norm", "block_v", "num_warps", "interpret"),
)
def fused_recurrent_decode_deferred(
    q: Float[Array, "B 1 H K"],
    k: Float[Array, "B 1 H K"],
    v: Float[Array, "B 1 HV V"],
    g: Float[Array, "B 1 HV Kg"],
    beta: Float[Array, "B 1 HV"],
    base: Float[Array, "S HV K V"],
    owed: Owed,
    slots: Int[Array, " B"] | None = None,
    a_log: Float[Array, " HV"] | None = None,
    dt_bias: Float[Array, "HV K"] | None = None,
    *,
    scale: Any,
    lower_bound: Any = None,
    gate: str = "activated",
    beta_is_logits: bool = False,
    use_qk_l2norm: bool = True,
    block_v: int = 32,
    num_warps: int = 4,
    interpret: bool = False,
) -> tuple[Float[Array, "B 1 HV V"], Float[Array, "S HV K V"], Owed]:
    """One token for each of B requests from a deferred pool (module doc); returns (o in q's dtype, the new
    base, what it owes). Arguments as `pallas_decode.fused_recurrent_decode`'s; `slots` -1 marks a padded
    request (reads and writes nothing, outputs zeros). Donate base and owed to update them in place."""
    if gate not in GATES:
        raise ValueError(f"gate must be one of {GATES}, got {gate!r}")
    batch, tokens, value_heads, dv = v.shape
    if tokens != 1:
        raise ValueError(f"the deferred decode step takes one token per request, got v of shape {list(v.shape)}")
    reason = tile_reason(q.shape[-1], dv)
    if reason:
        raise ValueError(f"fused_recurrent_decode_deferred {reason}")
    num_slots, _, dk, _ = base.shape
    if owed.key.shape != (num_slots, value_heads, dk) or owed.update.shape != (num_slots, value_heads, dv):
        raise ValueError(f"owed must hold key [{num_slots}, {value_heads}, {dk}] and update [{num_slots}, "
                         f"{value_heads}, {dv}], got {list(owed.key.shape)} and {list(owed.update.shape)}")
    block_v = min(block_v, dv)
    scalars = jnp.stack([
        jnp.asarray(scale, jnp.float32).reshape(()),
        jnp.asarray(0.0 if lower_bound is None else lower_bound, jnp.float32).reshape(()),
    ])
    kernel = functools.partial(
        _deferred_kernel, gate=gate, beta_is_logits=beta_is_logits, use_qk_l2norm=use_qk_l2norm, block_v=block_v,
        group=value_heads // q.shape[2],
    )
    arrays = (scalars, slots, q, k, v, g, beta, a_log, dt_bias, owed.key, owed.update, base)
    base_index = len(jax.tree.leaves(arrays)) - 1  # aliases count array leaves; the None slots hold none
    o, keys, owed_update, base = pallas_call(
        kernel,
        grid=(dv // block_v, value_heads, batch),
        out_shape=(
            jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct((batch, value_heads, dk), jnp.float32),
            jax.ShapeDtypeStruct(owed.update.shape, jnp.float32), jax.ShapeDtypeStruct(base.shape, jnp.float32),
        ),
        input_output_aliases={base_index - 1: 2, base_index: 3},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_fused_recurrent_decode_deferred",
    )(*arrays)
    if slots is None:
        return o, base, Owed(keys, owed_update)
    rows = jnp.where(slots >= 0, slots, num_slots)  # padded requests land out of bounds: dropped
    return o, base, Owed(owed.key.at[rows].set(keys, mode="drop"), owed_update)
