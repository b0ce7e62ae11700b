"""The pieces under the layers: packing (cu_seqlens and segment_ids), ShortConvolution (training, prefill, decode)
and the RMS norms, against float64 NumPy."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrax.nn import GatedRMSNorm, RMSNorm, ShortConvolution
from hybrax.core.packing import from_cu_seqlens, from_segment_ids
from tests.helpers import TOLERANCE, assert_close
from tests.nn import reference

TOL = TOLERANCE[jnp.float32]


def test_segment_ids_become_runs_positions_and_flat_cu_seqlens():
    ids = np.array([[3, 3, 1, 1, 1, 3, -1], [0, 0, 0, 0, 0, 0, 0]], np.int32)
    pack = from_segment_ids(ids, 2, 7, None, with_cu_seqlens=True)
    np.testing.assert_array_equal(pack.segments, [[0, 0, 1, 1, 1, 2, -1], [0, 0, 0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(pack.positions, [[0, 1, 0, 1, 2, 0, 0], [0, 1, 2, 3, 4, 5, 6]])
    np.testing.assert_array_equal(pack.cu_seqlens, [0, 2, 5, 6, 7, 14])  # the padding run is a sequence too
    padded = from_segment_ids(ids, 2, 7, 7, with_cu_seqlens=True)
    np.testing.assert_array_equal(padded.cu_seqlens, [0, 2, 5, 6, 7, 14, 14, 14])
    with pytest.raises(ValueError, match=r"max_segments \(4\) must be at least the number of runs .* got 5 runs"):
        from_segment_ids(ids, 2, 7, 4, with_cu_seqlens=True)
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq_len\] \(x's\) = \[2, 8\]"):
        from_segment_ids(ids, 2, 8, None, with_cu_seqlens=False)


def test_cu_seqlens_become_segments_and_positions():
    pack = from_cu_seqlens(jnp.array([0, 2, 2, 5]), 1, 7)
    np.testing.assert_array_equal(pack.segments, [[0, 0, 2, 2, 2, -1, -1]])
    np.testing.assert_array_equal(pack.positions, [[0, 1, 0, 1, 2, 0, 0]])


def conv_reference(conv, x, pieces):
    weight, bias = np.asarray(conv.weight[...], np.float64)[:, None], np.asarray(conv.bias[...], np.float64)
    return reference.per_sequence(lambda t: reference.short_conv(t, weight, bias), np.asarray(x), pieces)


def test_short_convolution_keeps_sequences_apart_and_serves():
    conv = ShortConvolution(6, 4, bias=True, rngs=nnx.Rngs(0))
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 9, 6)), jnp.float32)
    run = nnx.jit(lambda conv, x, cu, ids: conv(x, cu_seqlens=cu, segment_ids=ids))
    ids = np.array([[0, 0, 0, 0, 0, 1, 1, 2, 2], [5, 5, 5, 5, 5, 5, 5, 5, 5]], np.int32)
    pieces = [(0, slice(0, 5)), (0, slice(5, 7)), (0, slice(7, 9)), (1, slice(0, 9))]
    assert_close(run(conv, x, None, jnp.asarray(ids)), conv_reference(conv, x, pieces), TOL)
    cu = jnp.array([0, 1, 6, 8], jnp.int32)
    want = conv_reference(conv, x[:1], [(0, slice(0, 1)), (0, slice(1, 6)), (0, slice(6, 8))])
    assert_close(run(conv, x[:1], cu, None)[:, :8], want[:, :8], TOL)

    pool = conv.empty_cache(4)
    y, pool = nnx.jit(lambda conv, x, pool: conv.prefill(x, pool, jnp.array([2, 0]), cu_seqlens=jnp.array([0, 2, 6])))(
        conv, x[:1, :6], pool)
    assert_close(y, conv_reference(conv, x[:1, :6], [(0, slice(0, 2)), (0, slice(2, 6))]), TOL)
    y, pool = nnx.jit(lambda conv, x, pool: conv.decode(x, pool, jnp.array([0, -1])))(conv, x[:, 6:7], pool)
    assert_close(y[0], conv_reference(conv, x[:1, 2:7], [(0, slice(0, 5))])[0, 4:], TOL)
    assert np.all(np.asarray(y[1]) == 0)
    with pytest.raises(ValueError, match=r"x must have shape \[batch, 1, hidden_size\] = \[\*, 1, 6\], got \[2, 2, "):
        conv.decode(x[:, :2], pool, jnp.array([0, 1]))


@pytest.mark.parametrize("activation", ["sigmoid", "swish"])
def test_norms(activation):
    rng = np.random.default_rng(1)
    x, gate, weight = rng.normal(size=(3, 5, 8)), rng.normal(size=(3, 5, 8)), rng.normal(size=8)
    norm, gated = RMSNorm(8, eps=1e-5), GatedRMSNorm(8, eps=1e-5, activation=activation)
    norm.load_fla_state_dict({"weight": weight.astype(np.float32)})
    gated.load_fla_state_dict({"weight": weight.astype(np.float32)})
    normalized = reference.rms_norm(x, weight, 1e-5)
    act = reference.sigmoid(gate, np) * (gate if activation == "swish" else 1.0)
    assert_close(norm(jnp.asarray(x, jnp.float32)), normalized, TOL)
    assert_close(gated(jnp.asarray(x, jnp.float32), jnp.asarray(gate, jnp.float32)), normalized * act, TOL)
    with pytest.raises(ValueError, match="activation must be one of"):
        GatedRMSNorm(8, activation="relu")
