"""Flash attention forward in Pallas (Triton lowering): the output and each query row's logsumexp.

One program per (query block, batch, query head) keeps its [block_q, D] queries in registers and runs the
online softmax over the key blocks its window can see (`Geometry.key_blocks`), reading them from the kv
head its group shares. Attention sinks start the running max and denominator (they join it without a
value); a row that sees no key and no sink writes zeros and a logsumexp of +inf, so that the backward's
weights exp(logit - lse) are 0 there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from hybrax.ops.attention.pallas_flash_tiles import Geometry
from hybrax.ops.pallas_shared import dot_settings, mm


def _forward_kernel(*refs, geometry: Geometry, has_sinks: bool, interpret: bool) -> None:
    q_ref, k_ref, v_ref, *rest = refs
    q_segment_ref = kv_segment_ref = None
    if geometry.has_segments:
        q_segment_ref, kv_segment_ref, *rest = rest
    if has_sinks:
        sink_max_ref, sink_sum_ref, *rest = rest
    out_ref, lse_ref = rest
    block_q, block_k = geometry.block_q, geometry.block_k
    dtype, precision = dot_settings(q_ref.dtype, interpret)
    q_block = pl.program_id(0)
    q = q_ref[...]
    q_segments = None if q_segment_ref is None else q_segment_ref[...]

    def step(k_block: jax.Array, carry: tuple) -> tuple:
        row_max, row_sum, acc = carry
        keys = pl.ds(k_block * block_k, block_k)
        kv_segments = None if kv_segment_ref is None else kv_segment_ref[keys]
        logits, _ = geometry.logits(q, k_ref[keys, :], dtype, precision)
        logits = jnp.where(geometry.visible(q_block, k_block, q_segments, kv_segments), logits, -jnp.inf)
        new_max = jnp.maximum(row_max, jnp.max(logits, axis=1))
        shift = jnp.where(new_max == -jnp.inf, 0.0, new_max)  # rows that have seen nothing yet: no inf - inf
        weights = jnp.exp(logits - shift[:, None])
        rescale = jnp.exp(row_max - shift)
        row_sum = row_sum * rescale + jnp.sum(weights, axis=1)
        acc = acc * rescale[:, None] + mm(weights, v_ref[keys, :], dtype, precision)
        return new_max, row_sum, acc

    if has_sinks:
        start = (jnp.broadcast_to(sink_max_ref[...], (block_q,)), jnp.broadcast_to(sink_sum_ref[...], (block_q,)))
    else:
        start = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc = jnp.zeros((block_q, out_ref.shape[-1]), jnp.float32)
    first, end = geometry.key_blocks(q_block)
    row_max, row_sum, acc = lax.fori_loop(first, end, step, (*start, acc))
    seen_any = row_sum > 0
    out_ref[...] = (acc / jnp.where(seen_any, row_sum, 1.0)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen_any, row_max + jnp.log(row_sum), jnp.inf)


@functools.partial(jax.jit, static_argnames=("geometry", "num_warps", "num_stages", "interpret"))
def flash_forward(
    q: Float[Array, "B Tq H D"],
    k: Float[Array, "B Tk KV D"],
    v: Float[Array, "B Tk KV Dv"],
    q_segments: Int[Array, "B Tq"] | None,
    kv_segments: Int[Array, "B Tk"] | None,
    sink_max: Float[Array, "H 1"] | None,
    sink_sum: Float[Array, "H 1"] | None,
    *,
    geometry: Geometry,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[Float[Array, "B Tq H Dv"], Float[Array, "B H Tq"]]:
    """(out, lse) of inputs padded to whole blocks (Tq, Tk) and to power-of-two head dims."""
    batch, q_len, heads, head_dim = q.shape
    kv_len, v_dim = k.shape[1], v.shape[3]
    group = geometry.group
    arrays = [q, k, v]
    in_specs = [
        pl.BlockSpec((None, geometry.block_q, None, head_dim), lambda i, b, h: (b, i, h, 0)),
        pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, h // group, 0)),
        pl.BlockSpec((None, kv_len, None, v_dim), lambda i, b, h: (b, 0, h // group, 0)),
    ]
    if geometry.has_segments:
        arrays += [q_segments, kv_segments]
        in_specs += [pl.BlockSpec((None, geometry.block_q), lambda i, b, h: (b, i)),
                     pl.BlockSpec((None, kv_len), lambda i, b, h: (b, 0))]
    if sink_max is not None:
        arrays += [sink_max, sink_sum]
        in_specs += [pl.BlockSpec((None, 1), lambda i, b, h: (h, 0))] * 2
    kernel = functools.partial(_forward_kernel, geometry=geometry, has_sinks=sink_max is not None,
                               interpret=interpret)
    return pl.pallas_call(
        kernel,
        grid=(q_len // geometry.block_q, batch, heads),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, geometry.block_q, None, v_dim), lambda i, b, h: (b, i, h, 0)),
                   pl.BlockSpec((None, None, geometry.block_q), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((batch, q_len, heads, v_dim), q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="hybrax_flash_attention_fwd",
    )(*arrays)
