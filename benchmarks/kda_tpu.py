"""KDA chunked on one TPU: the Pallas Mosaic kernels (pallas_tpu:chunked) against our XLA chunked path.

Run on the TPU machine (JAX 0.10.2 there; jaxtyping and einops from its own index, see shared/tpu/README.md):

    PIP_CONFIG_FILE=/dev/null python3 -m pip install -q --isolated --only-binary=:all: \
        --index-url file:///opt/pypi/simple --target /tmp/site jaxtyping einops
    PYTHONPATH=$PYTHONPATH:/tmp/site:$PWD/src:$PWD python3 benchmarks/kda_tpu.py --tests

In one process (one program at a time may hold the chip): with --tests, tests/ops/kda/test_pallas_tpu*.py first,
their kernels compiled; then, bf16, per-channel decay, L2 norm inside, at each shape:
  sweep   the forward kernel alone (`kda_forward`) over chunk, value heads per grid step and the MXU passes
          of the scores and the solve, each with its error against the XLA fp32 path;
  bwd     the backward kernel alone (`kda_backward`, on the states the forward kept) over chunk and value
          heads per grid step, each with its gradients' errors against XLA's fp32 gradients;
  api     forward and forward+backward through `kernel_delta_attention`, ours (the Pallas forward and
          backward) and XLA's, each at chunk 64 and 128, with the full-size errors of ours against XLA on fp32
          inputs (out and final state; the gradients of q, k, v, g, beta, as err_grads); after the shapes, the
          same on PACKED: PACKED_DOCUMENTS documents of uneven lengths packed in one row (cu_seqlens);
  ablate  the forward kernel at its defaults with one piece at a time replaced by a stub of the same shapes
          (wrong results, for timing only): what each piece costs, as the machine has no profiler;
  gla     gated linear attention (recurrent_attention with a per-key gate gk), forward and forward+backward, ours
          (the kernels without the delta rule, opt-in) and XLA chunked, at each shape;
  decode  kda_decode_pool and kernel_delta_attention at T = 1 (B = 64, 16 heads of 128, fp32 states), ours
          and XLA's, per step of a jitted loop of DECODE_STEPS steps carrying the pool, with the state
          traffic in GB/s beside that of an elementwise pass over 512 MiB (read + write);
  steep   ours and XLA on gates of -5 sigmoid(N(0, 1) + b_c), b_c ~ N(0, 4) per channel (most sub-chunks then
          decay by more than exp(60) in some channel: the exact diagonal blocks run).
Times: median over rounds of the mean of back-to-back jitted calls (block_until_ready). A table is printed
after each part, the last one short; everything goes to $OUT/kda_tpu.json when OUT is set.
"""

from __future__ import annotations

import argparse
import functools
import itertools
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
from timing import print_table  # noqa: E402

from hybrax import KernelDeltaAttentionConfig, kernel_delta_attention  # noqa: E402
import hybrax.serving  # noqa: E402,F401  (registers the TPU pool step)
from hybrax.ops.recurrent.api import RecurrentAttentionConfig, recurrent_attention  # noqa: E402
from hybrax.ops.kda.pallas_tpu import chunk_fwd  # noqa: E402
from hybrax.ops.kda.pallas_tpu.chunk_bwd import kda_backward  # noqa: E402
from hybrax.ops.kda.pallas_tpu.chunk_fwd import kda_forward  # noqa: E402
from hybrax.ops.kda.pallas_tpu.chunk_gates import SUB, ChunkGates  # noqa: E402
from hybrax.serving import kda_decode_pool  # noqa: E402

SHAPES = [(1, 8192, 16, 128), (8, 2048, 16, 128)]
PACKED = (1, 32768, 16, 128)  # one row of packed documents (`packed_bounds`)
PACKED_DOCUMENTS = 16
SWEEP = [  # (chunk, block_heads, solve_passes)
    *itertools.product((64, 128), (1, 4), (1, 3)),
]
BWD_SWEEP = [*itertools.product((64, 128), (1, 2, 4))]  # (chunk, block_heads) of the backward kernel
API = [("pallas_tpu", 64), ("pallas_tpu", 128), ("xla", 64), ("xla", 128)]  # (platform, chunk)
START = time.perf_counter()
RESULTS: dict = {
    "device": None, "sweep": [], "bwd": [], "api": [], "steep": [], "gla": [], "decode": [], "errors": [],
}
DECODE = (64, 16, 128)  # requests, heads, head dim
DECODE_STEPS = 20


