"""KDA chunked over packed sequences (cu_seqlens) on the H200: hybrax Pallas vs flash-linear-attention.

Training packs sequences of many lengths into one row; both libraries then take cu_seqlens. Ours lays each
sequence out from a chunk boundary and its state passes restart per sequence (`pallas_chunked`); fla's
`chunk_kda` takes cu_seqlens natively. Same inputs (bf16, per-channel g as `kda_chunk_gpu.make_inputs`,
l2norm in the kernel), forward and forward+backward, median timings, and the outputs of both against our
XLA chunked path on the same packed inputs:

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site:src:.whl/stubs python3 benchmarks/kda_varlen_gpu.py
    python3 benchmarks/kda_varlen_gpu.py --smoke    # CPU, interpret mode, small, no fla

fla's first varlen run autotunes for minutes (over 200 s for the first case on 2026-12-04): the autotuning
results come back in $OUT/triton_autotune.tar after every case; unpack them into benchmarks/triton_autotune/.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_chunk_gpu import log, make_inputs, rel, time_jax  # noqa: E402
from timing import print_table, save_triton_autotune, seed_triton_cache  # noqa: E402

from hybrax import KernelDeltaAttentionConfig, kernel_delta_attention  # noqa: E402

# (total tokens, heads, sequences): 32k tokens in rows of mean length 2048 and 512, at 16 and 32 heads.
CASES = [(32768, 16, 16), (32768, 32, 64)]
SMOKE_CASES = [(200, 2, 5)]


def sequence_bounds(total: int, count: int, seed: int = 0) -> np.ndarray:
    """cu_seqlens [count + 1] int32 of `count` sequences of random lengths (>= 1) filling `total` tokens."""
    cuts = np.sort(np.random.default_rng(seed).choice(np.arange(1, total), count - 1, replace=False))
    return np.concatenate([[0], cuts, [total]]).astype(np.int32)


def ours(platform: str, cu_seqlens: np.ndarray, scale: float):
    """(forward, forward+backward) through the public API with the packed layout of `cu_seqlens`."""
    cfg = KernelDeltaAttentionConfig(platform=platform, backend="chunked")
    bounds = jnp.asarray(cu_seqlens)

    def forward(q, k, v, g, beta):
        return kernel_delta_attention(
            q, k, v, beta, g, softmax_scale=scale, return_state=True, cu_seqlens=bounds, cfg=cfg
        )

    def loss(q, k, v, g, beta, d_out):
        return jnp.sum(forward(q, k, v, g, beta)[0].astype(jnp.float32) * d_out)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 4)))


def fla_runners(q, k, v, g, beta, cu_seqlens: np.ndarray, d_out):
    """fla's forward and forward+backward on the same packed inputs (torch tensors shared through dlpack)."""
    import torch
    from fla.ops.kda import chunk_kda

    tensors = [torch.utils.dlpack.from_dlpack(x) for x in (q, k, v, g, beta)]
    bounds = torch.tensor(cu_seqlens, dtype=torch.long, device=tensors[0].device)
    trainable = [t.detach().clone().requires_grad_() for t in tensors]
    cotangent = torch.utils.dlpack.from_dlpack(d_out.astype(v.dtype))

    def forward(inputs=tensors):
        return chunk_kda(*inputs, use_qk_l2norm_in_kernel=True, output_final_state=True, cu_seqlens=bounds)

    return forward, lambda: torch.autograd.grad(forward(trainable)[0], trainable, cotangent)


def bench_case(total: int, heads: int, count: int, smoke: bool, with_fla: bool) -> dict:
    dim = 16 if smoke else 128
    cu_seqlens = sequence_bounds(total, count)
    row = {"tokens": total, "H": heads, "sequences": count, "mean_len": total // count}
    q, k, v, g, beta = make_inputs(0, 1, total, heads, dim)
    d_out = jax.random.normal(jax.random.key(1), v.shape, jnp.float32)
    scale = dim ** -0.5
    (pallas, pallas_grad), (xla, _) = ours("pallas", cu_seqlens, scale), ours("xla", cu_seqlens, scale)
    reference = jax.block_until_ready(xla(q, k, v, g, beta))
    out, final = jax.block_until_ready(pallas(q, k, v, g, beta))
    row["err_out"] = f"{rel(out.astype(jnp.float32), reference[0].astype(jnp.float32)):.1e}"
    row["err_state"] = f"{rel(final, reference[1]):.1e}"
    row["pallas_ms"] = time_jax(pallas, q, k, v, g, beta)
    row["pallas_fb_ms"] = time_jax(pallas_grad, q, k, v, g, beta, d_out)
    log(f"{row}")
    if with_fla:
        from triton.testing import do_bench

        fla, fla_fb = fla_runners(q, k, v, g, beta, cu_seqlens, d_out)
        fla_out = np.asarray(jnp.from_dlpack(fla()[0].float().contiguous()))
        row["err_fla_out"] = f"{rel(fla_out, reference[0].astype(jnp.float32)):.1e}"
        row["fla_ms"] = do_bench(fla, warmup=25, rep=100, return_mode="median")
        row["fla_fb_ms"] = do_bench(fla_fb, warmup=10, rep=50, return_mode="median")
        row["ratio"] = f"{row['pallas_ms'] / row['fla_ms']:.2f}"
        row["fb_ratio"] = f"{row['pallas_fb_ms'] / row['fla_fb_ms']:.2f}"
    for key in ("pallas_ms", "pallas_fb_ms", "fla_ms", "fla_fb_ms"):
        if key in row:
            row[key] = f"{row[key]:.3f}"
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpret mode, no fla")
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--cases", help="which of CASES to run, by index, e.g. 0 (default: all)")
    args = parser.parse_args()
    with_fla = not (args.smoke or args.no_fla)
    cache = seed_triton_cache() if with_fla else None
    cases = SMOKE_CASES if args.smoke else CASES
    if args.cases:
        cases = [cases[int(i)] for i in args.cases.split(",")]
    rows = []
    for case in cases:
        rows.append(bench_case(*case, args.smoke, with_fla))
        if cache is not None:  # after every case: fla's varlen autotuning takes minutes, keep what a timeout would lose
            save_triton_autotune(cache)
    print_table(rows, ["tokens", "H", "sequences", "mean_len", "err_out", "err_state", "err_fla_out", "fla_ms",
                       "pallas_ms", "ratio", "fla_fb_ms", "pallas_fb_ms", "fb_ratio"])


if __name__ == "__main__":
    main()
