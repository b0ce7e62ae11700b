"""Every serving function under jax.vmap over a leading layers axis (one pool per layer, as a model stacking its
KDA or attention layers holds them), against one call per layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.serving import (
    attention_decode_pool, kda_decode_pool, kda_prefill_pool, short_conv_decode, short_conv_prefill,
)
from tests.helpers import assert_close, normal

LAYERS, BATCH, HEADS, DIM, SLOTS = 2, 3, 2, 16, 5
ROWS = jnp.array([4, -1, 1], jnp.int32)  # a padded request among them


def check_layers(step, layered, tol=1e-6):
    """vmap(step) over the layers axis of every array in `layered` == step on each layer's arrays."""
    got = jax.jit(jax.vmap(step))(*layered)
    want = [step(*(x[layer] for x in layered)) for layer in range(LAYERS)]
    assert_close(got, jax.tree.map(lambda *per_layer: np.stack(per_layer), *want), tol)


def kda_inputs(tokens):
    q, k, v = (normal(seed, (LAYERS, BATCH, tokens, HEADS, DIM)) for seed in range(3))
    g = jax.nn.log_sigmoid(normal(3, (LAYERS, BATCH, tokens, HEADS, DIM)))
    return q, k, v, g, normal(4, (LAYERS, BATCH, tokens, HEADS)), normal(5, (LAYERS, SLOTS, HEADS, DIM, DIM))


@pytest.mark.parametrize("platform", ["xla", "pallas"])
def test_kda_decode_and_prefill(platform):
    def decode(*arrays):
        return kda_decode_pool(*arrays, ROWS, beta_is_logits=True, platform=platform)

    def prefill(*arrays):
        return kda_prefill_pool(*arrays, ROWS, beta_is_logits=True, platform=platform)

    check_layers(decode, kda_inputs(1))
    check_layers(prefill, kda_inputs(7), 1e-5)


@pytest.mark.parametrize("platform", ["xla", "pallas"])
def test_attention_decode_pool(platform):
    cached = jnp.array([3, 0, 7], jnp.int32)

    def step(q, k, v, k_pool, v_pool):
        return attention_decode_pool(q, k, v, k_pool, v_pool, ROWS, cached, platform=platform)

    q = normal(10, (LAYERS, BATCH, 1, 4, 16))
    k, v = normal(11, (LAYERS, BATCH, 1, 2, 16)), normal(12, (LAYERS, BATCH, 1, 2, 16))
    check_layers(step, (q, k, v, normal(13, (LAYERS, SLOTS, 32, 2, 16)), normal(14, (LAYERS, SLOTS, 32, 2, 16))))


def test_short_conv():
    weight = normal(20, (24, 4))
    conv_pool = normal(21, (LAYERS, SLOTS, 24, 3))
    check_layers(lambda x, pool: short_conv_decode(x, pool, weight, ROWS), (normal(22, (LAYERS, BATCH, 24)), conv_pool))
    check_layers(lambda x, pool: short_conv_prefill(x, pool, weight, ROWS),
                 (normal(23, (LAYERS, BATCH, 6, 24)), conv_pool))
