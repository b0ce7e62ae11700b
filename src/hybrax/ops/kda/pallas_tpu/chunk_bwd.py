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
cotangent dS' (fp32 [K, V]) lives in VMEM from the final state's cotangent, read at the first step, to the initial
state's, written at the last. Everything else is per chunk, so one pass does the whole backward: nothing but the
inputs' gradients leaves the kernel.

Layout as the forward's: [B, T, heads * 128] lane-dense blocks (K and V padded to 128, T to the chunk), per-head
decays, beta and their gradients as [B, HV, T, 1] columns. dq and dk come out per value head: in q's dtype, or
with GQA in fp32, summed over the value heads of each query/key head afterwards.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float

from hybrax.ops.kda.pallas_tpu.chunk_fwd import (
    LANES, MAX_HEAD_DIM, HeadChunk, _columns, _exact_diagonals, _head_chunk, _lanes, _pad, default_block_heads,
    fold_vmap_into_batch, interpret_mode,
)
from hybrax.ops.kda.pallas_tpu.chunk_gates import SUB
from hybrax.ops.kda.pallas_tpu.chunk_grad import chunk_gradients, gate_gradient, l2_normalize_bwd, recompute
from hybrax.ops.kda.pallas_tpu.chunk_intra import is_steep
from hybrax.ops.kda.pallas_tpu.chunk_intra_bwd import intra_gradients
from hybrax.ops.kda.pallas_tpu.chunk_state_bwd import state_step_bwd
from hybrax.ops.kda.pallas_tpu.dots import Dot
from hybrax.ops.pallas_shared import pallas_call


def _head_backward(x: HeadChunk, scores: tuple[jax.Array, jax.Array], steep: jax.Array, head: int, qk_head: int,
                   refs: tuple, *, scale: float, l2_normalize: bool, per_head: bool, dot: Dot, solve_dot: Dot) -> None:
    """One head's chunk: the state step in reverse (dS' updated in place) and the chunk's gradients written."""
    q_ref, k_ref, v_ref, states_ref, d_out_ref, dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, d_state_ref = refs
    lanes = _lanes(head)
    v, d_out = (ref[:, lanes].astype(jnp.float32) for ref in (v_ref, d_out_ref))
    state, d_state = states_ref[head], d_state_ref[head]
    entering = dot.operand(state)
    r = recompute(x.q, x.k, v, x.beta, x.gates, scores, entering, dot, solve_dot)
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
    q_ref, k_ref, v_ref, g_ref, beta_ref, states_ref, d_out_ref, d_final_ref,
    dq_ref, dk_ref, dv_ref, dg_ref, dbeta_ref, d_initial_ref, d_state_ref,
    *, group: int, scale: float, l2_normalize: bool, per_head: bool, dot: Dot, solve_dot: Dot,
):
    step = pl.program_id(2)  # the chunk's index from the end

    @pl.when(step == 0)
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
                       per_head=per_head, dot=dot, solve_dot=solve_dot)

    @pl.when(step == pl.num_programs(2) - 1)
    def _():
        d_initial_ref[...] = d_state_ref[...]


