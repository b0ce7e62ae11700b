"""`attention` as flash attention in Pallas (Triton lowering): every option of `attention`, fused.

Segment ids (packed sequences), attention sinks, the logits soft cap, a bias (with its gradient), a dense mask,
dropout (the XLA implementations' counter-based mask, recomputed tile by tile), windows on both sides with
hybrax's bottom-right alignment (Tq != Tk), fp32, any GQA ratio, head dims up to 256 (padded with zeros to a
power of two: zero q / k columns add nothing to q.k, zero value columns fill output columns that are sliced
off). A bias or mask is read by query row, so one shared by the heads of a group is copied per head, and the
bias's gradient is written whole ([B, H, Tq, Tk] fp32) before its broadcast dims are summed: fine for the usual
sizes, costly for long ones.

The forward (`pallas_flash_fwd.py`) writes each row's logsumexp; the backward (`pallas_flash_bwd.py`)
recomputes the weights from it. Lengths are padded to whole blocks; padded rows and keys are invisible.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float

from hybrax.core import Invocation, cotangent, register
from hybrax.core.config import is_power_of_two
from hybrax.ops.attention import scores
from hybrax.ops.attention.base import OP_ID, AttentionConfig, AttentionProblem
from hybrax.ops.attention.mask import PADDING_SEGMENT
from hybrax.ops.attention.pallas_flash_bwd import flash_backward_dkdv, flash_backward_dq
from hybrax.ops.attention.pallas_flash_fwd import flash_forward
from hybrax.ops.attention.pallas_flash_tiles import Extras, Geometry, from_rows, head_rows, to_rows
from hybrax.ops.pallas_shared import interpret_here

MAX_HEAD_DIM = 256
MIN_DOT = 16  # the smallest tile side a Triton dot takes
DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)


def _padded_dim(size: int) -> int:
    return max(MIN_DOT, 1 << (size - 1).bit_length())


def _supports(inv: Invocation, cfg: AttentionConfig | None = None) -> str | None:
    arrays, static = inv.arrays, inv.static
    if static["dtype"] not in DTYPES:
        return f"the flash kernels need dtype bfloat16, float16 or float32, got {static['dtype']}"
    if static["softmax_dtype"] != jnp.float32:
        return f"the flash kernels compute the softmax in float32, asked for {static['softmax_dtype']}"
    head_dim, v_dim = arrays["query"].shape[-1], arrays["value"].shape[-1]
    if _padded_dim(max(head_dim, v_dim)) > MAX_HEAD_DIM:
        return f"the flash kernels need head dims <= {MAX_HEAD_DIM}, got {head_dim} (query, key) and {v_dim} (value)"
    blocks = {} if cfg is None else {"block_q": cfg.block_q, "block_k": cfg.block_k}
    odd = {name: size for name, size in blocks.items() if not (size >= MIN_DOT and is_power_of_two(size))}
    return f"the flash kernels need blocks that are powers of two >= {MIN_DOT}, got {odd}" if odd else None


# Blocks (block_q query rows, block_k keys) by head dim (padded) for 16-bit inputs, forward and backward; fp32
# inputs take FP32_BLOCKS. Chosen offline (no GPU timed them yet): the largest tiles that upstream Triton 3.6
# compiles for sm_90 with every option on (segments, sinks, soft cap, bias, mask) without spilling registers or
# passing the H200's shared memory (`tools/triton_shared_memory.py --op attention`):
# forward 128 x 64 at D <= 128 (252 registers at D = 128), 64 x 32 at D = 256 (245); backward 64 x 64 at D = 128
# (255 registers), 64 x 32 at D = 64 and 256. fp32 dots take three tf32 passes: from D = 128 on the backward
# spills even at 32 x 32 (correct, but slow; 16-bit inputs are the fast path).
FORWARD_BLOCKS = {64: (128, 64), 128: (128, 64), 256: (64, 32)}
BACKWARD_BLOCKS = {64: (64, 32), 128: (64, 64), 256: (64, 32)}
FP32_BLOCKS = (32, 32)


def _blocks_by_dim(head_dims: tuple[int, int], dtype, table: dict) -> tuple[int, int]:
    if dtype == jnp.float32:
        return FP32_BLOCKS
    head_dim = max(64, _padded_dim(max(head_dims)))
    return table[head_dim]


def _heuristic(inv: Invocation) -> AttentionConfig:
    dims = (inv.arrays["query"].shape[-1], inv.arrays["value"].shape[-1])
    block_q, block_k = _blocks_by_dim(dims, inv.static["dtype"], FORWARD_BLOCKS)
    return AttentionConfig(block_q=block_q, block_k=block_k)


def _candidates(inv: Invocation) -> list[AttentionConfig]:
    """The heuristic's blocks and their halves (the Triton dot's minimum of 16 permitting)."""
    best = _heuristic(inv)
    block_qs = sorted({max(best.block_q // 2, MIN_DOT), best.block_q})
    return [AttentionConfig(block_q=bq, block_k=bk) for bq in block_qs
            for bk in sorted({max(best.block_k // 2, MIN_DOT), best.block_k})]


def _blocks(size: int, block: int) -> int:
    """The block along a length: the config's, or the smallest power of two >= 16 holding the length."""
    return min(block, _padded_dim(size))


