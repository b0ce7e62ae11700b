"""Attention of a few new tokens per request against its row of a KV cache pool, read in place (Pallas,
Triton lowering): flash decoding over the pool by slot.

One program per (split of the keys, block of query rows, request, kv head) loads its request's slot, cached
length and new-token count, and runs the online softmax over its split of the row's key blocks; the query rows
are the new tokens times the heads of the group (row r: token r // group, head r % group), so a decode step
fills a block with the group's heads. The pool is indexed by slot inside the kernel, never gathered. Each
program writes its split's (output, logsumexp); `combine_splits` merges the splits and adds the sinks. A token
at position p = cached + t sees keys j <= p (and j >= p - window); slot -1 (or any other row the pool lacks)
and tokens past the new count see nothing.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float, Int

from hybrax.ops.attention.pallas_flash_tiles import online_softmax
from hybrax.ops.pallas_shared import dot_settings, mm, mm_t, pallas_call


class PoolGeometry(NamedTuple):
    """Static description of one call (hashable)."""

    rows: int  # real query rows per kv head: tokens x group
    group: int
    block_q: int
    block_k: int
    num_splits: int
    blocks_per_split: int
    window: int | None
    scale: float
    soft_cap: float | None

    @property
    def row_blocks(self) -> int:
        return -(-self.rows // self.block_q)


def _kernel(slots_ref, cached_ref, new_ref, q_ref, k_pool_ref, v_pool_ref, out_ref, lse_ref, *,
            geometry: PoolGeometry, interpret: bool) -> None:
    index, b, head = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    split, row_block = index // geometry.row_blocks, index % geometry.row_blocks
    block_q, block_k = geometry.block_q, geometry.block_k
    slot, cached, new = slots_ref[b], cached_ref[b], new_ref[b]
    dtype, precision = dot_settings(q_ref.dtype, interpret)
    rows = pl.ds(row_block * block_q, block_q)
    row = row_block * block_q + lax.iota(jnp.int32, block_q)
    position = cached + row // geometry.group  # each row's token position in the request's row of the pool
    in_pool = (slot >= 0) & (slot < k_pool_ref.shape[0])
    real = (row < geometry.rows) & (row // geometry.group < new) & in_pool
    q = q_ref[b, head, rows, :]
    row_slot = jnp.where(in_pool, slot, 0)  # a padded request loads nothing: its loop is empty

    def step(k_block: jax.Array, carry: tuple) -> tuple:
        row_max, row_sum, acc = carry
        keys = pl.ds(k_block * block_k, block_k)
        logits = mm_t(q, k_pool_ref[row_slot, keys, head, :], dtype, precision) * geometry.scale
        if geometry.soft_cap is not None:
            logits = geometry.soft_cap * jnp.tanh(logits / geometry.soft_cap)
        col = (k_block * block_k + lax.iota(jnp.int32, block_k))[None, :]
        seen = real[:, None] & (col <= position[:, None])
        if geometry.window is not None:
            seen &= col >= position[:, None] - geometry.window
        logits = jnp.where(seen, logits, -jnp.inf)
        new_max, row_sum, weights, rescale = online_softmax(row_max, row_sum, logits)
        acc = acc * rescale[:, None] + mm(weights, v_pool_ref[row_slot, keys, head, :], dtype, precision)
        return new_max, row_sum, acc

    # This split's key blocks, up to the last real token's position and from the first token's window.
    first = split * geometry.blocks_per_split
    end = jnp.minimum(first + geometry.blocks_per_split, (cached + new + block_k - 1) // block_k)
    end = jnp.minimum(end, k_pool_ref.shape[1] // block_k)  # never past the row, whatever the lengths say
    if geometry.window is not None:
        first = jnp.maximum(first, jnp.maximum(cached - geometry.window, 0) // block_k)
    end = jnp.where(in_pool, end, first)
    start = (jnp.full((block_q,), -jnp.inf, jnp.float32), jnp.zeros((block_q,), jnp.float32),
             jnp.zeros((block_q, out_ref.shape[-1]), jnp.float32))
    row_max, row_sum, acc = lax.fori_loop(first, end, step, start)
    seen_any = row_sum > 0
    out_ref[b, head, split, rows, :] = acc / jnp.where(seen_any, row_sum, 1.0)[:, None]
    lse_ref[b, head, split, rows] = jnp.where(seen_any, row_max + jnp.log(row_sum), -jnp.inf)


@functools.partial(jax.jit, static_argnames=("geometry", "num_warps", "interpret"))
def pool_decode_splits(
    q: Float[Array, "B KV R D"],
    k_pool: Float[Array, "S L KV D"],
    v_pool: Float[Array, "S L KV Dv"],
    slots: Int[Array, " B"],
    cached_lengths: Int[Array, " B"],
    new_lengths: Int[Array, " B"],
    *,
    geometry: PoolGeometry,
    num_warps: int,
    interpret: bool,
) -> tuple[Float[Array, "B KV N R Dv"], Float[Array, "B KV N R"]]:
    """Each split's (output, logsumexp) by query row (R padded to whole blocks), fp32; -inf: saw nothing."""
    batch, kv_heads, rows, _ = q.shape
    shape = (batch, kv_heads, geometry.num_splits, rows)
    return pallas_call(
        functools.partial(_kernel, geometry=geometry, interpret=interpret),
        grid=(geometry.num_splits * geometry.row_blocks, batch, kv_heads),
        out_shape=(jax.ShapeDtypeStruct((*shape, v_pool.shape[-1]), jnp.float32),
                   jax.ShapeDtypeStruct(shape, jnp.float32)),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="hybrax_attention_pool_decode",
    )(slots, cached_lengths, new_lengths, q, k_pool, v_pool)


def combine_splits(out: Float[Array, "B KV N R Dv"], lse: Float[Array, "B KV N R"],
                   sinks: Float[Array, "KV R S"] | None) -> Float[Array, "B KV R Dv"]:
    """The softmax over every split's keys (and the sinks, which join the denominator without a value):
    splits weighted by exp(lse - max); rows that saw nothing give zeros."""
    row_max = jnp.max(lse, axis=2)
    if sinks is not None:
        row_max = jnp.maximum(row_max, jnp.max(sinks, axis=-1)[None])
    row_max = jnp.where(jnp.isfinite(row_max), row_max, 0.0)
    weights = jnp.exp(lse - row_max[:, :, None])  # [B, KV, N, R]; 0 for splits that saw nothing
    denominator = jnp.sum(weights, axis=2)
    if sinks is not None:
        denominator = denominator + jnp.sum(jnp.exp(sinks[None] - row_max[..., None]), axis=-1)
    total = jnp.sum(weights[..., None] * out, axis=2)
    return total / jnp.where(denominator > 0, denominator, 1.0)[..., None]
