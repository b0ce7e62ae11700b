"""The Pallas TPU decode kernel (TPU interpret mode on the CPU, compiled on a TPU) against the float64 reference:
through kda_decode_pool (outputs, the rows it updates in place, the rows it must leave alone: unnamed and
padded slots; fused gates, grouped value heads, several tokens per request, several steps of value-head
blocks) and through kernel_delta_attention at T = 1."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core import registry
from hybrax.ops.kda import reference
from hybrax.ops.kda import api
from hybrax.ops.kda.api import KernelDeltaAttentionConfig, kernel_delta_attention
from hybrax.ops.kda.pallas_tpu import pool_register, register  # noqa: F401  (register the TPU implementations)
from hybrax.ops.kda.pallas_tpu.decode import fused_recurrent_decode
from hybrax.serving import KdaDecodePool, kda_decode_pool
from tests.helpers import TOLERANCE, assert_close, normal, to64
from tests.serving.test_kda_pool import reference_run

SLOTS = 7


def case(seed, batch, tokens, heads, value_heads, dk, dv, gate):
    q, k = normal(seed, (batch, tokens, heads, dk)), normal(seed + 1, (batch, tokens, heads, dk))
    v = normal(seed + 2, (batch, tokens, value_heads, dv))
    g = normal(seed + 3, (batch, tokens, value_heads, dk))
    g = jax.nn.log_sigmoid(g) if gate == "activated" else g
    beta = normal(seed + 4, (batch, tokens, value_heads))
    kwargs = {} if gate == "activated" else {
        "a_log": normal(seed + 5, (value_heads,), scale=0.5), "dt_bias": normal(seed + 6, (value_heads, dk)),
        **({"lower_bound": -5.0} if gate == "bounded" else {}),
    }
    return (q, k, v, g, beta), kwargs


@pytest.mark.parametrize("gate, tokens, heads, value_heads", [
    ("bounded", 1, 1, 2),  # GQA: two value heads per query/key head
    ("softplus", 3, 16, 16),  # three tokens per request (speculative decoding); two steps of 8 value heads
])
def test_decode_by_slot_in_place(gate, tokens, heads, value_heads):
    slots = np.array([4, -1, 0, 6], np.int32)
    dk, dv = 16, 32
    inputs, kwargs = case(10, len(slots), tokens, heads, value_heads, dk, dv, gate)
    states = normal(12, (len(slots), value_heads, dk, dv))
    pool = np.array(normal(13, (SLOTS, value_heads, dk, dv)))
    pool[slots[slots >= 0]] = np.asarray(states)[slots >= 0]
    run = jax.jit(lambda pool, *x: kda_decode_pool(*x, pool, jnp.asarray(slots), gate=gate, beta_is_logits=True,
                                                   platform="pallas_tpu", **kwargs), donate_argnums=0)
    o, new_pool = run(jnp.asarray(pool), *inputs)
    ref_o, ref_states = reference_run(inputs, states, kwargs)
    valid = slots >= 0
    assert_close(o[valid], ref_o[valid], TOLERANCE[jnp.float32])
    assert np.all(np.asarray(o[~valid]) == 0), "padded requests output zeros"
    new_pool = np.asarray(new_pool)
    assert_close(new_pool[slots[valid]], ref_states[valid], TOLERANCE[jnp.float32], "pool rows")
    untouched = np.setdiff1d(np.arange(SLOTS), slots)
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])


@pytest.mark.parametrize("per_head", [False, True])
def test_kernel_delta_attention_step(per_head):
    """T = 1 with initial states (GQA; decay per channel or per head): the batch's states are the pool."""
    (q, k, v, g, beta), _ = case(30, 3, 1, 1, 2, 16, 32, "activated")
    g = g[..., 0] if per_head else g
    beta = jax.nn.sigmoid(beta)
    h0 = normal(37, (3, 2, 16, 32), scale=0.5)
    cfg = KernelDeltaAttentionConfig("pallas_tpu", "decode")
    o, final = jax.jit(lambda *x: kernel_delta_attention(*x, return_state=True, cfg=cfg))(q, k, v, beta, g, h0)
    ref_o, ref_final = reference.kda_reference(*(to64(x) for x in (q, k, v, beta, g, h0)))
    assert_close(o, ref_o, TOLERANCE[jnp.float32], "output")
    assert_close(final, ref_final, TOLERANCE[jnp.float32], "final state")


def test_the_step_is_opt_in_and_one_token_only():
    """Not yet run on a TPU: `auto` never takes it (a TPU's T = 1 call stays on XLA's single step)."""
    kernel = api.KernelDeltaAttention()

    def invocation(tokens, platform=None):
        (q, k, v, g, beta), _ = case(0, 1, tokens, 1, 1, 16, 16, "activated")
        inv = kernel.invocation(kernel.prepare(q, k, v, jax.nn.sigmoid(beta), g), platform)
        return dataclasses.replace(inv, device="tpu")

    def chosen(inv):
        return [impl.name for impl in registry.supported("kernel_delta_attention", inv)]

    assert chosen(invocation(1))[0] == "xla:single_step"
    assert chosen(invocation(1, "pallas_tpu"))[0] == "pallas_tpu:decode"
    assert chosen(invocation(2, "pallas_tpu")) == ["pallas_tpu:chunked"]


def test_declines_what_it_does_not_cover():
    impl = registry.lookup("kda_decode_pool", "pallas_tpu", "fused_recurrent")
    kernel = KdaDecodePool()
    (q, k, v, g, beta), _ = case(0, 2, 2, 1, 1, 16, 16, "activated")
    pool, slots = jnp.zeros((3, 1, 16, 16)), jnp.array([0, 1], jnp.int32)

    def reason(**kwargs):
        return impl.supports(kernel.invocation(kernel.prepare(q, k, v, g, beta, pool, slots, **kwargs)))

    assert "token_slots" in reason(token_slots=jnp.array([[0, 2], [1, -1]], jnp.int32))
    assert "V-first" in reason(state_v_first=True)
    assert reason() is None


@pytest.mark.parametrize("in_place", [True, False])
def test_lowers_to_mosaic(in_place):
    """The kernel through Pallas' Mosaic lowering for a TPU (no TPU needed)."""
    shape = (64, 1, 16, 128)
    arrays = [jax.ShapeDtypeStruct(shape, jnp.bfloat16)] * 3 + [
        jax.ShapeDtypeStruct(shape, jnp.float32), jax.ShapeDtypeStruct(shape[:3], jnp.float32),
        jax.ShapeDtypeStruct((80, 16, 128, 128), jnp.float32), jax.ShapeDtypeStruct((64,), jnp.int32),
    ]

    def step(*x):
        return fused_recurrent_decode(*x, scale=0.1, in_place=in_place, interpret=False)

    text = jax.jit(step).trace(*arrays).lower(lowering_platforms=("tpu",)).as_text()
    assert "kda_decode_tpu" in text
