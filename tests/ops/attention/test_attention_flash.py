"""The flash attention kernels beyond the shared forward / gradient cases (which run them in interpret mode):
what they decline, rows that see nothing, their block loops, and their lowering for an H200."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hybrax import AttentionConfig, MaskInfo, attention
from hybrax.core import Invocation
from hybrax.ops.attention import pallas_flash
from hybrax.ops.attention.api import OP_ID, Attention
from hybrax.ops.attention.pallas_flash_tiles import Geometry
from tests.helpers import lower_for_h200
from tests.ops.attention.inputs import make_call, normal

FLASH = AttentionConfig("pallas", "flash", block_q=16, block_k=16)


def _reason(dtype=jnp.float32, **options) -> str | None:
    call = make_call(dtype=dtype, **options)
    keywords = {name: value for name, value in call.options.items() if name != "dropout_rng"}
    problem = Attention().prepare(call.query, call.key, call.value, call.bias, call.options.get("dropout_rng"),
                                  call.sinks, **keywords)
    return pallas_flash._supports(Invocation(OP_ID, Attention.version, problem, "pallas", "gpu", "NVIDIA H200"))


@pytest.mark.parametrize(("options", "reason"), [
    (dict(softmax_dtype=jnp.bfloat16), "softmax in float32"),
    (dict(head_dim=16, v_dim=257), "head dims <= 256"),
])
def test_declines_with_the_reason(options, reason):
    assert reason in _reason(**options)


def test_takes_every_option_and_16_bit_inputs():
    assert _reason(segments=True, sinks=(4, 2), logits_soft_cap=2.0, sliding_window=(3, 5), bias_heads=2,
                   mask_heads=1, dropout_prob=0.1, deterministic=False, dropout_rng=jax.random.key(0)) is None
    assert _reason(jnp.bfloat16, head_dim=192, v_dim=128, causal=True) is None


def test_explicit_platform_names_what_it_declines():
    call = make_call()
    with pytest.raises(ValueError, match="pallas:flash cannot run this call: the flash kernels compute the softmax"):
        attention(call.query, call.key, call.value, softmax_dtype=jnp.bfloat16, cfg=FLASH)


def test_rows_that_see_nothing_give_zeros_and_zero_gradients():
    """A padded query (segment -1) with sinks: zeros out, zero dq, finite gradients everywhere."""
    q, k, v = normal(0, (2, 20, 4, 16)), normal(1, (2, 20, 2, 16)), normal(2, (2, 20, 2, 16))
    ids = np.zeros((2, 20), np.int32)
    ids[:, 10:] = 1
    ids[1, 15:] = -1
    sinks = normal(3, (4, 2))
    mask_info = MaskInfo.from_segments(jnp.asarray(ids))

    def loss(q, k, v, sinks):
        out = attention(q, k, v, None, None, sinks, mask_info=mask_info, causal=True, cfg=FLASH)
        return jnp.sum(out * normal(4, out.shape)), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True))(q, k, v, sinks)
    assert np.all(np.asarray(out)[1, 15:] == 0.0) and np.abs(np.asarray(out)[1, :15]).sum() > 0
    assert np.all(np.asarray(grads[0])[1, 15:] == 0.0)
    assert all(np.all(np.isfinite(np.asarray(g))) for g in grads)


def _tile_visibility(geometry: Geometry) -> tuple[np.ndarray, np.ndarray]:
    """bool [row blocks, k blocks] twice, by brute force: tiles with some visible (query row, key) pair, and
    tiles whose every pair is visible (real rows and keys, inside the window)."""
    rows, cols = np.arange(geometry.num_q_blocks * geometry.block_q)[:, None], np.arange(
        geometry.num_k_blocks * geometry.block_k)[None, :]
    aligned = rows // geometry.group + geometry.offset
    seen = (rows < geometry.num_rows) & (cols < geometry.kv_len)
    if geometry.window_left is not None:
        seen &= cols >= aligned - geometry.window_left
    if geometry.window_right is not None:
        seen &= cols <= aligned + geometry.window_right
    tiles = seen.reshape(geometry.num_q_blocks, geometry.block_q, geometry.num_k_blocks, geometry.block_k)
    return tiles.any(axis=(1, 3)), tiles.all(axis=(1, 3))


@pytest.mark.parametrize(("q_len", "kv_len", "group"), [(37, 37, 1), (5, 70, 1), (70, 9, 1), (64, 128, 1), (37, 37, 3),
                                                         (1, 70, 4), (70, 9, 8), (64, 64, 2)])
@pytest.mark.parametrize("window", [(None, None), (None, 0), (7, 0), (3, 20), (0, 0), (40, None)])
def test_block_loops_cover_every_visible_tile(q_len, kv_len, group, window):
    """Each loop's [first, end) holds every tile with a visible pair (a missed one would drop keys), and its
    unmasked part only tiles whose every pair is visible (else hidden keys would count); rows hold the group's
    heads of each position."""
    geometry = Geometry(q_len, kv_len, 16, 32, group, *window, 1.0, None, False)
    any_seen, all_seen = _tile_visibility(geometry)
    for q_block, k_block in itertools.product(range(geometry.num_q_blocks), range(geometry.num_k_blocks)):
        for index, (bounds, whole) in ((k_block, _ranges(geometry.key_blocks, geometry.whole_key_blocks, q_block)),
                                       (q_block, _ranges(geometry.query_blocks, geometry.whole_query_blocks, k_block))):
            assert bounds[0] <= whole[0] <= whole[1] <= bounds[1]
            if any_seen[q_block, k_block]:
                assert bounds[0] <= index < bounds[1], f"tile ({q_block}, {k_block}) skipped"
            if whole[0] <= index < whole[1]:
                assert all_seen[q_block, k_block], f"tile ({q_block}, {k_block}) unmasked but not all visible"
    # And the loops skip and leave masks off: a long causal call visits about half of the tiles, most unmasked.
    if window == (None, 0) and q_len == kv_len == 64:
        ranges = [_ranges(geometry.key_blocks, geometry.whole_key_blocks, i) for i in range(geometry.num_q_blocks)]
        assert sum(end - first for (first, end), _ in ranges) < geometry.num_q_blocks * geometry.num_k_blocks
        assert sum(end - first for _, (first, end) in ranges) > 0


def _ranges(bounds_of, whole_of, block: int) -> tuple[tuple[int, int], tuple[int, int]]:
    bounds = bounds_of(jnp.int32(block))
    return tuple(int(x) for x in bounds), tuple(int(x) for x in whole_of(jnp.int32(block), *bounds))


def test_lowers_to_three_triton_kernels_for_an_h200(monkeypatch):
    """The whole gradient with every option the kernels take, lowered for an H200 (compiled, not interpreted):
    the forward and the two backward kernels, with the heuristic's blocks for bf16 at D = 128."""
    monkeypatch.setattr(pallas_flash, "interpret_here", lambda: False)
    q, k = (jax.ShapeDtypeStruct((1, 256, heads, 128), jnp.bfloat16) for heads in (8, 2))
    segments, sinks = jax.ShapeDtypeStruct((1, 256), jnp.int32), jax.ShapeDtypeStruct((8, 1), jnp.float32)

    def loss(q, k, v, segments, sinks):
        out = attention(q, k, v, None, None, sinks, mask_info=MaskInfo.from_segments(segments), causal=True,
                        logits_soft_cap=30.0, cfg=AttentionConfig("pallas", "flash"))
        return jnp.sum(out.astype(jnp.float32))

    text = lower_for_h200(jax.grad(loss, argnums=(0, 1, 2, 4)), q, k, k, segments, sinks)
    for name in ("hybrax_flash_attention_fwd", "hybrax_flash_attention_bwd_dq", "hybrax_flash_attention_bwd_dkdv"):
        assert f'name = "{name}"' in text
    assert "num_warps = 8" in text


def test_blocks_fit_short_sequences():
    """A decode step, one query of 32 heads on 2 kv heads against 70 keys: the 16 heads of a group fill one
    block of 16 rows (the Triton dot's minimum), not 128."""
    call = make_call(causal=True, q_len=1, kv_len=70, heads=32, kv_heads=2, dtype=jnp.bfloat16)
    problem = Attention().prepare(call.query, call.key, call.value, causal=True)
    geometry = pallas_flash._geometry(problem, 128, 64)
    assert (geometry.num_rows, geometry.block_q, geometry.block_k, geometry.num_k_blocks) == (16, 16, 64, 2)
