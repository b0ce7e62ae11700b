"""KDA chunked forward on the H200: hybrax Pallas vs flash-linear-attention's Triton chunk_kda.

Run on the GPU machine (fla-core 0.6.0 wheel, and for --tokamax tokamax's, carried in .whl/):

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site:src:../shared/gpu/stubs python3 benchmarks/kda_chunk_gpu.py

For every shape it checks correctness at full size (ours and fla against an fp32 recurrence on the
same inputs), then times the forward of fla, ours (pallas:chunked) and our XLA chunked path, the
Pallas kernels one by one (first `--stages` shapes), and forward+backward with peak memory
(median of event-timed runs for torch, median over rounds of back-to-back jitted calls for JAX;
ours through the public `kernel_delta_attention`); with the fp32 check also our gradients against
our XLA chunked path's. With --tokamax also tokamax's `kimi_delta_attention` (xla_chunked). The GPU
machine lacks what tokamax imports; on 2026-12-04 this set, downloaded here into .whl/ (with
`pip download --no-deps --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all:`),
made it import there, with ../shared/gpu/stubs copied to .whl/stubs and put on PYTHONPATH:
tokamax==0.0.17 einshape immutabledict qwix absl-py pydantic pydantic-core typing-inspection
annotated-types typing_extensions flax msgpack rich pyyaml markdown-it-py mdurl pygments treescope
optax tqdm. fla autotunes ~80-100 s on its first call per head count and direction, unless
benchmarks/triton_autotune/ holds its results from an earlier run (`timing.seed_triton_cache`; each run
leaves them in $OUT/triton_autotune.tar to unpack there and commit); use --first, --shapes and the
--no-* flags to fit a 10-minute call. A short table is printed last; the full numbers go to
$OUT/kda_chunk_gpu.json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import print_table, save_triton_autotune, seed_triton_cache  # noqa: E402

from hybrax import KernelDeltaAttentionConfig, kernel_delta_attention  # noqa: E402
from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum  # noqa: E402
from hybrax.ops.kda.pallas_chunk_fwd import prepare_qk  # noqa: E402
from hybrax.ops.kda.pallas_chunk_grad import chunk_grad  # noqa: E402
from hybrax.ops.kda.pallas_chunk_intra_bwd import chunk_intra_bwd  # noqa: E402
from hybrax.ops.kda.pallas_chunk_intra import chunk_intra  # noqa: E402
from hybrax.ops.kda.pallas_chunk_state_bwd import chunk_state_bwd  # noqa: E402
from hybrax.ops.kda.pallas_chunk_state import chunk_state, chunk_state_output  # noqa: E402
from hybrax.ops.kda.pallas_chunk_wy import chunk_wy  # noqa: E402

SHAPES = [(1, 8192, 32, 128), (8, 2048, 16, 128), (1, 32768, 16, 128), (2, 16384, 16, 128)]


def make_inputs(seed: int, batch: int, length: int, heads: int, dim: int):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(keys[i], (batch, length, heads, dim), jnp.bfloat16) for i in range(3))
    # Per-channel log decay as in fla's own benchmark (fp32), beta through a sigmoid.
    g = -0.5 * jax.random.uniform(keys[3], (batch, length, heads, dim), jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, length, heads), jnp.float32))
    return q, k, v, g, beta


@jax.jit
def recurrence_fp32(q, k, v, g, beta):
    """Token-by-token fp32 recurrence (elementwise, no tf32): the full-size oracle."""
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6) * q.shape[-1] ** -0.5
    k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)

    def step(state, xs):
        qt, kt, vt, gt, bt = xs
        state = state * jnp.exp(gt)[..., None]
        error = vt - jnp.sum(state * kt[..., None], axis=-2)
        state = state + (bt[..., None] * kt)[..., None] * error[..., None, :]
        return state, jnp.sum(state * qt[..., None], axis=-2)

    batch, _, heads, dk = q.shape
    state = jnp.zeros((batch, heads, dk, v.shape[-1]), jnp.float32)
    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta))
    final, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), final


START = time.perf_counter()


def log(text: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {text}", file=sys.stderr, flush=True)


def rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def time_jax(fn, *args, reps: int = 20, rounds: int = 7) -> float:
    """Median over rounds of the mean time of `reps` back-to-back calls (ms)."""
    jax.block_until_ready(fn(*args))
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps * 1e3)
    return statistics.median(times)


def jax_memory_mb(fn, *args) -> float:
    """Arguments + outputs + temporaries of the compiled function (what it holds at its peak)."""
    stats = jax.jit(fn).lower(*args).compile().memory_analysis()
    return (stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes) / 2**20


def fla_runner(q, k, v, g, beta, backward: bool):
    import torch
    from fla.ops.kda import chunk_kda

    tensors = [torch.utils.dlpack.from_dlpack(x) for x in (q, k, v, g, beta)]
    if backward:
        tensors = [t.detach().clone().requires_grad_() for t in tensors]

    def forward():
        return chunk_kda(*tensors, use_qk_l2norm_in_kernel=True, output_final_state=True)

    if not backward:
        return forward
    d_out = torch.randn_like(tensors[2])
    return lambda: torch.autograd.grad(forward()[0], tensors, d_out)


def ours_runners(platform: str, scale: float, chunk: int = 64):
    """(forward, forward+backward) through the public API on one implementation."""
    cfg = KernelDeltaAttentionConfig(platform=platform, backend="chunked", chunk_size=chunk)

    def forward(q, k, v, g, beta):
        return kernel_delta_attention(q, k, v, beta, g, softmax_scale=scale, return_state=True, cfg=cfg)

    def loss(q, k, v, g, beta, d_out):
        return jnp.sum(forward(q, k, v, g, beta)[0].astype(jnp.float32) * d_out)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


# tokamax's KDA on a GPU: its xla_chunked path, which takes only its fused bounded gate
# (g = lower_bound * sigmoid(exp(a_log) * raw)); the raw gate below reproduces our per-channel g.
TOKAMAX_LOWER_BOUND = -5.0


def tokamax_runners(q, k, v, g, beta, scale: float):
    """(forward, forward+backward, their inputs) of tokamax's `kimi_delta_attention` (implementation
    xla_chunked) on our inputs: [H, B, T, K] layout, raw gate = logit(g / lower_bound), a_log = 0."""
    from tokamax._src.ops.kda.api import kimi_delta_attention as tokamax_kda

    share = jnp.clip(g / TOKAMAX_LOWER_BOUND, 1e-7, 1.0 - 1e-7)
    raw_gate = jnp.log(share) - jnp.log1p(-share)
    heads_first = lambda x: jnp.moveaxis(x, 2, 0)  # noqa: E731
    inputs = tuple(heads_first(x) for x in (q, k, v, raw_gate, beta))
    a_log = jnp.zeros((q.shape[2],), jnp.float32)

    def forward(q, k, v, gate, beta):
        return tokamax_kda(
            q, k, v, gate, beta, a_log=a_log, scale=scale, output_final_state=True, use_qk_l2norm=True,
            use_gate_in_kernel=True, lower_bound=TOKAMAX_LOWER_BOUND, implementation="xla_chunked",
        )

    def loss(q, k, v, gate, beta, d_out):
        return jnp.sum(forward(q, k, v, gate, beta)[0].astype(jnp.float32) * d_out)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4))), inputs


def time_tokamax(row: dict, q, k, v, g, beta, d_out, scale: float, backward: bool, reference) -> None:
    forward, forward_backward, inputs = tokamax_runners(q, k, v, g, beta, scale)
    out, _ = jax.block_until_ready(forward(*inputs))
    if reference is not None:
        row["err_tokamax"] = f"{rel(jnp.moveaxis(out, 0, 2).astype(jnp.float32), reference):.1e}"
    row["tokamax_ms"] = f"{time_jax(forward, *inputs):.3f}"
    if backward:
        row["tokamax_fb_ms"] = f"{time_jax(forward_backward, *inputs, jnp.moveaxis(d_out, 2, 0)):.3f}"
    log(f"tokamax {row}")


def time_fla_graph(row: dict, fla) -> None:
    """fla's forward replayed from a CUDA graph: its GPU time without PyTorch's launch overhead.

    Its eager forward at (1, 8192, 32, 128) read 1.076 ms in some calls and 1.46-1.72 ms in others, while its
    kernels' autotuned best times sum to ~1.06 ms; the graph's time says whether the host was the difference.
    """
    from triton.testing import do_bench_cudagraph

    try:
        row["fla_graph_ms"] = f"{do_bench_cudagraph(fla, rep=100, return_mode='median'):.3f}"
    except Exception as exc:  # a capture fla does not allow must not cost the row its other numbers
        row["fla_graph_error"] = f"{type(exc).__name__}: {exc}"[:120]


def torch_peak_mb(fn) -> float:
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def staged(row: dict, name: str, fn, *args):
    """Run once (compiling; logs how long), then time it into row[f"{name}_ms"]; returns the outputs."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    log(f"{name} compiled and ran in {time.perf_counter() - start:.1f}s")
    row[f"{name}_ms"] = f"{time_jax(fn, *args):.3f}"
    log(f"{name}: {row[f'{name}_ms']} ms")
    return out


