"""`recurrent_attention`'s "pallas_tpu:chunked": gated linear attention through the KDA TPU kernels without the
delta rule (`chunk_fwd.kda_forward` and `chunk_bwd.kda_backward` with delta_rule=False: no triangular solve, w = 0,
v_new = v), key and value repeated up to the query heads, the key-axis log decay (per head or per key channel) as
the gate, packed sequences as KDA's (`layout`).

Opt-in (`platform="pallas_tpu"`; `auto` never takes it) until it is timed on a TPU. Gradients: the TPU backward
kernel, then back through the head repeats and the gates' sum. Declined: a value gate (gv), reverse, K or V above
128, dtypes other than bf16 and fp32, chunks other than 16, 32, 64 and 128, packed layouts of more than
`layout.MAX_CHUNKS` chunks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from hybrax.core import Invocation, register
from hybrax.ops.kda.base import CHUNK_SIZES
from hybrax.ops.kda.pallas_tpu.chunk_bwd import kda_backward
from hybrax.ops.kda.pallas_tpu.chunk_fwd import MAX_HEAD_DIM, kda_forward
from hybrax.ops.kda.pallas_tpu.layout import MAX_CHUNKS, packed_chunks
from hybrax.ops.recurrent.base import OP_ID, RecurrentAttentionConfig, RecurrentProblem
from hybrax.ops.recurrent.engine import expand_heads, key_log_decay


def _heuristic(inv: Invocation) -> RecurrentAttentionConfig:
    return RecurrentAttentionConfig(chunk_size=64)


def _supports(inv: Invocation, cfg: RecurrentAttentionConfig | None = None) -> str | None:
    arrays, static = inv.arrays, inv.static
    if cfg is not None and cfg.chunk_size not in CHUNK_SIZES:  # the TPU kernel's chunks, as KDA's
        return f"needs chunk_size in {CHUNK_SIZES}, got {cfg.chunk_size}"
    if arrays["g_value"] is not None:
        return "takes no value gate (gv)"
    if static["reverse"]:
        return "runs forward in time only (reverse=False)"
    if arrays["cu_seqlens"] is not None:
        length, sequences = arrays["query"].shape[1], arrays["cu_seqlens"].shape[0] - 1
        chunks = packed_chunks(length, sequences, (cfg or _heuristic(inv)).chunk_size)
        if chunks > MAX_CHUNKS:
            return f"packs {sequences} sequences over {length} tokens in {chunks} chunks, more than {MAX_CHUNKS}"
    if arrays["query"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"needs bf16 or fp32 inputs, got {arrays['query'].dtype}"
    dk, dv = arrays["query"].shape[3], arrays["value"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    return None


def _kernel_inputs(p: RecurrentProblem) -> tuple:
    """(q, k, v, log decay, initial state) as the kernels take them: key and value repeated up to the query heads,
    the key-axis log decay (zeros [B, T, H, 1] without a gate)."""
    batch, length, heads, _ = p.query.shape
    log_decay = key_log_decay(p, jnp.float32)
    if log_decay is None:
        log_decay = jnp.zeros((batch, length, heads, 1), jnp.float32)
    return p.query, expand_heads(p.key, heads), expand_heads(p.value, heads), log_decay, p.initial_state


def _options(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> dict:
    return dict(scale=p.scale, cu_seqlens=p.cu_seqlens, l2_normalize=False, chunk=cfg.chunk_size, delta_rule=False)


def _no_beta(q: jax.Array) -> jax.Array:
    return jnp.zeros(q.shape[:3], jnp.float32)


def _forward(p: RecurrentProblem, cfg: RecurrentAttentionConfig, with_states: bool) -> tuple:
    q, k, v, log_decay, h0 = _kernel_inputs(p)
    return kda_forward(q, k, v, log_decay, _no_beta(q), h0, with_states=with_states, **_options(p, cfg))


def _forward_with_residuals(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple:
    o, final, entering = _forward(p, cfg, with_states=True)
    return (o, final), (p, entering)


def _backward(cfg: RecurrentAttentionConfig, residuals: tuple[RecurrentProblem, jax.Array], ct: tuple
              ) -> RecurrentProblem:
    """The problem's cotangent: the kernel's gradients, through the head repeats and the gates' sum (`jax.vjp`)."""
    p, entering = residuals
    (q, k, v, log_decay, h0), pullback = jax.vjp(_kernel_inputs, p)
    d_out, d_final = ct
    dq, dk, dv, dg, _, d_initial = kda_backward(
        q, k, v, log_decay, _no_beta(q), entering, d_out, d_final, **_options(p, cfg)
    )
    d_initial = None if h0 is None else d_initial.astype(h0.dtype)
    return pullback((dq, dk, dv, dg, d_initial))[0]


@register(OP_ID, "pallas_tpu", "chunked", supports=_supports,
          heuristic_cfg=_heuristic, fwd=_forward_with_residuals, bwd=_backward)
def pallas_tpu_chunked(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[jax.Array, jax.Array]:
    return _forward(p, cfg, with_states=False)
