"""KDA chunked forward, stage 0 (Pallas, Triton lowering): the chunk-local cumulative log decay.

G[t] = sum of g over the tokens of t's chunk up to and including t, in fp32 (with `reverse`: from t to
the chunk's end, the backward's map from dG to dg). One program per (chunk, value head, batch);
memory-bound (one read, one write). XLA's own cumsum on the GPU may
lower to an O(C^2) reduce-window; this is one pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from hybrax.ops.kda.pallas_tiles import (
    PackedChunks, chunk_rows_spec, chunk_window, packed_chunk_specs, split_packed, token_rows_spec,
)
from hybrax.ops.pallas_shared import pallas_call


def _cumsum_kernel(g_ref, *refs, reverse: bool, chunk: int):
    """Row by row in straight-line code: each thread carries its channels down (or up) the chunk, so the
    sum needs no exchange between threads, no shared memory and no barrier, and every row's load can be
    issued ahead. (A scan over the [C, K] tile went through shared memory, 32 KB per program, which held
    an H200 SM to six programs at 3.2 TB/s.) Launched heads first (`pallas_tiles`); 4 warps: alone 2 warps
    were as fast, inside the forward 4 were 0.003-0.005 ms faster at (1, 8192, 32, 128) (BENCHMARKS.md)."""
    packed_refs, (out_ref,) = split_packed(refs, len(refs) == 3)
    g = chunk_window(g_ref, packed_refs, chunk)
    rows = range(chunk - 1, -1, -1) if reverse else range(chunk)
    loaded = [g[row, :].astype(jnp.float32) for row in rows]
    total = jnp.zeros_like(loaded[0])
    for row, values in zip(rows, loaded):
        total = total + values
        out_ref[row, :] = total


@functools.partial(jax.jit, static_argnames=("chunk", "reverse", "num_warps", "interpret"))
def chunk_local_cumsum(
    g: Float[Array, "B T HV K"], packed: PackedChunks | None = None, *, chunk: int, reverse: bool = False,
    num_warps: int = 4, interpret: bool = False,
) -> Float[Array, "B T HV K"]:
    """G [B, T, HV, K] fp32; T a multiple of `chunk`, K a power of two. With `packed` g holds packed
    sequences ([1, T, HV, K], any T) and G comes in the padded layout, [1, NT * chunk, HV, K]."""
    batch, length, heads, dk = g.shape
    n_chunks = length // chunk if packed is None else packed.start.shape[0]
    in_specs = [token_rows_spec(chunk, dk, packed_length=None if packed is None else length),
                *packed_chunk_specs(packed, n_chunks)]
    return pallas_call(
        functools.partial(_cumsum_kernel, reverse=reverse, chunk=chunk),
        grid=(heads, n_chunks, batch),
        in_specs=in_specs,
        out_specs=chunk_rows_spec(chunk, dk),
        out_shape=jax.ShapeDtypeStruct((batch, n_chunks * chunk, heads, dk), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_cumsum",
    )(g, *(packed or ()))
