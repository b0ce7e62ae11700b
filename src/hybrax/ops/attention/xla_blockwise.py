"""Blockwise XLA attention: online softmax over key blocks, memory linear in sequence length.

Forward: for each query block, a scan over key blocks keeps the running max, denominator and
weighted value sum (FlashAttention's recurrence); only the output and each row's log-sum-exp are
kept. Backward (custom VJP): recomputes each tile's weights from the log-sum-exp; an outer scan
over key blocks accumulates dk, dv for its block while the inner scan over query blocks emits dq
and dbias tiles. Tiles that the causal / sliding window hides entirely are skipped.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.core import Invocation, cotangent, register, vary_like
from hybrax.ops.attention import scores
from hybrax.ops.attention.base import OP_ID, AttentionConfig, AttentionProblem


def _slice(x: jax.Array | None, start: jax.Array, size: int, axis: int) -> jax.Array | None:
    if x is None:
        return None
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis)


@dataclasses.dataclass(frozen=True)
class Tiling:
    """The problem's arrays padded to whole tiles, and the tile sizes."""

    p: AttentionProblem
    block_q: int
    block_k: int
    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    q_segment_ids: jax.Array | None
    kv_segment_ids: jax.Array | None

    @classmethod
    def of(cls, p: AttentionProblem, cfg: AttentionConfig) -> "Tiling":
        q_len, kv_len = p.query.shape[1], p.key.shape[1]
        block_q, block_k = min(cfg.block_q, q_len), min(cfg.block_k, kv_len)
        q_pad = -(-q_len // block_q) * block_q
        k_pad = -(-kv_len // block_k) * block_k
        # Padded positions are hidden by `scores.visible`; the pad values only need to be finite.
        pad = scores.pad_axis
        return cls(
            p, block_q, block_k,
            query=pad(p.query, 1, q_pad), key=pad(p.key, 1, k_pad), value=pad(p.value, 1, k_pad),
            bias=pad(pad(p.bias, 3, q_pad), 4, k_pad),
            mask=pad(pad(p.mask, 3, q_pad, False), 4, k_pad, False),
            q_segment_ids=pad(p.q_segment_ids, 1, q_pad), kv_segment_ids=pad(p.kv_segment_ids, 1, k_pad),
        )

    @property
    def num_q_blocks(self) -> int:
        return self.query.shape[1] // self.block_q

    @property
    def num_k_blocks(self) -> int:
        return self.key.shape[1] // self.block_k

    def may_see(self, qi: jax.Array, kj: jax.Array) -> jax.Array:
        """False when the window bounds alone hide every key of tile (qi, kj) from every query."""
        shift = self.p.key.shape[1] - self.p.query.shape[1]
        q_first, k_first = qi * self.block_q + shift, kj * self.block_k
        result = jnp.bool_(True)
        if self.p.window_right is not None:
            result &= k_first <= q_first + self.block_q - 1 + self.p.window_right
        if self.p.window_left is not None:
            result &= k_first + self.block_k - 1 >= q_first - self.p.window_left
        return result

    def tile(self, qi: jax.Array, kj: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array | None]:
        """Logits, visibility and dropout keep mask of tile (qi, kj), each [B, K, G, block_q, block_k]."""
        bq, bk = self.block_q, self.block_k
        q_start, k_start = qi * bq, kj * bk
        q_pos, k_pos = q_start + jnp.arange(bq), k_start + jnp.arange(bk)
        bias = _slice(_slice(self.bias, q_start, bq, 3), k_start, bk, 4)
        logits = scores.logits(self.p, self.q_block(qi), self.k_block(kj), bias)
        seen = scores.visible(
            self.p, q_pos, k_pos,
            _slice(_slice(self.mask, q_start, bq, 3), k_start, bk, 4),
            _slice(self.q_segment_ids, q_start, bq, 1), _slice(self.kv_segment_ids, k_start, bk, 1),
        )
        keep = scores.dropout_keep(self.p, q_pos, k_pos) if self.p.dropout_prob else None
        return logits, seen, keep

    def q_block(self, qi: jax.Array) -> jax.Array:
        return _slice(self.query, qi * self.block_q, self.block_q, 1)

    def k_block(self, kj: jax.Array) -> jax.Array:
        return _slice(self.key, kj * self.block_k, self.block_k, 1)

    def v_block(self, kj: jax.Array) -> jax.Array:
        return _slice(self.value, kj * self.block_k, self.block_k, 1)


def _blocks_to_rows(blocks: jax.Array, axis: int) -> jax.Array:
    """[n, ..., block, ...] (block at `axis` + 1) -> [..., n * block, ...] (at `axis`)."""
    moved = jnp.moveaxis(blocks, 0, axis)
    shape = moved.shape
    return moved.reshape(*shape[:axis], shape[axis] * shape[axis + 1], *shape[axis + 2:])


def _initial_state(t: Tiling) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Running (max, denominator, weighted values) of one query block before any key: the sinks'."""
    p = t.p
    batch, _, num_kv_heads, group, _ = p.query.shape
    rows = (batch, num_kv_heads, group, t.block_q)
    acc = jnp.zeros((*rows, p.value.shape[-1]), scores.accumulation_dtype(p))
    if p.softmax_aux is None:
        return jnp.full(rows, -jnp.inf, p.softmax_dtype), jnp.zeros(rows, p.softmax_dtype), acc
    sink_max = jnp.max(p.softmax_aux, axis=-1)
    sink_sum = jnp.sum(jnp.exp(p.softmax_aux - sink_max[..., None]), axis=-1)
    return jnp.broadcast_to(sink_max[None, :, :, None], rows), jnp.broadcast_to(sink_sum[None, :, :, None], rows), acc


def _finite(row_max: jax.Array) -> jax.Array:
    """The shift used for `exp`: the running max, or 0 while a row has seen nothing."""
    return jnp.where(jnp.isfinite(row_max), row_max, 0.0)


def _online_step(t: Tiling, qi: jax.Array, kj: jax.Array, state: tuple) -> tuple:
    row_max, denominator, acc = state
    logits, seen, keep = t.tile(qi, kj)
    new_max = jnp.maximum(row_max, jnp.max(jnp.where(seen, logits, -jnp.inf), axis=-1))
    shift = _finite(new_max)
    rescale = jnp.exp(row_max - shift)  # exp(-inf) = 0 for rows that had seen nothing
    exps = jnp.exp(jnp.where(seen, logits - shift[..., None], -jnp.inf))
    denominator = rescale * denominator + jnp.sum(exps, axis=-1)
    kept = scores.apply_dropout(t.p, exps, keep)
    values = jnp.einsum("bhgqk,bkhv->bhgqv", kept.astype(t.p.dtype), t.v_block(kj),
                        preferred_element_type=acc.dtype, precision=scores.precision(t.p.dtype))
    return new_max, denominator, rescale[..., None].astype(acc.dtype) * acc + values


def _forward(p: AttentionProblem, cfg: AttentionConfig) -> tuple[jax.Array, jax.Array]:
    """Output [B, Tq, K, G, Dv] and log-sum-exp [B, K, G, Tq] (0 for rows with an empty denominator)."""
    t = Tiling.of(p, cfg)

    def query_block(qi: jax.Array) -> tuple[jax.Array, jax.Array]:
        def key_step(state: tuple, kj: jax.Array) -> tuple[tuple, None]:
            step = lambda s: _online_step(t, qi, kj, s)  # noqa: E731
            return jax.lax.cond(t.may_see(qi, kj), step, lambda s: s, state), None

        start = vary_like(_initial_state(t), p)
        (row_max, denominator, acc), _ = jax.lax.scan(key_step, start, jnp.arange(t.num_k_blocks))
        nonempty = denominator > 0
        out = acc / jnp.where(nonempty, denominator, 1.0)[..., None].astype(acc.dtype)
        lse = jnp.where(nonempty, _finite(row_max) + jnp.log(jnp.where(nonempty, denominator, 1.0)), 0.0)
        return jnp.moveaxis(out, 3, 1).astype(p.dtype), lse

    outs, lses = jax.lax.map(query_block, jnp.arange(t.num_q_blocks))
    q_len = p.query.shape[1]
    return _blocks_to_rows(outs, 1)[:, :q_len], _blocks_to_rows(lses, 3)[..., :q_len]


def _reduce_leading(x: jax.Array, leading: tuple[int, ...]) -> jax.Array:
    """Sum a [B, K, G, ...] tile over the leading axes where the bias has size 1 (it was broadcast)."""
    axes = tuple(i for i, (n, m) in enumerate(zip(x.shape, leading)) if m == 1 and n != 1)
    return jnp.sum(x, axis=axes, keepdims=True)


def _tile_grads(
    t: Tiling, qi: jax.Array, kj: jax.Array, lse: jax.Array, delta: jax.Array, d_out: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """Gradients of one tile: (dk, dv) contributions of its key block, dq of its query block, dbias."""
    p = t.p
    acc_dtype = scores.accumulation_dtype(p)
    prec = scores.precision(p.dtype)
    logits, seen, keep = t.tile(qi, kj)
    weights = jnp.exp(jnp.where(seen, logits - lse[..., None], -jnp.inf))
    kept = scores.apply_dropout(p, weights, keep)
    dv = jnp.einsum("bhgqk,bqhgv->bkhv", kept.astype(p.dtype), d_out, preferred_element_type=acc_dtype,
                    precision=prec)
    d_weights = jnp.einsum("bqhgv,bkhv->bhgqk", d_out, t.v_block(kj), preferred_element_type=p.softmax_dtype,
                           precision=prec)
    d_weights = scores.apply_dropout(p, d_weights, keep)
    # Softmax backward, then the soft cap's chain rule: d(pre-cap logits).
    d_logits = weights * (d_weights - delta[..., None]) * scores.soft_cap_slope(p, logits)
    d_scaled = (d_logits * p.softmax_scale).astype(p.dtype)
    dq = jnp.einsum("bhgqk,bkhd->bqhgd", d_scaled, t.k_block(kj), preferred_element_type=acc_dtype, precision=prec)
    dk = jnp.einsum("bhgqk,bqhgd->bkhd", d_scaled, t.q_block(qi), preferred_element_type=acc_dtype, precision=prec)
    dbias = None if p.bias is None else _reduce_leading(d_logits, p.bias.shape[:3])
    return dk, dv, dq, dbias


def _backward(cfg: AttentionConfig, residuals: tuple, d_out: jax.Array) -> AttentionProblem:
    p, out, lse = residuals
    t = Tiling.of(p, cfg)
    acc_dtype = scores.accumulation_dtype(p)
    q_len, q_pad = p.query.shape[1], t.query.shape[1]
    # delta_i = sum_j P_ij dP_ij = dO_i . O_i, the softmax backward's row term. [B, K, G, Tq]
    delta = scores.row_delta(p, out, d_out)
    d_out_pad = scores.pad_axis(d_out.astype(p.dtype), 1, q_pad)
    lse_pad, delta_pad = scores.pad_axis(lse, 3, q_pad), scores.pad_axis(delta, 3, q_pad)
    bq = t.block_q
    # Shapes of a tile's (dq, dbias), for the zeros of skipped tiles.
    tile_shapes = jax.eval_shape(
        lambda: _tile_grads(t, jnp.int32(0), jnp.int32(0), lse_pad[..., :bq], delta_pad[..., :bq],
                            d_out_pad[:, :bq])[2:]
    )

    def key_block(dq: jax.Array, kj: jax.Array) -> tuple[jax.Array, tuple]:
        def query_step(dkv: tuple, qi: jax.Array) -> tuple[tuple, tuple]:
            def compute(dkv: tuple) -> tuple:
                dk, dv, dq_tile, dbias_tile = _tile_grads(
                    t, qi, kj, _slice(lse_pad, qi * bq, bq, 3), _slice(delta_pad, qi * bq, bq, 3),
                    _slice(d_out_pad, qi * bq, bq, 1),
                )
                return (dkv[0] + dk, dkv[1] + dv), (dq_tile, dbias_tile)

            def skip(dkv: tuple) -> tuple:
                return dkv, vary_like(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), tile_shapes), p, d_out)

            return jax.lax.cond(t.may_see(qi, kj), compute, skip, dkv)

        zeros_kv = vary_like((jnp.zeros(t.k_block(kj).shape, acc_dtype), jnp.zeros(t.v_block(kj).shape, acc_dtype)),
                             p, d_out)
        (dk, dv), (dq_tiles, dbias_tiles) = jax.lax.scan(query_step, zeros_kv, jnp.arange(t.num_q_blocks))
        return dq + _blocks_to_rows(dq_tiles, 1), (dk, dv, dbias_tiles)

    dq, (dk, dv, dbias) = jax.lax.scan(
        key_block, vary_like(jnp.zeros(t.query.shape, acc_dtype), p, d_out), jnp.arange(t.num_k_blocks)
    )
    kv_len = p.key.shape[1]
    if dbias is not None:
        nk, nq, bb, kb, gb, _, bk = dbias.shape
        # [nk, nq, Bb, Kb, Gb, bq, bk] -> [Bb, Kb, Gb, nq * bq, nk * bk]
        dbias = jnp.transpose(dbias, (2, 3, 4, 1, 5, 0, 6)).reshape(bb, kb, gb, nq * bq, nk * bk)
        dbias = dbias[..., :q_len, :kv_len].astype(p.bias.dtype)
    return cotangent(
        p,
        query=dq[:, :q_len].astype(p.query.dtype),
        key=_blocks_to_rows(dk, 1)[:, :kv_len].astype(p.key.dtype),
        value=_blocks_to_rows(dv, 1)[:, :kv_len].astype(p.value.dtype),
        bias=dbias,
        softmax_aux=scores.sink_grads(p, lse, delta),
    )


def _heuristic(inv: Invocation) -> AttentionConfig:
    # Measured at T=2048 / 8192 (H200 measurements): on the CPU tiles that stay in cache win; on an H200
    # the fewest loop steps win (1024 beat 512 by 2x at T=8192).
    if inv.device == "cpu":
        return AttentionConfig(block_q=128, block_k=256)
    return AttentionConfig(block_q=1024, block_k=1024)


def _candidates(inv: Invocation) -> list[AttentionConfig]:
    return [AttentionConfig(block_q=bq, block_k=bk) for bq in (128, 256, 512) for bk in (128, 256, 512)]


def _fwd(p: AttentionProblem, cfg: AttentionConfig) -> tuple[jax.Array, tuple]:
    out, lse = _forward(p, cfg)
    return out, (p, out, lse)


@register(OP_ID, "xla", "blockwise", heuristic_cfg=_heuristic, candidate_cfgs=_candidates,
          fwd=_fwd, bwd=_backward)
def blockwise(p: AttentionProblem, cfg: AttentionConfig) -> Float[Array, "B Tq K G Dv"]:
    return _forward(p, cfg)[0]
