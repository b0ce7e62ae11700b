"""`kda_tkg` (seed 003's decode step in its layouts) against the float64 reference and against
`kernel_delta_attention` chained over many tokens; in-place state under donation; bad input."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest

from hybrax import kda_tkg, kernel_delta_attention
from hybrax.ops.kda import reference, tkg
from tests.helpers import TOLERANCE, assert_close, normal, to64
from tests.ops.kda.oracle import kda64

LOWER_BOUND = -5.0


def step_inputs(seed, batch, dk, heads, dv, dtype=jnp.float32):
    """The seed's eleven arguments, in order (out is a zero destination)."""
    return [
        normal(seed, (batch, dk, heads), dtype), normal(seed + 1, (batch, dk, heads), dtype),
        normal(seed + 2, (batch, heads, dv), dtype), normal(seed + 3, (batch, dk, heads)),
        normal(seed + 4, (batch, 1, heads)), normal(seed + 5, (1, heads), scale=0.5),
        normal(seed + 6, (dk, heads)), jnp.zeros((batch, heads, dv), dtype),
        normal(seed + 7, (batch, heads, dk, dv), scale=0.5), jnp.full((1, 1), dk**-0.5), jnp.full((1, 1), LOWER_BOUND),
    ]


def reference_step(args):
    without_out = [to64(x) for index, x in enumerate(args) if index != 7]
    return reference.kda_tkg_reference(*without_out)


def heads_first(args):
    """The seed's arguments (out left out) in the layouts of the steps inside kda_tkg: q, k, g [B, 1, H, dk],
    v [B, 1, H, dv], a_log [H], dt_bias [H, dk]."""
    q, k, v, g, beta, a_log, dt_bias, _, state, scale, lower_bound = args
    q, k, g = (jnp.swapaxes(x, 1, 2)[:, None] for x in (q, k, g))
    return q, k, v[:, None], g, beta, a_log.reshape(-1), dt_bias.T, state, scale, lower_bound


def pallas_step(args):
    """The GPU path (the fused decode kernel, scale and lower_bound as arrays), in interpret mode."""
    return tkg._fused_step(*heads_first(args), "pallas", interpret=True)


def test_signature_is_the_seeds():
    names = list(inspect.signature(kda_tkg).parameters)
    assert names == ["q", "k", "v", "g", "beta", "a_log", "dt_bias", "out", "S", "scale", "lower_bound"]


@pytest.mark.parametrize("dk, dv", [(16, 8), (256, 32)])
def test_matches_reference(dk, dv):
    args = step_inputs(0, 3, dk, 2, dv)
    assert_close(jax.jit(kda_tkg)(*args), reference_step(args), TOLERANCE[jnp.float32])


def test_bf16_inputs_give_out_dtype():
    args = step_inputs(10, 2, 32, 2, 16, jnp.bfloat16)
    o, state = kda_tkg(*args)
    assert o.dtype == jnp.bfloat16 and state.dtype == jnp.float32
    assert_close((o, state), reference_step(args), TOLERANCE[jnp.bfloat16])


def test_pallas_kernel_step_in_interpret_mode():
    args = step_inputs(20, 2, 16, 2, 16)
    assert_close(pallas_step(args), reference_step(args), TOLERANCE[jnp.float32])


def test_pallas_step_gradients_match_float64():
    """The kernel has no backward: jax.grad takes the XLA step's, here against float64 autodiff of one KDA step
    (the bounded gate, beta logits) for every float argument."""
    args = step_inputs(40, 2, 16, 2, 16)
    arrays = heads_first(args)[:8]
    scale, lower_bound = float(args[9][0, 0]), float(args[10][0, 0])

    def loss_of(outputs):
        out, state = outputs
        return jnp.sum(jnp.sin(out)) + jnp.sum(state ** 2)

    fused = lambda *a: tkg._fused_step(*a, *args[9:], "pallas", interpret=True)  # noqa: E731
    got = jax.grad(lambda *a: loss_of(fused(*a)), argnums=range(8))(*arrays)
    with jax.enable_x64(True):
        def oracle(q, k, v, g, beta, a_log, dt_bias, state):
            return kda64(q, k, v, beta, g, state, a_log, dt_bias, lower_bound=lower_bound, beta_is_logits=True,
                         softmax_scale=scale)

        wide = [jnp.asarray(to64(x)) for x in arrays]
        want = [to64(g) for g in jax.grad(lambda *a: loss_of(oracle(*a)), argnums=range(8))(*wide)]
    assert_close(got, want, TOLERANCE[jnp.float32], "gradient")


