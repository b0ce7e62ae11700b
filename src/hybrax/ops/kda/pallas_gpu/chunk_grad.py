"""KDA chunked backward, the chunk-local gradients (Pallas, Triton lowering).

One program per (chunk, value head, batch); V and K are taken in slices (`block_v`, `block_k`) so
that the [K, V] state and its cotangent never sit in registers whole. The forward's chunk, from the state
h before it (X_k = beta k exp(G), X_v = beta v, T = (I + A_kk)^-1):

    qg = q exp(G),  kg = k exp(G_last - G),  decay = exp(G_last),  w = T X_k,  u = T X_v
    v_new = u - w h,   o = qg h + A_qk v_new,   h' = decay * h + kg^T v_new

With dh' and dv_new from the reverse state pass, its cotangents are

    dqg = dO h^T,  dkg = v_new dh'^T,  d decay = rowsum(dh' * h),  dw = -dv_new h^T,  du = dv_new
    dA_qk = dO v_new^T (j <= i),  dT = dw X_k^T + du X_v^T (j <= i),  dX_k = T^T dw,  dX_v = T^T du
    dA_kk = -T^T dT T^T (j < i)

and through the elementwise maps to q, k, v, beta and G (exp(G_last) ties every row's G_last to the
last row). The terms through A_kk and A_qk (pairwise decays) are left to `chunk_intra_bwd`. A steep
chunk takes exp(G), exp(G_last - G) and exp(G_last) from the per-token gates (`chunk_gates`), the same
decays summed exactly, so the same cotangents hold.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from hybrax.ops.kda.pallas_gpu.chunk_gates import EXACT_BLOCK_K, CumulativeGates, ExactGates, steep_chunk
from hybrax.ops.kda.pallas_gpu.tiles import (
    PackedChunks, chunk_column_spec, chunk_rows_spec, chunk_state_spec, chunk_windows, index_grid, packed_chunk_specs,
    pipeline_stages, split_packed, token_column_spec, token_rows_spec,
)
from hybrax.ops.pallas_shared import dot_settings, mm_t, mm_tn, pallas_call, solve_precision


def _grad_kernel(
    q_ref, k_ref, v_ref, g_ref, raw_ref, beta_ref, inverse_ref, h_ref, dh_ref, v_new_ref, dv_new_ref, d_out_ref,
    *refs, packed: bool, block_k: int, block_v: int, compute_dtype, precision, fp32_precision,
):
    packed_refs, (dq_ref, dk_ref, dv_ref, dbeta_ref, dg_ref, daqk_ref, dakk_ref) = split_packed(refs, packed)
    q_ref, k_ref, v_ref, raw_ref, beta_ref = chunk_windows(
        (q_ref, k_ref, v_ref, raw_ref, beta_ref), packed_refs, g_ref.shape[0]
    )
    chunk, dk = q_ref.shape
    dv = v_ref.shape[1]
    steep = steep_chunk(g_ref)
    betas = beta_ref[...].astype(jnp.float32)[:, None]
    inverse = inverse_ref[...].astype(jnp.float32)
    rows, cols = index_grid(chunk)
    value_slice = lambda j: pl.ds(pl.multiple_of(j * block_v, block_v), block_v)  # noqa: E731
    key_slice = lambda i, width: pl.ds(pl.multiple_of(i * width, width), width)  # noqa: E731

    def value_pass(j, sums):
        """dA_qk, the u-half of dT, dv and beta's value term, from one slice of V."""
        daqk, d_inverse, dbeta = sums
        slice_v = value_slice(j)
        d_out, v_new, dv_new = (ref[:, slice_v] for ref in (d_out_ref, v_new_ref, dv_new_ref))
        values = v_ref[:, slice_v].astype(jnp.float32)
        dx_v = mm_tn(inverse, dv_new, compute_dtype, precision)
        dv_ref[:, slice_v] = (dx_v * betas).astype(dv_ref.dtype)
        return (
            daqk + mm_t(d_out, v_new, compute_dtype, precision),
            d_inverse + mm_t(dv_new, values * betas, compute_dtype, precision),
            dbeta + jnp.sum(dx_v * values, axis=1),
        )

    def key_pass(gates, width, i, sums):
        """dqg, dkg, dw over all of V for one slice of K (`width` columns), then that slice's dq, dk, dG, with
        the decays of `gates` (`chunk_gates.CumulativeGates` or `ExactGates`)."""
        d_inverse, dbeta = sums
        slice_k = key_slice(i, width)

        def state_pass(j, partial):
            dqg, dkg, dw, d_decay = partial
            slice_v = value_slice(j)
            h, dh = h_ref[slice_k, slice_v], dh_ref[slice_k, slice_v]
            return (
                dqg + mm_t(d_out_ref[:, slice_v], h, compute_dtype, precision),
                dkg + mm_t(v_new_ref[:, slice_v], dh, compute_dtype, precision),
                dw - mm_t(dv_new_ref[:, slice_v], h, compute_dtype, precision),
                d_decay + jnp.sum(dh.astype(jnp.float32) * h.astype(jnp.float32), axis=1),
            )

        zeros = jnp.zeros((chunk, width), jnp.float32)
        dqg, dkg, dw, d_decay = lax.fori_loop(
            0, dv // block_v, state_pass, (zeros, zeros, zeros, jnp.zeros((width,), jnp.float32))
        )
        growth, to_end, total = gates.decays(gates.read(slice_k), slice_k)
        keys = k_ref[:, slice_k].astype(jnp.float32)
        x_k = keys * betas * growth
        dx_k = mm_tn(inverse, dw, jnp.float32, fp32_precision)
        dq_ref[:, slice_k] = dqg * growth
        dk_ref[:, slice_k] = dkg * to_end + dx_k * betas * growth
        kg_term = dkg * keys * to_end
        from_last = jnp.sum(kg_term, axis=0) + d_decay * total
        last_row = lax.broadcasted_iota(jnp.int32, growth.shape, 0) == chunk - 1
        queries = q_ref[:, slice_k].astype(jnp.float32)
        dg_ref[:, slice_k] = (
            dqg * queries * growth - kg_term + dx_k * x_k + jnp.where(last_row, from_last[None, :], 0.0)
        )
        return (
            d_inverse + mm_t(dw, x_k, jnp.float32, fp32_precision),
            dbeta + jnp.sum(dx_k * keys * growth, axis=1),
        )

    square = jnp.zeros((chunk, chunk), jnp.float32)
    daqk, d_inverse, dbeta = lax.fori_loop(
        0, dv // block_v, value_pass, (square, square, jnp.zeros((chunk,), jnp.float32))
    )
    daqk_ref[...] = jnp.where(rows >= cols, daqk, 0.0)
    key_passes = lambda gates, width: lax.fori_loop(  # noqa: E731
        0, dk // width, functools.partial(key_pass, gates, width), (d_inverse, dbeta)
    )
    d_inverse, dbeta = lax.cond(
        steep,
        lambda: key_passes(ExactGates(raw_ref), min(block_k, EXACT_BLOCK_K)),
        lambda: key_passes(CumulativeGates(g_ref), block_k),
    )
    d_inverse = jnp.where(rows >= cols, d_inverse, 0.0)
    dakk = -mm_tn(inverse, mm_t(d_inverse, inverse, jnp.float32, fp32_precision), jnp.float32, fp32_precision)
    dakk_ref[...] = jnp.where(rows > cols, dakk, 0.0)
    dbeta_ref[...] = dbeta


