"""kernel_delta_attention's public surface: the seed's signature, the entry points agreeing, vmap,
and the errors bad input raises (naming the argument) before any computation."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import KernelDeltaAttention, create_default_executor, kda_attention, kernel_delta_attention
from hybrax.ops.kda import reference
from hybrax.ops.kda.api import KernelDeltaAttentionConfig
from tests.helpers import TOLERANCE, assert_close, normal, to64

B, T, H, HV, K, V = 1, 20, 1, 2, 8, 4
SEED_POSITIONAL = ["query", "key", "value", "beta", "decay", "initial_state"]
SEED_KEYWORD = ["softmax_scale", "chunk_size", "use_qk_l2norm", "use_chunked", "return_state", "platform", "cfg"]
EXTENSIONS = ["cu_seqlens", "a_log", "dt_bias", "lower_bound", "beta_is_logits", "segment_ids", "max_segments"]
PACKING = ("segment_ids", "max_segments")  # the function turns them into cu_seqlens before prepare


def inputs(batch=B):
    q, k = normal(0, (batch, T, H, K)), normal(1, (batch, T, H, K))
    v = normal(2, (batch, T, HV, V))
    beta = jax.nn.sigmoid(normal(3, (batch, T, HV)))
    g = -jax.nn.softplus(normal(4, (batch, T, HV, K)))
    return q, k, v, beta, g, normal(5, (batch, HV, K, V), scale=0.5)


def test_signature_is_the_seeds():
    params = inspect.signature(kernel_delta_attention).parameters
    positional = [n for n, p in params.items() if p.kind is p.POSITIONAL_ONLY]
    keyword = [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY]
    assert positional == SEED_POSITIONAL
    assert keyword == SEED_KEYWORD + EXTENSIONS
    defaults = {n: params[n].default for n in ["decay", "initial_state", *SEED_KEYWORD]}
    assert defaults == {"decay": None, "initial_state": None, "softmax_scale": None, "chunk_size": 64,
                        "use_qk_l2norm": True, "use_chunked": True, "return_state": False, "platform": None,
                        "cfg": None}
    assert kda_attention is kernel_delta_attention
    # prepare takes what the function passes on (all but platform, cfg and the segments), in the same order.
    prepared = list(inspect.signature(KernelDeltaAttention.prepare).parameters)[1:]
    assert prepared == [n for n in params if n not in ("platform", "cfg", *PACKING)]


@pytest.mark.parametrize("options", [{}, {"use_chunked": False}], ids=["chunked", "scan"])
def test_entry_points_agree(options):
    args = inputs()
    want = kernel_delta_attention(*args, return_state=True, **options)
    assert_close(want, reference.kda_reference(*(to64(x) for x in args)), TOLERANCE[jnp.float32])
    for got in (KernelDeltaAttention().run(*args, return_state=True, **options),
                create_default_executor(persistent=False)(KernelDeltaAttention(), *args, return_state=True, **options),
                kda_attention(*args, return_state=True, **options)):
        assert_close(got, jax.tree.map(to64, want), 1e-6)


@pytest.mark.parametrize("backend", ["chunked", "scan"])
def test_vmap_over_a_leading_axis(backend):
    stacked = [x[:, None] for x in inputs(batch=3)]  # [3, B=1, ...]: the vmapped axis over batches of one
    cfg = KernelDeltaAttentionConfig("xla", backend, chunk_size=16)
    o, s = jax.vmap(lambda *a: kernel_delta_attention(*a, return_state=True, cfg=cfg))(*stacked)
    assert o.shape == (3, 1, T, HV, V) and s.shape == (3, 1, HV, K, V)
    want = [reference.kda_reference(*(to64(x[i]) for x in stacked)) for i in range(3)]
    assert_close((o, s), tuple(np.stack([w[j] for w in want]) for j in range(2)), TOLERANCE[jnp.float32])


def _bad(name):
    """Each entry: (positional arguments, keyword options) that prepare must reject, naming `name`."""
    q, k, v, beta, g, h0 = inputs()
    a_log, dt_bias = normal(8, (HV,)), normal(9, (HV, K))
    return {
        "a_log shape": ((q, k, v, beta, g), {"a_log": a_log[:1]}),
        "a_log dtype": ((q, k, v, beta, g), {"a_log": jnp.ones(HV, jnp.int32)}),
        "dt_bias shape": ((q, k, v, beta, g), {"a_log": a_log, "dt_bias": dt_bias[:, :3]}),
        "dt_bias without a_log": ((q, k, v, beta, g), {"dt_bias": dt_bias}),
        "lower_bound positive": ((q, k, v, beta, g), {"a_log": a_log, "lower_bound": 2.0}),
        "lower_bound positive array": ((q, k, v, beta, g), {"a_log": a_log, "lower_bound": jnp.array([2.0])}),
        "lower_bound shape": ((q, k, v, beta, g), {"a_log": a_log, "lower_bound": jnp.array([-1.0, -2.0])}),
        "lower_bound without a_log": ((q, k, v, beta, g), {"lower_bound": -1.0}),
        "a_log without decay": ((q, k, v, beta), {"a_log": a_log}),
        "value heads": ((q.repeat(2, 2), k.repeat(2, 2), normal(2, (B, T, 3, V)), beta[..., :1].repeat(3, 2)), {}),
        "key shape": ((q, k[..., :4], v, beta, g), {}),
        "key dtype": ((q, k.astype(jnp.bfloat16), v, beta, g), {}),
        "softmax_scale": ((q, k, v, beta, g), {"softmax_scale": -1.0}),
    }[name]


def test_numpy_scalars_are_numbers():
    q, k, v, beta, g, _ = inputs()
    want = kernel_delta_attention(q, k, v, beta, g, softmax_scale=0.5)
    assert_close(kernel_delta_attention(q, k, v, beta, g, softmax_scale=np.float32(0.5)), to64(want), 1e-7)


@pytest.mark.parametrize("case, match", [
    ("a_log shape", "^a_log"), ("a_log dtype", "^a_log"), ("dt_bias shape", "^dt_bias"),
    ("dt_bias without a_log", "^dt_bias"), ("lower_bound positive", "^lower_bound"),
    ("lower_bound positive array", "^lower_bound"),
    ("lower_bound shape", "^lower_bound"), ("lower_bound without a_log", "^lower_bound"),
    ("a_log without decay", "^decay"), ("value heads", "num_value_heads of value"), ("key shape", "^key"),
    ("key dtype", "query, key and value"), ("softmax_scale", "^softmax_scale"),
])
def test_bad_inputs_name_the_argument(case, match):
    args, options = _bad(case)
    with pytest.raises(ValueError, match=match):
        kernel_delta_attention(*args, **options)
