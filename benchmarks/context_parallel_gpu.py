"""Context parallelism (hybrax.parallel) on GPUs: what splitting one long sequence over n devices costs each device.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/context_parallel_gpu.py [--shards 2,4,8]

For KDA, gated linear attention and causal softmax attention at one long sequence (bf16, K = V = 128): the whole
sequence on one device, then what one device runs for its shard, forward and forward+backward, ms:
  - KDA: the chunked pass over T / n tokens with values widened by K columns (`kda_context_parallel`'s pass);
  - gated linear attention: the ordinary pass over T / n tokens;
  - attention: shard 0's two calls under the balanced split (T / 2n queries over T / 2n keys, and the last
    T / 2n queries over all T keys; every shard's pair costs the same).
`split` = whole / (n * shard): 1.0 when n devices would each do exactly 1/n of the work (attention's pair of
calls is exactly 1/n of the causal call's work: h^2 / 2 + (2n h^2 - h^2 / 2) with h = T / 2n). With at least
n devices visible the function itself runs under shard_map too (`cp`, `speedup` = whole / cp). Timings are the
median of rounds of back-to-back jitted calls from the host. `--smoke` runs tiny shapes on the CPU.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_chunk_gpu import time_jax  # noqa: E402

from hybrax import attention, kernel_delta_attention, recurrent_attention  # noqa: E402
from hybrax.parallel import attention_context_parallel, kda_context_parallel, recurrent_context_parallel  # noqa: E402


def inputs(length: int, heads: int, dim: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(key, (1, length, heads, dim), jnp.float32).astype(jnp.bfloat16) for key in keys[:3])
    gate = -jax.nn.softplus(-(jax.random.normal(keys[3], (1, length, heads, dim), jnp.float32) + 3.0))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (1, length, heads), jnp.float32))
    return q, k, v, gate, beta


def forward_and_grad(fn, argnums):
    def loss(*args):
        out = fn(*args)
        return sum(jnp.sum(x.astype(jnp.float32)) for x in jax.tree.leaves(out))

    return jax.jit(fn), jax.jit(jax.grad(loss, argnums=argnums))


# name -> (whole-sequence call, one shard's pass given (tokens of the shard, shards), the function under
# shard_map, its argnums to differentiate); all take (q, k, v, gate, beta).
def _kda_shard(q, k, v, gate, beta):
    dk = q.shape[-1]
    wide = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (dk,), v.dtype)], axis=-1)
    identity = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (v.shape[0], v.shape[2], dk, dk))
    initial = jnp.concatenate([jnp.zeros((v.shape[0], v.shape[2], dk, v.shape[3]), jnp.float32), identity], -1)
    return kernel_delta_attention(q, k, wide, beta, gate, initial, return_state=True)


OPS = {
    "kda": (lambda q, k, v, g, b: kernel_delta_attention(q, k, v, b, g), _kda_shard,
            lambda q, k, v, g, b: kda_context_parallel(q, k, v, b, g, axis_name="cp"), (0, 1, 2, 3, 4)),
    "gla": (lambda q, k, v, g, b: recurrent_attention(q, k, v, None, None, g),
            lambda q, k, v, g, b: recurrent_attention(q, k, v, None, None, g, return_state=True),
            lambda q, k, v, g, b: recurrent_context_parallel(q, k, v, None, None, g, axis_name="cp"), (0, 1, 2, 3)),
    "attention": (lambda q, k, v, g, b: attention(q, k, v, causal=True), None,
                  lambda q, k, v, g, b: attention_context_parallel(q, k, v, axis_name="cp", causal=True), (0, 1, 2)),
}


def balanced_shard_attention(shards: int):
    """Shard 0's calls under the balanced split (every shard's work is the same): its first half of queries over
    their keys, and the last shard's second half over every key (causal, bottom-right aligned)."""
    def call(q, k, v, g, b):
        half = q.shape[1] // (2 * shards)
        return attention(q[:, :half], k[:, :half], v[:, :half], causal=True), attention(q[:, -half:], k, v, causal=True)

    return call


def row(name: str, length: int, heads: int, dim: int, shards: int) -> dict:
    whole, shard, mapped, argnums = OPS[name]
    args = inputs(length, heads, dim)
    result = {"op": name, "T": length, "H": heads, "shards": shards}
    shard_args = tuple(x[:, :length // shards] for x in args)
    if name == "attention":
        shard, shard_args = balanced_shard_attention(shards), args
    for label, fn, fn_args in (("whole", whole, args), ("shard", shard, shard_args)):
        forward, grad = forward_and_grad(fn, argnums)
        result[f"{label}_fwd"], result[f"{label}_bwd"] = time_jax(forward, *fn_args), time_jax(grad, *fn_args)
    for part in ("fwd", "bwd"):
        result[f"split_{part}"] = result[f"whole_{part}"] / (shards * result[f"shard_{part}"])
    if jax.device_count() >= shards:
        mesh = jax.make_mesh((shards,), ("cp",), devices=jax.devices()[:shards])
        time_axis = P(None, "cp")
        specs = tuple(time_axis if x.ndim >= 2 else P() for x in args)
        call = jax.shard_map(mapped, mesh=mesh, in_specs=specs, out_specs=time_axis)
        placed = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(args, specs)]
        forward, grad = forward_and_grad(call, argnums)
        result["cp_fwd"], result["cp_bwd"] = time_jax(forward, *placed), time_jax(grad, *placed)
        result["speedup_fwd"] = result["whole_fwd"] / result["cp_fwd"]
        result["speedup_bwd"] = result["whole_bwd"] / result["cp_bwd"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", default="2,4,8")
    parser.add_argument("--ops", default="kda,gla,attention")
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    args = parser.parse_args()
    length, heads, dim = (64, 2, 16) if args.smoke else (args.length, args.heads, 128)
    print(f"{jax.devices()[0].device_kind} x {jax.device_count()}, jax {jax.__version__}, T={length}, H={heads}, "
          f"K=V={dim}, bf16; ms")
    columns = ["op", "shards", "whole_fwd", "shard_fwd", "split_fwd", "whole_bwd", "shard_bwd", "split_bwd",
               "cp_fwd", "speedup_fwd", "cp_bwd", "speedup_bwd"]
    print(" | ".join(columns))
    for name in args.ops.split(","):
        for shards in map(int, args.shards.split(",")):
            result = row(name, length, heads, dim, shards)
            cells = [result.get(c, "") for c in columns]
            print(" | ".join(f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells), flush=True)


if __name__ == "__main__":
    main()
