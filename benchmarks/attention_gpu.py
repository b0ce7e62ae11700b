"""GPU check of `attention`'s implementations (auto, cuDNN, XLA): errors against float64 and times beside
jax.nn.dot_product_attention (XLA, and cuDNN for bf16). Causal, B=1, H=8, D=64, then 32 query heads on 8 kv
heads of 128 with and without a 1024-token window; fwd and fwd+bwd.

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


# (q_len, heads, kv_heads, head_dim, dtype, sliding window): the seed shapes, then a Kimi-style GQA layer.
CASES = (
    (2048, 8, 8, 64, jnp.float32, None),
    (2048, 8, 8, 64, jnp.bfloat16, None),
    (8192, 8, 8, 64, jnp.bfloat16, None),
    (8192, 32, 8, 128, jnp.bfloat16, None),
    (8192, 32, 8, 128, jnp.bfloat16, 1024),
)


def _inputs(seq_len, heads, kv_heads, head_dim, dtype):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, seq_len, heads, head_dim), jnp.float32).astype(dtype)
    k, v = (jax.random.normal(key, (1, seq_len, kv_heads, head_dim), jnp.float32).astype(dtype) for key in keys[1:3])
    return (q, k, v), jax.random.normal(keys[3], q.shape, jnp.float32)


def main() -> None:
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    for seq_len, heads, kv_heads, head_dim, dtype, window in CASES:
        args, cotangent = _inputs(seq_len, heads, kv_heads, head_dim, dtype)
        sliding_window = None if window is None else (window, 0)
        want = None
        if seq_len <= 2048:
            want = reference.attention(*(np.asarray(x, np.float32) for x in args), causal=True,
                                       sliding_window=sliding_window)
        impls = [("auto", AttentionConfig())]
        impls += [("cuda:cudnn", AttentionConfig("cuda", "cudnn"))] if dtype == jnp.bfloat16 else []
        impls += [("xla:direct", AttentionConfig("xla", "direct"))] if seq_len <= 2048 else []
        impls += [(f"xla:blockwise {b}x{b}", AttentionConfig("xla", "blockwise", block_q=b, block_k=b))
                  for b in (256, 512, 1024)]
        rows = []
        for name, cfg in impls:
            ours = functools.partial(attention, causal=True, sliding_window=sliding_window, cfg=cfg)
            rows.append(_timed(f"ours {name}", ours, args, cotangent, want))
        anchors = ["xla"] + (["cudnn"] if dtype == jnp.bfloat16 else [])
        for impl in anchors:
            jax_nn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl,
                                       local_window_size=sliding_window)
            rows.append(_timed(f"jax.nn.dot_product_attention {impl}", jax_nn, args, cotangent, want))
        print(f"\nT={seq_len} H={heads} KV={kv_heads} D={head_dim} {jnp.dtype(dtype).name} window={window}")
        print_table(rows, ["implementation", "fwd ms", "fwd+bwd ms", "rel. error"])


if __name__ == "__main__":
    main()
