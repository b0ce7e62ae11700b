"""Gradients of both implementations (custom VJPs) for query, key, value, every gate and initial_state:
against jax.grad of the float64 reference math, against float64 finite differences, under jit and vmap."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import RecurrentAttentionConfig, recurrent_attention
from hybrax.ops.recurrent.reference import recurrent_reference
from tests.helpers import TOLERANCE, assert_close
from tests.ops.recurrent.inputs import ARG_NAMES, IMPLS, PALLAS, make_call, normal

FP32 = TOLERANCE[jnp.float32]
GATE_TOLERANCE_STRONG = 5e-5  # measured up to 1.5e-5
DIFFERENTIABLE = ARG_NAMES[:-1]  # all but cu_seqlens

LAYOUTS = {
    # batch of 2, per-head scalar g and a per-batch g_gamma; T = 19 spans two chunks of 16
    "batch": dict(seq_len=19, g_gamma_batched=True),
    # packed with empty sequences, per-key g
    "packed": dict(cu_seqlens=[0, 0, 6, 6, 19], g_per_key=True),
    # strong gates: a fifth of them -1000
    "strong": dict(seq_len=19, g_per_key=True, strong_fraction=0.2),
    # the gates along the key axis alone (what the Pallas forward takes), plain and strong
    "key_gates": dict(seq_len=19, g_gamma_batched=True, gates=("g", "g_gamma", "gk")),
    "strong_key_gates": dict(seq_len=19, g_per_key=True, strong_fraction=0.2, gates=("g", "g_gamma", "gk")),
    "packed_key_gates": dict(cu_seqlens=[0, 0, 6, 6, 19], g_per_key=True, gates=("g", "gk")),
}


def _loss(run, weights, *args):
    output, final = run(*args)
    return jnp.sum(output * weights[0]) + jnp.sum(final * weights[1])


def _weights(call, seed=99):
    output, final = call.reference()
    return normal(seed, output.shape), normal(seed + 1, final.shape)


def _present(call):
    return [i for i, name in enumerate(DIFFERENTIABLE) if call.arrays.get(name) is not None]


def _our_gradients(call, cfg, weights):
    run = functools.partial(recurrent_attention, reverse=call.reverse, return_state=True, cfg=cfg)
    argnums = _present(call)
    return jax.jit(jax.grad(functools.partial(_loss, run, weights), argnums=argnums))(*call.args())


def _reference_gradients(call, weights):
    """jax.grad of the reference math in float64."""
    with jax.enable_x64(True):
        args64 = [a if name == "cu_seqlens" or a is None else jnp.asarray(a, jnp.float64)
                  for name, a in zip(ARG_NAMES, call.args())]
        reference = functools.partial(recurrent_reference, reverse=call.reverse, xp=jnp)
        weights64 = [jnp.asarray(w, jnp.float64) for w in weights]
        expected = jax.grad(functools.partial(_loss, reference, weights64), argnums=_present(call))(*args64)
        return [np.asarray(e) for e in expected]


@functools.lru_cache
def _reference_case(layout, reverse, dtype=jnp.float32):
    """(call, weights, reference gradients), shared by both implementations: eager float64 grads are slow."""
    call = make_call(20, heads=4, kv_heads=2, key_dim=4, value_dim=3, reverse=reverse, dtype=dtype, **LAYOUTS[layout])
    if dtype == jnp.bfloat16:
        call.arrays["initial_state"] = call.arrays["initial_state"].astype(jnp.bfloat16)
    weights = _weights(call)
    return call, weights, _reference_gradients(call, weights)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout, reverse", [("batch", False), ("packed", False), ("packed", True), ("strong", False)])
def test_gradients_match_float64_reference(impl, layout, reverse):
    call, weights, expected = _reference_case(layout, reverse)
    ours = _our_gradients(call, IMPLS[impl], weights)
    for index, got, want in zip(_present(call), ours, expected, strict=True):
        name = DIFFERENTIABLE[index]
        assert got.dtype == call.args()[index].dtype
        # Gate gradients are suffix sums of q*dq - k*dk (engine.py): when a decay is exactly zero the true
        # gradient vanishes by cancellation of O(1) terms, which fp32 leaves at ~eps * sqrt(T) of them.
        tol = GATE_TOLERANCE_STRONG if layout == "strong" and name.startswith("g") else FP32
        assert_close(got, want, tol, what=f"d{name}")


@pytest.mark.parametrize("layout", ["key_gates", "strong_key_gates", "packed_key_gates"])
def test_pallas_gradients_match_float64_reference(layout):
    """The Pallas forward and backward (KDA's stages without the delta rule; interpret mode here). Its gate gradients
    are suffix sums too (of dG within each chunk): with strong gates they vanish by cancellation, as XLA's."""
    call, weights, expected = _reference_case(layout, False)
    ours = _our_gradients(call, PALLAS, weights)
    for index, got, want in zip(_present(call), ours, expected, strict=True):
        name = DIFFERENTIABLE[index]
        tol = GATE_TOLERANCE_STRONG if layout.startswith("strong") and name.startswith("g") else FP32
        assert_close(got, want, tol, what=f"d{name}")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("layout", ["packed"])
def test_gradients_match_finite_differences(impl, layout):
    """In float64 the implementations compute in float64, so central differences are accurate to ~1e-9."""
    with jax.enable_x64(True):
        call = make_call(21, heads=2, kv_heads=1, key_dim=4, value_dim=3, dtype=jnp.float64, **LAYOUTS[layout])
        call.arrays = {n: a if n == "cu_seqlens" else jnp.asarray(a, jnp.float64) for n, a in call.arrays.items()}
        weights = [jnp.asarray(w, jnp.float64) for w in _weights(call)]
        run = functools.partial(recurrent_attention, return_state=True, cfg=IMPLS[impl])
        loss = jax.jit(functools.partial(_loss, run, weights))
        grads = _our_gradients(call, IMPLS[impl], weights)
        args, eps = call.args(), 1e-5
        for seed, (index, grad) in enumerate(zip(_present(call), grads, strict=True)):
            direction = jnp.asarray(np.random.default_rng(seed).standard_normal(args[index].shape))
            shifted = lambda sign: loss(*(a + sign * eps * direction if i == index else a  # noqa: E731
                                           for i, a in enumerate(args)))
            numeric = float((shifted(1) - shifted(-1)) / (2 * eps))
            analytic = float(jnp.vdot(grad, direction))
            assert abs(numeric - analytic) <= 1e-6 * max(1.0, abs(numeric)), (DIFFERENTIABLE[index], numeric, analytic)


# name: (config, gates, seeds); the Pallas path takes no gv.
VMAP_CASES = {**{impl: (cfg, ("g", "gk", "gv"), (30, 31)) for impl, cfg in IMPLS.items()},
              "pallas": (PALLAS, ("g", "gk"), (32, 33))}


@pytest.mark.parametrize("case", VMAP_CASES)
def test_gradients_under_vmap_and_checkpoint(case):
    cfg, gates, seeds = VMAP_CASES[case]
    calls = [make_call(seed, batch=1, seq_len=19, gates=gates) for seed in seeds]

    def loss(*args):  # output only: the final state's cotangent is zero
        return jnp.sum(recurrent_attention(*args, cfg=cfg) ** 2)

    argnums = tuple(_present(calls[0]))
    grad = jax.grad(loss, argnums=argnums)
    stacked = [None if a is None else jnp.stack([a, b]) for a, b in zip(calls[0].args(), calls[1].args())]
    batched = jax.jit(jax.vmap(grad))(*stacked)
    rematerialized = jax.jit(jax.grad(jax.checkpoint(loss), argnums=argnums))
    for index, call in enumerate(calls):
        single = jax.jit(grad)(*call.args())
        for got, want in zip(batched, single, strict=True):
            assert_close(got[index], np.asarray(want, np.float64), FP32)
        for got, want in zip(rematerialized(*call.args()), single, strict=True):
            assert_close(got, np.asarray(want, np.float64), FP32)


# name: (config, gradient layout); the Pallas path takes no gv.
BF16_CASES = {**{impl: (cfg, "batch") for impl, cfg in IMPLS.items()}, "pallas": (PALLAS, "key_gates")}


@pytest.mark.parametrize("case", BF16_CASES)
def test_bfloat16_gradients(case):
    """bf16 query/key/value/state get bf16 gradients (fp32 gates fp32 ones) within bf16 rounding."""
    cfg, layout = BF16_CASES[case]
    call, weights, expected = _reference_case(layout, False, jnp.bfloat16)
    ours = _our_gradients(call, cfg, weights)
    for index, got, want in zip(_present(call), ours, expected, strict=True):
        assert got.dtype == call.args()[index].dtype
        assert_close(got, want, TOLERANCE[jnp.bfloat16], what=f"d{DIFFERENTIABLE[index]}")


# Per-chunk states at the chunk size the heuristic picks off the CPU: T/64 of them.
MEMORY_IMPLS = {"scan": IMPLS["scan"], "chunked": RecurrentAttentionConfig("xla", "chunked", chunk_size=64)}
# Compiled temp memory (forward, and jax.grad of output and final state) as a fraction of the T per-step
# [K, V] states that neither implementation may keep. Anything that keeps them needs at least 1: autodiff
# through a per-step lax.scan keeps 3.1 (the state and its decayed copy at each step; 395 MiB here), an
# associative scan over a [T, K, V] decay tensor 5.0 forward. Measured (jax 0.11.2, CPU): the scan
# 0.047 / 0.089 (the carried state plus time-major copies of the [T, H, K] inputs); chunked 0.149 / 0.336
# (per-chunk states: a few copies in each of the backward's three recurrences, plus [T, H, K] decays).
MEMORY_FRACTION = {"scan": 1 / 8, "chunked": 1 / 2}


@pytest.mark.parametrize("impl", MEMORY_IMPLS)
def test_memory_stays_far_below_per_step_states(impl):
    batch, seq_len, heads, dim = 1, 1024, 2, 128  # K = V = 128: per-step states (128 MiB) dwarf [T, H, K] arrays
    tokens = jax.ShapeDtypeStruct((batch, seq_len, heads, dim), jnp.float32)
    state = jax.ShapeDtypeStruct((batch, heads, dim, dim), jnp.float32)
    per_step_states_bytes = seq_len * batch * heads * dim * dim * 4

    def forward(q, k, v, gk, gv, h0):
        return recurrent_attention(q, k, v, None, None, gk, gv, h0, return_state=True, cfg=MEMORY_IMPLS[impl])

    def loss(*args):
        output, final = forward(*args)
        return jnp.sum(output) + jnp.sum(final)

    specs = (tokens,) * 5 + (state,)
    for what, fn in (("forward", forward), ("grad", jax.grad(loss, argnums=tuple(range(6))))):
        temp = jax.jit(fn).lower(*specs).compile().memory_analysis().temp_size_in_bytes
        assert temp < MEMORY_FRACTION[impl] * per_step_states_bytes, (
            f"{what}: temp memory {temp / 2**20:.1f} MiB, per-step states {per_step_states_bytes / 2**20:.0f} MiB")