@functools.partial(jax.jit, static_argnames=("chunk", "block_k", "block_v", "num_warps", "num_stages", "interpret"))
def chunk_grad(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, raw_g: jax.Array, beta: jax.Array, inverse: jax.Array,
    h: jax.Array, dh: jax.Array, v_new: jax.Array, dv_new: jax.Array, d_out: jax.Array,
    packed: PackedChunks | None = None, *,
    chunk: int = 64,
    block_k: int = 32, block_v: int = 64, num_warps: int = 4, num_stages: int | None = None,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """q, k [B, T, H, K] (prepared); v, v_new, dv_new, dO [B, T, HV, V]; g [B, T, HV, K] (G, fp32); raw_g
    [B, T, HV, K] the per-token gates (stage 0's input, fp32: what steep chunks read); beta [B, T, HV];
    T [B, T, HV, chunk]; h, dh [B, NT, HV, K, V].

    Returns dq, dk [B, T, HV, K] fp32 (per value head), dv [B, T, HV, V] (v's dtype), dbeta [B, T, HV],
    dG [B, T, HV, K], dA_qk, dA_kk [B, T, HV, chunk] (fp32; masked as the forward's). With `packed`, q, k, v,
    raw_g and beta are packed rows read in place (`chunk_intra`); the rest and the results are padded.
    """
    batch, length, heads, dk = g.shape[0], g.shape[1], q.shape[2], q.shape[3]
    dv, value_heads = v.shape[3], v.shape[2]
    group = value_heads // heads
    compute_dtype, precision = dot_settings(q.dtype, interpret)
    packed_length = None if packed is None else q.shape[1]

    def rows_spec(width, group=1):
        return chunk_rows_spec(chunk, width, group)

    def tokens_spec(width, group=1):
        return token_rows_spec(chunk, width, group, packed_length)

    state_spec, beta_spec = chunk_state_spec(dk, dv), chunk_column_spec(chunk)
    token_shape = (batch, length, value_heads)
    f32 = jnp.float32
    kernel = functools.partial(
        _grad_kernel, packed=packed is not None, block_k=min(block_k, dk), block_v=min(block_v, dv),
        compute_dtype=compute_dtype, precision=precision, fp32_precision=solve_precision(interpret, q.dtype),
    )
    return pallas_call(
        kernel,
        grid=(value_heads, length // chunk, batch),
        in_specs=[
            tokens_spec(dk, group), tokens_spec(dk, group), tokens_spec(dv), rows_spec(dk), tokens_spec(dk),
            token_column_spec(chunk, packed_length), rows_spec(chunk), state_spec, state_spec, rows_spec(dv),
            rows_spec(dv), rows_spec(dv), *packed_chunk_specs(packed, length // chunk),
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
        compiler_params=pltriton.CompilerParams(
            num_warps=num_warps, num_stages=num_stages or pipeline_stages(q.dtype, dk)
        ),
        interpret=interpret,
        name="kda_chunk_grad",
    )(q, k, v, g, raw_g, beta, inverse, h, dh, v_new, dv_new, d_out, *(packed or ()))
