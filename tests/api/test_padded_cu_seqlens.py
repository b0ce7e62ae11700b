"""A cu_seqlens padded to a fixed length with its last value (empty sequences at the end) lets the number of
documents vary without a retrace: a jitted call traces once for two document counts, matches the unpadded call,
and the empty sequences' final states are their initial states. On every backend that takes packed sequences."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda.api import KernelDeltaAttentionConfig
from hybrax.ops.kda.kimi import kimi_delta_attention
from hybrax.ops.recurrent.api import RecurrentAttentionConfig
from hybrax.ops.recurrent.gla import gated_linear_attention
from tests.helpers import TOLERANCE, assert_close, normal

T, H, K, V = 13, 2, 16, 8
SLOTS = 5  # the fixed maximum of documents
DOCUMENTS = ([0, 4, 9, 13], [0, 2, 3, 7, 11, 13])  # three, then five documents
TOL = TOLERANCE[jnp.float32]
GLA = {
    "xla scan": RecurrentAttentionConfig("xla", "scan"),
    "xla chunked": RecurrentAttentionConfig("xla", "chunked", chunk_size=16),
    "pallas chunked": RecurrentAttentionConfig("pallas", "chunked", chunk_size=16),
}

KDA = {
    "xla scan": KernelDeltaAttentionConfig("xla", "scan"),
    "xla chunked": KernelDeltaAttentionConfig("xla", "chunked", chunk_size=16),
    "pallas chunked": KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=16),
}


def padded(cu: list[int]) -> jax.Array:
    return jnp.array(cu + [cu[-1]] * (SLOTS + 1 - len(cu)), jnp.int32)


def check_traces_once(call, initial_state):
    """call(cu_seqlens, initial_state) -> (o, final_state), jitted with a trace counter, against its unpadded calls."""
    traces = []

    @jax.jit
    def jitted(cu_seqlens, initial_state):
        traces.append(cu_seqlens.shape)
        return call(cu_seqlens, initial_state)

    for cu in DOCUMENTS:
        documents = len(cu) - 1
        o, state = jitted(padded(cu), initial_state)
        expected_o, expected_state = call(jnp.array(cu, jnp.int32), initial_state[:documents])
        assert_close(o, expected_o, TOL, "o")
        assert_close(state[:documents], expected_state, TOL, "final_state")
        np.testing.assert_array_equal(state[documents:], initial_state[documents:])
    assert len(traces) == 1, f"traced {len(traces)} times"


@pytest.mark.parametrize("name", GLA)
def test_gated_linear_attention(name):
    q, k, v = normal(0, (1, T, H, K)), normal(1, (1, T, H, K)), normal(2, (1, T, H, V))
    g = jax.nn.log_sigmoid(normal(3, (1, T, H, K)) + 2.0)

    def call(cu_seqlens, initial_state):
        return gated_linear_attention(q, k, v, g, initial_state=initial_state, output_final_state=True,
                                      cu_seqlens=cu_seqlens, cfg=GLA[name])

    check_traces_once(call, normal(4, (SLOTS, H, K, V), scale=0.5))


@pytest.mark.parametrize("name", KDA)
def test_kimi_delta_attention(name):
    q, k, v = normal(0, (1, T, H, K)), normal(1, (1, T, H, K)) / 3, normal(2, (1, T, H, V))
    g, beta = -jax.nn.softplus(normal(3, (1, T, H, K))), jax.nn.sigmoid(normal(4, (1, T, H)))

    def call(cu_seqlens, initial_state):
        return kimi_delta_attention(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                    cu_seqlens=cu_seqlens, cfg=KDA[name])

    check_traces_once(call, normal(5, (SLOTS, H, K, V), scale=0.5))
