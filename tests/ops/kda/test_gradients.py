"""KDA gradients of every implementation against float64 autodiff of the reference math (`oracle.py`), and the
oracle itself against the NumPy reference and float64 finite differences."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda import reference
from hybrax.ops.kda.api import KernelDeltaAttentionConfig
from tests.helpers import TOLERANCE, assert_close, to64
from tests.ops.kda.oracle import (
    ARRAY_NAMES, CASES, as64, loss, our_gradients, oracle, reference_case,
)


# ---------------------------------------------------------------------------------------------------
# The oracle itself


def test_oracle_forward_matches_numpy_reference():
    for case in CASES:
        arrays, options, _, got, _ = reference_case(case)
        assert got[0].dtype == np.float64
        args = [to64(arrays.get(n)) for n in ARRAY_NAMES[:6]]
        fused = {n: to64(arrays[n]) for n in ("a_log", "dt_bias") if n in arrays}
        assert_close(got, reference.kda_reference(*args, **fused, **options), 1e-12, case)


@pytest.mark.parametrize("case", ["packed_empty_segment", "softplus_gate"])
def test_oracle_gradients_match_float64_finite_differences(case):
    """<grad, d> against a central difference along a random direction d, input by input, in float64."""
    arrays, options, weights, _, grads = reference_case(case)
    x = {n: to64(a) for n, a in arrays.items()}
    with jax.enable_x64(True):
        loss_of = jax.jit(functools.partial(loss, oracle(options), as64(weights)))
        for index, name in enumerate(sorted(x)):
            d, eps = np.random.default_rng(200 + index).standard_normal(x[name].shape), 1e-6
            plus, minus = (float(loss_of({**x, name: x[name] + sign * eps * d})) for sign in (1, -1))
            numeric, analytic = (plus - minus) / (2 * eps), float(np.sum(grads[name] * d))
            assert abs(numeric - analytic) <= 1e-7 * max(1.0, abs(analytic)), (name, numeric, analytic)


# ---------------------------------------------------------------------------------------------------
# Every implementation for T > 1 against the oracle (T == 1, xla:single_step and pallas:decode:
# test_pallas_decode.py)

IMPLS = {
    "xla_chunked16": KernelDeltaAttentionConfig("xla", "chunked", chunk_size=16),
    "xla_chunked64": KernelDeltaAttentionConfig("xla", "chunked", chunk_size=64),
    "xla_scan": KernelDeltaAttentionConfig("xla", "scan"),
    "pallas_chunked16": KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=16),  # interpret mode here
    "pallas_chunked128": KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=128),
}


# The fused gate is activated in `prepare`, the same for every implementation and chunk size: chunk 64 runs
# the cases where the chunking matters.
IMPL_CASES = [(case, impl) for case in CASES for impl in IMPLS if not (case == "softplus_gate" and impl.endswith("64"))]
# The Pallas kernels' largest chunk (one chunk of 128 holds all 45 tokens; packed: sequences inside it).
IMPL_CASES += [(case, "pallas_chunked128") for case in ("plain", "packed_empty_segment")]


@pytest.mark.parametrize(("case", "impl"), IMPL_CASES)
def test_gradients_match_float64_oracle(case, impl):
    arrays, options, weights, _, want = reference_case(case)
    got = our_gradients(IMPLS[impl], arrays, options, weights)
    assert got.keys() == want.keys()
    for name in got:
        assert got[name].dtype == arrays[name].dtype
        assert_close(got[name], want[name], TOLERANCE[jnp.float32], f"d{name} {case}/{impl}")


@pytest.mark.parametrize("impl", ["xla_chunked16", "xla_scan", "pallas_chunked16"])
def test_bf16_gradients_match_float64_oracle(impl):
    """bf16 q, k, v (fp32 gates, beta, state); the oracle runs on the same bf16-rounded inputs."""
    arrays, options, weights, _, want = reference_case("gqa_per_head_decay", jnp.bfloat16)
    got = our_gradients(IMPLS[impl], arrays, options, weights)
    for name in got:
        assert got[name].dtype == arrays[name].dtype
        assert_close(got[name], want[name], TOLERANCE[jnp.bfloat16], f"d{name} bf16/{impl}")
