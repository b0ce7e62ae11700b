"""kda_decode_pool (XLA and Pallas-interpret) and kda_prefill_pool against the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda import reference
from hybrax.serving import KdaDecodePoolConfig, kda_decode_pool, kda_prefill_pool
from tests.helpers import TOLERANCE, assert_close, normal, to64

H, HV, K, V = 1, 2, 16, 32
SLOTS = 7
TOL = TOLERANCE[jnp.float32]
GATES = {  # gate -> keyword arguments of both the op and the reference, besides a_log and dt_bias
    "activated": {},
    "softplus": {},
    "bounded": {"lower_bound": -5.0},
}
PLATFORMS = ["xla", "pallas"]


def step_inputs(seed, batch, tokens, gate="bounded"):
    q, k = normal(seed, (batch, tokens, H, K)), normal(seed + 1, (batch, tokens, H, K))
    v = normal(seed + 2, (batch, tokens, HV, V))
    g = normal(seed + 3, (batch, tokens, HV, K))
    g = jax.nn.log_sigmoid(g) if gate == "activated" else g
    beta = normal(seed + 4, (batch, tokens, HV))
    return q, k, v, g, beta


def gate_kwargs(seed, gate):
    if gate == "activated":
        return {}
    return {"a_log": normal(seed, (HV,), scale=0.5), "dt_bias": normal(seed + 1, (HV, K)), **GATES[gate]}


def reference_run(inputs, states, kwargs, cu_seqlens=None):
    """(o, final states) of the float64 reference from the given starting states, beta as logits."""
    q, k, v, g, beta = (to64(x) for x in inputs)
    kwargs = {name: to64(value) if name != "lower_bound" else value for name, value in kwargs.items()}
    return reference.kda_reference(q, k, v, beta, g, to64(states), beta_is_logits=True, cu_seqlens=cu_seqlens,
                                   **kwargs)


def pool_with(states, slots, seed, v_first=False):
    pool = np.array(normal(seed, (SLOTS, HV, K, V)))
    for row, slot in enumerate(slots):
        if slot >= 0:
            pool[slot] = states[row]
    return jnp.asarray(np.swapaxes(pool, 2, 3) if v_first else pool)


def k_first(pool, v_first):
    return np.swapaxes(np.asarray(pool), 2, 3) if v_first else np.asarray(pool)


def decode(inputs, pool, slots, gate, kwargs, platform, **options):
    return kda_decode_pool(*inputs, pool, jnp.asarray(slots), gate=gate, beta_is_logits=True, platform=platform,
                           **kwargs, **options)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("gate", list(GATES))
@pytest.mark.parametrize("v_first", [False, True])
def test_decode_by_slot(platform, gate, v_first):
    slots = np.array([4, -1, 0, 6], np.int32)
    inputs = step_inputs(10, len(slots), 1, gate)
    kwargs = gate_kwargs(11, gate)
    states = normal(12, (len(slots), HV, K, V))
    pool = pool_with(np.asarray(states), slots, 13, v_first)
    o, new_pool = jax.jit(lambda *a: decode(a, pool, slots, gate, kwargs, platform, state_v_first=v_first))(*inputs)
    ref_o, ref_states = reference_run(inputs, states, kwargs)
    valid = slots >= 0
    assert_close(o[valid], ref_o[valid], TOL)
    assert np.all(np.asarray(o[~valid]) == 0), "padded rows output zeros"
    after, before = k_first(new_pool, v_first), k_first(pool, v_first)
    assert_close(after[slots[valid]], ref_states[valid], TOL, "pool rows")
    untouched = np.setdiff1d(np.arange(SLOTS), slots)
    np.testing.assert_array_equal(after[untouched], before[untouched])


@pytest.mark.parametrize("platform, cfg", [
    ("xla", None), ("pallas", None), ("pallas", KdaDecodePoolConfig(block_v=16, num_warps=2, block_k=8)),
])
def test_speculative_tokens_keep_their_states(platform, cfg):
    """The state after each token lands in its token slot (also through a key-blocked Pallas launch)."""
    slots = np.array([1, -1, 3], np.int32)
    token_slots = np.array([[1, 2], [5, 5], [-1, 4]], np.int32)  # the padded row's 5 is never written
    inputs = step_inputs(20, 3, 2)
    kwargs = gate_kwargs(21, "bounded")
    states = normal(22, (3, HV, K, V))
    pool = pool_with(np.asarray(states), slots, 23)
    o, new_pool = decode(inputs, pool, slots, "bounded", kwargs, platform, token_slots=jnp.asarray(token_slots),
                         cfg=cfg)
    new_pool = np.asarray(new_pool)
    for row in (0, 2):
        for t in range(2):
            piece = tuple(x[row:row + 1, :t + 1] for x in inputs)
            ref_o, ref_state = reference_run(piece, states[row:row + 1], kwargs)
            if token_slots[row, t] >= 0:
                assert_close(new_pool[token_slots[row, t]], ref_state[0], TOL, f"state of token {t}")
        assert_close(o[row], ref_o[0], TOL)
    assert np.all(np.asarray(o[1]) == 0)
    untouched = [0, 3, 5, 6]  # 3 is read but not written (token_slots name no row 3)
    np.testing.assert_array_equal(new_pool[untouched], np.asarray(pool)[untouched])


@pytest.mark.parametrize("v_first", [False, True])
def test_prefill_then_decode_hands_over_exactly(v_first):
    """Packed prefill from the pool (one fresh request), then decode steps, equal one long sequence."""
    lengths, slots = [5, 0, 3], np.array([2, 5, 0], np.int32)
    has_initial = np.array([True, True, False])
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    prompt = step_inputs(30, 1, int(cu_seqlens[-1]) + 2)  # two tokens past the end belong to nobody
    kwargs = gate_kwargs(31, "softplus")
    states = normal(32, (3, HV, K, V))
    pool = pool_with(np.asarray(states), slots, 33, v_first)
    o, pool_after = kda_prefill_pool(
        *prompt, pool, jnp.asarray(slots), has_initial_state=jnp.asarray(has_initial),
        cu_seqlens=jnp.asarray(cu_seqlens), gate="softplus", beta_is_logits=True, state_v_first=v_first,
        platform="xla", **kwargs,
    )
    starts = np.where(has_initial[:, None, None, None], np.asarray(states), 0.0)
    ref_o, ref_states = reference_run(prompt, starts, kwargs, cu_seqlens)
    assert_close(o, ref_o, TOL)
    assert_close(k_first(pool_after, v_first)[slots], ref_states, TOL, "prefill states")

    step = step_inputs(34, 3, 1)
    o_step, pool_next = decode(step, pool_after, slots, "softplus", kwargs, "pallas", state_v_first=v_first)
    ref_o_step, ref_next = reference_run(step, ref_states, kwargs)
    assert_close((o_step, k_first(pool_next, v_first)[slots]), (ref_o_step, ref_next), TOL)


def test_prefill_padded_sequence_reads_and_writes_nothing():
    slots = np.array([3, -1], np.int32)
    prompt = step_inputs(40, 2, 4, "activated")
    states = normal(41, (2, HV, K, V))
    pool = pool_with(np.asarray(states), slots, 42)
    o, pool_after = kda_prefill_pool(*prompt, pool, jnp.asarray(slots), beta_is_logits=True, platform="xla")
    ref_o, ref_states = reference_run(prompt, states, {})
    assert_close((o[0], pool_after[3]), (ref_o[0], ref_states[0]), TOL)
    assert np.all(np.asarray(o[1]) == 0)
    rest = np.setdiff1d(np.arange(SLOTS), [3])
    np.testing.assert_array_equal(np.asarray(pool_after)[rest], np.asarray(pool)[rest])


@pytest.mark.parametrize(
    "change, message",
    [
        ({"slots": jnp.zeros((3,), jnp.int32)}, r"slots must have shape \[batch\]"),
        ({"slots": jnp.zeros((2,), jnp.float32)}, "slots must be an integer array"),
        ({"pool": jnp.zeros((SLOTS, HV, K, V), jnp.bfloat16)}, "pool must be float32"),
        ({"pool": jnp.zeros((SLOTS, HV, V, K + 1))}, r"pool must have shape"),
        ({"gate": "softplus"}, "needs a_log"),
        ({"lower_bound": -1.0}, "lower_bound"),
        ({"gate": "sigmoid"}, "gate must be one of"),
    ],
)
def test_invalid_arguments_are_named(change, message):
    q, k, v, g, beta = step_inputs(50, 2, 1, "activated")
    arguments = {"pool": jnp.zeros((SLOTS, HV, K, V)), "slots": jnp.zeros((2,), jnp.int32), "gate": "activated"}
    arguments.update(change)
    pool, slots = arguments.pop("pool"), arguments.pop("slots")
    with pytest.raises(ValueError, match=message):
        kda_decode_pool(q, k, v, g, beta, pool, slots, platform="xla", **arguments)


def test_autotune_inputs_have_distinct_slots():
    """Candidates are timed on slots that cannot race: distinct rows, -1 past the pool's end."""
    from hybrax.serving import KdaDecodePool

    kernel = KdaDecodePool()
    inputs = step_inputs(60, 4, 1, "activated")
    problem = kernel.prepare(*inputs, jnp.zeros((3, HV, K, V)), jnp.zeros((4,), jnp.int32),
                             token_slots=jnp.zeros((4, 1), jnp.int32))
    tuned = kernel.autotune_problem(kernel.invocation(problem, "pallas"), jax.random.key(0))
    np.testing.assert_array_equal(tuned.slots, [0, 1, 2, -1])
    np.testing.assert_array_equal(tuned.token_slots[:, 0], [0, 1, 2, -1])
