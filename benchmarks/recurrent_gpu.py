"""recurrent_attention on a GPU: ours (XLA chunked and scan, and the Pallas path on KDA's kernels with beta = 0)
beside flash-linear-attention's chunk_gla (per-key gate gk) and chunk_simple_gla (per-head scalar gate
g), one run, same inputs.

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=/tmp/site:src python3 benchmarks/recurrent_gpu.py [--no-fla]

bf16 q, k, v; fp32 log-decay gates (gk about -0.05 per step, as recurrent_cpu.py); the default scale K^-0.5.
Ours is timed as the median of jitted calls from the host, fla with triton.testing.do_bench; forward, then
forward+backward (the gradient of sum(out * d_out) for q, k, v and the gate). Errors of ours (outputs and
gradients) and of fla (outputs) against ours at fp32 (the scan, exact, no tf32) on the same inputs. `--smoke`
runs tiny shapes on the CPU without fla.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from timing import median_ms, print_table, save_triton_autotune, seed_triton_cache  # noqa: E402

from hybrax import RecurrentAttentionConfig, recurrent_attention  # noqa: E402
from hybrax.core import relative_error  # noqa: E402

SHAPES = [(1, 8192, 16, 128), (8, 2048, 16, 128)]  # (batch, seq_len, heads, dim)
SMOKE_SHAPES = [(1, 64, 2, 16)]
SCAN_TIMED_UP_TO = 2048  # longer scans are only the error reference: one step per token compiles and runs slowly
IMPLEMENTATIONS = {"xla:chunked": RecurrentAttentionConfig("xla", "chunked"),
                   "xla:scan": RecurrentAttentionConfig("xla", "scan"),
                   "pallas:chunked": RecurrentAttentionConfig("pallas", "chunked")}


def make_inputs(shape, gate: str, seed: int = 0):
    batch, seq_len, heads, dim = shape
    keys = jax.random.split(jax.random.key(seed), 5)
    q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(jnp.bfloat16) for key in keys[:3])
    gate_shape = shape if gate == "gk" else shape[:3]
    log_decay = -jax.nn.softplus(-(jax.random.normal(keys[3], gate_shape, jnp.float32) + 3.0))
    return q, k, v, log_decay, jax.random.normal(keys[4], shape, jnp.float32)


def ours(cfg, gate: str):
    def forward(q, k, v, log_decay):
        gates = dict(g=log_decay) if gate == "g" else dict(gk=log_decay)
        args = (gates.get("g"), None, gates.get("gk"))
        return recurrent_attention(q, k, v, *args, cfg=cfg)

    def loss(q, k, v, log_decay, d_out):
        return jnp.sum(forward(q, k, v, log_decay).astype(jnp.float32) * d_out)

    return jax.jit(forward), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))


def fla_runners(gate: str, q, k, v, log_decay, d_out):
    import torch
    from fla.ops.gla import chunk_gla
    from fla.ops.simple_gla import chunk_simple_gla

    tensors = [torch.utils.dlpack.from_dlpack(x).detach().clone().requires_grad_() for x in (q, k, v, log_decay)]
    d_out_torch = torch.utils.dlpack.from_dlpack(d_out.astype(jnp.bfloat16))
    op = chunk_gla if gate == "gk" else chunk_simple_gla

    def forward():
        return op(*tensors)[0]

    return forward, lambda: torch.autograd.grad(forward(), tensors, d_out_torch)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-fla", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, without fla")
    args = parser.parse_args()
    with_fla = not (args.no_fla or args.smoke)
    triton_cache = seed_triton_cache() if with_fla else None
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    rows = []
    for shape in SMOKE_SHAPES if args.smoke else SHAPES:
        for gate in ("gk", "g"):
            q, k, v, log_decay, d_out = make_inputs(shape, gate)
            exact, exact_grads = ours(IMPLEMENTATIONS["xla:scan"], gate)
            fp32 = (*(x.astype(jnp.float32) for x in (q, k, v)), log_decay)
            with jax.default_matmul_precision("highest"):  # no tf32 in the oracle
                want = np.asarray(exact(*fp32), np.float32)
                want_grads = [np.asarray(g, np.float32) for g in exact_grads(*fp32, d_out)]
            for name, cfg in IMPLEMENTATIONS.items():
                if name == "xla:scan" and shape[1] > SCAN_TIMED_UP_TO:
                    continue
                forward, forward_backward = ours(cfg, gate)
                error = relative_error(np.asarray(forward(q, k, v, log_decay), np.float32), want)
                grads = [np.asarray(g, np.float32) for g in forward_backward(q, k, v, log_decay, d_out)]
                rows.append({"shape": "x".join(map(str, shape)), "gate": gate, "implementation": f"ours {name}",
                             "fwd ms": f"{median_ms(lambda: forward(q, k, v, log_decay), repeats=10):.3f}",
                             "fwd+bwd ms": f"{median_ms(lambda: forward_backward(q, k, v, log_decay, d_out)):.3f}",
                             "rel. error": f"{error:.1e}", "grad error": f"{relative_error(grads, want_grads):.1e}"})
                print(rows[-1], flush=True)
            if with_fla:
                from triton.testing import do_bench

                forward, forward_backward = fla_runners(gate, q, k, v, log_decay, d_out)
                error = relative_error(np.asarray(jax.dlpack.from_dlpack(forward().detach()), np.float32), want)
                rows.append({"shape": "x".join(map(str, shape)), "gate": gate, "implementation": "fla chunk",
                             "fwd ms": f"{do_bench(forward, return_mode='median'):.3f}",
                             "fwd+bwd ms": f"{do_bench(forward_backward, return_mode='median'):.3f}",
                             "rel. error": f"{error:.1e}", "grad error": ""})
                print(rows[-1], flush=True)
    print_table(rows, list(rows[0]))
    if triton_cache is not None:
        save_triton_autotune(triton_cache)


if __name__ == "__main__":
    main()
