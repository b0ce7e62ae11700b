"""The recurrent backend: one `lax.scan` step per token, carrying only the [B,H,K,V] state.

Packed sequences reset the carried state to their initial state at their first token and write it
into their slot of the final states at every token (the last write wins), so nothing per step is kept.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrax.core import register, vary_like
from hybrax.core.packing import first_token_mask, token_sequence
from hybrax.ops.recurrent.base import OP_ID, RecurrentAttentionConfig
from hybrax.ops.recurrent.engine import decay_state, forward, vjp_rules


def _step(state, q, k, v, decay_k, decay_v):
    """One token for every batch row and head: state [..., K, V], the rest [..., K] or [..., V]."""
    state = decay_state(state, decay_k, decay_v) + k[..., :, None] * v[..., None, :]
    return state, jnp.einsum("...k,...kv->...v", q, state)


def scan_recurrence(q, k, v, log_k, log_v, h0, cu_seqlens, cfg: RecurrentAttentionConfig):
    """The engine contract of `engine.py`: (o [B,T,H,V], final state)."""
    batch, seq_len, num_heads, key_dim = q.shape
    value_dim = v.shape[-1]
    exp = lambda x: None if x is None else jnp.exp(x)  # noqa: E731
    time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)  # noqa: E731
    xs = tuple(map(time_major, (q, k, v, exp(log_k), exp(log_v))))
    if cu_seqlens is None:
        state = vary_like(jnp.zeros((batch, num_heads, key_dim, value_dim), q.dtype), xs) if h0 is None else h0

        def step(state, x):
            return _step(state, *x)

        final, o = jax.lax.scan(step, state, xs)
        return jnp.moveaxis(o, 0, 1), final

    num_seqs = cu_seqlens.shape[0] - 1
    initial = vary_like(jnp.zeros((num_seqs, num_heads, key_dim, value_dim), q.dtype), xs) if h0 is None else h0
    segment, starts = token_sequence(cu_seqlens, seq_len), first_token_mask(cu_seqlens, seq_len)

    def varlen_step(carry, x):
        state, finals = carry
        seg, start, token = x
        state = jnp.where(start, initial[seg], state)
        state, o = _step(state, *(None if a is None else a[0] for a in token))
        return (state, finals.at[seg].set(state)), o

    carry = (initial[0], initial)
    (_, finals), o = jax.lax.scan(varlen_step, carry, (segment, starts, xs))
    return o[None], finals


_fwd, _bwd = vjp_rules(scan_recurrence)


@register(OP_ID, "xla", "scan", heuristic_cfg=lambda inv: RecurrentAttentionConfig(),
          fwd=_fwd, bwd=_bwd)
def scan(problem, cfg: RecurrentAttentionConfig):
    return forward(scan_recurrence, problem, cfg)
