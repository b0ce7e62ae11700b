"""KDA chunked forward on the TPU: one Pallas Mosaic kernel over the grid (batch, block of value heads, chunk).

Each step reads one chunk of C tokens of `block_heads` value heads (q, k [C, K], v [C, V], the log decays,
beta per head) and does, per head, in VMEM:

    q, k L2-normalized (when asked), q scaled                              fp32, VPU
    the gate sums within the chunk (`chunk_gates`)                        VPU, no difference of cumsums
    A_qk, A_kk and T = (I + beta A_kk)^-1 (`chunk_intra`)                  MXU, [C, C] tiles
    w = T (beta k exp(G)), u = T (beta v), qg = q exp(G), kg = k exp(G_C - G)
    o = qg S + A_qk v_new, S <- exp(G_C) S + kg^T v_new (`chunk_state`)     MXU, S in a VMEM scratch

The chunk axis is the grid's last ("arbitrary": in order), so each head's fp32 state S lives in VMEM from
a sequence's first chunk, where it is loaded from the initial state, to its last, where it is written out as
the final state: the batch row's first and last chunk, or, with packed sequences, those the chunk info names
(`layout`: scalar-prefetched, it also picks the initial and final state blocks of each chunk's sequence).
The heads of one step are independent chains of small matmuls, unrolled into one basic block, so that the
scheduler overlaps them (one head's chain leaves the MXU idle while each product drains).

Layout: the [B, T, heads, D] inputs are read as [B, T', heads * D] (a free reshape), one [C, block * D]
block per step, so every block is lane-dense; K and V are padded to 128 (zero keys, gates and values
leave the state untouched) and T to the chunk, or packed sequences each to whole chunks (`layout.Rows`).
Per-head decays and beta come as [B, HV, T', 1] columns (a small transpose). With `with_states` the kernel
also writes the state entering each chunk (what the backward kernel, `chunk_bwd`, takes).

On a TPU v5e (JAX 0.10.2), bf16 (1, 8192, 16, 128), per-channel decay: 4.31 ms at chunk 128 with 4 heads per
step (3.94 with one-pass scores and solve), 5.04 at chunk 64, against 20.8 for XLA chunked; errors against
XLA on fp32 inputs 3.3e-3 (output) and 2.9e-3 (final state). The MXU's throughput does not bound it (the
3-pass solve's twice as many products cost 9%); the rest (vector work, VMEM traffic, the products' latency)
is not yet attributed: the machine has no profiler (benchmarks/results/tpu_v5_lite).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jaxtyping import Array, Float, Int

from hybrax.ops.kda.base import L2_EPS
from hybrax.ops.kda.pallas_tpu.chunk_gates import SUB, ChunkGates, chunk_gates
from hybrax.ops.kda.pallas_tpu.chunk_intra import (
    factored_scores, index_grid, is_steep, unit_lower_inverse, with_exact_diagonal,
)
from hybrax.ops.kda.pallas_tpu.chunk_state import state_step
from hybrax.ops.kda.pallas_tpu.dots import Dot
from hybrax.ops.kda.pallas_tpu.layout import Rows, boundaries, fold_vmap_into_batch, rows_of, sequence_of
from hybrax.ops.pallas_shared import pallas_call

LANES = 128  # the TPU's vector width: K and V are padded to it
MAX_HEAD_DIM = LANES


def head_dims_reason(q_shape: tuple[int, ...], v_shape: tuple[int, ...]) -> str | None:
    """Why the TPU kernels cannot take heads of q [..., K] and v [..., V] (each padded to one vector width), or
    None: what every TPU registration's supports() says of K and V."""
    dk, dv = q_shape[-1], v_shape[-1]
    if max(dk, dv) > MAX_HEAD_DIM:
        return f"needs K and V <= {MAX_HEAD_DIM}, got K={dk}, V={dv}"
    return None


def interpret_mode():
    """Pallas runs compiled on a TPU and in the TPU interpret mode anywhere else (the CPU tests)."""
    return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()


def _l2_normalize(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)


class HeadChunk(NamedTuple):
    """One head's chunk in fp32: q (normalized, scaled), k (normalized), g, beta [C, 1], its gate sums and its
    unmasked scores."""

    q: jax.Array
    k: jax.Array
    g: jax.Array
    beta: jax.Array
    gates: ChunkGates
    scores: tuple[jax.Array, jax.Array]


def _lanes(index: int) -> slice:
    return slice(index * LANES, (index + 1) * LANES)


