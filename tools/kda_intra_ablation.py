"""Where stage 1's time goes: `pallas_chunk_intra` timed with parts of its kernel replaced by trivial stand-ins.

A diagnostic: each part swapped out in turn (its outputs then wrong; only the time means something), and all
but one (what that part costs alone), so that the next change goes where the time is:

    norms       `row_factors`: the L2 norms of q and k rows (a pass over K slices)
    scores      `_factored_scores`: the masked [C, BK] x [BK, C] dots over K slices
    steep       `_exact_scores`: the column-by-column scores of steep chunks (the branch taken there)
    inverse     `unit_lower_inverse`: the doubling rounds of dependent [C, C] dots
    wy          `write_wy`: w, u, kg, qg and the decay (dots with T, stores)

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 tools/kda_intra_ablation.py [--shape kda-1x8192x32x128]
    PYTHONPATH=src python3 tools/kda_intra_ablation.py --smoke     # CPU, interpret mode, a tiny shape: it traces
"""

from __future__ import annotations

import argparse
import contextlib
from unittest import mock

import jax
import jax.numpy as jnp

from hybrax.bench.shapes import parse
from hybrax.bench.timer import SMOKE_BUDGET, Budget, time_jax
from hybrax.bench.workloads.kda import make_inputs
from hybrax.ops.kda.pallas_gpu import chunk_intra as pallas_chunk_intra
from hybrax.ops.kda.pallas_gpu.chunk_cumsum import chunk_local_cumsum

CHUNK = 64


def _zero_scores(q_ref, k_ref, gates_ref, **_):
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


def ablated_intra(parts: tuple[str, ...], scale: float, interpret: bool):
    """`chunk_intra` as the forward calls it (raw q, k) traced with `parts` swapped for their stand-ins (a fresh
    jit: traced anew)."""
    patches = {name: fn for part in parts for name, fn in STAND_INS[part].items()}
    intra = jax.jit(lambda *a: pallas_chunk_intra.chunk_intra.__wrapped__(
        *a, scale=scale, l2_normalize=True, chunk=CHUNK, interpret=interpret
    ))

    def run(*args):
        with mock.patch.multiple(pallas_chunk_intra, **patches) if patches else contextlib.nullcontext():
            return intra(*args)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="kda-1x8192x32x128", help="a kda shape name")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU, interpret mode")
    args = parser.parse_args()
    shape = parse("kda-1x128x2x32" if args.smoke else args.shape)
    inputs = make_inputs(shape, jnp.bfloat16)
    q, k, v, g, beta = (inputs[name] for name in ("q", "k", "v", "g", "beta"))
    gates = chunk_local_cumsum(g, chunk=CHUNK, interpret=args.smoke)
    budget = SMOKE_BUDGET if args.smoke else Budget()
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}; stage 1 at {shape.name}", flush=True)
    for name, parts in ABLATIONS.items():
        run = ablated_intra(parts, shape.head_dim ** -0.5, args.smoke)
        ms = time_jax(lambda: run(q, k, v, gates, g, beta), budget).median_ms
        print(f"{name:18s} {ms:.3f} ms", flush=True)


if __name__ == "__main__":
    main()
