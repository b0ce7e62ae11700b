"""Direct XLA attention: the whole [B, H, Tq, Tk] score tensor at once, gradients by autodiff.

Fastest for short sequences; `auto` moves to the blockwise implementation for long ones
(`api.is_long`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from hybrax.core import Invocation, register
from hybrax.ops.attention import scores
from hybrax.ops.attention.base import OP_ID, AttentionConfig, AttentionProblem


def softmax_parts(
    logits: Float[Array, "B K G q k"], seen: Bool[Array, "*b q k"], sinks: Float[Array, "K G S"] | None
) -> tuple[Float[Array, "B K G q k"], Float[Array, "B K G q"]]:
    """Unnormalized softmax weights over the visible keys, and each row's denominator (which the
    sinks join without a value). Weights = exps / denominator, 0 where the denominator is 0.

    Hidden keys get exactly 0: the max is taken over visible entries only and `exp` sees -inf,
    never inf - inf, so neither the value nor the gradient can be NaN.
    """
    row_max = jnp.max(jnp.where(seen, logits, -jnp.inf), axis=-1)
    if sinks is not None:
        row_max = jnp.maximum(row_max, jnp.max(sinks, axis=-1)[None, :, :, None])
    # The softmax does not depend on the shift: no gradient through it.
    row_max = jax.lax.stop_gradient(jnp.where(jnp.isfinite(row_max), row_max, 0.0))
    exps = jnp.exp(jnp.where(seen, logits - row_max[..., None], -jnp.inf))
    denominator = jnp.sum(exps, axis=-1)
    if sinks is not None:
        denominator = denominator + jnp.sum(jnp.exp(sinks[None, :, :, None, :] - row_max[..., None]), axis=-1)
    return exps, denominator


def _heuristic(inv: Invocation) -> AttentionConfig:
    return AttentionConfig()


@register(OP_ID, "xla", "direct", heuristic_cfg=_heuristic)
def direct(p: AttentionProblem, cfg: AttentionConfig) -> Float[Array, "B Tq K G Dv"]:
    q_pos = jnp.arange(p.query.shape[1])
    k_pos = jnp.arange(p.key.shape[1])
    logits = scores.logits(p, p.query, p.key, p.bias)
    seen = scores.visible(p, q_pos, k_pos, p.mask, p.q_segment_ids, p.kv_segment_ids)
    exps, denominator = softmax_parts(logits, seen, p.softmax_aux)
    keep = scores.dropout_keep(p, q_pos, k_pos) if p.dropout_prob else None
    # Normalizing the [.., q, Dv] output rather than the [.., q, k] weights saves a pass over the scores.
    out = jnp.einsum("bhgqk,bkhv->bhgqv", scores.apply_dropout(p, exps, keep).astype(p.dtype), p.value,
                     preferred_element_type=scores.accumulation_dtype(p), precision=scores.precision(p.dtype))
    out = out / jnp.where(denominator > 0, denominator, 1.0)[..., None].astype(out.dtype)
    return jnp.moveaxis(out, 3, 1).astype(p.dtype)
