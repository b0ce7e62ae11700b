"""KDA chunked forward on the GPU with Pallas (Triton lowering): the stages end to end.

    stage 0  chunk_cumsum    the chunk-local gate cumsum G
    stage 1  chunk_intra     q, k L2-normalized and q scaled (as row factors), A_kk, A_qk,
                             T = (I + A_kk)^-1, then w, u (the WY form), kg, qg and
                             the chunk's decay (per chunk; the backward, which keeps T and A_qk,
                             recomputes the rest with chunk_wy)
    stage 2  chunk_state     the state pass, state on chip, serial over chunks; in the forward
                             (chunk_state_output) each chunk's o = qg h + A_qk v_new too, so the
                             chunk states h never leave the chip (the backward recomputes them)

This file pads the inputs to the kernels' tile sizes (T to the chunk, K and V to powers of two
>= 16; zero keys, values, gates and betas leave the state untouched) and crops the results;
`chunk_bwd` is its backward, `chunk` joins the two, `chunked` is the registered implementation.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.ops.kda.common.delta import l2_normalize
from hybrax.ops.kda.common.layout import Segments
from hybrax.ops.kda.pallas_gpu.chunk_cumsum import chunk_local_cumsum
from hybrax.ops.kda.pallas_gpu.chunk_intra import chunk_intra
from hybrax.ops.kda.pallas_gpu.chunk_state import chunk_state, chunk_state_output
from hybrax.ops.kda.pallas_gpu.chunk_wy import chunk_wy
from hybrax.ops.kda.pallas_gpu.tiles import PackedChunks

MIN_TILE = 16
MAX_HEAD_DIM = 256


def _tile(size: int) -> int:
    """The smallest power of two >= max(size, 16): Triton tiles are powers of two, dots >= 16."""
    return max(MIN_TILE, 1 << (size - 1).bit_length())


def pad_to(x: jax.Array | None, sizes: dict[int, int]) -> jax.Array | None:
    if x is None:
        return None
    widths = [(0, sizes.get(axis, n) - n) for axis, n in enumerate(x.shape)]
    return jnp.pad(x, widths) if any(w for _, w in widths) else x


def normalize_qk(q: jax.Array, k: jax.Array, scale: float, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Unit-norm keys and queries, queries scaled, in fp32."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if normalize:
        q, k = l2_normalize(q), l2_normalize(k)
    return q * scale, k


def prepare_qk(q: jax.Array, k: jax.Array, scale: float, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """`normalize_qk`, stored in the input dtype: what the kernels read."""
    dtype = q.dtype
    return tuple(x.astype(dtype) for x in normalize_qk(q, k, scale, normalize))


class Padded(NamedTuple):
    """The inputs padded to the kernels' tiles: T to the chunk, K and V to powers of two >= 16 (zero
    keys, values, gates and betas leave the state untouched). q, k raw; g the per-token log decay."""

    q: jax.Array
    k: jax.Array
    v: jax.Array
    g: jax.Array
    beta: jax.Array
    initial_state: jax.Array | None


def pad_inputs(q, k, v, g, beta, initial_state, chunk: int, pad_length: bool = True) -> Padded:
    """Without `pad_length` T stays (packed rows, which the kernels read in place)."""
    length, dk, dv = q.shape[1], q.shape[3], v.shape[3]
    padded_length = -(-length // chunk) * chunk if pad_length else length
    kp, vp = _tile(dk), _tile(dv)
    return Padded(
        *(pad_to(x.astype(v.dtype), {1: padded_length, 3: kp}) for x in (q, k)),
        pad_to(v, {1: padded_length, 3: vp}),
        pad_to(g.astype(jnp.float32), {1: padded_length, 3: kp}),
        pad_to(beta.astype(jnp.float32), {1: padded_length}),
        pad_to(initial_state, {2: kp, 3: vp}),
    )


class Packing(NamedTuple):
    """Packed sequences' layout (`common.layout.packed_layout`) as the kernels and the gathers take it:
    the gathers' maps (padded rows -> tokens, tokens -> padded rows) and where each padded chunk lies in
    the packed row."""

    source: jax.Array
    destination: jax.Array
    chunks: PackedChunks


class Stages(NamedTuple):
    """What the forward's stages compute (padded shapes): the backward recomputes them."""

    q: jax.Array  # [B, T, H, K] normalized, scaled
    k: jax.Array  # [B, T, H, K] normalized
    g: jax.Array  # [B, T, HV, K] the chunk-local cumulative log decay G (fp32)
    inverse: jax.Array  # [B, T, HV, C] T = (I + A_kk)^-1
    aqk: jax.Array  # [B, T, HV, C]
    w: jax.Array
    kg: jax.Array
    qg: jax.Array
    decay: jax.Array  # [B, NT, HV, K] fp32
    h: jax.Array  # [B, NT, HV, K, V] the state entering each chunk
    v_new: jax.Array  # [B, T, HV, V]


