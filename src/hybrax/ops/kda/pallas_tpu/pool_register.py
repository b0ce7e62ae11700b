"""`kda_decode_pool`'s "pallas_tpu:fused_recurrent" implementation: the TPU decode kernel (`decode`) on the
serving pool, updated in place; the gate and beta activated by XLA first (a fusion over 1/V of the state's
bytes). Declined (`auto` then takes XLA's gather/scatter): token_slots (a state per token), the V-first
pool, K or V above 128. Gradients: XLA's implementation's. Opt-in (platform="pallas_tpu") until it has run and
been timed on a TPU.
"""

from __future__ import annotations

import jax

from hybrax.core import Invocation, lookup, register
from hybrax.ops.kda.gate import activate_beta, fused_gate
from hybrax.ops.kda.pallas_tpu.chunk_fwd import head_dims_reason
from hybrax.ops.kda.pallas_tpu.decode import fused_recurrent_decode
from hybrax.serving.kda_pool import OP_ID, KdaDecodePoolConfig, KdaPoolProblem


def _supports(inv: Invocation, cfg: KdaDecodePoolConfig | None = None) -> str | None:
    if inv.arrays["token_slots"] is not None:
        return "token_slots (a state per token) are not covered yet"
    if inv.static["state_v_first"]:
        return "the V-first pool is not covered yet"
    return head_dims_reason(inv.arrays["q"].shape, inv.arrays["v"].shape)


def _xla_pool_decode(problem: KdaPoolProblem, cfg: KdaDecodePoolConfig) -> tuple[jax.Array, jax.Array]:
    """The XLA implementation: what the gradient differentiates."""
    return lookup(OP_ID, "xla", "gather_scatter")(problem, cfg)


@register(OP_ID, "pallas_tpu", "fused_recurrent", supports=_supports,
          heuristic_cfg=lambda inv: KdaDecodePoolConfig(), gradient_of=_xla_pool_decode)
def pallas_tpu_pool_decode(problem: KdaPoolProblem, cfg: KdaDecodePoolConfig) -> tuple[jax.Array, jax.Array]:
    decay = problem.g
    if problem.gate != "activated":
        decay = fused_gate(decay, problem.a_log, problem.dt_bias, problem.lower_bound)
    return fused_recurrent_decode(
        problem.q, problem.k, problem.v, decay, activate_beta(problem.beta, problem.beta_is_logits), problem.pool,
        problem.slots, scale=problem.scale, use_qk_l2norm=problem.use_qk_l2norm,
    )
