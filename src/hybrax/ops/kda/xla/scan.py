"""KDA on XLA, token by token: the recurrent scan (O(1) state memory in the forward) and the direct
single step for T == 1 (decode with a state, no padding to a chunk; its math is `common/delta.py`'s, shared with
the decode kernels' gradient).

Gradients come from autodiff through the scan (which keeps each step's state for the backward);
the chunked implementation is the one for training.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.core import Invocation, register
from hybrax.core.packing import first_token_mask, last_token_mask, token_sequence
from hybrax.ops.kda.base import OP_ID, KdaProblem, KernelDeltaAttentionConfig
from hybrax.ops.kda.common.delta import delta_step, single_step, value_head_qk


def _time_major(*arrays: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jnp.moveaxis(x, 1, 0) for x in arrays)


def _dense_scan(problem: KdaProblem) -> tuple[jax.Array, jax.Array]:
    """B independent sequences of T tokens: scan over time, batch and heads vectorized."""
    q, k = value_head_qk(problem)
    xs = _time_major(q, k, problem.v.astype(jnp.float32), problem.beta, problem.decay)

    def body(state, token):
        o, state = delta_step(state, *token, problem.scale)
        return state, o

    final, o = lax.scan(body, problem.initial_states(), xs)
    return jnp.moveaxis(o, 0, 1), final


def _packed_scan(problem: KdaProblem) -> tuple[jax.Array, jax.Array]:
    """Packed sequences (batch of one): the state restarts from sequence n's initial state at its
    first token and is stored as its final state at its last; empty sequences keep their initial state."""
    length = problem.q.shape[1]
    cu = problem.cu_seqlens
    sequence = token_sequence(cu, length)  # N past the end
    inside = sequence < problem.num_sequences
    sequence = jnp.minimum(sequence, problem.num_sequences - 1)
    first, last = first_token_mask(cu, length), last_token_mask(cu, length)
    q, k = value_head_qk(problem)
    tokens = tuple(x[0] for x in (q, k, problem.v.astype(jnp.float32), problem.beta, problem.decay))
    initial = problem.initial_states()

    def body(carry, token):
        state, finals = carry
        index, is_first, is_last, *inputs = token
        state = jnp.where(is_first, initial[index], state)
        o, state = delta_step(state, *inputs, problem.scale)
        finals = finals.at[index].set(jnp.where(is_last, state, finals[index]))
        return (state, finals), o

    (_, finals), o = lax.scan(body, (initial[0], initial), (sequence, first, last, *tokens))
    return jnp.where(inside[:, None, None], o, 0.0)[None], finals


@register(OP_ID, "xla", "scan", heuristic_cfg=lambda inv: KernelDeltaAttentionConfig())
def kda_scan(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    o, final = _dense_scan(problem) if problem.cu_seqlens is None else _packed_scan(problem)
    return o.astype(problem.q.dtype), final


def _supports_single_step(inv: Invocation) -> str | None:
    if inv.arrays["q"].shape[1] != 1:
        return "needs seq_len == 1"
    if inv.arrays["cu_seqlens"] is not None:
        return "needs no cu_seqlens"
    return None


register(OP_ID, "xla", "single_step", heuristic_cfg=lambda inv: KernelDeltaAttentionConfig(),
         supports=_supports_single_step)(single_step)
