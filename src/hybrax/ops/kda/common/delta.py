"""The delta rule one token at a time, in XLA: what the scan, the decode kernels' gradient and the chunked
implementations' preparation of q and k share.

Per value head, with the state S [K, V] in fp32 and a log decay g <= 0 per key channel (or per head):

    S' = Diag(exp g) S;   S = S' + k (beta (v - S'^T k))^T;   o = S^T (scale q)

q and k are L2-normalized first when the call asks for it: x / sqrt(sum x^2 + L2_EPS), and repeated from
their heads to the value heads (grouped value attention).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from hybrax.ops.kda.base import L2_EPS, KdaProblem, KernelDeltaAttentionConfig

EXACT = lax.Precision.HIGHEST


def inverse_l2_norm(sum_of_squares: jax.Array) -> jax.Array:
    """1 / |x| from sum(x^2), with the epsilon every implementation uses (`base.L2_EPS`)."""
    return lax.rsqrt(sum_of_squares + L2_EPS)


def l2_normalize(x: jax.Array) -> jax.Array:
    return x * inverse_l2_norm(jnp.sum(x * x, axis=-1, keepdims=True))


def value_head_qk(problem: KdaProblem) -> tuple[jax.Array, jax.Array]:
    """q and k in fp32, L2-normalized when asked, repeated to [B, T, HV, K] (one per value head)."""
    group = problem.v.shape[2] // problem.q.shape[2]
    q, k = (x.astype(jnp.float32) for x in (problem.q, problem.k))
    if problem.use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    return jnp.repeat(q, group, axis=2), jnp.repeat(k, group, axis=2)


def delta_step(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array, decay: jax.Array, scale: float
) -> tuple[jax.Array, jax.Array]:
    """One token: state [..., K, V]; q, k [..., K]; v [..., V]; beta [...]; decay [..., K] or [..., 1].
    Returns (o [..., V], new state)."""
    state = state * jnp.exp(decay)[..., None]
    error = v - jnp.einsum("...kv,...k->...v", state, k, precision=EXACT)
    state = state + k[..., :, None] * (beta[..., None] * error)[..., None, :]
    return jnp.einsum("...kv,...k->...v", state, scale * q, precision=EXACT), state


def single_step(problem: KdaProblem, cfg: KernelDeltaAttentionConfig) -> tuple[jax.Array, jax.Array]:
    """T == 1: one delta step on the state, no scan and no chunk padding ("xla:single_step", and the gradient of
    the decode kernels, which have no backward of their own)."""
    q, k = value_head_qk(problem)
    o, final = delta_step(
        problem.initial_states(), q[:, 0], k[:, 0], problem.v[:, 0].astype(jnp.float32),
        problem.beta[:, 0], problem.decay[:, 0], problem.scale,
    )
    return o[:, None].astype(problem.q.dtype), final
