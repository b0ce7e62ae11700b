"""The Pallas Mosaic TPU KDA forward (TPU interpret mode on the CPU) against the float64 reference, its pieces
against NumPy, its gradient (the Pallas TPU backward, `chunk_bwd`) against float64 autodiff, and its lowering to Mosaic.

On a TPU the same file runs the kernels compiled (`interpret_mode` picks).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core import registry
from hybrax.ops.kda import reference
from hybrax.ops.kda.api import KernelDeltaAttention, KernelDeltaAttentionConfig, kernel_delta_attention
from hybrax.ops.kda.pallas_tpu import register  # noqa: F401  (registers pallas_tpu:chunked)
from hybrax.ops.kda.pallas_tpu.chunk_fwd import kda_forward
from hybrax.ops.kda.pallas_tpu.chunk_gates import chunk_gates
from hybrax.ops.kda.pallas_tpu.chunk_intra import factored_scores, unit_lower_inverse, with_exact_diagonal
from hybrax.ops.kda.pallas_tpu.dots import Dot
from tests.helpers import TOLERANCE, assert_close, normal, to64
from tests.ops.kda.oracle import ours, reference_case

FP32 = Dot(6)


def gates_with_forgetting(seed, shape, minus_inf=False):
    """Log decays in (-inf, 0): a tenth of the tokens forget everything (-1000, or -inf)."""
    g = jax.nn.log_sigmoid(normal(seed, shape, scale=2.0) + 2.0)
    forget = jax.random.bernoulli(jax.random.key(seed + 1), 0.1, shape[:-1])
    return jnp.where(forget[..., None], -jnp.inf if minus_inf else -1000.0, g)


def pairwise_exponents(g):
    """E[i, j, c] = sum_{j < s <= i} g_sc in float64 (-inf where a -inf gate lies between), for j <= i."""
    g = to64(g)
    chunk = g.shape[0]
    exponents = np.full((chunk, chunk, g.shape[1]), np.nan)
    for i in range(chunk):
        for j in range(i + 1):
            exponents[i, j] = np.sum(g[j + 1:i + 1], axis=0)
    return exponents


def test_gate_sums_are_sums_of_the_gates_between():
    g = gates_with_forgetting(0, (64, 8), minus_inf=True)
    gates = jax.jit(chunk_gates)(g)
    exponents = pairwise_exponents(g)
    starts = np.arange(64) // 16 * 16
    prefix = np.stack([exponents[i, starts[i] - 1] if starts[i] else np.sum(to64(g)[:i + 1], 0) for i in range(64)])
    ends = starts + 15
    suffix = np.stack([exponents[ends[j], j] for j in range(64)])
    np.testing.assert_allclose(np.asarray(gates.prefix), prefix, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gates.suffix), suffix, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda g: chunk_gates(g).from_start())(g)),
                               np.cumsum(to64(g), 0), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(jax.jit(lambda g: chunk_gates(g).to_end())(g)),
                               np.stack([exponents[63, j] for j in range(64)]), rtol=1e-6)
    assert np.isneginf(np.asarray(gates.total())).any()  # a -inf gate: the whole chunk forgets, no NaN


@pytest.mark.parametrize("steep", [False, True])
def test_scores_against_float64(steep):
    """A_qk and A_kk of one chunk: the factored form (mild gates) and the exact diagonal blocks (gates of
    -1000 and -inf, where the factored diagonal is clamped and wrong)."""
    q, k = normal(1, (64, 32)), normal(2, (64, 32))
    g = gates_with_forgetting(3, (64, 32), minus_inf=True) if steep else -0.1 * jax.random.uniform(
        jax.random.key(3), (64, 32))

    @jax.jit
    def scores(q, k, g):
        gates = chunk_gates(g)
        aqk, akk = factored_scores(q, k, gates, FP32)
        return with_exact_diagonal(aqk, akk, q, k, g) if steep else (aqk, akk)

    aqk, akk = scores(q, k, g)
    decay = np.exp(pairwise_exponents(g))  # [i, j, c], NaN above the diagonal
    lower = np.tril(np.ones((64, 64), bool))
    for got, left in ((aqk, q), (akk, k)):
        want = np.einsum("ic,jc,ijc->ij", to64(left), to64(k), np.nan_to_num(decay))
        # fp32's tolerance: on the chip the MXU's fp32 products (several bf16 passes) round to 2.4e-6 here.
        assert_close(np.where(lower, np.asarray(got), 0.0), np.where(lower, want, 0.0), 1e-5, "scores")


def test_unit_lower_inverse():
    lower = np.tril(np.asarray(normal(4, (64, 64), scale=0.3)), -1)
    got = jax.jit(lambda x: unit_lower_inverse(x, FP32))(jnp.asarray(lower, jnp.float32))
    assert_close(got, np.linalg.inv(np.eye(64) + lower.astype(np.float64)), 1e-5, "inverse")


def inputs(seed, batch, length, heads, value_heads, dk, dv, dtype, *, per_head=False, minus_inf=False):
    q, k = normal(seed, (batch, length, heads, dk), dtype), normal(seed + 1, (batch, length, heads, dk), dtype)
    v = normal(seed + 2, (batch, length, value_heads, dv), dtype)
    g = gates_with_forgetting(seed + 3, (batch, length, value_heads, 1 if per_head else dk), minus_inf)
    beta = jax.nn.sigmoid(normal(seed + 5, (batch, length, value_heads)))
    h0 = normal(seed + 6, (batch, value_heads, dk, dv), scale=0.5)
    return q, k, v, g, beta, h0


def check_forward(args, tol, **options):
    q, k, v, g, beta, h0 = args
    scale = q.shape[-1] ** -0.5
    out, final = kda_forward(q, k, v, g, beta, h0, scale=scale, **options)
    assert out.dtype == q.dtype and final.dtype == jnp.float32
    ref_out, ref_final = reference.kda_canonical(*(to64(x) for x in (q, k, v, beta, g)), to64(h0), scale=scale)
    assert_close(out, ref_out, tol, "output")
    assert_close(final, ref_final, tol, "final state")


def test_forward_gqa_odd_length_state_and_forgetting_gates():
    # T = 70: a partial second chunk; HV = 2 H, both value heads in one grid step; K, V padded to 128; gates of
    # -1000 and -inf make sub-chunks steep (the exact diagonal blocks) and forget exactly (no NaN).
    check_forward(inputs(10, 2, 70, 1, 2, 16, 32, jnp.float32, minus_inf=True), TOLERANCE[jnp.float32], chunk=64)


def test_forward_bf16_per_head_decay():
    # bf16 products on the MXU (the state too, as flash-linear-attention): ~3e-3 against float64 here.
    check_forward(inputs(30, 1, 160, 2, 4, 64, 64, jnp.bfloat16, per_head=True), TOLERANCE[jnp.bfloat16],
                  chunk=64, block_heads=1)


def test_vmap_and_jit_chunk_128():
    """Under vmap the mapped axis joins the batch (the kernel's grid keeps its three axes)."""
    q, k, v, g, beta, h0 = (jnp.stack([a, b]) for a, b in zip(
        inputs(40, 1, 40, 1, 1, 16, 16, jnp.float32), inputs(50, 1, 40, 1, 1, 16, 16, jnp.float32)))
    cfg = KernelDeltaAttentionConfig("pallas_tpu", "chunked", chunk_size=128)
    run = jax.jit(jax.vmap(lambda *x: kernel_delta_attention(*x, return_state=True, cfg=cfg)))
    out, final = run(q, k, v, beta, g, h0)
    for index in range(2):
        ref_out, ref_final = reference.kda_canonical(
            *(to64(x[index]) for x in (q, k, v, beta, g, h0)), scale=16**-0.5)
        assert_close(out[index], ref_out, TOLERANCE[jnp.float32], "output")
        assert_close(final[index], ref_final, TOLERANCE[jnp.float32], "final state")


CFG = KernelDeltaAttentionConfig("pallas_tpu", "chunked", chunk_size=64)


def test_public_api_outputs_and_gradients_against_float64():
    """Fused gates, beta logits, T = 45; gradients through the Pallas TPU backward on the kernel's chunk states.
    Outputs and gradients come from one compiled vjp (the loss is linear in the outputs, its weights the
    cotangents)."""
    with jax.default_device(jax.devices("cpu")[0]):  # the float64 oracle (on a TPU too)
        arrays, options, weights, outputs, gradients = reference_case("softplus_gate")
    arrays, weights = jax.device_put((arrays, weights), jax.devices()[0])

    @jax.jit
    def outputs_and_gradients(arrays):
        got, pullback = jax.vjp(ours(CFG, options), arrays)
        return got, pullback(weights)[0]

    got, got_gradients = outputs_and_gradients(arrays)
    assert_close(got, outputs, TOLERANCE[jnp.float32], "outputs")
    for name, want in gradients.items():
        assert_close(got_gradients[name], want, 1e-4, f"d{name}")


def invocation(*args, device="tpu", **kwargs):
    kernel = KernelDeltaAttention()
    inv = kernel.invocation(kernel.prepare(*args, **kwargs))
    return dataclasses.replace(inv, device=device, device_kind="TPU v5 lite")


def small_args(dk=16, length=8):
    shape = (1, length, 2, dk)
    return jnp.zeros(shape), jnp.zeros(shape), jnp.zeros(shape), jnp.zeros(shape[:3])


def test_auto_picks_it_on_a_tpu_and_nowhere_else():
    chosen = registry.supported("kernel_delta_attention", invocation(*small_args()))[0]
    assert chosen.name == "pallas_tpu:chunked"
    on_cpu = registry.supported("kernel_delta_attention", invocation(*small_args(), device="cpu"))
    assert "pallas_tpu:chunked" not in [impl.name for impl in on_cpu]


def test_declines_the_recurrent_scan_and_packed_layouts_beyond_its_chunk_info():
    impl = registry.lookup("kernel_delta_attention", "pallas_tpu", "chunked")
    assert "recurrent scan" in impl.supports(invocation(*small_args(), use_chunked=False))
    assert impl.supports(invocation(*small_args(), cu_seqlens=jnp.array([0, 3, 8], jnp.int32))) is None
    # 2^18 sequences (empty but for one) take a chunk each at least: more chunks than SMEM's chunk info holds.
    many = jnp.zeros((2**18 + 1,), jnp.int32).at[-1].set(8)
    assert "more than" in impl.supports(invocation(*small_args(), cu_seqlens=many))


def test_declines_head_dims_above_128_and_chunks_above_128():
    impl = registry.lookup("kernel_delta_attention", "pallas_tpu", "chunked")
    assert "K and V <= 128" in impl.supports(invocation(*small_args(dk=256)))
    assert "chunk_size" in impl.supports(invocation(*small_args()), KernelDeltaAttentionConfig(chunk_size=256))


@pytest.mark.parametrize("dtype, per_head, chunk, delta_rule", [
    (jnp.bfloat16, False, 64, True), (jnp.float32, True, 128, True), (jnp.bfloat16, False, 128, False),
])
def test_lowers_to_mosaic(dtype, per_head, chunk, delta_rule):
    """The kernel through Pallas' Mosaic lowering for a TPU (no TPU needed): an operation Mosaic lacks fails
    here, in CI."""
    batch, length, heads, dim = 1, 256, 4, 128
    shape = jax.ShapeDtypeStruct
    args = [shape((batch, length, heads, dim), dtype)] * 3 + [
        shape((batch, length, heads, 1 if per_head else dim), jnp.float32), shape((batch, length, heads), jnp.float32),
        shape((batch, heads, dim, dim), jnp.float32),
    ]
    forward = jax.jit(lambda *x: kda_forward(*x, scale=0.1, chunk=chunk, delta_rule=delta_rule, interpret=False))
    text = forward.trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert "kda_chunk_fwd_tpu" in text
