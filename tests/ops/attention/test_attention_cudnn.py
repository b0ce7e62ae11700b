"""The cuDNN implementation without a GPU: what it accepts, its translation to jax.nn (run through jax.nn's
XLA implementation against the float64 reference), and its lowering for CUDA, forward and backward."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from hybrax import AttentionConfig, MaskInfo, attention
from hybrax.core import Invocation
from hybrax.ops.attention import cudnn
from hybrax.ops.attention.api import OP_ID, Attention
from tests.helpers import TOLERANCE, assert_close, pretend_h200_cudnn_limits, pretend_h200_with_cudnn
from tests.ops.attention.inputs import differentiable_arrays, make_call, normal, reference_grads

# Calls cuDNN takes: heads, windows and scale; q_len == kv_len where a window or causality applies.
SUPPORTED = {
    "plain_cross": dict(q_len=19, kv_len=27),
    "causal_gqa": dict(causal=True, q_len=24, kv_len=24, heads=8, kv_heads=2),
    "causal_mqa_scale": dict(causal=True, q_len=24, kv_len=24, kv_heads=1, softmax_scale=0.3),
    "causal_window": dict(causal=True, q_len=24, kv_len=24, sliding_window=(5, 3)),
    "left_window": dict(q_len=24, kv_len=24, sliding_window=(0, 0)),
    "mha": dict(kv_heads=4),
    "mla_head_dims": dict(causal=True, q_len=24, kv_len=24, head_dim=24, v_dim=16),  # values padded to 24
    "head_dims_padded_to_8": dict(head_dim=12, v_dim=20),  # both padded to 24
}


def _prepare(call):
    keywords = {name: value for name, value in call.options.items() if name != "dropout_rng"}
    return Attention().prepare(call.query, call.key, call.value, call.bias, call.options.get("dropout_rng"),
                               call.sinks, **keywords)


def _problem(dtype=jnp.bfloat16, **options):
    call = make_call(**{"v_dim": 16, **options}, dtype=dtype)
    return call, _prepare(call)


@pytest.fixture(autouse=True)
def hopper(monkeypatch):
    """An H200's cuDNN limits wherever these tests run (jax.devices() is a CPU here)."""
    pretend_h200_cudnn_limits(monkeypatch)


def _invocation(problem, device="gpu", platform="auto") -> Invocation:
    return Invocation(OP_ID, Attention.version, problem, platform, device, "NVIDIA H200")


@pytest.mark.parametrize("case", SUPPORTED)
def test_translation_matches_reference(case):
    """bf16 only: jax.nn's XLA path cannot multiply fp16 on the CPU."""
    dtype = jnp.bfloat16
    call, problem = _problem(dtype, **SUPPORTED[case])
    assert cudnn._supports(_invocation(problem)) is None
    out = Attention().finalize(problem, jax.jit(cudnn.jax_nn_attention, static_argnums=1)(problem, "xla"))
    assert out.dtype == dtype
    assert_close(out, call.reference(), TOLERANCE[dtype], case)


@pytest.mark.parametrize("case", ["causal_gqa", "causal_window", "mla_head_dims", "head_dims_padded_to_8"])
def test_translation_gradients_match_reference(case):
    """The gradients through the translation (the head-dim padding, the heads' reshape) against float64 autodiff
    of the reference; jax.nn's XLA path stands in for cuDNN's fused backward."""
    call = make_call(**{"v_dim": 16, **SUPPORTED[case]}, dtype=jnp.bfloat16)
    cotangent = normal(99, (*call.query.shape[:3], call.value.shape[-1]))

    def loss(arrays):
        problem = _prepare(dataclasses.replace(call, **arrays))
        out = Attention().finalize(problem, cudnn.jax_nn_attention(problem, "xla"))
        return jnp.sum(out.astype(jnp.float32) * cotangent)

    got = jax.jit(jax.grad(loss))(differentiable_arrays(call))
    want = reference_grads(call, cotangent)
    for name in want:
        # bf16 rounding of the probabilities and of dS before the matmuls, as the XLA implementations' bf16 tests.
        assert_close(got[name], want[name], 2 * TOLERANCE[jnp.bfloat16], f"d{name} {case}")