def _head_chunk(q_ref, k_ref, g_ref, beta_ref, head: int, qk_head: int, *, scale, l2_normalize, per_head,
                solve_dot) -> HeadChunk:
    q, k = (ref[:, _lanes(qk_head)].astype(jnp.float32) for ref in (q_ref, k_ref))
    if l2_normalize:
        q, k = _l2_normalize(q), _l2_normalize(k)
    q = q * scale
    g = jnp.broadcast_to(g_ref[head], k.shape) if per_head else g_ref[:, _lanes(head)]
    gates = chunk_gates(g)
    return HeadChunk(q, k, g, beta_ref[head], gates, factored_scores(q, k, gates, solve_dot))


def _exact_diagonals(heads: list[HeadChunk]) -> list[tuple[jax.Array, jax.Array]]:
    return [with_exact_diagonal(*h.scores, h.q, h.k, h.g) for h in heads]


def _finish_head(x: HeadChunk, v: jax.Array, state: jax.Array, *, dot, solve_dot, delta_rule: bool
                 ) -> tuple[jax.Array, jax.Array]:
    """(o [C, V], the state after the chunk) of one head; without `delta_rule`, gated linear attention (no
    solve: w = 0, u = v)."""
    aqk, akk = x.scores
    rows, cols = index_grid(*aqk.shape)
    aqk = jnp.where(rows >= cols, aqk, 0.0)
    from_start = jnp.exp(x.gates.from_start())
    w, u = None, v
    if delta_rule:
        inverse = dot.operand(unit_lower_inverse(jnp.where(rows > cols, akk * x.beta, 0.0), solve_dot))
        w = dot(inverse, x.k * x.beta * from_start)
        u = dot(inverse, v * x.beta)
    kg = x.k * jnp.exp(x.gates.to_end())
    return state_step(state, w, u, x.q * from_start, aqk, kg, jnp.exp(x.gates.total()), dot)