def _launch(q, k, v, g, beta, states, d_out, d_final, *, chunk, block_heads, group, per_head, kernel, interpret):
    """The pallas_call on the forward's layout (`chunk_fwd._launch`), plus states [B, HV, NC, 128, 128], dO like v
    and dS_final [B, HV, 128, 128]; every chunk-indexed block taken from the end."""
    batch, padded = v.shape[:2]
    value_heads = d_final.shape[1]
    last = padded // chunk - 1
    qk_heads = max(block_heads // group, 1)
    qk_block = pl.BlockSpec(
        (None, chunk, qk_heads * LANES), lambda b, h, t: (b, last - t, lax.div(h * block_heads, group * qk_heads))
    )
    head_block = pl.BlockSpec((None, chunk, block_heads * LANES), lambda b, h, t: (b, last - t, h))
    column = pl.BlockSpec((None, block_heads, chunk, 1), lambda b, h, t: (b, h, last - t, 0))
    state = pl.BlockSpec((None, block_heads, LANES, LANES), lambda b, h, t: (b, h, 0, 0))
    states_block = pl.BlockSpec((None, block_heads, None, LANES, LANES), lambda b, h, t: (b, h, last - t, 0, 0))
    rows = jax.ShapeDtypeStruct((batch, padded, value_heads * LANES), jnp.float32)
    # dq, dk per value head: in q's dtype unless a group's value heads are summed afterwards.
    qk_rows = jax.ShapeDtypeStruct(rows.shape, q.dtype if group == 1 else jnp.float32)
    columns = jax.ShapeDtypeStruct((batch, value_heads, padded, 1), jnp.float32)
    return tuple(pallas_call(
        kernel,
        grid=(batch, value_heads // block_heads, last + 1),
        in_specs=[qk_block, qk_block, head_block, column if per_head else head_block, column, states_block,
                  head_block, state],
        out_specs=[head_block, head_block, head_block, column if per_head else head_block, column, state],
        out_shape=[qk_rows, qk_rows, jax.ShapeDtypeStruct(v.shape, v.dtype), columns if per_head else rows, columns,
                   jax.ShapeDtypeStruct(d_final.shape, jnp.float32)],
        scratch_shapes=[pltpu.VMEM((block_heads, LANES, LANES), jnp.float32)],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_bwd_tpu",
    )(q, k, v, g, beta, states, d_out, d_final))


def _check(q: jax.Array, v: jax.Array, states: jax.Array, chunk: int, block_heads: int, group: int) -> None:
    dk, dv = q.shape[3], v.shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"kda_backward: K and V must be <= {MAX_HEAD_DIM}, got K={dk}, V={dv}")
    if chunk % SUB or chunk & (chunk - 1):
        raise ValueError(f"kda_backward: chunk must be a power of two >= {SUB}, got {chunk}")
    value_heads = v.shape[2]
    if value_heads % block_heads or (block_heads % group and group % block_heads):
        raise ValueError(
            f"kda_backward: block_heads={block_heads} must divide HV={value_heads} and divide or be divided by the "
            f"group HV/H={group}"
        )
    want = (q.shape[0], value_heads, -(-q.shape[1] // chunk), dk, dv)
    if states.shape != want:
        raise ValueError(f"kda_backward: states must have shape [B, HV, NC, K, V] = {list(want)} (the forward's at "
                         f"chunk {chunk}), got {list(states.shape)}")


@functools.partial(
    jax.jit, static_argnames=("scale", "l2_normalize", "chunk", "block_heads", "solve_passes", "interpret")
)
def kda_backward(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    g: Float[Array, "B T HV Kd"],
    beta: Float[Array, "B T HV"],
    states: Float[Array, "B HV NC K V"],
    d_out: Float[Array, "B T HV V"],
    d_final: Float[Array, "B HV K V"],
    *,
    scale: float,
    l2_normalize: bool = True,
    chunk: int = 64,
    block_heads: int | None = None,
    solve_passes: int | None = None,
    interpret=None,
) -> tuple[jax.Array, ...]:
    """The cotangents of `chunk_fwd.kda_forward`'s (o, final state) w.r.t. its inputs.

    Args:
        q, k, v, g, beta: the forward's inputs (g the activated log decay per key channel, Kd = K, or per head,
            Kd = 1; beta activated).
        states: the fp32 state entering each chunk, NC = ceil(T / chunk) (`kda_forward(with_states=True)`).
        d_out: the output's cotangent; d_final: the final state's (fp32).
        scale, l2_normalize, chunk, block_heads, solve_passes, interpret: as `kda_forward`'s; the products
            with the states and the outputs take its state precision, those through T and the pairwise decays
            `solve_passes`.

    Returns:
        (dq, dk [B, T, H, K] in q's dtype, dv [B, T, HV, V] in v's, dg [B, T, HV, Kd], dbeta [B, T, HV] and
        d_initial [B, HV, K, V] in fp32).
    """
    batch, length, heads, dk = q.shape
    value_heads, dv = v.shape[2:]
    group = value_heads // heads
    block_heads = block_heads or default_block_heads(value_heads, group)
    _check(q, v, states, chunk, block_heads, group)
    padded = -(-length // chunk) * chunk
    fp32 = v.dtype == jnp.float32
    per_head = g.shape[3] == 1

    def lanes(x: jax.Array) -> jax.Array:  # [B, T, n, D] -> [B, padded, n * 128]
        return _pad(x, {1: padded, 3: LANES}).reshape(batch, padded, -1)

    launch = functools.partial(
        _launch, chunk=chunk, block_heads=block_heads, group=group, per_head=per_head,
        kernel=functools.partial(
            _backward_kernel, group=group, scale=scale, l2_normalize=l2_normalize, per_head=per_head,
            dot=Dot(6 if fp32 else 1), solve_dot=Dot(solve_passes or (6 if fp32 else 3)),
        ),
        interpret=interpret_mode() if interpret is None else interpret,
    )
    dq, dk_, dv_, dg, dbeta, d_initial = fold_vmap_into_batch(launch)(
        lanes(q), lanes(k), lanes(v), _columns(g[..., 0], padded) if per_head else lanes(g.astype(jnp.float32)),
        _columns(beta, padded), _pad(states, {3: LANES, 4: LANES}), lanes(d_out.astype(v.dtype)),
        _pad(d_final.astype(jnp.float32), {2: LANES, 3: LANES}),
    )

    def per_key_head(x: jax.Array) -> jax.Array:  # [B, padded, HV * 128] -> [B, T, H, K], summed over each group
        return x.reshape(batch, padded, heads, group, LANES).sum(axis=3)[:, :length, :, :dk].astype(q.dtype)

    def tokens(x: jax.Array) -> jax.Array:  # [B, HV, padded, 1] -> [B, T, HV]
        return jnp.swapaxes(x[:, :, :length, 0], 1, 2)

    dg = tokens(dg)[..., None] if per_head else dg.reshape(batch, padded, value_heads, LANES)[:, :length, :, :dk]
    dv_ = dv_.reshape(batch, padded, value_heads, LANES)[:, :length, :, :dv]
    return per_key_head(dq), per_key_head(dk_), dv_, dg.astype(g.dtype), tokens(dbeta), d_initial[:, :, :dk, :dv]
