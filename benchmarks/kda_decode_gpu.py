"""KDA decode on the H200: hybrax's Pallas step vs flash-linear-attention's fused_recurrent_kda.

Run on the GPU machine (fla-core 0.6.0 wheel carried in .whl/):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site:src python3 benchmarks/kda_decode_gpu.py

A decode step as a server runs it: seed 003's math (L2 norm, scale, bounded gate
lower_bound * sigmoid(exp(a_log) * (g + dt_bias)), beta sigmoid), bf16 q/k/v, fp32 state updated
in place. Ours runs `steps` steps inside one jitted lax.fori_loop (unrolled by UNROLL) with the
state donated, timed from the host around the whole loop and divided by the steps (one dispatch). fla
is timed two ways: one eager call per step (triton.testing.do_bench, as a PyTorch server without
graphs runs it) and a CUDA graph of `steps` calls replayed (its device time). Correctness first, at
full size: ours against hybrax's XLA step and against fla on the same inputs. The state traffic is
2 * B * H * K * V * 4 bytes per step; the ceiling is a measured 1 GiB device-to-device copy, and
`stream_us` the same loop moving the state in place with nothing else (S = 0.999 S): the floor of a step
at that size (at B <= 8 the state stays in the L2 cache, where the copy's bandwidth says nothing).
`--cuda 32x4,64x4` also times the CUDA kernel (`cuda_decode.cu`, K-first state) at those block_v x num_warps
launches, after checking each against the XLA step; a trailing `s` (`64x4s`) launches it without the programmatic
launch (each step waits for the one before to finish before it is scheduled). `--smoke` runs tiny shapes on the
CPU in interpret mode (the script's own check).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import copy_bandwidth, print_table  # noqa: E402

from hybrax import kernel_delta_attention  # noqa: E402
from hybrax.ops.kda.cuda_decode import fused_recurrent_decode_cuda  # noqa: E402
from hybrax.ops.kda.pallas_decode import fused_recurrent_decode  # noqa: E402

DIM = 128
LOWER_BOUND = -5.0
CASES = [(1, 32), (8, 32), (64, 32), (256, 32), (1024, 16)]  # (requests, heads)
STEPS = {1: 1000, 8: 500, 64: 200, 256: 60, 1024: 60}
# (block_v, num_warps). The first run (2026-12-02) also timed (16, 2), (64, 8), (128, 8): never the best.
VARIANTS = [(32, 2), (32, 4), (64, 2), (64, 4)]
# Steps per loop iteration: an XLA while loop on the GPU costs ~6 us per iteration (its predicate
# goes back to the host), which a server's step (all layers in one program) never pays.
UNROLL = 10


def make_inputs(seed: int, batch: int, heads: int, dim: int):
    keys = jax.random.split(jax.random.key(seed), 8)
    q, k, v = (jax.random.normal(keys[i], (batch, 1, heads, dim), jnp.bfloat16) for i in range(3))
    g = jax.random.normal(keys[3], (batch, 1, heads, dim), jnp.float32)
    beta = jax.random.normal(keys[4], (batch, 1, heads), jnp.float32)
    a_log = 0.5 * jax.random.normal(keys[5], (heads,), jnp.float32)
    dt_bias = jax.random.normal(keys[6], (heads, dim), jnp.float32)
    state = jax.random.normal(keys[7], (batch, heads, dim, dim), jnp.float32)
    return (q, k, v, g, beta, a_log, dt_bias), state


def launch_of(variant: tuple[int, ...]) -> dict[str, int]:
    return dict(zip(("block_v", "num_warps"), variant))


def variant_name(variant: tuple[int, ...]) -> str:
    return "".join(f"{prefix}{n}" for prefix, n in zip(("bv", "w"), variant))


def cuda_launch_of(variant: tuple[int, int, bool]) -> dict:
    return {**launch_of(variant[:2]), "programmatic_launch": variant[2]}


def cuda_variant_name(variant: tuple[int, int, bool]) -> str:
    return variant_name(variant[:2]) + ("" if variant[2] else "-serial")


def parse_cuda_launch(text: str) -> tuple[int, int, bool]:
    """'64x4' -> (64, 4, True); '64x4s' -> (64, 4, False): without the programmatic launch."""
    block_v, num_warps = (int(n) for n in text.removesuffix("s").split("x"))
    return block_v, num_warps, not text.endswith("s")


def pallas_step(inputs, state, slots=None, state_v_first=False, **launch):
    q, k, v, g, beta, a_log, dt_bias = inputs
    return fused_recurrent_decode(
        q, k, v, g, beta, state, slots, a_log=a_log, dt_bias=dt_bias, scale=q.shape[-1] ** -0.5,
        lower_bound=LOWER_BOUND, gate="bounded", beta_is_logits=True, state_v_first=state_v_first, **launch,
    )


def cuda_step(inputs, state, slots=None, **launch):
    q, k, v, g, beta, a_log, dt_bias = inputs
    return fused_recurrent_decode_cuda(
        q, k, v, g, beta, state, slots, a_log=a_log, dt_bias=dt_bias, scale=q.shape[-1] ** -0.5,
        lower_bound=LOWER_BOUND, gate="bounded", beta_is_logits=True, **launch,
    )


def xla_step(inputs, state):
    q, k, v, g, beta, a_log, dt_bias = inputs
    return kernel_delta_attention(
        q, k, v, beta, g, state, a_log=a_log, dt_bias=dt_bias, lower_bound=LOWER_BOUND, beta_is_logits=True,
        return_state=True, platform="xla",
    )


def stream_step(inputs, state):
    """The floor under any step: the state read and written in place once (S = 0.999 S, one XLA fusion),
    the barrier keeping the unrolled loop from folding the steps' scalings into one."""
    del inputs
    state = lax.optimization_barrier(state * 0.999)
    return state[:, :1, :1, :1], state


