"""The Kimi Delta Attention layer (`hybrax.nn.KimiDeltaAttention`) in training, and one decode step of it in serving.

kda_layer: x [B, T, N] N(0, 1) in the benchmark's dtype through a layer of hidden size N with H heads of D
(K = V = D) and fla's defaults otherwise (short convolutions of width 4, the softplus gate, chunked KDA): the
parameters and the computation in the dtype (A_log and dt_bias stay fp32), fixed random weights (the layer's own
initialisation from key 0; the fla anchor loads the same ones through `fla_state_dict`). Forward+backward is the
gradient of sum(y * d_out) with respect to x and every parameter, as training takes it.

Work: per token 2 P FLOPs for the P weights of the projections (q, k, v, the low-rank gate, beta, the low-rank
output gate, the output), 2 W C for the convolutions over their C = 2 H K + H V channels, plus KDA's count
(`kda.py`); forward+backward 3x.

Parts: with HYBRAX_BENCH_PARTS=1 in the environment each row's extras also hold the time of each step of the layer
as its own jitted call, on the activations that step sees in the layer (each part's forward, or its gradient with
respect to its inputs and its parameters): `projections_ms` (x W_q, x W_k, x W_v), `conv_ms` (the three short
convolutions), `gate_ms` (the low-rank gate and beta projections), `kda_ms` (KDA with its gate activation and the
L2 norms of q and k), `output_ms` (the output gate, gated RMS norm and W_o). Their sum beside the layer's time
says what running the steps apart costs, and each says where the layer's time goes.

kda_layer_decode: one token for each of B requests, x [B, 1, N], through `layer.decode` over a cache of B slots
named in shuffled order (random fp32 states and convolution inputs), the cache donated; each step's input is the
last step's output, so nothing in a step is loop-invariant for the compiler to hoist out of the loop
(`decode.py` runs many steps in one program). Work: every byte a step must move: the KDA state read and written
(2 B H K V 4), the convolution inputs read and written (2 B C (W - 1) 4), every weight read once, x read and y
written. Beside every row: the copy bandwidth (`decode.py`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from hybrax import kernel_delta_attention
from hybrax.bench.shapes import Shape, parse
from hybrax.bench.workloads import decode, kda
from hybrax.bench.workloads.base import MODES, Call, Declined, Inputs, Work, Workload, check_mode, jax_call, to_numpy
from hybrax.nn import KimiDeltaAttention

CONV_SIZE = 4
PARTS_VARIABLE = "HYBRAX_BENCH_PARTS"


def make_layer(shape: Shape, dtype: Any) -> KimiDeltaAttention:
    """The benchmark's layer: fla's defaults, parameters and computation in `dtype`, weights from key 0."""
    return KimiDeltaAttention(shape.hidden, shape.heads, shape.head_dim, conv_size=CONV_SIZE, dtype=dtype,
                              param_dtype=dtype, rngs=nnx.Rngs(0))


def check_impl(op: str, impl: str) -> None:
    if impl != "auto":
        raise Declined(f"{op} times the layer as it chooses its kernels, impl 'auto'; got {impl!r}")


def _parameters(shape: Shape, dtype: Any) -> list[tuple[tuple, jax.ShapeDtypeStruct]]:
    """(path, shape and dtype) of every parameter of the layer, without making it."""
    layer = nnx.eval_shape(lambda: make_layer(shape, dtype))
    return [(path, variable.get_value()) for path, variable in nnx.to_flat_state(nnx.state(layer, nnx.Param))]


def _conv_channels(shape: Shape) -> int:
    return 3 * shape.heads * shape.head_dim


# ---------------------------------------------------------------------------------------------------- training


def make_inputs(shape: Shape, dtype: Any) -> Inputs:
    keys = jax.random.split(jax.random.key(0), 2)
    tokens = (shape.batch, shape.seq_len, shape.hidden)
    return {"layer": make_layer(shape, dtype), "x": jax.random.normal(keys[0], tokens, dtype),
            "d_out": jax.random.normal(keys[1], tokens, jnp.float32)}


def ours(impl: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    check_impl("kda_layer", impl)
    graphdef, params = nnx.split(inputs["layer"])
    return jax_call(lambda x, params: nnx.merge(graphdef, params)(x), [inputs["x"], params], mode, inputs["d_out"])


def work(shape: Shape, mode: str, dtype: Any) -> Work:
    matmul_weights = sum(value.size for path, value in _parameters(shape, dtype) if path[-1] == "kernel")
    per_token = 2 * matmul_weights + 2 * CONV_SIZE * _conv_channels(shape)
    attention = kda.work(parse(f"kda-{shape.batch}x{shape.seq_len}x{shape.heads}x{shape.head_dim}"), mode, dtype)
    return Work(flops=per_token * shape.tokens * (3 if mode == "fwd+bwd" else 1) + attention.flops)


@dataclasses.dataclass(frozen=True)
class Part:
    """One step of the layer: the parameters it owns (top-level names) and run(layer, *activations)."""

    params: tuple[str, ...]
    run: Callable[..., Any]


def _convolved(layer: KimiDeltaAttention, q: jax.Array, k: jax.Array, v: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(conv.convolve(t, None) for conv, t in zip(layer._convs(), (q, k, v)))


def _attended(layer: KimiDeltaAttention, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array,
              beta: jax.Array) -> jax.Array:
    return kernel_delta_attention(*layer._heads(q, k, v), beta, g, use_chunked=layer.mode == "chunk",
                                  **layer._gate_options())


# The layer's own private steps, so that each part computes exactly what the layer does in that step.
PARTS = {
    "projections": Part(("q_proj", "k_proj", "v_proj"), lambda layer, x: layer._projections(x)),
    "conv": Part(("q_conv1d", "k_conv1d", "v_conv1d"), _convolved),
    "gate": Part(("f_a_proj", "f_b_proj", "b_proj"), lambda layer, x: layer._gate_and_beta(x)),
    "kda": Part(("A_log", "dt_bias"), _attended),
    "output": Part(("g_a_proj", "g_b_proj", "o_norm", "o_proj"), lambda layer, x, o: layer._output(x, o)),
}


def part_call(layer: KimiDeltaAttention, part: Part, args: tuple, mode: str) -> Call:
    """A jitted call of the part on `args`: its forward, or the gradient of sum(out * cotangent) (random
    cotangents) with respect to the arguments and the part's parameters (the other parameters are passed, not
    differentiated)."""
    graphdef, own, rest = nnx.split(layer, lambda path, _: path[0] in part.params, ...)

    def forward(own, args, rest):
        return part.run(nnx.merge(graphdef, own, rest), *args)

    if mode == "fwd":
        jitted = jax.jit(forward)
        return Call(run=lambda: jitted(own, args, rest))
    shapes = jax.tree.leaves(jax.eval_shape(forward, own, args, rest))
    keys = jax.random.split(jax.random.key(2), len(shapes))
    cotangents = [jax.random.normal(key, out.shape, jnp.float32) for key, out in zip(keys, shapes)]

    def loss(own, args, rest, cotangents):
        outs = jax.tree.leaves(forward(own, args, rest))
        return sum(jnp.sum(out.astype(jnp.float32) * d_out) for out, d_out in zip(outs, cotangents))

    gradient = jax.jit(jax.grad(loss, argnums=(0, 1)))
    return Call(run=lambda: gradient(own, args, rest, cotangents))


def part_calls(layer: KimiDeltaAttention, x: jax.Array, mode: str) -> dict[str, Call]:
    """Each part's Call on the activations the layer computes from x (each part's forward run once to make the
    next one's inputs)."""
    forward = lambda name, *args: part_call(layer, PARTS[name], args, "fwd").run()  # noqa: E731
    q, k, v = forward("conv", *forward("projections", x))
    g, beta = forward("gate", x)
    o = forward("kda", q, k, v, g, beta)
    args = {"projections": (x,), "conv": (q, k, v), "gate": (x,), "kda": (q, k, v, g, beta), "output": (x, o)}
    return {name: part_call(layer, PARTS[name], args[name], mode) for name in PARTS}


