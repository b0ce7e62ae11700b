"""kda_decode_pool (XLA and Pallas-interpret) and kda_prefill_pool against the float64 reference."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda import reference
from hybrax.serving import KdaDecodePool, KdaDecodePoolConfig, kda_decode_pool, kda_prefill_pool, kda_pool
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


def step_inputs(seed, batch, tokens, gate="bounded", dtype=jnp.float32):
    q, k = normal(seed, (batch, tokens, H, K)), normal(seed + 1, (batch, tokens, H, K))
    v = normal(seed + 2, (batch, tokens, HV, V))
    g = normal(seed + 3, (batch, tokens, HV, K))
    g = jax.nn.log_sigmoid(g) if gate == "activated" else g
    beta = normal(seed + 4, (batch, tokens, HV))
    return tuple(x.astype(dtype) for x in (q, k, v, g, beta))


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
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_decode_by_slot(platform, gate, v_first, dtype):
    """bf16 inputs keep an fp32 pool; the reference runs in float64 on the bf16-rounded inputs."""
    slots = np.array([4, -1, 0, 6], np.int32)
    inputs = step_inputs(10, len(slots), 1, gate, dtype)
    kwargs = gate_kwargs(11, gate)
    states = normal(12, (len(slots), HV, K, V))
    pool = pool_with(np.asarray(states), slots, 13, v_first)
    o, new_pool = jax.jit(lambda *a: decode(a, pool, slots, gate, kwargs, platform, state_v_first=v_first))(*inputs)
    assert o.dtype == dtype and new_pool.dtype == jnp.float32
    ref_o, ref_states = reference_run(inputs, states, kwargs)
    valid = slots >= 0
    assert_close(o[valid], ref_o[valid], TOLERANCE[dtype])
    assert np.all(np.asarray(o[~valid]) == 0), "padded rows output zeros"
    after, before = k_first(new_pool, v_first), k_first(pool, v_first)
    assert_close(after[slots[valid]], ref_states[valid], TOLERANCE[dtype], "pool rows")
    untouched = np.setdiff1d(np.arange(SLOTS), slots)
    np.testing.assert_array_equal(after[untouched], before[untouched])


@pytest.mark.parametrize("platform, cfg", [
    ("xla", None), ("pallas", None), ("pallas", KdaDecodePoolConfig(block_v=16, num_warps=2)),
])
def test_speculative_tokens_keep_their_states(platform, cfg):
    """The state after each token lands in its token slot (also through a Pallas launch of 16 columns)."""
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


@pytest.mark.parametrize("v_first, dtype", [(False, jnp.float32), (True, jnp.float32), (False, jnp.bfloat16)])
def test_prefill_then_decode_hands_over_exactly(v_first, dtype):
    """Packed prefill from the pool (one fresh request), then decode steps, equal one long sequence; bf16 inputs
    keep an fp32 pool."""
    lengths, slots = [5, 0, 3], np.array([2, 5, 0], np.int32)
    has_initial = np.array([True, True, False])
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    prompt = step_inputs(30, 1, int(cu_seqlens[-1]) + 2, dtype=dtype)  # two tokens past the end belong to nobody
    kwargs = gate_kwargs(31, "softplus")
    states = normal(32, (3, HV, K, V))
    pool = pool_with(np.asarray(states), slots, 33, v_first)
    o, pool_after = kda_prefill_pool(
        *prompt, pool, jnp.asarray(slots), has_initial_state=jnp.asarray(has_initial),
        cu_seqlens=jnp.asarray(cu_seqlens), gate="softplus", beta_is_logits=True, state_v_first=v_first,
        platform="xla", **kwargs,
    )
    starts = np.where(has_initial[:, None, None, None], np.asarray(states), 0.0)
    assert o.dtype == dtype and pool_after.dtype == jnp.float32
    ref_o, ref_states = reference_run(prompt, starts, kwargs, cu_seqlens)
    tol = TOLERANCE[dtype]
    assert_close(o, ref_o, tol)
    assert_close(k_first(pool_after, v_first)[slots], ref_states, tol, "prefill states")

    step = step_inputs(34, 3, 1, dtype=dtype)
    o_step, pool_next = decode(step, pool_after, slots, "softplus", kwargs, "pallas", state_v_first=v_first)
    ref_o_step, ref_next = reference_run(step, ref_states, kwargs)
    assert_close((o_step, k_first(pool_next, v_first)[slots]), (ref_o_step, ref_next), tol)


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


OUTSIDE = r"must be -1 \(none\) or a row in \[0, num_slots = 7\), got "
TWICE = r"must name each row at most once \(two writes to one row would race\), got "
DECODE_BAD = [
    ({"slots": jnp.zeros((3,), jnp.int32)}, r"slots must have shape \[batch\]"),
    ({"slots": jnp.zeros((2,), jnp.float32)}, "slots must be an integer array"),
    ({"slots": jnp.array([0, SLOTS], jnp.int32)}, "slots " + OUTSIDE + r"\[7\]"),
    ({"slots": jnp.array([-2, 0], jnp.int32)}, "slots " + OUTSIDE + r"\[-2\]"),
    ({"slots": jnp.array([3, 3], jnp.int32)}, "slots " + TWICE + r"\[3\] more than once"),
    ({"token_slots": jnp.array([[1], [SLOTS]], jnp.int32)}, "token_slots " + OUTSIDE + r"\[7\]"),
    ({"token_slots": jnp.array([[4], [4]], jnp.int32)}, "token_slots " + TWICE + r"\[4\]"),
    ({"pool": jnp.zeros((SLOTS, HV, K, V), jnp.bfloat16)}, "pool must be float32"),
    ({"pool": jnp.zeros((SLOTS, HV, V, K + 1))}, r"pool must have shape"),
    ({"pool": jnp.zeros((HV, K, V))}, r"pool must have shape \[num_slots, num_value_heads, head_dim, v_head_dim\]"),
    ({"g": jnp.zeros((2, 1, HV))}, r"g must have shape \[batch, tokens, num_value_heads, head_dim or 1\] \(4 dims"),
    ({"gate": "softplus"}, "needs a_log"),
    ({"gate": "softplus", "a_log": jnp.zeros((HV,), jnp.int32)}, "a_log must be a floating-point array, got dtype int"),
    ({"gate": "softplus", "a_log": jnp.zeros((HV,)), "dt_bias": jnp.zeros((HV, K), jnp.int32)},
     "dt_bias must be a floating-point array, got dtype int32"),
    ({"gate": "bounded", "a_log": jnp.zeros((HV,)), "lower_bound": 1.0}, r"lower_bound must be a number <= 0 .*1.0"),
    ({"lower_bound": -1.0}, "lower_bound"),
    ({"gate": "sigmoid"}, "gate must be one of"),
    ({"softmax_scale": 0.0}, r"softmax_scale must be a number > 0 .* got 0.0"),
    ({"softmax_scale": "0.5"}, r"softmax_scale must be a number > 0 .* got '0.5'"),
]


@pytest.mark.parametrize("change, message", DECODE_BAD)
def test_invalid_arguments_are_named(change, message):
    inputs = dict(zip("q k v g beta".split(), step_inputs(50, 2, 1, "activated")))
    arguments = {**inputs, "pool": jnp.zeros((SLOTS, HV, K, V)), "slots": jnp.array([0, 1], jnp.int32),
                 "gate": "activated", **change}
    positional = [arguments.pop(name) for name in ("q", "k", "v", "g", "beta", "pool", "slots")]
    with pytest.raises(ValueError, match=message):
        kda_decode_pool(*positional, platform="xla", **arguments)


PREFILL_BAD = [
    ({"q": jnp.zeros((1, 6, H * K))}, r"q must have shape \[batch, seq_len, num_heads, head_dim\] \(4 dims\)"),
    ({"pool": jnp.zeros((SLOTS, HV, K, V), jnp.bfloat16)}, r"pool must be float32 \(the recurrent state\), got bf"),
    ({"pool": jnp.zeros((SLOTS, HV, K, V + 1))},
     r"pool must have shape \[num_slots, num_value_heads, head_dim, v_head_dim\] = \[\*, 2, 16, 32\]"),
    ({"pool": jnp.zeros((HV, K, V))}, r"pool must have shape \[num_slots, num_value_heads, head_dim, v_head_dim\]"),
    ({"state_v_first": True}, r"pool must have shape \[num_slots, num_value_heads, v_head_dim, head_dim\]"),
    ({"has_initial_state": jnp.ones((2,))}, "has_initial_state must be a bool array, got dtype float32"),
    ({"cu_seqlens": jnp.array([0.0, 3.0, 6.0])}, "cu_seqlens must be an integer array"),
    ({"cu_seqlens": jnp.array([[0, 3, 6]], jnp.int32)}, r"cu_seqlens must have shape \[num_sequences \+ 1\]"),
    ({"cu_seqlens": jnp.array([0, 5, 3], jnp.int32)}, r"cu_seqlens must start at 0, never decrease .* \[0, 5, 3\]"),
    ({"cu_seqlens": jnp.array([0, 3, 9], jnp.int32)}, r"cu_seqlens .* end at most at seq_len 6, got \[0, 3, 9\]"),
    ({"slots": jnp.array([SLOTS, 0], jnp.int32)}, "slots " + OUTSIDE + r"\[7\]"),
    ({"slots": jnp.array([2, 2], jnp.int32)}, "slots " + TWICE + r"\[2\]"),
    ({"g": jnp.zeros((1, 6, HV))}, r"g must have shape \[batch, tokens, num_value_heads, head_dim or 1\]"),
    ({"gate": "bounded", "a_log": jnp.zeros((HV,)), "lower_bound": 0.5}, r"lower_bound must be a number <= 0"),
]


@pytest.mark.parametrize("change, message", PREFILL_BAD)
def test_prefill_invalid_arguments_are_named(change, message):
    """Two packed sequences of 3 tokens each."""
    inputs = dict(zip("q k v g beta".split(), step_inputs(55, 1, 6, "activated")))
    arguments = {**inputs, "pool": jnp.zeros((SLOTS, HV, K, V)), "slots": jnp.array([0, 1], jnp.int32),
                 "cu_seqlens": jnp.array([0, 3, 6], jnp.int32), **change}
    positional = [arguments.pop(name) for name in ("q", "k", "v", "g", "beta", "pool", "slots")]
    with pytest.raises(ValueError, match=message):
        kda_prefill_pool(*positional, platform="xla", **arguments)


@pytest.mark.parametrize("op", ["decode", "prefill"])
def test_numpy_scalars_work_as_python_numbers(op):
    """softmax_scale and lower_bound as numpy scalars (as kernel_delta_attention takes them) give the same result."""
    inputs = step_inputs(56, 2, 1)
    pool, slots = jnp.zeros((SLOTS, HV, K, V)), jnp.array([0, 1], jnp.int32)
    kwargs = {"a_log": normal(57, (HV,), scale=0.5), "gate": "bounded", "platform": "xla"}
    run = kda_decode_pool if op == "decode" else kda_prefill_pool
    want = run(*inputs, pool, slots, softmax_scale=0.3, lower_bound=-5.0, **kwargs)
    got = run(*inputs, pool, slots, softmax_scale=np.float32(0.3), lower_bound=np.float32(-5.0), **kwargs)
    assert_close(got, want, TOL)


def test_autotune_inputs_have_distinct_slots():
    """Candidates are timed on slots that cannot race: distinct rows, -1 past the pool's end."""
    from hybrax.serving import KdaDecodePool

    kernel = KdaDecodePool()
    inputs = step_inputs(60, 4, 1, "activated")
    slots = jnp.array([2, -1, 0, 1], jnp.int32)
    problem = kernel.prepare(*inputs, jnp.zeros((3, HV, K, V)), slots, token_slots=slots[:, None])
    tuned = kernel.autotune_problem(kernel.invocation(problem, "pallas"), jax.random.key(0))
    np.testing.assert_array_equal(tuned.slots, [0, 1, 2, -1])
    np.testing.assert_array_equal(tuned.token_slots[:, 0], [0, 1, 2, -1])


