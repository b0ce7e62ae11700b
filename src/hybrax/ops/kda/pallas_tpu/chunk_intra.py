"""KDA's chunk-local scores and the triangular solve for the TPU kernels, on values in VMEM.

For one chunk of C rows (q normalized and scaled, k normalized, fp32) with the gate sums of `chunk_gates`:

    A_qk[i, j] = Σ_c q_ic k_jc exp(G_ic - G_jc)   (j <= i)
    A_kk[i, j] = Σ_c k_ic k_jc exp(G_ic - G_jc)   (j < i; the caller scales rows by beta)

Rows of sub-chunk a take one MXU product each, [2 SUB, K] x [K, C]: the left operand is q and k times
exp(P) <= 1, the right one holds, in the columns of each earlier sub-chunk b, k exp(S) times the link
exp(Σ_{b < m < a} T_m) <= 1 (exact: the exponent is the sum of the gates between the two rows), and in
the columns of sub-chunk a itself k exp(-P), which is >= 1: bounded by the sub-chunk's decay. Where some
sub-chunk decays by more than exp(STEEP) in some channel (`ChunkGates.steepest`; gates of -1000 or -inf),
that factor is clamped and the diagonal blocks are computed again exactly (`with_exact_diagonal`: per column,
the exponents as sums of the gates between the rows).

T = (I + A_kk)^-1 comes from blocked forward substitution on whole [C, C] tiles (`unit_lower_inverse`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.ops.kda.pallas_tpu.chunk_gates import SUB, ChunkGates, block_of, row_in_segment, segment_prefix
from hybrax.ops.kda.pallas_tpu.dots import Dot, Operand

# The largest decay within one sub-chunk that the diagonal blocks take as a product: exp(60) = 1e26 keeps
# the factors and the products of the masked upper triangle far from fp32's limit (3e38).
STEEP = 60.0


def index_grid(rows: int, cols: int) -> tuple[jax.Array, jax.Array]:
    """Row and column indices of a [rows, cols] tile."""
    return lax.broadcasted_iota(jnp.int32, (rows, cols), 0), lax.broadcasted_iota(jnp.int32, (rows, cols), 1)


def _right_operand(a: int, gates: ChunkGates, keys_to_end: jax.Array, keys_up: jax.Array) -> jax.Array:
    """[C, K]: the columns of sub-chunk a's scores. Earlier sub-chunks b: k exp(S) exp(Σ_{b<m<a} T_m);
    sub-chunk a: k exp(min(-P, STEEP)); later ones: zeros."""
    blocks = []
    for b in range(gates.sub_chunks):
        rows = slice(b * SUB, (b + 1) * SUB)
        if b < a:
            blocks.append(keys_to_end[rows] * jnp.exp(gates.between(b, a)))
        elif b == a:
            blocks.append(keys_up[rows])
        else:
            blocks.append(jnp.zeros_like(keys_up[rows]))
    return jnp.concatenate(blocks, axis=0)


def factored_scores(q: jax.Array, k: jax.Array, gates: ChunkGates, dot: Dot) -> tuple[jax.Array, jax.Array]:
    """(A_qk, A_kk) [C, C] fp32, unmasked: entries above the diagonal (and A_kk's diagonal) are arbitrary but
    finite; in a chunk steeper than STEEP (`is_steep`) the diagonal blocks are wrong (`with_exact_diagonal`
    replaces them). q, k [C, K] fp32; `dot` the kernel's precision for them."""
    down = jnp.exp(gates.prefix)  # exp(P) <= 1
    keys_to_end = k * jnp.exp(gates.suffix)  # k exp(S) <= |k|
    keys_up = k * jnp.exp(jnp.minimum(-gates.prefix, STEEP))  # k exp(-P), clamped
    queries_down, keys_down = q * down, k * down
    qk_rows, kk_rows = [], []
    for a in range(gates.sub_chunks):
        rows = slice(a * SUB, (a + 1) * SUB)
        left = jnp.concatenate([queries_down[rows], keys_down[rows]], axis=0)  # [2 SUB, K]
        scores = dot(left, _right_operand(a, gates, keys_to_end, keys_up), "nt")  # [2 SUB, C]
        qk_rows.append(scores[:SUB])
        kk_rows.append(scores[SUB:])
    return jnp.concatenate(qk_rows, axis=0), jnp.concatenate(kk_rows, axis=0)


def is_steep(gates: ChunkGates) -> jax.Array:
    """Whether some sub-chunk decays by more than exp(STEEP) in some channel (a scalar bool)."""
    return gates.steepest() > STEEP


def with_exact_diagonal(
    aqk: jax.Array, akk: jax.Array, q: jax.Array, k: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """A_qk and A_kk with their diagonal [SUB, SUB] blocks computed exactly on the VPU, one column of every
    block per step: for column c of each sub-chunk, the exponents Σ_{c < s <= i} g_s are prefix sums of the
    gates after c, the key of row c is spread over its sub-chunk, and the rows' sums over K are the column."""
    chunk, width = q.shape
    local = row_in_segment((chunk, width), SUB)
    rows, cols = index_grid(chunk, chunk)
    first_col = block_of(rows, SUB) * SUB

    def column(c, blocks):
        diag_qk, diag_kk = blocks
        exponents = segment_prefix(jnp.where(local > c, g, 0.0), SUB)  # rows before c: 0, masked below
        picked = jnp.where(local == c, k, 0.0)
        spread = jnp.concatenate(
            [jnp.broadcast_to(jnp.sum(picked[m * SUB:(m + 1) * SUB], axis=0, keepdims=True), (SUB, width))
             for m in range(chunk // SUB)], axis=0,
        )
        decayed = spread * jnp.exp(exponents)
        target = cols == first_col + c
        diag_qk = jnp.where(target, jnp.sum(q * decayed, axis=1, keepdims=True), diag_qk)
        diag_kk = jnp.where(target, jnp.sum(k * decayed, axis=1, keepdims=True), diag_kk)
        return diag_qk, diag_kk

    zeros = jnp.zeros((chunk, chunk), jnp.float32)
    diag_qk, diag_kk = lax.fori_loop(0, SUB, column, (zeros, zeros))
    on_diagonal = block_of(rows, SUB) == block_of(cols, SUB)
    return jnp.where(on_diagonal, diag_qk, aqk), jnp.where(on_diagonal, diag_kk, akk)


def unit_lower_inverse(strict_lower: jax.Array, dot: Dot) -> jax.Array:
    """(I + L)^-1 for a strictly lower [n, n] L (n a power of two >= 2) by blocked forward substitution on
    whole tiles: with X the inverse of the block diagonal of blocks of `size` rows (from size 2, where the
    inverse of [[1, 0], [l, 1]] is [[1, 0], [-l, 1]]), the blocks of twice the size are
    [[A^-1, 0], [-B^-1 L21 A^-1, B^-1]] = X - X (L_21 X), L_21 the part of L below X's blocks within the
    larger ones: two [n, n] matmuls per doubling, L converted for the MXU once and X once per doubling."""
    n = strict_lower.shape[0]
    rows, cols = index_grid(n, n)
    pairs = (block_of(rows, 2) == block_of(cols, 2)) & (rows > cols)
    inverse = jnp.where(rows == cols, 1.0, 0.0) - jnp.where(pairs, strict_lower, 0.0)
    lower = dot.operand(strict_lower)
    size = 2
    while size < n:
        below = (block_of(rows, 2 * size) == block_of(cols, 2 * size)) & (block_of(rows, size) > block_of(cols, size))
        coupling = Operand(tuple(jnp.where(below, part, jnp.zeros((), part.dtype)) for part in lower.parts))
        current = dot.operand(inverse)
        inverse = inverse - dot(current, dot(coupling, current))
        size *= 2
    return inverse
