"""Extreme log decays through every chunked KDA implementation, against float64 autodiff of the reference.

Issue 43: any gate <= 0 is valid, -inf included (log 0, a hard reset). The Pallas kernels exponentiated
differences of the chunk-local fp32 cumulative gate, which keep the rounding of the larger sum: 5e-3 relative
error after a run of -1000, O(1) after a -1e30 token (it swallows every later gate of its chunk), NaN at -inf;
XLA's chunked path met 0 * -inf in its masked matmuls (NaN at -inf). Each gate pattern below is one row of the
batch (one sequence when packed), so that an implementation compiles once per layout and every pattern is
checked on its own: outputs, final states and the gradients of every input.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda.api import KernelDeltaAttentionConfig, kernel_delta_attention
from tests.helpers import TOLERANCE, to64
from tests.ops.kda.oracle import as64, kda64

FP32 = TOLERANCE[jnp.float32]
# The fused gate's a_log gradient sums dg * g over the tokens. The Pallas backward takes dg as a suffix sum of
# the gradient of the cumulative gate (pallas_chunk_cumsum.gate_gradient), which leaves ~2^-24 of the terms that
# cancel in it, and g multiplies that by up to 104 (below, the gate's decay underflows and dg is set to 0):
# measured 1.1e-5 on the fused layout's mixture (gates of -70 times rates above 1). XLA differentiates the
# pairwise sums themselves: no such cancellation.
A_LOG = {"xla": FP32, "pallas": 5e-5}


# ---------------------------------------------------------------------------------------------------
# Gate patterns: log decays [T, *channels] for one sequence (the channels: [HV, K] or [HV]).


def _bounded(rng, shape):
    return -np.logaddexp(0.0, rng.standard_normal(shape))  # -softplus: around -0.7


def _run_of_1000(rng, shape):
    """The issue's case: -1000 over the first half, then -0.05."""
    g = np.full(shape, -0.05)
    g[: max(1, shape[0] // 2)] = -1000.0
    return g


def _at(rows, value, channels_too=False):
    """Bounded gates with `value` at the given rows (those inside the sequence), in every channel, or with
    `channels_too` in every other channel only (per-channel resets)."""

    def pattern(rng, shape):
        g = _bounded(rng, shape)
        rows_inside = [row for row in rows if row < shape[0]] or [0]
        if channels_too and len(shape) == 3:
            g[np.ix_(rows_inside, range(shape[1]), range(0, shape[2], 2))] = value
        else:
            g[rows_inside] = value
        return g

    return pattern


def _mixture(rng, shape):
    """Per token and channel: mostly bounded, else just past the kernels' steep threshold per token (-70),
    -1000, -1e30 or -inf."""
    g = _bounded(rng, shape)
    pick = rng.choice(5, size=shape, p=[0.8, 0.05, 0.05, 0.05, 0.05])
    for index, value in enumerate((-70.0, -1000.0, -1e30, -np.inf), start=1):
        g[pick == index] = value
    return g


PATTERNS = {
    "bounded": _bounded,  # the control
    "run_of_1000": _run_of_1000,
    # Row 16 opens the second 16-row sub-chunk (the row the steep test used to miss), 37 sits inside one.
    "single_1e30": _at([16, 37], -1e30),
    "inf_resets": _at([0, 20, 32], -np.inf, channels_too=True),
    "mixture": _mixture,
}


def _gates(length, channels, seed):
    """[P, T, *channels] float64: one row per pattern."""
    rng = np.random.default_rng(seed)
    return np.stack([pattern(rng, (length, *channels)) for pattern in PATTERNS.values()])


# ---------------------------------------------------------------------------------------------------
# KDA


def _softplus_inverse(x):
    """raw with softplus(raw) = x, for x in (0, inf] (raw +inf at x = inf; float64)."""
    with np.errstate(over="ignore", divide="ignore"):
        return np.where(x > 30.0, x, np.log(np.expm1(np.minimum(x, 30.0))))


def kda_case(seed, *, length=64, heads=1, value_heads=1, dim=16, decay="channel", fused=False, packed=False):
    """(arrays, options): one batch row per gate pattern, or with `packed` one sequence per pattern in a batch
    of one, behind an empty sequence and followed by tokens of no sequence. `fused`: the decay is the raw input
    of the softplus gate (a_log, dt_bias) that gives the patterns' log decays, -inf as -3e38 (a raw input of
    +inf gives the gate -inf, whose a_log gradient is inf * 0 = NaN, in the float64 reference too; two gates of
    -3e38 overflow a sum of them to -inf)."""
    rng = np.random.default_rng(seed)
    rows = len(PATTERNS)
    channels = (value_heads, dim) if decay == "channel" or fused else (value_heads,)
    g = _gates(length, channels, seed + 1)
    arrays = {}
    if fused:
        a_log = 0.1 + 0.5 * np.abs(rng.standard_normal(value_heads))  # rates above 1: raw inputs up to 3e38
        dt_bias = rng.standard_normal((value_heads, dim))
        rate = np.exp(a_log)[:, None]
        arrays.update(a_log=a_log, dt_bias=dt_bias)
        g = _softplus_inverse(-np.maximum(g, -3e38) / rate) - dt_bias  # softplus(raw + dt_bias) * rate = -g
    batch, options = rows, {}
    if packed:  # sequences of `length` tokens, an empty one first, 3 tokens of no sequence after them
        batch, total = 1, rows * length + 3
        g = np.concatenate([g.reshape(rows * length, *channels), np.zeros((3, *channels))])[None]
        options["cu_seqlens"] = (0, 0, *range(length, rows * length + 1, length))
        length = total
    states = rows + 1 if packed else rows
    normal = lambda *shape: rng.standard_normal(shape)  # noqa: E731
    arrays.update(
        q=normal(batch, length, heads, dim), k=normal(batch, length, heads, dim),
        v=normal(batch, length, value_heads, dim),
        beta=1 / (1 + np.exp(-normal(batch, length, value_heads))), decay=g,
        initial_state=0.5 * normal(states, value_heads, dim, dim),
    )
    return {name: jnp.asarray(x, jnp.float32) for name, x in arrays.items()}, options


ARRAY_NAMES = ("q", "k", "v", "beta", "decay", "initial_state", "a_log", "dt_bias")


def _kda_run(cfg, options):
    cu = options.get("cu_seqlens")

    def run(arrays):
        fused = {name: arrays[name] for name in ("a_log", "dt_bias") if name in arrays}
        return kernel_delta_attention(
            *(arrays[name] for name in ARRAY_NAMES[:6]), return_state=True, cfg=cfg, **fused,
            cu_seqlens=None if cu is None else jnp.array(cu, jnp.int32),
        )

    return run


def _oracle_run(options):
    return lambda arrays: kda64(*(arrays.get(name) for name in ARRAY_NAMES), **options)


def outputs_and_gradients(run, arrays, weights):
    """((o, final state), the gradients of sum(o * w) + sum(final * ws) w.r.t. every array)."""
    outputs, pullback = jax.vjp(run, arrays)
    return outputs, pullback(weights)[0]


def ours(run, cfg):
    """`outputs_and_gradients` of an implementation: jitted for XLA (one compilation instead of hundreds of eager
    ones); the Pallas path runs eagerly, its forward and backward being jitted already (layouts of the same
    kernel shapes share them)."""
    compute = functools.partial(outputs_and_gradients, run)
    return compute if cfg.platform == "pallas" else jax.jit(compute)


def loss_weights(run, arrays, seed):
    shapes = jax.eval_shape(run, arrays)
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s.shape), jnp.float32) for s in shapes)


