"""The Pallas Mosaic TPU KDA backward (TPU interpret mode on the CPU): every input's gradient through
`kernel_delta_attention` with platform "pallas_tpu" against float64 autodiff of the reference, and the kernel's
lowering to Mosaic.

Each case runs the forward and the backward kernel once (one compiled vjp; the loss is linear in the outputs, its
weights the cotangents): tiny shapes, as the interpret mode is slow. On a TPU the same file runs the kernels
compiled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hybrax.ops.kda.api import KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_tpu import register  # noqa: F401  (registers pallas_tpu:chunked)
from hybrax.ops.kda.pallas_tpu.chunk_bwd import kda_backward
from tests.helpers import TOLERANCE, assert_close
from tests.ops.kda.oracle import loss_weights, make_case, oracle_outputs_and_gradients, ours


def check_gradients(case: dict, chunk: int, dtype=jnp.float32) -> None:
    with jax.default_device(jax.devices("cpu")[0]):  # the float64 oracle (on a TPU too)
        arrays, options = make_case(**case, dtype=dtype)
        weights = loss_weights(arrays)
        outputs, gradients = oracle_outputs_and_gradients(arrays, options, weights)
    arrays, weights = jax.device_put((arrays, weights), jax.devices()[0])
    cfg = KernelDeltaAttentionConfig("pallas_tpu", "chunked", chunk_size=chunk)

    @jax.jit
    def outputs_and_gradients(arrays):
        got, pullback = jax.vjp(ours(cfg, options), arrays)
        return got, pullback((weights[0].astype(got[0].dtype), weights[1]))[0]

    assert "kda_chunk_bwd_tpu" in str(jax.make_jaxpr(outputs_and_gradients)(arrays))  # not XLA's backward
    got, got_gradients = outputs_and_gradients(arrays)
    assert_close(got, outputs, TOLERANCE[dtype], "outputs")
    assert set(got_gradients) == set(gradients)
    for name, want in gradients.items():
        assert_close(got_gradients[name], want, TOLERANCE[dtype], f"d{name}")


def test_fused_gate_and_beta_logits():
    """a_log and dt_bias through the softplus gate, beta logits; T = 45 at chunk 32: two chunks of two sub-chunks,
    the last one partial."""
    check_gradients(dict(gate="softplus"), chunk=32)


def test_gates_of_minus_1000_per_channel():
    """A tenth of the tokens forget everything: steep sub-chunks (the diagonal blocks exactly, the blocks below
    them factored), and gradients that are exactly what survives the forgetting."""
    check_gradients(dict(hard=True), chunk=32)


def test_gqa_per_head_decay_bf16():
    """Two value heads per query/key head (dq, dk summed over them), a per-head decay (its gradient summed over K),
    gates of -1000, bf16 inputs; three chunks of 16."""
    check_gradients(dict(heads=1, value_heads=2, decay="head", hard=True), chunk=16, dtype=jnp.bfloat16)


def test_one_token_without_l2_norm_bf16():
    """T = 1 (one chunk of padding), q and k as given (use_qk_l2norm=False) with softmax_scale 0.3, bf16 inputs
    (dq and dk written in bf16 by the kernel)."""
    check_gradients(dict(length=1, unnormalized=True), chunk=16, dtype=jnp.bfloat16)


@pytest.mark.parametrize("dtype, per_head, chunk, group", [
    (jnp.bfloat16, False, 64, 2), (jnp.float32, True, 128, 1),
])
def test_lowers_to_mosaic(dtype, per_head, chunk, group):
    """The backward kernel through Pallas' Mosaic lowering for a TPU (no TPU needed): an operation Mosaic lacks
    fails here, in CI."""
    batch, length, heads, dim = 1, 256, 4, 128
    shape = jax.ShapeDtypeStruct
    args = [shape((batch, length, heads // group, dim), dtype)] * 2 + [
        shape((batch, length, heads, dim), dtype), shape((batch, length, heads, 1 if per_head else dim), jnp.float32),
        shape((batch, length, heads), jnp.float32), shape((batch, heads, length // chunk, dim, dim), jnp.float32),
        shape((batch, length, heads, dim), dtype), shape((batch, heads, dim, dim), jnp.float32),
    ]
    backward = jax.jit(lambda *x: kda_backward(*x, scale=0.1, chunk=chunk, interpret=False))
    assert "kda_chunk_bwd_tpu" in backward.trace(*args).lower(lowering_platforms=("tpu",)).as_text()


def test_rejects_states_of_another_chunk():
    q = jnp.zeros((1, 40, 1, 16))
    states = jnp.zeros((1, 1, 2, 16, 16))  # chunk 32's, asked at 16
    with pytest.raises(ValueError, match=r"states must have shape \[B, HV, NC, K, V\] = \[1, 1, 3, 16, 16\]"):
        kda_backward(q, q, q, q, q[..., 0], states, q, states[:, :, 0], scale=0.25, chunk=16)