DECLINED = {
    "bias": (dict(bias_heads=4), "bias"),
    "mask": (dict(mask_heads=1), "mask"),
    "segments": (dict(segments=True), "segment ids"),
    "sinks": (dict(sinks=(4, 2)), "sinks"),
    "soft_cap": (dict(logits_soft_cap=2.0), "soft cap"),
    "dropout": (dict(dropout_prob=0.1, deterministic=False, dropout_rng=jax.random.key(0)), "dropout"),
    "right_window": (dict(sliding_window=(4, 2), q_len=24, kv_len=24), "right window of 0"),
    "causal_unequal_lengths": (dict(causal=True), "q_len == kv_len"),
    "head_dim_over_256": (dict(head_dim=264), "<= 256"),
    "padded_head_dim_over_256": (dict(head_dim=16, v_dim=257), "<= 256"),
}


@pytest.mark.parametrize("case", DECLINED)
def test_declines_what_it_cannot_compute(case):
    options, reason = DECLINED[case]
    _, problem = _problem(**options)
    assert reason in cudnn._supports(_invocation(problem))


def test_declines_fp32_and_other_softmax_dtypes_and_cpus():
    _, fp32 = _problem(jnp.float32)
    assert "bfloat16 or float16" in cudnn._supports(_invocation(fp32))
    _, bf16_softmax = _problem(softmax_dtype=jnp.bfloat16)
    assert "softmax in float32" in cudnn._supports(_invocation(bf16_softmax))
    _, problem = _problem()
    assert "CUDA GPU" in cudnn._supports(_invocation(problem, device="cpu"))


def test_before_hopper_head_dims_stop_at_128(monkeypatch):
    monkeypatch.undo()
    assert cudnn.max_head_dim() == 128  # no compute capability on the CPU: the pre-Hopper limit
    _, problem = _problem(head_dim=192, v_dim=128)
    assert "<= 128" in cudnn._supports(_invocation(problem))


def test_auto_prefers_cudnn_then_pallas_flash_on_gpus_and_xla_elsewhere():
    _, problem = _problem(causal=True, q_len=24, kv_len=24)
    assert Attention().implementations(_invocation(problem))[0].name == "cuda:cudnn"
    _, with_sinks = _problem(causal=True, q_len=24, kv_len=24, sinks=(4, 2))
    assert Attention().implementations(_invocation(with_sinks))[0].name == "pallas:flash"
    on_cpu = [impl.name for impl in Attention().implementations(_invocation(problem, "cpu"))]
    assert on_cpu[0] == "xla:direct" and "cuda:cudnn" not in on_cpu and "pallas:flash" not in on_cpu


def test_explicit_cuda_platform_on_cpu_names_the_reason():
    call = make_call(dtype=jnp.bfloat16, v_dim=16)
    with pytest.raises(ValueError, match="cuDNN needs a CUDA GPU"):
        attention(call.query, call.key, call.value, cfg=AttentionConfig("cuda", "cudnn"))


@pytest.fixture
def cuda_without_gpu(monkeypatch):
    pretend_h200_with_cudnn(monkeypatch)


@pytest.mark.parametrize("head_dim, v_dim", [(64, 64), (192, 128)])
def test_lowers_to_cudnn_forward_and_backward_under_vmap(cuda_without_gpu, head_dim, v_dim):
    """Through the public API, chosen by `auto`, batched by vmap and differentiated: the fused forward and
    backward kernels, causal, with the window cuDNN counts inclusively (left + 1); MLA's head dims padded."""
    q, k = (jax.ShapeDtypeStruct((3, 2, 64, heads, head_dim), jnp.bfloat16) for heads in (8, 2))
    v = jax.ShapeDtypeStruct((3, 2, 64, 2, v_dim), jnp.bfloat16)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, causal=True, sliding_window=16).astype(jnp.float32))

    batched_grad = jax.vmap(jax.grad(loss, argnums=(0, 1, 2)))
    text = jax.jit(batched_grad).trace(q, k, v).lower(lowering_platforms=("cuda",)).as_text()
    assert "__cudnn$fmhaSoftmax(" in text and "__cudnn$fmhaSoftmaxBackward(" in text
    assert f"tensor<6x64x2x{head_dim}xbf16>" in text  # vmap folded into the batch; values padded to head_dim
    config = text.replace("\\22", '"')  # the backend config is JSON inside an MLIR string
    assert '"mask_type": "CAUSAL"' in config and '"sliding_window_length": 17' in config


def test_mask_info_none_is_still_supported():
    _, problem = _problem(causal=True, q_len=24, kv_len=24, mask_info=MaskInfo())
    assert cudnn._supports(_invocation(problem)) is None
