"""The public surface: signature, executor and Kernel.run, auto selection, dtypes, init_bias,
transformations, and the errors bad input raises before any computation."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import Attention, AttentionConfig, MaskInfo, attention, create_default_executor
from hybrax.ops.attention import reference
from tests.helpers import TOLERANCE, assert_close
from tests.ops.attention.inputs import IMPLS, normal


def _qkv(batch=2, q_len=10, kv_len=14, heads=4, kv_heads=2, dim=8, dtype=jnp.float32):
    return (normal(0, (batch, q_len, heads, dim), dtype), normal(1, (batch, kv_len, kv_heads, dim), dtype),
            normal(2, (batch, kv_len, kv_heads, dim), dtype))


def test_signature_is_the_seeds():
    params = inspect.signature(attention).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_ONLY]
    keyword = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    assert positional == ["query", "key", "value", "bias", "dropout_rng", "softmax_aux"]
    assert keyword == ["mask_info", "init_bias", "deterministic", "softmax_scale", "logits_soft_cap", "dtype",
                       "softmax_dtype", "dropout_prob", "causal", "sliding_window", "platform", "cfg"]
    assert params["dtype"].default is None


def test_executor_run_and_function_agree():
    q, k, v = _qkv()
    want = reference.attention(q, k, v, causal=True)
    for out in (create_default_executor(persistent=False)(Attention(), q, k, v, causal=True),
                Attention().run(q, k, v, causal=True),
                attention(q, k, v, causal=True),
                attention(q, k, v, causal=True, platform="xla")):
        assert out.shape == (2, 10, 4, 8)
        assert_close(out, want, TOLERANCE[jnp.float32])


def test_run_takes_the_seeds_argument_order():
    q, k, v = _qkv()
    mask = jax.random.bernoulli(jax.random.key(3), 0.7, (2, 1, 10, k.shape[1]))
    bias = normal(4, (2, 1, 10, k.shape[1]))
    out = Attention().run(q, k, v, mask, bias, None, True, None, None, 0.3, cfg=AttentionConfig("xla", "direct"))
    want = attention(q, k, v, bias, mask_info=MaskInfo.from_attention_mask(mask), softmax_scale=0.3)
    assert_close(out, np.asarray(want, np.float64), 1e-6)
    with pytest.raises(ValueError, match="attention_mask or mask_info"):
        Attention().run(q, k, v, mask, mask_info=MaskInfo.from_attention_mask(mask))


def _chosen(q_len, kv_len, batch=1, heads=1):
    q = jnp.zeros((batch, q_len, heads, 8))
    kv = jnp.zeros((batch, kv_len, heads, 8))
    kernel = Attention()
    return kernel.heuristic_cfg(kernel.invocation(kernel.prepare(q, kv, kv, causal=True)))


def test_auto_prefers_blockwise_for_long_sequences():
    assert _chosen(256, 256).backend == "direct"
    assert _chosen(1, 1024).backend == "blockwise"
    assert _chosen(1024, 1024).backend == "blockwise"
    assert _chosen(512, 512, batch=64, heads=8).backend == "blockwise"  # 512 MiB of scores


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_dtype_default_is_the_inputs(dtype):
    q, k, v = _qkv(dtype=dtype)
    assert attention(q, k, v).dtype == dtype


def test_init_bias_is_used_only_without_bias_and_mask():
    q, k, v = _qkv()
    bias = normal(3, (2, 4, 10, 14))
    calls = []

    def make_bias():
        calls.append(1)
        return bias

    got = attention(q, k, v, init_bias=make_bias)
    assert_close(got, reference.attention(q, k, v, bias), TOLERANCE[jnp.float32])
    mask = MaskInfo.from_attention_mask(jnp.ones((2, 1, 10, 14), bool))
    attention(q, k, v, mask_info=mask, init_bias=make_bias)
    attention(q, k, v, bias, init_bias=make_bias)
    assert len(calls) == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_vmap_jit_and_checkpointed_grad(impl):
    q, k, v = _qkv(batch=1)
    stacked = [jnp.stack([x, 2 * x]) for x in (q, k, v)]
    fn = lambda q, k, v: attention(q, k, v, causal=True, sliding_window=3, cfg=IMPLS[impl])  # noqa: E731
    batched = jax.jit(jax.vmap(fn))(*stacked)
    for i in range(2):
        want = reference.attention(*(x[i] for x in stacked), causal=True, sliding_window=3)
        assert_close(batched[i], want, TOLERANCE[jnp.float32])
    grad_fn = jax.grad(jax.checkpoint(lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)))
    grad = jax.jit(jax.vmap(grad_fn))(*stacked)
    for i in range(2):  # the batching rule of the custom VJP: each example's gradient as computed alone
        assert_close(grad[i], grad_fn(*(x[i] for x in stacked)), 1e-6, f"gradient of example {i}")


B, TQ, TK, H, HKV, D = 2, 10, 14, 4, 2, 8
BAD = {
    "query rank": (dict(query=jnp.zeros((B, TQ, H))), r"query must have shape \[batch, q_len, num_heads, head_dim\]"),
    "batch": (dict(key=jnp.zeros((3, TK, HKV, D))), r"batch sizes .* query \[2, 10, 4, 8\], key \[3, 14, 2, 8\]"),
    "kv lengths": (dict(value=jnp.zeros((B, TK + 1, HKV, D))), r"kv lengths .* key \[2, 14, 2, 8\], value \[2, 15"),
    "kv heads": (dict(value=jnp.zeros((B, TK, 1, D))), r"kv heads .*value \[2, 14, 1, 8\]"),
    "head dims": (dict(key=jnp.zeros((B, TK, HKV, 4)), value=jnp.zeros((B, TK, HKV, 4))),
                  r"head dims .* query \[2, 10, 4, 8\], key \[2, 14, 2, 4\]"),
    "heads not a multiple": (dict(key=jnp.zeros((B, TK, 3, D)), value=jnp.zeros((B, TK, 3, D))),
                             r"num_heads of query \[2, 10, 4, 8\] must be a multiple of num_kv_heads of key"),
    "integer query": (dict(query=jnp.zeros((B, TQ, H, D), jnp.int32)), "query must be a floating-point array"),
    "bias shape": (dict(bias=jnp.zeros((B, 3, TQ, TK))), r"bias must have shape .* = \[2 \| 1, 4 \| 2 \| 1, 10, 14\]"
                   r" for query \[2, 10, 4, 8\] and key \[2, 14, 2, 8\], got \[2, 3, 10, 14\]"),
    "bias lengths": (dict(bias=jnp.zeros((B, H, TK, TQ))), r"bias must have shape .*got \[2, 4, 14, 10\]"),
    "sinks": (dict(softmax_aux=jnp.zeros((HKV, 2))), r"softmax_aux must have shape \[num_heads, num_sinks\] = "
              r"\[4, \*\] or \[num_sinks\], got \[2, 2\]"),
    "mask shape": (dict(mask_info=MaskInfo.from_attention_mask(jnp.ones((B, 1, TQ, TQ), bool))),
                   r"mask_info.attention_mask must have shape .*got \[2, 1, 10, 10\]"),
    "segment shape": (dict(mask_info=MaskInfo.from_segments(jnp.zeros((B, TQ), jnp.int32))),
                      r"mask_info.kv_segment_ids must have shape \[batch, kv_len\] = \[2, 14\], got \[2, 10\]"),
    "window negative": (dict(sliding_window=-1), r"sliding_window must be an int >= 0 or a pair"),
    "window triple": (dict(sliding_window=(1, 2, 3)), r"sliding_window .* got \(1, 2, 3\)"),
    "dropout prob": (dict(dropout_prob=1.0, deterministic=False), r"dropout_prob must be a number in \[0, 1\)"),
    "dropout rng": (dict(dropout_prob=0.1, deterministic=False), "needs a dropout_rng"),
    "soft cap": (dict(logits_soft_cap=0.0), "logits_soft_cap must be a number > 0"),
    "nan scale": (dict(softmax_scale=float("nan")), "softmax_scale must be a finite number or None .* got nan"),
    "array scale": (dict(softmax_scale=jnp.ones((2,))), "softmax_scale must be a finite number or None"),
    "dtype": (dict(dtype=jnp.int32), "dtype must be a floating dtype"),
    "init_bias": (dict(init_bias=lambda: jnp.zeros((B, H, TQ, TQ))), r"init_bias\(\) must have shape"),
    # MaskInfo built directly skips its constructors' checks: prepare checks the fields again.
    "float segment ids": (dict(mask_info=MaskInfo(jnp.zeros((B, TQ)), jnp.zeros((B, TK)))),
                          "mask_info.q_segment_ids must be an integer array"),
    "integer mask": (dict(mask_info=MaskInfo(attention_mask=jnp.ones((B, 1, TQ, TK), jnp.int32))),
                     "mask_info.attention_mask must be a boolean array"),
    "dropout rng shape": (dict(dropout_prob=0.1, deterministic=False, dropout_rng=jnp.zeros((3,), jnp.uint32)),
                          r"dropout_rng must be a key .* got shape \[3\]"),
    "dropout keys": (dict(dropout_prob=0.1, deterministic=False, dropout_rng=jax.random.split(jax.random.key(0))),
                     r"dropout_rng must be a single key, got keys of shape \[2\]"),
    "head dim 0": (dict(query=jnp.zeros((B, TQ, H, 0)), key=jnp.zeros((B, TK, HKV, 0))),
                   r"need head dims of at least 1"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_input_names_the_argument_and_shapes(case):
    changes, message = BAD[case]
    args = dict(query=jnp.zeros((B, TQ, H, D)), key=jnp.zeros((B, TK, HKV, D)), value=jnp.zeros((B, TK, HKV, D)),
                bias=None, dropout_rng=None, softmax_aux=None)
    args.update(changes)
    positional = [args.pop(n) for n in ("query", "key", "value", "bias", "dropout_rng", "softmax_aux")]
    with pytest.raises(ValueError, match=message):
        Attention().prepare(*positional, **args)


def test_mask_constructors_check_their_input():
    with pytest.raises(ValueError, match=r"q_segment_ids must have shape \[batch, q_len\]"):
        MaskInfo.from_segments(jnp.zeros((4,), jnp.int32))
    with pytest.raises(ValueError, match="q_segment_ids must be an integer array"):
        MaskInfo.from_segments(jnp.zeros((1, 4)))
    with pytest.raises(ValueError, match="mask must be a boolean array"):
        MaskInfo.from_attention_mask(jnp.zeros((1, 1, 4, 4)))


def test_explicit_blockwise_config_is_honoured():
    q, k, v = _qkv()
    cfg = AttentionConfig(platform="xla", backend="blockwise", block_q=4, block_k=4)
    out = attention(q, k, v, causal=True, cfg=cfg)
    assert_close(out, reference.attention(q, k, v, causal=True), TOLERANCE[jnp.float32])


def test_auto_at_long_length_needs_memory_linear_in_length():
    """Compiled temp memory of forward and forward+backward, against the [Tq, Tk] scores (16 MiB)."""
    spec = jax.ShapeDtypeStruct((1, 2048, 1, 16), jnp.float32)
    forward = lambda q, k, v: attention(q, k, v, causal=True)  # noqa: E731
    scores_bytes = 2048 * 2048 * 4
    for fn in (forward, jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v)), argnums=(0, 1, 2))):
        temp = jax.jit(fn).lower(spec, spec, spec).compile().memory_analysis().temp_size_in_bytes
        assert temp < scores_bytes / 4, f"temp memory {temp / 2**20:.1f} MiB"
