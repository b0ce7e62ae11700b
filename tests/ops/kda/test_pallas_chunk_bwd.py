"""The Pallas chunked KDA backward (interpret mode on the CPU) against float64 autodiff of the reference.

`kda_chunk`'s VJP (the backward kernels behind `platform="pallas"`) against jax.vjp of the token-by-
token float64 oracle (`test_gradients.kda64`), for the cotangents of both outputs (o and the final
state); `test_lowers_to_triton` lowers the backward to Triton IR for an H200, so an unsupported
primitive fails in CI too.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from hybrax.ops.kda.api import kernel_delta_attention
from hybrax.ops.kda.common.layout import Segments
from hybrax.ops.kda.pallas_gpu.chunk import kda_chunk
from hybrax.ops.kda.pallas_gpu.chunk_bwd import kda_chunk_bwd
from hybrax.ops.kda.pallas_gpu.chunk_grad import chunk_grad
from tests.helpers import TOLERANCE, assert_close, lower_for_h200, normal
from tests.ops.kda.oracle import oracle_vjp
from tests.ops.kda.test_pallas_chunk_fwd import abstract_inputs, inputs, pipeline_stages_of


def check(seed, batch, length, heads, value_heads, dk, dv, dtype=jnp.float32, *, with_state=True,
          l2_normalize=True, hard_gates=False, fast_gates=False, chunk=64, tol=None):
    q, k, v, g, beta = inputs(seed, batch, length, heads, value_heads, dk, dv, dtype, hard_gates, fast_gates)
    h0 = normal(seed + 6, (batch, value_heads, dk, dv), scale=0.5) if with_state else None
    d_out = normal(seed + 7, v.shape, dtype)
    d_final = normal(seed + 8, (batch, value_heads, dk, dv))
    scale = dk**-0.5

    def ours(q, k, v, g, beta, h0):
        return kda_chunk(q, k, v, g, beta, h0, None, None, scale, l2_normalize, chunk, True)

    got = jax.vjp(ours, q, k, v, g, beta, h0)[1]((d_out, d_final))
    # The oracle in float64 on the same (possibly bf16-rounded) inputs.
    want = oracle_vjp((q, k, v, g, beta, h0), (d_out, d_final), softmax_scale=scale, use_qk_l2norm=l2_normalize)
    assert all(a is None or a.dtype == x.dtype for a, x in zip(got, (q, k, v, g, beta, h0)))
    tol = TOLERANCE[dtype] if tol is None else tol
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "d_initial"), got, want):
        if b is not None:
            assert_close(a, b, tol, name)


def test_two_chunks_with_initial_state():
    check(0, 2, 128, 2, 2, 32, 32)


@pytest.mark.parametrize("length", [1, 70])
def test_lengths_off_the_chunk(length):
    check(10, 1, length, 1, 1, 16, 16)


def test_grouped_value_heads_and_odd_head_dims():
    # HV = 2 H: dq and dk sum over the value heads of a key head; K, V padded to 32, 64 inside.
    check(20, 1, 80, 1, 2, 24, 40)


def test_gates_of_minus_1000():
    # Steep chunks sum every decay from the per-token gates, as in the forward (5e-4 before issue 43).
    check(30, 1, 128, 2, 2, 16, 32, hard_gates=True)


def test_fast_decay_below_steep():
    check(35, 1, 128, 2, 2, 32, 32, fast_gates=True)


def test_without_l2_norm():
    # Raw keys make A_kk and T far from the identity: the fp32 chunked path loses more digits (measured 5e-6
    # against float64).
    check(40, 1, 64, 1, 1, 16, 16, l2_normalize=False, with_state=False, tol=5e-5)


def test_chunk_32():
    check(50, 1, 96, 1, 1, 32, 16, chunk=32)


def test_bf16():
    check(60, 1, 128, 2, 2, 64, 64, jnp.bfloat16)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton(dtype, packed):
    args, segments = abstract_inputs(dtype, packed)
    cotangents = [jax.ShapeDtypeStruct(args[2].shape, dtype), jax.ShapeDtypeStruct(args[5].shape, jnp.float32)]
    text = lower_for_h200(
        lambda *a: kda_chunk_bwd(*a[:8], Segments(*a[8:]) if packed else None, scale=0.1), *args, *cotangents, *segments
    )
    # Recomputed forward (cumsum, intra, state: no T and A_qk given) and the backward (state, grad, intra,
    # cumsum).
    assert text.count("__gpu$xla.gpu.triton") == 7
    stages = dict(pipeline_stages_of(text))  # three where measured (bf16), the earlier settings elsewhere
    expected = {"kda_chunk_state_bwd": 3, "kda_chunk_grad": 3, "kda_chunk_intra_bwd": 3}
    if dtype == jnp.float32:
        expected.update(kda_chunk_state_bwd=2, kda_chunk_grad=1, kda_chunk_intra_bwd=1)
    assert {name: stages[name] for name in expected} == expected


def test_one_pipeline_stage_at_head_dim_256():
    # Two stages of the reverse state pass asked the H200 for 241664 bytes of shared memory (bf16) of its
    # 232448; at K = 256 every backward kernel runs one.
    args, _ = abstract_inputs(jnp.bfloat16, False, 256)
    cotangents = [jax.ShapeDtypeStruct(args[2].shape, jnp.bfloat16), jax.ShapeDtypeStruct(args[5].shape, jnp.float32)]
    stages = dict(pipeline_stages_of(lower_for_h200(lambda *a: kda_chunk_bwd(*a, scale=0.1), *args, *cotangents)))
    assert {stages[name] for name in ("kda_chunk_state_bwd", "kda_chunk_grad", "kda_chunk_intra_bwd")} == {1}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_packed_sequences(dtype):
    # Sequences of 0 (empty), 70, 5, 0 and 40 tokens, then 13 tokens of no sequence; an empty
    # sequence's initial-state gradient is its final state's cotangent. The kernels read the packed rows
    # in place: the last sequence's last chunk runs past the array's end (masked).
    cu_seqlens = jnp.array([0, 0, 70, 75, 75, 115], jnp.int32)
    q, k, v, g, beta = inputs(110, 1, 128, 1, 2, 16, 32, dtype)
    h0 = normal(116, (5, 2, 16, 32), scale=0.5)
    d_out, d_final = normal(117, v.shape, dtype), normal(118, h0.shape)

    def f(q, k, v, g, beta, h0):
        return kernel_delta_attention(q, k, v, beta, g, h0, return_state=True, cu_seqlens=cu_seqlens, platform="pallas")

    got = jax.vjp(f, q, k, v, g, beta, h0)[1]((d_out, d_final))
    want = oracle_vjp((q, k, v, g, beta, h0), (d_out, d_final), cu_seqlens=tuple(cu_seqlens.tolist()))
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "d_initial"), got, want):
        assert_close(a, b, TOLERANCE[dtype], name)


def test_grad_kernel_slices_agree():
    # chunk_grad walks K and V in slices: several slices must sum to what one whole-width slice gives.
    batch, length, heads, dk, dv, chunk = 1, 64, 1, 64, 64, 32
    q, k = normal(120, (batch, length, heads, dk)), normal(121, (batch, length, heads, dk))
    v, v_new, dv_new, d_out = (normal(122 + i, (batch, length, heads, dv)) for i in range(4))
    # G chunk-local and mild, so that exp(G_last) keeps the last rows' terms visible.
    gates = -0.1 * jax.nn.softplus(normal(126, (batch, length // chunk, chunk, heads, dk)))
    g = jnp.cumsum(gates, axis=2).reshape(batch, length, heads, dk)
    gates = gates.reshape(g.shape)
    beta = jax.nn.sigmoid(normal(127, (batch, length, heads)))
    inverse = jnp.tril(normal(128, (batch, length, heads, chunk)))
    h, dh = (normal(129 + i, (batch, length // chunk, heads, dk, dv)) for i in range(2))
    args = (q, k, v, g, gates, beta, inverse, h, dh, v_new, dv_new, d_out)
    whole = chunk_grad(*args, chunk=chunk, block_k=dk, block_v=dv, interpret=True)
    sliced = chunk_grad(*args, chunk=chunk, block_k=16, block_v=32, interpret=True)
    assert_close(sliced, whole, 1e-6, "sliced")