def oracle_outputs_and_gradients(run64, arrays, weights):
    with jax.enable_x64(True):
        return jax.tree.map(np.asarray, outputs_and_gradients(run64, as64(arrays), as64(weights)))


def assert_rows_close(got, want, tol, what, rows=None):
    """Relative error of each part named in `rows` (name -> index; default: each pattern's batch row) <= tol;
    NaN or inf fails."""
    got, want = to64(got), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    rows = rows or {name: row for row, name in enumerate(PATTERNS)}
    for name, row in rows.items():
        error = np.linalg.norm(got[row] - want[row]) / max(np.linalg.norm(want[row]), 1e-30)
        assert np.all(np.isfinite(got[row])) and error <= tol, f"{what}, {name}: relative error {error:.2e}"


IMPLS = {
    "xla_chunked16": KernelDeltaAttentionConfig("xla", "chunked", chunk_size=16),
    "xla_chunked64": KernelDeltaAttentionConfig("xla", "chunked", chunk_size=64),
    "pallas_chunked16": KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=16),  # interpret mode here
    "pallas_chunked64": KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=64),
}
LAYOUTS = {
    "channel": dict(),  # per-channel decay, T = 64: one chunk of 64 (four sub-chunks) or four of 16
    "head": dict(decay="head"),  # per-head decay [B, T, HV]
    "fused_gqa_odd_length": dict(fused=True, heads=1, value_heads=2, length=45),  # the softplus gate, HV = 2 H
    "packed": dict(packed=True, length=21),  # sequences of 21 tokens: two chunks of 16 or one of 64 each
    "single_token": dict(length=1),  # T = 1: each pattern one gate
}
# Every layout on chunks of 64 (four sub-chunks: the Pallas kernels' steep test across them), chunks of 16 where
# the chunking differs most (interpret mode compiles each Pallas layout for a minute on two cores).
CASES = [(layout, impl) for layout in LAYOUTS for impl in IMPLS if impl.endswith("64") or layout != "single_token"]
CASES = [case for case in CASES if case[1] != "pallas_chunked16" or case[0] in ("channel", "head", "packed")]


