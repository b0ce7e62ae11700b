"""Packed sequences (cu_seqlens) through the Pallas Mosaic TPU KDA kernels (TPU interpret mode on the CPU): outputs,
final states and every input's gradient against float64 autodiff of the reference and against each sequence run
alone; under vmap; and the packed kernels' lowering to Mosaic.

The sequences are uneven: an empty one, one of a single token, one over two chunks, then tokens of no sequence, so
that the layout has chunks past the last sequence. On a TPU the same file runs the kernels compiled.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax.ops.kda import reference
from hybrax.ops.kda.api import KernelDeltaAttentionConfig
from hybrax.ops.kda.pallas_tpu import register  # noqa: F401  (registers pallas_tpu:chunked)
from hybrax.ops.kda.pallas_tpu.chunk_bwd import kda_backward
from hybrax.ops.kda.pallas_tpu.chunk_fwd import kda_forward
from tests.helpers import TOLERANCE, assert_close, to64
from tests.ops.kda.oracle import ARRAY_NAMES, loss_weights, make_case, oracle_outputs_and_gradients, ours

CU_SEQLENS = (0, 0, 1, 24, 33)  # empty, 1 token, 23 tokens, 9 tokens; tokens 33..36 belong to none
LENGTH = 37
TOKEN_ARRAYS = ("q", "k", "v", "beta", "decay")


def pallas_outputs_and_gradients(arrays, options, weights, chunk):
    """(o, final state) and the loss's gradients (`oracle.loss_weights`' weights) through pallas_tpu:chunked, one
    compiled vjp; checks that the Pallas backward ran."""
    cfg = KernelDeltaAttentionConfig("pallas_tpu", "chunked", chunk_size=chunk)

    @jax.jit
    def run(arrays):
        got, pullback = jax.vjp(ours(cfg, options), arrays)
        return got, pullback((weights[0].astype(got[0].dtype), weights[1]))[0]

    assert "kda_chunk_bwd_tpu" in str(jax.make_jaxpr(run)(arrays))  # not XLA's backward
    return run(arrays)


@functools.lru_cache
def fp32_case():
    """(arrays, options, weights, ours: outputs and gradients), per-channel decay, fp32, chunk 16: the 23-token
    sequence over two chunks, the last one partial; two chunks past the sequences."""
    arrays, options = make_case(batch=1, length=LENGTH, cu_seqlens=CU_SEQLENS)
    weights = loss_weights(arrays)
    return arrays, options, weights, pallas_outputs_and_gradients(arrays, options, weights, chunk=16)


def check_against_float64(arrays, options, weights, ours_, dtype) -> None:
    outputs, gradients = oracle_outputs_and_gradients(arrays, options, weights)
    got, got_gradients = ours_
    assert_close(got, outputs, TOLERANCE[dtype], "outputs")
    assert not np.any(np.asarray(got[0][:, CU_SEQLENS[-1]:], np.float32))  # tokens of no sequence: zeros
    assert set(got_gradients) == set(gradients)
    for name, want in gradients.items():
        assert_close(got_gradients[name], want, TOLERANCE[dtype], f"d{name}")


def test_per_channel_decay_fp32():
    check_against_float64(*fp32_case(), jnp.float32)


def test_gqa_per_head_decay_forgetting_gates_bf16():
    """Two value heads per query/key head, a per-head decay, gates of -1000 (steep sub-chunks), bf16; chunk 32."""
    arrays, options = make_case(batch=1, length=LENGTH, cu_seqlens=CU_SEQLENS, heads=1, value_heads=2, decay="head",
                                hard=True, dtype=jnp.bfloat16)
    weights = loss_weights(arrays)
    check_against_float64(arrays, options, weights, pallas_outputs_and_gradients(arrays, options, weights, 32),
                          jnp.bfloat16)


def test_matches_the_sequences_unpacked():
    """The packed call's outputs and gradients are those of the sequences unpacked, one per batch row (the same
    kernels on dense rows; each row zero-padded at its end, which changes nothing before it); an empty sequence
    keeps its initial state, which takes the final state's cotangent; tokens of no sequence get zero gradients."""
    arrays, options, weights, ((o, final), grads) = fp32_case()
    bounds = [(n, start, end) for n, (start, end) in enumerate(zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])) if end > start]
    width = max(end - start for _, start, end in bounds)

    def unpacked(x):  # [1, T, ...] -> [rows, width, ...]
        return jnp.stack([jnp.pad(x[0, start:end], [(0, width - end + start)] + [(0, 0)] * (x.ndim - 2))
                          for _, start, end in bounds])

    rows = {name: unpacked(arrays[name]) for name in TOKEN_ARRAYS}
    rows["initial_state"] = arrays["initial_state"][np.array([n for n, _, _ in bounds])]
    row_weights = (unpacked(weights[0]), weights[1][np.array([n for n, _, _ in bounds])])
    (o_rows, final_rows), grad_rows = pallas_outputs_and_gradients(rows, {}, row_weights, chunk=16)
    for row, (n, start, end) in enumerate(bounds):
        assert_close(o[0, start:end], o_rows[row, :end - start], 1e-6, f"sequence {n}'s output")
        assert_close(final[n], final_rows[row], 1e-6, f"sequence {n}'s final state")
        for name in TOKEN_ARRAYS:
            assert_close(grads[name][0, start:end], grad_rows[name][row, :end - start], 1e-6, f"sequence {n}'s d{name}")
        assert_close(grads["initial_state"][n], grad_rows["initial_state"][row], 1e-6, f"sequence {n}'s dh0")
    assert_close(final[0], arrays["initial_state"][0], 0.0, "the empty sequence's final state")
    assert_close(grads["initial_state"][0], weights[1][0], 0.0, "the empty sequence's d initial_state")
    for name in TOKEN_ARRAYS:
        assert not np.any(np.asarray(grads[name][:, CU_SEQLENS[-1]:])), f"d{name} of tokens of no sequence"


