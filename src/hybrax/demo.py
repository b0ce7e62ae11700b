"""The main job: run every operation on the default device, check it against its float64
reference and time it. `python -m hybrax.demo` prints one table.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from hybrax.core import relative_error


@dataclasses.dataclass(frozen=True)
class Case:
    operation: str
    implementation: str
    shape: str
    run: Callable[[], Any]  # a jitted call on fixed inputs
    reference: Callable[[], Any]  # float64 NumPy result of the same math


def pallas_chunk() -> int:
    """The chunk of the Pallas KDA / GLA rows: off the GPU the kernels run in interpret mode, where XLA's
    simplifier gives up (and logs an error line) on the 64 unrolled row stores of the chunk-64 gate cumsum;
    chunk 32 runs the same kernels quietly."""
    return 64 if jax.default_backend() == "gpu" else 32


def median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_cases() -> list[Case]:
    """Both XLA implementations and the Pallas flash kernels (interpret mode off the GPU) on causal GQA, and on a
    causal sliding window with sinks, a soft cap and fewer queries than keys (shape: batch x Tq x Tk x heads/kv
    heads x head dim)."""
    from hybrax import AttentionConfig, attention
    from hybrax.ops.attention.reference import attention as attention_reference

    rng = np.random.default_rng(0)
    batch, seq_len, heads, kv_heads, dim = 2, 256, 8, 2, 64

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    q, k, v = normal(batch, seq_len, heads, dim), normal(batch, seq_len, kv_heads, dim), normal(
        batch, seq_len, kv_heads, dim)
    calls = {  # name: (query, sinks, options)
        "causal": (q, None, dict(causal=True)),
        "swa,sinks": (q[:, -64:], normal(heads, 2), dict(causal=True, sliding_window=(96, 0), logits_soft_cap=20.0)),
    }
    cases = []
    for name, (query, sinks, options) in calls.items():
        for cfg in (AttentionConfig("xla", "direct"), AttentionConfig("xla", "blockwise", block_q=64, block_k=128),
                    AttentionConfig("pallas", "flash")):
            run = jax.jit(lambda q, k, v, s, cfg=cfg, options=options: attention(
                q, k, v, None, None, s, cfg=cfg, **options))
            cases.append(Case(
                "attention", f"{cfg.platform}:{cfg.backend}",
                f"{name} {batch}x{query.shape[1]}x{seq_len}x{heads}/{kv_heads}x{dim}",
                run=lambda run=run, query=query, sinks=sinks: run(query, k, v, sinks),
                reference=lambda query=query, sinks=sinks, options=options: attention_reference(
                    query, k, v, softmax_aux=sinks, **options),
            ))
    return cases


def recurrent_cases() -> list[Case]:
    """Both XLA implementations, per-key and per-head gates, packed sequences, and the Pallas path (interpret mode
    off the GPU) where it applies (gates along the key axis); outputs and final states."""
    from hybrax import RecurrentAttentionConfig, recurrent_attention
    from hybrax.ops.recurrent.reference import recurrent_reference

    rng = np.random.default_rng(0)
    batch, seq_len, heads, dim = 2, 256, 4, 64

    def normal(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    def log_decay(*shape):
        return (-np.logaddexp(0.0, -(rng.standard_normal(shape) + 3.0))).astype(np.float32)

    tokens = (batch, seq_len, heads, dim)
    q, k, v, h0 = normal(*tokens), normal(*tokens), normal(*tokens), normal(batch, heads, dim, dim)
    gk, gv = log_decay(*tokens), log_decay(*tokens)
    g, g_gamma = log_decay(1, seq_len, heads), log_decay(heads)
    cu_seqlens = np.array([0, 40, 40, 200, 256], np.int32)
    packed_h0 = normal(4, heads, dim, dim)
    calls = {
        "gk,h0": (q, k, v, None, None, gk, None, h0, None),
        "gk,gv,reverse": (q, k, v, None, None, gk, gv, None, None),
        "g,g_gamma,packed": (q[:1], k[:1], v[:1], g, g_gamma, None, None, packed_h0, cu_seqlens),
    }
    cases = []
    for gates, args in calls.items():
        reverse = "reverse" in gates
        configs = [RecurrentAttentionConfig("xla", "scan"), RecurrentAttentionConfig("xla", "chunked")]
        if gates == "gk,h0":  # see pallas_chunk
            configs.append(RecurrentAttentionConfig("pallas", "chunked", chunk_size=pallas_chunk()))
        for cfg in configs:
            run = jax.jit(lambda *a, cfg=cfg, reverse=reverse: recurrent_attention(
                *a, reverse=reverse, return_state=True, cfg=cfg))
            cases.append(Case(
                "recurrent_attention", f"{cfg.platform}:{cfg.backend}",
                f"{gates} {args[0].shape[0]}x{seq_len}x{heads}x{dim}",
                run=lambda run=run, args=args: run(*args),
                reference=lambda args=args, reverse=reverse: recurrent_reference(*args, reverse=reverse),
            ))
    return cases


def kda_cases() -> list[Case]:
    """KDA: the chunked, scan and Pallas-chunked (interpret mode off the GPU) implementations with
    per-channel decay, grouped value heads and a state; the fused bounded gate with beta logits on packed
    sequences; one decode step (kda_tkg, the NKI layout). Outputs and final states."""
    from hybrax import KernelDeltaAttentionConfig, kda_tkg, kernel_delta_attention
    from hybrax.ops.kda.reference import kda_reference, kda_tkg_reference

    rng = np.random.default_rng(0)
    batch, seq_len, heads, value_heads, dim = 2, 256, 2, 4, 64

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    q, k = normal(batch, seq_len, heads, dim), normal(batch, seq_len, heads, dim)
    v, h0 = normal(batch, seq_len, value_heads, dim), normal(batch, value_heads, dim, dim, scale=0.5)
    beta = 1 / (1 + np.exp(-normal(batch, seq_len, value_heads)))
    decay = (-np.logaddexp(0.0, -(normal(batch, seq_len, value_heads, dim) + 3.0))).astype(np.float32)
    gate = {"a_log": normal(value_heads, scale=0.5), "dt_bias": normal(value_heads, dim), "lower_bound": -5.0}
    packed = (q[:1], k[:1], v[:1], normal(1, seq_len, value_heads), normal(1, seq_len, value_heads, dim),
              normal(3, value_heads, dim, dim, scale=0.5))
    cu_seqlens = np.array([0, 100, 100, 256], np.int32)
    cases = []
    for cfg in (KernelDeltaAttentionConfig("xla", "chunked"), KernelDeltaAttentionConfig("xla", "scan"),
                KernelDeltaAttentionConfig("pallas", "chunked", chunk_size=pallas_chunk())):
        run = jax.jit(lambda *a, cfg=cfg: kernel_delta_attention(*a, return_state=True, cfg=cfg))
        cases.append(Case(
            "kernel_delta_attention", f"{cfg.platform}:{cfg.backend}",
            f"channel,gva,h0 {batch}x{seq_len}x{heads}/{value_heads}x{dim}",
            run=lambda run=run: run(q, k, v, beta, decay, h0),
            reference=lambda: kda_reference(q, k, v, beta, decay, h0),
        ))
    for cfg in (KernelDeltaAttentionConfig("xla", "chunked"), KernelDeltaAttentionConfig("xla", "scan")):
        run = jax.jit(lambda *a, cfg=cfg: kernel_delta_attention(
            *a, cu_seqlens=cu_seqlens, beta_is_logits=True, return_state=True, cfg=cfg, **gate))
        cases.append(Case(
            "kernel_delta_attention", f"xla:{cfg.backend}", f"gate,packed 1x{seq_len}x{heads}/{value_heads}x{dim}",
            run=lambda run=run: run(*packed),
            reference=lambda: kda_reference(*packed, cu_seqlens=cu_seqlens, beta_is_logits=True, **gate),
        ))
    requests, dk = 8, 128
    step = [normal(requests, dk, value_heads), normal(requests, dk, value_heads), normal(requests, value_heads, dk),
            normal(requests, dk, value_heads), normal(requests, 1, value_heads), normal(1, value_heads, scale=0.5),
            normal(dk, value_heads), np.zeros((requests, value_heads, dk), np.float32),
            normal(requests, value_heads, dk, dk, scale=0.5), np.full((1, 1), dk**-0.5, np.float32),
            np.full((1, 1), -5.0, np.float32)]
    without_out = step[:7] + step[8:]
    cases.append(Case(
        "kda_tkg", "xla step" if jax.default_backend() != "gpu" else "pallas decode",
        f"decode {requests}x{value_heads}x{dk}x{dk}", run=lambda: jax.jit(kda_tkg)(*step),
        reference=lambda: kda_tkg_reference(*without_out),
    ))
    return cases


def context_parallel_cases() -> list[Case]:
    """One packed batch of sequences split along time over every device (hybrax.parallel, inside shard_map):
    KDA, gated linear attention and causal attention against the float64 reference of the whole sequence."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from hybrax.ops.attention.reference import attention as attention_reference
    from hybrax.ops.kda.reference import kda_reference
    from hybrax.ops.recurrent.reference import recurrent_reference
    from hybrax.parallel import attention_context_parallel, kda_context_parallel, recurrent_context_parallel

    rng = np.random.default_rng(0)
    shards, seq_len, heads, dim = jax.device_count(), 256, 4, 64
    mesh, time_axis = jax.make_mesh((shards,), ("cp",)), P(None, "cp")
    cu_seqlens = np.array([0, 40, 40, 200, 256], np.int32)  # sequences cross the shards' boundaries

    def normal(*shape, scale=1.0):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    q, k, v = (normal(1, seq_len, heads, dim) for _ in range(3))
    beta = 1 / (1 + np.exp(-normal(1, seq_len, heads)))
    decay = (-np.logaddexp(0.0, -(normal(1, seq_len, heads, dim) + 3.0))).astype(np.float32)
    initial = normal(4, heads, dim, dim, scale=0.5)

    def sharded(fn, tokens):
        mapped = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=(time_axis,) * len(tokens), out_specs=time_axis))
        placed = [jax.device_put(x, NamedSharding(mesh, time_axis)) for x in tokens]
        return lambda: mapped(*placed)

    shape = f"packed {shards} shards 1x{seq_len}x{heads}x{dim}"
    return [
        Case("kda_context_parallel", "auto", shape,
             run=sharded(lambda *a: kda_context_parallel(*a, initial, axis_name="cp", cu_seqlens=cu_seqlens),
                         (q, k, v, beta, decay)),
             reference=lambda: kda_reference(q, k, v, beta, decay, initial, cu_seqlens=cu_seqlens)[0]),
        Case("recurrent_context_parallel", "auto", shape,
             run=sharded(lambda q, k, v, gk: recurrent_context_parallel(
                 q, k, v, None, None, gk, None, initial, axis_name="cp", cu_seqlens=cu_seqlens), (q, k, v, decay)),
             reference=lambda: recurrent_reference(q, k, v, None, None, decay, None, initial, cu_seqlens)[0]),
        Case("attention_context_parallel", "auto", f"causal {shards} shards 1x{seq_len}x{heads}x{dim}",
             run=sharded(lambda *a: attention_context_parallel(*a, axis_name="cp", causal=True), (q, k, v)),
             reference=lambda: attention_reference(q, k, v, causal=True)),
    ]


