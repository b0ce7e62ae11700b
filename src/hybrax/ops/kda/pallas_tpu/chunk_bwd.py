"""KDA chunked backward on the TPU: one Pallas Mosaic kernel over the grid (batch, block of value heads, chunk),
the chunk axis walked from the last chunk to the first.

Each step reads one chunk of `block_heads` value heads as the forward does (q, k, v, the log decays, beta), the
fp32 state S entering it (which the forward stored) and the output's cotangent dO, and does, per head, in VMEM:

    the forward's chunk again: gate sums, A_qk, A_kk, T, w, v_new, qg, kg (`chunk_fwd`, `chunk_grad.recompute`)
    dv_new and dS <- the state step in reverse (`chunk_state_bwd`)          dS' in a VMEM scratch
    dq, dk, dv, dbeta, dG, dG_C, dA_qk, dA_kk (`chunk_grad.chunk_gradients`)  through T: dL = -T^T dT T^T
    the terms through the pairwise decays of A_qk, A_kk (`chunk_intra_bwd`)
    dg: suffix sums of dG plus dG_C (`chunk_grad.gate_gradient`); per-head decay: its sum over K
    dq, dk through the scale and the L2 norm (`chunk_grad.l2_normalize_bwd`)

The chunk axis is the grid's last ("arbitrary": in order) and its blocks are indexed from the end, so each head's
cotangent dS' (fp32 [K, V]) lives in VMEM from the final state's cotangent, read at a sequence's last chunk, to the
initial state's, written at its first (with packed sequences, the chunks the chunk info names: `layout`).
Everything else is per chunk, so one pass does the whole backward: nothing but the inputs' gradients leaves the
kernel. Without the delta rule (gated linear attention) the same pass skips T (`chunk_grad`).

Layout as the forward's: [B, T', heads * 128] lane-dense blocks (K and V padded to 128, T to the chunk or packed
sequences to whole chunks), per-head decays, beta and their gradients as [B, HV, T', 1] columns. dq and dk come
out per value head: in q's dtype, or with GQA in fp32, summed over the value heads of each query/key head
afterwards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from hybrax.ops.kda.pallas_tpu.chunk_fwd import (
    LANES, HeadChunk, _exact_diagonals, _head_chunk, _lanes, _pad, check_call, default_block_heads, interpret_mode,
    kernel_gates, kernel_rows, kernel_states,
)
from hybrax.ops.kda.pallas_tpu.chunk_grad import chunk_gradients, gate_gradient, l2_normalize_bwd, recompute
from hybrax.ops.kda.pallas_tpu.chunk_intra import is_steep
from hybrax.ops.kda.pallas_tpu.chunk_intra_bwd import intra_gradients
from hybrax.ops.kda.pallas_tpu.chunk_state_bwd import state_step_bwd
from hybrax.ops.kda.pallas_tpu.dots import Dot
from hybrax.ops.kda.pallas_tpu.layout import Rows, boundaries, fold_vmap_into_batch, rows_of, sequence_of
from hybrax.ops.pallas_shared import pallas_call


def _head_backward(x: HeadChunk, scores: tuple[jax.Array, jax.Array], steep: jax.Array, head: int, qk_head: int,
                   refs: tuple, *, scale: float, l2_normalize: bool, per_head: bool, dot: Dot, solve_dot: Dot,
                   delta_rule: bool) -> None:
    """One head's chunk: the state step in reverse (dS' updated in place) and the chunk's gradients written."""
    q_ref, k_ref, v_ref, states_ref, d_out_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, d_state_ref = refs
    lanes = _lanes(head)
    v, d_out = (ref[:, lanes].astype(jnp.float32) for ref in (v_ref, d_out_ref))
    state, d_state = states_ref[head], d_state_ref[head]
    entering = dot.operand(state)
    r = recompute(x.q, x.k, v, x.beta, x.gates, scores, entering, dot, solve_dot, delta_rule)
    dv_new, d_entering = state_step_bwd(d_state, r.w, r.qg, r.aqk, r.kg, d_out, r.decay, dot)
    d_state_ref[head] = d_entering
    grads = chunk_gradients(x.k, v, x.beta, r, state, entering, d_state, d_out, dv_new, dot, solve_dot)
    y_q, y_k, z = intra_gradients(grads.d_aqk, grads.d_akk, x.q, x.k, x.g, x.gates, steep, solve_dot)
    dq, dk = (grads.dq + y_q) * scale, grads.dk + y_k + z
    if l2_normalize:
        qk_lanes = _lanes(qk_head)
        dq = l2_normalize_bwd(q_ref[:, qk_lanes].astype(jnp.float32), dq)
        dk = l2_normalize_bwd(k_ref[:, qk_lanes].astype(jnp.float32), dk)
    dq_ref[:, lanes], dk_ref[:, lanes] = dq.astype(dq_ref.dtype), dk.astype(dk_ref.dtype)
    dv_ref[:, lanes] = grads.dv.astype(dv_ref.dtype)
    dbeta_ref[head] = grads.dbeta
    dg = gate_gradient(grads.dg + x.q * y_q + x.k * (y_k - z), grads.d_total, x.g)
    if per_head:
        dg_ref[head] = jnp.sum(dg, axis=1, keepdims=True)
    else:
        dg_ref[:, lanes] = dg


