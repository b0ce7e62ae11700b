"""The deferred decode step (interpret mode on the CPU): chained steps against the float64 reference, pools by
slot with padded requests, what it refuses, and its lowering for an H200."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda.pallas_decode_deferred import Owed, fused_recurrent_decode_deferred, materialize, nothing_owed
from tests.helpers import TOLERANCE, assert_close, lower_for_h200, normal
from tests.ops.kda.test_pallas_decode import (
    B, HV, K, LOWER_BOUND, V, as_pool, decode_inputs, gate_params, reference_steps,
)


def deferred(q, k, v, g, beta, base, owed, gate, a_log=None, dt_bias=None, **kwargs):
    fused = {} if gate == "activated" else {"a_log": a_log, "dt_bias": dt_bias}
    return fused_recurrent_decode_deferred(
        q, k, v, g, beta, base, owed, scale=K**-0.5, lower_bound=LOWER_BOUND if gate == "bounded" else None,
        gate=gate, beta_is_logits=True, block_v=16, interpret=True, **fused, **kwargs,
    )


@pytest.mark.parametrize("gate", ["activated", "softplus", "bounded"])
@pytest.mark.parametrize("gate_width", [K, 1])
def test_chained_steps_match_reference(gate, gate_width):
    """Five steps from a pool owing nothing: every output, and the materialized state after the last."""
    steps = 5
    q, k, v, g, beta = decode_inputs(110, tokens=steps, gate_width=gate_width if gate == "activated" else K)
    if gate == "activated":
        g = jax.nn.log_sigmoid(g)
    a_log, dt_bias = gate_params(111)
    initial = normal(112, (B, HV, K, V))
    base, owed, outputs = initial, nothing_owed(initial), []
    for t in range(steps):
        token = (x[:, t:t + 1] for x in (q, k, v, g, beta))
        o, base, owed = deferred(*token, base, owed, gate, a_log, dt_bias)
        outputs.append(o)
    ref_o, ref_state = reference_steps(q, k, v, g, beta, initial, gate, a_log, dt_bias)
    assert_close((jnp.concatenate(outputs, axis=1), materialize(base, owed)), (ref_o, ref_state),
                 TOLERANCE[jnp.float32])


def test_gates_of_minus_1000_and_bf16_inputs():
    q, k, v, g, beta = decode_inputs(120, tokens=2, dtype=jnp.bfloat16)
    g = jax.nn.log_sigmoid(g).at[1].set(-1000.0)  # request 1 forgets everything at each step
    initial = normal(121, (B, HV, K, V))
    base, owed, outputs = initial, nothing_owed(initial), []
    for t in range(2):
        o, base, owed = deferred(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), base, owed, "activated")
        outputs.append(o)
    assert outputs[0].dtype == jnp.bfloat16
    ref_o, ref_state = reference_steps(q, k, v, g, beta, initial, "activated")
    assert np.all(np.isfinite(np.asarray(materialize(base, owed))))
    assert_close(jnp.concatenate(outputs, axis=1), ref_o, TOLERANCE[jnp.bfloat16])
    assert_close(materialize(base, owed), ref_state, 1e-5, "state")  # fp32 arithmetic on bf16-exact inputs


def test_pool_slots_padding_and_untouched_rows():
    """Two steps by slot, a padded request in each: outputs and states by slot; rows no request names (and the
    padded ones') keep base and owed bit for bit."""
    slots = np.array([5, -1, 2], np.int32)
    q, k, v, g, beta = decode_inputs(130, tokens=2)
    a_log, dt_bias = gate_params(131)
    states = normal(132, (B, HV, K, V))
    pool = as_pool(np.asarray(states), slots, 7, 133)
    owed = Owed(normal(134, (7, HV, K)), normal(135, (7, HV, V)))
    base = pool - owed.key[..., None] * owed.update[..., None, :]  # the pool's states, with something owed
    first_base, first_owed = base, owed
    outputs = []
    for t in range(2):
        o, base, owed = deferred(*(x[:, t:t + 1] for x in (q, k, v, g, beta)), base, owed, "bounded", a_log,
                                 dt_bias, slots=jnp.asarray(slots))
        outputs.append(o)
    o = jnp.concatenate(outputs, axis=1)
    ref_o, ref_states = reference_steps(q, k, v, g, beta, states, "bounded", a_log, dt_bias)
    valid = slots >= 0
    assert_close(o[valid], ref_o[valid], TOLERANCE[jnp.float32])
    assert_close(materialize(base, owed)[slots[valid]], ref_states[valid], TOLERANCE[jnp.float32], "pool")
    assert np.all(np.asarray(o[~valid]) == 0), "a padded request must output zeros"
    untouched = np.setdiff1d(np.arange(7), slots[valid])
    for name, after, before in (("base", base, first_base), ("key", owed.key, first_owed.key),
                                ("update", owed.update, first_owed.update)):
        np.testing.assert_array_equal(np.asarray(after)[untouched], np.asarray(before)[untouched], name)


def test_refuses_several_tokens_and_mismatched_owed():
    q, k, v, g, beta = decode_inputs(140, tokens=2)
    base = normal(141, (B, HV, K, V))
    with pytest.raises(ValueError, match="one token per request, got v of shape"):
        deferred(q, k, v, g, beta, base, nothing_owed(base), "activated")
    token = (x[:, :1] for x in (q, k, v, g, beta))
    with pytest.raises(ValueError, match=rf"owed must hold key \[{B}, {HV}, {K}\]"):
        deferred(*token, base, Owed(jnp.zeros((B, HV, K + 1)), jnp.zeros((B, HV, V))), "activated")


def test_lowers_to_triton():
    sd = jax.ShapeDtypeStruct
    inputs = [sd((4, 1, 2, 128), jnp.bfloat16)] * 3 + [sd((4, 1, 2, 128), jnp.float32), sd((4, 1, 2), jnp.float32)]
    base, slots = sd((6, 2, 128, 128), jnp.float32), sd((4,), jnp.int32)
    owed = Owed(sd((6, 2, 128), jnp.float32), sd((6, 2, 128), jnp.float32))

    def step(q, k, v, g, beta, base, owed, slots, a_log, dt_bias):
        return fused_recurrent_decode_deferred(
            q, k, v, g, beta, base, owed, slots, a_log, dt_bias, scale=0.1, lower_bound=-5.0, gate="bounded",
            beta_is_logits=True, block_v=64,
        )

    text = lower_for_h200(step, *inputs, base, owed, slots, sd((2,), jnp.float32), sd((2, 128), jnp.float32))
    assert text.count("__gpu$xla.gpu.triton") == 1
