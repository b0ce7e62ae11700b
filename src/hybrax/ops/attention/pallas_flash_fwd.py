"""Flash attention forward in Pallas (Triton lowering): the output and each query row's logsumexp.

One program per (row block, batch, kv head) keeps its [block_q, D] query rows (positions x the group's heads,
`pallas_flash_tiles`) in registers and runs the online softmax over the key blocks its window can see
(`Geometry.key_blocks`). Attention sinks start each row's running max and denominator (they join it without
a value); a row that sees no key and no sink writes zeros and a logsumexp of +inf, so that the backward's
weights exp(logit - lse) are 0 there.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from hybrax.ops.attention.pallas_flash_tiles import Extras, Geometry, extras_specs, masked_loop, online_softmax
from hybrax.ops.pallas_shared import dot_settings, mm, pallas_call


def _forward_kernel(*refs, geometry: Geometry, has_sinks: bool, interpret: bool) -> None:
    q_ref, k_ref, v_ref, *rest = refs
    extras, rest = Extras.take(geometry, rest)
    if has_sinks:
        sink_max_ref, sink_sum_ref, *rest = rest
    out_ref, lse_ref = rest
    block_q, block_k = geometry.block_q, geometry.block_k
    dtype, precision = dot_settings(q_ref.dtype, interpret)
    q_block = pl.program_id(0)
    q = q_ref[...]
    rows = slice(None)  # the program's rows are its whole blocks of the extras
    row_hashes = geometry.dropout_rows(extras, pl.program_id(1), pl.program_id(2), q_block)

    def step(k_block: jax.Array, carry: tuple, masked: bool) -> tuple:
        row_max, row_sum, acc = carry
        keys = pl.ds(k_block * block_k, block_k)
        logits, _ = geometry.logits(q, k_ref[keys, :], extras, rows, keys, dtype, precision)
        if masked:
            logits = jnp.where(geometry.visible(q_block, k_block, extras, rows, keys), logits, -jnp.inf)
        new_max, row_sum, weights, rescale = online_softmax(row_max, row_sum, logits)
        # Dropout after the normalization: the denominator counts every weight, the values only the kept ones.
        kept = geometry.dropout(geometry.dropout_keep(row_hashes, k_block), weights)
        acc = acc * rescale[:, None] + mm(kept, v_ref[keys, :], dtype, precision)
        return new_max, row_sum, acc

    if has_sinks:
        start = (sink_max_ref[...], sink_sum_ref[...])
    else:
        start = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32))
    acc = jnp.zeros((block_q, out_ref.shape[-1]), jnp.float32)
    bounds = geometry.key_blocks(q_block)
    row_max, row_sum, acc = masked_loop(bounds, geometry.whole_key_blocks(q_block, *bounds), step, (*start, acc))
    seen_any = row_sum > 0
    out_ref[...] = (acc / jnp.where(seen_any, row_sum, 1.0)[:, None]).astype(out_ref.dtype)
    lse_ref[...] = jnp.where(seen_any, row_max + jnp.log(row_sum), jnp.inf)


@functools.partial(jax.jit, static_argnames=("geometry", "num_warps", "num_stages", "interpret"))
def flash_forward(
    q: Float[Array, "B KV R D"],
    k: Float[Array, "B Tk KV D"],
    v: Float[Array, "B Tk KV Dv"],
    extras: Extras,
    sink_max: Float[Array, "KV R"] | None,
    sink_sum: Float[Array, "KV R"] | None,
    *,
    geometry: Geometry,
    num_warps: int,
    num_stages: int,
    interpret: bool,
) -> tuple[Float[Array, "B KV R Dv"], Float[Array, "B KV R"]]:
    """(out, lse) by query row (R = q_len * group rows per kv head; extras and sinks by row), the rows and Tk
    padded to whole blocks and the head dims to powers of two."""
    batch, kv_heads, rows, head_dim = q.shape
    kv_len, v_dim = k.shape[1], v.shape[3]
    block_q = geometry.block_q
    extra_arrays, extra_specs = extras_specs(geometry, extras, rows, kv_len, per_row_block=True)
    arrays = [q, k, v, *extra_arrays]
    in_specs = [
        pl.BlockSpec((None, None, block_q, head_dim), lambda i, b, h: (b, h, i, 0)),
        pl.BlockSpec((None, kv_len, None, head_dim), lambda i, b, h: (b, 0, h, 0)),
        pl.BlockSpec((None, kv_len, None, v_dim), lambda i, b, h: (b, 0, h, 0)),
        *extra_specs,
    ]
    if sink_max is not None:
        arrays += [sink_max, sink_sum]
        in_specs += [pl.BlockSpec((None, block_q), lambda i, b, h: (h, i))] * 2
    kernel = functools.partial(_forward_kernel, geometry=geometry, has_sinks=sink_max is not None,
                               interpret=interpret)
    return pallas_call(
        kernel,
        grid=(rows // block_q, batch, kv_heads),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, block_q, v_dim), lambda i, b, h: (b, h, i, 0)),
                   pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[jax.ShapeDtypeStruct((batch, kv_heads, rows, v_dim), q.dtype),
                   jax.ShapeDtypeStruct((batch, kv_heads, rows), jnp.float32)],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="hybrax_flash_attention_fwd",
    )(*arrays)
