"""Experiment (to delete once measured): what keeps the KDA decode step below the copy bandwidth.

Times, in the decode loop of `kda_decode_gpu.py`, the library's step beside variants of its kernel
(bounded gate, beta logits, K-first state, no slots) and two ceilings of the same loop:

    library      hybrax.ops.kda.pallas_decode.fused_recurrent_decode
    two_pass     the library's order: S' = decay S; e = v - S'^T k; S = S' + k (beta e)^T; o = S^T q
    one_pass     both reductions from S' at once: o = S'^T q + (q . k) beta e (one dependent reduction less)
    *_ef / *_efl the state loaded with eviction_policy="evict_first", stored so too / stored normally
                 (jax 0.11's Triton lowering rejects every cache_modifier: it looks ".cg" up without the dot)
    scale_tile   the same grid, loads and stores, no reductions: S = decay S (the kernel's own ceiling)
    xla_scale    XLA's in-place S = 0.999 S per step (the loop's ceiling)

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/kda_decode_variants.py
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_decode_gpu import LOWER_BOUND, copy_bandwidth, decode_loop, make_inputs, pallas_step, rel, time_loop  # noqa
from timing import print_table  # noqa: E402

from hybrax.ops.kda.pallas_decode import _log_decay  # noqa: E402
from hybrax.ops.kda.xla_scan import l2_normalize  # noqa: E402


def _variant_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, state_in_ref, o_ref, state_ref,
                    *, block_v, one_pass, load_kw, store_kw, scale_only, tiles):
    del state_in_ref
    j, head, b = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    for part in range(tiles):
        _variant_tile(q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, o_ref, state_ref,
                      pl.ds((j * tiles + part) * block_v, block_v), head, b,
                      one_pass=one_pass, load_kw=load_kw, store_kw=store_kw, scale_only=scale_only)


def _variant_tile(q_ref, k_ref, v_ref, g_ref, beta_ref, a_log_ref, dt_bias_ref, o_ref, state_ref, cols, head, b,
                  *, one_pass, load_kw, store_kw, scale_only):
    tile = state_ref.at[b, head, :, cols]
    decay = _log_decay(g_ref[b, 0, head, :].astype(jnp.float32), a_log_ref, dt_bias_ref, LOWER_BOUND, head, "bounded")
    state = pltriton.load(tile, **load_kw) * jnp.exp(decay)[:, None]
    if scale_only:
        pltriton.store(tile, state, **store_kw)
        return
    q = l2_normalize(q_ref[b, 0, head, :].astype(jnp.float32)) * q_ref.shape[-1] ** -0.5
    k = l2_normalize(k_ref[b, 0, head, :].astype(jnp.float32))
    beta = jax.nn.sigmoid(beta_ref[b, 0, head].astype(jnp.float32))
    error = v_ref[b, 0, head, cols].astype(jnp.float32) - jnp.sum(state * k[:, None], axis=0)
    if one_pass:
        out = jnp.sum(state * q[:, None], axis=0) + jnp.sum(q * k) * beta * error
        state = state + k[:, None] * (beta * error)[None, :]
    else:
        state = state + k[:, None] * (beta * error)[None, :]
        out = jnp.sum(state * q[:, None], axis=0)
    pltriton.store(tile, state, **store_kw)
    o_ref[b, 0, head, cols] = out.astype(o_ref.dtype)


def variant_step(inputs, state, *, block_v, num_warps, one_pass=False, evict="", scale_only=False, tiles=1,
                 interpret=False):
    q, k, v, g, beta, a_log, dt_bias = inputs
    batch, _, heads, dv = v.shape
    load_kw = {"eviction_policy": "evict_first"} if evict else {}
    store_kw = {"eviction_policy": "evict_first"} if evict == "ef" else {}
    kernel = functools.partial(_variant_kernel, block_v=block_v, one_pass=one_pass, load_kw=load_kw,
                               store_kw=store_kw, scale_only=scale_only, tiles=tiles)
    return pl.pallas_call(
        kernel, grid=(dv // block_v // tiles, heads, batch),
        out_shape=(jax.ShapeDtypeStruct(v.shape, q.dtype), jax.ShapeDtypeStruct(state.shape, jnp.float32)),
        input_output_aliases={7: 1},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="kda_decode_variant",
    )(q, k, v, g, beta, a_log, dt_bias, state)


def xla_scale(inputs, state):
    """The barrier keeps XLA from fusing the loop's steps into one multiply."""
    return inputs[2], lax.optimization_barrier(state * (1.0 - 1e-3 * inputs[3][0, 0, 0, 0]))