# Launch settings tried per kernel with --sweep (the first of each is the pipeline's default).
# Earlier sweeps (BENCHMARKS.md) settled block sizes and warps; "sN" asks Triton for N pipeline stages
# (asynchronous copies of the next K slice or chunk while the current one computes).
# Stage 1 is latency-bound (4096 programs at (1, 8192, 32, 128), each a serial chain of small dots): fewer
# warps per program let more programs share an SM, which took the older separate solve kernel from 1.041
# (k32 w2) to 0.784 ms (k16 w2) on 2026-12-03; the fused kernel had only been timed at 4 warps.
INTRA_VARIANTS = {"k32w4s3": dict(block_k=32, num_warps=4, num_stages=3),
                  "k32w4s1": dict(block_k=32, num_warps=4, num_stages=1),
                  "k32w4s4": dict(block_k=32, num_warps=4, num_stages=4),
                  "k16w4s3": dict(block_k=16, num_warps=4, num_stages=3),
                  # 8 warps: no spills (offline ptxas for sm_90: 248 registers, against 255 and 492/404 bytes
                  # spilled at 4 warps), one program per SM instead of two.
                  "k32w8s3": dict(block_k=32, num_warps=8, num_stages=3),
                  "k32w8s1": dict(block_k=32, num_warps=8, num_stages=1)}