CASE_GROUPS: dict[str, Callable[[], list[Case]]] = {
    "attention": attention_cases, "recurrent": recurrent_cases, "kda": kda_cases, "parallel": context_parallel_cases,
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m hybrax.demo",
        description="Run every hybrax operation on the default device (the CPU unless JAX_PLATFORMS says otherwise), "
                    "check each against its float64 reference and time it; prints one table.")
    parser.add_argument("--only", choices=sorted(CASE_GROUPS), action="append",
                        help="run only this group of operations (repeatable); default: all")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if os.environ.get("JAX_PLATFORMS") == "cpu":  # devices for context parallelism (before JAX starts its backend)
        jax.config.update("jax_num_cpu_devices", 4)
    groups = args.only or list(CASE_GROUPS)
    cases = [case for group in CASE_GROUPS if group in groups for case in CASE_GROUPS[group]()]
    print(f"hybrax demo on {jax.devices()[0].device_kind} (jax {jax.__version__})")
    header = f"{'operation':<26} {'implementation':<22} {'shape':<28} {'rel. error':>10} {'time ms':>9}"
    print(header)
    print("-" * len(header))
    for case in cases:
        error = relative_error(jax.tree.map(np.asarray, case.run()), case.reference())
        ms = median_time(case.run) * 1e3
        print(f"{case.operation:<26} {case.implementation:<22} {case.shape:<28} {error:>10.2e} {ms:>9.3f}")


if __name__ == "__main__":
    main()
