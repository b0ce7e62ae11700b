"""The KDA decode kernels at every launch: µs per step in the decode loop, against the stream floor.

A diagnostic beside `python -m hybrax.bench --op kda_decode` (which times the library's own launch through the
serving pool): the Pallas step (`pallas_decode.fused_recurrent_decode`) at each `block_v x num_warps` launch,
K-first or V-first state, and the CUDA step (`cuda_decode.fused_recurrent_decode_cuda`, K-first) at each launch,
with or without the programmatic launch (a trailing `s`: each step waits for the one before to finish). The plain
step (request b owns state row b), the bounded gate, beta sigmoid and L2 norm fused; every launch is first
checked against the XLA step on the same inputs. Same loop and floor as the benchmark (hybrax.bench.workloads
.decode).

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 tools/kda_decode_launches.py \
        [--shapes kda_decode-64x32x128,...] [--pallas 32x4,64x4] [--cuda 64x4,64x4s] [--v-first] [--unroll 10]
    PYTHONPATH=src python3 tools/kda_decode_launches.py --smoke    # CPU, interpret mode, tiny, Pallas only
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from hybrax import kernel_delta_attention
from hybrax.bench.shapes import BENCHMARK_SHAPES, parse
from hybrax.bench.timer import SMOKE_BUDGET, Budget, time_jax
from hybrax.bench.workloads import decode
from hybrax.bench.workloads.kda_decode import LOWER_BOUND, make_inputs
from hybrax.ops.kda.decode.cuda import fused_recurrent_decode_cuda
from hybrax.ops.kda.decode.pallas_gpu import fused_recurrent_decode


def launches(text: str) -> list[tuple[int, int, bool]]:
    """'32x4,64x4s' -> [(32, 4, True), (64, 4, False)]: block_v, num_warps, programmatic launch (CUDA)."""
    found = []
    for item in filter(None, text.split(",")):
        block_v, num_warps = (int(n) for n in item.removesuffix("s").split("x"))
        found.append((block_v, num_warps, not item.endswith("s")))
    return found


def fused(inputs: dict) -> dict:
    return dict(a_log=inputs["a_log"], dt_bias=inputs["dt_bias"], scale=inputs["q"].shape[-1] ** -0.5,
                lower_bound=LOWER_BOUND, gate="bounded", beta_is_logits=True)


def xla_step(inputs: dict, state: jax.Array) -> tuple[jax.Array, jax.Array]:
    return kernel_delta_attention(inputs["q"], inputs["k"], inputs["v"], inputs["beta"], inputs["g"], state,
                                  a_log=inputs["a_log"], dt_bias=inputs["dt_bias"], lower_bound=LOWER_BOUND,
                                  beta_is_logits=True, return_state=True, platform="xla")


def relative(a: jax.Array, b: jax.Array) -> float:
    a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def kernels(args: argparse.Namespace, inputs: dict) -> dict:
    """name -> step(state, inputs) of every launch asked for (the state in the layout the launch takes)."""
    names = ("q", "k", "v", "g", "beta")
    steps = {}
    for block_v, num_warps, _ in launches(args.pallas):
        launch = dict(block_v=block_v, num_warps=num_warps, state_v_first=args.v_first, interpret=args.smoke)
        steps[f"pallas bv{block_v} w{num_warps}"] = lambda state, x, launch=launch: fused_recurrent_decode(
            *(x[n] for n in names), state, **fused(x), **launch)
    for block_v, num_warps, programmatic in launches(args.cuda):
        launch = dict(block_v=block_v, num_warps=num_warps, programmatic_launch=programmatic)
        name = f"cuda bv{block_v} w{num_warps}" + ("" if programmatic else " serial")
        steps[name] = lambda state, x, launch=launch: fused_recurrent_decode_cuda(
            *(x[n] for n in names), state, **fused(x), **launch)
    return steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(BENCHMARK_SHAPES["kda_decode"]))
    parser.add_argument("--pallas", default="32x4,64x4", help="Pallas launches, block_v x num_warps")
    parser.add_argument("--cuda", default="", help="CUDA launches, e.g. 64x4,64x4s (s: no programmatic launch)")
    parser.add_argument("--v-first", action="store_true", help="the Pallas state V-first [B, H, V, K]")
    parser.add_argument("--unroll", type=int, default=decode.UNROLL, help="decode steps per loop iteration")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, interpret mode")
    args = parser.parse_args()
    if args.smoke:
        args.shapes, args.cuda = "kda_decode-2x2x16", ""
    budget = SMOKE_BUDGET if args.smoke else Budget(rounds=5)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    for shape in map(parse, args.shapes.split(",")):
        inputs = make_inputs(shape, jnp.bfloat16)
        state = inputs["state"]
        steps, _ = decode.steps_for(shape.batch * shape.heads)
        loop_steps = (steps, 1 if args.smoke else args.unroll)
        floor = decode.carried_call(decode.stream_step, state.copy(), None, loop_steps)  # the loops donate
        floor_us = time_jax(floor.run, budget).median_ms * 1e3 / floor.steps
        state_bytes = 2 * state.size * 4
        want_o, want_state = jax.jit(xla_step)(inputs, state)
        print(f"\n{shape.name}: stream floor {floor_us:.2f} µs per step ({state_bytes / floor_us / 1e6:.0f} GB/s)")
        for name, step in kernels(args, inputs).items():
            layout = (lambda s: jnp.swapaxes(s, 2, 3)) if args.v_first and name.startswith("pallas") else (lambda s: s)
            o, new = jax.jit(step)(layout(state), inputs)
            error = max(relative(o, want_o), relative(layout(new), want_state))
            call = decode.carried_call(step, layout(state).copy(), inputs, loop_steps)
            us = time_jax(call.run, budget).median_ms * 1e3 / call.steps
            print(f"  {name:24s} {us:9.2f} µs  {state_bytes / us / 1e6:6.0f} GB/s  {100 * floor_us / us:5.1f}% of "
                  f"the floor  error vs XLA {error:.1e}", flush=True)


if __name__ == "__main__":
    main()
