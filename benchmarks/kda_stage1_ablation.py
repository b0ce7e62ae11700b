"""Where does the KDA chunked forward's stage 1 (kernels 1a-1c: `pallas_chunk_{diagonal,solve,wy}`)
spend its time? (H200)

At (1, 8192, 32, 128) bf16: the precision of the solve's fp32 dots (Triton's exact fp32 dot,
three tf32 passes, one tf32 pass), each with the stage's time and the whole forward's error against
an fp32 recurrence; then, at the default precision, the stage with one part replaced by a trivial
stand-in (its result is then wrong; only the time matters): the diagonal blocks (zeros), the 16x16
diagonal inverses (identity). The differences place the time.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/kda_stage1_ablation.py
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_chunk_gpu import make_inputs, recurrence_fp32, rel, time_jax  # noqa: E402
from timing import print_table  # noqa: E402

from hybrax.ops.kda import pallas_chunk_diagonal, pallas_tiles  # noqa: E402
from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum  # noqa: E402
from hybrax.ops.kda.pallas_chunk_diagonal import chunk_diagonal  # noqa: E402
from hybrax.ops.kda.pallas_chunk_fwd import kda_chunk_fwd, prepare_qk  # noqa: E402
from hybrax.ops.kda.pallas_chunk_solve import chunk_solve  # noqa: E402
from hybrax.ops.kda.pallas_chunk_wy import chunk_wy  # noqa: E402

SHAPE = (1, 8192, 32, 128)


def _zero_diagonal(k_beta, q, gates, k_ref, g_ref):
    zeros = jnp.zeros((pallas_tiles.SUB, pallas_tiles.SUB), jnp.float32)
    return zeros, zeros


def _identity_inverse(strict_lower, precision):
    n = strict_lower.shape[0]
    return (lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(
        jnp.float32
    )


@contextlib.contextmanager
def patched(changes: dict):
    """Replace module attributes ({(module, name): value}) for the duration; the jitted wrappers
    cache traces of the old code, so their caches are cleared."""
    old = {key: getattr(*key) for key in changes}

    def apply(values):
        for (module, name), value in values.items():
            setattr(module, name, value)
        for fn in (chunk_diagonal, chunk_solve, chunk_wy, kda_chunk_fwd):
            fn.clear_cache()

    apply(changes)
    try:
        yield
    finally:
        apply(old)


def stage_one(q, k, v, g, beta):
    blocks = chunk_diagonal(q, k, g, beta)
    inverse, aqk = chunk_solve(q, k, g, beta, *blocks, chunk=64)
    return chunk_wy(q, k, v, g, beta, inverse, chunk=64), aqk


PRECISIONS = {
    "fp32 exact (ieee)": lax.Precision.HIGHEST,
    "tf32 x3": lax.DotAlgorithmPreset.TF32_TF32_F32_X3,
    "tf32": lax.Precision.DEFAULT,
}
STAND_INS = {
    "no diagonal blocks": {(pallas_chunk_diagonal, "diagonal_blocks"): _zero_diagonal},
    "no 16x16 inverses": {(pallas_chunk_diagonal, "unit_lower_inverse"): _identity_inverse},
}


def main() -> None:
    q, k, v, g, beta = make_inputs(0, *SHAPE)
    scale = SHAPE[3] ** -0.5
    qn, kn = prepare_qk(q, k, scale, True)
    gates = chunk_local_cumsum(g, chunk=64)
    ref_out, ref_final = recurrence_fp32(q, k, v, g, beta)
    runs = [
        (f"solve {name}", {(pallas_tiles, "GPU_SOLVE_PRECISION"): value}, True) for name, value in PRECISIONS.items()
    ]
    runs += [(name, changes, False) for name, changes in STAND_INS.items()]
    rows = []
    for name, changes, check in runs:
        with patched(changes):
            stage = jax.jit(stage_one)
            start = time.perf_counter()
            jax.block_until_ready(stage(qn, kn, v, gates, beta))
            row = {"variant": name, "compile_s": f"{time.perf_counter() - start:.0f}"}
            row["intra_ms"] = f"{time_jax(stage, qn, kn, v, gates, beta):.3f}"
            if check:
                forward = jax.jit(lambda q, k, v, g, beta: kda_chunk_fwd(q, k, v, g, beta, scale=scale))
                out, final = forward(q, k, v, g, beta)
                row["err_out"] = f"{rel(out.astype(jnp.float32), ref_out):.1e}"
                row["err_state"] = f"{rel(final, ref_final):.1e}"
                row["forward_ms"] = f"{time_jax(forward, q, k, v, g, beta):.3f}"
        rows.append(row)
        print(row, flush=True)
    print_table(rows, ["variant", "intra_ms", "forward_ms", "err_out", "err_state", "compile_s"])


if __name__ == "__main__":
    main()
