"""KDA chunked on the GPU: every layout the Pallas path accepts compiles there and agrees with XLA.

The benchmark (`python -m hybrax.bench --op kda`) runs bf16 with K = V = 128 only. The Pallas kernels also take
fp32 inputs, K and V up to 256, grouped value heads, packed sequences and gates that underflow; each
of those changes the kernels' tiles (and so their shared memory, which only the GPU's compiler
checks). This runs each once, forward and backward through the public API, on `pallas` and on
`xla`, and prints the relative differences (a row fails above the dtype's tolerance).

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 tools/kda_chunk_coverage.py
    PYTHONPATH=src python3 tools/kda_chunk_coverage.py --smoke    # CPU, interpret mode, small
"""

from __future__ import annotations

import argparse
import time
import traceback
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from hybrax import KernelDeltaAttentionConfig, kernel_delta_attention

# Relative difference between the Pallas and XLA paths (both chunked, same dtype): bf16 inputs as
# flash-linear-attention's tolerances (out 5e-3 against fp32, so 1e-2 between two bf16 paths;
# gradients 8e-3 -> 2e-2), fp32 a tf32-free 1e-4.
TOLERANCE = {jnp.bfloat16: (1e-2, 2e-2), jnp.float32: (1e-4, 1e-4)}


class Case(NamedTuple):
    name: str
    dtype: object
    heads: int
    value_heads: int
    dk: int
    dv: int
    length: int
    cu_seqlens: tuple[int, ...] | None = None
    gate_scale: float = 0.5  # g = -gate_scale * U(0, 1); 1000 makes whole sub-chunks underflow


CASES = [
    Case("bf16 K=V=128", jnp.bfloat16, 4, 4, 128, 128, 1000),
    Case("fp32 K=V=128", jnp.float32, 4, 4, 128, 128, 1000),
    Case("bf16 K=V=256", jnp.bfloat16, 2, 2, 256, 256, 1000),
    Case("fp32 K=V=256", jnp.float32, 2, 2, 256, 256, 1000),
    Case("bf16 K=64 V=128, 2 -> 8 heads", jnp.bfloat16, 2, 8, 64, 128, 1000),
    Case("bf16 K=V=100 (padded)", jnp.bfloat16, 2, 2, 100, 100, 1000),
    Case("bf16 packed, empty sequences", jnp.bfloat16, 4, 4, 128, 128, 1000, (0, 300, 301, 301, 1000)),
    Case("bf16 gates -1000", jnp.bfloat16, 4, 4, 128, 128, 1000, None, 1000.0),
]
SMOKE = [case._replace(heads=1, value_heads=case.value_heads // case.heads, dk=min(case.dk, 32),
                       dv=min(case.dv, 32), length=70, cu_seqlens=case.cu_seqlens and (0, 20, 21, 21, 70))
         for case in CASES[::3]]


def rel(a, b) -> float:
    a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def make(case: Case, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 7)
    batch = 1 if case.cu_seqlens else 2
    sequences = len(case.cu_seqlens) - 1 if case.cu_seqlens else batch
    q, k = (jax.random.normal(keys[i], (batch, case.length, case.heads, case.dk), case.dtype) for i in range(2))
    v = jax.random.normal(keys[2], (batch, case.length, case.value_heads, case.dv), case.dtype)
    g = -case.gate_scale * jax.random.uniform(keys[3], (batch, case.length, case.value_heads, case.dk))
    beta = jax.nn.sigmoid(jax.random.normal(keys[4], (batch, case.length, case.value_heads)))
    state = jax.random.normal(keys[5], (sequences, case.value_heads, case.dk, case.dv))
    d_out = jax.random.normal(keys[6], v.shape, jnp.float32)
    return (q, k, v, beta, g, state), d_out


def runner(platform: str, case: Case):
    """Forward and the gradient of a loss on both outputs, jitted, through the public API (on the CPU
    the Pallas path runs in interpret mode by itself)."""
    cfg = KernelDeltaAttentionConfig(platform=platform, backend="chunked", chunk_size=64)
    cu_seqlens = None if case.cu_seqlens is None else jnp.asarray(case.cu_seqlens, jnp.int32)

    def forward(*arrays):
        return kernel_delta_attention(*arrays, return_state=True, cfg=cfg, cu_seqlens=cu_seqlens)

    def loss(arrays, d_out):
        out, state = forward(*arrays)
        return jnp.sum(out.astype(jnp.float32) * d_out) + jnp.sum(state)

    return jax.jit(forward), jax.jit(jax.value_and_grad(loss))


def check(case: Case) -> dict:
    arrays, d_out = make(case)
    row = {"case": case.name}
    start = time.perf_counter()
    results = {}
    for platform in ("pallas", "xla"):
        forward, gradient = runner(platform, case)
        results[platform] = (jax.block_until_ready(forward(*arrays)), jax.block_until_ready(gradient(arrays, d_out)[1]))
    (out, state), grads = results["pallas"]
    (out_x, state_x), grads_x = results["xla"]
    row["err_out"], row["err_state"] = rel(out, out_x), rel(state, state_x)
    row["err_grads"] = max(rel(a, b) for a, b in zip(grads, grads_x))
    out_tol, grad_tol = TOLERANCE[case.dtype]
    ok = max(row["err_out"], row["err_state"]) <= out_tol and row["err_grads"] <= grad_tol
    row.update({key: f"{row[key]:.1e}" for key in ("err_out", "err_state", "err_grads")})
    row["s"], row["ok"] = f"{time.perf_counter() - start:.0f}", "ok" if ok else "FAIL"
    return row


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="small cases on the CPU (interpret mode)")
    args = parser.parse_args()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    rows = []
    for case in SMOKE if args.smoke else CASES:
        try:
            rows.append(check(case))
        except Exception as exc:  # a layout that does not compile: say so, go on
            traceback.print_exc()
            rows.append({"case": case.name, "ok": "ERROR", "error": f"{type(exc).__name__}: {exc}"[:160]})
        print(rows[-1], flush=True)
    names = ("case", "err_out", "err_state", "err_grads", "s", "ok", "error")
    columns = [c for c in names if any(c in r for r in rows)]
    widths = {c: max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in columns}
    for row in [dict(zip(columns, columns)), *rows]:
        print("  ".join(str(row.get(c, "")).ljust(widths[c]) for c in columns))


if __name__ == "__main__":
    main()
