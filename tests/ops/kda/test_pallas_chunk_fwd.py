"""The Pallas chunked KDA forward (interpret mode on the CPU) against the float64 reference.

Every kernel runs here in Pallas' interpret mode; `test_lowers_to_triton` also lowers the whole
pipeline to Triton IR for an H200 (no GPU needed), so an unsupported primitive fails in CI too.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.core import lookup
from hybrax.ops.kda import api, reference
from hybrax.ops.kda.common.layout import Segments
from hybrax.ops.kda.pallas_gpu import chunked  # noqa: F401  (registers pallas:chunked)
from hybrax.ops.kda.pallas_gpu.chunk_cumsum import chunk_local_cumsum, gate_gradient
from hybrax.ops.kda.pallas_gpu.chunk_fwd import kda_chunk_fwd, prepare_qk
from hybrax.ops.kda.pallas_gpu.chunk_intra import chunk_intra, unit_lower_inverse
from hybrax.ops.kda.pallas_gpu.chunk_state import chunk_state, chunk_state_output, default_block_v, output_block_v
from hybrax.ops.kda.pallas_gpu.chunk_state_bwd import chunk_state_bwd
from hybrax.ops.kda.pallas_gpu.chunk_wy import chunk_wy
from hybrax.ops.kda.pallas_gpu.tiles import PackedChunks
from hybrax.ops.pallas_shared import EXACT
from tests.helpers import TOLERANCE, assert_close, lower_for_h200, normal, on_h200, to64


def inputs(seed, batch, length, heads, value_heads, dk, dv, dtype, hard_gates=False, fast_gates=False):
    q = normal(seed, (batch, length, heads, dk), dtype)
    k = normal(seed + 1, (batch, length, heads, dk), dtype)
    v = normal(seed + 2, (batch, length, value_heads, dv), dtype)
    g = jax.nn.log_sigmoid(normal(seed + 3, (batch, length, value_heads, dk), scale=2.0) + 2.0)
    if fast_gates:
        # Log decays down to -3 per token: a 16-token sub-chunk decays by up to exp(45), just under the
        # kernels' STEEP, so the factored scores run with factors near their largest.
        g = -3.0 * jax.random.uniform(jax.random.key(seed + 3), g.shape)
    if hard_gates:
        # One token in ten forgets everything: gates of -1000 must underflow, never overflow.
        forget = jax.random.bernoulli(jax.random.key(seed + 4), 0.1, g.shape[:3])
        g = jnp.where(forget[..., None], -1000.0, g)
    beta = jax.nn.sigmoid(normal(seed + 5, (batch, length, value_heads)))
    return q, k, v, g, beta


def check(seed, batch, length, heads, value_heads, dk, dv, dtype=jnp.float32, *, with_state=False,
          l2_normalize=True, hard_gates=False, fast_gates=False, chunk=64, tol=None):
    q, k, v, g, beta = inputs(seed, batch, length, heads, value_heads, dk, dv, dtype, hard_gates, fast_gates)
    h0 = normal(seed + 6, (batch, value_heads, dk, dv), scale=0.5) if with_state else None
    scale = dk**-0.5
    out, final = kda_chunk_fwd(
        q, k, v, g, beta, h0, scale=scale, l2_normalize=l2_normalize, chunk=chunk, interpret=True
    )
    ref_out, ref_final = reference.kda_canonical(
        *(to64(x) for x in (q, k, v, beta, g)), to64(h0), scale=scale, use_qk_l2norm=l2_normalize
    )
    assert out.dtype == dtype and final.dtype == jnp.float32
    tol = TOLERANCE[dtype] if tol is None else tol
    assert_close(out, ref_out, tol, "output")
    assert_close(final, ref_final, tol, "final state")


def test_two_chunks_with_initial_state():
    check(0, 2, 128, 2, 2, 32, 32, with_state=True)


@pytest.mark.parametrize("length", [1, 70])
def test_lengths_off_the_chunk(length):
    check(10, 1, length, 1, 1, 16, 16)


def test_grouped_value_heads_and_odd_head_dims():
    # HV = 2 H; K and V of no power of two are padded to 32 and 64 inside.
    check(20, 1, 80, 1, 2, 24, 40, with_state=True)


def test_gates_of_minus_1000():
    # Steep chunks sum every decay from the per-token gates (`pallas_chunk_gates`), so no decay carries the
    # rounding of a cumulative gate near -1000 (3e-4 before issue 43; tests/ops/kda/test_extreme_gates.py).
    check(30, 1, 128, 2, 2, 16, 32, hard_gates=True, with_state=True)


def test_fast_decay_below_steep():
    check(35, 1, 128, 2, 2, 32, 32, fast_gates=True, with_state=True)


def test_without_l2_norm():
    # Raw keys make A_kk large: the triangular inverse is exercised far from the identity.
    check(40, 1, 64, 1, 1, 16, 16, l2_normalize=False)


@pytest.mark.parametrize("chunk", [16, 32])
def test_smaller_chunks(chunk):
    check(50, 1, 96, 1, 1, 32, 16, chunk=chunk, with_state=True)


def test_bf16():
    check(60, 1, 128, 2, 2, 64, 64, jnp.bfloat16, with_state=True)


def public_inputs(seed, dtype=jnp.float32, length=40):
    q = normal(seed, (2, length, 1, 16), dtype)
    k = normal(seed + 1, (2, length, 1, 16), dtype)
    v = normal(seed + 2, (2, length, 2, 32), dtype)
    raw_gate = normal(seed + 3, (2, length, 2, 16))
    beta_logits = normal(seed + 4, (2, length, 2))
    h0 = normal(seed + 5, (2, 2, 16, 32), scale=0.5)
    gate = {"a_log": normal(seed + 6, (2,), scale=0.5), "dt_bias": normal(seed + 7, (2, 16)), "lower_bound": -5.0}
    return (q, k, v, beta_logits, raw_gate, h0), gate


def test_public_api_fused_gate_beta_logits_and_state():
    args, gate = public_inputs(70)
    out, final = api.kernel_delta_attention(*args, platform="pallas", return_state=True, beta_is_logits=True, **gate)
    ref_out, ref_final = reference.kda_reference(
        *(to64(x) for x in args), beta_is_logits=True, **{name: to64(x) for name, x in gate.items()}
    )
    assert_close(out, ref_out, TOLERANCE[jnp.float32], "output")
    assert_close(final, ref_final, TOLERANCE[jnp.float32], "final state")


def test_public_api_per_head_decay():
    (q, k, v, beta_logits, _, _), _ = public_inputs(80)
    decay = jax.nn.log_sigmoid(normal(88, (2, 40, 2)) + 1.0)
    beta = jax.nn.sigmoid(beta_logits)
    out = api.kernel_delta_attention(q, k, v, beta, decay, platform="pallas")
    ref_out, _ = reference.kda_reference(*(to64(x) for x in (q, k, v, beta, decay)))
    assert_close(out, ref_out, TOLERANCE[jnp.float32], "output")


def test_gradient_matches_xla():
    args, gate = public_inputs(90, length=24)

    def loss(platform):
        def f(q, k, v, beta_logits, raw_gate, h0):
            out, final = api.kernel_delta_attention(
                q, k, v, beta_logits, raw_gate, h0, platform=platform, return_state=True, beta_is_logits=True,
                **gate,
            )
            return jnp.sum(out * jnp.cos(out)) + jnp.sum(final**2)

        return jax.grad(f, argnums=tuple(range(6)))(*args)

    assert_close(loss("pallas"), [to64(x) for x in loss("xla")], 1e-5, "gradient")


def test_vmap_and_checkpoint_match_xla():
    q, k, v, g, beta = inputs(95, 3, 20, 1, 1, 16, 16, jnp.float32)
    stacked = [x[:, None] for x in (q, k, v, beta, g)]  # a vmapped axis over batches of one

    def vmapped(platform):
        return jax.vmap(lambda *a: api.kernel_delta_attention(*a, platform=platform))(*stacked)

    def checkpointed_grad(platform):
        def f(q):
            return api.kernel_delta_attention(q, k, v, beta, g, platform=platform)

        return jax.grad(lambda q: jnp.sum(jax.checkpoint(f)(q) ** 2))(q)

    assert_close(vmapped("pallas"), to64(vmapped("xla")), 1e-5, "vmapped output")
    assert_close(checkpointed_grad("pallas"), to64(checkpointed_grad("xla")), 1e-5, "checkpointed gradient")


@pytest.mark.parametrize("dims", [(16, 32), (24, 40)])
@pytest.mark.parametrize("with_state", [False, True])
def test_packed_sequences(with_state, dims):
    # Sequences of 0 (empty), 70 (over a chunk), 5, 0 and 40 tokens, then 13 tokens of no sequence; head
    # sizes that are tiles, and ones padded to tiles (the packed rows are then read from padded copies).
    cu_seqlens = jnp.array([0, 0, 70, 75, 75, 115], jnp.int32)
    q, k, v, g, beta = inputs(100, 1, 128, 1, 2, *dims, jnp.float32)
    h0 = normal(106, (5, 2, *dims), scale=0.5) if with_state else None
    out, final = api.kernel_delta_attention(
        q, k, v, beta, g, h0, platform="pallas", return_state=True, cu_seqlens=cu_seqlens
    )
    ref_out, ref_final = reference.kda_reference(
        *(to64(x) for x in (q, k, v, beta, g, h0)), cu_seqlens=np.asarray(cu_seqlens)
    )
    assert_close(out, ref_out, TOLERANCE[jnp.float32], "output")
    assert_close(final, ref_final, TOLERANCE[jnp.float32], "final states")


def test_supports_every_layout_up_to_head_dim_256():
    q, k, v, g, beta = inputs(100, 1, 32, 1, 1, 16, 16, jnp.float32)
    kernel = api.KernelDeltaAttention()
    pallas = lookup(api.OP_ID, "pallas", "chunked")
    packed = kernel.prepare(q, k, v, beta, g, cu_seqlens=jnp.array([0, 10, 32], jnp.int32))
    assert pallas.supports(kernel.invocation(packed, "pallas")) is None
    wide = kernel.prepare(*(jnp.zeros((1, 4, 1, 512)) for _ in range(3)), beta[:, :4], g[:, :4, :, 0])
    reason = pallas.supports(kernel.invocation(wide, "pallas"))
    assert reason is not None and "256" in reason


@pytest.mark.parametrize(
    ("length", "dim", "packed", "chosen"),
    [(32, 16, False, "pallas:chunked"), (32, 16, True, "pallas:chunked"), (1, 16, False, "pallas:decode"),
     (32, 512, False, "xla:chunked")],
)
def test_auto_on_a_gpu(length, dim, packed, chosen):
    # What `auto` takes on a GPU (the invocation as a GPU call would build it): the Pallas kernels,
    # XLA where they decline (K above 256).
    q, k, v = (jnp.zeros((1, length, 2, dim)) for _ in range(3))
    beta, g = jnp.zeros((1, length, 2)), jnp.zeros((1, length, 2, dim))
    cu_seqlens = jnp.array([0, length // 2, length], jnp.int32) if packed else None
    kernel = api.KernelDeltaAttention()
    inv = kernel.invocation(kernel.prepare(q, k, v, beta, g, cu_seqlens=cu_seqlens))
    assert kernel.implementations(on_h200(inv))[0].name == chosen


def abstract_inputs(dtype, packed: bool, dim: int = 128) -> list:
    """[q, k, v, g, beta, initial state], [the 3 arrays of Segments when packed (3 sequences in 2 chunks)]."""
    token, state = (1, 128, 2, dim), (3 if packed else 1, 2, dim, dim)
    shapes = [token, token, token, token, (1, 128, 2), state]
    dtypes = [dtype, dtype, dtype, jnp.float32, jnp.float32, jnp.float32]
    args = [jax.ShapeDtypeStruct(s, d) for s, d in zip(shapes, dtypes)]
    segments = [jax.ShapeDtypeStruct((2,), jnp.int32) for _ in range(3)] if packed else []
    return args, segments


def pipeline_stages_of(text: str) -> list[tuple[str, int]]:
    """(kernel name, num_stages) of each Triton call in lowered StableHLO text, in order."""
    return [(name, int(stages)) for name, stages in re.findall(r'name = "(kda_[a-z_]+)", num_stages = (\d+)', text)]


@pytest.mark.parametrize(
    ("dtype", "dim", "stages"),
    # Three pipeline stages where they were measured (bf16, K <= 128); the earlier settings for fp32; one
    # at K = 256, where more ask for more shared memory than the H200 has.
    [(jnp.bfloat16, 128, [1, 3, 3]), (jnp.float32, 128, [1, 1, 2]), (jnp.bfloat16, 256, [1, 1, 1]),
     (jnp.float32, 256, [1, 1, 1])],
)
def test_pipeline_stages(dtype, dim, stages):
    args, _ = abstract_inputs(dtype, False, dim)
    text = lower_for_h200(lambda *a: kda_chunk_fwd(*a[:6], None, scale=0.1), *args)
    names = ["kda_chunk_cumsum", "kda_chunk_intra", "kda_chunk_state_output"]
    assert pipeline_stages_of(text) == list(zip(names, stages))


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton(dtype, packed):
    args, segments = abstract_inputs(dtype, packed)
    text = lower_for_h200(
        lambda *a: kda_chunk_fwd(*a[:6], Segments(*a[6:]) if packed else None, scale=0.1), *args, *segments
    )
    assert text.count("__gpu$xla.gpu.triton") == 3  # cumsum, intra, state pass with the output


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_lowers_to_triton_reading_packed_rows_in_place(dtype):
    # 100 packed tokens in 3 padded chunks: the cumsum and stage 1 read them through masked windows.
    args, _ = abstract_inputs(dtype, True)
    args = [jax.ShapeDtypeStruct((1, 100, *x.shape[2:]), x.dtype) for x in args[:5]] + args[5:]
    chunks = [jax.ShapeDtypeStruct((3,), jnp.int32) for _ in range(5)]

    def forward(*a):
        return kda_chunk_fwd(*a[:6], Segments(*a[6:9]), PackedChunks(*a[9:]), scale=0.1)

    text = lower_for_h200(forward, *args, *chunks)
    assert text.count("__gpu$xla.gpu.triton") == 3


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_wy_recompute_matches_stage_1(dtype):
    # The backward's `chunk_wy` from the stored T gives the forward's w, u, kg, qg and decay: both round T
    # to the dtype their dots take, so bf16 agrees too.
    q, k, v, g, beta = inputs(190, 1, 128, 2, 4, 64, 128, dtype, fast_gates=True)
    q, k = prepare_qk(q, k, 0.125, True)
    gates = chunk_local_cumsum(g, chunk=64, interpret=True)
    (inverse, _), wy = chunk_intra(q, k, v, gates, g, beta, interpret=True)
    assert_close(chunk_wy(q, k, v, gates, g, beta, inverse, interpret=True), wy, 1e-6, "w, u, kg, qg, decay")


@pytest.mark.parametrize("gates", ["fast", "hard"])
@pytest.mark.parametrize("dtype, tolerance", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
def test_stage_1_normalizes_inside(dtype, tolerance, gates):
    # Stage 1 on raw q, k with the norms and scale as row and column factors gives what it gives on
    # `prepare_qk`'s normalized copies (bf16: those copies are rounded, the factors are not), with GQA,
    # through the factored scores (fast gates) and the steep chunks' exact ones (hard gates).
    q, k, v, g, beta = inputs(200, 1, 128, 2, 4, 64, 32, dtype, fast_gates=gates == "fast", hard_gates=gates == "hard")
    q = q * 7.0  # norms far from 1
    gates = chunk_local_cumsum(g, chunk=64, interpret=True)
    fused = chunk_intra(q, k, v, gates, g, beta, scale=0.125, l2_normalize=True, interpret=True)
    expected = chunk_intra(*prepare_qk(q, k, 0.125, True), v, gates, g, beta, interpret=True)
    assert_close(fused, expected, tolerance, "T, A_qk, w, u, kg, qg, decay")


def test_state_passes_agree_across_value_blocks():
    # The state passes take 16 value columns per program below a wave of 32-column programs
    # (`default_block_v`), the pass with the output 64 from two waves of 64-column programs
    # (`output_block_v`); every width, each over several value blocks, gives the same states and outputs.
    assert default_block_v(rows=16, dv=128) == 16 and default_block_v(rows=32, dv=128) == 32
    assert output_block_v(rows=64, dv=128) == 32 and output_block_v(rows=128, dv=128) == 64
    w, kg, qg = (normal(210 + i, (1, 128, 2, 32)) for i in range(3))
    u, d_out = normal(213, (1, 128, 2, 64)), normal(214, (1, 128, 2, 64))
    aqk = jnp.tril(normal(215, (1, 2, 2, 64, 64))).transpose(0, 1, 3, 2, 4).reshape(1, 128, 2, 64)
    decay = jax.random.uniform(jax.random.key(216), (1, 2, 2, 32), minval=0.5, maxval=1.0)
    h0 = normal(217, (1, 2, 32, 64))
    for run in (
        lambda **b: chunk_state(w, u, kg, decay, h0, interpret=True, **b),
        lambda **b: chunk_state_output(w, u, kg, decay, qg, aqk, h0, interpret=True, **b),
        lambda **b: chunk_state_bwd(qg, kg, w, aqk, d_out, decay, h0, interpret=True, **b),
    ):
        expected = [to64(x) for x in run(block_v=32)]
        assert_close(run(block_v=16), expected, 1e-6, "16 against 32 value columns")
        assert_close(run(block_v=64), expected, 1e-6, "64 against 32 value columns")


@pytest.mark.parametrize("n", [16, 32, 64])
@pytest.mark.parametrize("kind", ["random", "ones"])
def test_unit_lower_inverse(n, kind):
    # Against numpy's inverse, through every block growth (2 rows without dots, 4x, 2x); all-ones L (identical
    # unit keys, beta 1, no decay) is the case whose powers grow fastest (its inverse is bidiagonal).
    rng = np.random.default_rng(n)
    lower = np.tril(rng.normal(size=(n, n)) * 0.3 if kind == "random" else np.ones((n, n)), -1)
    got = unit_lower_inverse(jnp.asarray(lower, jnp.float32), EXACT)
    assert_close(got, np.linalg.inv(np.eye(n) + lower), 1e-6, "(I + L)^-1")


@pytest.mark.parametrize("chunk", [16, 64])
def test_chunk_local_cumsum(chunk):
    # Against numpy within each chunk: prefix sums.
    g = normal(230, (2, 128, 3, 32), scale=3.0)
    expected = np.cumsum(np.asarray(g, np.float64).reshape(2, 128 // chunk, chunk, 3, 32), 2)
    got = chunk_local_cumsum(g, chunk=chunk, interpret=True)
    assert_close(got, expected.reshape(g.shape), 1e-6, "G")


@pytest.mark.parametrize("chunk", [16, 64])
def test_gate_gradient(chunk):
    # The backward's dg: suffix sums of dG within each chunk, and 0 at gates whose decay underflows (below -104;
    # only steep chunks hold them: the first here, a gate of -200 in row 3 and of -inf in row 40 % chunk).
    d_cumulative = normal(231, (2, 128, 3, 32), scale=3.0)
    g = -jax.nn.softplus(normal(232, (2, 128, 3, 32)))
    g = g.at[:, 3, 0].set(-200.0).at[:, 40 % chunk, 1].set(-jnp.inf)
    expected = np.asarray(d_cumulative, np.float64).reshape(2, 128 // chunk, chunk, 3, 32)
    expected = np.flip(np.cumsum(np.flip(expected, 2), 2), 2).reshape(g.shape)
    expected = np.where(np.asarray(g) < -104, 0.0, expected)
    cumulative = chunk_local_cumsum(g, chunk=chunk, interpret=True)
    got = gate_gradient(d_cumulative, cumulative, g, chunk=chunk, interpret=True)
    assert_close(got, expected, 1e-6, "dg")