def decode_loop(step, steps: int, unroll: int = UNROLL):
    """`steps` decode steps in one jitted fori_loop (`unroll` per iteration), the state donated and
    carried in place; the last output comes back so that nothing is dead code."""

    @functools.partial(jax.jit, donate_argnums=(0,))
    def loop(state, inputs):
        o, state = step(inputs, state)
        state = lax.fori_loop(1, steps, lambda _, state: step(inputs, state)[1], state, unroll=unroll)
        return state, o

    return loop


def time_loop(loop, state, inputs, steps: int, repeats: int = 5) -> tuple[float, jax.Array]:
    """Median seconds per step over `repeats` runs of the loop (compiled and warmed first)."""
    state, _ = jax.block_until_ready(loop(state, inputs))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        state, _ = jax.block_until_ready(loop(state, inputs))
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times), state


def rel(a, b) -> float:
    a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


class Fla:
    """fla's fused_recurrent_kda on the same inputs (torch tensors sharing nothing with JAX)."""

    def __init__(self, inputs, state, state_v_first: bool = False):
        import torch
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        self.torch = torch
        to_torch = lambda x: torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32))).cuda()  # noqa: E731
        q, k, v, g, beta, a_log, dt_bias = (to_torch(x) for x in inputs)
        q, k, v = (x.to(torch.bfloat16) for x in (q, k, v))
        self.state = to_torch(state).contiguous()
        self.step = functools.partial(
            fused_recurrent_kda_fwd, q=q, k=k, v=v, g=g, beta=beta, A_log=a_log, dt_bias=dt_bias.reshape(-1),
            initial_state=self.state, scale=q.shape[-1] ** -0.5, inplace_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            lower_bound=LOWER_BOUND, state_v_first=state_v_first,
        )

    def one_step(self):
        o, state = self.step()
        return o.float().cpu().numpy(), state.cpu().numpy()

    def eager_s(self) -> float:
        from triton.testing import do_bench

        return do_bench(self.step, warmup=25, rep=200, return_mode="median") * 1e-3

    def graph_s(self, steps: int) -> float:
        torch = self.torch
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for _ in range(3):
                self.step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        # Thread-local capture: JAX's runtime threads may still free or launch work of the timings before
        # (a global-mode capture failed once that way, 2026-12-04, with the extras on).
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            for _ in range(steps):
                self.step()
        times = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) * 1e-3 / steps)
        return statistics.median(times)


