"""GPU check of `attention`'s XLA implementations: errors against float64 and times beside
jax.nn.dot_product_attention (XLA, and cuDNN for bf16). Causal, B=1, H=8, D=64; fwd and fwd+bwd.

    PYTHONPATH=src python3 benchmarks/attention_gpu.py
"""

from __future__ import annotations

import functools

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import median_ms, print_table  # noqa: E402

from hybrax import AttentionConfig, attention  # noqa: E402
from hybrax.core import relative_error  # noqa: E402
from hybrax.ops.attention import reference  # noqa: E402


def _timed(name, forward, args, cotangent, want):
    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32) * cotangent), argnums=(0, 1, 2)))
    error = relative_error(np.asarray(fwd(*args), np.float32), want) if want is not None else float("nan")
    timed = functools.partial(median_ms, repeats=10, warmup=2)
    return {"implementation": name, "fwd ms": f"{timed(lambda: fwd(*args)):.3f}",
            "fwd+bwd ms": f"{timed(lambda: fwd_bwd(*args)):.3f}", "rel. error": f"{error:.1e}"}


def main() -> None:
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    for seq_len, dtype in ((2048, jnp.float32), (2048, jnp.bfloat16), (8192, jnp.bfloat16)):
        shape = (1, seq_len, 8, 64)
        keys = jax.random.split(jax.random.key(0), 4)
        q, k, v = (jax.random.normal(key, shape, jnp.float32).astype(dtype) for key in keys[:3])
        cotangent = jax.random.normal(keys[3], shape, jnp.float32)
        want = None
        if seq_len <= 2048:
            want = reference.attention(*(np.asarray(x, np.float32) for x in (q, k, v)), causal=True)
        rows = []
        impls = [("direct", AttentionConfig("xla", "direct"))] if seq_len <= 2048 else []
        impls += [(f"blockwise {b}x{b}", AttentionConfig("xla", "blockwise", block_q=b, block_k=b))
                  for b in (256, 512, 1024)]
        for name, cfg in impls:
            rows.append(_timed(f"ours xla:{name}", lambda q, k, v, cfg=cfg: attention(q, k, v, causal=True, cfg=cfg),
                               (q, k, v), cotangent, want))
        anchors = ["xla"] + (["cudnn"] if dtype == jnp.bfloat16 else [])
        for impl in anchors:
            rows.append(_timed(f"jax.nn.dot_product_attention {impl}", lambda q, k, v, impl=impl:
                               jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=impl),
                               (q, k, v), cotangent, want))
        print(f"\nT={seq_len} {jnp.dtype(dtype).name}")
        print_table(rows, ["implementation", "fwd ms", "fwd+bwd ms", "rel. error"])


if __name__ == "__main__":
    main()
