"""recurrent_attention on the KDA Pallas kernels (Triton lowering), forward and backward.

Gated linear attention is KDA without the delta rule: S_t = diag(exp(log_k_t)) S_{t-1} + k_t^T v_t and
o_t = scale q_t S_t, where KDA adds beta_t k_t^T (v_t - S'^T k_t). With beta = 0, `chunk_intra` computes what
both share — the chunk-local cumulative decays, the decayed keys and queries and the intra-chunk scores A_qk —
and the state pass with the WY pair (w, u) = (0, v) turns KDA's v_new = u - w S into plain v. So each pass costs
about what KDA's does (the intra kernel also builds a WY form that beta = 0 makes the identity: the price of
sharing the kernels). The backward runs KDA's backward stages on the same substitution: with w = 0 every term
through the WY form vanishes, and the gradient of v is the state pass's dv_new, since v_new = v.

It takes gates along the key axis (g per head or per key channel, g_gamma, gk); a value gate gv, reverse and
packed sequences (cu_seqlens) stay with XLA. Grouped heads are repeated up to the query heads (their gradients
summed back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.core import Invocation, cotangent, register
from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum
from hybrax.ops.kda.pallas_chunk_fwd import MAX_HEAD_DIM, Padded, normalize_qk, pad_inputs, pad_to
from hybrax.ops.kda.pallas_chunk_grad import chunk_grad
from hybrax.ops.kda.pallas_chunk_intra import chunk_intra
from hybrax.ops.kda.pallas_chunk_intra_bwd import chunk_intra_bwd
from hybrax.ops.kda.pallas_chunk_state import chunk_state, chunk_state_output
from hybrax.ops.kda.pallas_chunk_state_bwd import chunk_state_bwd
from hybrax.ops.pallas_shared import interpret_here
from hybrax.ops.recurrent.api import OP_ID, RecurrentAttentionConfig, RecurrentProblem
from hybrax.ops.recurrent.engine import expand_heads, key_log_decay, reduce_heads


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


def _kda_inputs(p: RecurrentProblem, chunk: int) -> Padded:
    """The problem as KDA's padded inputs: key and value repeated up to the query heads, the key-axis log decay
    [B, T, H, K] as the gate, beta = 0."""
    batch, length, heads, dk = p.query.shape
    log_decay = key_log_decay(p, jnp.float32)
    log_decay = jnp.zeros((batch, length, heads, dk), jnp.float32) if log_decay is None else jnp.broadcast_to(
        log_decay, (batch, length, heads, dk))
    key, value = (expand_heads(x, heads) for x in (p.key, p.value))
    return pad_inputs(p.query, key, value, log_decay, jnp.zeros((batch, length, heads), jnp.float32),
                      p.initial_state, chunk)


def _forward(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[jax.Array, jax.Array]:
    """(output in the query's dtype, final state fp32 [B, H, K, V])."""
    length, dk, dv, chunk = p.query.shape[1], p.query.shape[3], p.value.shape[3], cfg.chunk_size
    x, interpret = _kda_inputs(p, chunk), interpret_here()
    gates = chunk_local_cumsum(x.g, None, chunk=chunk, interpret=interpret)
    (_, aqk), (w, _, kg, qg, decay) = chunk_intra(x.q, x.k, x.v, gates, x.beta, None, scale=p.scale, chunk=chunk,
                                                  with_inverse=False, interpret=interpret)
    o, final_state = chunk_state_output(jnp.zeros_like(w), x.v, kg, decay, qg, aqk, x.initial_state, None,
                                        chunk=chunk, interpret=interpret)
    return o[:, :length, :, :dv].astype(p.query.dtype), final_state[:, :, :dk, :dv]


def _fwd(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[tuple[jax.Array, jax.Array], RecurrentProblem]:
    return _forward(p, cfg), p


def _bwd(cfg: RecurrentAttentionConfig, p: RecurrentProblem, ct: tuple[jax.Array, jax.Array]) -> RecurrentProblem:
    """KDA's backward stages (`pallas_chunk_bwd.kda_chunk_bwd`) with beta = 0 and v_new = v: the forward's
    stages recomputed, the state pass in reverse, the chunk-local and intra-chunk gradients, dG's suffix sums."""
    d_out, d_final = ct
    length, kv_heads, dk, dv, chunk = p.query.shape[1], p.key.shape[2], p.query.shape[3], p.value.shape[3], \
        cfg.chunk_size
    x, interpret = _kda_inputs(p, chunk), interpret_here()
    normalized, normalize_vjp = jax.vjp(lambda q, k: normalize_qk(q, k, p.scale, False), x.q, x.k)
    qn, kn = (y.astype(x.q.dtype) for y in normalized)  # as the kernels read them
    gates = chunk_local_cumsum(x.g, None, chunk=chunk, interpret=interpret)
    (inverse, aqk), (w, _, kg, qg, decay) = chunk_intra(qn, kn, x.v, gates, x.beta, None, chunk=chunk,
                                                        interpret=interpret)
    w = jnp.zeros_like(w)
    h, v_new, _ = chunk_state(w, x.v, kg, decay, x.initial_state, None, chunk=chunk, interpret=interpret)
    d_out = pad_to(d_out.astype(x.v.dtype), {1: gates.shape[1], 3: x.v.shape[3]})
    d_final = pad_to(d_final.astype(jnp.float32), {2: x.k.shape[3], 3: x.v.shape[3]})
    dh, dv_new, d_initial = chunk_state_bwd(qg, kg, w, aqk, d_out, decay, d_final, None, chunk=chunk,
                                            interpret=interpret)
    dq, dk_, _, _, dg, daqk, dakk = chunk_grad(qn, kn, x.v, gates, x.beta, inverse, h, dh, v_new, dv_new, d_out,
                                                None, chunk=chunk, interpret=interpret)
    dq_intra, dk_intra, dg_intra, _ = chunk_intra_bwd(qn, kn, gates, x.beta, daqk, dakk, None, chunk=chunk,
                                                      interpret=interpret)
    dg = chunk_local_cumsum(dg + dg_intra, chunk=chunk, reverse=True, interpret=interpret)[:, :length, :, :dk]
    dq, dk_ = normalize_vjp((dq + dq_intra, dk_ + dk_intra))
    crop = lambda x, width: x[:, :length, :, :width]  # noqa: E731
    grads = dict(
        query=crop(dq, dk).astype(p.query.dtype),
        key=reduce_heads(crop(dk_, dk), kv_heads).astype(p.key.dtype),
        value=reduce_heads(crop(dv_new.astype(jnp.float32), dv), kv_heads).astype(p.value.dtype),
    )
    if p.g_key is not None:
        grads["g_key"] = dg.astype(p.g_key.dtype)
    if p.g_scalar is not None:
        grads["g_scalar"] = jnp.sum(dg, axis=-1).astype(p.g_scalar.dtype)
    if p.initial_state is not None:
        grads["initial_state"] = d_initial[:, :, :dk, :dv].astype(p.initial_state.dtype)
    return cotangent(p, **grads)


# devices=(): `auto` never picks it until a GPU has checked and timed it (platform="pallas" runs it anywhere).
@register(OP_ID, "pallas", "chunked", priority=3, devices=(), supports=_supports,
          heuristic_cfg=lambda inv: RecurrentAttentionConfig(chunk_size=64), fwd=_fwd, bwd=_bwd)
def pallas_chunked(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[Float[Array, "B T H V"], jax.Array]:
    return _forward(p, cfg)
