"""segment_ids [B, T] for gated_linear_attention and recurrent_attention, on every backend that takes packed
sequences: outputs, final states (one per run, row-major) and gradients against the float64 reference run by run;
the same numbers as the cu_seqlens form over the flattened rows; under jit with max_segments; the errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.recurrent.api import RecurrentAttentionConfig, recurrent_attention
from hybrax.ops.recurrent.gla import gated_linear_attention
from tests.api import fla_reference as ref
from tests.api.segments import IDS, flat_cu_seqlens, num_runs, reference
from tests.helpers import TOLERANCE, assert_close, normal, to64

H, K, V = 2, 8, 4
TOL = TOLERANCE[jnp.float32]
CONFIGS = {
    "xla scan": RecurrentAttentionConfig("xla", "scan"),
    "xla chunked": RecurrentAttentionConfig("xla", "chunked", chunk_size=16),
    "pallas chunked": RecurrentAttentionConfig("pallas", "chunked", chunk_size=16),
}


def inputs(ids: np.ndarray, seed: int = 0) -> dict:
    batch, length = ids.shape
    return {
        "q": normal(seed, (batch, length, H, K)), "k": normal(seed + 1, (batch, length, H, K)),
        "v": normal(seed + 2, (batch, length, H, V)),
        "g": jax.nn.log_sigmoid(normal(seed + 3, (batch, length, H, K)) + 2.0),
        "gv": jax.nn.log_sigmoid(normal(seed + 4, (batch, length, H, V)) + 2.0),
        "h0": normal(seed + 5, (num_runs(ids), H, K, V), scale=0.5),
    }


def gla_reference(x: dict, ids: np.ndarray, reverse: bool = False, xp=np):
    f64 = to64 if xp is np else (lambda a: a)
    run = lambda q, k, v, g, gv, **kw: ref.gla(q, k, v, g, gv, reverse=reverse, **kw)  # noqa: E731
    return reference(run, [f64(x[n]) for n in ("q", "k", "v", "g", "gv")], ids, f64(x["h0"]), xp)


@pytest.mark.parametrize("case", IDS)
@pytest.mark.parametrize("name", CONFIGS)
def test_outputs_and_states_per_run(case, name):
    ids, x = IDS[case], inputs(IDS[case])
    if name.startswith("pallas"):  # its kernel takes no value gate
        x["gv"] = None
    o, state = gated_linear_attention(x["q"], x["k"], x["v"], x["g"], gv=x["gv"], initial_state=x["h0"],
                                      output_final_state=True, segment_ids=jnp.asarray(ids), cfg=CONFIGS[name])
    expected_o, expected_state = gla_reference(x, ids)
    assert_close(o, expected_o, TOL, "o")
    assert_close(state, expected_state, TOL, "final_state")


def test_reverse_runs_each_run_backwards():
    ids, x = IDS["B=2"], inputs(IDS["B=2"], 1)
    o, state = gated_linear_attention(x["q"], x["k"], x["v"], x["g"], gv=x["gv"], initial_state=x["h0"],
                                      output_final_state=True, reverse=True, segment_ids=jnp.asarray(ids))
    expected_o, expected_state = gla_reference(x, ids, reverse=True)
    assert_close(o, expected_o, TOL, "o")
    assert_close(state, expected_state, TOL, "final_state")


def test_same_as_the_cu_seqlens_form_of_the_flattened_rows():
    ids, x = IDS["B=3"], inputs(IDS["B=3"], 2)
    o, state = gated_linear_attention(x["q"], x["k"], x["v"], x["g"], initial_state=x["h0"], output_final_state=True,
                                      segment_ids=jnp.asarray(ids))
    flat = {n: x[n].reshape(1, -1, *x[n].shape[2:]) for n in ("q", "k", "v", "g")}
    o_cu, state_cu = gated_linear_attention(flat["q"], flat["k"], flat["v"], flat["g"], initial_state=x["h0"],
                                            output_final_state=True, cu_seqlens=jnp.asarray(flat_cu_seqlens(ids)))
    keep = jnp.asarray(ids >= 0)[..., None, None]
    np.testing.assert_array_equal(o, jnp.where(keep, o_cu.reshape(o.shape), 0))
    np.testing.assert_array_equal(state, state_cu)


@pytest.mark.parametrize("name", ["xla scan", "xla chunked"])
def test_gradients_against_the_float64_reference(name):
    ids = IDS["B=3"]
    x = inputs(ids, 3)
    names = ["q", "k", "v", "g", "gv", "h0"]
    weights_o, weights_s = normal(30, (*ids.shape, H, V)), normal(31, (num_runs(ids), H, K, V))

    def loss(args):
        q, k, v, g, gv, h0 = args
        o, state = gated_linear_attention(q, k, v, g, gv=gv, initial_state=h0, output_final_state=True,
                                          segment_ids=jnp.asarray(ids), cfg=CONFIGS[name])
        return jnp.sum(o * weights_o) + jnp.sum(state * weights_s)

    def reference_loss(args):
        o, state = gla_reference(dict(zip(names, args)), ids, xp=jnp)
        return jnp.sum(o * to64(weights_o)) + jnp.sum(state * to64(weights_s))

    args = [x[n] for n in names]
    grads = jax.grad(loss)(args)
    with jax.enable_x64(True):
        want = [np.asarray(w) for w in jax.grad(reference_loss)([jnp.asarray(to64(a)) for a in args])]
    for arg, got, expected in zip(names, grads, want):
        assert_close(got, expected, TOL, f"d{arg}")


def test_under_jit_with_max_segments_and_per_row_g_gamma():
    """Traced ids need max_segments: states past the runs are empty sequences' (their initial state back).
    recurrent_attention's per-row g_gamma [B, H] follows each token to its row."""
    ids, x = IDS["B=2"], inputs(IDS["B=2"], 4)
    runs = num_runs(ids)
    h0 = jnp.concatenate([x["h0"], normal(9, (2, H, K, V))])
    g_gamma = jax.nn.log_sigmoid(normal(10, (2, H)) + 1.0)

    @jax.jit
    def call(ids):
        return recurrent_attention(x["q"], x["k"], x["v"], x["g"][..., 0], g_gamma, None, x["gv"], h0,
                                   segment_ids=ids, max_segments=runs + 2, return_state=True)

    o, state = call(jnp.asarray(ids))
    per_token = x["g"][..., 0] + g_gamma[:, None, :]
    expected_o, expected_state = gla_reference(
        {**x, "g": jnp.broadcast_to(per_token[..., None], x["g"].shape)}, ids)
    assert_close(o, expected_o, TOL, "o")
    assert_close(state[:runs], expected_state, TOL, "final_state")
    np.testing.assert_array_equal(state[runs:], h0[runs:])


