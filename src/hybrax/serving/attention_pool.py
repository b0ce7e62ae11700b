"""`attention_decode_pool`: the softmax attention layers of a hybrid model, served from a KV cache pool by slot.

Every live request owns a row of the cache pools k_pool [num_slots, max_len, KV, D] and v_pool
[num_slots, max_len, KV, Dv], the same slots that index its KDA state and conv state, holding the keys and values
of its first cached_lengths[b] tokens. A step brings T new tokens per request (T = 1: decode; T > 1: speculative
decoding, or a chunk of a prompt, with new_lengths[b] <= T of them real): their keys and values are written at
positions cached_lengths[b] ... of the request's row, and each new token attends causally to its row up to and
including itself (within `sliding_window`, with `attention`'s soft cap and sinks). Slot -1 marks a padded
request (and so, under jit, where it cannot be checked, is any slot outside [0, num_slots); eager calls refuse
it), and tokens past new_lengths are padding: they read nothing, write nothing and output zeros. Rows no
request names stay bit-for-bit unchanged; donate the pools to update them in place. Valid slots must be
distinct. The caller advances cached_lengths by new_lengths after the step and keeps cached_lengths + new_lengths
<= max_len: concrete lengths are checked; traced ones are not, and writes outside the row are dropped (past its
end, or before its start for a negative cached length, which would otherwise wrap to the row's end; those tokens
do not see themselves).

The XLA implementation ("xla:gather") runs `hybrax.attention` on the gathered rows with a mask of each token's
visible positions: it copies the requests' rows once per step. The Pallas one ("pallas:in_place",
`ops/attention/pallas_pool_decode.py`) reads them in place by slot, flash decoding over splits of each row;
`auto` picks it on GPUs, where it is faster (BENCHMARKS.md). It needs power-of-two head dims from 16 to 256 and a
max_len that its key blocks divide (a multiple of 16).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from hybrax.core import (
    Invocation, Kernel, KernelConfig, default_executor, problem_dataclass, register, set_auto_order, static_field,
)
from hybrax.core.validate import (
    check_at_least_one, check_floating, check_integer, check_positive_number, check_rank, check_shape, is_concrete,
)
from hybrax.ops.attention.api import attention
from hybrax.ops.attention.mask import MaskInfo
from hybrax.ops.attention.pallas_flash_tiles import from_rows, head_rows, to_rows
from hybrax.ops.attention.pallas_pool_decode import PoolGeometry, combine_splits, pool_decode_splits
from hybrax.ops.pallas_shared import interpret_here
from hybrax.serving.kda_pool import pool_rows
from hybrax.serving.prefill import check_slots, gather_rows

OP_ID = "attention_decode_pool"


@dataclasses.dataclass(frozen=True)
class AttentionDecodePoolConfig(KernelConfig):
    """Speed knobs of the in-place Pallas kernel: keys per block, and splits of each row's keys (None: the
    heuristic's)."""

    block_k: int | None = None
    num_splits: int | None = None


@problem_dataclass
class AttentionPoolProblem:
    """q [B, T, H, D]; k, v [B, T, KV, D | Dv] (the new tokens); pools [S, L, KV, D | Dv]; slots, cached and new
    lengths [B] int32; sinks [H, S] or None."""

    q: Float[Array, "B T H D"]
    k: Float[Array, "B T KV D"]
    v: Float[Array, "B T KV Dv"]
    k_pool: Float[Array, "S L KV D"]
    v_pool: Float[Array, "S L KV Dv"]
    slots: Int[Array, " B"]
    cached_lengths: Int[Array, " B"]
    new_lengths: Int[Array, " B"]
    softmax_aux: Float[Array, "H N"] | None
    sliding_window: int | None = static_field()
    softmax_scale: float | None = static_field()
    logits_soft_cap: float | None = static_field()


def check_query_key(q: Any, k: Any, length: str = "tokens") -> None:
    """q [B, T, H, D] and k [B, T, KV, D] agree (`length` names dim 1): the new tokens' queries and keys, as the
    decode step and the prefill take them."""
    check_rank("q", q, 4, f"[batch, {length}, num_heads, head_dim]")
    batch, tokens, _, head_dim = jnp.shape(q)
    check_rank("k", k, 4, f"[batch, {length}, num_kv_heads, head_dim]")
    check_shape("k", k, (batch, tokens, jnp.shape(k)[2], head_dim), f"[batch, {length}, num_kv_heads, head_dim] (q's)")


