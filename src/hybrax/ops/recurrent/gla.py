"""`gated_linear_attention`: gated linear attention with flash-linear-attention's arguments (`chunk_gla`,
`fused_recurrent_gla`).

Per head, with the state S [K, V] in fp32:
    S_t = S_{t-1} * exp(g_t)[:, None] * exp(gv_t)[None, :] + k_t v_t^T;  o_t = S_t^T (scale q_t)
g (chunk_gla's name; fused_recurrent_gla calls it gk) is the log decay per key channel [B, T, H, K], or per
head [B, T, H]; gv the log decay per value channel. The call is mapped onto `recurrent_attention` and run by
the executor; it returns (o, final_state or None) like fla.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from hybrax.core import checks, default_executor
from hybrax.core.validate import check_number, check_rank
from hybrax.ops.fla_states import fla_result, k_first_initial_state
from hybrax.core.packing import unflatten_output
from hybrax.ops.recurrent.api import RecurrentAttention, RecurrentAttentionConfig, packed_rows


def _initial_state(initial_state: Any, q: Any, v: Any, cu_seqlens: Any, v_first: bool) -> Any:
    """The initial state in recurrent_attention's [N, H, K, V] layout."""
    if initial_state is None:
        return None
    check_rank("q", q, 4, "[batch, seq_len, num_heads, head_dim]")
    check_rank("v", v, 4, "[batch, seq_len, num_kv_heads, v_head_dim]")
    batch, _, heads, dk = jnp.shape(q)
    states = batch if cu_seqlens is None else jnp.shape(cu_seqlens)[0] - 1
    return k_first_initial_state(initial_state, states, ("num_heads", heads), dk, jnp.shape(v)[3], v_first=v_first,
                                 packed=cu_seqlens is not None)


def gated_linear_attention(
    q: Float[Array, "batch seq_len num_heads head_dim"],
    k: Float[Array, "batch seq_len num_kv_heads head_dim"],
    v: Float[Array, "batch seq_len num_kv_heads v_head_dim"],
    g: Float[Array, "batch seq_len num_heads *head_dim"] | None = None,
    *,
    gk: Float[Array, "batch seq_len num_heads head_dim"] | None = None,
    gv: Float[Array, "batch seq_len num_heads v_head_dim"] | None = None,
    scale: float | None = None,
    initial_state: Float[Array, "num_states num_heads d1 d2"] | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Int[Array, " num_sequences_plus_1"] | None = None,
    segment_ids: Int[Array, "batch seq_len"] | None = None,
    max_segments: int | None = None,
    platform: str | None = None,
    cfg: RecurrentAttentionConfig | None = None,
) -> tuple[Float[Array, "batch seq_len num_heads v_head_dim"], Float[Array, "num_states num_heads d1 d2"] | None]:
    """Gated linear attention as flash-linear-attention's `chunk_gla` / `fused_recurrent_gla` take it.

    Args:
        q: [B, T, H, K]. k: [B, T, HKV, K], v: [B, T, HKV, V], HKV dividing H (fla: HKV = H).
        g (or gk, fused_recurrent_gla's name): log decay <= 0 per key channel [B, T, H, K] or per head
            [B, T, H]; None: no key decay.
        gv: log decay <= 0 per value channel [B, T, H, V], or None.
        scale: of the queries; None: K ** -0.5.
        initial_state: [N, H, K, V] ([N, H, V, K] with state_v_first); N = B, or the number of packed
            sequences with cu_seqlens or segment_ids. None: zeros.
        output_final_state: also return the fp32 final state, in initial_state's layout.
        reverse: run from the last token to the first (each packed sequence on its own).
        state_v_first: states are [.., V, K].
        cu_seqlens: [N + 1] int32: N sequences packed into a batch of one. Pad it to a fixed length with its
            last value to avoid a retrace when N varies (empty sequences at the end: final state = initial state).
        segment_ids: [B, T] int, instead of cu_seqlens: each run of equal ids in a row is a sequence, ids < 0
            padding (zero output). The rows run as one packed row of B * T tokens, one sequence (and state) per run
            in row-major order, padding runs included: N runs, counted when the ids are concrete.
        max_segments: N with segment_ids under jit, a static bound on the runs; the states past the runs are
            empty sequences' (final state = initial state).
        platform, cfg: which implementation and knobs (default: the executor's choice; see hybrax.explain).

    Returns:
        (o [B, T, H, V] in q's dtype, final_state fp32 or None when output_final_state is False).

    Values are checked on concrete inputs (gates <= 0, no NaN or inf): ValueError naming the argument; under
    jit, through `hybrax.checked`.
    """
    if g is not None and gk is not None:
        raise ValueError("g and gk are the same gate (chunk_gla calls it g, fused_recurrent_gla gk): give one")
    pack, (q, k, v, g, _, gk, gv, cu_seqlens) = packed_rows(q, k, v, g, None, gk, gv, cu_seqlens, segment_ids,
                                                             max_segments, names=("q", "k", "v"))
    h0 = _initial_state(initial_state, q, v, cu_seqlens, state_v_first)
    if scale is not None:
        check_number("scale", scale, "a finite number or None", lambda value: True)
    for arg, array in (("q", q), ("k", k), ("v", v)):
        checks.check_finite(arg, array)
    for arg, gate in (("g", g), ("gk", gk), ("gv", gv)):
        checks.check_log_decay(arg, gate)
    result = default_executor()(
        RecurrentAttention(), q, k, v, g, None, gk, gv, h0, cu_seqlens,
        softmax_scale=scale, reverse=reverse, return_state=output_final_state, platform=platform, cfg=cfg,
    )
    return unflatten_output(pack, fla_result(result, output_final_state, state_v_first))
