"""Forward of both implementations against the float64 reference: gate forms, GQA, V != K, reverse,
odd lengths, T = 1, packed sequences with empty ones, strong gates, bf16, every chunk size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import RecurrentAttentionConfig, recurrent_attention
from hybrax.ops.recurrent import xla_chunked
from hybrax.ops.recurrent.xla_chunked import CHUNK_SIZES
from tests.helpers import TOLERANCE, assert_close
from tests.ops.recurrent.inputs import IMPLS, make_call

FP32 = TOLERANCE[jnp.float32]

GATE_SETS = {
    "none": dict(gates=()),
    "scalar_g_gamma": dict(gates=("g", "g_gamma")),
    "g_per_key": dict(gates=("g",), g_per_key=True),
    "gk": dict(gates=("gk",)),
    "gv_only": dict(gates=("gv",)),
    "g_gamma_gv": dict(gates=("g_gamma", "gv")),
    "all": dict(gates=("g", "g_gamma", "gk", "gv")),
}


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gate_set", GATE_SETS)
def test_matches_reference(impl, gate_set):
    call = make_call(1, **GATE_SETS[gate_set])
    assert_close(call.run(IMPLS[impl]), call.reference(), FP32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("gate_set", ["scalar_g_gamma", "all"])
def test_reverse(impl, gate_set):
    call = make_call(1, reverse=True, **GATE_SETS[gate_set])
    assert_close(call.run(IMPLS[impl]), call.reference(), FP32)


@pytest.mark.parametrize("impl", IMPLS)
def test_output_dtype_shapes_and_default_return(impl):
    call = make_call(2, value_dim=5)
    output, final = call.run(IMPLS[impl])
    assert output.shape == (2, 37, 4, 5) and output.dtype == jnp.float32
    assert final.shape == (2, 4, 8, 5) and final.dtype == jnp.float32
    alone = jax.jit(lambda *args: recurrent_attention(*args, cfg=IMPLS[impl]))(*call.args())
    np.testing.assert_array_equal(alone, output)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seq_len", [1, 16, 33])
def test_lengths_around_chunks(impl, seq_len):
    call = make_call(3, seq_len=seq_len, heads=2, kv_heads=1, g_per_key=True, g_gamma_batched=True)
    assert_close(call.run(IMPLS[impl]), call.reference(), FP32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reverse", [False, True])
def test_packed_sequences_with_empty_ones(impl, reverse):
    # Empty sequences first, in the middle and last; lengths across chunk boundaries.
    call = make_call(4, cu_seqlens=[0, 0, 5, 5, 22, 40, 40], heads=2, kv_heads=1, reverse=reverse)
    output, final = call.run(IMPLS[impl])
    assert final.shape == (6, 2, 8, 6)
    assert_close((output, final), call.reference(), FP32)
    # An empty sequence hands its initial state back unchanged.
    np.testing.assert_array_equal(final[0], call.arrays["initial_state"][0])


@pytest.mark.parametrize("impl", IMPLS)
def test_packed_equals_separate_calls(impl):
    call = make_call(5, cu_seqlens=[0, 7, 30], gates=("g", "gk"), initial_state=False)
    output, final = call.run(IMPLS[impl])
    for index, (start, end) in enumerate([(0, 7), (7, 30)]):
        part = {name: call.arrays[name][:, start:end] for name in ("query", "key", "value", "g", "gk")}
        alone, alone_final = jax.jit(lambda q, k, v, g, gk: recurrent_attention(
            q, k, v, g, None, gk, return_state=True, cfg=IMPLS[impl]))(*part.values())
        assert_close(output[:, start:end], np.asarray(alone, np.float64), FP32)
        assert_close(final[index], np.asarray(alone_final[0], np.float64), FP32)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["batch", "packed"])
def test_strong_gates_are_finite_and_exact(impl, layout):
    packed = [0, 9, 9, 37] if layout == "packed" else None
    call = make_call(6, g_per_key=True, strong_fraction=0.2, cu_seqlens=packed)
    output, final = call.run(IMPLS[impl])
    assert np.all(np.isfinite(output)) and np.all(np.isfinite(final))
    assert_close((output, final), call.reference(), FP32)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_gates_minus_1000_leave_only_the_current_token(impl):
    call = make_call(7, gates=("gk",), initial_state=True)
    call.arrays["gk"] = jnp.full_like(call.arrays["gk"], -1000.0)
    output, _ = call.run(IMPLS[impl])
    assert np.all(np.isfinite(output))
    assert_close(output, call.reference()[0], FP32)


@pytest.mark.parametrize("impl", IMPLS)
def test_bfloat16(impl):
    call = make_call(8, dtype=jnp.bfloat16)
    output, final = call.run(IMPLS[impl])
    assert output.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert_close((output, final), call.reference(), TOLERANCE[jnp.bfloat16])


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
def test_every_chunk_size(chunk_size):
    call = make_call(9, seq_len=130, batch=1, g_per_key=True)
    cfg = RecurrentAttentionConfig("xla", "chunked", chunk_size=chunk_size)
    assert_close(call.run(cfg), call.reference(), FP32)


@pytest.mark.parametrize("impl", IMPLS)
def test_softmax_scale(impl):
    call = make_call(10, gates=("gk",))
    scaled, _ = call.run(IMPLS[impl], softmax_scale=0.3)
    unscaled, _ = call.run(IMPLS[impl], softmax_scale=1.0)
    assert_close(scaled, 0.3 * np.asarray(unscaled, np.float64), FP32)


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_checkpoint(impl):
    call, other = make_call(11, batch=1, gates=("g", "gk")), make_call(12, batch=1, gates=("g", "gk"))

    def run(*args):
        return recurrent_attention(*args, return_state=True, cfg=IMPLS[impl])

    assert_close(jax.jit(run)(*call.args()), call.reference(), FP32)
    assert_close(jax.jit(jax.checkpoint(run))(*call.args()), call.reference(), FP32)
    stacked = [None if a is None else jnp.stack([a, b]) for a, b in zip(call.args(), other.args())]
    output, final = jax.jit(jax.vmap(run))(*stacked)
    for index, single in enumerate((call, other)):
        assert_close((output[index], final[index]), single.reference(), FP32)


@pytest.mark.parametrize("layout", ["batch", "packed"])
def test_chunks_processed_in_groups(monkeypatch, layout):
    """Small groups (3 rows of chunks, the last group padded) give the same answer as one pass."""
    monkeypatch.setattr(xla_chunked, "GROUP_TOKENS", 3 * 16)
    packed = [0, 0, 5, 22, 40] if layout == "packed" else None
    call = make_call(13, g_per_key=True, cu_seqlens=packed)
    assert_close(call.run(IMPLS["chunked"]), call.reference(), FP32)