def log(text: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {text}", flush=True)


def save() -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "kda_tpu.json"), "w") as f:
            json.dump(RESULTS, f, indent=1)


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def time_ms(fn, *args, reps: int = 5, rounds: int = 5) -> float:
    """Median over rounds of the mean time of `reps` back-to-back calls (ms)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(reps):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / reps * 1e3)
    return statistics.median(times)


def make_inputs(seed: int, batch: int, length: int, heads: int, dim: int, steep: bool = False):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(keys[i], (batch, length, heads, dim), jnp.bfloat16) for i in range(3))
    if steep:  # a bounded gate (lower bound -5) with a bias per channel: some channels forget within a sub-chunk
        bias = 2.0 * jax.random.normal(jax.random.key(seed + 1), (heads, dim), jnp.float32)
        g = -5.0 * jax.nn.sigmoid(jax.random.normal(keys[3], (batch, length, heads, dim), jnp.float32) + bias)
    else:  # flash-linear-attention's benchmark gates
        g = -0.5 * jax.random.uniform(keys[3], (batch, length, heads, dim), jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, length, heads), jnp.float32))
    return q, k, v, g, beta


def packed_bounds(length: int, documents: int, seed: int = 0) -> jax.Array:
    """cu_seqlens of `documents` documents over `length` tokens, cut at uniform random tokens: uneven lengths
    (about exponential, the longest several times the mean), every token in a document."""
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, length), documents - 1, replace=False))
    return jnp.asarray(np.concatenate([[0], cuts, [length]]), jnp.int32)


def runners(platform: str, scale: float, chunk: int = 64, cu_seqlens=None):
    """(forward, forward+backward) through the public API at `chunk` (64: XLA's heuristic for the call's
    default hint), of packed documents with cu_seqlens."""
    cfg = KernelDeltaAttentionConfig(platform=platform, backend="chunked", chunk_size=chunk)

    def forward(q, k, v, g, beta):
        return kernel_delta_attention(q, k, v, beta, g, softmax_scale=scale, return_state=True, cfg=cfg,
                                      cu_seqlens=cu_seqlens)

    def loss(q, k, v, g, beta):
        o, final = forward(q, k, v, g, beta)
        return jnp.sum(o.astype(jnp.float32) * v.astype(jnp.float32)) + jnp.sum(final)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def reference_fp32(inputs, scale: float, cu_seqlens=None):
    """Our XLA chunked path on the inputs cast to fp32: the full-size reference."""
    q, k, v, g, beta = inputs
    forward, _ = runners("xla", scale, cu_seqlens=cu_seqlens)
    return forward(*(x.astype(jnp.float32) for x in (q, k, v)), g, beta)


def reference_grads_fp32(inputs, scale: float, cu_seqlens=None):
    """The gradients of `runners`' loss (q, k, v, g, beta) by our XLA chunked path on fp32 inputs."""
    q, k, v, g, beta = inputs
    _, backward = runners("xla", scale, cu_seqlens=cu_seqlens)
    return backward(*(x.astype(jnp.float32) for x in (q, k, v)), g, beta)


def grad_errors(grads, reference, names=("q", "k", "v", "g", "beta")) -> str:
    """Each gradient's relative error against the reference's, as "q 3e-03 k ..."."""
    return " ".join(f"{name} {rel(a.astype(jnp.float32), b):.0e}" for name, a, b in zip(names, grads, reference))


DEADLINE = [float("inf")]  # seconds since START after which no new part starts


def guarded(what: str, fn):
    if time.perf_counter() - START > DEADLINE[0]:
        log(f"{what} skipped: past the time budget")
        return None
    try:
        return fn()
    except Exception:  # noqa: BLE001  (a variant that fails to compile must not stop the others)
        text = traceback.format_exc()
        log(f"{what} FAILED:\n{text[-2500:]}")
        RESULTS["errors"].append({"what": what, "error": text[-2500:]})
        return None


def sweep(shape, inputs, reference, variants) -> None:
    scale = shape[3] ** -0.5
    q, k, v, g, beta = inputs
    for chunk, block_heads, passes in variants:
        name = f"C{chunk} heads{block_heads} passes{passes}"
        fn = jax.jit(lambda *x, c=chunk, b=block_heads, p=passes: kda_forward(
            *x, scale=scale, chunk=c, block_heads=b, solve_passes=p))

        def run():
            start = time.perf_counter()
            o, final = jax.block_until_ready(fn(q, k, v, g, beta))
            compile_s = time.perf_counter() - start
            return dict(shape=str(shape), variant=name, fwd_ms=round(time_ms(fn, q, k, v, g, beta), 3),
                        err_o=f"{rel(o.astype(jnp.float32), reference[0]):.1e}",
                        err_state=f"{rel(final, reference[1]):.1e}", first_call_s=round(compile_s, 1))

        row = guarded(f"sweep {shape} {name}", run)
        if row:
            RESULTS["sweep"].append(row)
            log(str(row))
            save()


