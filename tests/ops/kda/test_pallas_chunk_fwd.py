"""The Pallas chunked KDA forward (interpret mode on the CPU) against a float64 recurrence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda.pallas_chunk_fwd import kda_chunk_fwd
from tests.helpers import TOLERANCE, assert_close, normal, to64


def naive_kda(q, k, v, g, beta, initial_state, scale, l2_normalize):
    """float64 recurrence: decay first, then the delta rule on the decayed state."""
    batch, length, heads, dk = q.shape
    value_heads, dv = v.shape[2], v.shape[3]
    group = value_heads // heads
    if l2_normalize:
        q = q / np.sqrt(np.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k / np.sqrt(np.sum(k * k, -1, keepdims=True) + 1e-6)
    state = np.zeros((batch, value_heads, dk, dv)) if initial_state is None else initial_state.copy()
    out = np.zeros((batch, length, value_heads, dv))
    for t in range(length):
        for h in range(value_heads):
            qt, kt = q[:, t, h // group], k[:, t, h // group]
            s = state[:, h] * np.exp(g[:, t, h])[:, :, None]
            error = v[:, t, h] - np.einsum("bkv,bk->bv", s, kt)
            s = s + beta[:, t, h, None, None] * kt[:, :, None] * error[:, None, :]
            state[:, h] = s
            out[:, t, h] = np.einsum("bkv,bk->bv", s, scale * qt)
    return out, state


def inputs(seed, batch, length, heads, value_heads, dk, dv, dtype, gate_floor=None):
    q = normal(seed, (batch, length, heads, dk), dtype)
    k = normal(seed + 1, (batch, length, heads, dk), dtype)
    v = normal(seed + 2, (batch, length, value_heads, dv), dtype)
    g = jax.nn.log_sigmoid(normal(seed + 3, (batch, length, value_heads, dk), jnp.float32, 2.0) + 2.0)
    if gate_floor is not None:
        # Some tokens forget everything: gates of -1000 must underflow, never overflow.
        hard = jax.random.bernoulli(jax.random.key(seed + 4), 0.1, g.shape[:3])
        g = jnp.where(hard[..., None], gate_floor, g)
    beta = jax.nn.sigmoid(normal(seed + 5, (batch, length, value_heads), jnp.float32))
    return q, k, v, g, beta


def check(seed, batch, length, heads, value_heads, dk, dv, dtype=jnp.float32, *, with_state=False,
          l2_normalize=True, gate_floor=None, tol=None):
    q, k, v, g, beta = inputs(seed, batch, length, heads, value_heads, dk, dv, dtype, gate_floor)
    h0 = normal(seed + 6, (batch, value_heads, dk, dv), jnp.float32, 0.5) if with_state else None
    scale = dk ** -0.5
    out, final = kda_chunk_fwd(q, k, v, g, beta, h0, scale=scale, l2_normalize=l2_normalize, interpret=True)
    ref_out, ref_final = naive_kda(*(to64(x) for x in (q, k, v, g, beta)), to64(h0), scale, l2_normalize)
    tol = TOLERANCE[dtype] if tol is None else tol
    assert out.dtype == dtype and final.dtype == jnp.float32
    assert_close(out, ref_out, tol, "output")
    assert_close(final, ref_final, tol, "final state")


def test_fp32_two_chunks():
    check(0, 2, 128, 2, 2, 32, 32)
