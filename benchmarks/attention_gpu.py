"""GPU check of `attention`'s implementations (auto, cuDNN, Pallas flash, XLA): errors against float64 (outputs
and the gradients of q, k, v, at T <= 2048) and times
beside jax.nn.dot_product_attention (XLA, and cuDNN for bf16). Causal, B=1, H=8, D=64, then 32 query heads on 8
kv heads of 128: plain, with a 1024-token window, and as four packed sequences (also at T = 2048, checked);
fwd and fwd+bwd.

    PYTHONPATH=src python3 benchmarks/attention_gpu.py [--cases 0,5]

Each row prints as soon as it is timed (a run cut off at the GPU machine's limit keeps what it measured); the
tables follow per case.
"""

from __future__ import annotations

import argparse
import functools
import pathlib
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from timing import median_ms, print_table  # noqa: E402

from hybrax import AttentionConfig, MaskInfo, attention  # noqa: E402
from hybrax.core import relative_error  # noqa: E402
from hybrax.ops.attention import reference  # noqa: E402


def _timed(name, forward, args, cotangent, want: tuple | None):
    """A row of times and error; a launch that fails (compile or run) is a row saying so, and the sweep goes on."""
    try:
        return _time(name, forward, args, cotangent, want)
    except Exception as error:  # noqa: BLE001 - one failing implementation must not end a GPU session's run
        message = f"failed: {type(error).__name__}: {str(error).splitlines()[0][:300]}"
        return {"implementation": name, "fwd ms": message, "fwd+bwd ms": "", "rel. error": "", "grad error": ""}


def _time(name, forward, args, cotangent, want):
    fwd = jax.jit(forward)
    fwd_bwd = jax.jit(jax.grad(lambda *a: jnp.sum(forward(*a).astype(jnp.float32) * cotangent), argnums=(0, 1, 2)))
    error = grad_error = float("nan")
    if want is not None:
        error = relative_error(np.asarray(fwd(*args), np.float32), want[0])
        grad_error = relative_error([np.asarray(g, np.float32) for g in fwd_bwd(*args)], want[1])
    timed = functools.partial(median_ms, repeats=10, warmup=2)
    return {"implementation": name, "fwd ms": f"{timed(lambda: fwd(*args)):.3f}",
            "fwd+bwd ms": f"{timed(lambda: fwd_bwd(*args)):.3f}", "rel. error": f"{error:.1e}",
            "grad error": f"{grad_error:.1e}"}


def _reference(args, cotangent, seen) -> tuple:
    """The float64 output and gradients of sum(out * cotangent) for q, k, v (the reference's autodiff)."""
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float32), jnp.float64) for x in (*args, cotangent)]
        def loss(*qkv):
            return jnp.sum(reference.attention_math(jnp, *qkv, seen=seen) * f64[3])
        out = reference.attention_math(jnp, *f64[:3], seen=seen)
        grads = jax.grad(loss, argnums=(0, 1, 2))(*f64[:3])
        return np.asarray(out), [np.asarray(g) for g in grads]


class Case(NamedTuple):
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: Any
    window: int | None = None  # left window, causal
    segments: int = 1  # equal packed sequences (segment ids); jax.nn cannot express them


# The seed shapes, then a Kimi-style GQA layer: plain, windowed, and four packed sequences.
CASES = (
    Case(2048, 8, 8, 64, jnp.float32),
    Case(2048, 8, 8, 64, jnp.bfloat16),
    Case(8192, 8, 8, 64, jnp.bfloat16),
    Case(8192, 32, 8, 128, jnp.bfloat16),
    Case(8192, 32, 8, 128, jnp.bfloat16, window=1024),
    Case(8192, 32, 8, 128, jnp.bfloat16, segments=4),
    Case(2048, 32, 8, 128, jnp.bfloat16, segments=4),  # the packed layer at a length the reference checks
)


def _inputs(case: Case):
    keys = jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (1, case.seq_len, case.heads, case.head_dim), jnp.float32).astype(case.dtype)
    k, v = (jax.random.normal(key, (1, case.seq_len, case.kv_heads, case.head_dim), jnp.float32).astype(case.dtype)
            for key in keys[1:3])
    return (q, k, v), jax.random.normal(keys[3], q.shape, jnp.float32)


def _implementations(case: Case) -> list[tuple[str, AttentionConfig]]:
    impls = [("auto", AttentionConfig()), ("pallas:flash", AttentionConfig("pallas", "flash"))]
    if case.dtype == jnp.bfloat16 and case.segments == 1:
        impls.append(("cuda:cudnn", AttentionConfig("cuda", "cudnn")))
    impls += [("xla:direct", AttentionConfig("xla", "direct"))] if case.seq_len <= 2048 else []
    # At 8192 tokens one blocking shows XLA's level; each more costs minutes of compiling and timing.
    blocks = (256, 512, 1024) if case.seq_len <= 2048 else (256,)
    return impls + [(f"xla:blockwise {b}x{b}", AttentionConfig("xla", "blockwise", block_q=b, block_k=b))
                    for b in blocks]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", help="indices into CASES to run, e.g. 0,5 (default: all)")
    options = parser.parse_args()
    cases = CASES if not options.cases else [CASES[int(i)] for i in options.cases.split(",")]
    print(f"{jax.devices()[0].device_kind}, jax {jax.__version__}")
    for case in cases:
        args, cotangent = _inputs(case)
        sliding_window = None if case.window is None else (case.window, 0)
        ids = np.repeat(np.arange(case.segments, dtype=np.int32), case.seq_len // case.segments)[None]
        mask_info = MaskInfo.from_segments(jnp.asarray(ids)) if case.segments > 1 else None
        want = None
        if case.seq_len <= 2048:
            seen = reference.visible_keys(case.seq_len, case.seq_len, causal=True, sliding_window=sliding_window,
                                          q_segment_ids=ids, kv_segment_ids=ids)
            want = _reference(args, cotangent, seen)
        title = (f"T={case.seq_len} H={case.heads} KV={case.kv_heads} D={case.head_dim} "
                 f"{jnp.dtype(case.dtype).name} window={case.window} segments={case.segments}")
        rows = []
        for name, cfg in _implementations(case):
            ours = functools.partial(attention, causal=True, sliding_window=sliding_window, mask_info=mask_info,
                                     cfg=cfg)
            rows.append(_timed(f"ours {name}", ours, args, cotangent, want))
            print(title, rows[-1], flush=True)
        anchors = [] if case.segments > 1 else ["xla"] + (["cudnn"] if case.dtype == jnp.bfloat16 else [])
        for impl in anchors:
            jax_nn = functools.partial(jax.nn.dot_product_attention, is_causal=True, implementation=impl,
                                       local_window_size=sliding_window)
            rows.append(_timed(f"jax.nn.dot_product_attention {impl}", jax_nn, args, cotangent, want))
            print(title, rows[-1], flush=True)
        print(f"\n{title}")
        print_table(rows, ["implementation", "fwd ms", "fwd+bwd ms", "rel. error", "grad error"])


if __name__ == "__main__":
    main()
