"""Gated linear attention through the Pallas Mosaic TPU KDA kernels without the delta rule (recurrent_attention's
"pallas_tpu:chunked", TPU interpret mode on the CPU): outputs, final states and the gradients of every input, through
the TPU backward kernel, against float64 autodiff of the recurrent reference; dense rows and packed sequences, and
the backward kernel's lowering to Mosaic without the delta rule.

On a TPU the same file runs the kernels compiled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import RecurrentAttentionConfig, recurrent_attention
from hybrax.ops.kda.pallas_tpu.chunk_bwd import kda_backward
from hybrax.ops.recurrent.reference import recurrent_reference
from tests.helpers import TOLERANCE, assert_close
from tests.ops.recurrent.inputs import ARG_NAMES, make_call, normal

CFG = RecurrentAttentionConfig("pallas_tpu", "chunked", chunk_size=16)
LAYOUTS = {
    # T = 19 over two chunks; fewer key/value heads than query heads; per-head g plus a per-batch g_gamma plus gk
    "dense": dict(seq_len=19, g_gamma_batched=True, gates=("g", "g_gamma", "gk")),
    # an empty sequence, one of a single token, one over two chunks; per-key g plus gk
    "packed": dict(cu_seqlens=[0, 0, 1, 6, 25], g_per_key=True, gates=("g", "gk")),
}


def loss(run, weights, *args):
    output, final = run(*args)
    return jnp.sum(output * weights[0]) + jnp.sum(final * weights[1])


@pytest.mark.parametrize("layout", LAYOUTS)
def test_outputs_and_gradients_against_float64(layout):
    call = make_call(20, heads=4, kv_heads=2, key_dim=8, value_dim=6, **LAYOUTS[layout])
    args = call.args()
    present = [index for index, name in enumerate(ARG_NAMES[:-1]) if args[index] is not None]
    want_out = recurrent_reference(*args)
    weights = tuple(normal(99 + index, np.shape(x)) for index, x in enumerate(want_out))
    run = functools.partial(recurrent_attention, return_state=True, cfg=CFG)
    grad = jax.jit(jax.grad(functools.partial(loss, run, weights), argnums=present))
    assert "kda_chunk_bwd_tpu" in str(jax.make_jaxpr(grad)(*args))  # the TPU backward, not XLA's
    with jax.enable_x64(True):
        args64 = [x if name == "cu_seqlens" or x is None else jnp.asarray(x, jnp.float64)
                  for name, x in zip(ARG_NAMES, args)]
        reference = functools.partial(recurrent_reference, xp=jnp)
        weights64 = [jnp.asarray(w, jnp.float64) for w in weights]
        want = jax.grad(functools.partial(loss, reference, weights64), argnums=present)(*args64)
        want = [np.asarray(x) for x in want]
    assert_close(call.run(CFG), want_out, TOLERANCE[jnp.float32], "outputs")
    for index, got, expected in zip(present, grad(*args), want):
        assert_close(got, expected, TOLERANCE[jnp.float32], f"d{ARG_NAMES[index]}")


def test_backward_lowers_to_mosaic_without_the_delta_rule():
    """An operation Mosaic lacks fails here, in CI (no TPU needed)."""
    batch, length, heads, dim, chunk = 1, 256, 4, 128, 64
    shape = jax.ShapeDtypeStruct
    rows, fp32 = shape((batch, length, heads, dim), jnp.bfloat16), jnp.float32
    args = [rows, rows, rows, shape(rows.shape, fp32), shape(rows.shape[:3], fp32),
            shape((batch, heads, length // chunk, dim, dim), fp32), rows, shape((batch, heads, dim, dim), fp32)]
    backward = jax.jit(lambda *x: kda_backward(*x, scale=0.1, l2_normalize=False, chunk=chunk, delta_rule=False,
                                               interpret=False))
    assert "kda_chunk_bwd_tpu" in backward.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