@pytest.mark.parametrize("path", ["xla", "pallas_interpret"])
def test_lower_bound_of_minus_1000(path):
    """lower_bound = -1000: exp(g) must underflow to 0, never overflow. Raw gates of -12 on half the keys keep
    those log decays near -0.01; the others land between about -100 and -1000 (the state forgets them)."""
    args = step_inputs(70, 3, 16, 2, 16)  # the kernel takes V >= 16
    args[3] = args[3].at[:, :8].set(-12.0)  # g [B, dk, H]
    args[10] = jnp.full((1, 1), -1000.0)
    out = jax.jit(kda_tkg)(*args) if path == "xla" else pallas_step(args)
    assert_close(out, reference_step(args), TOLERANCE[jnp.float32])


def test_chained_steps_equal_kernel_delta_attention():
    batch, length, heads, dk, dv = 2, 12, 2, 16, 8
    q, k = normal(30, (batch, length, heads, dk)), normal(31, (batch, length, heads, dk))
    v, g = normal(32, (batch, length, heads, dv)), normal(33, (batch, length, heads, dk))
    beta, a_log, dt_bias = normal(34, (batch, length, heads)), normal(35, (heads,), scale=0.5), normal(36, (heads, dk))
    state0 = normal(37, (batch, heads, dk, dv), scale=0.5)
    whole, final = kernel_delta_attention(
        q, k, v, beta, g, state0, a_log=a_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND, beta_is_logits=True,
        return_state=True, platform="xla",
    )
    step = jax.jit(kda_tkg, donate_argnums=8)
    state, outs = state0 + 0.0, []
    head_last = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [B, H, K] -> [B, K, H]
    for t in range(length):
        o, state = step(
            head_last(q[:, t]), head_last(k[:, t]), v[:, t], head_last(g[:, t]), beta[:, t, None], a_log[None],
            dt_bias.T, jnp.zeros((batch, heads, dv)), state, jnp.full((1, 1), dk**-0.5), jnp.full((1, 1), LOWER_BOUND),
        )
        outs.append(o)
    assert_close((jnp.stack(outs, 1), state), (to64(whole), to64(final)), 1e-5)


def test_donated_state_is_updated_in_place():
    args = step_inputs(40, 2, 16, 2, 8)
    state = args[8] + 0.0
    pointer = state.unsafe_buffer_pointer()
    args[8] = state
    _, new_state = jax.jit(kda_tkg, donate_argnums=8)(*args)
    assert state.is_deleted() and new_state.unsafe_buffer_pointer() == pointer


@pytest.mark.parametrize(
    "index, bad, name",
    [(1, (2, 16, 3), "k"), (2, (2, 3, 8), "v"), (4, (2, 2), "beta"), (5, (2,), "a_log"), (6, (2, 16), "dt_bias"),
     (7, (2, 2, 4), "out"), (8, (2, 2, 16, 4), "S"), (9, (1,), "scale"), (10, (), "lower_bound")],
)
def test_bad_shapes_name_the_argument(index, bad, name):
    args = step_inputs(50, 2, 16, 2, 8)
    args[index] = jnp.zeros(bad, jnp.float32)
    with pytest.raises(ValueError, match=rf"^{name} must"):
        kda_tkg(*args)


def test_state_must_be_fp32():
    args = step_inputs(60, 2, 16, 2, 8)
    args[8] = args[8].astype(jnp.bfloat16)
    with pytest.raises(ValueError, match="S must be float32"):
        kda_tkg(*args)


def test_positive_lower_bound_is_refused():
    """A positive bound would make the gate a growth factor; kernel_delta_attention refuses it as well."""
    args = step_inputs(65, 2, 16, 2, 8)
    args[10] = jnp.full((1, 1), 5.0)
    with pytest.raises(ValueError, match=r"lower_bound must be <= 0"):
        kda_tkg(*args)
    jax.jit(kda_tkg)(*step_inputs(65, 2, 16, 2, 8))  # traced bounds are not checked