def check_values_and_pools(q: Any, k: Any, v: Any, k_pool: Any, v_pool: Any, length: str = "tokens") -> None:
    """v [B, T, KV, Dv] agrees with k (checked by `check_query_key`), the pools [S, L, KV, D | Dv] with both, and
    all five arrays are floating."""
    batch, tokens, kv_heads, head_dim = jnp.shape(k)
    check_rank("v", v, 4, f"[batch, {length}, num_kv_heads, v_head_dim]")
    v_dim = jnp.shape(v)[3]
    check_shape("v", v, (batch, tokens, kv_heads, v_dim), f"[batch, {length}, num_kv_heads, v_head_dim] (k's)")
    check_rank("k_pool", k_pool, 4, "[num_slots, max_len, num_kv_heads, head_dim]")
    num_slots, max_len = jnp.shape(k_pool)[:2]
    check_shape("k_pool", k_pool, (num_slots, max_len, kv_heads, head_dim),
                "[num_slots, max_len, num_kv_heads, head_dim] (k's heads and dim)")
    check_shape("v_pool", v_pool, (num_slots, max_len, kv_heads, v_dim),
                "[num_slots, max_len, num_kv_heads, v_head_dim] (k_pool's slots and length, v's heads and dim)")
    for name, array in (("q", q), ("k", k), ("v", v), ("k_pool", k_pool), ("v_pool", v_pool)):
        check_floating(name, array)


def check_sliding_window(sliding_window: Any) -> None:
    """sliding_window: keys back from each token (an int >= 0), or None."""
    if sliding_window is not None and not (isinstance(sliding_window, int) and sliding_window >= 0):
        raise ValueError(f"sliding_window must be an int >= 0 (keys back from each token) or None, "
                         f"got {sliding_window!r}")


def _check(q: Any, k: Any, v: Any, k_pool: Any, v_pool: Any, slots: Any, cached_lengths: Any,
           new_lengths: Any, sliding_window: Any) -> None:
    check_query_key(q, k)
    batch, tokens, heads = jnp.shape(q)[:3]
    kv_heads = jnp.shape(k)[2]
    check_at_least_one("q", q, {2: "num_heads", 3: "head_dim"})
    check_at_least_one("k", k, {2: "num_kv_heads"})
    if heads % kv_heads:
        raise ValueError(f"num_heads of q ({heads}) must be a multiple of num_kv_heads of k ({kv_heads})")
    check_values_and_pools(q, k, v, k_pool, v_pool)
    check_at_least_one("v", v, {3: "v_head_dim"})
    num_slots, max_len = jnp.shape(k_pool)[:2]
    check_slots(slots, None, batch, num_slots)
    if cached_lengths is None:
        raise ValueError("cached_lengths must be an integer array [batch] (the tokens already in each row), got None")
    for name, lengths in (("cached_lengths", cached_lengths), ("new_lengths", new_lengths)):
        if lengths is not None:
            check_shape(name, lengths, (batch,), "[batch]")
            check_integer(name, lengths)
    _check_length_values(slots, cached_lengths, new_lengths, tokens, max_len)
    check_sliding_window(sliding_window)


def _check_length_values(slots: Any, cached_lengths: Any, new_lengths: Any, tokens: int, max_len: int) -> None:
    """When concrete: 0 <= new_lengths <= tokens, and each request's tokens fit in its row (past max_len the
    writes are dropped and the tokens would not see themselves); padded requests (slot -1) are not checked."""
    new = np.full(np.shape(slots), tokens) if new_lengths is None else new_lengths
    if not all(is_concrete(x) for x in (slots, cached_lengths, new)):
        return
    real = np.asarray(slots) >= 0
    new, cached = np.asarray(new)[real], np.asarray(cached_lengths)[real]
    if np.any((new < 0) | (new > tokens)):
        raise ValueError(f"new_lengths must be in [0, tokens = {tokens}] (the real new tokens of each request), "
                         f"got {new.tolist()} for the requests with a slot")
    if np.any(cached < 0) or np.any(cached + new > max_len):
        raise ValueError(f"cached_lengths + new_lengths must be in [0, max_len = {max_len}] (each request's tokens "
                         f"fit in its row), got cached_lengths {cached.tolist()} and new_lengths {new.tolist()} "
                         f"for the requests with a slot")


def _scalars(softmax_scale: Any, logits_soft_cap: Any) -> tuple[float | None, float | None]:
    """softmax_scale and logits_soft_cap as Python floats (both implementations hold them as statics), checked here
    so the in-place kernel refuses what `attention` refuses (a soft cap of 0 would divide by zero)."""
    if softmax_scale is not None:
        softmax_scale = check_positive_number("softmax_scale", softmax_scale)
    if logits_soft_cap is not None:
        logits_soft_cap = check_positive_number("logits_soft_cap", logits_soft_cap)
    return softmax_scale, logits_soft_cap


def _write(pool: jax.Array, rows: jax.Array, positions: jax.Array, new: jax.Array) -> jax.Array:
    """pool with new[b, t] at [rows[b, t], positions[b, t]]; indices past the pool's rows (padding) or past a row's
    end are dropped."""
    return pool.at[rows, positions].set(new.astype(pool.dtype), mode="drop")


