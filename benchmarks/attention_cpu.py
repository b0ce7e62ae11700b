"""CPU time of `attention` (direct and blockwise XLA) beside ejkernel's `attention` on the same input.

B=1, T=2048, H=4, D=64, causal, fp32; forward and forward+backward (grad of sum(out * cotangent)
for query, key, value), jit, median of 5 after a warm-up. ejkernel runs in its own environment
(jax 0.10, benchmarks/ejkernel_env.sh) with dtype=float32 (its default is bfloat16).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/attention_cpu.py
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import median_ms, print_table, run_in_ejkernel_env  # noqa: E402

from hybrax import Attention, AttentionConfig, attention  # noqa: E402
from hybrax.core import relative_error  # noqa: E402
from hybrax.ops.attention import reference  # noqa: E402


def _ours(name: str, cfg: AttentionConfig, q, k, v, cotangent) -> dict:
    def forward(q, k, v):
        return attention(q, k, v, causal=True, cfg=cfg)

    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v) * cotangent), argnums=(0, 1, 2)))
    return {"implementation": name, "out": np.asarray(fwd(q, k, v)),
            "forward_ms": median_ms(lambda: fwd(q, k, v)), "forward_backward_ms": median_ms(lambda: fwd_bwd(q, k, v))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--blocks", default="128x256,256x256,512x512",
                        help="blockwise block_q x block_k, comma-separated")
    args = parser.parse_args()
    shape = (1, args.seq_len, 4, 64)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, cotangent = (jax.random.normal(key, shape, jnp.float32) for key in keys)

    rows = [_ours("hybrax xla:direct", AttentionConfig("xla", "direct"), q, k, v, cotangent)]
    for blocks in args.blocks.split(","):
        bq, bk = (int(n) for n in blocks.split("x"))
        cfg = AttentionConfig("xla", "blockwise", block_q=bq, block_k=bk)
        rows.append(_ours(f"hybrax xla:blockwise {bq}x{bk}", cfg, q, k, v, cotangent))
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(f"{tmp}/inputs.npz", query=q, key=k, value=v, cotangent=cotangent)
        anchor = run_in_ejkernel_env("attention_ejkernel.py", f"{tmp}/inputs.npz", f"{tmp}/out.npy")
        rows.append({"implementation": f"ejkernel 0.0.80.3 attention (jax {anchor['jax']}, dtype=fp32)",
                     "out": np.load(f"{tmp}/out.npy"), **anchor})

    want = reference.attention(q, k, v, causal=True)
    base = rows[-1]
    for row in rows:
        row["rel. error"] = f"{relative_error(row.pop('out'), want):.1e}"
        row["fwd ms"] = f"{row['forward_ms']:.1f}"
        row["fwd+bwd ms"] = f"{row['forward_backward_ms']:.1f}"
        row["fwd / ejkernel"] = f"{row['forward_ms'] / base['forward_ms']:.2f}"
        row["fwd+bwd / ejkernel"] = f"{row['forward_backward_ms'] / base['forward_backward_ms']:.2f}"
    auto = Attention().heuristic_cfg(Attention().invocation(Attention().prepare(q, k, v, causal=True)))
    print(f"attention, B=1 T={args.seq_len} H=4 D=64 causal fp32, CPU {jax.devices()[0].device_kind}, "
          f"jax {jax.__version__}; auto picks {auto.platform}:{auto.backend} {auto.block_q}x{auto.block_k}")
    print_table(rows, ["implementation", "fwd ms", "fwd+bwd ms", "fwd / ejkernel", "fwd+bwd / ejkernel",
                       "rel. error"])


if __name__ == "__main__":
    main()
