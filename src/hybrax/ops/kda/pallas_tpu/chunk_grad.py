"""KDA's per-chunk gradients for the TPU backward kernel, on values in VMEM: one head's chunk through the WY / UT
form, from the state S entering it (stored by the forward), the cotangent dS' of the state leaving it and dv_new
(`chunk_state_bwd`). With q normalized and scaled, k normalized, X_k = beta k exp(G), X_v = beta v and
T = (I + L)^-1, L = Diag(beta) A_kk (j < i), the forward's chunk is

    w = T X_k,  u = T X_v,  v_new = u - w S,  o = qg S + A_qk v_new,  S' = Diag(exp(G_C)) S + kg^T v_new
    qg = q exp(G),  kg = k exp(G_C - G)

and its cotangents, dO given:

    dqg = dO S^T,  dkg = v_new dS'^T,  dw = -dv_new S^T,  d exp(G_C) = Σ_v dS' * S
    dA_qk = dO v_new^T  (j <= i)
    dX_k = T^T dw,  dX_v = T^T dv_new,  dT = dw X_k^T + dv_new X_v^T
    dL = -T^T dT T^T  (j < i),  dA_kk = Diag(beta) dL
    dbeta = Σ_j dL * A_kk + Σ_c dX_k * k exp(G) + Σ_v dX_v * v,  dv = beta dX_v

then through qg, kg and X_k to q, k and the gate sums: dG [C, K] (the gradient of each row's G_i) and dG_C
[1, K] (exp(G_C) and every kg hold the chunk's whole decay). The pairwise decays inside A_qk and A_kk are
`chunk_intra_bwd`'s. Each gate g_s lies in G_i for i >= s and in G_C, so

    dg_s = Σ_{i >= s} dG_i + dG_C          (`gate_gradient`, with `chunk_gates`' suffix sums)

A gate below UNDERFLOW decays by exactly 0 in fp32: every term that holds it is 0, and so is its gradient, where
the sums would leave the rounding of terms that cancel (which the fused gate's a_log gradient multiplies by the
gate itself). The L2 norm's backward (`l2_normalize_bwd`) maps dq and dk back to the raw inputs.

Gated linear attention (no delta rule) is the same chunk with w = 0 and u = v_new = v: no T, no A_kk, beta unused,
so dv = dv_new and every term through T drops out.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.ops.kda.base import L2_EPS
from hybrax.ops.kda.pallas_tpu.chunk_gates import chunk_gates
from hybrax.ops.kda.pallas_tpu.chunk_intra import index_grid, unit_lower_inverse
from hybrax.ops.kda.pallas_tpu.dots import Dot, Operand

UNDERFLOW = -104.0  # exp(x) rounds to 0 in fp32 below about -103.97


class Recomputed(NamedTuple):
    """One head's chunk as the forward computed it, fp32."""

    aqk: jax.Array  # [C, C] A_qk, j <= i
    akk: jax.Array  # [C, C] A_kk, j < i (not scaled by beta)
    inverse: jax.Array | None  # [C, C] T (None without the delta rule)
    from_start: jax.Array  # [C, K] exp(G)
    to_end: jax.Array  # [C, K] exp(G_C - G)
    decay: jax.Array  # [1, K] exp(G_C)
    qg: jax.Array  # [C, K]
    kg: jax.Array  # [C, K]
    w: jax.Array | None  # [C, K] (None without the delta rule)
    v_new: jax.Array  # [C, V]


class Gradients(NamedTuple):
    """One head's chunk's cotangents, fp32, before the pairwise decays' terms (`chunk_intra_bwd`)."""

    dq: jax.Array  # [C, K] of the normalized, scaled q
    dk: jax.Array  # [C, K] of the normalized k
    dv: jax.Array  # [C, V]
    dbeta: jax.Array  # [C, 1]
    dg: jax.Array  # [C, K] dG
    d_total: jax.Array  # [1, K] dG_C
    d_aqk: jax.Array  # [C, C]
    d_akk: jax.Array | None  # [C, C] (None without the delta rule)


def recompute(
    q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, gates, scores: tuple[jax.Array, jax.Array],
    entering: Operand, dot: Dot, solve_dot: Dot, delta_rule: bool = True,
) -> Recomputed:
    """The forward's chunk terms from q, k [C, K], v [C, V], beta [C, 1], the gate sums (`chunk_gates`), the
    unmasked scores (A_qk, A_kk) and the entering state as an MXU operand, at the forward's precisions. Without
    `delta_rule` (gated linear attention) T and w are None and v_new = v."""
    aqk, akk = scores
    rows, cols = index_grid(*aqk.shape)
    aqk, akk = jnp.where(rows >= cols, aqk, 0.0), jnp.where(rows > cols, akk, 0.0)
    from_start, to_end = jnp.exp(gates.from_start()), jnp.exp(gates.to_end())
    inverse, w, v_new = None, None, v
    if delta_rule:
        inverse = unit_lower_inverse(akk * beta, solve_dot)
        solve = dot.operand(inverse)
        w = dot(solve, k * beta * from_start)
        v_new = dot(solve, v * beta) - dot(w, entering)
    return Recomputed(
        aqk, akk, inverse, from_start, to_end, jnp.exp(gates.total()), q * from_start, k * to_end, w, v_new
    )


