"""recurrent_attention on the CPU: ours (scan, chunked at each chunk size) beside ejkernel's, one run.

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/recurrent_cpu.py [B T H K V]

B=1, T=2048, H=4, K=V=64 with a per-key gate gk by default. Forward and forward+backward (jit, median
of 5); ejkernel runs in its own jax 0.10 environment on the same inputs, and its jitted backward is
attempted and its failure recorded. Errors are against the float64 reference.
"""

from __future__ import annotations

import pathlib
import sys
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

from hybrax import RecurrentAttentionConfig, recurrent_attention
from hybrax.core import relative_error
from hybrax.ops.recurrent.reference import recurrent_reference
from hybrax.ops.recurrent.xla_chunked import CHUNK_SIZES

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from recurrent_ejkernel import SHAPE, make_inputs  # noqa: E402
from timing import median_ms, print_table, run_in_ejkernel_env  # noqa: E402


# Eight packed sequences of uneven lengths (one of a single token) for the varlen rows.
PACKED = (0, 100, 400, 401, 900, 1300, 1500, 2000, 2048)


def _ours(cfg, inputs, reference, cu_seqlens=None):
    def run(q, k, v, gk):
        return recurrent_attention(q, k, v, None, None, gk, None, None, cu_seqlens, cfg=cfg)

    forward = jax.jit(run)
    backward = jax.jit(jax.grad(lambda *args: jnp.sum(run(*args)), argnums=(0, 1, 2, 3)))
    return {
        "forward_ms": median_ms(lambda: forward(*inputs)),
        "fwd_bwd_ms": median_ms(lambda: backward(*inputs)),
        "rel_error": relative_error(forward(*inputs), reference),
    }


def main() -> None:
    shape = tuple(int(x) for x in sys.argv[1:]) or SHAPE
    numpy_inputs = make_inputs(*shape)
    reference, _ = recurrent_reference(numpy_inputs[0], numpy_inputs[1], numpy_inputs[2], None, None, numpy_inputs[3])
    with tempfile.TemporaryDirectory() as tmp:
        out = str(pathlib.Path(tmp) / "ejkernel.npy")
        anchor = run_in_ejkernel_env("recurrent_ejkernel.py", out, *map(str, shape))
        anchor_error = relative_error(np.load(out), reference)
    inputs = [jnp.asarray(x) for x in numpy_inputs]
    rows = [{
        "implementation": f"ejkernel (jax {anchor['jax']})",
        "forward_ms": f"{anchor['forward_ms']:.2f}",
        "fwd_bwd_ms": f"{anchor['backward_ms']:.2f}" if "backward_ms" in anchor else "fails under jit",
        "vs_ejkernel_fwd": "1.0x",
        "rel_error": f"{anchor_error:.1e}",
    }]
    configs = [RecurrentAttentionConfig("xla", "scan")] + [
        RecurrentAttentionConfig("xla", "chunked", chunk_size=c) for c in CHUNK_SIZES]
    runs = [(cfg, None, reference) for cfg in configs]
    if shape[0] == 1 and shape[1] == PACKED[-1]:
        packed_reference, _ = recurrent_reference(*numpy_inputs[:3], None, None, numpy_inputs[3], None, None, PACKED)
        cu_seqlens = jnp.asarray(PACKED, jnp.int32)
        runs += [(cfg, cu_seqlens, packed_reference) for cfg in (configs[0], configs[3])]
    for cfg, cu_seqlens, expected in runs:
        ours = _ours(cfg, inputs, expected, cu_seqlens)
        name = "ours scan" if cfg.backend == "scan" else f"ours chunked C={cfg.chunk_size}"
        rows.append({
            "implementation": name + (", 8 packed seqs" if cu_seqlens is not None else ""),
            "forward_ms": f"{ours['forward_ms']:.2f}",
            "fwd_bwd_ms": f"{ours['fwd_bwd_ms']:.2f}",
            "vs_ejkernel_fwd": f"{anchor['forward_ms'] / ours['forward_ms']:.1f}x",
            "rel_error": f"{ours['rel_error']:.1e}",
        })
    print(f"recurrent_attention, CPU, B,T,H,K,V = {shape}, gk given, fp32, jit, median of 5")
    print_table(rows, ["implementation", "forward_ms", "fwd_bwd_ms", "vs_ejkernel_fwd", "rel_error"])
    if "backward_error" in anchor:
        print(f"ejkernel jit(grad): {anchor['backward_error']}")


if __name__ == "__main__":
    main()
