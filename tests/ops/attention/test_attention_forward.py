"""Every option of `attention`, both XLA implementations, against the float64 reference."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from tests.helpers import TOLERANCE, assert_close
from tests.ops.attention.inputs import IMPLS, XLA_IMPLS, impl_cases, make_call

# name -> make_call arguments. Lengths 19 x 27 give ragged tiles; Tq != Tk checks the alignment.
CASES = {
    "plain": {},
    "causal": dict(causal=True),
    "causal_square_window": dict(causal=True, q_len=24, kv_len=24, sliding_window=(6, 3)),
    "causal_one_query_long_kv": dict(causal=True, q_len=1, kv_len=70),
    "causal_more_queries_than_keys": dict(causal=True, q_len=30, kv_len=11),
    "window_int_and_scale": dict(sliding_window=5, softmax_scale=0.7),
    "window_asymmetric": dict(sliding_window=(2, 9)),
    "bias_per_head": dict(bias_heads=4),
    "bias_per_kv_head": dict(bias_heads=2),
    "bias_batch1_shared_sinks": dict(bias_heads=1, bias_batch=1, sinks=(2,)),
    "soft_cap_after_bias": dict(bias_heads=4, logits_soft_cap=2.0),
    "soft_cap_sinks_window": dict(logits_soft_cap=1.5, sinks=(4, 2), sliding_window=(3, 8)),
    "segments_causal_gqa": dict(segments=True, causal=True, heads=8, kv_heads=2, q_len=33, kv_len=33),
    "segments": dict(segments=True),
    "mask_shared_heads": dict(mask_heads=1),
    "mask_per_head_with_bias": dict(mask_heads=4, bias_heads=4),
    "sinks_per_head": dict(sinks=(4, 3)),
    "mha_same_head_dims": dict(kv_heads=4, v_dim=16),
    "mqa": dict(kv_heads=1),
    "gqa_4": dict(heads=8, kv_heads=2),
    "everything": dict(causal=True, sliding_window=(7, 2), bias_heads=2, logits_soft_cap=3.0, mask_heads=1,
                       sinks=(4, 2), softmax_scale=0.3),
}


@pytest.mark.parametrize(("case", "impl"), impl_cases(CASES))
def test_forward_fp32(case, impl):
    call = make_call(**CASES[case])
    out = call.run_jit(IMPLS[impl])
    assert out.dtype == jnp.float32
    assert_close(out, call.reference(), TOLERANCE[jnp.float32], f"{case}/{impl}")


@pytest.mark.parametrize(("case", "impl"), impl_cases(
    {case: CASES[case] for case in ("plain", "causal_one_query_long_kv", "everything", "segments", "gqa_4",
                                    "soft_cap_sinks_window")}))
def test_forward_bf16(case, impl):
    call = make_call(**CASES[case], dtype=jnp.bfloat16)
    out = call.run_jit(IMPLS[impl])
    assert out.dtype == jnp.bfloat16
    assert_close(out, call.reference(), TOLERANCE[jnp.bfloat16], f"{case}/{impl}")


@pytest.mark.parametrize(("case", "impl"), impl_cases(
    {case: CASES[case] for case in ("causal", "everything", "segments_causal_gqa")}, XLA_IMPLS))
def test_forward_fp16(case, impl):
    call = make_call(**CASES[case], dtype=jnp.float16)
    out = call.run_jit(IMPLS[impl])
    assert out.dtype == jnp.float16
    assert_close(out, call.reference(), TOLERANCE[jnp.float16], f"{case}/{impl}")


@pytest.mark.parametrize("impl", XLA_IMPLS)
def test_bf16_softmax_dtype_rounds_the_scores_only(impl):
    """fp32 inputs with the softmax in bf16: the output stays fp32, within bf16's tolerance and off fp32's."""
    call = make_call(**CASES["everything"])
    out = call.run_jit(IMPLS[impl], softmax_dtype=jnp.bfloat16)
    assert out.dtype == jnp.float32
    error = assert_close(out, call.reference(), TOLERANCE[jnp.bfloat16])
    assert error > TOLERANCE[jnp.float32], "softmax_dtype=bfloat16 was ignored"


@pytest.mark.parametrize("impl", IMPLS)
def test_fp32_inputs_with_bf16_dtype_compute_in_bf16(impl):
    call = make_call(causal=True)
    out = call.run_jit(IMPLS[impl], dtype=jnp.bfloat16)
    assert out.dtype == jnp.bfloat16
    error = assert_close(out, call.reference(), TOLERANCE[jnp.bfloat16])
    assert error > TOLERANCE[jnp.float32], "dtype=bfloat16 was ignored"