def _forward_kernel(
    *refs, group: int, scale: float, l2_normalize: bool, per_head: bool, dot: Dot, solve_dot: Dot, delta_rule: bool,
    packed: bool,
):
    info_ref, refs = (refs[0], refs[1:]) if packed else (None, refs)  # packed: the chunk info (`layout`)
    q_ref, k_ref, v_ref, g_ref, beta_ref, h0_ref, o_ref, final_ref, *refs = refs
    states_ref, state_ref = refs if len(refs) == 2 else (None, *refs)  # states: each chunk's entering state
    chunk_index = pl.program_id(2)
    first, last = boundaries(info_ref, chunk_index, pl.num_programs(2))

    if packed:  # with every sequence empty no chunk starts one, and the state, carried through zero rows, starts at 0
        @pl.when(chunk_index == 0)
        def _():
            state_ref[...] = jnp.zeros(state_ref.shape, jnp.float32)

    @pl.when(first)
    def _():
        state_ref[...] = h0_ref[...]

    block_heads = state_ref.shape[0]
    load = functools.partial(
        _head_chunk, q_ref, k_ref, g_ref, beta_ref, scale=scale, l2_normalize=l2_normalize, per_head=per_head,
        solve_dot=solve_dot,
    )
    heads = [load(head, head // group if block_heads % group == 0 else 0) for head in range(block_heads)]
    steep = functools.reduce(jnp.logical_or, [is_steep(h.gates) for h in heads])
    scores = lax.cond(steep, lambda: _exact_diagonals(heads), lambda: [h.scores for h in heads])
    if states_ref is not None:
        states_ref[...] = state_ref[...]
    for head, (x, head_scores) in enumerate(zip(heads, scores)):
        v = v_ref[:, _lanes(head)].astype(jnp.float32)
        o, state = _finish_head(x._replace(scores=head_scores), v, state_ref[head], dot=dot, solve_dot=solve_dot,
                                delta_rule=delta_rule)
        state_ref[head] = state
        o_ref[:, _lanes(head)] = o.astype(o_ref.dtype)

    @pl.when(last)
    def _():
        final_ref[...] = state_ref[...]


def _pad(x: jax.Array, widths: dict[int, int]) -> jax.Array:
    pads = [(0, widths.get(axis, n) - n) for axis, n in enumerate(x.shape)]
    return jnp.pad(x, pads) if any(p for _, p in pads) else x


def _columns(x: jax.Array) -> jax.Array:
    """[B, T', HV] -> [B, HV, T', 1] fp32: per-head values as the kernel's [C, 1] blocks."""
    return jnp.swapaxes(x.astype(jnp.float32), 1, 2)[..., None]


def default_block_heads(value_heads: int, group: int) -> int:
    """Value heads per grid step: the largest of 4, 2, 1 that divides HV and that the GQA group divides or
    divides (so that a step reads whole query/key heads)."""
    return next(n for n in (4, 2, 1) if value_heads % n == 0 and (n % group == 0 or group % n == 0))


def state_block(block_heads: int) -> pl.BlockSpec:
    """The states of a [B, N, HV, 128, 128] array that a grid step (b, h, t) reads or writes: its chunk's
    sequence's (dense rows: N = 1, the batch row's)."""
    return pl.BlockSpec((None, None, block_heads, LANES, LANES),
                        lambda b, h, t, *info: (b, sequence_of(info, t), h, 0, 0))


def _launch(*arrays, chunk, block_heads, group, per_head, with_states, kernel, interpret, packed):
    """The pallas_call on the kernel's layout: [the chunk info [NC] when packed,] q, k [B, T', H * 128];
    v [B, T', HV * 128]; g like v, or [B, HV, T', 1] per head; beta [B, HV, T', 1]; h0 [B, N, HV, 128, 128];
    T' = NC * C rows (`layout.Rows`)."""
    q, k, v, g, beta, h0 = arrays[int(packed):]
    batch, padded = v.shape[:2]
    value_heads = h0.shape[2]
    qk_heads = max(block_heads // group, 1)  # query/key heads a step reads
    qk_block = pl.BlockSpec(
        (None, chunk, qk_heads * LANES), lambda b, h, t, *_: (b, t, lax.div(h * block_heads, group * qk_heads))
    )
    head_block = pl.BlockSpec((None, chunk, block_heads * LANES), lambda b, h, t, *_: (b, t, h))
    column = pl.BlockSpec((None, block_heads, chunk, 1), lambda b, h, t, *_: (b, h, t, 0))
    chunks = padded // chunk
    states_out = [(pl.BlockSpec((None, block_heads, None, LANES, LANES), lambda b, h, t, *_: (b, h, t, 0, 0)),
                   jax.ShapeDtypeStruct((batch, value_heads, chunks, LANES, LANES), jnp.float32))] * with_states
    grid = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=int(packed),
        grid=(batch, value_heads // block_heads, chunks),
        in_specs=[qk_block, qk_block, head_block, column if per_head else head_block, column,
                  state_block(block_heads)],
        out_specs=[head_block, state_block(block_heads), *(spec for spec, _ in states_out)],
        scratch_shapes=[pltpu.VMEM((block_heads, LANES, LANES), jnp.float32)],
    )
    return tuple(pallas_call(
        kernel,
        grid_spec=grid,
        out_shape=[
            jax.ShapeDtypeStruct((batch, padded, value_heads * LANES), v.dtype),
            jax.ShapeDtypeStruct(h0.shape, jnp.float32),
            *(shape for _, shape in states_out),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="kda_chunk_fwd_tpu",
    )(*arrays))


def check_call(caller: str, q: jax.Array, v: jax.Array, chunk: int, block_heads: int,
               cu_seqlens: jax.Array | None) -> None:
    """What `kda_forward` and `kda_backward` need of their inputs and options beyond the public API's checks."""
    dk, dv = q.shape[3], v.shape[3]
    if max(dk, dv) > MAX_HEAD_DIM:
        raise ValueError(f"{caller}: K and V must be <= {MAX_HEAD_DIM}, got K={dk}, V={dv}")
    if chunk % SUB or chunk & (chunk - 1):
        raise ValueError(f"{caller}: chunk must be a power of two >= {SUB}, got {chunk}")
    value_heads, group = v.shape[2], v.shape[2] // q.shape[2]
    if value_heads % block_heads or (block_heads % group and group % block_heads):
        raise ValueError(
            f"{caller}: block_heads={block_heads} must divide HV={value_heads} and divide or be divided by the "
            f"group HV/H={group}"
        )
    if cu_seqlens is not None and (q.shape[0] != 1 or cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2):
        raise ValueError(f"{caller}: cu_seqlens [N + 1] (N >= 1) packs sequences in a batch of one, got batch "
                         f"{q.shape[0]} and cu_seqlens of shape {list(cu_seqlens.shape)}")


def kernel_rows(layout: Rows, *arrays: jax.Array) -> list[jax.Array]:
    """[B, T, n, D] arrays -> the kernel's rows [B, NC * C, n * 128] (D padded to 128 lanes)."""
    return [_pad(layout.from_tokens(x), {3: LANES}).reshape(x.shape[0], layout.length, -1) for x in arrays]


def kernel_gates(layout: Rows, g: jax.Array, beta: jax.Array) -> list[jax.Array]:
    """(g, beta) as the kernels read them: g per channel as rows (`kernel_rows`), per head as columns
    [B, HV, NC * C, 1]; beta as columns; fp32."""
    g = _columns(layout.from_tokens(g[..., 0])) if g.shape[3] == 1 else kernel_rows(layout, g.astype(jnp.float32))[0]
    return [g, _columns(layout.from_tokens(beta))]


def kernel_states(x: jax.Array, packed: bool) -> jax.Array:
    """States [B or N, HV, K, V] -> the kernels' [B, N, HV, 128, 128] fp32 (dense: N = 1; packed: B = 1)."""
    x = _pad(x.astype(jnp.float32), {2: LANES, 3: LANES})
    return x[None] if packed else x[:, None]


@functools.partial(
    jax.jit,
    static_argnames=(
        "scale", "l2_normalize", "chunk", "block_heads", "solve_passes", "with_states", "delta_rule", "interpret"
    ),
)
def kda_forward(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    g: Float[Array, "B T HV Kd"],
    beta: Float[Array, "B T HV"],
    initial_state: Float[Array, "N HV K V"] | None = None,
    *,
    scale: float,
    cu_seqlens: Int[Array, " N1"] | None = None,
    l2_normalize: bool = True,
    chunk: int = 64,
    block_heads: int | None = None,
    solve_passes: int | None = None,
    with_states: bool = False,
    delta_rule: bool = True,
    interpret=None,
) -> tuple[jax.Array, ...]:
    """KDA forward on the TPU. Without `delta_rule`, gated linear attention (beta unused, no solve):
    S_t = Diag(exp g_t) S_{t-1} + k_t v_t^T, o_t = S_t^T (scale q_t).

    Args:
        q, k [B, T, H, K], v [B, T, HV, V]: bf16 or fp32, K, V <= 128, HV a multiple of H.
        g: the activated log decay (<= 0), per key channel (Kd = K) or per head (Kd = 1); beta: activated.
        initial_state: [N, HV, K, V] (N = B, or the packed sequences' count), or None (zeros).
        cu_seqlens: [N + 1] packed sequences in a batch of one (`hybrax.core.validate.check_cu_seqlens`'s rule,
            not checked here), or None.
        chunk: 16, 32, 64 or 128. block_heads: value heads per grid step (None: `default_block_heads`).
        solve_passes: the MXU precision (`dots.Dot`) of the scores and the triangular solve: default 6 (fp32)
            for fp32 inputs and 3 for bf16; the other products take 6 for fp32 inputs, 1 (bf16 operands) for
            bf16.
        interpret: None: compiled on a TPU, the TPU interpret mode elsewhere.

    Returns:
        o [B, T, HV, V] in v's dtype (zeros for tokens of no sequence) and the final state [N, HV, K, V] fp32;
        with `with_states` also the state entering each chunk of the kernel's rows [B, HV, NC, K, V] fp32
        (`layout.Rows`: NC = ceil(T / chunk) for dense rows), what `chunk_bwd.kda_backward` takes.
    """
    batch, length, heads, dk = q.shape
    value_heads, dv = v.shape[2:]
    group = value_heads // heads
    block_heads = block_heads or default_block_heads(value_heads, group)
    check_call("kda_forward", q, v, chunk, block_heads, cu_seqlens)
    layout = rows_of(length, chunk, cu_seqlens)
    packed = layout.info is not None
    fp32 = v.dtype == jnp.float32
    dot = Dot(6 if fp32 else 1)
    solve_dot = Dot(solve_passes or (6 if fp32 else 3))
    if initial_state is None:
        initial_state = jnp.zeros((batch if cu_seqlens is None else cu_seqlens.shape[0] - 1, value_heads, dk, dv),
                                  jnp.float32)
    per_head = g.shape[3] == 1
    launch = functools.partial(
        _launch, chunk=chunk, block_heads=block_heads, group=group, per_head=per_head, with_states=with_states,
        kernel=functools.partial(
            _forward_kernel, group=group, scale=scale, l2_normalize=l2_normalize, per_head=per_head, dot=dot,
            solve_dot=solve_dot, delta_rule=delta_rule, packed=packed,
        ),
        interpret=interpret_mode() if interpret is None else interpret, packed=packed,
    )
    o, final, *states = fold_vmap_into_batch(launch, shared=int(packed))(
        *([layout.info] if packed else []), *kernel_rows(layout, q, k, v), *kernel_gates(layout, g, beta),
        kernel_states(initial_state, packed),
    )
    o = layout.to_tokens(o.reshape(batch, layout.length, value_heads, LANES)[..., :dv], length)
    final = final[0] if packed else final[:, 0]
    final = layout.states(final[..., :dk, :dv], initial_state.astype(jnp.float32))
    return (o, final, *(x[..., :dk, :dv] for x in states))
