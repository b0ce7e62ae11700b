"""`recurrent_attention`: gated linear recurrent attention (ejkernel's `recurrent_attention` signature), the public
function; the problem, config and kernel live in `base.py`, each implementation in its own module (imported
here so that it registers).
"""

from __future__ import annotations


from jaxtyping import Array, Float, Int

from hybrax.core import default_executor
from hybrax.ops.recurrent import pallas_chunked, pallas_tpu_chunked, xla_chunked, xla_scan  # noqa: F401  (they register)
from hybrax.ops.recurrent.base import OP_ID, RecurrentAttention, RecurrentAttentionConfig, RecurrentProblem

__all__ = ["OP_ID", "RecurrentAttention", "RecurrentAttentionConfig", "RecurrentProblem", "recurrent_attention"]

def recurrent_attention(
    query: Float[Array, "batch seq_len num_heads head_dim"],
    key: Float[Array, "batch seq_len num_kv_heads head_dim"],
    value: Float[Array, "batch seq_len num_kv_heads v_head_dim"],
    g: Float[Array, "batch seq_len num_heads"] | Float[Array, "batch seq_len num_heads head_dim"] | None = None,
    g_gamma: Float[Array, "num_heads"] | Float[Array, "batch num_heads"] | None = None,
    gk: Float[Array, "batch seq_len num_heads head_dim"] | None = None,
    gv: Float[Array, "batch seq_len num_heads v_head_dim"] | None = None,
    initial_state: Float[Array, "num_states num_heads head_dim v_head_dim"] | None = None,
    cu_seqlens: Int[Array, "num_seqs_plus_one"] | None = None,
    /,
    *,
    softmax_scale: float | None = None,
    reverse: bool = False,
    return_state: bool = False,
    platform: str | None = None,
    cfg: RecurrentAttentionConfig | None = None,
) -> Float[Array, "batch seq_len num_heads v_head_dim"] | tuple[
    Float[Array, "batch seq_len num_heads v_head_dim"], Float[Array, "num_states num_heads head_dim v_head_dim"]
]:
    """Gated linear recurrent attention; see the module docstring for the recurrence.

    All gates are log decays (any subset may be given). With `cu_seqlens` ([N+1], batch 1) the batch
    packs N sequences, each starting from `initial_state[n]` and ending in `final_state[n]`; it rises from 0
    to at most seq_len, and tokens from cu_seqlens[-1] on belong to no sequence (zero output).
    Returns the output in the query's dtype, and with `return_state` also the fp32 final states.
    """
    return default_executor()(
        RecurrentAttention(), query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens,
        softmax_scale=softmax_scale, reverse=reverse, return_state=return_state, platform=platform, cfg=cfg,
    )