def test_errors_name_the_argument():
    ids, x = jnp.asarray(IDS["B=2"]), inputs(IDS["B=2"])
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    with pytest.raises(ValueError, match="give cu_seqlens or segment_ids, not both"):
        gated_linear_attention(q[:1], k[:1], v[:1], g[:1], segment_ids=ids[:1], cu_seqlens=jnp.array([0, 7]))
    with pytest.raises(ValueError, match=r"segment_ids must have shape \[batch, seq_len\] \(q's\) = \[2, 7\]"):
        gated_linear_attention(q, k, v, g, segment_ids=ids[:, :5])
    with pytest.raises(ValueError, match=r"k must have shape \[batch, seq_len, \.\.\.\] = \[2, 7, \.\.\.\]"):
        gated_linear_attention(q, k[:, :5], v, g, segment_ids=ids)
    with pytest.raises(ValueError, match="segment_ids under jit need max_segments"):
        jax.jit(lambda ids: gated_linear_attention(q, k, v, g, segment_ids=ids)[0])(ids)
    with pytest.raises(ValueError, match="max_segments bounds the runs of segment_ids"):
        gated_linear_attention(q, k, v, g, max_segments=4)
    with pytest.raises(ValueError, match=r"initial_state must have shape \[num_sequences, num_heads"):
        gated_linear_attention(q, k, v, g, initial_state=x["h0"][:2], segment_ids=ids)
