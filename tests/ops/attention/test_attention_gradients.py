"""Gradients of both implementations (query, key, value, bias, sinks) against float64 autodiff of the
reference math, under jit, grad and checkpoint."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import pytest

from tests.helpers import TOLERANCE, assert_close
from tests.ops.attention.inputs import IMPLS, differentiable_arrays, impl_cases, make_call, normal, reference_grads

CASES = {
    "bf16": dict(causal=True, bias_heads=4, sinks=(4, 2)),
    "causal_gqa": dict(causal=True),
    "one_query_long_kv": dict(causal=True, q_len=1, kv_len=40),
    "bias_soft_cap_sinks": dict(bias_heads=4, logits_soft_cap=2.0, sinks=(4, 2)),
    "bias_kv_heads_batch1_window": dict(bias_heads=2, bias_batch=1, sliding_window=(4, 3)),
    "shared_bias_and_sinks_mqa": dict(bias_heads=1, sinks=(3,), kv_heads=1),
    "segments_and_mask": dict(segments=True, causal=True),
    "mask_with_bias": dict(mask_heads=4, bias_heads=4, sinks=(4, 1)),
    "dropout": dict(dropout_prob=0.3, deterministic=False, dropout_rng=jax.random.key(5), bias_heads=4),
    "soft_cap_sinks_window_gqa": dict(logits_soft_cap=1.5, sinks=(8, 2), sliding_window=(3, 8), heads=8),
    "segments_more_queries": dict(segments=True, causal=True, q_len=37, kv_len=21),
    "bf16_no_bias": dict(causal=True, sinks=(4, 2), logits_soft_cap=3.0),
}


@functools.cache
def _case(case: str, dtype=jnp.float32):
    """The call, its output cotangent and the reference gradients, shared by both implementations."""
    call = make_call(**CASES[case], dtype=dtype)
    cotangent = normal(99, (*call.query.shape[:3], call.value.shape[-1]))
    return call, cotangent, reference_grads(call, cotangent)


def _grads(call, cfg, cotangent) -> dict:
    def loss(arrays):
        out = jax.checkpoint(lambda arrays: dataclasses.replace(call, **arrays).run(cfg))(arrays)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss))(differentiable_arrays(call))


@pytest.mark.parametrize(("case", "impl"), impl_cases({c: o for c, o in CASES.items() if not c.startswith("bf16")}))
def test_gradients_fp32(case, impl):
    call, cotangent, want = _case(case)
    got = _grads(call, IMPLS[impl], cotangent)
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].dtype == jnp.float32
        # d sinks sums batch x queries terms of both signs (-P_sink * dO.O): the fp32 rounding of
        # each term survives the cancellation, so its relative error is a few 1e-5.
        tol = 1e-4 if name == "sinks" else TOLERANCE[jnp.float32]
        assert_close(got[name], want[name], tol, f"d{name} {case}/{impl}")


@pytest.mark.parametrize(("case", "impl"), impl_cases({c: o for c, o in CASES.items() if c.startswith("bf16")}))
def test_gradients_bf16(case, impl):
    call, cotangent, want = _case(case, jnp.bfloat16)
    got = _grads(call, IMPLS[impl], cotangent)
    for name in got:
        assert got[name].dtype == jnp.bfloat16
        # bf16 rounding of the probabilities and of dS before the matmuls: a few 1e-3 relative.
        assert_close(got[name], want[name], 2 * TOLERANCE[jnp.bfloat16], f"d{name} {impl} bf16")
