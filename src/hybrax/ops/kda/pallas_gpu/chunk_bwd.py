"""KDA chunked backward on the GPU with Pallas (Triton lowering): the stages end to end.

    recompute  the forward's stages 0-2 (`chunk_fwd.forward_stages`) from the T and A_qk the
               forward kept: G, w, kg, qg (chunk_wy), the chunk states h and v_new
    stage 2'   chunk_state_bwd   the state pass in reverse: dh per chunk, dv_new, d initial state
    stage 1'   chunk_grad        the chunk-local gradients, dA_qk and dA_kk (per chunk)
    stage 1''  chunk_intra_bwd   the gradients through A_qk and A_kk (per chunk)
    stage 0'   chunk_cumsum      dg from dG, a suffix sum within each chunk (`gate_gradient`)

then (XLA) the sums over the value heads of a key head, the L2 norm's and the scale's backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.ops.kda.common.layout import Segments, from_packed_rows
from hybrax.ops.kda.pallas_gpu.chunk_cumsum import gate_gradient
from hybrax.ops.kda.pallas_gpu.chunk_fwd import (
    Packing, Solved, forward_stages, has_chunks, normalize_qk, pad_inputs, pad_to,
)
from hybrax.ops.kda.pallas_gpu.chunk_grad import chunk_grad
from hybrax.ops.kda.pallas_gpu.chunk_intra_bwd import chunk_intra_bwd
from hybrax.ops.kda.pallas_gpu.chunk_state_bwd import chunk_state_bwd


def _per_key_head(x: jax.Array, heads: int) -> jax.Array:
    """[B, T, HV, K] per value head -> [B, T, H, K], summed over the value heads of each key head."""
    batch, length, value_heads, dk = x.shape
    return x.reshape(batch, length, heads, value_heads // heads, dk).sum(axis=3)


@functools.partial(jax.jit, static_argnames=("scale", "l2_normalize", "chunk", "delta_rule", "interpret"))
def kda_chunk_bwd(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    g: Float[Array, "B T HV K"],
    beta: Float[Array, "B T HV"],
    initial_state: Float[Array, "B HV K V"] | None,
    d_out: Float[Array, "B T HV V"],
    d_final: Float[Array, "B HV K V"],
    segments: Segments | None = None,
    solved: Solved | None = None,
    packing: Packing | None = None,
    *,
    scale: float,
    l2_normalize: bool = True,
    chunk: int = 64,
    delta_rule: bool = True,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """The cotangents (dq, dk, dv, dg, dbeta, d initial state) of `kda_chunk_fwd`'s (o, final state);
    each in its input's dtype (d initial state None when the initial state is None). `segments` as
    in `kda_chunk_fwd`; `solved`: the forward's T and A_qk (recomputed when None). With `packing` too, the
    inputs and their cotangents are packed rows (the kernels read them in place) and d_out, T and A_qk
    are in the padded layout. Without `delta_rule` (gated linear attention: v_new = v) dv is the state pass's
    dv_new, and dbeta means nothing."""
    length, heads, dk = q.shape[1], q.shape[2], q.shape[3]
    dv = v.shape[3]
    chunks = None if packing is None else packing.chunks
    x = pad_inputs(q, k, v, g, beta, initial_state, chunk, pad_length=packing is None)
    normalized, normalize_vjp = jax.vjp(lambda q, k: normalize_qk(q, k, scale, l2_normalize), x.q, x.k)
    qn, kn = (y.astype(x.q.dtype) for y in normalized)  # as the forward's kernels read them
    s = forward_stages(x, qn, kn, segments, solved, chunks, chunk=chunk, delta_rule=delta_rule, interpret=interpret)
    d_out = pad_to(d_out.astype(x.v.dtype), {1: s.g.shape[1], 3: x.v.shape[3]})
    d_final = pad_to(d_final.astype(jnp.float32), {2: x.k.shape[3], 3: x.v.shape[3]})

    dh, dv_new, d_initial = chunk_state_bwd(
        s.qg, s.kg, s.w, s.aqk, d_out, s.decay, d_final, segments, chunk=chunk, interpret=interpret
    )
    if segments is not None:  # an empty sequence's final state is its initial state
        d_initial = jnp.where(has_chunks(segments, d_final.shape[0]), d_initial, d_final)
    dq, dk_, dv_, dbeta, dg, daqk, dakk = chunk_grad(
        qn, kn, x.v, s.g, x.g, x.beta, s.inverse, s.h, dh, s.v_new, dv_new, d_out, chunks, chunk=chunk,
        interpret=interpret,
    )
    dq_intra, dk_intra, dg_intra, dbeta_intra = chunk_intra_bwd(
        qn, kn, s.g, x.g, x.beta, daqk, dakk, chunks, chunk=chunk, interpret=interpret
    )
    dg = gate_gradient(dg + dg_intra, s.g, x.g, chunks, chunk=chunk, interpret=interpret)
    if not delta_rule:
        dv_ = dv_new

    def rows(x):  # the padded layout -> the rows of x (packed: the tokens')
        return x if packing is None else from_packed_rows(x, packing)

    dq, dk_ = normalize_vjp(tuple(rows(_per_key_head(a + b, heads)) for a, b in ((dq, dq_intra), (dk_, dk_intra))))
    crop = lambda x, width: rows(x)[:, :length, :, :width]  # noqa: E731
    d_initial = None if initial_state is None else d_initial[:, :, :dk, :dv]
    return (
        dq[:, :length, :, :dk].astype(q.dtype), dk_[:, :length, :, :dk].astype(k.dtype), crop(dv_, dv).astype(v.dtype),
        crop(dg, dk).astype(g.dtype), rows(dbeta + dbeta_intra)[:, :length].astype(beta.dtype), d_initial,
    )