CUMSUM_VARIANTS = {"w4": dict(num_warps=4), "w2": dict(num_warps=2), "w8": dict(num_warps=8)}
INTRA_BWD_VARIANTS = {"k16w4s3": dict(block_k=16, num_warps=4, num_stages=3),
                      "k16w4s1": dict(block_k=16, num_warps=4, num_stages=1),
                      "k16w4s4": dict(block_k=16, num_warps=4, num_stages=4),
                      "k16w8s3": dict(block_k=16, num_warps=8, num_stages=3)}
GRAD_VARIANTS = {"k32v64w4s3": dict(block_k=32, block_v=64, num_warps=4, num_stages=3),
                 "k32v64w4s1": dict(block_k=32, block_v=64, num_warps=4, num_stages=1),
                 "k32v64w4s4": dict(block_k=32, block_v=64, num_warps=4, num_stages=4),
                 "k32v64w8s3": dict(block_k=32, block_v=64, num_warps=8, num_stages=3)}
# The state passes take 32 value columns per program, 16 below a wave of 32-column programs
# (`pallas_chunk_state.default_block_v`): the first variant of each is that choice.
STATE_VARIANTS = {"w4s3": dict(num_warps=4, num_stages=3),
                  "v32w4s3": dict(block_v=32, num_warps=4, num_stages=3),
                  "v16w4s3": dict(block_v=16, num_warps=4, num_stages=3),
                  "v32w4s2": dict(block_v=32, num_warps=4, num_stages=2),
                  "v32w4s4": dict(block_v=32, num_warps=4, num_stages=4)}
