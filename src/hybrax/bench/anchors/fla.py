"""flash-linear-attention (`fla-core`, PyTorch and Triton) on the benchmark's inputs, on a CUDA GPU.

kda: `chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, output_final_state=True)`, with cu_seqlens for
packed shapes; gla: `chunk_gla` (per-key gate) or `chunk_simple_gla` (per-head gate); kda_decode:
`fused_recurrent_kda_fwd` updating its state in place with the same fused gate, beta sigmoid and L2 norm (the
plain step: fla's state rows are the requests, no slots); kda_layer: the layer `fla.layers.KimiDeltaAttention`
(package flash-linear-attention) of the same configuration in the benchmark's dtype (A_log and dt_bias fp32, as
ours keeps them), loaded with our layer's weights (`KimiDeltaAttention.fla_state_dict`), forward without autograd.
Forward+backward is `torch.autograd.grad` of sum(out * d_out) (for the layer: with respect to x and every
parameter). The timer replays the calls from a CUDA graph (`hybrax.bench.timer.time_torch`).

JAX and PyTorch share the GPU: run with XLA_PYTHON_CLIENT_PREALLOCATE=false (the runner sets it when fla is
asked for). fla autotunes each kernel on its first call per shape (about 100 s per head count and direction on
an H200); Triton keeps the results in TRITON_CACHE_DIR, so pointing it at a kept folder (the ignored
benchmarks/triton_autotune/ is the usual one) spares later runs the wait.
"""

from __future__ import annotations

import functools
from typing import Any

import jax.numpy as jnp
import numpy as np

from hybrax.bench.anchors import require
from hybrax.bench.shapes import Shape
from hybrax.bench.workloads.base import Call, Declined, Inputs, check_mode
from hybrax.bench.workloads.kda_decode import LOWER_BOUND
from hybrax.bench.workloads.kda_layer import CONV_SIZE

PACKAGES = ("fla-core", "flash-linear-attention", "torch", "triton")


def _torch() -> Any:
    torch = require("torch", "torch")
    if not torch.cuda.is_available():
        raise Declined("fla needs a CUDA GPU, and torch sees none")
    require("fla.ops", "fla-core")
    return torch


def _shared(torch: Any, x: Any) -> Any:
    """The JAX array as a torch tensor on the same memory (no copy)."""
    return torch.utils.dlpack.from_dlpack(x)


def _copied(torch: Any, x: Any, dtype: Any = None) -> Any:
    """A torch copy of the JAX array on the GPU (fla updates it in place)."""
    tensor = torch.from_numpy(np.asarray(jnp.asarray(x, jnp.float32))).cuda()
    return tensor if dtype is None else tensor.to(dtype)


def _dtype(torch: Any, dtype: Any) -> Any:
    """The torch dtype of a JAX dtype of the benchmark (bf16, fp16, else fp32)."""
    return {jnp.dtype(jnp.bfloat16): torch.bfloat16, jnp.dtype(jnp.float16): torch.float16}.get(
        jnp.dtype(dtype), torch.float32)


def _numpy(tensor: Any) -> np.ndarray:
    return tensor.detach().float().cpu().numpy()


