"""CPU time of `kernel_delta_attention` (chunked and scan XLA) beside ejkernel's chunked KDA.

B=1, T=2048, H=4, K=V=64, per-head decay (the only kind ejkernel accepts), fp32; forward and
forward+backward (grad of sum(out * cotangent) for query, key, value, beta, decay), jit, median of 5
after a warm-up. ejkernel runs in its own environment (jax 0.10, benchmarks/ejkernel_env.sh), at its
default chunk size (64, the base of the ratio columns) and at smaller ones, which are faster on the CPU.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/kda_cpu.py
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

from hybrax import KernelDeltaAttentionConfig, kernel_delta_attention  # noqa: E402
from hybrax.core import relative_error  # noqa: E402
from hybrax.ops.kda import reference  # noqa: E402

NAMES = ("query", "key", "value", "beta", "decay")


def _inputs(length: int, per_channel: bool) -> dict[str, jax.Array]:
    heads, dim = 4, 64
    keys = jax.random.split(jax.random.key(0), 6)
    q, k, v, cotangent = (jax.random.normal(key, (1, length, heads, dim), jnp.float32) for key in keys[:4])
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, length, heads)))
    decay_shape = (1, length, heads, dim) if per_channel else (1, length, heads)
    decay = jax.nn.log_sigmoid(jax.random.normal(keys[5], decay_shape) + 3.0)
    return {"query": q, "key": k, "value": v, "beta": beta, "decay": decay, "cotangent": cotangent}


def _ours(name: str, cfg: KernelDeltaAttentionConfig, inputs: dict, backward: bool = True) -> dict:
    args = tuple(inputs[n] for n in NAMES)

    def forward(*a):
        return kernel_delta_attention(*a, cfg=cfg)

    fwd = jax.jit(forward)
    row = {"implementation": name, "out": np.asarray(fwd(*args)), "forward_ms": median_ms(lambda: fwd(*args))}
    if backward:
        loss = lambda *a: jnp.sum(forward(*a) * inputs["cotangent"])  # noqa: E731
        fwd_bwd = jax.jit(jax.grad(loss, argnums=tuple(range(len(NAMES)))))
        row["forward_backward_ms"] = median_ms(lambda: fwd_bwd(*args))
    return row


def _anchor(tmp: str, chunk: int) -> dict:
    """ejkernel's chunked KDA at one chunk size, on the inputs saved in `tmp`."""
    timing = run_in_ejkernel_env("kda_ejkernel.py", f"{tmp}/inputs.npz", f"{tmp}/out.npy", str(chunk))
    return {"implementation": f"ejkernel 0.0.80.3 chunked C={chunk} (jax {timing['jax']})",
            "out": np.load(f"{tmp}/out.npy"), **timing}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--chunks", default="32,64,128", help="our chunk sizes, comma-separated")
    parser.add_argument("--anchor-chunks", default="64,32,16",
                        help="ejkernel's chunk sizes, comma-separated; the first (its default: 64) is the ratios' base")
    parser.add_argument("--per-channel", action="store_true", help="also time a per-channel decay (ours only)")
    args = parser.parse_args()
    inputs = _inputs(args.seq_len, per_channel=False)

    rows = [_ours(f"hybrax xla:chunked C={c}", KernelDeltaAttentionConfig("xla", "chunked", chunk_size=int(c)), inputs)
            for c in args.chunks.split(",")]
    rows.append(_ours("hybrax xla:scan", KernelDeltaAttentionConfig("xla", "scan"), inputs, backward=False))
    with tempfile.TemporaryDirectory() as tmp:
        np.savez(f"{tmp}/inputs.npz", **{n: np.asarray(x) for n, x in inputs.items()})
        anchors = [_anchor(tmp, int(c)) for c in args.anchor_chunks.split(",")]
    rows += anchors
    want, _ = reference.kda_reference(*(np.asarray(inputs[n]) for n in NAMES))
    if args.per_channel:
        channel = _inputs(args.seq_len, per_channel=True)
        row = _ours("hybrax xla:chunked C=64, per-channel decay", KernelDeltaAttentionConfig("xla", "chunked"), channel)
        row["out_ref"] = reference.kda_reference(*(np.asarray(channel[n]) for n in NAMES))[0]
        rows.append(row)

    base = anchors[0]
    for row in rows:
        row["rel. error"] = f"{relative_error(row.pop('out'), row.pop('out_ref', want)):.1e}"
        row["fwd ms"] = f"{row['forward_ms']:.1f}"
        row["fwd / ejkernel"] = f"{row['forward_ms'] / base['forward_ms']:.2f}"
        if "forward_backward_ms" in row:
            row["fwd+bwd ms"] = f"{row['forward_backward_ms']:.1f}"
            row["fwd+bwd / ejkernel"] = f"{row['forward_backward_ms'] / base['forward_backward_ms']:.2f}"
    print(f"kernel_delta_attention, B=1 T={args.seq_len} H=4 K=V=64, per-head decay, fp32, "
          f"CPU {jax.devices()[0].device_kind}, jax {jax.__version__}")
    print_table(rows, ["implementation", "fwd ms", "fwd+bwd ms", "fwd / ejkernel", "fwd+bwd / ejkernel",
                       "rel. error"])


if __name__ == "__main__":
    main()
