"""The CUDA KDA decode kernel against the float64 reference (on a GPU with nvcc), and where it is chosen or declined
(anywhere: the CPU tests check the declines and `auto`'s choice on an H200 with and without nvcc)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import kernel_delta_attention
from hybrax.ops import cuda_build
from hybrax.ops.kda import reference
from hybrax.ops.kda.api import KernelDeltaAttention
from hybrax.ops.kda.decode import cuda as cuda_decode
from hybrax.ops.kda.decode.cuda import LAUNCHES, fused_recurrent_decode_cuda
from hybrax.serving import kda_pool
from tests.helpers import TOLERANCE, assert_close, lower_for_h200, normal, on_h200, to64

ON_GPU = jax.default_backend() == "gpu" and cuda_build.nvcc_path() is not None
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs an NVIDIA GPU and nvcc")
LOWER_BOUND = -5.0


def step_inputs(seed, batch, heads, value_heads, dk, dv, dtype=jnp.float32, gate_width=None):
    q, k = (normal(seed + i, (batch, 1, heads, dk), dtype) for i in range(2))
    v = normal(seed + 2, (batch, 1, value_heads, dv), dtype)
    g = normal(seed + 3, (batch, 1, value_heads, gate_width or dk))
    beta = normal(seed + 4, (batch, 1, value_heads))
    a_log, dt_bias = normal(seed + 5, (value_heads,), scale=0.5), normal(seed + 6, (value_heads, dk))
    return q, k, v, g, beta, a_log, dt_bias


def reference_step(q, k, v, g, beta, state, gate, a_log, dt_bias, lower_bound=LOWER_BOUND, use_qk_l2norm=True):
    fused = {} if gate == "activated" else {"a_log": to64(a_log), "dt_bias": to64(dt_bias)}
    if gate == "bounded":
        fused["lower_bound"] = lower_bound
    return reference.kda_reference(
        *(to64(x) for x in (q, k, v, beta, g, state)), beta_is_logits=True, use_qk_l2norm=use_qk_l2norm, **fused,
    )


def run_cuda(q, k, v, g, beta, state, gate, a_log, dt_bias, slots=None, lower_bound=LOWER_BOUND, **launch):
    fused = {} if gate == "activated" else {"a_log": a_log, "dt_bias": dt_bias}
    return fused_recurrent_decode_cuda(
        q, k, v, g, beta, state, slots, scale=q.shape[-1] ** -0.5, gate=gate, beta_is_logits=True,
        lower_bound=lower_bound if gate == "bounded" else None, **fused, **launch,
    )


@gpu_only
@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("gate", ["activated", "softplus", "bounded"])
def test_every_launch_and_gate_matches_reference(gate, launch):
    q, k, v, g, beta, a_log, dt_bias = step_inputs(10, 3, 2, 4, 128, 128)
    if gate == "activated":
        g = jax.nn.log_sigmoid(g)
    state = normal(20, (3, 4, 128, 128))
    out = run_cuda(q, k, v, g, beta, state, gate, a_log, dt_bias, block_v=launch[0], num_warps=launch[1])
    assert_close(out, reference_step(q, k, v, g, beta, state, gate, a_log, dt_bias), TOLERANCE[jnp.float32])


@gpu_only
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("dk, dv, gate_width", [(64, 64, 1), (128, 96, 128), (64, 256, 64)])
def test_head_sizes_gate_widths_and_half_inputs(dk, dv, gate_width, dtype):
    q, k, v, g, beta, a_log, dt_bias = step_inputs(30, 5, 1, 3, dk, dv, dtype, gate_width)
    state = normal(31, (5, 3, dk, dv))
    o, new_state = run_cuda(q, k, v, g, beta, state, "bounded", a_log, dt_bias, block_v=32, num_warps=4)
    assert o.dtype == dtype
    ref_o, ref_state = reference_step(q, k, v, g, beta, state, "bounded", a_log, dt_bias)
    assert_close(o, ref_o, TOLERANCE[jnp.bfloat16])
    assert_close(new_state, ref_state, 1e-5, "state")  # fp32 arithmetic on half-exact inputs


@gpu_only
def test_pool_padding_minus_1000_and_untouched_rows():
    """Slots with -1 output zeros and write nothing; rows no request names stay bit-for-bit; -1000 gates."""
    slots = np.array([5, -1, 2, 0], np.int32)
    q, k, v, g, beta, a_log, dt_bias = step_inputs(40, 4, 2, 2, 128, 128)
    g = g.at[..., :64].set(-12.0)  # log decays near -0.01 there, between about -100 and -1000 elsewhere
    states = np.array(normal(41, (4, 2, 128, 128)))
    pool = np.array(normal(42, (7, 2, 128, 128)))
    pool[slots[slots >= 0]] = states[slots >= 0]
    o, new_pool = jax.jit(run_cuda, static_argnames=("gate", "block_v", "num_warps", "lower_bound"),
                          donate_argnums=(5,))(q, k, v, g, beta, jnp.asarray(pool), "bounded", a_log, dt_bias,
                                               jnp.asarray(slots), lower_bound=-1000.0, block_v=64, num_warps=4)
    ref_o, ref_states = reference_step(q, k, v, g, beta, states, "bounded", a_log, dt_bias, lower_bound=-1000.0)
    valid = slots >= 0
    assert_close(o[valid], ref_o[valid], TOLERANCE[jnp.float32])
    assert_close(np.asarray(new_pool)[slots[valid]], ref_states[valid], TOLERANCE[jnp.float32], "pool")
    assert np.all(np.asarray(o[~valid]) == 0), "a padded request must output zeros"
    untouched = np.setdiff1d(np.arange(7), slots[valid])
    np.testing.assert_array_equal(np.asarray(new_pool)[untouched], pool[untouched])


@gpu_only
@pytest.mark.parametrize("programmatic", [False, True])
def test_chained_steps_without_l2_norm_follow_the_sequence(programmatic):
    """The steps in one program, each reading the state the one before wrote: with the programmatic launch a step
    is scheduled while the one before runs, and must still wait for its state."""
    steps, batch = 6, 2
    inputs = [step_inputs(50 + 10 * t, batch, 1, 2, 64, 64) for t in range(steps)]
    a_log, dt_bias = inputs[0][5:]
    initial = 0.1 * normal(49, (batch, 2, 64, 64))

    @jax.jit
    def chain(inputs, state):
        outputs = []
        for q, k, v, g, beta, _, _ in inputs:
            o, state = fused_recurrent_decode_cuda(
                q, k, v, g, beta, state, a_log=a_log, dt_bias=dt_bias, scale=0.125, gate="softplus",
                beta_is_logits=True, use_qk_l2norm=False, block_v=32, num_warps=2, programmatic_launch=programmatic,
            )
            outputs.append(o)
        return outputs, state

    outputs, state = chain(inputs, initial)
    sequence = [jnp.concatenate([step[i] for step in inputs], axis=1) for i in range(5)]
    want = reference_step(*sequence, initial, "softplus", a_log, dt_bias, use_qk_l2norm=False)
    assert_close((jnp.concatenate(outputs, axis=1), state), want, 1e-4)  # unnormalized keys: a longer lever


@gpu_only
def test_single_token_path_and_its_gradient():
    q, k, v, g, beta, a_log, dt_bias = step_inputs(60, 2, 2, 4, 128, 128)
    state = normal(61, (2, 4, 128, 128))

    def loss(platform, q, state):
        o, new_state = kernel_delta_attention(
            q, k, v, beta, g, state, a_log=a_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND, beta_is_logits=True,
            return_state=True, platform=platform,
        )
        return jnp.sum(o * v) + jnp.sum(new_state * state), (o, new_state)

    (_, got), got_grads = jax.value_and_grad(lambda *a: loss("cuda", *a), argnums=(0, 1), has_aux=True)(q, state)
    (_, want), want_grads = jax.value_and_grad(lambda *a: loss("xla", *a), argnums=(0, 1), has_aux=True)(q, state)
    assert_close(got, want, TOLERANCE[jnp.float32])
    assert_close(got_grads, want_grads, TOLERANCE[jnp.float32], "gradients")


def test_declines_without_a_gpu_or_nvcc(monkeypatch):
    assert "needs an NVIDIA GPU" in cuda_build.unavailable_reason("cpu")
    monkeypatch.setattr(cuda_build, "nvcc_path", lambda: None)
    assert "needs nvcc" in cuda_build.unavailable_reason("gpu")


@pytest.mark.skipif(ON_GPU, reason="checks the CPU's refusal")
def test_explicit_platform_says_why_off_the_gpu():
    q, k, v, g, beta, _, _ = step_inputs(70, 1, 1, 1, 64, 64)
    with pytest.raises(ValueError, match="cuda:decode: needs an NVIDIA GPU"):
        kernel_delta_attention(q, k, v, jax.nn.sigmoid(beta), jax.nn.log_sigmoid(g), platform="cuda")


@pytest.mark.parametrize("tokens, dk, dv, reason", [(2, 128, 128, "one token"), (1, 32, 128, "K in"),
                                                    (1, 128, 48, "V a multiple of 32")])
def test_shape_reasons(tokens, dk, dv, reason):
    assert reason in cuda_decode.shape_reason(tokens, dk, dv)
    assert cuda_decode.shape_reason(1, 128, 96) is None


def test_bad_launch_is_refused():
    q, k, v, g, beta, _, _ = step_inputs(75, 1, 1, 1, 64, 64)
    with pytest.raises(ValueError, match=r"\(block_v, num_warps\) must be one of"):
        fused_recurrent_decode_cuda(q, k, v, g, beta, normal(76, (1, 1, 64, 64)), scale=1.0, block_v=128, num_warps=8)


@pytest.mark.parametrize(("nvcc", "batch", "cuda"), [("/usr/local/cuda/bin/nvcc", 512, True),
                                                     ("/usr/local/cuda/bin/nvcc", 511, False), (None, 512, False)])
def test_auto_on_an_h200_takes_cuda_from_2048_rows_where_nvcc_builds_it(monkeypatch, nvcc, batch, cuda):
    """512 requests x 4 value heads = cuda_decode.AUTO_MIN_ROWS; one request fewer, or no nvcc: the Pallas step."""
    monkeypatch.setattr(cuda_build, "nvcc_path", lambda: nvcc)
    q, k, v, g, beta, a_log, dt_bias = step_inputs(80, batch, 2, 4, 64, 64)
    decode_kernel, pool_kernel = KernelDeltaAttention(), kda_pool.KdaDecodePool()
    decode = decode_kernel.invocation(decode_kernel.prepare(q, k, v, jax.nn.sigmoid(beta), jax.nn.log_sigmoid(g)))
    pool_args = (q, k, v, g, beta, jnp.zeros((batch, 4, 64, 64)), jnp.arange(batch, dtype=jnp.int32))
    pool = pool_kernel.invocation(pool_kernel.prepare(*pool_args))
    token_slots = jnp.arange(batch, dtype=jnp.int32)[:, None]
    speculative = pool_kernel.invocation(pool_kernel.prepare(*pool_args, token_slots=token_slots))
    want = ("cuda:decode", "cuda:fused_recurrent") if cuda else ("pallas:decode", "pallas:fused_recurrent")
    assert decode_kernel.implementations(on_h200(decode))[0].name == want[0]
    assert pool_kernel.implementations(on_h200(pool))[0].name == want[1]
    assert pool_kernel.implementations(on_h200(speculative))[0].name == "pallas:fused_recurrent"


@pytest.mark.parametrize("batch, programmatic", [(1, True), (5, False)])
def test_lowers_to_the_ffi_target_with_the_state_in_place(batch, programmatic):
    """For an H200 without one: a custom call of hybrax_kda_decode whose second result (the state) aliases its
    last operand, once; nothing else on the state's path; the programmatic launch as asked."""
    shapes = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in step_inputs(90, batch, 2, 4, 128, 128)]
    state = jax.ShapeDtypeStruct((8, 4, 128, 128), jnp.float32)
    slots = jax.ShapeDtypeStruct((batch,), jnp.int32)

    def step(q, k, v, g, beta, a_log, dt_bias, state, slots):
        return fused_recurrent_decode_cuda(q, k, v, g, beta, state, slots, a_log, dt_bias, scale=0.1,
                                           lower_bound=-5.0, gate="bounded", beta_is_logits=True,
                                           programmatic_launch=programmatic)

    text = lower_for_h200(step, *shapes, state, slots)
    assert text.count("stablehlo.custom_call @hybrax_kda_decode") == 1
    assert "output_tuple_indices = [1], operand_index = 9" in text
    assert f"programmatic = {str(programmatic).lower()}" in text
