"""Flash attention backward in Pallas (Triton lowering), in two kernels that recompute the weights
exp(logit - lse) tile by tile from the forward's logsumexp:

- `flash_backward_dq`: one program per (row block, batch, kv head) loops over its key blocks.
- `flash_backward_dkdv`: one program per (key block, batch, kv head) loops over the row blocks that see it;
  the rows hold every head of the group (`pallas_flash_tiles`), so dK / dV sum the group without atomics.

With dP = dO V^T and delta = rowsum(dO * O): dS = W * (dP - delta), times cap's slope 1 - tanh^2 under a
soft cap; dQ = scale dS K, dK = scale dS^T Q, dV = W^T dO.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from hybrax.ops.attention.pallas_flash_tiles import Extras, Geometry, extras_specs, masked_loop
from hybrax.ops.pallas_shared import dot_settings, mm, mm_t, mm_tn, pallas_call


def _tile_grads(geometry: Geometry, q_block, k_block, q, k, v, d_out, lse, delta, extras: Extras, rows, keys,
                row_hashes, dtype, precision, masked: bool) -> tuple[jax.Array, jax.Array]:
    """(weights W after dropout, cotangents dS of the capped argument, which are also the bias's) of one
    [block_q, block_k] tile, fp32; `masked`: apply visibility."""
    logits, tanh = geometry.logits(q, k, extras, rows, keys, dtype, precision)
    weights = jnp.exp(logits - lse[:, None])
    if masked:
        weights = jnp.where(geometry.visible(q_block, k_block, extras, rows, keys), weights, 0.0)
    # With dropout Z: out = (W * Z) V, so dW = Z * dO V^T, and the softmax backward runs on dW.
    keep = geometry.dropout_keep(row_hashes, k_block)
    d_weights = geometry.dropout(keep, mm_t(d_out, v, dtype, precision))
    d_logits = weights * (d_weights - delta[:, None])
    if tanh is not None:
        d_logits = d_logits * (1.0 - tanh * tanh)
    return geometry.dropout(keep, weights), d_logits


def _dq_kernel(*refs, geometry: Geometry, interpret: bool) -> None:
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *rest = refs
    extras, rest = Extras.take(geometry, rest)
    dq_ref, *rest = rest
    d_bias_ref = rest[0] if geometry.has_bias else None
    dtype, precision = dot_settings(q_ref.dtype, interpret)
    q_block, block_k = pl.program_id(0), geometry.block_k
    q, d_out, lse, delta = q_ref[...], d_out_ref[...], lse_ref[...], delta_ref[...]
    rows = slice(None)
    row_hashes = geometry.dropout_rows(extras, pl.program_id(1), pl.program_id(2), q_block)

    def step(k_block: jax.Array, dq: jax.Array, masked: bool) -> jax.Array:
        keys = pl.ds(k_block * block_k, block_k)
        k = k_ref[keys, :]
        _, d_logits = _tile_grads(geometry, q_block, k_block, q, k, v_ref[keys, :], d_out, lse, delta, extras,
                                  rows, keys, row_hashes, dtype, precision, masked)
        if d_bias_ref is not None:
            d_bias_ref[:, keys] = d_logits
        return dq + mm(d_logits, k, dtype, precision)

    first, end = geometry.key_blocks(q_block)
    if d_bias_ref is not None:  # the bias's cotangent is 0 on tiles the loop skips
        def zero(k_block: jax.Array, _) -> None:
            d_bias_ref[:, pl.ds(k_block * block_k, block_k)] = jnp.zeros((geometry.block_q, block_k), jnp.float32)

        lax.fori_loop(0, first, zero, None)
        lax.fori_loop(end, geometry.num_k_blocks, zero, None)
    whole = geometry.whole_key_blocks(q_block, first, end)
    dq = masked_loop((first, end), whole, step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * geometry.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, geometry: Geometry, interpret: bool) -> None:
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *rest = refs
    extras, (dk_ref, dv_ref) = Extras.take(geometry, rest)
    dtype, precision = dot_settings(q_ref.dtype, interpret)
    k_block, batch_index, kv_head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    k, v = k_ref[...], v_ref[...]
    keys = slice(None)

    def step(q_block: jax.Array, carry: tuple, masked: bool) -> tuple:
        dk, dv = carry
        rows = pl.ds(q_block * geometry.block_q, geometry.block_q)
        q, d_out = q_ref[rows, :], d_out_ref[rows, :]
        row_hashes = geometry.dropout_rows(extras, batch_index, kv_head, q_block)
        weights, d_logits = _tile_grads(geometry, q_block, k_block, q, k, v, d_out, lse_ref[rows], delta_ref[rows],
                                        extras, rows, keys, row_hashes, dtype, precision, masked)
        return dk + mm_tn(d_logits, q, dtype, precision), dv + mm_tn(weights, d_out, dtype, precision)

    bounds = geometry.query_blocks(k_block)
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = masked_loop(bounds, geometry.whole_query_blocks(k_block, *bounds), step, zeros)
    dk_ref[...] = (dk * geometry.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(geometry: Geometry, head_dim: int, v_dim: int, rows: int, kv_len: int, per_row_block: bool):
    """Block specs of (q, k, v, dO, lse, delta) on the grid (block, batch, kv head): the looping side's rows
    whole, the other side's rows by program."""
    q_rows = geometry.block_q if per_row_block else rows
    kv_rows = kv_len if per_row_block else geometry.block_k

    def q_index(i, b, h):
        return (b, h, i if per_row_block else 0, 0)

    def kv_index(i, b, h):
        return (b, 0 if per_row_block else i, h, 0)

    def row_index(i, b, h):
        return (b, h, i if per_row_block else 0)

    return [
        pl.BlockSpec((None, None, q_rows, head_dim), q_index),
        pl.BlockSpec((None, kv_rows, None, head_dim), kv_index),
        pl.BlockSpec((None, kv_rows, None, v_dim), kv_index),
        pl.BlockSpec((None, None, q_rows, v_dim), q_index),
        pl.BlockSpec((None, None, q_rows), row_index),
        pl.BlockSpec((None, None, q_rows), row_index),
    ]


def _call(kernel, geometry: Geometry, arrays: list, extras: Extras, per_row_block: bool, out_specs, out_shape,
          num_warps: int, num_stages: int, interpret: bool, name: str):
    q, k, v = arrays[:3]
    batch, kv_heads, rows, head_dim = q.shape
    kv_len = k.shape[1]
    extra_arrays, extra_specs = extras_specs(geometry, extras, rows, kv_len, per_row_block)
    blocks = rows // geometry.block_q if per_row_block else kv_len // geometry.block_k
    return pallas_call(
        functools.partial(kernel, geometry=geometry, interpret=interpret),
        grid=(blocks, batch, kv_heads),
        in_specs=_specs(geometry, head_dim, v.shape[3], rows, kv_len, per_row_block) + extra_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=name,
    )(*arrays, *extra_arrays)


_STATIC = ("geometry", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_backward_dq(
    q: Float[Array, "B KV R D"], k: Float[Array, "B Tk KV D"], v: Float[Array, "B Tk KV Dv"],
    d_out: Float[Array, "B KV R Dv"], lse: Float[Array, "B KV R"], delta: Float[Array, "B KV R"], extras: Extras,
    *, geometry: Geometry, num_warps: int, num_stages: int, interpret: bool,
) -> tuple[Float[Array, "B KV R D"], Float[Array, "B KV R Tk"] | None]:
    """dQ by query row, in the layout of `pallas_flash_fwd.flash_forward`, and with a bias the cotangent of the
    capped argument by row and key (the bias's before its broadcast dims are summed), fp32."""
    batch, kv_heads, rows, head_dim = q.shape
    block_q, kv_len = geometry.block_q, k.shape[1]
    out_specs = [pl.BlockSpec((None, None, block_q, head_dim), lambda i, b, h: (b, h, i, 0))]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if geometry.has_bias:
        out_specs.append(pl.BlockSpec((None, None, block_q, kv_len), lambda i, b, h: (b, h, i, 0)))
        out_shape.append(jax.ShapeDtypeStruct((batch, kv_heads, rows, kv_len), jnp.float32))
    grads = _call(_dq_kernel, geometry, [q, k, v, d_out, lse, delta], extras, True, out_specs, out_shape,
                  num_warps, num_stages, interpret, "hybrax_flash_attention_bwd_dq")
    return grads[0], grads[1] if geometry.has_bias else None


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_backward_dkdv(
    q: Float[Array, "B KV R D"], k: Float[Array, "B Tk KV D"], v: Float[Array, "B Tk KV Dv"],
    d_out: Float[Array, "B KV R Dv"], lse: Float[Array, "B KV R"], delta: Float[Array, "B KV R"], extras: Extras,
    *, geometry: Geometry, num_warps: int, num_stages: int, interpret: bool,
) -> tuple[Float[Array, "B Tk KV D"], Float[Array, "B Tk KV Dv"]]:
    """(dK, dV) in the inputs' dtype."""
    head_dim, v_dim = k.shape[3], v.shape[3]
    out_specs = [pl.BlockSpec((None, geometry.block_k, None, head_dim), lambda i, b, h: (b, i, h, 0)),
                 pl.BlockSpec((None, geometry.block_k, None, v_dim), lambda i, b, h: (b, i, h, 0))]
    out_shape = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    return tuple(_call(_dkdv_kernel, geometry, [q, k, v, d_out, lse, delta], extras, False, out_specs, out_shape,
                       num_warps, num_stages, interpret, "hybrax_flash_attention_bwd_dkdv"))
