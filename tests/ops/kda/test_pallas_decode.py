"""The Pallas KDA decode kernel (interpret mode on the CPU) against the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda import reference
from hybrax.ops.kda.api import KernelDeltaAttentionConfig
from hybrax.ops.kda.decode import pallas_gpu as pallas_decode
from hybrax.ops.kda.decode.pallas_gpu import MAX_UNROLLED_TOKENS, fused_recurrent_decode
from tests.helpers import TOLERANCE, assert_close, lower_for_h200, normal, to64
from tests.ops.kda.oracle import loss_weights, oracle_outputs_and_gradients, our_gradients, ours

B, H, HV, K, V = 3, 1, 2, 16, 32
LOWER_BOUND = -5.0
GATE_ARGS = {  # gate form -> reference keyword arguments besides a_log and dt_bias
    "softplus": {},
    "bounded": {"lower_bound": LOWER_BOUND},
}


def decode_inputs(seed, batch=B, tokens=1, dtype=jnp.float32, gate_width=K):
    q = normal(seed, (batch, tokens, H, K), dtype)
    k = normal(seed + 1, (batch, tokens, H, K), dtype)
    v = normal(seed + 2, (batch, tokens, HV, V), dtype)
    g = normal(seed + 3, (batch, tokens, HV, gate_width))
    beta = normal(seed + 4, (batch, tokens, HV))
    return q, k, v, g, beta


def gate_params(seed):
    return normal(seed, (HV,), scale=0.5), normal(seed + 1, (HV, K))


def reference_steps(q, k, v, g, beta, state, gate, a_log=None, dt_bias=None):
    """(o, final state) of the float64 reference; g raw for the fused gates, beta logits."""
    kwargs = {}
    if gate != "activated":
        kwargs = {"a_log": to64(a_log), "dt_bias": to64(dt_bias), **GATE_ARGS[gate]}
    return reference.kda_reference(
        to64(q), to64(k), to64(v), to64(beta), to64(g), to64(state), beta_is_logits=True, **kwargs
    )


def run_kernel(q, k, v, g, beta, state, gate, a_log=None, dt_bias=None, **kwargs):
    fused = {} if gate == "activated" else {"a_log": a_log, "dt_bias": dt_bias}
    return fused_recurrent_decode(
        q, k, v, g, beta, state, scale=K**-0.5, lower_bound=LOWER_BOUND if gate == "bounded" else None,
        gate=gate, beta_is_logits=True, block_v=16, interpret=True, **fused, **kwargs,
    )


@pytest.mark.parametrize("gate", ["activated", "softplus", "bounded"])
@pytest.mark.parametrize("tokens", [1, 3, MAX_UNROLLED_TOKENS + 2])  # the last in the kernel's fori_loop
def test_steps_match_reference(gate, tokens):
    q, k, v, g, beta = decode_inputs(10, tokens=tokens)
    if gate == "activated":
        g = jax.nn.log_sigmoid(g)
    a_log, dt_bias = gate_params(20)
    state = normal(30, (B, HV, K, V))
    out = run_kernel(q, k, v, g, beta, state, gate, a_log, dt_bias)
    assert_close(out, reference_steps(q, k, v, g, beta, state, gate, a_log, dt_bias), TOLERANCE[jnp.float32])


def test_per_head_decay_and_bf16_inputs():
    q, k, v, g, beta = decode_inputs(40, dtype=jnp.bfloat16, gate_width=1)
    g = jax.nn.log_sigmoid(g)
    state = normal(41, (B, HV, K, V))
    o, new_state = run_kernel(q, k, v, g, beta, state, "activated")
    assert o.dtype == jnp.bfloat16
    ref_o, ref_state = reference_steps(q, k, v, g, beta, state, "activated")
    assert_close(o, ref_o, TOLERANCE[jnp.bfloat16])
    assert_close(new_state, ref_state, 1e-5, "state")  # fp32 arithmetic on bf16-exact inputs


def test_chained_steps_equal_one_sequence():
    """Eight decode calls, each feeding its state to the next, follow the whole sequence's reference."""
    steps = 8
    q, k, v, g, beta = decode_inputs(50, tokens=steps)
    a_log, dt_bias = gate_params(51)
    state = initial = normal(52, (B, HV, K, V))
    outputs = []
    for t in range(steps):
        piece = slice(t, t + 1)
        o, state = run_kernel(q[:, piece], k[:, piece], v[:, piece], g[:, piece], beta[:, piece], state,
                              "bounded", a_log, dt_bias)
        outputs.append(o)
    ref_o, ref_state = reference_steps(q, k, v, g, beta, initial, "bounded", a_log, dt_bias)
    assert_close((jnp.concatenate(outputs, axis=1), state), (ref_o, ref_state), TOLERANCE[jnp.float32])


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("gate_width", [K, 1])
def test_layouts_and_gate_widths_match_reference(v_first, gate_width):
    """Three tokens through either state layout with a per-key or per-head gate (dt_bias per key either way)."""
    q, k, v, g, beta = decode_inputs(70, tokens=3, gate_width=gate_width)
    a_log, dt_bias = gate_params(71)
    states = normal(72, (B, HV, K, V))
    state = jnp.swapaxes(states, 2, 3) if v_first else states
    o, new_state = run_kernel(q, k, v, g, beta, state, "bounded", a_log, dt_bias, state_v_first=v_first)
    new_state = jnp.swapaxes(new_state, 2, 3) if v_first else new_state
    ref = reference_steps(q, k, v, g, beta, states, "bounded", a_log, dt_bias)
    assert_close((o, new_state), ref, TOLERANCE[jnp.float32])


