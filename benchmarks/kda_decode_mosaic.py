"""Experiment (untimed in this form): the KDA decode step's state stream on Mosaic GPU with TMA, several CTAs per SM.

Run on the H200 on 2026-12-04 (third session, commit 9a67102, one CTA of one warpgroup per SM): 74-79% of
copy, 1-3 points under the Triton-lowered library step (BENCHMARKS.md): with the loads already
asynchronous, each SM still did one tile's serial math at a time (the reduction over K across the
warpgroup, then the update, then the second reduction). This version asks whether `ctas_per_sm` CTAs on
each SM (two or three: their shared memory and registers fit), each with its own tiles in flight, close
that, with the output's reduction taken from the decayed state alongside the update's (o = S'^T q +
(k . q) e, as the library step since 4b4c601) instead of after it.

The state math only (the small per-request vectors are prepared by XLA beforehand, 1/V of the state's
bytes): per (request b, value head h, value block j), with the [K, BV] state tile S (K-first, as the
library's pool):

    S' = S * exp(decay)[:, None];  e = beta * (v - S'^T k);  S = S' + k e^T;  o = S'^T q + (k . q) e

Each CTA (one warpgroup) walks `steps` consecutive tiles; `plgpu.emit_pipeline` keeps `stages` tiles'
TMA loads in flight, and each new tile leaves by a TMA store. The new state goes to a second buffer
(plgpu.kernel has no input/output aliasing): the same bytes per step as the in-place library kernel.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/kda_decode_mosaic.py [--swizzled]
    python3 benchmarks/kda_decode_mosaic.py --smoke [--swizzled]    # CPU, Mosaic GPU interpret mode
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_decode_gpu import LOWER_BOUND, decode_loop, make_inputs, pallas_step, rel, time_loop  # noqa: E402

from hybrax.ops.kda.gate import fused_gate  # noqa: E402
from hybrax.ops.kda.xla_scan import l2_normalize  # noqa: E402


def prologue(inputs):
    """The per-request vectors, fp32: q (normalized, scaled), k (normalized) [B, H, K]; the decay factor
    exp(g) [B, H, K]; v [B, H, V]; beta and k . q broadcast to [B, H, V] (vectors, so that the kernel
    reads no scalar)."""
    q, k, v, g, beta, a_log, dt_bias = inputs
    dk = q.shape[-1]
    q = l2_normalize(q[:, 0].astype(jnp.float32)) * dk ** -0.5
    k = l2_normalize(k[:, 0].astype(jnp.float32))
    decay = jnp.exp(fused_gate(g, a_log=a_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND)[:, 0].astype(jnp.float32))
    columns = functools.partial(jnp.broadcast_to, shape=v[:, 0].shape)
    beta, kq = columns(jax.nn.sigmoid(beta[:, 0])[..., None]), columns(jnp.sum(k * q, -1, keepdims=True))
    return q, k, decay, v[:, 0].astype(jnp.float32), beta, kq


def mosaic_step(inputs, state, *, block_v: int = 64, ctas: int = 132, stages: int = 2, swizzled: bool = False,
                interpret: bool = False):
    """`ctas`: SMS * CTAs per SM on the GPU (fewer, so that every CTA walks as many tiles)."""
    """One decode step; `swizzled` lays the state tiles out in shared memory as wgmma operands are
    ((8, 32) tiles, 128-byte swizzle), the other candidate layout for the registers' loads."""
    batch, heads, dk, dv = state.shape
    q, k, decay, v, beta, kq = prologue(inputs)
    blocks = dv // block_v
    tiles = batch * heads * blocks
    while tiles % ctas:  # every CTA walks the same number of tiles
        ctas -= 1
    steps = tiles // ctas

    def tile_of(step):
        """(b, h, j) of this CTA's step-th tile: consecutive tiles are neighbours in memory."""
        tile = lax.axis_index("cta") * steps + step
        return tile // (heads * blocks), (tile // blocks) % heads, tile % blocks

    def row_spec(width):  # a [width] vector of a [B, H, width] array: the tile's (b, h) row
        return pl.BlockSpec((None, None, width), lambda s: tile_of(s)[:2] + (0,))

    def column_spec():  # the tile's [BV] slice of a [B, H, V] array
        return pl.BlockSpec((None, None, block_v), lambda s: tile_of(s))

    transforms = (plgpu.TilingTransform((8, 32)), plgpu.SwizzleTransform(128)) if swizzled else ()
    state_spec = plgpu.BlockSpec(
        (None, None, dk, block_v), lambda s: (*tile_of(s)[:2], 0, tile_of(s)[2]), transforms=transforms
    )

    @functools.partial(
        plgpu.kernel,
        out_type=(jax.ShapeDtypeStruct(state.shape, jnp.float32), jax.ShapeDtypeStruct(v.shape, jnp.float32)),
        scratch_types=[plgpu.SMEM((block_v,), jnp.float32)],
        grid=(ctas,), grid_names=("cta",), interpret=plgpu.InterpretGPUParams() if interpret else None,
    )
    def kernel(state_gmem, q_gmem, k_gmem, decay_gmem, v_gmem, beta_gmem, kq_gmem, state_out_gmem, o_gmem, o_smem):
        def body(indices, state_smem, q_smem, k_smem, decay_smem, v_smem, beta_smem, kq_smem):
            # Explicit register layouts (Mosaic GPU's inference finds none by itself): the tile as a wgmma
            # accumulator, the [K] vectors as its rows' layout, the [BV] vectors as its columns'.
            rows, columns = plgpu.Layout.WGMMA.reduce(1), plgpu.Layout.WGMMA.reduce(0)
            keys, queries, decay = (plgpu.load(ref, layout=rows) for ref in (k_smem, q_smem, decay_smem))
            values, betas, kq = (plgpu.load(ref, layout=columns) for ref in (v_smem, beta_smem, kq_smem))
            tile = plgpu.load(state_smem, layout=plgpu.Layout.WGMMA)
            tile = tile * lax.broadcast_in_dim(decay, (dk, block_v), [0])
            keys_2d = lax.broadcast_in_dim(keys, (dk, block_v), [0])
            # Both reductions over K from the decayed tile, before the update.
            error = betas * (values - jnp.sum(tile * keys_2d, axis=0))
            decayed_out = jnp.sum(tile * lax.broadcast_in_dim(queries, (dk, block_v), [0]), axis=0)
            tile = tile + keys_2d * lax.broadcast_in_dim(error, (dk, block_v), [1])
            # The new tile goes back through its own input slot (emit_pipeline's output copies are
            # predicated, which GPU interpret mode cannot run); the slot is reused once this returns,
            # so the body waits until the stores have read shared memory.
            state_smem[...] = tile
            o_smem[...] = decayed_out + kq * error
            plgpu.commit_smem()
            b, h, j = tile_of(indices[0])
            cols = pl.ds(j * block_v, block_v)
            plgpu.copy_smem_to_gmem(state_smem, state_out_gmem.at[b, h, :, cols])
            plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[b, h, cols])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        plgpu.emit_pipeline(
            body, grid=(steps,),
            in_specs=[state_spec, *[row_spec(dk)] * 3, *[column_spec()] * 3],
            max_concurrent_steps=stages,
        )(state_gmem, q_gmem, k_gmem, decay_gmem, v_gmem, beta_gmem, kq_gmem)

    new_state, out = kernel(state, q, k, decay, v, beta, kq)
    return out[:, None].astype(inputs[0].dtype), new_state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, Mosaic GPU interpret mode")
    parser.add_argument("--cases", default="64x32,256x32,1024x16,8x32")
    parser.add_argument("--configs", default="64x2x1,64x2x2,64x3x2,32x3x2,32x2x3,32x3x3",
                        help="block_v x stages x CTAs per SM")
    parser.add_argument("--swizzled", action="store_true", help="also each config with swizzled shared memory")
    args = parser.parse_args()
    dim, cases = (64, "2x2") if args.smoke else (128, args.cases)
    from kda_decode_gpu import copy_bandwidth

    copy = float("nan") if args.smoke else copy_bandwidth()
    for case in cases.split(","):
        batch, heads = (int(n) for n in case.split("x"))
        inputs, state = make_inputs(batch, batch, heads, dim)
        o_ref, s_ref = pallas_step(inputs, state, block_v=min(64, dim), num_warps=4, interpret=args.smoke)
        steps = 2 if args.smoke else max(20, 12800 // batch)
        variants = {"library bv64w4": functools.partial(pallas_step, block_v=min(64, dim), num_warps=4,
                                                        interpret=args.smoke)}
        for config in args.configs.split(","):
            block_v, stages, per_sm = (int(n) for n in config.split("x"))
            for swizzled in (False, True) if args.swizzled else (False,):
                variants[f"mosaic bv{block_v}s{stages}c{per_sm}{' swizzled' if swizzled else ''}"] = functools.partial(
                    mosaic_step, block_v=min(block_v, dim), stages=stages, ctas=4 if args.smoke else 132 * per_sm,
                    swizzled=swizzled, interpret=args.smoke,
                )
        for name, step in variants.items():
            o, new = step(inputs, state)
            err = max(rel(o, o_ref), rel(new, s_ref))
            seconds, _ = time_loop(decode_loop(step, steps), jnp.copy(state), inputs, steps)
            bandwidth = 2 * state.size * 4 / seconds
            print(f"B={batch} H={heads} {name:27s} err {err:.1e}  {seconds * 1e6:9.2f} us  "
                  f"{bandwidth / 1e12:5.2f} TB/s  {100 * bandwidth / copy:5.1f}% of copy", flush=True)
            assert np.isfinite(err) and err < 1e-4, f"{name} disagrees with the library step: {err:.1e}"


if __name__ == "__main__":
    main()
