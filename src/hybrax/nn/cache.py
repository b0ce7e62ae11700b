"""Serving a hybrid stack by slot: `HybridCache` holds every layer's pools and each slot's length; `SlotAllocator`
hands slots to requests and takes them back.

A request owns one slot from its prefill to its end, the same row index in every layer's pools. A released slot is
reused as it is: prefill starts a new request's row afresh in every layer (KDA from a zero state and an empty
convolution history, attention from position 0), so nothing of the previous request leaks into it.

    allocator = SlotAllocator(num_slots)
    cache = HybridCache.create(layers, num_slots, max_len)
    slots = allocator.allocate(2)                                # [2] int32
    ... each layer: y, pool = layer.prefill(x, cache.layers[i], slots, cu_seqlens=cu_seqlens)
    cache = cache.prefilled(pools, slots, prompt_lengths)
    ... each step: y, pool = layer.decode(x, cache.layers[i], step_slots)  (-1: padded row)
    cache = cache.decoded(pools, step_slots)
    allocator.release(finished_slots)
HybridCache is a pytree: pass it through jit and donate it, and the pools update in place.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from hybrax.nn.attention import read_rows, set_rows


@functools.partial(jax.tree_util.register_dataclass, data_fields=["layers", "lengths"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class HybridCache:
    """layers: each layer's cache (its `empty_cache`), in the stack's order; lengths [S] int32: the tokens each slot
    holds (its request's prompt and generated tokens so far)."""

    layers: tuple[Any, ...]
    lengths: Int[Array, " num_slots"]

    @classmethod
    def create(cls, layers: Sequence[Any], num_slots: int, max_len: int) -> HybridCache:
        """Empty pools for num_slots requests of up to max_len tokens, from each layer's `empty_cache`."""
        if not (isinstance(num_slots, int) and num_slots >= 1):
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        return cls(tuple(layer.empty_cache(num_slots, max_len=max_len) for layer in layers),
                   jnp.zeros((num_slots,), jnp.int32))

    @property
    def num_slots(self) -> int:
        return self.lengths.shape[0]

    def _with_layers(self, layers: Sequence[Any]) -> tuple[Any, ...]:
        if len(layers) != len(self.layers):
            raise ValueError(f"layers must hold one cache per layer ({len(self.layers)}), got {len(layers)}")
        return tuple(layers)

    def prefilled(self, layers: Sequence[Any], slots: Int[Array, " num_sequences"],
                  prompt_lengths: Int[Array, " num_sequences"]) -> HybridCache:
        """After a prefill: the layers' new caches, and each valid slot's length set to its prompt's."""
        return HybridCache(self._with_layers(layers), set_rows(self.lengths, slots, jnp.asarray(prompt_lengths)))

    def decoded(self, layers: Sequence[Any], slots: Int[Array, " batch"]) -> HybridCache:
        """After a decode step: the layers' new caches, and each valid slot's length one longer."""
        return HybridCache(self._with_layers(layers), set_rows(self.lengths, slots, read_rows(self.lengths, slots) + 1))


class SlotAllocator:
    """Free slots of a pool of num_slots, lowest first (host-side bookkeeping, outside jit)."""

    def __init__(self, num_slots: int):
        if not (isinstance(num_slots, int) and num_slots >= 1):
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, count: int = 1) -> np.ndarray:
        """count free slots [count] int32, taken from the free list."""
        if count > len(self._free):
            raise ValueError(f"allocate needs {count} free slots, only {len(self._free)} of {self.num_slots} are free")
        return np.array([heapq.heappop(self._free) for _ in range(count)], np.int32)

    def release(self, slots: Any) -> None:
        """Give slots back (each allocated, at most once); -1 entries (padded rows) are skipped."""
        slots = [int(s) for s in np.asarray(slots).reshape(-1) if s != -1]
        if len(set(slots)) != len(slots):
            raise ValueError(f"release takes each slot once, got {slots}")
        free = set(self._free)
        bad = sorted(s for s in slots if not 0 <= s < self.num_slots or s in free)
        if bad:
            raise ValueError(f"release takes allocated slots, got {bad} (free, or outside [0, {self.num_slots}))")
        for slot in slots:
            heapq.heappush(self._free, slot)