@functools.lru_cache
def kda_reference(layout):
    arrays, options = kda_case(430, **LAYOUTS[layout])
    run64 = _oracle_run(options)
    weights = loss_weights(run64, arrays, 431)
    return arrays, options, weights, oracle_outputs_and_gradients(run64, arrays, weights)


def _parts(options):
    """Each pattern's part of the tokens and of the states: its batch row, or in a packed batch its sequence's
    tokens and state (and the whole: the empty sequence, the tokens of none)."""
    cu = options.get("cu_seqlens")
    if cu is None:
        return None, None
    tokens = {name: (0, slice(start, end)) for name, start, end in zip(PATTERNS, cu[1:-1], cu[2:])}
    states = {name: index for index, name in enumerate(PATTERNS, start=1)}
    return {"all": ..., **tokens}, {"all": ..., **states}


@pytest.mark.parametrize(("layout", "impl"), CASES)
def test_kda_extreme_gates(layout, impl):
    arrays, options, weights, (want_outputs, want_grads) = kda_reference(layout)
    outputs, grads = ours(_kda_run(IMPLS[impl], options), IMPLS[impl])(arrays, weights)
    tokens, states = _parts(options)
    assert_rows_close(outputs[0], want_outputs[0], FP32, "output", tokens)
    assert_rows_close(outputs[1], want_outputs[1], FP32, "final state", states)
    for name in ("q", "k", "v", "beta", "decay"):
        assert_rows_close(grads[name], want_grads[name], FP32, f"d {name}", tokens)
    assert_rows_close(grads["initial_state"], want_grads["initial_state"], FP32, "d initial_state", states)
    if "a_log" in grads:  # shared by every pattern: one relative error
        assert_rows_close(grads["dt_bias"], want_grads["dt_bias"], FP32, "d dt_bias", {"all": ...})
        assert_rows_close(grads["a_log"], want_grads["a_log"], A_LOG[IMPLS[impl].platform], "d a_log", {"all": ...})