def column_to_row(column: jax.Array) -> jax.Array:
    """[n, 1] -> [1, n], through a diagonal select and a sublane sum (no narrow transpose)."""
    n = column.shape[0]
    eye = lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)
    return jnp.sum(jnp.where(eye, jnp.broadcast_to(column, (n, n)), 0.0), axis=0, keepdims=True)


def _through_solve(
    k: jax.Array, v: jax.Array, beta: jax.Array, r: Recomputed, entering: Operand, dv_new: jax.Array, dot: Dot,
    solve_dot: Dot,
) -> tuple[jax.Array, ...]:
    """The delta rule's terms of the module, through T: (dk's and dG's shares through X_k [C, K], dv [C, V],
    dbeta [C, 1], dL [C, C])."""
    rows, cols = index_grid(*r.aqk.shape)
    dw = -dot(dot.operand(dv_new), entering, "nt")
    x_k, x_v = k * beta * r.from_start, v * beta
    transposed = solve_dot.operand(r.inverse.T)
    dx_k, dx_v = solve_dot(transposed, dw), solve_dot(transposed, dv_new)
    d_inverse = solve_dot(dw, x_k, "nt") + solve_dot(dv_new, x_v, "nt")
    dl = -solve_dot(transposed, solve_dot(d_inverse, r.inverse, "nt"))
    dl = jnp.where(rows > cols, dl, 0.0)
    dbeta = (jnp.sum(dl * r.akk, axis=1, keepdims=True) + jnp.sum(dx_k * k * r.from_start, axis=1, keepdims=True)
             + jnp.sum(dx_v * v, axis=1, keepdims=True))
    return dx_k * beta * r.from_start, dx_k * x_k, dx_v * beta, dbeta, dl


def chunk_gradients(
    k: jax.Array, v: jax.Array, beta: jax.Array, r: Recomputed, state: jax.Array, entering: Operand,
    d_state: jax.Array, d_out: jax.Array, dv_new: jax.Array, dot: Dot, solve_dot: Dot,
) -> Gradients:
    """The chunk's cotangents (see the module) from k [C, K], v [C, V], beta [C, 1], its recomputed terms, the
    state S entering it (fp32 and as an MXU operand), dS' and dO, dv_new. `dot` takes the products with the
    state and the outputs (bf16 operands for bf16 inputs), `solve_dot` those through T. Without the delta rule
    (`r.w` None: v_new = v) dv = dv_new, dbeta = 0 and dA_kk is None."""
    rows, cols = index_grid(*r.aqk.shape)
    d_out = dot.operand(d_out)
    dqg = dot(d_out, entering, "nt")
    dkg = dot(r.v_new, dot.operand(d_state), "nt")
    d_aqk = jnp.where(rows >= cols, dot(d_out, r.v_new, "nt"), 0.0)
    d_decay = column_to_row(jnp.sum(d_state * state, axis=1, keepdims=True))
    d_total = jnp.sum(dkg * r.kg, axis=0, keepdims=True) + d_decay * r.decay
    dq, dk, dg = dqg * r.from_start, dkg * r.to_end, dqg * r.qg - dkg * r.kg
    if r.w is None:
        return Gradients(dq, dk, dv_new, jnp.zeros_like(beta), dg, d_total, d_aqk, None)
    dk_solve, dg_solve, dv, dbeta, dl = _through_solve(k, v, beta, r, entering, dv_new, dot, solve_dot)
    return Gradients(dq, dk + dk_solve, dv, dbeta, dg + dg_solve, d_total, d_aqk, dl * beta)


def gate_gradient(dg: jax.Array, d_total: jax.Array, g: jax.Array) -> jax.Array:
    """The gates' gradient [C, K] from dG [C, K] and dG_C [1, K]: each row's suffix sum of dG within the chunk
    plus dG_C, and 0 for a gate g [C, K] below UNDERFLOW (see the module)."""
    sums = dg + chunk_gates(dg).to_end() + d_total
    return jnp.where(g < UNDERFLOW, 0.0, sums)


def l2_normalize_bwd(x: jax.Array, dy: jax.Array) -> jax.Array:
    """The cotangent of the rows of x [C, K] from that of y = x / sqrt(Σ x^2 + eps): r (dy - y Σ y dy),
    r = 1 / sqrt(Σ x^2 + eps)."""
    r = lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + L2_EPS)
    y = x * r
    return r * (dy - y * jnp.sum(y * dy, axis=1, keepdims=True))