def _geometry(p: AttentionProblem, block_q: int, block_k: int) -> Geometry:
    q_len, kv_len, group = p.query.shape[1], p.key.shape[1], p.query.shape[3]
    return Geometry(
        q_len=q_len, kv_len=kv_len, block_q=_blocks(q_len * group, block_q), block_k=_blocks(kv_len, block_k),
        group=group, window_left=p.window_left, window_right=p.window_right, scale=p.softmax_scale,
        soft_cap=p.logits_soft_cap, has_segments=p.q_segment_ids is not None, has_bias=p.bias is not None,
        has_mask=p.mask is not None, dropout_prob=p.dropout_prob,
    )


def _launch(geometry: Geometry, head_dim: int, dtype) -> dict:
    """Eight warps from 8192 entries of [block_q, D] tiles on (fewer spills in the offline compile), four below;
    fp32 tiles without pipelining (each stage would hold another set of fp32 tiles in shared memory)."""
    warps = 8 if geometry.block_q * head_dim >= 8192 else 4
    return {"num_warps": warps, "num_stages": 1 if dtype == jnp.float32 else 2, "interpret": interpret_here()}


def _to_rows(x: jax.Array, geometry: Geometry, width: int | None = None) -> jax.Array:
    """`to_rows`, rows padded to whole blocks (and the last axis to `width`)."""
    rows = to_rows(x, geometry.num_q_blocks * geometry.block_q)
    return rows if width is None else scores.pad_axis(rows, 3, width)


def _from_rows(rows: jax.Array, geometry: Geometry, width: int | None = None) -> jax.Array:
    """The inverse of `_to_rows`, keeping the first `width` entries of the last axis."""
    return from_rows(rows if width is None else rows[..., :width], geometry.q_len, geometry.group)


def _pairwise_rows(x: jax.Array | None, geometry: Geometry, dtype) -> jax.Array | None:
    """A bias or mask [B|1, K|1, G|1, Tq, Tk] by row: [B|1, K|1, R', Tk'] (a group-shared one copied per head),
    padded with zeros (hidden, for a mask)."""
    if x is None:
        return None
    x = jnp.broadcast_to(x, (*x.shape[:2], geometry.group, *x.shape[3:])).astype(dtype)
    rows = _to_rows(jnp.moveaxis(x, 3, 1), geometry)  # [B, Tq, K, G, Tk] -> [B, K, R', Tk]
    return scores.pad_axis(rows, 3, geometry.num_k_blocks * geometry.block_k)


def _padded_inputs(p: AttentionProblem, geometry: Geometry) -> dict:
    """q [B, K, R', D'] by row (`_to_rows`), k [B, Tk', K, D'], v [B, Tk', K, Dv'] and the extras (segment ids
    by row [B, R'] and key [B, Tk'], bias and mask by row and key), padded to whole blocks and power-of-two
    head dims."""
    kv_rows = geometry.num_k_blocks * geometry.block_k
    head_size, value_size = _padded_dim(p.query.shape[-1]), _padded_dim(p.value.shape[-1])

    def keys_and_width(x: jax.Array, width: int) -> jax.Array:
        return scores.pad_axis(scores.pad_axis(x, 1, kv_rows), 3, width)

    q_segments = None
    if p.q_segment_ids is not None:
        by_row = jnp.repeat(p.q_segment_ids, geometry.group, axis=1)
        q_segments = scores.pad_axis(by_row, 1, geometry.num_q_blocks * geometry.block_q, PADDING_SEGMENT)
    extras = Extras(
        q_segments=q_segments, kv_segments=scores.pad_axis(p.kv_segment_ids, 1, kv_rows, PADDING_SEGMENT),
        bias=_pairwise_rows(p.bias, geometry, jnp.float32), mask=_pairwise_rows(p.mask, geometry, jnp.int8),
        dropout_seed=p.dropout_seed,
    )
    return dict(q=_to_rows(p.query, geometry, head_size), k=keys_and_width(p.key, head_size),
                v=keys_and_width(p.value, value_size), extras=extras)


