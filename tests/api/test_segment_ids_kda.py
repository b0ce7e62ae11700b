"""segment_ids [B, T] for kimi_delta_attention and kernel_delta_attention, on every backend that takes packed
sequences: outputs, final states (one per run, row-major) and gradients against the float64 reference run by run;
the same numbers as the cu_seqlens form over the flattened rows; under jit with max_segments; the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda.api import KernelDeltaAttentionConfig, kernel_delta_attention
from hybrax.ops.kda.kimi import kimi_delta_attention
from tests.api import fla_reference as ref
from tests.api.segments import IDS, flat_cu_seqlens, num_runs, reference
from tests.helpers import TOLERANCE, assert_close, normal, to64

H, K, V = 2, 16, 8
TOL = TOLERANCE[jnp.float32]
CONFIGS = {
    "xla scan": KernelDeltaAttentionConfig("xla", "scan"),
    "xla chunked": KernelDeltaAttentionConfig("xla", "chunked", chunk_size=16),
    "pallas chunked": KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=16),
}


def inputs(ids: np.ndarray, seed: int = 0) -> dict:
    batch, length = ids.shape
    return {
        "q": normal(seed, (batch, length, H, K)), "k": normal(seed + 1, (batch, length, H, K)) / 3,
        "v": normal(seed + 2, (batch, length, H, V)),
        "g": -jax.nn.softplus(normal(seed + 3, (batch, length, H, K))),
        "beta": jax.nn.sigmoid(normal(seed + 4, (batch, length, H))),
        "h0": normal(seed + 5, (num_runs(ids), H, K, V), scale=0.5),
    }


def kda_reference(x: dict, ids: np.ndarray, xp=np):
    f64 = to64 if xp is np else (lambda a: a)
    return reference(ref.kda, [f64(x[n]) for n in ("q", "k", "v", "g", "beta")], ids, f64(x["h0"]), xp)


@pytest.mark.parametrize("case", IDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_outputs_and_states_per_run(case, name):
    ids, x = IDS[case], inputs(IDS[case])
    o, state = kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                                    output_final_state=True, segment_ids=jnp.asarray(ids), cfg=CONFIGS[name])
    expected_o, expected_state = kda_reference(x, ids)
    assert_close(o, expected_o, TOL, "o")
    assert_close(state, expected_state, TOL, "final_state")


def test_same_as_the_cu_seqlens_form_of_the_flattened_rows():
    ids, x = IDS["B=3"], inputs(IDS["B=3"], 1)
    args = [x[n] for n in ("q", "k", "v", "beta", "g")]
    o, state = kernel_delta_attention(*args, x["h0"], return_state=True, segment_ids=jnp.asarray(ids))
    flat = [a.reshape(1, -1, *a.shape[2:]) for a in args]
    o_cu, state_cu = kernel_delta_attention(*flat, x["h0"], return_state=True,
                                            cu_seqlens=jnp.asarray(flat_cu_seqlens(ids)))
    keep = jnp.asarray(ids >= 0)[..., None, None]
    np.testing.assert_array_equal(o, jnp.where(keep, o_cu.reshape(o.shape), 0))
    np.testing.assert_array_equal(state, state_cu)


@pytest.mark.parametrize("name", ["xla chunked", "pallas chunked"])
def test_gradients_against_the_float64_reference(name):
    ids = IDS["B=3"]
    x = inputs(ids, 2)
    names = ["q", "k", "v", "g", "beta", "h0"]
    weights_o, weights_s = normal(30, (*ids.shape, H, V)), normal(31, (num_runs(ids), H, K, V))

    def loss(args):
        q, k, v, g, beta, h0 = args
        o, state = kimi_delta_attention(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                        segment_ids=jnp.asarray(ids), cfg=CONFIGS[name])
        return jnp.sum(o * weights_o) + jnp.sum(state * weights_s)

    def reference_loss(args):
        o, state = kda_reference(dict(zip(names, args)), ids, xp=jnp)
        return jnp.sum(o * to64(weights_o)) + jnp.sum(state * to64(weights_s))

    args = [x[n] for n in names]
    grads = jax.grad(loss)(args)
    with jax.enable_x64(True):
        want = [np.asarray(w) for w in jax.grad(reference_loss)([jnp.asarray(to64(a)) for a in args])]
    for arg, got, expected in zip(names, grads, want):
        assert_close(got, expected, TOL, f"d{arg}")


def test_under_jit_with_max_segments():
    """Traced ids need max_segments: states past the runs are empty sequences' (their initial state back)."""
    ids, x = IDS["B=2"], inputs(IDS["B=2"], 3)
    runs = num_runs(ids)
    h0 = jnp.concatenate([x["h0"], normal(9, (3, H, K, V))])

    @jax.jit
    def call(ids):
        return kernel_delta_attention(x["q"], x["k"], x["v"], x["beta"], x["g"], h0, use_qk_l2norm=False,
                                      return_state=True, segment_ids=ids, max_segments=runs + 3)

    o, state = call(jnp.asarray(ids))
    expected_o, expected_state = kda_reference(x, ids)
    assert_close(o, expected_o, TOL, "o")
    assert_close(state[:runs], expected_state, TOL, "final_state")
    np.testing.assert_array_equal(state[runs:], h0[runs:])


def test_errors_name_the_argument():
    ids, x = jnp.asarray(IDS["B=2"]), inputs(IDS["B=2"])
    q, k, v, g, beta = x["q"], x["k"], x["v"], x["g"], x["beta"]
    with pytest.raises(ValueError, match="give cu_seqlens or segment_ids, not both"):
        kimi_delta_attention(q[:1], k[:1], v[:1], g[:1], beta[:1], segment_ids=ids[:1], cu_seqlens=jnp.array([0, 7]))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq_len\] \(q's\) = \[2, 7\]"):
        kimi_delta_attention(q, k, v, g, beta, segment_ids=ids[:, :5])
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq_len\] \(query's\) = \[2, 7\]"):
        kernel_delta_attention(q, k, v, beta, g, segment_ids=ids[:, :5])
    with pytest.raises(ValueError, match=r"beta must have shape \[batch, seq_len, \.\.\.\] = \[2, 7, \.\.\.\]"):
        kernel_delta_attention(q, k, v, beta[:, :5], g, segment_ids=ids)
    with pytest.raises(ValueError, match="segment_ids under jit need max_segments"):
        jax.jit(lambda ids: kimi_delta_attention(q, k, v, g, beta, segment_ids=ids)[0])(ids)
    with pytest.raises(ValueError, match="max_segments bounds the runs of segment_ids"):
        kernel_delta_attention(q, k, v, beta, g, max_segments=4)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[num_sequences, num_value_heads"):
        kimi_delta_attention(q, k, v, g, beta, initial_state=x["h0"][:2], segment_ids=ids)