def extras(shape: Shape, inputs: Inputs, mode: str, measure) -> dict[str, Any]:
    """Each part's time ("<part>_ms") where the environment asks for them (HYBRAX_BENCH_PARTS=1)."""
    if os.environ.get(PARTS_VARIABLE, "0") in ("", "0"):
        return {}
    calls = part_calls(inputs["layer"], inputs["x"], mode)
    return {f"{name}_ms": measure(call).median_ms for name, call in calls.items()}


WORKLOAD = Workload(
    op="kda_layer", families=("kda_layer",), impls=("auto",), anchors=("fla",), modes=MODES,
    inputs=make_inputs, ours=ours, work=work, extras=extras,
)

# ---------------------------------------------------------------------------------------------------- decode

DECODE_MODES = ("fwd",)


def make_decode_inputs(shape: Shape, dtype: Any) -> Inputs:
    keys = jax.random.split(jax.random.key(0), 4)
    layer = make_layer(shape, dtype)
    cache = layer.empty_cache(shape.batch)
    cache = dataclasses.replace(cache, conv=jax.random.normal(keys[0], cache.conv.shape, jnp.float32),
                                state=jax.random.normal(keys[1], cache.state.shape, jnp.float32))
    return {"layer": layer, "cache": cache, "x": jax.random.normal(keys[2], (shape.batch, 1, shape.hidden), dtype),
            "slots": jax.random.permutation(keys[3], shape.batch).astype(jnp.int32)}


def decode_ours(impl: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    check_mode("kda_layer_decode", mode, DECODE_MODES)
    check_impl("kda_layer_decode", impl)
    graphdef, params = nnx.split(inputs["layer"])

    def step(carry, arrays):
        cache, x = carry
        params, slots = arrays
        y, cache = nnx.merge(graphdef, params).decode(x, cache, slots)
        return y, (cache, y.astype(x.dtype))

    fresh = lambda: (jax.tree.map(jnp.copy, inputs["cache"]), jnp.copy(inputs["x"]))  # noqa: E731 - donated
    arrays = (params, inputs["slots"])
    one_step = jax.jit(step)
    return decode.carried_call(step, fresh(), arrays, decode.steps_for(shape.batch * shape.heads),
                               output=lambda: to_numpy(one_step(fresh(), arrays)[0]))


def decode_work(shape: Shape, mode: str, dtype: Any) -> Work:
    weights = sum(value.size * value.dtype.itemsize for _, value in _parameters(shape, dtype))
    state = 2 * shape.batch * shape.heads * shape.head_dim**2 * 4
    conv = 2 * shape.batch * _conv_channels(shape) * (CONV_SIZE - 1) * 4
    tokens = 2 * shape.batch * shape.hidden * jnp.dtype(dtype).itemsize
    return Work(bytes=weights + state + conv + tokens)


def decode_extras(shape: Shape, inputs: Inputs, mode: str, measure) -> dict[str, Any]:
    bandwidth = decode.copy_bandwidth(measure)
    return {"copy_gbps": bandwidth / 1e9} if bandwidth else {}


DECODE_WORKLOAD = Workload(
    op="kda_layer_decode", families=("kda_layer_decode",), impls=("auto",), anchors=(), modes=DECODE_MODES,
    inputs=make_decode_inputs, ours=decode_ours, work=decode_work, extras=decode_extras,
)
WORKLOADS = (WORKLOAD, DECODE_WORKLOAD)
