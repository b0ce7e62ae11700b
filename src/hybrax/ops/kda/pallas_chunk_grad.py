"""KDA chunked backward, the chunk-local gradients (Pallas, Triton lowering).

One program per (chunk, value head, batch), whole-chunk tiles. The forward's chunk, from the state
h before it (X_k = beta k exp(G), X_v = beta v, T = (I + A_kk)^-1):

    qg = q exp(G),  kg = k exp(G_last - G),  decay = exp(G_last),  w = T X_k,  u = T X_v
    v_new = u - w h,   o = qg h + A_qk v_new,   h' = decay * h + kg^T v_new

With dh' and dv_new from the reverse state pass, its cotangents are

    dqg = dO h^T,  dkg = v_new dh'^T,  d decay = rowsum(dh' * h),  dw = -dv_new h^T,  du = dv_new
    dA_qk = dO v_new^T (j <= i),  dT = dw X_k^T + du X_v^T (j <= i),  dX_k = T^T dw,  dX_v = T^T du
    dA_kk = -T^T dT T^T (j < i)

and through the elementwise maps to q, k, v, beta and G (exp(G_last) ties every row's G_last to the
last row). The terms through A_kk and A_qk (pairwise decays) are left to `pallas_chunk_intra_bwd`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_tiles import dot_settings, index_grid, mm, mm_t, solve_precision


def mm_tn(a: jax.Array, b: jax.Array, dtype, precision) -> jax.Array:
    """a.T @ b (contracting the first axis of both) with operands cast to `dtype`, fp32 accumulation."""
    return lax.dot_general(
        a.astype(dtype), b.astype(dtype), (((0,), (0,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )


def _grad_kernel(
    q_ref, k_ref, v_ref, g_ref, beta_ref, inverse_ref, h_ref, dh_ref, v_new_ref, dv_new_ref, d_out_ref,
    dq_ref, dk_ref, dv_ref, dbeta_ref, dg_ref, daqk_ref, dakk_ref, *, compute_dtype, precision, fp32_precision,
):
    chunk = q_ref.shape[0]
    gates = g_ref[...]
    last = g_ref[chunk - 1, :]
    growth = jnp.exp(gates)
    to_end = jnp.exp(last[None, :] - gates)
    betas = beta_ref[...].astype(jnp.float32)[:, None]
    queries, keys, values = (ref[...].astype(jnp.float32) for ref in (q_ref, k_ref, v_ref))
    x_k, x_v = keys * betas * growth, values * betas
    h, dh = h_ref[...], dh_ref[...]
    d_out, v_new, dv_new = d_out_ref[...], v_new_ref[...], dv_new_ref[...]
    inverse = inverse_ref[...].astype(jnp.float32)

    dqg = mm_t(d_out, h, compute_dtype, precision)
    dkg = mm_t(v_new, dh, compute_dtype, precision)
    dw = -mm_t(dv_new, h, compute_dtype, precision)
    rows, cols = index_grid(chunk)
    daqk_ref[...] = jnp.where(rows >= cols, mm_t(d_out, v_new, compute_dtype, precision), 0.0)
    d_inverse = mm_t(dw, x_k, jnp.float32, fp32_precision) + mm_t(dv_new, x_v, compute_dtype, precision)
    d_inverse = jnp.where(rows >= cols, d_inverse, 0.0)
    dx_k = mm_tn(inverse, dw, jnp.float32, fp32_precision)
    dx_v = mm_tn(inverse, dv_new, compute_dtype, precision)
    dakk = -mm_tn(inverse, mm_t(d_inverse, inverse, jnp.float32, fp32_precision), jnp.float32, fp32_precision)
    dakk_ref[...] = jnp.where(rows > cols, dakk, 0.0)

    dq_ref[...] = dqg * growth
    dk_ref[...] = dkg * to_end + dx_k * betas * growth
    dv_ref[...] = (dx_v * betas).astype(dv_ref.dtype)
    dbeta_ref[...] = jnp.sum(dx_k * keys * growth, axis=1) + jnp.sum(dx_v * values, axis=1)
    kg_term = dkg * keys * to_end
    d_decay = jnp.sum(dh.astype(jnp.float32) * h.astype(jnp.float32), axis=1) * jnp.exp(last)
    from_last = jnp.sum(kg_term, axis=0) + d_decay
    last_row = lax.broadcasted_iota(jnp.int32, gates.shape, 0) == chunk - 1
    dg_ref[...] = dqg * queries * growth - kg_term + dx_k * x_k + jnp.where(last_row, from_last[None, :], 0.0)


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def chunk_grad(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, inverse: jax.Array, h: jax.Array,
    dh: jax.Array, v_new: jax.Array, dv_new: jax.Array, d_out: jax.Array, *, chunk: int = 64, num_warps: int = 8,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """q, k [B, T, H, K] (prepared); v, v_new, dv_new, dO [B, T, HV, V]; g [B, T, HV, K] (G, fp32);
    beta [B, T, HV]; T [B, T, HV, chunk]; h, dh [B, NT, HV, K, V].

    Returns dq, dk [B, T, HV, K] fp32 (per value head), dv [B, T, HV, V] (v's dtype), dbeta [B, T, HV],
    dG [B, T, HV, K], dA_qk, dA_kk [B, T, HV, chunk] (fp32; masked as the forward's).
    """
    batch, length, heads, dk = q.shape
    dv, value_heads = v.shape[3], v.shape[2]
    group = value_heads // heads
    compute_dtype, precision = dot_settings(q.dtype, interpret)

    def rows_spec(width, head=lambda h: h):
        return pl.BlockSpec((None, chunk, None, width), lambda t, h, b: (b, t, head(h), 0))

    state_spec = pl.BlockSpec((None, None, None, dk, dv), lambda t, h, b: (b, t, h, 0, 0))
    beta_spec = pl.BlockSpec((None, chunk, None), lambda t, h, b: (b, t, h))
    token_shape = (batch, length, value_heads)
    f32 = jnp.float32
    kernel = functools.partial(
        _grad_kernel, compute_dtype=compute_dtype, precision=precision,
        fp32_precision=solve_precision(interpret, q.dtype),
    )
    return pl.pallas_call(
        kernel,
        grid=(length // chunk, value_heads, batch),
        in_specs=[
            rows_spec(dk, lambda h: h // group), rows_spec(dk, lambda h: h // group), rows_spec(dv), rows_spec(dk),
            beta_spec, rows_spec(chunk), state_spec, state_spec, rows_spec(dv), rows_spec(dv), rows_spec(dv),
        ],
        out_specs=[
            rows_spec(dk), rows_spec(dk), rows_spec(dv), beta_spec, rows_spec(dk), rows_spec(chunk), rows_spec(chunk),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((*token_shape, dk), f32),  # dq
            jax.ShapeDtypeStruct((*token_shape, dk), f32),  # dk
            jax.ShapeDtypeStruct((*token_shape, dv), v.dtype),  # dv
            jax.ShapeDtypeStruct(token_shape, f32),  # dbeta
            jax.ShapeDtypeStruct((*token_shape, dk), f32),  # dG
            jax.ShapeDtypeStruct((*token_shape, chunk), f32),  # dA_qk
            jax.ShapeDtypeStruct((*token_shape, chunk), f32),  # dA_kk
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_grad",
    )(q, k, v, g, beta, inverse, h, dh, v_new, dv_new, d_out)
