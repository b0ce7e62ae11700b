"""The Pallas path (KDA's chunk kernels without the delta rule, interpret mode here) against the float64
reference: every gate along the key axis, strong gates, ragged lengths, packed sequences, GQA, bf16; and what it
declines. Its gradients:
test_recurrent_gradients.py."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from hybrax import recurrent_attention
from hybrax.ops.recurrent.api import RecurrentAttention
from hybrax.ops.recurrent.reference import recurrent_reference
from tests.helpers import TOLERANCE, assert_close, on_h200
from tests.ops.recurrent.inputs import PALLAS, make_call

CASES = {
    "no_gate": dict(gates=()),
    "scalar_g_and_g_gamma_per_batch": dict(gates=("g", "g_gamma"), g_gamma_batched=True),
    "g_per_key": dict(gates=("g",), g_per_key=True),
    "gk_no_initial_state": dict(gates=("gk",), initial_state=False),
    "g_g_gamma_gk": dict(gates=("g", "g_gamma", "gk")),
    "strong_gates": dict(gates=("g", "gk"), strong_fraction=0.2),
    "one_token": dict(gates=("gk",), seq_len=1),
    "one_chunk": dict(gates=("gk",), seq_len=16),
    "mha_wide_heads": dict(gates=("gk",), heads=2, kv_heads=2, key_dim=32, value_dim=24),
    "packed_with_empty_sequences": dict(gates=("g", "gk"), cu_seqlens=[0, 0, 5, 5, 27, 40]),
    "packed_one_token_no_state": dict(gates=("gk",), cu_seqlens=[0, 1, 18], initial_state=False),
}


@pytest.mark.parametrize("case", CASES)
def test_matches_reference(case):
    call = make_call(3, **CASES[case])
    assert_close(call.run(PALLAS), call.reference(), TOLERANCE[jnp.float32], case)


def test_bf16():
    call = make_call(4, gates=("g", "gk"), dtype=jnp.bfloat16)
    output, final = call.run(PALLAS)
    assert output.dtype == jnp.bfloat16 and final.dtype == jnp.float32
    assert_close((output, final), call.reference(), TOLERANCE[jnp.bfloat16])


@pytest.mark.parametrize(("options", "reason"), [
    (dict(gates=("gk", "gv")), "value gate"),
    (dict(gates=("gk",), reverse=True), "reverse=False"),
])
def test_declines_with_the_reason(options, reason):
    call = make_call(5, **options)
    with pytest.raises(ValueError, match=f"pallas:chunked cannot run this call: .*{reason}"):
        recurrent_attention(*call.args(), reverse=call.reverse, cfg=PALLAS)


@pytest.mark.parametrize(("options", "chosen"), [
    (dict(gates=("gk",)), "pallas:chunked"), (dict(gates=("g",), cu_seqlens=[0, 0, 5, 64]), "pallas:chunked"),
    (dict(gates=("gk", "gv")), "xla:chunked"), (dict(gates=("gk",), reverse=True), "xla:chunked"),
])
def test_auto_on_a_gpu(options, chosen):
    """What `auto` takes on a GPU for a call long enough for the chunked path (the invocation as a GPU call would
    build it), and on the CPU (the scan, at every length)."""
    call = make_call(7, seq_len=64, **options)
    kernel = RecurrentAttention()
    inv = kernel.invocation(kernel.prepare(*call.args(), reverse=call.reverse))
    assert kernel.implementations(on_h200(inv))[0].name == chosen
    assert kernel.implementations(inv)[0].name == "xla:scan"


def test_softmax_scale():
    call = make_call(6, gates=("g", "gk"))
    want = recurrent_reference(*call.args(), softmax_scale=0.3)
    assert_close(call.run(PALLAS, softmax_scale=0.3), want, TOLERANCE[jnp.float32])