@pytest.mark.parametrize("shared", [True, False])
def test_vmap(shared):
    """Under vmap, against the float64 reference: cu_seqlens shared by the mapped calls (the mapped axis joins the
    kernels' batch) or mapped itself (one call per mapped index; the second call's sequences all empty: zero
    outputs, the initial states kept)."""
    cases = [make_case(seed=seed, batch=1, length=LENGTH, cu_seqlens=CU_SEQLENS)[0] for seed in (11, 12)]
    bounds = [CU_SEQLENS, CU_SEQLENS if shared else (0, 0, 0, 0, 0)]
    stacked = [jnp.stack([case[name] for case in cases]) for name in ARRAY_NAMES[:6]]
    cu_seqlens = jnp.array(bounds[0], jnp.int32) if shared else jnp.array(bounds, jnp.int32)

    def forward(q, k, v, beta, g, h0, cu_seqlens):
        return kda_forward(q, k, v, g, beta, h0, scale=0.25, cu_seqlens=cu_seqlens, chunk=16)

    o, final = jax.jit(jax.vmap(forward, in_axes=(0,) * 6 + (None if shared else 0,)))(*stacked, cu_seqlens)
    for index, case in enumerate(cases):
        q, k, v, beta, g, h0 = (case[name] for name in ARRAY_NAMES[:6])
        want = reference.kda_canonical(*(to64(x) for x in (q, k, v, beta, g, h0)), cu_seqlens=bounds[index],
                                       scale=0.25)
        assert_close((o[index], final[index]), want, TOLERANCE[jnp.float32], f"call {index}")


@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_lowers_to_mosaic(direction):
    """The packed kernels (the chunk info scalar-prefetched into SMEM, the state blocks indexed by it) through
    Pallas' Mosaic lowering for a TPU (no TPU needed): an operation Mosaic lacks fails here, in CI."""
    length, heads, dim, chunk, sequences = 512, 4, 128, 64, 3
    shape = jax.ShapeDtypeStruct
    tokens = [shape((1, length, heads, dim), jnp.bfloat16)] * 3 + [
        shape((1, length, heads, dim), jnp.float32), shape((1, length, heads), jnp.float32),
    ]
    cu_seqlens = shape((sequences + 1,), jnp.int32)
    if direction == "forward":
        fn = lambda q, k, v, g, beta, h0, cu: kda_forward(  # noqa: E731
            q, k, v, g, beta, h0, scale=0.1, cu_seqlens=cu, chunk=chunk, with_states=True, interpret=False)
        args = [*tokens, shape((sequences, heads, dim, dim), jnp.float32), cu_seqlens]
    else:
        chunks = (length + sequences * (chunk - 1)) // chunk
        fn = lambda q, k, v, g, beta, states, d_out, d_final, cu: kda_backward(  # noqa: E731
            q, k, v, g, beta, states, d_out, d_final, scale=0.1, cu_seqlens=cu, chunk=chunk, interpret=False)
        args = [*tokens, shape((1, heads, chunks, dim, dim), jnp.float32), tokens[2],
                shape((sequences, heads, dim, dim), jnp.float32), cu_seqlens]
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    assert {"forward": "kda_chunk_fwd_tpu", "backward": "kda_chunk_bwd_tpu"}[direction] in text