def as_pool(states, slots, num_slots, seed, v_first=False):
    """A pool of random rows with states[b] at slots[b] (V-first: [slots, HV, V, K])."""
    pool = np.array(normal(seed, (num_slots, HV, K, V)))
    for b, slot in enumerate(slots):
        if slot >= 0:
            pool[slot] = states[b]
    return jnp.asarray(np.swapaxes(pool, 2, 3) if v_first else pool)


@pytest.mark.parametrize("v_first", [False, True])
def test_pool_slots_padding_and_untouched_rows(v_first):
    slots = np.array([5, -1, 2], np.int32)
    q, k, v, g, beta = decode_inputs(60)
    a_log, dt_bias = gate_params(61)
    states = normal(62, (B, HV, K, V))
    pool = as_pool(np.asarray(states), slots, 7, 63, v_first)
    o, new_pool = run_kernel(q, k, v, g, beta, pool, "softplus", a_log, dt_bias, slots=jnp.asarray(slots),
                             state_v_first=v_first)
    ref_o, ref_states = reference_steps(q, k, v, g, beta, states, "softplus", a_log, dt_bias)
    new_pool = np.swapaxes(np.asarray(new_pool), 2, 3) if v_first else np.asarray(new_pool)
    valid = slots >= 0
    assert_close(o[valid], ref_o[valid], TOLERANCE[jnp.float32])
    assert_close(new_pool[slots[valid]], ref_states[valid], TOLERANCE[jnp.float32], "pool")
    assert np.all(np.asarray(o[~valid]) == 0), "a padded request must output zeros"
    untouched = np.setdiff1d(np.arange(7), slots[valid])
    before = np.swapaxes(np.asarray(pool), 2, 3) if v_first else np.asarray(pool)
    np.testing.assert_array_equal(new_pool[untouched], before[untouched])


