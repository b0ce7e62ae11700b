"""Where stage 1's time goes: `pallas_chunk_intra` timed with parts of its kernel replaced.

Stage 1 (the L2 norms, A_kk, A_qk, the inverse by doubling, the WY form) takes 0.72 ms of the forward's
1.01 at (1, 8192, 32, 128) bf16 on the H200, and the forward misses 0.8x fla by 0.15 ms. Its FLOPs (~37 us at
peak) and bytes (~0.16 ms at copy speed) do not explain it. This times the kernel with one part at a
time swapped for a trivial stand-in (outputs then wrong; only the time means something), so the next
change goes where the time is:

    norms       `row_factors`: the L2 norms of q and k rows (a pass over K slices)
    scores      `_factored_scores`: the masked [C, BK] x [BK, C] dots over K slices
    steep       `_exact_scores`: the column-by-column scores of steep chunks (the branch taken there)
    inverse     `unit_lower_inverse`: 6 doubling rounds of two dependent [C, C] dots
    wy          `write_wy`: w, u, kg, qg and the decay (dots with T, stores)

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 benchmarks/kda_intra_ablation_gpu.py
    python3 benchmarks/kda_intra_ablation_gpu.py --smoke     # CPU, interpret mode, small: it traces
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_chunk_gpu import make_inputs, time_jax  # noqa: E402
from timing import print_table  # noqa: E402

from hybrax.ops.kda import pallas_chunk_intra  # noqa: E402
from hybrax.ops.kda.pallas_chunk_cumsum import chunk_local_cumsum  # noqa: E402


def _zero_scores(q_ref, k_ref, g_ref, **_):
    zeros = jnp.zeros((q_ref.shape[0],) * 2, jnp.float32)
    return zeros, zeros


def _unit_factors(q_ref, k_ref, *_):
    ones = jnp.ones(q_ref.shape[:1], jnp.float32)
    return ones, ones


STAND_INS = {
    "norms": {"row_factors": _unit_factors},
    "scores": {"_factored_scores": _zero_scores},
    "steep": {"_exact_scores": _zero_scores},
    "inverse": {"unit_lower_inverse": lambda strict_lower, precision: strict_lower},
    "wy": {"write_wy": lambda *refs, **settings: None},
}
# Each part alone replaced, then all but one part replaced (what that part costs on its own).
ABLATIONS = {"full kernel": ()} | {f"without {part}": (part,) for part in STAND_INS} | {
    f"only {part}": tuple(other for other in STAND_INS if other != part) for part in ("scores", "inverse", "wy")
}


def ablated_intra(parts: tuple[str, ...], scale: float, chunk: int, interpret: bool):
    """`chunk_intra` as the forward calls it (raw q, k) traced with `parts` swapped for their stand-ins (a
    fresh jit: traced anew)."""
    patches = {name: fn for part in parts for name, fn in STAND_INS[part].items()}
    intra = jax.jit(lambda *a: pallas_chunk_intra.chunk_intra.__wrapped__(
        *a, scale=scale, l2_normalize=True, chunk=chunk, interpret=interpret
    ))

    def run(*args):
        with mock.patch.multiple(pallas_chunk_intra, **patches) if patches else contextlib.nullcontext():
            return intra(*args)

    return run


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, interpret mode")
    args = parser.parse_args()
    shape, chunk = ((1, 128, 2, 32), 64) if args.smoke else ((1, 8192, 32, 128), 64)
    q, k, v, g, beta = make_inputs(0, *shape)
    gates = chunk_local_cumsum(g, chunk=chunk, interpret=args.smoke)
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; stage 1 at {shape}", flush=True)
    rows = []
    for name, parts in ABLATIONS.items():
        run = ablated_intra(parts, shape[3] ** -0.5, chunk, args.smoke)
        jax.block_until_ready(run(q, k, v, gates, beta))
        ms = time_jax(run, q, k, v, gates, beta, reps=2 if args.smoke else 20, rounds=1 if args.smoke else 7)
        rows.append({"kernel": name, "ms": f"{ms:.3f}"})
        print(rows[-1], flush=True)
    print_table(rows, ["kernel", "ms"])


if __name__ == "__main__":
    main()