def peak_mb(torch: Any, run: Any) -> float:
    """The memory one call allocates beyond what was allocated before it, at its peak."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _differentiated(torch: Any, forward: Any, tensors: list, d_out: Any, mode: str) -> Call:
    """A Call of forward(*tensors) ("fwd") or of the gradients of sum(out * d_out) for every tensor."""
    if mode == "fwd":
        return Call(run=lambda: forward(*tensors), framework="torch", output=lambda: _numpy(forward(*tensors)[0]))
    trainable = [t.detach().clone().requires_grad_() for t in tensors]
    cotangent = d_out.to(tensors[2].dtype)

    def run():
        return torch.autograd.grad(forward(*trainable)[0], trainable, cotangent)

    return Call(run=run, framework="torch", memory_mb=lambda: peak_mb(torch, run))


def _kda(torch: Any, shape: Shape, inputs: Inputs, mode: str) -> Call:
    from fla.ops.kda import chunk_kda

    bounds = inputs["cu_seqlens"]
    packed = {} if bounds is None else {"cu_seqlens": torch.tensor(np.asarray(bounds), dtype=torch.long,
                                                                   device="cuda")}
    forward = functools.partial(chunk_kda, use_qk_l2norm_in_kernel=True, output_final_state=True, **packed)
    tensors = [_shared(torch, inputs[name]) for name in ("q", "k", "v", "g", "beta")]
    return _differentiated(torch, forward, tensors, _shared(torch, inputs["d_out"]), mode)


def _gla(torch: Any, shape: Shape, inputs: Inputs, mode: str) -> Call:
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    forward = chunk_gla if shape.family == "gla" else chunk_simple_gla
    tensors = [_shared(torch, inputs[name]) for name in ("q", "k", "v", "log_decay")]
    return _differentiated(torch, forward, tensors, _shared(torch, inputs["d_out"]), mode)


def _kda_decode(torch: Any, shape: Shape, inputs: Inputs, mode: str) -> Call:
    check_mode("fla's kda_decode", mode, ("fwd",))
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

    dtype = _dtype(torch, inputs["q"].dtype)
    q, k, v = (_copied(torch, inputs[name], dtype) for name in ("q", "k", "v"))
    g, beta, a_log, dt_bias = (_copied(torch, inputs[name]) for name in ("g", "beta", "a_log", "dt_bias"))
    state = _copied(torch, inputs["state"]).contiguous()
    step = functools.partial(
        fused_recurrent_kda_fwd, q=q, k=k, v=v, g=g, beta=beta, A_log=a_log, dt_bias=dt_bias.reshape(-1),
        initial_state=state, scale=shape.head_dim ** -0.5, inplace_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True, lower_bound=LOWER_BOUND, state_v_first=False,
    )
    return Call(run=step, framework="torch", output=lambda: _numpy(step()[0]))


def _kda_layer(torch: Any, shape: Shape, inputs: Inputs, mode: str) -> Call:
    layers = require("fla.layers.kda", "flash-linear-attention")
    dtype = _dtype(torch, inputs["x"].dtype)
    layer = layers.KimiDeltaAttention(hidden_size=shape.hidden, head_dim=shape.head_dim, num_heads=shape.heads,
                                      mode="chunk", conv_size=CONV_SIZE).cuda().to(dtype)
    layer.A_log.data, layer.dt_bias.data = layer.A_log.data.float(), layer.dt_bias.data.float()  # fp32, as ours
    # load_state_dict copies each tensor into its parameter's device and dtype
    layer.load_state_dict({name: torch.tensor(value) for name, value in inputs["layer"].fla_state_dict().items()})
    layer.train()  # fla's chunked KDA at every length (in eval mode it takes its token-by-token kernel up to 64)
    x = _shared(torch, inputs["x"])
    if mode == "fwd":
        def forward():
            with torch.no_grad():
                return layer(x)[0]

        return Call(run=forward, framework="torch", output=lambda: _numpy(forward()))
    trainable = x.detach().clone().requires_grad_()
    wrt = [trainable, *layer.parameters()]
    cotangent = _shared(torch, inputs["d_out"]).to(dtype)

    def run():
        return torch.autograd.grad(layer(trainable)[0], wrt, cotangent)

    return Call(run=run, framework="torch", memory_mb=lambda: peak_mb(torch, run))


BUILDERS = {"kda": _kda, "gla": _gla, "kda_decode": _kda_decode, "kda_layer": _kda_layer}


def build(name: str, op: str, shape: Shape, inputs: Inputs, mode: str) -> Call:
    if op not in BUILDERS:
        raise Declined(f"fla has no counterpart of {op} here (it has {sorted(BUILDERS)})")
    return BUILDERS[op](_torch(), shape, inputs, mode)