def bwd_sweep(shape, inputs, reference_grads) -> None:
    """The backward kernel alone, on the forward's states and the cotangents of `runners`' loss."""
    scale = shape[3] ** -0.5
    q, k, v, g, beta = inputs
    for chunk, block_heads in BWD_SWEEP:
        name = f"C{chunk} heads{block_heads}"
        fn = jax.jit(lambda *x, c=chunk, b=block_heads: kda_backward(*x, scale=scale, chunk=c, block_heads=b))

        def run(chunk=chunk, fn=fn):
            _, final, states = kda_forward(q, k, v, g, beta, scale=scale, chunk=chunk, with_states=True)
            args = (q, k, v, g, beta, states, v, jnp.ones_like(final))  # the loss's cotangents: dO = v, dS = 1
            start = time.perf_counter()
            dq, dk, dv, dg, dbeta, _ = jax.block_until_ready(fn(*args))
            compile_s = time.perf_counter() - start
            # The loss's v gradient also holds o (the loss weighs o by v): v is left out.
            want = [reference_grads[i] for i in (0, 1, 3, 4)]
            errors = grad_errors((dq, dk, dg, dbeta), want, ("q", "k", "g", "beta"))
            return dict(shape=str(shape), variant=name, bwd_ms=round(time_ms(fn, *args), 3), err_grads=errors,
                        first_call_s=round(compile_s, 1))

        row = guarded(f"bwd {shape} {name}", run)
        if row:
            RESULTS["bwd"].append(row)
            log(str(row))
            save()


def api(shape, inputs, reference, steep: bool = False, reference_grads=None, cu_seqlens=None) -> None:
    """`cu_seqlens`: the inputs hold packed documents (the rows name how many)."""
    scale = shape[3] ** -0.5
    rows = RESULTS["steep" if steep else "api"]
    label = str(shape) if cu_seqlens is None else f"{shape} {cu_seqlens.shape[0] - 1} docs"
    for platform, chunk in API:
        forward, backward = runners(platform, scale, chunk, cu_seqlens)

        def run():
            o, final = forward(*inputs)
            row = dict(shape=label, platform=platform, chunk=chunk, fwd_ms=round(time_ms(forward, *inputs), 3),
                       err_o=f"{rel(o.astype(jnp.float32), reference[0]):.1e}",
                       err_state=f"{rel(final, reference[1]):.1e}")
            if not steep:
                row["fwd_bwd_ms"] = round(time_ms(backward, *inputs, reps=2, rounds=3), 3)
                if reference_grads is not None:
                    row["err_grads"] = grad_errors(backward(*inputs), reference_grads)
            return row

        row = guarded(f"{'steep' if steep else 'api'} {label} {platform} {chunk}", run)
        if row:
            rows.append(row)
            log(str(row))
            save()


def packed(shape, cu_seqlens) -> None:
    """The api part on packed documents, against XLA's fp32 results on them."""
    inputs = make_inputs(0, *shape)
    scale = shape[3] ** -0.5
    reference = guarded(f"reference {shape} packed", lambda: reference_fp32(inputs, scale, cu_seqlens))
    grads = guarded(f"reference gradients {shape} packed", lambda: reference_grads_fp32(inputs, scale, cu_seqlens))
    if reference is not None:
        api(shape, inputs, reference, reference_grads=grads, cu_seqlens=cu_seqlens)


def gla(shape, inputs) -> None:
    q, k, v, g, _ = inputs
    outputs = {}
    for platform in ("pallas_tpu", "xla"):
        cfg = RecurrentAttentionConfig(platform, "chunked", chunk_size=64)
        forward = jax.jit(lambda q, k, v, g, cfg=cfg: recurrent_attention(q, k, v, None, None, g, cfg=cfg))
        backward = jax.jit(jax.grad(lambda q, k, v, g, forward=forward: jnp.sum(
            forward(q, k, v, g).astype(jnp.float32) * v.astype(jnp.float32)), argnums=(0, 1, 2, 3)))

        def run(forward=forward, backward=backward):
            outputs[platform] = forward(q, k, v, g)
            return dict(shape=str(shape), platform=platform, fwd_ms=round(time_ms(forward, q, k, v, g), 3),
                        fwd_bwd_ms=round(time_ms(backward, q, k, v, g, reps=2, rounds=3), 3))

        row = guarded(f"gla {shape} {platform}", run)
        if row:
            RESULTS["gla"].append(row)
    if len(outputs) == 2:
        RESULTS["gla"][-2]["err_o_vs_xla"] = f"{rel(outputs['pallas_tpu'].astype(jnp.float32), outputs['xla']):.1e}"
    for row in RESULTS["gla"][-len(outputs):]:
        log(str(row))
    save()