def _sink_start(p: AttentionProblem, geometry: Geometry) -> dict:
    """Each row's sinks as the online softmax's starting max and denominator, [K, R'] each (padded rows: 0, 0;
    they are invisible, their outputs sliced off)."""
    if p.softmax_aux is None:
        return {"sink_max": None, "sink_sum": None}
    sinks = p.softmax_aux.astype(jnp.float32)  # [K, G, S]
    sink_max = jnp.max(sinks, axis=-1)
    sink_sum = jnp.sum(jnp.exp(sinks - sink_max[..., None]), axis=-1)
    padded_rows = geometry.num_q_blocks * geometry.block_q
    return {"sink_max": head_rows(sink_max, geometry.q_len, padded_rows),
            "sink_sum": head_rows(sink_sum, geometry.q_len, padded_rows)}


def _forward(p: AttentionProblem, cfg: AttentionConfig) -> tuple[jax.Array, jax.Array]:
    """(out [B, Tq, K, G, Dv], lse [B, K, G, Tq])."""
    geometry = _geometry(p, cfg.block_q, cfg.block_k)
    inputs = _padded_inputs(p, geometry)
    out, lse = flash_forward(**inputs, **_sink_start(p, geometry), geometry=geometry,
                             **_launch(geometry, inputs["q"].shape[-1], p.dtype))
    return _from_rows(out, geometry, p.value.shape[-1]), jnp.moveaxis(_from_rows(lse, geometry), 1, 3)


def _fwd(p: AttentionProblem, cfg: AttentionConfig) -> tuple[jax.Array, tuple]:
    out, lse = _forward(p, cfg)
    return out, (p, out, lse)


def _bwd(cfg: AttentionConfig, residuals: tuple, d_out: jax.Array) -> AttentionProblem:
    p, out, lse = residuals
    head_dim, v_dim = p.query.shape[-1], p.value.shape[-1]
    geometry = _geometry(p, *_blocks_by_dim((head_dim, v_dim), p.dtype, BACKWARD_BLOCKS))
    inputs = _padded_inputs(p, geometry)
    delta = scores.row_delta(p, out, d_out)
    by_row = dict(  # lse and delta [B, K, G, Tq] -> [B, K, R']; padded rows are invisible
        lse=_to_rows(jnp.moveaxis(lse, 3, 1), geometry), delta=_to_rows(jnp.moveaxis(delta, 3, 1), geometry),
        d_out=_to_rows(d_out.astype(p.dtype), geometry, inputs["v"].shape[-1]),
    )
    launch = dict(geometry=geometry, **_launch(geometry, inputs["q"].shape[-1], p.dtype))
    dq, d_bias = flash_backward_dq(**inputs, **by_row, **launch)
    dk, dv = flash_backward_dkdv(**inputs, **by_row, **launch)
    kv_len = p.key.shape[1]
    return cotangent(
        p,
        query=_from_rows(dq, geometry, head_dim).astype(p.query.dtype),
        key=dk[:, :kv_len, :, :head_dim],
        value=dv[:, :kv_len, :, :v_dim],
        bias=None if d_bias is None else _bias_grad(p, d_bias, geometry),
        softmax_aux=scores.sink_grads(p, lse, delta),
    )


def _bias_grad(p: AttentionProblem, d_bias: jax.Array, geometry: Geometry) -> jax.Array:
    """[B, K, R', Tk'] by row -> the bias's shape [B|1, K|1, G|1, Tq, Tk], its broadcast dims summed."""
    per_head = jnp.moveaxis(_from_rows(d_bias, geometry, p.key.shape[1]), 1, 3)  # [B, K, G, Tq, Tk]
    summed = [axis for axis in range(3) if p.bias.shape[axis] == 1 and per_head.shape[axis] > 1]
    return jnp.sum(per_head, axis=tuple(summed), keepdims=True).astype(p.bias.dtype)


# On a GPU `auto` takes it where cuDNN declines (sinks, segments, bias, masks, dropout, soft cap, fp32): checked
# against float64 and timed on the H200 (H200 measurements). platform="pallas" runs it anywhere.
@register(OP_ID, "pallas", "flash", supports=_supports, heuristic_cfg=_heuristic,
          candidate_cfgs=_candidates, fwd=_fwd, bwd=_bwd)
def flash(p: AttentionProblem, cfg: AttentionConfig) -> Float[Array, "B Tq K G Dv"]:
    return _forward(p, cfg)[0]
