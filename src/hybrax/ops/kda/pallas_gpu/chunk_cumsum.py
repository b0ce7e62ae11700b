"""KDA chunked, stage 0 (Pallas, Triton lowering): the chunk-local cumulative log decay, and its backward.

G[t] = sum of g over the tokens of t's chunk up to and including t, in fp32, the gates clamped at -1e30 so
that G is finite for any gate <= 0 (`chunk_gates`). Its backward (`gate_gradient`) sums dG from t to
the chunk's end. One program per (chunk, value head, batch); memory-bound (one read, one write). XLA's own
cumsum on the GPU may lower to an O(C^2) reduce-window; this is one pass.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.pallas import triton as pltriton
from jaxtyping import Array, Float

from hybrax.ops.kda.pallas_gpu.chunk_gates import UNDERFLOW, clamp, steep_chunk
from hybrax.ops.kda.pallas_gpu.tiles import (
    PackedChunks, chunk_rows_spec, chunk_window, packed_chunk_specs, split_packed, token_rows_spec,
)
from hybrax.ops.pallas_shared import pallas_call


def _cumsum_kernel(g_ref, *refs, chunk: int):
    """Row by row in straight-line code: each thread carries its channels down the chunk, so the sum needs no
    exchange between threads, no shared memory and no barrier, and every row's load can be issued ahead. (A
    scan over the [C, K] tile went through shared memory, 32 KB per program, which held an H200 SM to six
    programs at 3.2 TB/s.) Launched heads first (`tiles`); 4 warps: alone 2 warps were as fast, inside
    the forward 4 were 0.003-0.005 ms faster at (1, 8192, 32, 128) (H200 measurements)."""
    packed_refs, (out_ref,) = split_packed(refs, len(refs) == 3)
    g = chunk_window(g_ref, packed_refs, chunk)
    total = jnp.zeros(g.shape[1:], jnp.float32)
    for row, gates in enumerate([clamp(g[row, :].astype(jnp.float32)) for row in range(chunk)]):
        total = total + gates
        out_ref[row, :] = total


def _gate_gradient_kernel(dg_ref, g_ref, raw_ref, *refs, chunk: int):
    """dg from dG: sums up the chunk, as `_cumsum_kernel` sums down it. A gate below UNDERFLOW decays by exactly
    0 in fp32, so its gradient is 0 (every term that holds it carries that 0), where the sum leaves the rounding
    of the terms that cancel there, which the fused gate multiplies by the gate itself (its a_log gradient): in
    a steep chunk, the only kind that holds such a gate (`chunk_gates.steep_chunk`), those rows get 0."""
    packed_refs, (out_ref,) = split_packed(refs, len(refs) == 3)
    raw = chunk_window(raw_ref, packed_refs, chunk)
    rows = range(chunk - 1, -1, -1)
    loaded = [dg_ref[row, :] for row in rows]  # issued before the steep test's reduction

    def write(steep: bool):
        total = jnp.zeros_like(loaded[0])
        for row, values in zip(rows, loaded):
            total = total + values
            out_ref[row, :] = jnp.where(raw[row, :] < UNDERFLOW, 0.0, total) if steep else total

    lax.cond(steep_chunk(g_ref), lambda: write(True), lambda: write(False))


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def chunk_local_cumsum(
    g: Float[Array, "B T HV K"], packed: PackedChunks | None = None, *, chunk: int, num_warps: int = 4,
    interpret: bool = False,
) -> Float[Array, "B T HV K"]:
    """G [B, T, HV, K] fp32; T a multiple of `chunk`, K a power of two. With `packed` g holds packed
    sequences ([1, T, HV, K], any T) and G comes in the padded layout, [1, NT * chunk, HV, K]."""
    batch, length, heads, dk = g.shape
    n_chunks = length // chunk if packed is None else packed.start.shape[0]
    in_specs = [token_rows_spec(chunk, dk, packed_length=None if packed is None else length),
                *packed_chunk_specs(packed, n_chunks)]
    return pallas_call(
        functools.partial(_cumsum_kernel, chunk=chunk),
        grid=(heads, n_chunks, batch),
        in_specs=in_specs,
        out_specs=chunk_rows_spec(chunk, dk),
        out_shape=jax.ShapeDtypeStruct((batch, n_chunks * chunk, heads, dk), jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_cumsum",
    )(g, *(packed or ()))


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "interpret"))
def gate_gradient(
    dg: Float[Array, "B T HV K"], g: Float[Array, "B T HV K"], raw_g: Float[Array, "B T2 HV K"],
    packed: PackedChunks | None = None, *, chunk: int, num_warps: int = 4, interpret: bool = False,
) -> Float[Array, "B T HV K"]:
    """The gradient of the per-token gates from dG [B, T, HV, K] (fp32, the padded layout): sums of dG from each
    row to its chunk's end, 0 for a gate below UNDERFLOW (`_gate_gradient_kernel`). g: G (`chunk_local_cumsum`);
    raw_g: its input, padded as dG, or with `packed` the packed rows ([1, T2, HV, K], read in place)."""
    batch, length, heads, dk = dg.shape
    n_chunks = length // chunk
    rows = chunk_rows_spec(chunk, dk)
    in_specs = [rows, rows, token_rows_spec(chunk, dk, packed_length=None if packed is None else raw_g.shape[1]),
                *packed_chunk_specs(packed, n_chunks)]
    return pallas_call(
        functools.partial(_gate_gradient_kernel, chunk=chunk),
        grid=(heads, n_chunks, batch),
        in_specs=in_specs,
        out_specs=rows,
        out_shape=jax.ShapeDtypeStruct(dg.shape, jnp.float32),
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_chunk_gate_gradient",
    )(dg, g, raw_g, *(packed or ()))