def _square_zeros(q, k, gates, dot):
    return (jnp.zeros((q.shape[0], q.shape[0]), jnp.float32),) * 2


def _plain_gates(g):
    return ChunkGates(g, g, [g[m * SUB:m * SUB + 1] for m in range(g.shape[0] // SUB)])


STUBS = {  # piece -> (name in chunk_fwd, stub)
    "gate sums": ("chunk_gates", _plain_gates),
    "scores": ("factored_scores", _square_zeros),
    "steep check": ("is_steep", lambda gates: jnp.zeros((), bool)),
    "solve": ("unit_lower_inverse", lambda lower, dot: lower),
    "state step": ("state_step", lambda state, w, u, qg, aqk, kg, decay, dot: (u + w, state)),
}


def ablate(shape, inputs) -> None:
    """The default forward, then with each piece stubbed (a fresh jit each, so that no trace is shared)."""
    scale = shape[3] ** -0.5
    for piece in ("none", *STUBS):
        name, stub = STUBS.get(piece, (None, None))
        original = getattr(chunk_fwd, name) if name else None

        def run(name=name, stub=stub):
            fn = jax.jit(functools.partial(kda_forward.__wrapped__, scale=scale, chunk=128))
            if name:
                setattr(chunk_fwd, name, stub)
            try:
                jax.block_until_ready(fn(*inputs))
            finally:
                if name:
                    setattr(chunk_fwd, name, original)
            return dict(shape=str(shape), stubbed=piece, fwd_ms=round(time_ms(fn, *inputs), 3))

        row = guarded(f"ablate {shape} {piece}", run)
        if row:
            RESULTS.setdefault("ablate", []).append(row)
            log(str(row))
            save()


def elementwise_gbps() -> float:
    """Bytes read plus written per second by x * 2 + 1 over 512 MiB of fp32."""
    x = jnp.ones((2**27,), jnp.float32)
    fn = jax.jit(lambda x: x * 2 + 1)
    return 2 * x.size * 4 / (time_ms(fn, x) * 1e-3) / 1e9


def decode() -> None:
    batch, heads, dim = DECODE
    keys = jax.random.split(jax.random.key(2), 6)
    q, k, v = (jax.random.normal(keys[i], (batch, 1, heads, dim), jnp.bfloat16) for i in range(3))
    g = -0.5 * jax.random.uniform(keys[3], (batch, 1, heads, dim), jnp.float32)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, 1, heads), jnp.float32))
    pool = 0.1 * jax.random.normal(keys[5], (batch, heads, dim, dim), jnp.float32)
    slots = jnp.arange(batch, dtype=jnp.int32)
    state_bytes = 2 * pool.size * 4
    copy = guarded("decode elementwise pass", elementwise_gbps)
    for op, platform in itertools.product(("kda_decode_pool", "kernel_delta_attention"), ("pallas_tpu", "xla")):
        if op == "kda_decode_pool":
            step = lambda pool, p=platform: kda_decode_pool(q, k, v, g, beta, pool, slots, platform=p)  # noqa: E731
        else:
            step = lambda pool, p=platform: kernel_delta_attention(  # noqa: E731
                q, k, v, beta, g, pool, return_state=True, platform=p)

        @jax.jit
        def loop(pool, step=step):
            def body(_, carry):
                pool, total = carry
                o, pool = step(pool)
                return pool, total + jnp.sum(o[:, :, 0, :8].astype(jnp.float32))
            return jax.lax.fori_loop(0, DECODE_STEPS, body, (pool, jnp.zeros((), jnp.float32)))

        def run():
            final = loop(pool)[0]
            us = time_ms(loop, pool, reps=2, rounds=5) * 1e3 / DECODE_STEPS
            row = dict(op=op, platform=platform, us_per_step=round(us, 1), gbps=round(state_bytes / (us * 1e-6) / 1e9))
            if copy:
                row["pct_of_elementwise"] = round(100 * row["gbps"] / copy, 1)
            row["final"] = final
            return row

        row = guarded(f"decode {op} {platform}", run)
        if row:
            RESULTS["decode"].append(row)
    finals = {(r["op"], r["platform"]): r.pop("final") for r in RESULTS["decode"]}
    for r in RESULTS["decode"]:
        if (r["op"], "xla") in finals and r["platform"] != "xla":
            r["err_pool_vs_xla"] = f"{rel(finals[(r['op'], r['platform'])], finals[(r['op'], 'xla')]):.1e}"
        log(str(r))
    RESULTS["elementwise_gbps"] = copy
    save()


