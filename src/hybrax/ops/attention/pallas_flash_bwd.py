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
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from hybrax.ops.attention.pallas_flash_tiles import Geometry, masked_loop
from hybrax.ops.pallas_shared import dot_settings, mm, mm_t, mm_tn


def _tile_grads(geometry: Geometry, q_block, k_block, q, k, v, d_out, lse, delta, q_segments, kv_segments,
                dtype, precision, masked: bool) -> tuple[jax.Array, jax.Array]:
    """(weights W, logit cotangents dS) of one [block_q, block_k] tile, fp32; `masked`: apply visibility."""
    logits, tanh = geometry.logits(q, k, dtype, precision)
    weights = jnp.exp(logits - lse[:, None])
    if masked:
        weights = jnp.where(geometry.visible(q_block, k_block, q_segments, kv_segments), weights, 0.0)
    d_logits = weights * (mm_t(d_out, v, dtype, precision) - delta[:, None])
    if tanh is not None:
        d_logits = d_logits * (1.0 - tanh * tanh)
    return weights, d_logits


def _unpack(refs: tuple, has_segments: bool) -> tuple:
    q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, *rest = refs
    q_segment_ref = kv_segment_ref = None
    if has_segments:
        q_segment_ref, kv_segment_ref, *rest = rest
    return (q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, q_segment_ref, kv_segment_ref), rest


def _dq_kernel(*refs, geometry: Geometry, interpret: bool) -> None:
    (q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, q_segment_ref, kv_segment_ref), (dq_ref,) = _unpack(
        refs, geometry.has_segments)
    dtype, precision = dot_settings(q_ref.dtype, interpret)
    q_block = pl.program_id(0)
    q, d_out, lse, delta = q_ref[...], d_out_ref[...], lse_ref[...], delta_ref[...]
    q_segments = None if q_segment_ref is None else q_segment_ref[...]

    def step(k_block: jax.Array, dq: jax.Array, masked: bool) -> jax.Array:
        keys = pl.ds(k_block * geometry.block_k, geometry.block_k)
        k = k_ref[keys, :]
        kv_segments = None if kv_segment_ref is None or not masked else kv_segment_ref[keys]
        _, d_logits = _tile_grads(geometry, q_block, k_block, q, k, v_ref[keys, :], d_out, lse, delta,
                                  q_segments, kv_segments, dtype, precision, masked)
        return dq + mm(d_logits, k, dtype, precision)

    bounds = geometry.key_blocks(q_block)
    dq = masked_loop(bounds, geometry.whole_key_blocks(q_block, *bounds), step, jnp.zeros(q.shape, jnp.float32))
    dq_ref[...] = (dq * geometry.scale).astype(dq_ref.dtype)


def _dkdv_kernel(*refs, geometry: Geometry, interpret: bool) -> None:
    (q_ref, k_ref, v_ref, d_out_ref, lse_ref, delta_ref, q_segment_ref, kv_segment_ref), (dk_ref, dv_ref) = _unpack(
        refs, geometry.has_segments)
    dtype, precision = dot_settings(q_ref.dtype, interpret)
    k_block = pl.program_id(0)
    k, v = k_ref[...], v_ref[...]
    kv_segments = None if kv_segment_ref is None else kv_segment_ref[...]

    def step(q_block: jax.Array, carry: tuple, masked: bool) -> tuple:
        dk, dv = carry
        rows = pl.ds(q_block * geometry.block_q, geometry.block_q)
        q, d_out = q_ref[rows, :], d_out_ref[rows, :]
        q_segments = None if q_segment_ref is None or not masked else q_segment_ref[rows]
        weights, d_logits = _tile_grads(geometry, q_block, k_block, q, k, v, d_out, lse_ref[rows],
                                        delta_ref[rows], q_segments, kv_segments, dtype, precision, masked)
        return dk + mm_tn(d_logits, q, dtype, precision), dv + mm_tn(weights, d_out, dtype, precision)

    bounds = geometry.query_blocks(k_block)
    zeros = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = masked_loop(bounds, geometry.whole_query_blocks(k_block, *bounds), step, zeros)
    dk_ref[...] = (dk * geometry.scale).astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _specs(geometry: Geometry, head_dim: int, v_dim: int, rows: int, kv_len: int, per_query_block: bool):
    """Block specs of (q, k, v, dO, lse, delta[, q segments, kv segments]) on the grid (block, batch, kv head):
    the looping side's rows whole, the other side's rows by program."""
    q_rows = geometry.block_q if per_query_block else rows
    kv_rows = kv_len if per_query_block else geometry.block_k

    def q_index(i, b, h):
        return (b, h, i if per_query_block else 0, 0)

    def kv_index(i, b, h):
        return (b, 0 if per_query_block else i, h, 0)

    def row_index(i, b, h):
        return (b, h, i if per_query_block else 0)

    specs = [
        pl.BlockSpec((None, None, q_rows, head_dim), q_index),
        pl.BlockSpec((None, kv_rows, None, head_dim), kv_index),
        pl.BlockSpec((None, kv_rows, None, v_dim), kv_index),
        pl.BlockSpec((None, None, q_rows, v_dim), q_index),
        pl.BlockSpec((None, None, q_rows), row_index),
        pl.BlockSpec((None, None, q_rows), row_index),
    ]
    if geometry.has_segments:
        specs += [pl.BlockSpec((None, q_rows), lambda i, b, h: (b, i if per_query_block else 0)),
                  pl.BlockSpec((None, kv_rows), lambda i, b, h: (b, 0 if per_query_block else i))]
    return specs


