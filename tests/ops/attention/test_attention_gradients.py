"""Gradients of both implementations (query, key, value, bias, sinks) against float64 autodiff of the
reference math, under jit, grad and checkpoint."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.attention import reference
from tests.helpers import TOLERANCE, assert_close, to64
from tests.ops.attention.inputs import IMPLS, make_call, normal

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
}


@functools.cache
def _case(case: str, dtype=jnp.float32):
    """The call, its output cotangent and the reference gradients, shared by both implementations."""
    call = make_call(**CASES[case], dtype=dtype)
    cotangent = normal(99, (*call.query.shape[:3], call.value.shape[-1]))
    return call, cotangent, _reference_grads(call, cotangent)


def _reference_grads(call, cotangent):
    """jax.grad (jitted) of the reference math in float64 for (query, key, value, bias, sinks)."""
    with jax.enable_x64(True):
        arrays = [None if a is None else jnp.asarray(to64(a)) for a in (call.query, call.key, call.value, call.bias, call.sinks)]
        seen, kwargs = call.seen(), call.reference_kwargs()

        def loss(q, k, v, bias, sinks):
            out = reference.attention_math(jnp, q, k, v, bias, sinks, seen=seen, **kwargs)
            return jnp.sum(out * jnp.asarray(cotangent, jnp.float64))

        present = [i for i, a in enumerate(arrays) if a is not None]
        grads = jax.jit(jax.grad(lambda *xs: loss(*[dict(zip(present, xs)).get(i) for i in range(5)]),
                         argnums=tuple(range(len(present)))))(*[arrays[i] for i in present])
        return [np.asarray(g) for g in grads], present


def _grads(call, cfg, cotangent):
    arrays = [call.query, call.key, call.value, call.bias, call.sinks]
    present = [i for i, a in enumerate(arrays) if a is not None]

    def loss(*xs):
        given = dict(zip(present, xs))
        q, k, v, bias, sinks = (given.get(i) for i in range(5))
        run = lambda q, k, v: dataclasses.replace(call, query=q, key=k, value=v, bias=bias, sinks=sinks).run(cfg)
        out = jax.checkpoint(run)(q, k, v)
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    return jax.jit(jax.grad(loss, argnums=tuple(range(len(present)))))(*[arrays[i] for i in present])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", [c for c in CASES if c != "bf16"])
def test_gradients_fp32(case, impl):
    call, cotangent, (want, present) = _case(case)
    got = _grads(call, IMPLS[impl], cotangent)
    names = ["query", "key", "value", "bias", "sinks"]
    for index, g, w in zip(present, got, want):
        assert g.dtype == jnp.float32
        # d sinks sums batch x queries terms of both signs (-P_sink * dO.O): the fp32 rounding of
        # each term survives the cancellation, so its relative error is a few 1e-5.
        tol = 1e-4 if names[index] == "sinks" else TOLERANCE[jnp.float32]
        assert_close(g, w, tol, f"d{names[index]} {case}/{impl}")


@pytest.mark.parametrize("impl", IMPLS)
def test_gradients_bf16(impl):
    call, cotangent, (want, _) = _case("bf16", jnp.bfloat16)
    got = _grads(call, IMPLS[impl], cotangent)
    for g, w in zip(got, want):
        assert g.dtype == jnp.bfloat16
        # bf16 rounding of the probabilities and of dS before the matmuls: a few 1e-3 relative.
        assert_close(g, w, 2 * TOLERANCE[jnp.bfloat16], f"{impl} bf16 grads")
