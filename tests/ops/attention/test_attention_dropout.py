"""Dropout: the implementations apply the mask they draw (checked against the reference given that
mask), and the mask is deterministic per key, independent across batch, heads, queries and keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import Attention, attention
from hybrax.ops.attention import scores
from tests.helpers import TOLERANCE, assert_close
from tests.ops.attention.inputs import IMPLS, make_call, normal

RATE = 0.25


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_matches_reference_with_the_same_mask(impl):
    call = make_call(causal=True, bias_heads=4, sinks=(4, 2), dropout_prob=RATE, deterministic=False,
                     dropout_rng=jax.random.key(3))
    out = call.run(IMPLS[impl])
    assert_close(out, call.reference(), TOLERANCE[jnp.float32], impl)
    assert call.dropout_keep().mean() < 0.9  # the reference really dropped something


def _keep_mask(rng, shape=(2, 64, 4, 8), kv_len=64, kv_heads=2) -> np.ndarray:
    """The keep mask [B, H, Tq, Tk] that `attention` draws for `rng`."""
    q = jnp.zeros(shape)
    kv = jnp.zeros((shape[0], kv_len, kv_heads, shape[3]))
    p = Attention().prepare(q, kv, kv, None, rng, dropout_prob=RATE, deterministic=False)
    keep = np.asarray(scores.dropout_keep(p, jnp.arange(shape[1]), jnp.arange(kv_len)))
    return keep.reshape(shape[0], shape[2], shape[1], kv_len)


def test_keep_rate_and_independence():
    keep = _keep_mask(jax.random.key(0)).astype(np.float64)  # [2, 4, 64, 64]: 32768 draws
    # Keep rate within 5 standard deviations of 1 - RATE.
    assert abs(keep.mean() - (1 - RATE)) < 5 * np.sqrt(RATE * (1 - RATE) / keep.size)
    centred = keep - keep.mean()

    def correlation(a, b):
        return float(np.mean(a * b) / np.sqrt(np.mean(a * a) * np.mean(b * b)))

    bound = 5 / np.sqrt(keep[0, 0].size)  # 5 sigma of the correlation of independent draws
    pairs = {
        "batch": (centred[0, 0], centred[1, 0]),
        "heads sharing a kv head": (centred[0, 0], centred[0, 1]),
        "heads of different kv heads": (centred[0, 0], centred[0, 2]),
        "neighbouring queries": (centred[:, :, :-1], centred[:, :, 1:]),
        "neighbouring keys": (centred[..., :-1], centred[..., 1:]),
    }
    for name, (a, b) in pairs.items():
        assert abs(correlation(a, b)) < bound, f"dropout masks correlated across {name}"


def test_same_key_same_mask_other_key_other_mask():
    a, b = _keep_mask(jax.random.key(1)), _keep_mask(jax.random.key(2))
    assert np.array_equal(a, _keep_mask(jax.random.key(1)))
    assert 0.3 < np.mean(a != b) < 0.45  # 2 p (1 - p) = 0.375 for independent masks


@pytest.mark.parametrize("impl", IMPLS)
def test_dropout_is_off_when_deterministic_and_raw_keys_work(impl):
    q, k, v = normal(0, (1, 8, 2, 8)), normal(1, (1, 8, 2, 8)), normal(2, (1, 8, 2, 8))
    rng = jax.random.key(4)
    plain = attention(q, k, v, cfg=IMPLS[impl])
    off = attention(q, k, v, None, rng, dropout_prob=RATE, deterministic=True, cfg=IMPLS[impl])
    np.testing.assert_array_equal(plain, off)
    typed = attention(q, k, v, None, rng, dropout_prob=RATE, deterministic=False, cfg=IMPLS[impl])
    raw = attention(q, k, v, None, jax.random.key_data(rng), dropout_prob=RATE, deterministic=False,
                    cfg=IMPLS[impl])
    np.testing.assert_array_equal(typed, raw)
    assert not np.allclose(typed, plain)
