"""One cu_seqlens rule for every op that takes it (`hybrax.core.validate.check_cu_seqlens`): [N + 1] integers,
N >= 1, in a batch of one, from 0, never decreasing, ending at most at seq_len; tokens from cu_seqlens[-1] on
belong to no sequence: zero output, no effect on any state, zero gradient. Each op rejects the same bad
boundaries with the same words, and with an end short of seq_len agrees with the same call on the tokens up to
the end (and with the float64 reference there), in every implementation, with cu_seqlens traced under jit."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda.api import KernelDeltaAttentionConfig, kernel_delta_attention
from hybrax.ops.kda.reference import kda_reference
from hybrax.ops.recurrent.api import RecurrentAttentionConfig, recurrent_attention
from hybrax.ops.recurrent.reference import recurrent_reference
from hybrax.serving.prefill import kda_prefill_pool
from hybrax.serving.short_conv import short_conv_prefill
from tests.helpers import TOLERANCE, assert_close, normal, to64

T, END, H, K, V = 20, 13, 2, 16, 8  # END < T: tokens END.. belong to no sequence
CU = (0, 5, 5, END)  # three sequences, one empty
N = len(CU) - 1
TOL = TOLERANCE[jnp.float32]


def _kda_arrays(length=T):
    q, k, v = normal(0, (1, length, H, K)), normal(1, (1, length, H, K)), normal(2, (1, length, H, V))
    beta, g = jax.nn.sigmoid(normal(3, (1, length, H))), -jax.nn.softplus(normal(4, (1, length, H, K)))
    return q, k, v, beta, g


def _recurrent_arrays(length=T):
    q, k, v = normal(0, (1, length, H, K)), normal(1, (1, length, H, K)), normal(2, (1, length, H, V))
    return q, k, v, jax.nn.log_sigmoid(normal(3, (1, length, H)) + 2.0)


INITIAL = normal(5, (N, H, K, V), scale=0.5)


def kda_op(cfg):
    def run(arrays, cu_seqlens):
        return kernel_delta_attention(*arrays, INITIAL, cu_seqlens=cu_seqlens, return_state=True, cfg=cfg)
    return run


def recurrent_op(cfg, reverse):
    def run(arrays, cu_seqlens):
        q, k, v, g = arrays
        return recurrent_attention(q, k, v, g, None, None, None, INITIAL, cu_seqlens, reverse=reverse,
                                   return_state=True, cfg=cfg)
    return run


def prefill_op(arrays, cu_seqlens):
    q, k, v, beta, g = arrays
    pool = jnp.zeros((4, H, K, V)).at[jnp.array([3, 0, 1])].set(INITIAL)
    return kda_prefill_pool(q, k, v, g, beta, pool, jnp.array([3, 0, 1], jnp.int32), cu_seqlens=cu_seqlens)


CONV_WEIGHT = normal(6, (K, 4))


def short_conv_op(arrays, cu_seqlens):
    x = arrays[0][:, :, 0, :]  # [1, T, K]
    pool = normal(7, (4, K, 3))
    return short_conv_prefill(x, pool, CONV_WEIGHT, jnp.array([3, 0, 1], jnp.int32), cu_seqlens=cu_seqlens)


KDA = {f"kda {p} {b}": kda_op(KernelDeltaAttentionConfig(p, b, chunk_size=16))
       for p, b in (("xla", "scan"), ("xla", "chunked"), ("pallas", "chunked"))}
RECURRENT = {f"recurrent {p} {b}{' reverse' if r else ''}": recurrent_op(RecurrentAttentionConfig(p, b, chunk_size=16), r)
             for p, b, r in (("xla", "scan", False), ("xla", "chunked", False), ("pallas", "chunked", False),
                             ("xla", "scan", True), ("xla", "chunked", True))}
OPS = {**{name: (op, _kda_arrays) for name, op in KDA.items()},
       **{name: (op, _recurrent_arrays) for name, op in RECURRENT.items()},
       "kda_prefill_pool": (prefill_op, _kda_arrays), "short_conv_prefill": (short_conv_op, _kda_arrays)}


RULE = "must start at 0, never decrease and end at most at seq_len 20, got"
BAD = {
    "not starting at 0": ([1, 5, 5, END], rf"{RULE} \[1, 5, 5, 13\]"),
    "decreasing": ([0, 9, 5, END], rf"{RULE} \[0, 9, 5, 13\]"),
    "ending past seq_len": ([0, 5, 5, T + 1], rf"{RULE} \[0, 5, 5, 21\]"),
    "one entry": ([0], r"must have shape \[num_sequences \+ 1\] with at least 2 entries"),
    "two dims": ([[0, 5, 5, END]], r"must have shape \[num_sequences \+ 1\]"),
    "floats": ([0.0, 5.0, 5.0, END], "must be an integer array"),
}


@pytest.mark.parametrize("bad", BAD.values(), ids=BAD.keys())
@pytest.mark.parametrize("name", ["kda xla chunked", "recurrent xla scan", "kda_prefill_pool", "short_conv_prefill"])
def test_every_op_rejects_the_same_bad_boundaries_in_the_same_words(name, bad):
    op, arrays = OPS[name]
    bounds, message = bad
    dtype = jnp.float32 if isinstance(bounds[0], float) else jnp.int32
    with pytest.raises(ValueError, match=f"^cu_seqlens {message}"):
        op(arrays(), jnp.asarray(bounds, dtype))


@pytest.mark.parametrize("name", ["kda xla chunked", "recurrent xla scan", "kda_prefill_pool", "short_conv_prefill"])
def test_every_op_needs_a_batch_of_one(name):
    op, arrays = OPS[name]
    doubled = [jnp.concatenate([x, x]) for x in arrays()]
    with pytest.raises(ValueError, match="^cu_seqlens needs a batch of one"):
        op(doubled, jnp.asarray(CU, jnp.int32))


def _references():
    """float64 (output, states) of the tokens up to END, per op family."""
    q, k, v, beta, g = (to64(x) for x in _kda_arrays(END))
    kda = kda_reference(q, k, v, beta, g, to64(INITIAL), cu_seqlens=np.asarray(CU))
    q, k, v, g = (to64(x) for x in _recurrent_arrays(END))
    forward = recurrent_reference(q, k, v, g, initial_state=to64(INITIAL), cu_seqlens=np.asarray(CU))
    backward = recurrent_reference(q, k, v, g, initial_state=to64(INITIAL), cu_seqlens=np.asarray(CU), reverse=True)
    return {"kda": kda, "recurrent": forward, "recurrent reverse": backward}


@pytest.mark.parametrize("name", OPS)
def test_tokens_past_the_end_belong_to_no_sequence(name):
    op, arrays = OPS[name]
    cu = jnp.asarray(CU, jnp.int32)
    out, state = jax.jit(op)(arrays(), cu)  # cu_seqlens traced: its values are known only at run time
    out_short, state_short = jax.jit(op)(arrays(END), cu)
    assert np.all(np.asarray(out[:, END:]) == 0), "tokens past cu_seqlens[-1] must give zeros"
    assert_close(out[:, :END], to64(out_short), TOL, "output up to the end")
    assert_close(state, to64(state_short), TOL, "states")
    family = "kda" if name.startswith("kda ") else "recurrent reverse" if "reverse" in name else "recurrent"
    if name.startswith(("kda ", "recurrent")):
        assert_close((out[:, :END], state), _references()[family], TOL, "against float64")


@pytest.mark.parametrize("name", ["recurrent xla scan", "kda_prefill_pool"])
def test_an_eager_call_with_concrete_boundaries_agrees(name):
    op, arrays = OPS[name]
    cu = jnp.asarray(CU, jnp.int32)
    for got, want in zip(op(arrays(), cu), jax.jit(op)(arrays(), cu), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _loss(op, arrays, cu):
    out, state = op(arrays, cu)
    return jnp.sum(out * jnp.cos(out)) + jnp.sum(jnp.sin(state))


@pytest.mark.parametrize("name", ["kda xla chunked", "recurrent xla scan", "recurrent xla chunked reverse"])
def test_gradients_past_the_end_are_zero_and_before_it_those_of_the_shorter_call(name):
    op, arrays = OPS[name]
    cu = jnp.asarray(CU, jnp.int32)
    grads = jax.jit(jax.grad(functools.partial(_loss, op), argnums=0))(list(arrays()), cu)
    short = jax.jit(jax.grad(functools.partial(_loss, op), argnums=0))(list(arrays(END)), cu)
    for index, (full, want) in enumerate(zip(grads, short, strict=True)):
        assert np.all(np.asarray(full[:, END:]) == 0), f"input {index}: gradient past the end"
        assert_close(full[:, :END], to64(want), TOL, f"input {index}: gradient up to the end")