def _new_tokens(p: AttentionPoolProblem) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(real [B, T], positions [B, T], k_pool, v_pool with the real new tokens written)."""
    num_slots, tokens = p.k_pool.shape[0], p.q.shape[1]
    token = jnp.arange(tokens, dtype=jnp.int32)
    real = (p.slots >= 0)[:, None] & (token[None, :] < p.new_lengths[:, None])
    positions = p.cached_lengths[:, None] + token[None, :]
    rows = jnp.where(real, p.slots[:, None], num_slots)
    stored_at = jnp.where(positions >= 0, positions, p.k_pool.shape[1])  # a negative index would wrap, not drop
    return real, positions, _write(p.k_pool, rows, stored_at, p.k), _write(p.v_pool, rows, stored_at, p.v)


class AttentionDecodePool(Kernel[AttentionDecodePoolConfig, Any]):
    """The slot-pool attention decode step for an `Executor`: takes `attention_decode_pool`'s arguments and runs
    the implementation the config names or `auto` picks (this module's AUTO table)."""

    op_id = OP_ID
    config_type = AttentionDecodePoolConfig

    def prepare(
        self, q: Any, k: Any, v: Any, k_pool: Any, v_pool: Any, slots: Any, cached_lengths: Any, /, *,
        new_lengths: Any = None, sliding_window: int | None = None, softmax_scale: float | None = None,
        logits_soft_cap: float | None = None, softmax_aux: Any = None,
    ) -> AttentionPoolProblem:
        _check(q, k, v, k_pool, v_pool, slots, cached_lengths, new_lengths, sliding_window)
        batch, tokens, heads, _ = jnp.shape(q)
        if softmax_aux is not None:
            check_rank("softmax_aux", softmax_aux, 2, "[num_heads, num_sinks]")
            check_shape("softmax_aux", softmax_aux, (heads, None), "[num_heads, num_sinks]")
        softmax_scale, logits_soft_cap = _scalars(softmax_scale, logits_soft_cap)
        if new_lengths is None:
            new_lengths = jnp.full((batch,), tokens, jnp.int32)
        return AttentionPoolProblem(
            q=q, k=k, v=v, k_pool=k_pool, v_pool=v_pool, slots=pool_rows(slots, jnp.shape(k_pool)[0]),
            cached_lengths=jnp.asarray(cached_lengths, jnp.int32), new_lengths=jnp.asarray(new_lengths, jnp.int32),
            softmax_aux=softmax_aux, sliding_window=sliding_window, softmax_scale=softmax_scale,
            logits_soft_cap=logits_soft_cap,
        )


@register(OP_ID, "xla", "gather", heuristic_cfg=lambda inv: AttentionDecodePoolConfig())
def _gather(p: AttentionPoolProblem, cfg: AttentionDecodePoolConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    real, positions, k_pool, v_pool = _new_tokens(p)
    key_position = jnp.arange(k_pool.shape[1], dtype=jnp.int32)[None, None, :]
    seen = real[:, :, None] & (key_position <= positions[:, :, None])  # [B, T, max_len]
    if p.sliding_window is not None:
        seen &= key_position >= positions[:, :, None] - p.sliding_window
    out = attention(
        p.q, gather_rows(k_pool, p.slots, None), gather_rows(v_pool, p.slots, None), None, None, p.softmax_aux,
        mask_info=MaskInfo.from_attention_mask(seen[:, None]), softmax_scale=p.softmax_scale,
        logits_soft_cap=p.logits_soft_cap,
    )
    return jnp.where(real[:, :, None, None], out, 0).astype(p.q.dtype), k_pool, v_pool


def _power_of_two(size: int) -> bool:
    return size >= 16 and size & (size - 1) == 0


def _in_place_reason(inv: Invocation, cfg: AttentionDecodePoolConfig | None = None) -> str | None:
    head_dim, v_dim = inv.arrays["q"].shape[-1], inv.arrays["v"].shape[-1]
    if not (_power_of_two(head_dim) and _power_of_two(v_dim) and max(head_dim, v_dim) <= 256):
        return f"the in-place kernel needs power-of-two head dims from 16 to 256, got {head_dim} and {v_dim}"
    max_len = inv.arrays["k_pool"].shape[1]
    if max_len % 16:
        return f"the in-place kernel needs a max_len that is a multiple of 16, got {max_len}"
    if cfg is not None and not (_power_of_two(cfg.block_k) and max_len % cfg.block_k == 0):
        return f"the in-place kernel needs block_k a power of two >= 16 dividing max_len {max_len}, got {cfg.block_k}"
    return None


def _in_place_heuristic(inv: Invocation) -> AttentionDecodePoolConfig:
    """Key blocks of up to 64 that divide max_len; splits enough for about two programs per SM of an H200
    (132 SMs) across requests, kv heads and row blocks."""
    batch, tokens, heads, _ = inv.arrays["q"].shape
    kv_heads, max_len = inv.arrays["k"].shape[2], inv.arrays["k_pool"].shape[1]
    block_k = next(size for size in (64, 32, 16) if max_len % size == 0)
    rows = tokens * heads // kv_heads
    programs = batch * kv_heads * -(-rows // 64)
    return AttentionDecodePoolConfig(block_k=block_k, num_splits=max(1, min(-(-264 // programs), max_len // block_k)))


# `auto` picks it on GPUs: on the H200 it matched the gather and ran 1.4x (B = 1) to 5.9x (B = 64, 32k tokens)
# faster (H200 measurements). On the CPU it would run interpreted.
@register(OP_ID, "pallas", "in_place", supports=_in_place_reason,
          heuristic_cfg=_in_place_heuristic, gradient_of=_gather)
def _in_place(p: AttentionPoolProblem, cfg: AttentionDecodePoolConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    real, _, k_pool, v_pool = _new_tokens(p)
    batch, tokens, heads, head_dim = p.q.shape
    kv_heads, max_len, v_dim = p.k.shape[2], k_pool.shape[1], p.v.shape[-1]
    group, rows = heads // kv_heads, tokens * heads // kv_heads
    block_q = min(64, max(16, 1 << (rows - 1).bit_length()))
    blocks = max_len // cfg.block_k
    geometry = PoolGeometry(
        rows=rows, group=group, block_q=block_q, block_k=cfg.block_k, num_splits=cfg.num_splits,
        blocks_per_split=-(-blocks // cfg.num_splits), window=p.sliding_window,
        scale=head_dim**-0.5 if p.softmax_scale is None else p.softmax_scale, soft_cap=p.logits_soft_cap,
    )
    padded_rows = geometry.row_blocks * block_q
    q_rows = to_rows(jnp.reshape(p.q, (batch, tokens, kv_heads, group, head_dim)), padded_rows).astype(k_pool.dtype)
    splits, lse = pool_decode_splits(q_rows, k_pool, v_pool, p.slots, p.cached_lengths, p.new_lengths,
                                     geometry=geometry, num_warps=4, interpret=interpret_here())
    sinks = None
    if p.softmax_aux is not None:  # [H, N] -> each row's head's sinks [KV, R', N]
        per_head = jnp.reshape(p.softmax_aux.astype(jnp.float32), (kv_heads, group, -1))
        sinks = head_rows(per_head, tokens, padded_rows)
    out = jnp.reshape(from_rows(combine_splits(splits, lse, sinks), tokens, group), (batch, tokens, heads, v_dim))
    return jnp.where(real[:, :, None, None], out, 0).astype(p.q.dtype), k_pool, v_pool


# What `auto` tries, in order, per device platform; the first whose supports() accepts the call runs (a device
# not named here reads the "cpu" row).
AUTO = {
    "gpu": ("pallas:in_place", "xla:gather"),
    "tpu": ("xla:gather",),
    "cpu": ("xla:gather",),
}
set_auto_order(OP_ID, AUTO)


def attention_decode_pool(
    q: Float[Array, "batch tokens num_heads head_dim"],
    k: Float[Array, "batch tokens num_kv_heads head_dim"],
    v: Float[Array, "batch tokens num_kv_heads v_head_dim"],
    k_pool: Float[Array, "num_slots max_len num_kv_heads head_dim"],
    v_pool: Float[Array, "num_slots max_len num_kv_heads v_head_dim"],
    slots: Int[Array, " batch"],
    cached_lengths: Int[Array, " batch"],
    /,
    *,
    new_lengths: Int[Array, " batch"] | None = None,
    sliding_window: int | None = None,
    softmax_scale: float | None = None,
    logits_soft_cap: float | None = None,
    softmax_aux: Float[Array, "num_heads num_sinks"] | None = None,
    platform: str | None = None,
    cfg: AttentionDecodePoolConfig | None = None,
) -> tuple[Float[Array, "batch tokens num_heads v_head_dim"], Float[Array, "num_slots max_len num_kv_heads head_dim"],
           Float[Array, "num_slots max_len num_kv_heads v_head_dim"]]:
    """T new tokens for each of B requests against their cached rows: returns (output [B, T, H, Dv] in q's
    dtype, k_pool, v_pool with the new tokens written). See the module doc; `sliding_window` w keeps the keys
    of the w positions before each token and its own."""
    return default_executor()(
        AttentionDecodePool(), q, k, v, k_pool, v_pool, slots, cached_lengths, new_lengths=new_lengths,
        sliding_window=sliding_window, softmax_scale=softmax_scale, logits_soft_cap=logits_soft_cap,
        softmax_aux=softmax_aux, platform=platform, cfg=cfg,
    )