def test_token_slots_keep_every_tokens_state():
    """Speculative decoding: the state after token t lands in token_slots[b, t]; -1 writes nothing."""
    tokens = 3
    slots = np.array([0, 4, -1], np.int32)
    token_slots = np.array([[1, 2, 3], [5, -1, 6], [7, 7, 7]], np.int32)
    q, k, v, g, beta = decode_inputs(70, tokens=tokens)
    a_log, dt_bias = gate_params(71)
    states = normal(72, (B, HV, K, V))
    pool = as_pool(np.asarray(states), slots, 8, 73)
    o, new_pool = run_kernel(q, k, v, g, beta, pool, "bounded", a_log, dt_bias, slots=jnp.asarray(slots),
                             token_slots=jnp.asarray(token_slots))
    new_pool, pool = np.asarray(new_pool), np.asarray(pool)
    written = set()
    for b in (0, 1):
        for t in range(tokens):
            if token_slots[b, t] < 0:
                continue
            piece = (slice(b, b + 1), slice(0, t + 1))
            ref_o, ref_state = reference_steps(
                *(x[piece] for x in (q, k, v, g, beta)), states[b:b + 1], "bounded", a_log, dt_bias
            )
            assert_close(new_pool[token_slots[b, t]], ref_state[0], TOLERANCE[jnp.float32], f"state {b},{t}")
            written.add(int(token_slots[b, t]))
        assert_close(o[b], ref_o[0], TOLERANCE[jnp.float32])
    untouched = sorted(set(range(8)) - written)  # includes the read slots 0 and 4 and padded row's 7
    np.testing.assert_array_equal(new_pool[untouched], pool[untouched])
    assert np.all(np.asarray(o[2]) == 0)


