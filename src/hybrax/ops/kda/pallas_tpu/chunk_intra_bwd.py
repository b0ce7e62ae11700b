"""KDA's gradients through the chunk-local scores for the TPU backward kernel, on values in VMEM.

With E_ijc = exp(G_ic - G_jc) (the sum of the gates after j through i), P = dA_qk (j <= i) and D = dA_kk (j < i,
already times beta_i), A_qk[i, j] = Σ_c q_ic k_jc E_ijc and A_kk[i, j] = Σ_c k_ic k_jc E_ijc give

    rows     Y_q[i] = Σ_j P_ij k_j E_ij,   Y_k[i] = Σ_j D_ij k_j E_ij
    columns  Z[j]   = Σ_i (P_ij q_i + D_ij k_i) E_ij
    dq = Y_q,   dk = Y_k + Z,   dG = q Y_q + k Y_k - k Z

(q normalized and scaled, k normalized; dG the gradient of each row's G_i, as `chunk_grad`'s). The decays
factor as the forward's scores do (`chunk_intra`): for rows i of sub-chunk a, E_ij = exp(P_i) F_a(j), with
F_a(j) = exp(S_j) exp(Σ_{b < m < a} T_m) <= 1 for j in an earlier sub-chunk b and exp(-P_j) (clamped at
exp(STEEP)) for j in a itself. So per sub-chunk a, the rows' [P; D] [2 SUB, C] take one MXU product with
k F_a [C, K] for Y, and their transpose one with [q; k] exp(P) [2 SUB, K] for Z, weighed by F_a afterwards.
In a steep chunk the diagonal blocks' factors are clamped and wrong: they are dropped from P and D there, and
`exact_diagonal` adds those blocks on the VPU, one column of every block per step, every exponent a sum of the
gates between the two rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.ops.kda.pallas_tpu.chunk_gates import SUB, ChunkGates, block_of, row_in_segment, segment_prefix
from hybrax.ops.kda.pallas_tpu.chunk_intra import STEEP, _right_operand, index_grid
from hybrax.ops.kda.pallas_tpu.dots import Dot


def factored(
    p: jax.Array, d: jax.Array | None, q: jax.Array, k: jax.Array, gates: ChunkGates, dot: Dot
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(Y_q, Y_k, Z) [C, K] fp32 from P, D [C, C] (masked; D None: zeros, gated linear attention) and q, k [C, K]
    fp32 by sub-chunks (the module's factored form; wrong in the diagonal blocks of a chunk steeper than STEEP)."""
    down = jnp.exp(gates.prefix)  # exp(P) <= 1
    to_end, up = jnp.exp(gates.suffix), jnp.exp(jnp.minimum(-gates.prefix, STEEP))
    parts = 1 if d is None else 2  # P's rows, then D's
    y_q, y_k, z = [], [], jnp.zeros_like(k)
    for a in range(gates.sub_chunks):
        rows = slice(a * SUB, (a + 1) * SUB)
        factor = _right_operand(a, gates, to_end, up)  # F_a [C, K]: zeros for later sub-chunks
        pairs = p[rows] if d is None else jnp.concatenate([p[rows], d[rows]], axis=0)  # [parts SUB, C]
        y = dot(pairs, k * factor) * jnp.concatenate([down[rows]] * parts, axis=0)
        y_q.append(y[:SUB])
        y_k.append(y[SUB:])
        left = jnp.concatenate([q[rows] * down[rows], k[rows] * down[rows]][:parts], axis=0)  # [parts SUB, K]
        z = z + dot(pairs, left, "tn") * factor
    y_k = jnp.zeros_like(k) if d is None else jnp.concatenate(y_k, axis=0)
    return jnp.concatenate(y_q, axis=0), y_k, z


def _sub_chunk_sums(x: jax.Array) -> jax.Array:
    """[C, K]: each sub-chunk's column sums, repeated over its SUB rows."""
    chunk, width = x.shape
    return jnp.concatenate(
        [jnp.broadcast_to(jnp.sum(x[m * SUB:(m + 1) * SUB], axis=0, keepdims=True), (SUB, width))
         for m in range(chunk // SUB)], axis=0,
    )


def exact_diagonal(
    p: jax.Array, d: jax.Array | None, q: jax.Array, k: jax.Array, g: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(Y_q, Y_k, Z) [C, K] of the diagonal [SUB, SUB] blocks of P and D (None: zeros) alone, exactly: for column
    c of each sub-chunk, the exponents Σ_{c < s <= i} g_s are prefix sums of the gates after c (`chunk_intra`'s
    `with_exact_diagonal` does the same for the scores); g [C, K] the per-token log decays."""
    chunk, width = q.shape
    local = row_in_segment((chunk, width), SUB)
    rows, cols = index_grid(chunk, chunk)
    first_col = block_of(rows, SUB) * SUB

    def column(c, sums):
        y_q, y_k, z = sums
        decay = jnp.exp(segment_prefix(jnp.where(local > c, g, 0.0), SUB))  # E_ij for j the block's column c
        target = cols == first_col + c

        def picked(x):  # [C, 1]: column c of each diagonal block of x
            return jnp.sum(jnp.where(target, x, 0.0), axis=1, keepdims=True)

        key = _sub_chunk_sums(jnp.where(local == c, k, 0.0)) * decay  # k_j E_ij
        p_col = picked(p)
        if d is None:
            z_col = _sub_chunk_sums(p_col * q * decay)
            return y_q + p_col * key, y_k, jnp.where(local == c, z_col, z)
        d_col = picked(d)
        z_col = _sub_chunk_sums((p_col * q + d_col * k) * decay)
        return y_q + p_col * key, y_k + d_col * key, jnp.where(local == c, z_col, z)

    zeros = jnp.zeros((chunk, width), jnp.float32)
    return lax.fori_loop(0, SUB, column, (zeros, zeros, zeros))


def intra_gradients(
    p: jax.Array, d: jax.Array | None, q: jax.Array, k: jax.Array, g: jax.Array, gates: ChunkGates,
    steep: jax.Array, dot: Dot,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(Y_q, Y_k, Z) [C, K] fp32 (see the module; D None: no A_kk, gated linear attention, Y_k = 0): factored,
    and in a steep chunk (`steep`, a scalar bool) the diagonal blocks exactly."""

    def steep_chunk():
        rows, cols = index_grid(*p.shape)
        off = block_of(rows, SUB) != block_of(cols, SUB)
        off_diagonal = lambda x: None if x is None else jnp.where(off, x, 0.0)  # noqa: E731
        parts = factored(off_diagonal(p), off_diagonal(d), q, k, gates, dot)
        return tuple(a + b for a, b in zip(parts, exact_diagonal(p, d, q, k, g)))

    return lax.cond(steep, steep_chunk, lambda: factored(p, d, q, k, gates, dot))
