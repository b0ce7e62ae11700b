"""A small hybrid stack (3 KDA : 1 attention) served by slot: prefill (packed prompts, a padded one) and token-by-
token decode (padded rows) through `HybridCache` give the training forward's logits, also for a request that reuses
the slot of one that ended and with a V-first state pool; slots no request holds are never written."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hybrax.nn import Attention, HybridCache, KimiDeltaAttention, RMSNorm, SlotAllocator, sequence_lengths
from tests.helpers import TOLERANCE, assert_close

VOCAB, HIDDEN = 37, 32
# The requests in each decode step's three rows (None: a padded row).
SCHEDULE = [("a", "b", None)] * 3 + [("c", "b", None)] * 2 + [(None, "c", None)]


class Stack(nnx.Module):
    """Embedding, four pre-norm residual mixers (KDA, KDA, KDA, attention), output head."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        kda = [KimiDeltaAttention(HIDDEN, 2, 8, num_v_heads=4, mode="fused_recurrent", rngs=rngs) for _ in range(3)]
        self.mixers = nnx.List([*kda, Attention(HIDDEN, 4, 2, 8, sinks=True, qk_norm=True, rngs=rngs)])
        self.norms = nnx.List([RMSNorm(HIDDEN) for _ in self.mixers])
        self.head = nnx.Linear(HIDDEN, VOCAB, rngs=rngs)

    def __call__(self, tokens, cu_seqlens):
        h = self.embed(tokens)
        for norm, mixer in zip(self.norms, self.mixers):
            h = h + mixer(norm(h), cu_seqlens=cu_seqlens)
        return self.head(h)

    def prefill(self, tokens, cache, slots, cu_seqlens):
        h, pools = self.embed(tokens), []
        for norm, mixer, pool in zip(self.norms, self.mixers, cache.layers):
            y, pool = mixer.prefill(norm(h), pool, slots, cu_seqlens=cu_seqlens)
            h, pools = h + y, pools + [pool]
        return self.head(h), cache.prefilled(pools, slots, sequence_lengths(*tokens.shape, cu_seqlens))

    def decode(self, tokens, cache, slots):
        h, pools = self.embed(tokens)[:, None], []
        for norm, mixer, pool in zip(self.norms, self.mixers, cache.layers):
            y, pool = mixer.decode(norm(h), pool, slots)
            h, pools = h + y, pools + [pool]
        return self.head(h)[:, 0], cache.decoded(pools, slots)


prefill = nnx.jit(lambda model, tokens, cache, slots, cu: model.prefill(tokens, cache, slots, cu), donate_argnums=2)
decode = nnx.jit(lambda model, tokens, cache, slots: model.decode(tokens, cache, slots), donate_argnums=2)


def test_prefill_and_decode_give_the_training_logits():
    model = Stack(nnx.Rngs(0))
    rng = np.random.default_rng(1)
    sequences = {name: rng.integers(0, VOCAB, size=length) for name, length in (("a", 8), ("b", 8), ("c", 7))}
    everything = np.concatenate(list(sequences.values()))
    ends = np.cumsum([len(s) for s in sequences.values()])
    logits = np.asarray(nnx.jit(Stack.__call__)(model, jnp.asarray(everything)[None],
                                                jnp.asarray(np.concatenate([[0], ends]), jnp.int32))[0])
    want = dict(zip(sequences, np.split(logits, ends[:-1])))
    served = {name: [] for name in sequences}

    allocator, cache = SlotAllocator(3), HybridCache.create(model.mixers, 3, max_len=10)
    layers = list(cache.layers)
    layers[1] = model.mixers[1].empty_cache(3, state_v_first=True)  # one KDA layer keeps its states V-first
    cache = HybridCache(tuple(layers), cache.lengths)
    held = dict(zip("ab", allocator.allocate(2)))
    # a's prompt, a padded prompt of 2 tokens, b's prompt, then a token past the end
    tokens = np.concatenate([sequences["a"][:5], [1, 2], sequences["b"][:3], [3]])
    slots = jnp.array([held["a"], -1, held["b"]], jnp.int32)
    y, cache = prefill(model, jnp.asarray(tokens)[None], cache, slots, jnp.array([0, 5, 7, 10], jnp.int32))
    served["a"].extend(np.asarray(y[0, :5]))
    served["b"].extend(np.asarray(y[0, 7:10]))

    fed = {"a": 5, "b": 3, "c": 4}  # tokens given so far: the prompts
    for step, rows in enumerate(SCHEDULE):
        if step == 3:  # a has ended: c takes its slot (the lowest free), prefilled alone
            allocator.release([held.pop("a")])
            held["c"] = allocator.allocate()[0]
            tokens = np.concatenate([sequences["c"][:4], np.zeros(7, np.int64)])
            slots = jnp.array([held["c"], -1, -1], jnp.int32)
            y, cache = prefill(model, jnp.asarray(tokens)[None], cache, slots, jnp.array([0, 4, 4, 4], jnp.int32))
            served["c"].extend(np.asarray(y[0, :4]))
        slots = jnp.array([held[row] if row else -1 for row in rows], jnp.int32)
        step_tokens = jnp.array([sequences[row][fed[row]] if row else 0 for row in rows], jnp.int32)
        donated = cache.layers[0].state
        y, cache = decode(model, step_tokens, cache, slots)
        assert donated.is_deleted()  # the pools were donated: updated in place
        for index, row in enumerate(rows):
            if row:
                served[row].append(np.asarray(y[index]))
                fed[row] += 1

    assert held["c"] == 0 and fed == {"a": 8, "b": 8, "c": 7}
    for name in sequences:
        assert_close(np.stack(served[name]), want[name], TOLERANCE[jnp.float32], f"request {name}")
    np.testing.assert_array_equal(np.asarray(cache.lengths), [7, 8, 0])
    for leaf in jax.tree.leaves(cache.layers):
        if leaf.ndim > 1:  # every pool's row 2 (never held) is still zero
            assert np.all(np.asarray(leaf[2]) == 0)


def test_allocator_and_cache_refuse_misuse():
    allocator = SlotAllocator(2)
    slots = allocator.allocate(2)
    with pytest.raises(ValueError, match="allocate needs 1 free slots, only 0 of 2 are free"):
        allocator.allocate()
    allocator.release(slots[:1])
    with pytest.raises(ValueError, match=r"release takes allocated slots, got \[0\]"):
        allocator.release([0])
    with pytest.raises(ValueError, match="release takes each slot once"):
        allocator.release([1, 1])
    cache = HybridCache.create([nnx.eval_shape(lambda: KimiDeltaAttention(HIDDEN, 2, 8, rngs=nnx.Rngs(0)))], 2, 4)
    with pytest.raises(ValueError, match=r"layers must hold one cache per layer \(1\), got 2"):
        cache.decoded([None, None], jnp.array([0]))
