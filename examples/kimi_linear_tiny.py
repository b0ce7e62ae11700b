"""A tiny Kimi-Linear-style language model with hybrax.nn: trains on the CPU, then generates through the cache.

The model: token embedding, four blocks (three of Kimi Delta Attention, then one of softmax attention, as Kimi
Linear's 3:1), each a pre-norm mixer and a pre-norm SwiGLU MLP with residuals, a final norm and an output head.
The task: each sequence counts up from a random start by a random stride (mod the vocabulary), so the model must
read the stride from its prompt. Training packs two sequences per row (segment_ids), AdamW through optax. Serving
prefills several prompts packed in one row into their cache slots, then decodes them greedily token by token, each
step a jitted call with the cache donated (updated in place).

    .venv/bin/python examples/kimi_linear_tiny.py          # about 300 steps, then generation
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from hybrax.nn import Attention, HybridCache, KimiDeltaAttention, RMSNorm, SlotAllocator, sequence_lengths

VOCAB, HIDDEN, HEADS, HEAD_DIM = 32, 64, 2, 32
SEQUENCE, PER_ROW, BATCH = 16, 2, 8


class SwiGLU(nnx.Module):
    def __init__(self, hidden: int, inner: int, rngs: nnx.Rngs):
        self.gate = nnx.Linear(hidden, inner, use_bias=False, rngs=rngs)
        self.up = nnx.Linear(hidden, inner, use_bias=False, rngs=rngs)
        self.down = nnx.Linear(inner, hidden, use_bias=False, rngs=rngs)

    def __call__(self, x):
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Block(nnx.Module):
    """x + mixer(norm(x)), then + mlp(norm(.)); the mixer also serves by slot (prefill, decode)."""

    def __init__(self, mixer: nnx.Module, rngs: nnx.Rngs):
        self.mixer, self.mixer_norm, self.mlp_norm = mixer, RMSNorm(HIDDEN), RMSNorm(HIDDEN)
        self.mlp = SwiGLU(HIDDEN, 2 * HIDDEN, rngs)

    def _finish(self, x, y):
        x = x + y
        return x + self.mlp(self.mlp_norm(x))

    def __call__(self, x, segment_ids, max_segments):
        return self._finish(x, self.mixer(self.mixer_norm(x), segment_ids=segment_ids, max_segments=max_segments))

    def prefill(self, x, pool, slots, cu_seqlens):
        y, pool = self.mixer.prefill(self.mixer_norm(x), pool, slots, cu_seqlens=cu_seqlens)
        return self._finish(x, y), pool

    def decode(self, x, pool, slots):
        y, pool = self.mixer.decode(self.mixer_norm(x), pool, slots)
        return self._finish(x, y), pool


class TinyKimi(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, HIDDEN, rngs=rngs)
        # Sequences this short train faster token by token than in chunks on the CPU (fla's fused_recurrent mode).
        mixers = [KimiDeltaAttention(HIDDEN, HEADS, HEAD_DIM, mode="fused_recurrent", rngs=rngs) for _ in range(3)]
        mixers.append(Attention(HIDDEN, HEADS, HEADS, HEAD_DIM, rngs=rngs))
        self.blocks = nnx.List([Block(mixer, rngs) for mixer in mixers])
        self.norm = RMSNorm(HIDDEN)
        self.head = nnx.Linear(HIDDEN, VOCAB, rngs=rngs)

    def mixers(self) -> list[nnx.Module]:
        return [block.mixer for block in self.blocks]

    def __call__(self, tokens, segment_ids, max_segments):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, segment_ids, max_segments)
        return self.head(self.norm(x))

    def prefill(self, tokens, cache: HybridCache, slots, cu_seqlens):
        """Prompts packed in tokens [1, T] (cu_seqlens) into their slots: (logits [1, T, V], the new cache)."""
        x, pools = self.embed(tokens), []
        for block, pool in zip(self.blocks, cache.layers):
            x, pool = block.prefill(x, pool, slots, cu_seqlens)
            pools.append(pool)
        return self.head(self.norm(x)), cache.prefilled(pools, slots, sequence_lengths(*tokens.shape, cu_seqlens))

    def decode(self, tokens, cache: HybridCache, slots):
        """One token per request, tokens [B], by slot (-1: padded): (logits [B, V], the new cache)."""
        x, pools = self.embed(tokens)[:, None], []
        for block, pool in zip(self.blocks, cache.layers):
            x, pool = block.decode(x, pool, slots)
            pools.append(pool)
        return self.head(self.norm(x))[:, 0], cache.decoded(pools, slots)


def counting(rng: np.random.Generator, count: int, length: int) -> np.ndarray:
    """count sequences [count, length]: start + stride * t mod VOCAB, stride in 1..4."""
    start = rng.integers(0, VOCAB, size=(count, 1))
    stride = rng.integers(1, 5, size=(count, 1))
    return (start + stride * np.arange(length)) % VOCAB


def training_batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """PER_ROW sequences packed in each of BATCH rows: tokens and segment_ids [BATCH, PER_ROW * SEQUENCE]."""
    tokens = counting(rng, BATCH * PER_ROW, SEQUENCE).reshape(BATCH, PER_ROW * SEQUENCE)
    segment_ids = np.repeat(np.arange(PER_ROW), SEQUENCE)[None].repeat(BATCH, axis=0)
    return tokens.astype(np.int32), segment_ids.astype(np.int32)


def loss_fn(model: TinyKimi, tokens, segment_ids):
    """Next-token cross-entropy within each packed sequence."""
    logits = model(tokens, segment_ids, max_segments=BATCH * PER_ROW)
    same = segment_ids[:, 1:] == segment_ids[:, :-1]
    losses = optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:])
    return jnp.sum(losses * same) / jnp.sum(same)


@nnx.jit
def train_step(model: TinyKimi, optimizer: nnx.Optimizer, tokens, segment_ids):
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens, segment_ids)
    optimizer.update(model, grads)
    return loss


prefill = nnx.jit(lambda model, tokens, cache, slots, cu: model.prefill(tokens, cache, slots, cu), donate_argnums=2)
decode = nnx.jit(lambda model, tokens, cache, slots: model.decode(tokens, cache, slots), donate_argnums=2)


def generate(model: TinyKimi, prompts: list[np.ndarray], new_tokens: int, num_slots: int = 8) -> list[np.ndarray]:
    """Greedy continuations of the prompts: one packed prefill, then a decode step per token (padded rows up to
    num_slots, so every step runs the same compiled program)."""
    allocator = SlotAllocator(num_slots)
    cache = HybridCache.create(model.mixers(), num_slots, max_len=max(map(len, prompts)) + new_tokens)
    slots = allocator.allocate(len(prompts))
    cu_seqlens = np.concatenate([[0], np.cumsum([len(p) for p in prompts])]).astype(np.int32)
    logits, cache = prefill(model, jnp.asarray(np.concatenate(prompts))[None], cache, jnp.asarray(slots),
                            jnp.asarray(cu_seqlens))
    next_tokens = jnp.argmax(logits[0, cu_seqlens[1:] - 1], axis=-1)
    rows = np.full(num_slots, -1, np.int32)
    rows[:len(prompts)] = slots
    step_tokens = jnp.zeros(num_slots, jnp.int32).at[:len(prompts)].set(next_tokens)
    generated = [next_tokens]
    for _ in range(new_tokens - 1):
        logits, cache = decode(model, step_tokens, cache, jnp.asarray(rows))
        step_tokens = jnp.argmax(logits, axis=-1)
        generated.append(step_tokens[:len(prompts)])
    allocator.release(slots)
    return list(np.asarray(jnp.stack(generated, axis=1)))


def main(steps: int = 300, seed: int = 0, verbose: bool = True) -> dict[str, float]:
    """Train for `steps`, then continue eight prompts by twelve tokens; returns the first and last losses and the
    share of generated tokens that continue each count correctly."""
    rng = np.random.default_rng(seed)
    model = TinyKimi(nnx.Rngs(seed))
    optimizer = nnx.Optimizer(model, optax.adamw(optax.warmup_cosine_decay_schedule(0.0, 3e-3, 20, steps)),
                              wrt=nnx.Param)
    begin, losses = time.time(), []
    for step in range(steps):
        losses.append(float(train_step(model, optimizer, *map(jnp.asarray, training_batch(rng)))))
        if verbose and (step % 50 == 0 or step == steps - 1):
            print(f"step {step:4d}  loss {losses[-1]:.3f}  ({time.time() - begin:.1f} s)")

    new_tokens = 12
    full = [counting(rng, 1, length + new_tokens)[0].astype(np.int32) for length in (3, 4, 5, 6, 7, 8, 9, 10)]
    prompts = [sequence[:-new_tokens] for sequence in full]
    continuations = generate(model, prompts, new_tokens)
    correct = np.mean([np.mean(got == sequence[-new_tokens:]) for got, sequence in zip(continuations, full)])
    if verbose:
        for prompt, got in zip(prompts, continuations):
            print(f"{' '.join(map(str, prompt)):>30}  ->  {' '.join(map(str, got))}")
        print(f"generated tokens that continue their count: {correct:.0%} ({time.time() - begin:.1f} s in all)")
    return {"first_loss": losses[0], "last_loss": losses[-1], "accuracy": float(correct)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    main(**vars(parser.parse_args()))