# The forward's state pass with the output: each chunk adds two dots off the recurrence's critical path,
# so fewer value columns per program (more programs in flight per SM) may hide them better.
STATE_OUTPUT_VARIANTS = {"w4": dict(num_warps=4),
                         "v32w4": dict(block_v=32, num_warps=4),
                         "v16w4": dict(block_v=16, num_warps=4),
                         "v16w2": dict(block_v=16, num_warps=2),
                         "v64w4": dict(block_v=64, num_warps=4),
                         "v32w8": dict(block_v=32, num_warps=8)}
STATE_BWD_VARIANTS = {"w4s3": dict(num_warps=4, num_stages=3),
                      "v32w4s3": dict(block_v=32, num_warps=4, num_stages=3),
                      "v16w4s3": dict(block_v=16, num_warps=4, num_stages=3),
                      "v32w4s2": dict(block_v=32, num_warps=4, num_stages=2)}
# The backward's recompute of w, u, kg, qg from the kept T (whole K and V per program: no loop to
# pipeline but the row loads).
WY_VARIANTS = {"w4s1": dict(num_warps=4, num_stages=1), "w4s3": dict(num_warps=4, num_stages=3)}


def time_variants(row: dict, kernel: str, variants: dict, swept: set, build, *args):
    """Time the default launch of `kernel` (the first of `variants`) and, when --sweep names it, the
    others, each checked against the default's outputs (largest relative difference into
    row[f"{kernel}_{name}_diff"]); returns the default's outputs. A variant that fails to compile is
    logged and skipped."""
    outputs = None
    for index, (name, settings) in enumerate(variants.items()):
        if index and kernel not in swept and "all" not in swept:
            break
        try:
            out = staged(row, f"{kernel}_{name}", jax.jit(build(settings)), *args)
        except Exception as exc:  # e.g. out of shared memory with more stages
            if not index:
                raise
            log(f"{kernel}_{name} failed: {type(exc).__name__}: {str(exc)[:200]}")
            row[f"{kernel}_{name}_ms"] = "failed"
            continue
        if index:
            diffs = [rel(a.astype(jnp.float32), b.astype(jnp.float32))
                     for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(outputs))]
            row[f"{kernel}_{name}_diff"] = f"{max(diffs):.0e}"
        else:
            outputs = out
    return outputs


def time_stages(row: dict, q, k, v, g, beta, scale: float, sweep: str) -> None:
    """Each kernel alone, on the inputs it sees inside the pipeline (the kernels named in --sweep: each
    launch variant)."""
    chunk = 64
    swept = set(sweep.split(","))
    gates = time_variants(
        row, "cumsum", CUMSUM_VARIANTS, swept, lambda s: functools.partial(chunk_local_cumsum, chunk=chunk, **s), g
    )
    (inverse, aqk), (w, u, kg, qg, decay) = time_variants(  # q, k normalized inside, as the forward calls it
        row, "intra", INTRA_VARIANTS, swept,
        lambda s: functools.partial(chunk_intra, scale=scale, l2_normalize=True, chunk=chunk, **s),
        q, k, v, gates, beta,
    )
    qn, kn = jax.jit(functools.partial(prepare_qk, scale=scale, normalize=True))(q, k)  # what the backward reads
    h, v_new, _ = time_variants(
        row, "state", STATE_VARIANTS, swept, lambda s: lambda *a: chunk_state(*a, None, **s), w, u, kg, decay
    )
    time_variants(
        row, "state_output", STATE_OUTPUT_VARIANTS, swept, lambda s: lambda *a: chunk_state_output(*a, None, **s),
        w, u, kg, decay, qg, aqk,
    )
    # The backward's kernels, on a random output cotangent.
    d_out = jax.random.normal(jax.random.key(2), v.shape, v.dtype)
    time_variants(
        row, "wy", WY_VARIANTS, swept, lambda s: functools.partial(chunk_wy, chunk=chunk, **s),
        qn, kn, v, gates, beta, inverse,
    )
    dh, dv_new, _ = time_variants(
        row, "state_bwd", STATE_BWD_VARIANTS, swept, lambda s: lambda *a: chunk_state_bwd(*a, None, **s),
        qg, kg, w, aqk, d_out, decay,
    )
    *_, daqk, dakk = time_variants(
        row, "grad", GRAD_VARIANTS, swept, lambda s: functools.partial(chunk_grad, chunk=chunk, **s),
        qn, kn, v, gates, beta, inverse, h, dh, v_new, dv_new, d_out,
    )
    time_variants(
        row, "intra_bwd", INTRA_BWD_VARIANTS, swept, lambda s: functools.partial(chunk_intra_bwd, chunk=chunk, **s),
        qn, kn, gates, beta, daqk, dakk,
    )
    log(f"{row}")