def _float64(tree):
    """Float leaves in float64 (inside jax.enable_x64); ints and None as they are."""
    return jax.tree.map(lambda x: x.astype(jnp.float64) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_gradients_through_a_step_match_float64(platform):
    """jax.grad through a speculative step (2 tokens, a padded request) and the pool, for every float argument:
    against autodiff of the XLA step on float64 copies of the same problem. The Pallas kernel has no backward
    of its own: it takes the XLA step's (`register(gradient_of=...)`), so this checks that wiring."""
    inputs, kwargs = step_inputs(70, 3, 2, "softplus"), gate_kwargs(80, "softplus")
    pool, slots = normal(90, (SLOTS, HV, K, V), scale=0.5), jnp.array([4, -1, 1], jnp.int32)
    arrays = (*inputs, pool, kwargs["a_log"], kwargs["dt_bias"])

    def loss_of(outputs):
        o, new_pool = outputs
        return jnp.sum(jnp.sin(o)) + jnp.sum(new_pool ** 2)

    def loss(q, k, v, g, beta, pool, a_log, dt_bias):
        return loss_of(kda_decode_pool(q, k, v, g, beta, pool, slots, a_log=a_log, dt_bias=dt_bias, gate="softplus",
                                       beta_is_logits=True, platform=platform))

    got = jax.grad(loss, argnums=range(8))(*arrays)
    problem = KdaDecodePool().prepare(*inputs, pool, slots, a_log=kwargs["a_log"], dt_bias=kwargs["dt_bias"],
                                      gate="softplus", beta_is_logits=True)
    with jax.enable_x64(True):
        grads = jax.grad(lambda p: loss_of(kda_pool._xla_pool_decode(p, KdaDecodePoolConfig())), allow_int=True)(
            _float64(problem))
        want = [np.asarray(getattr(grads, name)) for name in ("q", "k", "v", "g", "beta", "pool", "a_log", "dt_bias")]
    assert_close(got, want, TOLERANCE[jnp.float32], "gradient")


@pytest.mark.parametrize("v_first, launch", [(False, {"block_v": 32, "num_warps": 4}),
                                              (True, {"block_v": 32, "num_warps": 8})])
def test_pallas_heuristic_launch_follows_the_pool_layout(v_first, launch):
    """The V-first pool takes 8 warps (its reductions over K stay inside warps; measured on the H200), the
    K-first pool 4 (Triton lays its warps along K)."""
    kernel = KdaDecodePool()
    inputs = step_inputs(61, 4, 1, "activated")
    shape = (SLOTS, HV, V, K) if v_first else (SLOTS, HV, K, V)
    problem = kernel.prepare(*inputs, jnp.zeros(shape), jnp.arange(4, dtype=jnp.int32), state_v_first=v_first)
    cfg = kda_pool._pallas_heuristic(kernel.invocation(problem, "pallas"))
    assert (cfg.block_v, cfg.num_warps) == (min(launch["block_v"], V), launch["num_warps"])