class Solved(NamedTuple):
    """T and A_qk from stage 1, [B, T, HV, C] each (padded): what the backward keeps from the forward.
    (Keeping the chunk states h and v_new too, so that the backward skips its state pass, made
    forward+backward no faster on the H200.)"""

    inverse: jax.Array
    aqk: jax.Array


def solve_chunks(
    x: Padded, q: jax.Array, k: jax.Array, solved: Solved | None, packed: PackedChunks | None = None, *,
    chunk: int, interpret: bool,
) -> tuple[jax.Array, Solved, tuple[jax.Array, ...]]:
    """Stages 0 and 1 on padded inputs (or packed rows, read in place), with q and k already through
    `prepare_qk`: G, (T, A_qk) and the WY form (w, u, kg, qg, decay), padded. Given T and A_qk, stage 1
    only recomputes the WY form."""
    g = chunk_local_cumsum(x.g, packed, chunk=chunk, interpret=interpret)
    if solved is None:
        scores, wy = chunk_intra(q, k, x.v, g, x.g, x.beta, packed, chunk=chunk, interpret=interpret)
        return g, Solved(*scores), wy
    return g, solved, chunk_wy(q, k, x.v, g, x.g, x.beta, solved.inverse, packed, chunk=chunk, interpret=interpret)


def without_delta_rule(w: jax.Array, v: jax.Array, packed: PackedChunks | None, chunk: int
                       ) -> tuple[jax.Array, jax.Array]:
    """The WY pair (w, u) of gated linear attention: the state pass's v_new = u - w S is then v itself, in the
    padded layout (packed rows gathered into it). With beta = 0 the intra kernel's w is 0 already; its u,
    T beta v, would be 0 too."""
    return jnp.zeros_like(w), v if packed is None else packed_to_padded(v, packed, chunk)


def packed_to_padded(x: jax.Array, packed: PackedChunks, chunk: int) -> jax.Array:
    """Packed rows [1, T, ...] -> the padded layout [1, NT * chunk, ...]: chunk c's rows are tokens
    start[c] ... start[c] + count[c] - 1, then zeros."""
    offset = jnp.arange(chunk, dtype=jnp.int32)[None, :]
    token = jnp.minimum(packed.start[:, None] + offset, x.shape[1] - 1).reshape(-1)
    inside = (offset < packed.count[:, None]).reshape(-1)
    rows = jnp.take(x[0], token, axis=0)
    return jnp.where(inside.reshape(-1, *([1] * (rows.ndim - 1))), rows, jnp.zeros((), x.dtype))[None]


def forward_stages(
    x: Padded, q: jax.Array, k: jax.Array, segments: Segments | None = None, solved: Solved | None = None,
    packed: PackedChunks | None = None, *, chunk: int, delta_rule: bool = True, interpret: bool = False,
) -> Stages:
    """What the backward needs of the forward, on padded inputs or packed rows (`solve_chunks`, then the
    state pass storing every chunk's state)."""
    g, (inverse, aqk), (w, u, kg, qg, decay) = solve_chunks(
        x, q, k, solved, packed, chunk=chunk, interpret=interpret
    )
    if not delta_rule:
        w, u = without_delta_rule(w, x.v, packed, chunk)
    h, v_new, _ = chunk_state(w, u, kg, decay, x.initial_state, segments, chunk=chunk, interpret=interpret)
    return Stages(q, k, g, inverse, aqk, w, kg, qg, decay, h, v_new)


