"""Context parallelism (`hybrax.parallel`): what splitting one long sequence over n devices costs each device.

Three ops, one per function: `kda_cp` (kda shapes), `gla_cp` (gla shapes), `attention_cp` (attn shapes); bf16
q, k, v N(0, 1), fp32 log decays log sigmoid(N(0, 1) + 3) per key channel, beta = sigmoid(N(0, 1)).
Implementations:

    shard:N   what one device runs for its 1/N of the tokens, timed on one device: KDA's chunked pass with the
              values widened by K columns (the pass `kda_context_parallel` makes), gated linear attention's
              ordinary pass with its final state, attention's two calls of shard 0 under the balanced split
              (its first T / 2N queries over their keys, the last T / 2N over all T keys: every shard's pair costs
              the same, exactly 1/N of the causal call's work);
    mesh:N    the function itself under shard_map over N devices (declined with fewer).

Beside every row: `whole_ms`, the unsplit op on one device; the summary shows whole / (N x shard), 1.0 when N
devices would each do exactly 1/N of the work, and whole / mesh, the speed-up.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from hybrax import attention, kernel_delta_attention, recurrent_attention
from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.base import MODES, Call, Declined, Inputs, Work, Workload, jax_call
from hybrax.parallel import attention_context_parallel, kda_context_parallel, recurrent_context_parallel

AXIS = "cp"


def make_inputs(shape: Shape, dtype: Any) -> Inputs:
    keys = jax.random.split(jax.random.key(0), 6)
    length, dim = shape.seq_len, shape.head_dim
    q = jax.random.normal(keys[0], (shape.batch, length, shape.heads, dim), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(key, (shape.batch, length, shape.kv_heads, dim), jnp.float32).astype(dtype)
            for key in keys[1:3])
    gate = jax.nn.log_sigmoid(jax.random.normal(keys[3], (shape.batch, length, shape.heads, dim), jnp.float32) + 3.0)
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (shape.batch, length, shape.heads), jnp.float32))
    return {"q": q, "k": k, "v": v, "g": gate, "beta": beta, "d_out": jax.random.normal(keys[5], q.shape, jnp.float32)}


def _kda_shard(q, k, v, g, beta):
    """KDA's pass over one shard with the values widened by K identity columns (the state's affine map)."""
    dk = q.shape[-1]
    batch, _, heads, dv = v.shape
    wide = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (dk,), v.dtype)], axis=-1)
    identity = jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (batch, heads, dk, dk))
    initial = jnp.concatenate([jnp.zeros((batch, heads, dk, dv), jnp.float32), identity], -1)
    return kernel_delta_attention(q, k, wide, beta, g, initial, return_state=True)


def _balanced_attention(shards: int) -> Callable:
    """Shard 0's two calls, their outputs joined along time ([B, T / N, H, D], as the shard's output)."""

    def call(q, k, v):
        half = q.shape[1] // (2 * shards)
        first_half = attention(q[:, :half], k[:, :half], v[:, :half], causal=True)
        return jnp.concatenate([first_half, attention(q[:, -half:], k, v, causal=True)], axis=1)

    return call


# op -> (input names, whole call, one shard's call for N shards, the function under shard_map)
FUNCTIONS: dict[str, tuple[tuple[str, ...], Callable, Callable[[int], Callable], Callable]] = {
    "kda_cp": (("q", "k", "v", "g", "beta"), lambda q, k, v, g, b: kernel_delta_attention(q, k, v, b, g),
               lambda shards: _kda_shard,
               lambda q, k, v, g, b: kda_context_parallel(q, k, v, b, g, axis_name=AXIS)),
    "gla_cp": (("q", "k", "v", "g"), lambda q, k, v, g: recurrent_attention(q, k, v, None, None, g),
               lambda shards: lambda q, k, v, g: recurrent_attention(q, k, v, None, None, g, return_state=True),
               lambda q, k, v, g: recurrent_context_parallel(q, k, v, None, None, g, axis_name=AXIS)),
    "attention_cp": (("q", "k", "v"), lambda q, k, v: attention(q, k, v, causal=True), _balanced_attention,
                     lambda q, k, v: attention_context_parallel(q, k, v, axis_name=AXIS, causal=True)),
}


def cotangent_for(fn: Callable, args: list[jax.Array]) -> jax.Array:
    """An fp32 N(0, 1) cotangent shaped like fn's (first) output (KDA's shard pass outputs V + K columns)."""
    out = jax.eval_shape(fn, *args)
    out = out[0] if isinstance(out, (tuple, list)) else out
    return jax.random.normal(jax.random.key(1), out.shape, jnp.float32)


def _shards(impl: str) -> tuple[str, int]:
    kind, _, count = impl.partition(":")
    if kind not in ("shard", "mesh") or not count.isdigit() or int(count) < 2:
        raise Declined(f"context parallelism takes impl 'shard:N' or 'mesh:N' with N >= 2, got {impl!r}")
    return kind, int(count)


def ours_for(op: str) -> Callable[[str, Shape, Inputs, str], Call]:
    names, _, shard_call, mapped = FUNCTIONS[op]

    def ours(impl: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
        kind, shards = _shards(impl)
        args = [inputs[name] for name in names]
        if kind == "shard":
            tokens = shape.seq_len // shards
            if op != "attention_cp":  # attention's pair of calls reads every key itself
                args = [x[:, :tokens] for x in args]
            return jax_call(shard_call(shards), args, mode, cotangent_for(shard_call(shards), args))
        if jax.device_count() < shards:
            raise Declined(f"mesh:{shards} needs {shards} devices, {jax.device_count()} visible")
        mesh = jax.make_mesh((shards,), (AXIS,), devices=jax.devices()[:shards])
        time_axis = P(None, AXIS)
        specs = tuple(time_axis if x.ndim >= 2 else P() for x in args)
        call = jax.shard_map(mapped, mesh=mesh, in_specs=specs, out_specs=time_axis)
        placed = [jax.device_put(x, NamedSharding(mesh, spec)) for x, spec in zip(args, specs)]
        return jax_call(call, placed, mode, jax.device_put(inputs["d_out"], NamedSharding(mesh, time_axis)))

    return ours


def extras_for(op: str) -> Callable[..., dict[str, Any]]:
    names, whole, _, _ = FUNCTIONS[op]

    def extras(shape: Shape, inputs: Inputs, mode: str, measure) -> dict[str, Any]:
        call = jax_call(whole, [inputs[name] for name in names], mode, inputs["d_out"])
        return {"whole_ms": measure(call).median_ms}

    return extras


def work(shape: Shape, mode: str, dtype: Any) -> Work:
    return Work()


WORKLOADS = tuple(
    Workload(op=op, families=(family,), impls=("shard:2", "shard:4", "shard:8"), anchors=(), modes=MODES,
             inputs=make_inputs, ours=ours_for(op), work=work, extras=extras_for(op))
    for op, family in (("kda_cp", "kda"), ("gla_cp", "gla"), ("attention_cp", "attn"))
)