def _backward_kernel(
    *refs, group: int, scale: float, l2_normalize: bool, per_head: bool, dot: Dot, solve_dot: Dot, delta_rule: bool,
    packed: bool,
):
    info_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)  # packed: the chunk info (`layout`)
    (q_ref, k_ref, v_ref, g_ref, beta_ref, states_ref, d_out_ref, d_final_ref,
     dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, d_initial_ref, d_state_ref) = refs
    step, count = pl.program_id(2), pl.num_programs(2)  # step: the chunk's index from the end
    first, last = boundaries(info_ref, count - 1 - step, count)

    if packed:  # chunks after the last sequence carry zero rows: nothing flows back through them
        @pl.when(step == 0)
        def _():
            d_state_ref[...] = jnp.zeros(d_state_ref.shape, jnp.float32)

    @pl.when(last)
    def _():
        d_state_ref[...] = d_final_ref[...]

    block_heads = d_state_ref.shape[0]
    load = functools.partial(
        _head_chunk, q_ref, k_ref, g_ref, beta_ref, scale=scale, l2_normalize=l2_normalize, per_head=per_head,
        solve_dot=solve_dot,
    )
    qk_heads = [head // group if block_heads % group == 0 else 0 for head in range(block_heads)]
    heads = [load(head, qk_head) for head, qk_head in enumerate(qk_heads)]
    steep = functools.reduce(jnp.logical_or, [is_steep(h.gates) for h in heads])
    scores = lax.cond(steep, lambda: _exact_diagonals(heads), lambda: [h.scores for h in heads])
    refs = (q_ref, k_ref, v_ref, states_ref, d_out_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, d_state_ref)
    for head, (x, head_scores) in enumerate(zip(heads, scores)):
        _head_backward(x, head_scores, steep, head, qk_heads[head], refs, scale=scale, l2_normalize=l2_normalize,
                       per_head=per_head, dot=dot, solve_dot=solve_dot, delta_rule=delta_rule)

    @pl.when(first)
    def _():
        d_initial_ref[...] = d_state_ref[...]


def _launch(*arrays, chunk, block_heads, group, per_head, kernel, interpret, packed):
    """The pallas_call on the forward's layout (`chunk_fwd._launch`), plus states [B, HV, NC, 128, 128], dO like v
    and dS_final [B, N, HV, 128, 128]; every chunk-indexed block taken from the end."""
    q, k, v, g, beta, states, d_out, d_final = arrays[int(packed):]
    batch, padded = v.shape[:2]
    value_heads = d_final.shape[2]
    last = padded // chunk - 1
    qk_heads = max(block_heads // group, 1)
    qk_block = pl.BlockSpec(
        (None, chunk, qk_heads * LANES),
        lambda b, h, t, *_: (b, last - t, lax.div(h * block_heads, group * qk_heads)),
    )
    head_block = pl.BlockSpec((None, chunk, block_heads * LANES), lambda b, h, t, *_: (b, last - t, h))
    column = pl.BlockSpec((None, block_heads, chunk, 1), lambda b, h, t, *_: (b, h, last - t, 0))
    state = pl.BlockSpec((None, None, block_heads, LANES, LANES),
                         lambda b, h, t, *info: (b, sequence_of(info, last - t), h, 0, 0))
    states_block = pl.BlockSpec((None, block_heads, None, LANES, LANES), lambda b, h, t, *_: (b, h, last - t, 0, 0))
    value_rows = jax.ShapeDtypeStruct((batch, padded, value_heads * LANES), jnp.float32)
    # dq, dk per value head: in q's dtype unless a group's value heads are summed afterwards.
    qk_rows = jax.ShapeDtypeStruct(value_rows.shape, q.dtype if group == 1 else jnp.float32)
    columns = jax.ShapeDtypeStruct((batch, value_heads, padded, 1), jnp.float32)
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=int(packed),
        grid=(batch, value_heads // block_heads, last + 1),
        in_specs=[qk_block, qk_block, head_block, column if per_head else head_block, column, states_block,
                  head_block, state],
        out_specs=[head_block, head_block, head_block, column if per_head else head_block, column, state],
        scratch_shapes=[pltpu.VMEM((block_heads, LANES, LANES), jnp.float32)],
    )
    return tuple(pallas_call(
        kernel,
        grid_spec=grid,
        out_shape=[qk_rows, qk_rows, jax.ShapeDtypeStruct(v.shape, v.dtype), columns if per_head else value_rows,
                   columns, jax.ShapeDtypeStruct(d_final.shape, jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_bwd_tpu",
    )(*arrays))


def _check_states(q: jax.Array, v: jax.Array, states: jax.Array, layout: Rows) -> None:
    want = (q.shape[0], v.shape[2], layout.chunks, q.shape[3], v.shape[3])
    if states.shape != want:
        raise ValueError(f"kda_backward: states must have shape [B, HV, NC, K, V] = {list(want)} (the forward's at "
                         f"chunk {layout.chunk}), got {list(states.shape)}")


@functools.partial(
    jax.jit,
    static_argnames=("scale", "l2_normalize", "chunk", "block_heads", "solve_passes", "delta_rule", "interpret"),
)
def kda_backward(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    g: Float[Array, "B T HV Kd"],
    beta: Float[Array, "B T HV"],
    states: Float[Array, "B HV NC K V"],
    d_out: Float[Array, "B T HV V"],
    d_final: Float[Array, "N HV K V"],
    *,
    scale: float,
    cu_seqlens: Int[Array, " N1"] | None = None,
    l2_normalize: bool = True,
    chunk: int = 64,
    block_heads: int | None = None,
    solve_passes: int | None = None,
    delta_rule: bool = True,
    interpret=None,
) -> tuple[jax.Array, ...]:
    """The cotangents of `chunk_fwd.kda_forward`'s (o, final state) w.r.t. its inputs.

    Args:
        q, k, v, g, beta: the forward's inputs (g the activated log decay per key channel, Kd = K, or per head,
            Kd = 1; beta activated).
        states: the fp32 state entering each chunk of the kernel's rows (`kda_forward(with_states=True)`).
        d_out: the output's cotangent; d_final: the final state's (fp32), N = B or the packed sequences' count.
        scale, cu_seqlens, l2_normalize, chunk, block_heads, solve_passes, delta_rule, interpret: as
            `kda_forward`'s; the products with the states and the outputs take its state precision, those
            through T and the pairwise decays `solve_passes`.

    Returns:
        (dq, dk [B, T, H, K] in q's dtype, dv [B, T, HV, V] in v's, dg [B, T, HV, Kd], dbeta [B, T, HV] (zeros
        without `delta_rule`) and d_initial [N, HV, K, V] in fp32).
    """
    batch, length, heads, dk = q.shape
    value_heads, dv = v.shape[2:]
    group = value_heads // heads
    block_heads = block_heads or default_block_heads(value_heads, group)
    check_call("kda_backward", q, v, chunk, block_heads, cu_seqlens)
    layout = rows_of(length, chunk, cu_seqlens)
    _check_states(q, v, states, layout)
    packed = layout.info is not None
    fp32 = v.dtype == jnp.float32
    per_head = g.shape[3] == 1
    launch = functools.partial(
        _launch, chunk=chunk, block_heads=block_heads, group=group, per_head=per_head,
        kernel=functools.partial(
            _backward_kernel, group=group, scale=scale, l2_normalize=l2_normalize, per_head=per_head,
            dot=Dot(6 if fp32 else 1), solve_dot=Dot(solve_passes or (6 if fp32 else 3)), delta_rule=delta_rule,
            packed=packed,
        ),
        interpret=interpret_mode() if interpret is None else interpret, packed=packed,
    )
    dq, dk_, dv_, dg, dbeta, d_initial = fold_vmap_into_batch(launch, shared=int(packed))(
        *([layout.info] if packed else []), *kernel_rows(layout, q, k, v), *kernel_gates(layout, g, beta),
        _pad(states, {3: LANES, 4: LANES}), *kernel_rows(layout, d_out.astype(v.dtype)),
        kernel_states(d_final, packed),
    )

    def per_key_head(x: jax.Array) -> jax.Array:  # [B, NC * C, HV * 128] -> [B, T, H, K], summed over each group
        x = x.reshape(batch, layout.length, heads, group, LANES).sum(axis=3)[..., :dk]
        return layout.to_tokens(x, length).astype(q.dtype)

    def tokens(x: jax.Array) -> jax.Array:  # [B, HV, NC * C, 1] -> [B, T, HV]
        return jnp.swapaxes(layout.to_tokens(x[..., 0], length, axis=2), 1, 2)

    def value_rows(x: jax.Array, width: int) -> jax.Array:  # [B, NC * C, HV * 128] -> [B, T, HV, width]
        return layout.to_tokens(x.reshape(batch, layout.length, value_heads, LANES)[..., :width], length)

    dg = tokens(dg)[..., None] if per_head else value_rows(dg, dk)
    d_initial = d_initial[0] if packed else d_initial[:, 0]
    d_initial = layout.states(d_initial[..., :dk, :dv], d_final.astype(jnp.float32))
    return (per_key_head(dq), per_key_head(dk_), value_rows(dv_, dv), dg.astype(g.dtype), tokens(dbeta), d_initial)