def _flat_scale_kernel(state_in_ref, state_ref):
    del state_in_ref
    state_ref[...] = state_ref[...] * 0.999


def flat_scale(inputs, state, *, block, num_warps, interpret=False):
    """The state as contiguous blocks of `block` floats, each scaled: Triton's plain streaming rate."""
    flat = state.reshape(-1, block)
    spec = pl.BlockSpec((1, block), lambda i: (i, 0))
    out = pl.pallas_call(
        _flat_scale_kernel, grid=(flat.shape[0],), in_specs=[spec], out_specs=spec,
        out_shape=jax.ShapeDtypeStruct(flat.shape, jnp.float32), input_output_aliases={0: 0},
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=1), interpret=interpret,
    )(flat)
    return inputs[2], out.reshape(state.shape)


def variants(block_v, num_warps, dim, interpret):
    launch = {"block_v": block_v, "num_warps": num_warps, "interpret": interpret}
    tag = f"bv{block_v}w{num_warps}"
    steps = {
        f"library {tag}": functools.partial(pallas_step, **launch),
        f"two_pass {tag}": functools.partial(variant_step, **launch),
        f"one_pass {tag}": functools.partial(variant_step, one_pass=True, **launch),
        f"one_pass_ef {tag}": functools.partial(variant_step, one_pass=True, evict="ef", **launch),
        f"vfirst {tag}": functools.partial(pallas_step, state_v_first=True, **launch),
        f"scale_tile {tag}": functools.partial(variant_step, scale_only=True, **launch),
    }
    if 2 * block_v <= dim:
        steps[f"one_pass_halves {tag}"] = functools.partial(variant_step, one_pass=True, tiles=2, **launch)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", default="64x32,256x32,1024x16")
    parser.add_argument("--configs", default="64x4,64x8,128x4,128x8")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpret mode")
    args = parser.parse_args()
    dim, cases = (16, "2x2") if args.smoke else (128, args.cases)
    copy = float("nan") if args.smoke else copy_bandwidth()
    rows = []
    for case in cases.split(","):
        batch, heads = (int(n) for n in case.split("x"))
        inputs, state0 = make_inputs(batch, batch, heads, dim)
        steps = 2 if args.smoke else max(20, 12800 // batch)
        o_ref, s_ref = pallas_step(inputs, state0, block_v=min(64, dim), num_warps=4, interpret=args.smoke)
        steps_to_time = {"xla_scale": xla_scale}
        for block, num_warps in ((4096, 4), (8192, 4), (16384, 8)):
            steps_to_time[f"flat_scale {block}w{num_warps}"] = functools.partial(
                flat_scale, block=min(block, dim * dim), num_warps=num_warps, interpret=args.smoke)
        for config in args.configs.split(","):
            block_v, num_warps = (int(n) for n in config.split("x"))
            steps_to_time.update(variants(min(block_v, dim), num_warps, dim, args.smoke))
        for name, step in steps_to_time.items():
            exact = not name.startswith(("scale", "xla", "flat"))
            if name.startswith("vfirst"):
                o, new = step(inputs, jnp.swapaxes(state0, 2, 3))
                err = f"{max(rel(o, o_ref), rel(jnp.swapaxes(new, 2, 3), s_ref)):.1e}"
            else:
                err = f"{max(rel(x, r) for x, r in zip(step(inputs, state0), (o_ref, s_ref))):.1e}" if exact else ""
            seconds, state = time_loop(decode_loop(step, steps), jnp.copy(state0), inputs, steps)
            bandwidth = 2 * state.size * 4 / seconds
            rows.append({"B": batch, "H": heads, "variant": name, "us": round(seconds * 1e6, 2),
                         "TB/s": round(bandwidth / 1e12, 2), "%copy": round(100 * bandwidth / copy, 1), "err": err})
            print(rows[-1], flush=True)
    print(f"copy {copy / 1e12:.2f} TB/s")
    print_table(rows, ["B", "H", "variant", "us", "TB/s", "%copy", "err"])


if __name__ == "__main__":
    main()
