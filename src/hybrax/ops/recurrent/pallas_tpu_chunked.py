"""`recurrent_attention`'s "pallas_tpu:chunked": gated linear attention through the KDA TPU forward kernel
without the delta rule (`chunk_fwd.kda_forward(delta_rule=False)`: no triangular solve), key and value repeated
up to the query heads, the key-axis log decay (per head or per key channel) as the gate.

Opt-in (`platform="pallas_tpu"`; `auto` never takes it) until it is timed on a TPU. Gradients: XLA chunked's
(`gradient_of`). Declined: a value gate (gv), reverse, packed sequences, K or V above 128, dtypes other than
bf16 and fp32, chunks other than 16, 32, 64 and 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, lookup, register
from hybrax.ops.kda.base import CHUNK_SIZES
from hybrax.ops.kda.pallas_tpu.chunk_fwd import MAX_HEAD_DIM, kda_forward
from hybrax.ops.recurrent.base import OP_ID, RecurrentAttentionConfig, RecurrentProblem
from hybrax.ops.recurrent.engine import expand_heads, key_log_decay


def _supports(inv: Invocation, cfg: RecurrentAttentionConfig | None = None) -> str | None:
    arrays, static = inv.arrays, inv.static
    if cfg is not None and cfg.chunk_size not in CHUNK_SIZES:  # the TPU kernel's chunks, as KDA's
        return f"needs chunk_size in {CHUNK_SIZES}, got {cfg.chunk_size}"
    if arrays["g_value"] is not None:
        return "takes no value gate (gv)"
    if static["reverse"]:
        return "runs forward in time only (reverse=False)"
    if arrays["cu_seqlens"] is not None:
        return "packed sequences (cu_seqlens) are not covered yet"
    if arrays["query"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"needs bf16 or fp32 inputs, got {arrays['query'].dtype}"
    dk, dv = arrays["query"].shape[3], arrays["value"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    return None


def _xla_chunked(problem: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[jax.Array, jax.Array]:
    """XLA's chunked implementation: what the gradient differentiates."""
    return lookup(OP_ID, "xla", "chunked")(problem, cfg)


@register(OP_ID, "pallas_tpu", "chunked", priority=3, devices=(), supports=_supports,
          heuristic_cfg=lambda inv: RecurrentAttentionConfig(chunk_size=64), gradient_of=_xla_chunked)
def pallas_tpu_chunked(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[jax.Array, jax.Array]:
    batch, length, heads, _ = p.query.shape
    log_decay = key_log_decay(p, jnp.float32)
    if log_decay is None:
        log_decay = jnp.zeros((batch, length, heads, 1), jnp.float32)
    return kda_forward(
        p.query, expand_heads(p.key, heads), expand_heads(p.value, heads), log_decay,
        jnp.zeros((batch, length, heads), jnp.float32), p.initial_state, scale=p.scale, l2_normalize=False,
        chunk=cfg.chunk_size, delta_rule=False,
    )
