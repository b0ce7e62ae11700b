"""recurrent_attention on the KDA Pallas kernels (Triton lowering), forward and backward.

Gated linear attention is KDA without the delta rule: S_t = diag(exp(log_k_t)) S_{t-1} + k_t^T v_t and
o_t = scale q_t S_t, where KDA adds beta_t k_t^T (v_t - S'^T k_t). With beta = 0, `chunk_intra` computes what
both share — the chunk-local cumulative decays, the decayed keys and queries and the intra-chunk scores A_qk —
and the state pass with the WY pair (w, u) = (0, v) turns KDA's v_new = u - w S into plain v. So each pass costs
about what KDA's does (the intra kernel also builds a WY form that beta = 0 makes the identity: the price of
sharing the kernels). The backward runs KDA's backward stages on the same substitution: with w = 0 every term
through the WY form vanishes, and the gradient of v is the state pass's dv_new, since v_new = v (`delta_rule`
in `ops/kda/pallas_gpu/chunk_*.py`).

It takes gates along the key axis (g per head or per key channel, g_gamma, gk) and packed sequences
(cu_seqlens, read in place as KDA's); a value gate gv and reverse stay with XLA. Grouped heads are repeated up to
the query heads (their gradients summed back).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.core import Invocation, register, vary_like
from hybrax.ops.kda.pallas_gpu.chunk_fwd import MAX_HEAD_DIM
from hybrax.ops.kda.pallas_gpu.chunk import chunk_reason, run_chunked
from hybrax.ops.recurrent.base import OP_ID, RecurrentAttentionConfig, RecurrentProblem
from hybrax.ops.recurrent.engine import expand_heads, key_log_decay


def _supports(inv: Invocation, cfg: RecurrentAttentionConfig | None = None) -> str | None:
    arrays, static = inv.arrays, inv.static
    if arrays["g_value"] is not None:
        return "the Pallas path takes no value gate (gv)"
    if static["reverse"]:
        return "the Pallas path runs forward in time only (reverse=False)"
    if arrays["query"].dtype not in (jnp.bfloat16, jnp.float32):
        return f"the Pallas path needs bf16 or fp32 inputs, got {arrays['query'].dtype}"
    dk, dv = arrays["query"].shape[3], arrays["value"].shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"the Pallas path needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    return None if cfg is None else chunk_reason(cfg.chunk_size)


def _run(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[jax.Array, jax.Array]:
    """(output in the query's dtype, final states fp32 [B | N, H, K, V]): KDA's stages without the delta rule,
    on key and value repeated up to the query heads and the key-axis log decay as the gate. Gradients come from
    their custom VJP (the heads' and gates' sums by autodiff)."""
    batch, length, heads, dk = p.query.shape
    log_decay = key_log_decay(p, jnp.float32)
    # Constants (no gate, beta) vary over the mesh as the inputs do (inside shard_map), as their gradients will.
    log_decay = vary_like(jnp.zeros((batch, length, heads, dk), jnp.float32), p) if log_decay is None else (
        jnp.broadcast_to(log_decay, (batch, length, heads, dk)))
    num_states = batch if p.cu_seqlens is None else p.cu_seqlens.shape[0] - 1
    return run_chunked(
        p.query, expand_heads(p.key, heads), expand_heads(p.value, heads), log_decay,
        vary_like(jnp.zeros((batch, length, heads), jnp.float32), p),
        None if p.initial_state is None else p.initial_state.astype(jnp.float32), p.cu_seqlens,
        (num_states, heads, dk, p.value.shape[3]), scale=p.scale, l2_normalize=False, chunk=cfg.chunk_size,
        delta_rule=False,
    )


# On a GPU `auto` takes it over xla:chunked: checked and timed on the H200, 10x XLA's chunked forward on GLA's
# per-key gate (H200 measurements). platform="pallas" runs it anywhere.
@register(OP_ID, "pallas", "chunked", supports=_supports,
          heuristic_cfg=lambda inv: RecurrentAttentionConfig(chunk_size=64))
def pallas_chunked(p: RecurrentProblem, cfg: RecurrentAttentionConfig) -> tuple[Float[Array, "B T H V"], jax.Array]:
    return _run(p, cfg)