def check(batch, heads, inputs, state, fla, launch, v_first: bool, cuda_launches) -> dict:
    """One step at full size: ours vs the XLA step, vs fla, the slot-pool and other-layout forms vs ours, and each
    CUDA launch (and its pool form) vs the XLA step."""
    transpose = lambda state: jnp.swapaxes(state, 2, 3)  # noqa: E731  (V-first <-> K-first)
    o, new = pallas_step(inputs, state, state_v_first=v_first, **launch)
    o_xla, new_xla = xla_step(inputs, transpose(state) if v_first else state)
    errors = {"err_o_vs_xla": rel(o, o_xla), "err_S_vs_xla": rel(transpose(new) if v_first else new, new_xla)}
    perm = jax.random.permutation(jax.random.key(batch), batch).astype(jnp.int32)
    pool = jnp.zeros_like(state).at[perm].set(state)
    o_pool, pool = pallas_step(inputs, pool, perm, state_v_first=v_first, **launch)
    errors["err_pool"] = max(rel(o_pool, o), rel(pool[perm], new))
    o_other, new_other = pallas_step(inputs, transpose(state), state_v_first=not v_first, **launch)
    errors["err_other_layout"] = max(rel(o_other, o), rel(transpose(new_other), new))
    for launch_cuda in cuda_launches:
        o_cuda, new_cuda = cuda_step(inputs, state, **cuda_launch_of(launch_cuda))
        name = cuda_variant_name(launch_cuda)
        errors[f"err_cuda_{name}"] = max(rel(o_cuda, o_xla), rel(new_cuda, new_xla))
        pool = jnp.zeros_like(state).at[perm].set(state)
        o_pool, pool = cuda_step(inputs, pool, perm, **cuda_launch_of(launch_cuda))
        errors[f"err_cuda_pool_{name}"] = max(rel(o_pool, o_xla), rel(pool[perm], new_xla))
    if fla is not None:
        o_fla, new_fla = fla.one_step()
        errors["err_o_vs_fla"], errors["err_S_vs_fla"] = rel(o, o_fla), rel(new, new_fla)
    return errors