def kda_chunk_fwd(*args, **kwargs) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV K V"]]:
    """KDA forward: o [B, T, HV, V] (v's dtype) and the final state [B, HV, K, V] (fp32); the arguments
    of `kda_chunk_fwd_solved`. Stage 1 stores no T: only the backward reads it."""
    return kda_chunk_fwd_solved(*args, with_inverse=False, **kwargs)[:2]


@functools.partial(
    jax.jit,
    static_argnames=("scale", "l2_normalize", "chunk", "block_v", "state_warps", "with_inverse", "delta_rule",
                     "interpret"),
)
def kda_chunk_fwd_solved(
    q: Float[Array, "B T H K"],
    k: Float[Array, "B T H K"],
    v: Float[Array, "B T HV V"],
    g: Float[Array, "B T HV K"],
    beta: Float[Array, "B T HV"],
    initial_state: Float[Array, "B HV K V"] | None = None,
    segments: Segments | None = None,
    packed: PackedChunks | None = None,
    *,
    scale: float,
    l2_normalize: bool = True,
    chunk: int = 64,
    block_v: int | None = None,
    state_warps: int = 4,
    with_inverse: bool = True,
    delta_rule: bool = True,
    interpret: bool = False,
) -> tuple[Float[Array, "B T HV V"], Float[Array, "B HV K V"], Solved]:
    """KDA forward: o [B, T, HV, V] (v's dtype), the final state [B, HV, K, V] (fp32) and T and A_qk
    (padded), which the backward takes instead of recomputing them (T None without `with_inverse`).

    g is the per-channel log decay (any <= 0, -inf a hard reset: `chunk_gates`), beta the update
    strength (already through its sigmoid); q, k, v share one dtype (bf16 or fp32); HV is a multiple of H. With
    `segments` the batch of one holds packed sequences, each from a chunk boundary (`common.layout.packed_layout`), and
    initial_state [N, HV, K, V] is required; the final states are then [N, HV, K, V]. With `packed` too,
    the inputs are the packed rows themselves (the first kernels read each chunk's rows in place) and o
    and T, A_qk come in the padded layout. Without `delta_rule`, gated linear attention (`without_delta_rule`;
    beta is then unused, pass zeros).
    """
    dk, dv = q.shape[3], v.shape[3]
    x = pad_inputs(q, k, v, g, beta, initial_state, chunk, pad_length=packed is None)
    gates = chunk_local_cumsum(x.g, packed, chunk=chunk, interpret=interpret)
    length = q.shape[1] if packed is None else gates.shape[1]
    scores, (w, u, kg, qg, decay) = chunk_intra(  # q, k normalized inside: no pass writes copies first
        x.q, x.k, x.v, gates, x.g, x.beta, packed, scale=scale, l2_normalize=l2_normalize, chunk=chunk,
        with_inverse=with_inverse, interpret=interpret,
    )
    solved = Solved(*scores)
    if not delta_rule:
        w, u = without_delta_rule(w, x.v, packed, chunk)
    o, final_state = chunk_state_output(
        w, u, kg, decay, qg, solved.aqk, x.initial_state, segments, chunk=chunk, block_v=block_v,
        num_warps=state_warps, interpret=interpret,
    )
    if segments is not None:  # a sequence without tokens ends where it began
        final_state = jnp.where(has_chunks(segments, final_state.shape[0]), final_state, x.initial_state)
    return o[:, :length, :, :dv], final_state[:, :, :dk, :dv], solved


def has_chunks(segments: Segments, sequences: int) -> jax.Array:
    """[N, 1, 1, 1] bool: whether sequence n owns a chunk (empty sequences own none)."""
    owned = jnp.zeros(sequences, bool).at[segments.sequence].max(segments.first != 0)
    return owned[:, None, None, None]
