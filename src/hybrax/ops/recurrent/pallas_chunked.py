"""recurrent_attention's forward on the KDA Pallas kernels (Triton lowering); its backward is the XLA chunked one.

Gated linear attention is KDA without the delta rule: S_t = diag(exp(log_k_t)) S_{t-1} + k_t^T v_t and
o_t = scale q_t S_t, where KDA adds beta_t k_t^T (v_t - S'^T k_t). With beta = 0, `chunk_intra` computes what
both share — the chunk-local cumulative decays, the decayed keys and queries and the intra-chunk scores A_qk —
and the state pass with the WY pair (w, u) = (0, v) turns KDA's u - w S into plain v. So the forward costs about
what KDA's does (the intra kernel also builds a WY form that beta = 0 makes the identity: the price of sharing
the kernels). The backward is the XLA chunked implementation's, from the same residuals (the problem and the
final state).

It takes gates along the key axis (g per head or per key channel, g_gamma, gk); a value gate gv, reverse and
packed sequences (cu_seqlens) stay with XLA. Grouped heads are repeated up to the query heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.core import Invocation, register
from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum
from hybrax.ops.kda.pallas_chunk_fwd import MAX_HEAD_DIM, pad_inputs
from hybrax.ops.kda.pallas_chunk_intra import chunk_intra
from hybrax.ops.kda.pallas_chunk_state import chunk_state_output
from hybrax.ops.pallas_shared import interpret_here
from hybrax.ops.recurrent import xla_chunked
from hybrax.ops.recurrent.api import OP_ID, RecurrentAttentionConfig, RecurrentProblem
from hybrax.ops.recurrent.engine import expand_heads, key_log_decay


def _supports(inv: Invocation) -> str | None:
    arrays, static = inv.arrays, inv.static
    for name, what in (("g_value", "value gate (gv)"), ("cu_seqlens", "packed sequences (cu_seqlens)")):
        if arrays[name] is not None:
            return f"the Pallas forward takes no {what}"
    if static["reverse"]:
        return "the Pallas forward runs forward in time only (reverse=False)"
    if arrays["query"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"the Pallas forward needs bf16 or fp32 inputs, got {arrays['query'].dtype}"
    dk, dv = arrays["query"].shape[3], arrays["value"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"the Pallas forward needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    return None


def _forward(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[jax.Array, jax.Array]:
    """(output in the query's dtype, final state fp32 [B, H, K, V])."""
    batch, length, heads, dk = p.query.shape
    dv, chunk = p.value.shape[3], cfg.chunk_size
    log_decay = key_log_decay(p, jnp.float32)
    log_decay = jnp.zeros((batch, length, heads, dk), jnp.float32) if log_decay is None else jnp.broadcast_to(
        log_decay, (batch, length, heads, dk))
    key, value = (expand_heads(x, heads) for x in (p.key, p.value))
    x = pad_inputs(p.query, key, value, log_decay, jnp.zeros((batch, length, heads), jnp.float32),
                   p.initial_state, chunk)
    interpret = interpret_here()
    gates = chunk_local_cumsum(x.g, None, chunk=chunk, interpret=interpret)
    (_, aqk), (w, _, kg, qg, decay) = chunk_intra(x.q, x.k, x.v, gates, x.beta, None, scale=p.scale, chunk=chunk,
                                                  with_inverse=False, interpret=interpret)
    o, final_state = chunk_state_output(jnp.zeros_like(w), x.v, kg, decay, qg, aqk, x.initial_state, None,
                                        chunk=chunk, interpret=interpret)
    return o[:, :length, :, :dv].astype(p.query.dtype), final_state[:, :, :dk, :dv]


def _fwd(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[tuple[jax.Array, jax.Array], tuple]:
    out, final_state = _forward(p, cfg)
    return (out, final_state), (p, None, final_state)  # the residuals of `xla_chunked`'s backward (no gv)


# devices=(): `auto` never picks it until a GPU has checked and timed it (platform="pallas" runs it anywhere).
@register(OP_ID, "pallas", "chunked", priority=3, devices=(), supports=_supports,
          heuristic_cfg=lambda inv: RecurrentAttentionConfig(chunk_size=64), fwd=_fwd, bwd=xla_chunked.vjp_backward)
def pallas_chunked(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[Float[Array, "B T H V"], jax.Array]:
    return _forward(p, cfg)