def hard_gates(g):
    """Log decays of -1000: request 1 forgets everything at its first token, request 2 half its keys at its last."""
    return g.at[1, 0].set(-1000.0).at[2, -1, :, : K // 2].set(-1000.0)


def raw_gates_for_minus_1000(g):
    """Raw inputs of the bounded gate -1000 * sigmoid(exp(a_log) * (g + dt_bias)): -12 on half the keys keeps
    those log decays near -0.01; the others land between about -100 and -1000 (the state forgets them)."""
    return g.at[..., : K // 2].set(-12.0)


@pytest.mark.parametrize("gate", ["activated", "bounded"])
@pytest.mark.parametrize("tokens", [1, MAX_UNROLLED_TOKENS + 2])  # unrolled, and the kernel's fori_loop
def test_gates_of_minus_1000(gate, tokens):
    """-1000 must underflow exp(g) to 0, never overflow: activated gates, and the bounded gate's lower_bound."""
    q, k, v, g, beta = decode_inputs(90, tokens=tokens)
    a_log, dt_bias = gate_params(91)
    state = normal(92, (B, HV, K, V))
    if gate == "activated":
        g, lower_bound, fused = hard_gates(jax.nn.log_sigmoid(g)), None, {}
    else:
        g, lower_bound, fused = raw_gates_for_minus_1000(g), -1000.0, {"a_log": a_log, "dt_bias": dt_bias}
    out = fused_recurrent_decode(
        q, k, v, g, beta, state, scale=K**-0.5, lower_bound=lower_bound, gate=gate, beta_is_logits=True, block_v=16,
        interpret=True, **fused,
    )
    want = reference.kda_reference(
        *(to64(x) for x in (q, k, v, beta, g, state)), beta_is_logits=True, lower_bound=lower_bound,
        **{name: to64(x) for name, x in fused.items()},
    )
    assert_close(out, want, TOLERANCE[jnp.float32])


SINGLE_TOKEN = {
    "xla_single_step": KernelDeltaAttentionConfig("xla", "single_step"),
    "pallas_decode": KernelDeltaAttentionConfig("pallas", "decode"),  # the kernel in interpret mode here
}


def single_token_case(gate):
    """(arrays, options) of kernel_delta_attention at T == 1 (HV = 2 H, beta logits)."""
    q, k, v, g, beta = decode_inputs(80)
    a_log, dt_bias = gate_params(81)
    arrays = dict(q=q, k=k, v=v, beta=beta, decay=g, initial_state=normal(82, (B, HV, K, V)))
    if gate == "activated_minus_1000":
        return {**arrays, "decay": hard_gates(jax.nn.log_sigmoid(g))}, {"beta_is_logits": True}
    lower_bound = LOWER_BOUND
    if gate == "bounded_minus_1000":
        arrays["decay"], lower_bound = raw_gates_for_minus_1000(g), -1000.0
    return {**arrays, "a_log": a_log, "dt_bias": dt_bias}, {"beta_is_logits": True, "lower_bound": lower_bound}


@pytest.mark.parametrize("gate", ["bounded", "activated_minus_1000", "bounded_minus_1000"])
@pytest.mark.parametrize("impl", SINGLE_TOKEN)
def test_single_token_paths_match_float64_oracle(impl, gate):
    """kernel_delta_attention's T == 1 paths: output and final state, and the gradients w.r.t. every input
    (q, k, v, beta, gate, initial state, a_log, dt_bias) of a loss of both, against float64 autodiff of the
    oracle (oracle.kda64). pallas:decode's backward is the XLA step's VJP: this checks its wiring."""
    arrays, options = single_token_case(gate)
    weights = loss_weights(arrays)
    want_outputs, want = oracle_outputs_and_gradients(arrays, options, weights)
    assert_close(jax.jit(ours(SINGLE_TOKEN[impl], options))(arrays), want_outputs, TOLERANCE[jnp.float32])
    got = our_gradients(SINGLE_TOKEN[impl], arrays, options, weights)
    assert got.keys() == want.keys()
    for name in got:
        assert_close(got[name], want[name], TOLERANCE[jnp.float32], f"d{name} {gate}/{impl}")


@pytest.mark.parametrize("impl", SINGLE_TOKEN)
def test_single_token_paths_under_vmap(impl):
    """vmapped over a leading axis (the kernel gets a batch dimension of its grid) against each example alone."""
    arrays, options = single_token_case("bounded")
    stacked = {name: jnp.stack([x, 0.5 * x]) if name != "a_log" else jnp.stack([x, x]) for name, x in arrays.items()}
    run = ours(SINGLE_TOKEN[impl], options)
    batched = jax.jit(jax.vmap(run))(stacked)
    for i in range(2):
        want = run({name: x[i] for name, x in stacked.items()})
        assert_close(jax.tree.map(lambda x: x[i], batched), want, 1e-6, f"example {i}")


def test_unsupported_head_sizes_are_declined():
    assert pallas_decode.tile_reason(100, 128) is not None
    assert pallas_decode.tile_reason(128, 128) is None


@pytest.mark.parametrize("launch", [{"block_v": 24}, {"block_v": 0}])
def test_launch_blocks_must_be_powers_of_two(launch):
    q, k, v, g, beta = decode_inputs(80)
    with pytest.raises(ValueError, match=f"{next(iter(launch))} must be a power of two"):
        fused_recurrent_decode(q, k, v, g, beta, normal(81, (B, HV, K, V)), scale=1.0, interpret=True, **launch)


@pytest.mark.parametrize("v_first", [False, True])
@pytest.mark.parametrize("use_qk_l2norm", [False, True])
@pytest.mark.parametrize("tokens", [1, MAX_UNROLLED_TOKENS + 2])
def test_lowers_to_triton(v_first, use_qk_l2norm, tokens):
    """Interpret mode runs any jnp; the Triton lowering takes stacks and splits only of two along the last
    axis, and its scalars apart from 0-d tensors: the kernel lowers for an H200 in every shape of its code."""
    sd = jax.ShapeDtypeStruct
    inputs = [sd((4, tokens, 2, 128), jnp.bfloat16)] * 3 + [sd((4, tokens, 2, 128), jnp.float32),
                                                            sd((4, tokens, 2), jnp.float32)]
    pool, slots, token_slots = sd((6, 2, 128, 128), jnp.float32), sd((4,), jnp.int32), sd((4, tokens), jnp.int32)
    gate_params = sd((2,), jnp.float32), sd((2, 128), jnp.float32)

    def step(q, k, v, g, beta, pool, slots, token_slots, a_log, dt_bias):
        return fused_recurrent_decode(
            q, k, v, g, beta, pool, slots, token_slots, a_log, dt_bias, scale=0.1, lower_bound=-5.0,
            gate="bounded", beta_is_logits=True, use_qk_l2norm=use_qk_l2norm, state_v_first=v_first, block_v=64,
        )

    text = lower_for_h200(step, *inputs, pool, slots, token_slots, *gate_params)
    assert text.count("__gpu$xla.gpu.triton") == 1
