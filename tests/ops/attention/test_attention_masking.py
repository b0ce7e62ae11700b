"""Rows that see no key: zero output, zero and finite gradients, for every way of hiding keys."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import MaskInfo, attention
from tests.ops.attention.inputs import IMPLS, normal

B, TQ, TK, H, D = 2, 12, 20, 2, 8


def _qkv():
    return normal(0, (B, TQ, H, D)), normal(1, (B, TK, H, D)), normal(2, (B, TK, H, D))


def _empty_row_options():
    """(options, bool [B, TQ] of query rows that see nothing)."""
    q_ids = np.zeros((B, TQ), np.int32)
    q_ids[0, :3] = -1
    segments = MaskInfo.from_segments(jnp.asarray(q_ids), jnp.zeros((B, TK), jnp.int32))
    mask = np.ones((B, 1, TQ, TK), bool)
    mask[1, 0, 5] = False
    return {
        "padding_segment": (dict(mask_info=segments), q_ids == -1),
        "all_false_mask_row": (dict(mask_info=MaskInfo.from_attention_mask(jnp.asarray(mask))),
                               ~mask[:, 0].any(-1)),
    }


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("case", "sinks"), [("padding_segment", False), ("all_false_mask_row", True)])
def test_hidden_rows_give_zeros_and_zero_gradients(impl, case, sinks):
    q, k, v = _qkv()
    options, empty = _empty_row_options()[case]
    aux = normal(3, (H, 2)) if sinks else None
    bias = normal(4, (B, H, TQ, TK))

    def loss(q, k, v, bias, aux):
        out = attention(q, k, v, bias, None, aux, cfg=IMPLS[impl], **options)
        return jnp.sum(out * normal(5, out.shape)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4), has_aux=True))(q, k, v, bias, aux)
    assert empty.any() and not empty.all()
    assert np.all(np.asarray(out)[empty] == 0.0), "hidden rows must give zeros"
    assert np.abs(np.asarray(out)[~empty]).sum() > 0
    for g in grads:
        if g is not None:
            assert np.all(np.isfinite(np.asarray(g)))
    dq, dbias = np.asarray(grads[0]), np.asarray(grads[3])
    assert np.all(dq[empty] == 0.0)
    assert np.all(np.transpose(dbias, (0, 2, 1, 3))[empty] == 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_causal_queries_before_the_first_key_see_nothing(impl):
    q = normal(0, (1, 9, 2, 8))
    k, v = normal(1, (1, 4, 2, 8)), normal(2, (1, 4, 2, 8))
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, causal=True, cfg=IMPLS[impl]), q, k, v)
    out = np.asarray(out)
    # Query i sits at key position i - 5: rows 0..4 see nothing, row 5 sees key 0 only.
    assert np.all(out[:, :5] == 0.0)
    np.testing.assert_allclose(out[0, 5], np.asarray(v)[0, 0], rtol=1e-6)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in vjp(jnp.ones_like(jnp.asarray(out))))


@pytest.mark.parametrize("impl", IMPLS)
def test_mask_applies_together_with_bias(impl):
    q, k, v = _qkv()
    bias = normal(4, (B, H, TQ, TK))
    mask = np.array(jax.random.bernoulli(jax.random.key(7), 0.5, (B, 1, TQ, TK)))
    mask[..., 0] = True
    with_mask = attention(q, k, v, bias, mask_info=MaskInfo.from_attention_mask(jnp.asarray(mask)), cfg=IMPLS[impl])
    # The same mask as a -1e9 bias: identical output only if neither replaced the other.
    as_bias = attention(q, k, v, bias + jnp.where(jnp.asarray(mask), 0.0, -1e9), cfg=IMPLS[impl])
    np.testing.assert_allclose(with_mask, as_bias, rtol=1e-5, atol=1e-6)
    assert not np.allclose(with_mask, attention(q, k, v, bias, cfg=IMPLS[impl]), atol=1e-3)
    assert not np.allclose(with_mask, attention(q, k, v, mask_info=MaskInfo.from_attention_mask(
        jnp.asarray(mask)), cfg=IMPLS[impl]), atol=1e-3)
