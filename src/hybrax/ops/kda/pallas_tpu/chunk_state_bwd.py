"""KDA's inter-chunk step in reverse for the TPU backward kernel, on values in VMEM: the cotangent dS' of the
state leaving a chunk (fp32 [K, V], carried in a VMEM scratch across the grid's chunk axis, walked from the
last chunk to the first) back through the chunk. The forward step (`chunk_state.state_step`), from the state S
entering the chunk:

    v_new = u - w S,   o = qg S + A_qk v_new,   S' = Diag(exp(G_C)) S + kg^T v_new

so, with dO the chunk's output cotangent,

    dv_new = A_qk^T dO + kg dS'                               the corrections' cotangent
    dS     = Diag(exp(G_C)) dS' + qg^T dO - w^T dv_new         the cotangent of S: the previous chunk's dS'

The last chunk starts from the final state's cotangent; the first one's dS is the initial state's. Nothing
here reads S itself: the per-chunk gradients (`chunk_grad`) take it from the states the forward stored.
"""

from __future__ import annotations

import jax

from hybrax.ops.kda.pallas_tpu.chunk_state import row_to_column
from hybrax.ops.kda.pallas_tpu.dots import Dot


def state_step_bwd(
    d_state: jax.Array, w: jax.Array | None, qg: jax.Array, aqk: jax.Array, kg: jax.Array, d_out: jax.Array,
    decay: jax.Array, dot: Dot,
) -> tuple[jax.Array, jax.Array]:
    """(dv_new [C, V], dS [K, V]) fp32 from dS' [K, V] (the cotangent of the state leaving the chunk) and the
    chunk's terms: w, qg, kg [C, K], A_qk [C, C] (masked), dO
    [C, V], decay [1, K] = exp(G_C). w None: no delta rule (gated linear attention, v_new = v: no w^T dv_new
    term). For bf16 inputs `dot` takes bf16 operands, as the forward's state step."""
    leaving = dot.operand(d_state)
    d_out = dot.operand(d_out)
    dv_new = dot(aqk, d_out, "tn") + dot(kg, leaving)
    d_entering = row_to_column(decay) * d_state + dot(qg, d_out, "tn")
    if w is not None:
        d_entering = d_entering - dot(w, dv_new, "tn")
    return dv_new, d_entering
