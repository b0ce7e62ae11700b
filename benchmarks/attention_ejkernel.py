"""Runs inside .venv-ejkernel (jax 0.10): ejkernel 0.0.80.3's `attention` on the inputs saved by
attention_cpu.py. Prints one JSON line: forward / forward+backward ms, and saves its output.

Usage: attention_ejkernel.py INPUTS.npz OUTPUT.npy
ejkernel defaults to dtype=bfloat16; we pass dtype=float32 so both sides compute in fp32.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from ejkernel.modules.operations.attention import attention

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import median_ms  # noqa: E402


def main() -> None:
    inputs = np.load(sys.argv[1])
    q, k, v, cotangent = (jnp.asarray(inputs[n]) for n in ("query", "key", "value", "cotangent"))

    def forward(q, k, v):
        out, _weights = attention(q, k, v, causal=True, dtype=jnp.float32)
        return out

    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.grad(lambda q, k, v: jnp.sum(forward(q, k, v) * cotangent), argnums=(0, 1, 2)))
    np.save(sys.argv[2], np.asarray(fwd(q, k, v)))
    print(json.dumps({
        "jax": jax.__version__,
        "forward_ms": median_ms(lambda: fwd(q, k, v)),
        "forward_backward_ms": median_ms(lambda: fwd_bwd(q, k, v)),
    }))


if __name__ == "__main__":
    main()