def run_tests() -> None:
    """The test files, in this process (one program may hold the chip), before anything else starts JAX's
    backends: tests/conftest.py sets the CPU device count."""
    import pytest

    log("tests/ops/kda/test_pallas_tpu*.py, compiled")
    code = pytest.main(["-q", "-x", "-p", "no:cacheprovider", "tests/ops/kda/test_pallas_tpu.py",
                        "tests/ops/kda/test_pallas_tpu_bwd.py", "tests/ops/kda/test_pallas_tpu_packed.py",
                        "tests/ops/kda/test_pallas_tpu_gla.py", "tests/ops/kda/test_pallas_tpu_decode.py"])
    RESULTS["tests_exit_code"] = int(code)
    save()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tests", action="store_true", help="run tests/ops/kda/test_pallas_tpu*.py first")
    parser.add_argument("--parts", default="sweep,ablate,bwd,api,steep,gla,decode")
    parser.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N of SHAPES")
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds after which no part starts")
    args = parser.parse_args()
    DEADLINE[0] = args.budget
    if args.tests:
        run_tests()
    RESULTS["device"] = str(jax.devices()[0].device_kind)
    log(f"jax {jax.__version__} on {RESULTS['device']}")
    parts = args.parts.split(",")
    variants = SWEEP
    for index, shape in enumerate(SHAPES[:args.shapes]):
        inputs = make_inputs(0, *shape)
        reference = reference_fp32(inputs, shape[3] ** -0.5)
        if "sweep" in parts:
            sweep(shape, inputs, reference, variants)
            # Later shapes: the two fastest variants of the first.
            timed = sorted((r["fwd_ms"], r["variant"]) for r in RESULTS["sweep"] if r["shape"] == str(SHAPES[0]))
            variants = [v for v in SWEEP if f"C{v[0]} heads{v[1]} passes{v[2]}" in [n for _, n in timed[:2]]]
        if "ablate" in parts and index == 0:
            ablate(shape, inputs)
        grads = None
        if "bwd" in parts or "api" in parts:
            grads = guarded(f"reference gradients {shape}", lambda: reference_grads_fp32(inputs, shape[3] ** -0.5))
        if "bwd" in parts and grads is not None:
            bwd_sweep(shape, inputs, grads)
        if "api" in parts:
            api(shape, inputs, reference, reference_grads=grads)
        if "gla" in parts:
            gla(shape, inputs)
        if "steep" in parts and index == 0:
            steep = make_inputs(1, *shape, steep=True)
            api(shape, steep, reference_fp32(steep, shape[3] ** -0.5), steep=True)
    if "api" in parts:
        packed(PACKED, packed_bounds(PACKED[1], PACKED_DOCUMENTS))
    if "decode" in parts:
        decode()
    tables = [
        ("sweep", ["shape", "variant", "fwd_ms", "err_o", "err_state", "first_call_s"]),
        ("ablate", ["shape", "stubbed", "fwd_ms"]),
        ("gla", ["shape", "platform", "fwd_ms", "fwd_bwd_ms", "err_o_vs_xla"]),
        ("decode", ["op", "platform", "us_per_step", "gbps", "pct_of_elementwise", "err_pool_vs_xla"]),
        ("steep", ["shape", "platform", "chunk", "fwd_ms", "err_o", "err_state"]),
        ("bwd", ["shape", "variant", "bwd_ms", "err_grads", "first_call_s"]),
        ("api", ["shape", "platform", "chunk", "fwd_ms", "fwd_bwd_ms", "err_o", "err_state", "err_grads"]),
    ]
    for part, columns in tables:
        if RESULTS.get(part):  # the parts that ran
            print_table(RESULTS[part], columns)
    if RESULTS["errors"]:
        print(f"{len(RESULTS['errors'])} part(s) failed: " + "; ".join(e["what"] for e in RESULTS["errors"]))


if __name__ == "__main__":
    main()