_STATIC = ("geometry", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_backward_dq(
    q: Float[Array, "B KV R D"], k: Float[Array, "B Tk KV D"], v: Float[Array, "B Tk KV Dv"],
    d_out: Float[Array, "B KV R Dv"], lse: Float[Array, "B KV R"], delta: Float[Array, "B KV R"],
    q_segments: Int[Array, "B R"] | None, kv_segments: Int[Array, "B Tk"] | None,
    *, geometry: Geometry, num_warps: int, num_stages: int, interpret: bool,
) -> Float[Array, "B KV R D"]:
    """dQ by query row, in the layout of `pallas_flash_fwd.flash_forward`."""
    batch, kv_heads, rows, head_dim = q.shape
    arrays = [q, k, v, d_out, lse, delta] + ([q_segments, kv_segments] if geometry.has_segments else [])
    return pl.pallas_call(
        functools.partial(_dq_kernel, geometry=geometry, interpret=interpret),
        grid=(rows // geometry.block_q, batch, kv_heads),
        in_specs=_specs(geometry, head_dim, v.shape[3], rows, k.shape[1], per_query_block=True),
        out_specs=pl.BlockSpec((None, None, geometry.block_q, head_dim), lambda i, b, h: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="hybrax_flash_attention_bwd_dq",
    )(*arrays)


@functools.partial(jax.jit, static_argnames=_STATIC)
def flash_backward_dkdv(
    q: Float[Array, "B KV R D"], k: Float[Array, "B Tk KV D"], v: Float[Array, "B Tk KV Dv"],
    d_out: Float[Array, "B KV R Dv"], lse: Float[Array, "B KV R"], delta: Float[Array, "B KV R"],
    q_segments: Int[Array, "B R"] | None, kv_segments: Int[Array, "B Tk"] | None,
    *, geometry: Geometry, num_warps: int, num_stages: int, interpret: bool,
) -> tuple[Float[Array, "B Tk KV D"], Float[Array, "B Tk KV Dv"]]:
    """(dK, dV) in the inputs' dtype."""
    batch, kv_heads, rows, head_dim = q.shape
    kv_len, v_dim = k.shape[1], v.shape[3]
    arrays = [q, k, v, d_out, lse, delta] + ([q_segments, kv_segments] if geometry.has_segments else [])
    return pl.pallas_call(
        functools.partial(_dkdv_kernel, geometry=geometry, interpret=interpret),
        grid=(kv_len // geometry.block_k, batch, kv_heads),
        in_specs=_specs(geometry, head_dim, v_dim, rows, kv_len, per_query_block=False),
        out_specs=[pl.BlockSpec((None, geometry.block_k, None, head_dim), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, geometry.block_k, None, v_dim), lambda i, b, h: (b, i, h, 0))],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="hybrax_flash_attention_bwd_dkdv",
    )(*arrays)
