"""The main job: run every operation on the default device, check it against its float64
reference and time it. `python -m hybrax.demo` prints one table.
"""

from __future__ import annotations

import dataclasses
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


def median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_cases() -> list[Case]:
    """Both XLA implementations on causal GQA, and on a causal sliding window with sinks, a soft cap
    and fewer queries than keys (shape: batch x Tq x Tk x heads/kv heads x head dim)."""
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
        for cfg in (AttentionConfig("xla", "direct"), AttentionConfig("xla", "blockwise", block_q=64, block_k=128)):
            run = jax.jit(lambda q, k, v, s, cfg=cfg, options=options: attention(
                q, k, v, None, None, s, cfg=cfg, **options))
            cases.append(Case(
                "attention", f"xla:{cfg.backend}",
                f"{name} {batch}x{query.shape[1]}x{seq_len}x{heads}/{kv_heads}x{dim}",
                run=lambda run=run, query=query, sinks=sinks: run(query, k, v, sinks),
                reference=lambda query=query, sinks=sinks, options=options: attention_reference(
                    query, k, v, softmax_aux=sinks, **options),
            ))
    return cases


def recurrent_cases() -> list[Case]:
    """Both implementations, per-key and per-head gates, packed sequences; outputs and final states."""
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
        for cfg in (RecurrentAttentionConfig("xla", "scan"), RecurrentAttentionConfig("xla", "chunked")):
            run = jax.jit(lambda *a, cfg=cfg, reverse=reverse: recurrent_attention(
                *a, reverse=reverse, return_state=True, cfg=cfg))
            cases.append(Case(
                "recurrent_attention", f"xla:{cfg.backend}", f"{gates} {args[0].shape[0]}x{seq_len}x{heads}x{dim}",
                run=lambda run=run, args=args: run(*args),
                reference=lambda args=args, reverse=reverse: recurrent_reference(*args, reverse=reverse),
            ))
    return cases


def kda_cases() -> list[Case]:
    return []


def main() -> None:
    cases = attention_cases() + recurrent_cases() + kda_cases()
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