def bench_case(
    batch: int, heads: int, steps: int, with_fla: bool, variants, interpret: bool, extras: bool, v_first: bool,
    cuda_launches=(), unroll: int = UNROLL,
) -> dict:
    """One (B, H): the check, then every launch in `variants` with the state in the chosen layout (fla too),
    the stream floor, and with `extras` the pool by slot and the XLA step (K-first only)."""
    inputs, state = make_inputs(batch * 7 + heads, batch, heads, DIM)
    if v_first:
        state = jnp.swapaxes(state, 2, 3)
    fla = Fla(inputs, state, state_v_first=v_first) if with_fla else None
    row = {"B": batch, "H": heads, "layout": "V-first" if v_first else "K-first"}
    check_launch = {"block_v": 32, "num_warps": 4, "interpret": interpret}
    row.update(check(batch, heads, inputs, state, fla, check_launch, v_first, cuda_launches))
    timings, failed = {}, {}
    for variant in variants:
        step = functools.partial(pallas_step, state_v_first=v_first, interpret=interpret, **launch_of(variant))
        try:
            timings[variant], state = time_loop(decode_loop(step, steps, unroll), state, inputs, steps)
        except Exception as exc:  # a launch that does not compile must not cost the sweep its other launches
            failed[variant_name(variant)] = f"{type(exc).__name__}: {exc}"[:200]
    cuda_timings = {}
    for variant in cuda_launches:
        step = functools.partial(cuda_step, **cuda_launch_of(variant))
        try:
            cuda_timings[variant], state = time_loop(decode_loop(step, steps, unroll), state, inputs, steps)
        except Exception as exc:
            failed["cuda_" + cuda_variant_name(variant)] = f"{type(exc).__name__}: {exc}"[:200]
    if cuda_timings:
        variant, best_cuda = min(cuda_timings.items(), key=lambda item: item[1])
        row["cuda_sweep_us"] = {cuda_variant_name(v): round(t * 1e6, 2) for v, t in cuda_timings.items()}
        row["cuda_us"], row["cuda_cfg"] = best_cuda * 1e6, cuda_variant_name(variant)
    if failed:
        row["failed"] = failed
    variant, best = min(timings.items(), key=lambda item: item[1])
    stream_seconds, state = time_loop(decode_loop(stream_step, steps, unroll), state, inputs, steps)
    row["stream_us"] = stream_seconds * 1e6
    row["sweep_us"] = {variant_name(variant): round(t * 1e6, 2) for variant, t in timings.items()}
    row["ours_us"], row["cfg"] = best * 1e6, variant_name(variant)
    launch = {"state_v_first": v_first, "interpret": interpret, **launch_of(variant)}
    slots = jax.random.permutation(jax.random.key(1), batch).astype(jnp.int32)
    pool_step = functools.partial(pallas_step, slots=slots, **launch)
    vfirst_step = functools.partial(pallas_step, **{**launch, "state_v_first": True})
    others = [("pool_us", pool_step)] if extras else []
    if extras and not v_first:  # the V-first form and the XLA step, beside a K-first state
        others += [("vfirst_us", vfirst_step), ("xla_us", xla_step)]
    for name, step in others:
        seconds, state = time_loop(decode_loop(step, steps, unroll), state, inputs, steps)
        row[name] = seconds * 1e6
    if fla is not None:
        row["fla_eager_us"] = fla.eager_s() * 1e6
        try:
            row["fla_graph_us"] = fla.graph_s(min(steps, 200)) * 1e6
        except Exception as exc:  # keep this case's other numbers and the next cases
            row["fla_graph_error"] = f"{type(exc).__name__}: {exc}"[:200]
    row["state_bytes"] = 2 * batch * heads * DIM * DIM * 4
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpret mode, no fla")
    parser.add_argument("--batches", help="which request counts of CASES to run, e.g. 64,256 (default: all)")
    parser.add_argument("--configs", help="block_v x num_warps to time, e.g. 32x2,64x4 "
                        "(default: VARIANTS)")
    parser.add_argument("--v-first", action="store_true", help="the state V-first [B, H, V, K], fla's too")
    parser.add_argument("--cuda", help="the CUDA kernel's block_v x num_warps launches to time too, e.g. 32x4,64x4 "
                        "(64x4s: without the programmatic launch)")
    parser.add_argument("--unroll", type=int, default=UNROLL, help="decode steps per loop iteration: a server's "
                        "program runs a step per layer with no loop between them (default %(default)s)")
    parser.add_argument("--no-fla", action="store_true", help="leave fla out (its timings do not depend on ours)")
    parser.add_argument("--no-extras", action="store_true", help="leave out the pool, V-first and XLA timings")
    parser.add_argument("--cases", help="requests x heads to run instead of CASES, e.g. 7x32,8x32 (a program wave "
                        "at B = 8: 924 of the 1024 programs of 32 columns fit on the H200 at once, all at B = 7)")
    args = parser.parse_args()
    variants, cuda_launches = VARIANTS, ()
    if args.cuda and (args.v_first or args.smoke):
        parser.error("--cuda takes the K-first state on a GPU (not --v-first or --smoke)")
    if args.cuda:
        cuda_launches = [parse_cuda_launch(c) for c in args.cuda.split(",")]
    if args.configs:
        variants = [tuple(int(n) for n in c.split("x")) for c in args.configs.split(",")]
    if args.smoke:
        cases, steps, variants, with_fla = [(1, 2), (2, 2)], {1: 2, 2: 2}, variants[:2], False
    else:
        cases, steps, with_fla = CASES, STEPS, not args.no_fla
        if args.batches:
            cases = [case for case in CASES if str(case[0]) in args.batches.split(",")]
        if args.cases:
            cases = [tuple(int(n) for n in case.split("x")) for case in args.cases.split(",")]
            steps = {batch: STEPS.get(batch, 500) for batch, _ in cases}
    copy = copy_bandwidth() if not args.smoke else float("nan")
    rows = []
    for batch, heads in cases:
        row = bench_case(batch, heads, steps[batch], with_fla, variants, args.smoke, not args.no_extras, args.v_first,
                         cuda_launches, args.unroll)
        bandwidth = row["state_bytes"] / (row["ours_us"] * 1e-6)
        row.update({"TB/s": round(bandwidth / 1e12, 2), "%copy": round(100 * bandwidth / copy, 1)})
        if "cuda_us" in row:
            row["cuda_%copy"] = round(100 * row["state_bytes"] / (row["cuda_us"] * 1e-6) / copy, 1)
        if with_fla and "fla_graph_us" in row:
            row["x_fla_eager"] = round(row["fla_eager_us"] / row["ours_us"], 2)
            row["x_fla_graph"] = round(row["fla_graph_us"] / row["ours_us"], 2)
            if "cuda_us" in row:
                row["cuda_x_fla_graph"] = round(row["fla_graph_us"] / row["cuda_us"], 2)
            row["fla_graph_TB/s"] = round(row["state_bytes"] / (row["fla_graph_us"] * 1e-6) / 1e12, 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kda_decode_gpu.json"), "w") as f:
            json.dump({"copy_TBps": copy / 1e12, "device": jax.devices()[0].device_kind, "rows": rows}, f, indent=1)
    for row in rows:
        for key in ("ours_us", "cuda_us", "stream_us", "pool_us", "vfirst_us", "xla_us", "fla_eager_us",
                    "fla_graph_us"):
            if key in row:
                row[key] = round(row[key], 2)
        row["max_err"] = f"{max(v for k, v in row.items() if k.startswith('err')):.1e}"
    print(f"copy bandwidth {copy / 1e12:.2f} TB/s on {jax.devices()[0].device_kind}")
    print_table(rows, ["B", "H", "layout", "cfg", "ours_us", "TB/s", "%copy", "cuda_cfg", "cuda_us", "cuda_%copy",
                       "cuda_x_fla_graph", "stream_us", "pool_us", "vfirst_us",
                       "xla_us", "fla_eager_us", "fla_graph_us", "fla_graph_TB/s", "x_fla_eager", "x_fla_graph",
                       "max_err"])


if __name__ == "__main__":
    main()
