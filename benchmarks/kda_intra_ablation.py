"""Where does the KDA chunked forward's stage 1 (`pallas_chunk_intra`) spend its time? (H200)

Times the stage at (1, 8192, 32, 128) bf16 as it is, and with one part replaced by a trivial
stand-in (the result is then wrong; only the time matters): the diagonal blocks (zeros), the 16x16
diagonal inverses (identity), the exact fp32 dots of the solve done as tf32; and at 2, 4 and 8
warps. The differences place the time.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/kda_intra_ablation.py
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
from kda_chunk_gpu import make_inputs, time_jax  # noqa: E402
from timing import print_table  # noqa: E402

from hybrax.ops.kda import pallas_chunk_intra as intra  # noqa: E402
from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum  # noqa: E402
from hybrax.ops.kda.pallas_chunk_fwd import prepare_qk  # noqa: E402

SHAPE = (1, 8192, 32, 128)


def _zero_diagonal(k_beta, q, gates, k_ref, g_ref, first_row):
    zeros = jnp.zeros((intra.SUB, intra.SUB), jnp.float32)
    return zeros, zeros


def _identity_inverse(strict_lower):
    n = strict_lower.shape[0]
    return (lax.broadcasted_iota(jnp.int32, (n, n), 0) == lax.broadcasted_iota(jnp.int32, (n, n), 1)).astype(
        jnp.float32
    )


@contextlib.contextmanager
def patched(name: str, value):
    old = getattr(intra, name)
    setattr(intra, name, value)
    try:
        yield
    finally:
        setattr(intra, name, old)


VARIANTS = {
    "as is": (None, None),
    "no diagonal blocks": ("_diagonal_blocks", _zero_diagonal),
    "no 16x16 inverses": ("_unit_lower_inverse", _identity_inverse),
    "solve in tf32": ("EXACT", lax.Precision.DEFAULT),
}


def main() -> None:
    q, k, v, g, beta = make_inputs(0, *SHAPE)
    qn, kn = prepare_qk(q, k, SHAPE[3] ** -0.5, True)
    gates = chunk_local_cumsum(g, chunk=64)
    rows = []
    runs = [(name, 4) for name in VARIANTS] + [("as is", 2), ("as is", 8)]
    for name, warps in runs:
        attribute, value = VARIANTS[name]
        context = patched(attribute, value) if attribute else contextlib.nullcontext()
        with context:
            fn = jax.jit(lambda *a, warps=warps: intra.chunk_intra.__wrapped__(*a, chunk=64, num_warps=warps))
            start = time.perf_counter()
            jax.block_until_ready(fn(qn, kn, v, gates, beta))
            compile_s = time.perf_counter() - start
            ms = time_jax(fn, qn, kn, v, gates, beta)
        rows.append({"variant": name, "warps": warps, "ms": f"{ms:.3f}", "compile_s": f"{compile_s:.0f}"})
        print(rows[-1], flush=True)
    print_table(rows, ["variant", "warps", "ms", "compile_s"])


if __name__ == "__main__":
    main()
