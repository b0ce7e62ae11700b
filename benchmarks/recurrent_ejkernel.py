"""ejkernel's `recurrent_attention` on the CPU (run with .venv-ejkernel's Python, jax 0.10).

`python benchmarks/recurrent_ejkernel.py OUT.npy [B T H K V]` times its jitted forward on the inputs of
`make_inputs`, saves its output to OUT.npy (for an accuracy check beside ours) and tries to jit its
backward. Prints one JSON line last.
"""

from __future__ import annotations

import json
import sys

import numpy as np

SHAPE = (1, 2048, 4, 64, 64)  # B, T, H, K, V


def make_inputs(batch: int, seq_len: int, heads: int, key_dim: int, value_dim: int, seed: int = 0):
    """q, k, v and a per-key log decay gk (log-sigmoid, about -0.05 per step), float32 NumPy."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, seq_len, heads, key_dim), np.float32)
    k = rng.standard_normal((batch, seq_len, heads, key_dim), np.float32)
    v = rng.standard_normal((batch, seq_len, heads, value_dim), np.float32)
    gk = -np.logaddexp(0.0, -(rng.standard_normal((batch, seq_len, heads, key_dim)) + 3.0)).astype(np.float32)
    return q, k, v, gk


def main() -> None:
    import jax
    import jax.numpy as jnp
    from ejkernel.modules.operations import recurrent_attention

    from timing import median_ms

    out_path = sys.argv[1]
    shape = tuple(int(x) for x in sys.argv[2:]) or SHAPE
    q, k, v, gk = (jnp.asarray(x) for x in make_inputs(*shape))
    forward = jax.jit(lambda q, k, v, gk: recurrent_attention(q, k, v, None, None, gk))
    output = np.asarray(forward(q, k, v, gk))
    np.save(out_path, output)
    result = {"jax": jax.__version__, "forward_ms": median_ms(lambda: forward(q, k, v, gk))}
    grad = jax.jit(jax.grad(lambda q, k, v, gk: jnp.sum(recurrent_attention(q, k, v, None, None, gk)),
                            argnums=(0, 1, 2, 3)))
    try:
        jax.block_until_ready(grad(q, k, v, gk))
        result["backward_ms"] = median_ms(lambda: grad(q, k, v, gk))
    except Exception as exc:  # the anchor's failure is the measurement
        result["backward_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
