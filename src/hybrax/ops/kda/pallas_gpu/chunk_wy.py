"""KDA chunked backward's recompute of stage 1's second half (Pallas, Triton lowering): the WY form and
the decayed keys and queries from a stored T. The forward computes them inside `chunk_intra`.

One program per (chunk, value head, batch), [C, C] x [C, K | V] matmuls:

    w  = T (beta k exp(G)),  u = T (beta v)         T = (I + A_kk)^-1
    kg = k exp(G_last - G)                          keys decayed to the chunk's end (state update)
    qg = q exp(G)                                   queries decayed from the chunk's start (output)
    decay = exp(G_last)                             the chunk's total per-channel decay

Steep chunks take the decays from the per-token gates instead of G (`chunk_gates`).
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
    PackedChunks, chunk_rows_spec, chunk_windows, packed_chunk_specs, split_packed, token_column_spec, token_rows_spec,
)
from hybrax.ops.pallas_shared import dot_settings, mm, pallas_call


def write_wy(
    gates, inverse, betas, q_ref, k_ref, v_ref, w_ref, u_ref, kg_ref, qg_ref, decay_ref,
    *, query_rows, key_rows, block_k: int, block_v: int, compute_dtype, precision,
) -> None:
    """Stores w, u, kg, qg and decay of one chunk from its T (`inverse` [C, C]) and betas ([C, 1] fp32),
    K and V taken in slices of `block_k` and `block_v` columns; rows of q and k times `query_rows` and
    `key_rows` ([C, 1] or 1.0: stage 1 normalizes them here); the decays from `gates`
    (`chunk_gates.CumulativeGates`, or `ExactGates` in a steep chunk)."""
    inverse = inverse.astype(compute_dtype)  # once for every slice's dot (bf16: half the registers)

    slices = q_ref.shape[1] // block_k

    def key_cols(index):  # the slice's columns (a Python int index is already a known multiple)
        start = index * block_k
        return pl.ds(start if isinstance(index, int) else pl.multiple_of(start, block_k), block_k)

    def plain_reads(index):
        """A slice's gates (G and its last row; the per-token gates are read as they are summed) and queries.
        Read a slice ahead (carried): Triton copies ahead only the dots' operands, and ptxas moves no load across
        the barriers of the dot, so read where they are used these waited out a memory round trip per slice."""
        cols = key_cols(index)
        return gates.read(cols), q_ref[:, cols]

    def keys_slice(index, ahead):
        cols = key_cols(index)
        (loaded, queries), ahead = ahead, plain_reads(jnp.minimum(index + 1, slices - 1))
        growth, to_end, total = gates.decays(loaded, cols)
        keys = k_ref[:, cols].astype(jnp.float32) * key_rows
        w_ref[:, cols] = mm(inverse, keys * betas * growth, compute_dtype, precision).astype(w_ref.dtype)
        kg_ref[:, cols] = (keys * to_end).astype(kg_ref.dtype)
        qg_ref[:, cols] = (queries.astype(jnp.float32) * query_rows * growth).astype(qg_ref.dtype)
        decay_ref[cols] = total
        return ahead

    def values_slice(index, carry):
        cols = pl.ds(pl.multiple_of(index * block_v, block_v), block_v)
        values = v_ref[:, cols].astype(jnp.float32)
        u_ref[:, cols] = mm(inverse, values * betas, compute_dtype, precision).astype(u_ref.dtype)
        return carry

    lax.fori_loop(0, slices, keys_slice, plain_reads(0))
    lax.fori_loop(0, v_ref.shape[1] // block_v, values_slice, 0)


def write_wy_either(steep, g_ref, raw_ref, *args, block_k: int, **options) -> None:
    """`write_wy` from G (g_ref) or, in a `steep` chunk, from the per-token gates (raw_ref) in slices of at most
    EXACT_BLOCK_K columns: two whole branches."""
    lax.cond(
        steep,
        lambda: write_wy(ExactGates(raw_ref), *args, block_k=min(block_k, EXACT_BLOCK_K), **options),
        lambda: write_wy(CumulativeGates(g_ref), *args, block_k=block_k, **options),
    )


def wy_specs(chunk: int, length: int, q: jax.Array, v: jax.Array) -> tuple[list, list]:
    """Out specs and shapes of w, u, kg, qg [B, T, HV, K | V] (q's dtype) and decay [B, T/C, HV, K] (fp32),
    T = `length`."""
    batch, _, _, dk = q.shape
    value_heads, dv = v.shape[2:]
    tokens = (batch, length, value_heads)
    specs = [chunk_rows_spec(chunk, width) for width in (dk, dv, dk, dk)]
    specs.append(pl.BlockSpec((None, None, None, dk), lambda h, t, b: (b, t, h, 0)))
    shapes = [jax.ShapeDtypeStruct((*tokens, width), q.dtype) for width in (dk, dv, dk, dk)]
    shapes.append(jax.ShapeDtypeStruct((batch, length // chunk, value_heads, dk), jnp.float32))
    return specs, shapes


def _wy_kernel(
    q_ref, k_ref, v_ref, g_ref, raw_ref, beta_ref, inverse_ref, *refs, packed: bool, compute_dtype, precision
):
    packed_refs, out_refs = split_packed(refs, packed)
    chunk = g_ref.shape[0]
    q_ref, k_ref, v_ref, raw_ref, beta_ref = chunk_windows((q_ref, k_ref, v_ref, raw_ref, beta_ref), packed_refs, chunk)
    options = dict(query_rows=1.0, key_rows=1.0, block_v=v_ref.shape[1], compute_dtype=compute_dtype,
                   precision=precision)

    def write(gates, block_k):  # T and beta read in each branch: nothing live across them
        betas = beta_ref[...].astype(jnp.float32)[:, None]
        write_wy(gates, inverse_ref[...], betas, q_ref, k_ref, v_ref, *out_refs, block_k=block_k, **options)

    lax.cond(
        steep_chunk(g_ref),
        lambda: write(ExactGates(raw_ref), min(q_ref.shape[1], EXACT_BLOCK_K)),
        lambda: write(CumulativeGates(g_ref), q_ref.shape[1]),
    )


@functools.partial(jax.jit, static_argnames=("chunk", "num_warps", "num_stages", "interpret"))
def chunk_wy(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, raw_g: jax.Array, beta: jax.Array, inverse: jax.Array,
    packed: PackedChunks | None = None, *, chunk: int = 64, num_warps: int = 4, num_stages: int = 1,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """q, k [B, T, H, K]; v [B, T, HV, V]; g [B, T, HV, K] (G, fp32); raw_g [B, T, HV, K] the per-token gates
    (stage 0's input, fp32: what steep chunks read); beta [B, T, HV]; T [B, T, HV, chunk].

    Returns w, kg, qg [B, T, HV, K]; u [B, T, HV, V] (the inputs' dtype); decay [B, T/chunk, HV, K] fp32.
    With `packed`, q, k, v, raw_g and beta are packed rows read in place (`chunk_intra`).
    """
    dk, dv = q.shape[3], v.shape[3]
    length = g.shape[1]
    group = v.shape[2] // q.shape[2]
    compute_dtype, precision = dot_settings(q.dtype, interpret)
    rows = functools.partial(chunk_rows_spec, chunk)
    packed_length = None if packed is None else q.shape[1]
    tokens = functools.partial(token_rows_spec, chunk, packed_length=packed_length)
    out_specs, out_shape = wy_specs(chunk, length, q, v)
    return pallas_call(
        functools.partial(_wy_kernel, packed=packed is not None, compute_dtype=compute_dtype, precision=precision),
        grid=(v.shape[2], length // chunk, q.shape[0]),
        in_specs=[
            tokens(dk, group), tokens(dk, group), tokens(dv), rows(dk), tokens(dk),
            token_column_spec(chunk, packed_length), rows(chunk), *packed_chunk_specs(packed, length // chunk),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="kda_chunk_wy",
    )(q, k, v, g, raw_g, beta, inverse, *(packed or ()))