def bench_shape(shape, args, index: int) -> dict:
    from triton.testing import do_bench

    batch, length, heads, dim = shape
    row = {"shape": f"({batch},{length},{heads},{dim})"}
    q, k, v, g, beta = make_inputs(0, *shape)
    d_out = jax.random.normal(jax.random.key(1), v.shape, jnp.float32)
    scale = dim ** -0.5
    ours, ours_grad = ours_runners("pallas", scale, args.chunk)
    if index < args.stages:
        time_stages(row, q, k, v, g, beta, scale, args.sweep)

    out, final = jax.block_until_ready(ours(q, k, v, g, beta))
    log(f"{shape} ours compiled and ran")
    if not args.no_check:
        ref_out, ref_final = jax.block_until_ready(recurrence_fp32(q, k, v, g, beta))
        row["err_ours"] = f"{rel(out.astype(jnp.float32), ref_out):.1e}"
        row["err_state"] = f"{rel(final, ref_final):.1e}"
    row["pallas_ms"] = f"{time_jax(ours, q, k, v, g, beta):.3f}"
    log(f"{shape} {row}")
    if not args.no_fla:
        fla = fla_runner(q, k, v, g, beta, backward=False)
        if not args.no_check:
            fla_out = fla()[0]
            fla_out = np.asarray(jnp.from_dlpack(fla_out.float().contiguous()))
            row["err_fla"] = f"{rel(fla_out, ref_out):.1e}"
        fla_ms = do_bench(fla, warmup=25, rep=100, return_mode="median")
        row["fla_ms"] = f"{fla_ms:.3f}"
        row["ratio"] = f"{float(row['pallas_ms']) / fla_ms:.2f}"
        time_fla_graph(row, fla)
        log(f"{shape} {row}")
    if not args.no_xla:
        xla, xla_grad = ours_runners("xla", scale)
        row["xla_ms"] = f"{time_jax(xla, q, k, v, g, beta):.3f}"
        log(f"{shape} {row}")
    if args.tokamax:
        try:  # an anchor that fails (its wheels, its limits) must not cost the row its other numbers
            time_tokamax(row, q, k, v, g, beta, d_out, scale, not args.no_bwd, None if args.no_check else ref_out)
        except Exception as exc:
            traceback.print_exc()
            row["tokamax_error"] = f"{type(exc).__name__}: {exc}"[:120]
    if not args.no_bwd:
        grads = jax.block_until_ready(ours_grad(q, k, v, g, beta, d_out))
        log(f"{shape} ours backward compiled and ran")
        if not args.no_check:
            xla_grads = jax.block_until_ready(ours_runners("xla", scale)[1](q, k, v, g, beta, d_out))
            errors = [rel(a.astype(jnp.float32), b.astype(jnp.float32)) for a, b in zip(grads, xla_grads)]
            row["err_grads"] = "/".join(f"{e:.0e}" for e in errors)  # dq/dk/dv/dg/dbeta vs XLA chunked
            del xla_grads
        row["pallas_fb_ms"] = f"{time_jax(ours_grad, q, k, v, g, beta, d_out):.3f}"
        row["pallas_fb_MB"] = f"{jax_memory_mb(ours_grad, q, k, v, g, beta, d_out):.0f}"
        if not args.no_xla:
            row["xla_fb_ms"] = f"{time_jax(xla_grad, q, k, v, g, beta, d_out):.3f}"
        if not args.no_fla:
            fla_fb = fla_runner(q, k, v, g, beta, backward=True)
            fla_fb_ms = do_bench(fla_fb, warmup=10, rep=50, return_mode="median")
            row["fla_fb_ms"] = f"{fla_fb_ms:.3f}"
            row["fb_ratio"] = f"{float(row['pallas_fb_ms']) / fla_fb_ms:.2f}"
            row["fla_fb_MB"] = f"{torch_peak_mb(fla_fb):.0f}"
        log(f"{shape} {row}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-check", action="store_true", help="skip the fp32 recurrence check")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--no-xla", action="store_true", help="skip our XLA chunked path")
    parser.add_argument("--no-bwd", action="store_true", help="forward only")
    parser.add_argument("--tokamax", action="store_true", help="also tokamax's xla_chunked KDA (its wheels carried)")
    parser.add_argument("--stages", type=int, default=1, help="time the Pallas stages on this many shapes")
    parser.add_argument("--sweep", default="", help="kernels whose launch variants to time: all, or some of "
                        "cumsum,intra,state,state_output,wy,state_bwd,grad,intra_bwd (comma-separated)")
    parser.add_argument("--first", type=int, default=0, help="skip the SHAPES before this index")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="how many of SHAPES to run")
    parser.add_argument("--chunk", type=int, default=64, help="our Pallas path's chunk size (the stages use 64)")
    args = parser.parse_args()
    triton_cache = seed_triton_cache()
    import torch

    print(f"GPU: {torch.cuda.get_device_name()}  jax {jax.__version__}  torch {torch.__version__}", flush=True)
    rows = []
    for shape in SHAPES[args.first : args.first + args.shapes]:
        try:
            rows.append(bench_shape(shape, args, len(rows)))
        except Exception as exc:  # keep the other shapes' numbers
            traceback.print_exc()
            rows.append({"shape": str(shape), "error": f"{type(exc).__name__}: {exc}"[:200]})
        print(json.dumps(rows[-1]), flush=True)
        save_triton_autotune(triton_cache)  # after every shape: a call cut off by its time limit keeps them
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kda_chunk_gpu.json"), "w") as f:
            json.dump(rows, f, indent=1)
    default = lambda kernel, variants: f"{kernel}_{next(iter(variants))}_ms"  # noqa: E731
    columns = ["shape", "err_ours", "err_state", "err_fla", "err_tokamax", "fla_ms", "fla_graph_ms", "pallas_ms",
               "ratio", "xla_ms", "tokamax_ms", "tokamax_fb_ms",
               default("cumsum", CUMSUM_VARIANTS), default("intra", INTRA_VARIANTS), default("state", STATE_VARIANTS),
               default("state_output", STATE_OUTPUT_VARIANTS),
               default("wy", WY_VARIANTS), default("state_bwd", STATE_BWD_VARIANTS), default("grad", GRAD_VARIANTS),
               default("intra_bwd", INTRA_BWD_VARIANTS),
               "err_grads", "fla_fb_ms", "pallas_fb_ms", "fb_ratio", "xla_fb_ms", "fla_fb_MB", "pallas_fb_MB",
               "tokamax_error", "error"]
    print_table(rows, [c for c in columns if any(c in r for r in rows)])
    for row in rows:
        variants = [name for name in row if name.startswith(("cumsum_", "intra_", "state", "grad_", "wy_"))]
        if len(variants) > 3:
            print(row["shape"], "  ".join(f"{name.removesuffix('_ms')} {row[name]}" for name in variants))


if __name__ == "__main__":
    main()
