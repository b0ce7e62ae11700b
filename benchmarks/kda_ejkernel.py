"""Runs inside .venv-ejkernel (jax 0.10): ejkernel 0.0.80.3's chunked `kernel_delta_attention` on the
inputs saved by kda_cpu.py. Prints one JSON line: forward / forward+backward ms, and saves its output.

Usage: kda_ejkernel.py INPUTS.npz OUTPUT.npy CHUNK_SIZE
ejkernel accepts only a per-head decay [B, T, H]; its output is fp32.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from ejkernel.modules.operations import kernel_delta_attention

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from timing import median_ms  # noqa: E402

NAMES = ("query", "key", "value", "beta", "decay")


def main() -> None:
    inputs = np.load(sys.argv[1])
    chunk = int(sys.argv[3])
    args = tuple(jnp.asarray(inputs[n]) for n in NAMES)
    cotangent = jnp.asarray(inputs["cotangent"])

    def forward(q, k, v, beta, decay):
        return kernel_delta_attention(q, k, v, beta, decay, chunk_size=chunk, use_chunked=True)

    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.grad(lambda *a: jnp.sum(forward(*a) * cotangent), argnums=tuple(range(len(NAMES)))))
    np.save(sys.argv[2], np.asarray(fwd(*args)))
    print(json.dumps({
        "jax": jax.__version__,
        "forward_ms": median_ms(lambda: fwd(*args)),
        "forward_backward_ms": median_ms(lambda: fwd_bwd(*args)),
    }))


if __name__ == "__main__":
    main()
