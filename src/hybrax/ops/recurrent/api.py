"""`recurrent_attention`: gated linear recurrent attention (ejkernel's `recurrent_attention` signature), the public
function; the problem, config and kernel live in `base.py`, each implementation in its own module (imported
here so that it registers).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybrax.core import default_executor, set_auto_order
from hybrax.core.packing import Packing, segment_packing, unflatten_output
from hybrax.core.validate import check_rank
from hybrax.ops.recurrent import pallas_chunked, pallas_tpu_chunked, xla_chunked, xla_scan  # noqa: F401  (they register)
from hybrax.ops.recurrent.base import (
    OP_ID, RecurrentAttention, RecurrentAttentionConfig, RecurrentProblem, check_gates,
)

# What `auto` tries, in order, per device platform; the first whose supports() accepts the call runs (a device
# not named here reads the "cpu" row). A call shorter than CHUNKED_MIN_SEQ_LEN (64) tries the scan first
# (`RecurrentAttention.implementations`); on the CPU the scan is first at every length.
AUTO = {
    "gpu": ("pallas:chunked", "xla:chunked", "xla:scan"),
    "tpu": ("xla:chunked", "xla:scan"),
    "cpu": ("xla:scan", "xla:chunked"),
}
# Run only when asked for by platform (there before the platform's other implementations).
OPT_IN = {
    "pallas_tpu:chunked": "not yet timed on a TPU",
}
set_auto_order(OP_ID, AUTO, OPT_IN)

__all__ = [
    "OP_ID", "RecurrentAttention", "RecurrentAttentionConfig", "RecurrentProblem", "packed_rows", "recurrent_attention",
]


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
    segment_ids: Int[Array, "batch seq_len"] | None = None,
    max_segments: int | None = None,
) -> Float[Array, "batch seq_len num_heads v_head_dim"] | tuple[
    Float[Array, "batch seq_len num_heads v_head_dim"], Float[Array, "num_states num_heads head_dim v_head_dim"]
]:
    """Gated linear recurrent attention; see the module docstring for the recurrence.

    All gates are log decays (any subset may be given). With `cu_seqlens` ([N+1], batch 1) the batch
    packs N sequences, each starting from `initial_state[n]` and ending in `final_state[n]`; it rises from 0
    to at most seq_len, and tokens from cu_seqlens[-1] on belong to no sequence (zero output). Pad
    cu_seqlens to a fixed length with its last value to avoid a retrace when the number of sequences varies
    (the empty sequences at the end keep their initial states). `segment_ids` [B, T] instead: each run of
    equal ids in a row is a sequence, ids < 0 padding (zero output); the rows run as one packed row of
    B * T tokens with one sequence, and state, per run in row-major order (padding runs included), counted
    when the ids are concrete, else `max_segments` of them (states past the runs keep their initial values).
    Returns the output in the query's dtype, and with `return_state` also the fp32 final states.
    """
    pack, (query, key, value, g, g_gamma, gk, gv, cu_seqlens) = packed_rows(
        query, key, value, g, g_gamma, gk, gv, cu_seqlens, segment_ids, max_segments)
    result = default_executor()(
        RecurrentAttention(), query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens,
        softmax_scale=softmax_scale, reverse=reverse, return_state=return_state, platform=platform, cfg=cfg,
    )
    return unflatten_output(pack, result)


def packed_rows(query: Any, key: Any, value: Any, g: Any, g_gamma: Any, gk: Any, gv: Any, cu_seqlens: Any,
                segment_ids: Any, max_segments: int | None, names: tuple[str, str, str] = ("query", "key", "value")
                ) -> tuple[Packing | None, tuple]:
    """(the packing of segment_ids, the arguments query .. gv, cu_seqlens as the packed form takes them: one row of
    B * T tokens and the flattened cu_seqlens); without segment_ids (None, the arguments unchanged). The gates'
    shapes are checked first (flattening drops their batch); `names`: the caller's for query, key, value."""
    if segment_ids is None:
        segment_packing(names[0], query, cu_seqlens, segment_ids, max_segments)  # refuses max_segments alone
        return None, (query, key, value, g, g_gamma, gk, gv, cu_seqlens)
    check_rank(names[0], query, 4, "[batch, seq_len, num_heads, head_dim]")
    check_rank(names[2], value, 4, "[batch, seq_len, num_kv_heads, v_head_dim]")
    check_gates(g, g_gamma, gk, gv, *jnp.shape(query), jnp.shape(value)[3])
    pack = segment_packing(names[0], query, cu_seqlens, segment_ids, max_segments)
    query, key, value, g, gk, gv = (pack.flatten(name, array) for name, array in (
        *zip(names, (query, key, value)), ("g", g), ("gk", gk), ("gv", gv)))
    g, g_gamma = _gamma_per_token(g, g_gamma, pack)
    return pack, (query, key, value, g, g_gamma, gk, gv, pack.cu_seqlens)


def _gamma_per_token(g: Any, g_gamma: Any, pack: Packing) -> tuple[Any, Any]:
    """(g, g_gamma) on the flattened row, a per-row g_gamma [B, H] moved into g as a per-token gate."""
    if g_gamma is None or jnp.ndim(g_gamma) != 2:
        return g, g_gamma
    gamma = jnp.repeat(jnp.asarray(g_gamma), pack.segments.shape[1], axis=0)[None]  # [1, B * T, H]
    if g is None:
        return gamma, None
    return g + (gamma if jnp.ndim(g) == 3 else gamma[..., None]), None
