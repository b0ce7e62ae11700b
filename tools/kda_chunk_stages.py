"""Each kernel of the Pallas KDA chunked path alone, on the inputs it sees inside the pipeline, and its launches.

A diagnostic beside the benchmark runner (`python -m hybrax.bench --op kda` times the whole forward and
backward): where the time goes, kernel by kernel, and what other launch settings (K and value blocks, warps,
Triton pipeline stages) would give. The first launch of each kernel is the pipeline's default; `--sweep` names
the kernels whose other launches to time, each checked against the default's outputs (largest relative
difference). A launch that fails to compile (e.g. out of shared memory) is reported and skipped.

    XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=src python3 tools/kda_chunk_stages.py \
        [--shapes kda-1x8192x32x128] [--sweep all | intra,state,state_output,wy,state_bwd,grad,intra_bwd,cumsum]
    PYTHONPATH=src python3 tools/kda_chunk_stages.py --smoke    # CPU, interpret mode, a tiny shape
"""

from __future__ import annotations

import argparse
import functools
import re
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from hybrax.bench.shapes import parse
from hybrax.bench.timer import SMOKE_BUDGET, Budget, time_jax
from hybrax.bench.workloads.kda import make_inputs
from hybrax.ops.kda.pallas_gpu.chunk_cumsum import chunk_local_cumsum
from hybrax.ops.kda.pallas_gpu.chunk_fwd import prepare_qk
from hybrax.ops.kda.pallas_gpu.chunk_grad import chunk_grad
from hybrax.ops.kda.pallas_gpu.chunk_intra import chunk_intra
from hybrax.ops.kda.pallas_gpu.chunk_intra_bwd import chunk_intra_bwd
from hybrax.ops.kda.pallas_gpu.chunk_state import chunk_state, chunk_state_output
from hybrax.ops.kda.pallas_gpu.chunk_state_bwd import chunk_state_bwd
from hybrax.ops.kda.pallas_gpu.chunk_wy import chunk_wy

CHUNK = 64


def _launch(text: str) -> dict[str, int]:
    """'k32v64w4s3' -> block_k 32, block_v 64, num_warps 4, num_stages 3 (the letters present)."""
    names = {"k": "block_k", "v": "block_v", "w": "num_warps", "s": "num_stages"}
    return {names[letter]: int(number) for letter, number in re.findall(r"([kvws])(\d+)", text)}


# Launch settings per kernel (the first is the pipeline's default); "sN" asks Triton for N pipeline stages.
# Stage 1 runs 4096 latency-bound programs at (1, 8192, 32, 128): fewer warps or more stages change how many
# share an SM; 8 warps spill no registers where 4 spill some, at one program per SM instead of two.
VARIANTS = {kernel: {name: _launch(name) for name in names.split()} for kernel, names in {
    "cumsum": "w4 w2 w8",
    "intra": "k32w4s3 k32w4s1 k32w4s4 k16w4s3 k32w8s3 k32w8s1",
    # The state passes take 32 value columns per program, 16 below a wave of 32-column programs ("w4s3").
    "state": "w4s3 v32w4s3 v16w4s3 v32w4s2 v32w4s4",
    # With the output each chunk adds two dots off the recurrence's critical path.
    "state_output": "w4 v32w4 v16w4 v16w2 v64w4 v32w8",
    "wy": "w4s1 w4s3",  # the backward's recompute of w, u, kg, qg from the kept T
    "state_bwd": "w4s3 v32w4s3 v16w4s3 v32w4s2",
    "grad": "k32v64w4s3 k32v64w4s1 k32v64w4s4 k32v64w8s3",
    "intra_bwd": "k16w4s3 k16w4s1 k16w4s4 k16w8s3",
}.items()}


def relative(a: jax.Array, b: jax.Array) -> float:
    a, b = (np.asarray(jnp.asarray(x, jnp.float32), np.float64) for x in (a, b))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class Stages:
    """Times each kernel's launches into `rows` ((kernel, launch, ms, difference from the default))."""

    def __init__(self, swept: set[str], budget: Budget, interpret: bool):
        self.swept, self.budget, self.interpret, self.rows = swept, budget, interpret, []

    def time(self, kernel: str, build, *args):
        """Every launch of `kernel` that --sweep asks for (the default always); returns the default's outputs."""
        default = None
        for index, (name, settings) in enumerate(VARIANTS[kernel].items()):
            if index and not ({kernel, "all"} & self.swept):
                break
            fn = jax.jit(build({**settings, "interpret": self.interpret}))
            try:
                out = jax.block_until_ready(fn(*args))
                ms = time_jax(lambda: fn(*args), self.budget).median_ms
            except Exception as error:  # noqa: BLE001 - e.g. out of shared memory with more stages
                if not index:
                    raise
                self.rows.append((kernel, name, "failed", traceback.format_exception_only(error)[-1].strip()[:80]))
                continue
            if index:
                differences = [relative(a, b) for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(default))]
                self.rows.append((kernel, name, f"{ms:.3f}", f"{max(differences):.0e}"))
            else:
                default = out
                self.rows.append((kernel, name, f"{ms:.3f}", "default"))
            print(*self.rows[-1], flush=True)
        return default


def run_stages(stages: Stages, q, k, v, g, beta, scale: float) -> None:
    """The forward's kernels, then the backward's on a random output cotangent, each on its real inputs."""
    gates = stages.time("cumsum", lambda s: functools.partial(chunk_local_cumsum, chunk=CHUNK, **s), g)
    (inverse, aqk), (w, u, kg, qg, decay) = stages.time(  # q, k normalized inside, as the forward calls it
        "intra", lambda s: functools.partial(chunk_intra, scale=scale, l2_normalize=True, chunk=CHUNK, **s),
        q, k, v, gates, g, beta)
    qn, kn = jax.jit(functools.partial(prepare_qk, scale=scale, normalize=True))(q, k)  # what the backward reads
    h, v_new, _ = stages.time("state", lambda s: lambda *a: chunk_state(*a, None, chunk=CHUNK, **s), w, u, kg, decay)
    stages.time("state_output", lambda s: lambda *a: chunk_state_output(*a, None, chunk=CHUNK, **s),
                w, u, kg, decay, qg, aqk)
    d_out = jax.random.normal(jax.random.key(2), v.shape, v.dtype)
    stages.time("wy", lambda s: functools.partial(chunk_wy, chunk=CHUNK, **s), qn, kn, v, gates, g, beta, inverse)
    dh, dv_new, _ = stages.time("state_bwd", lambda s: lambda *a: chunk_state_bwd(*a, None, chunk=CHUNK, **s),
                                qg, kg, w, aqk, d_out, decay)
    *_, daqk, dakk = stages.time("grad", lambda s: functools.partial(chunk_grad, chunk=CHUNK, **s),
                                 qn, kn, v, gates, g, beta, inverse, h, dh, v_new, dv_new, d_out)
    stages.time("intra_bwd", lambda s: functools.partial(chunk_intra_bwd, chunk=CHUNK, **s),
                qn, kn, gates, g, beta, daqk, dakk)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="kda-1x8192x32x128", help="kda shape names, comma-separated")
    parser.add_argument("--sweep", default="", help=f"kernels whose other launches to time: all, or some of "
                        f"{','.join(VARIANTS)}")
    parser.add_argument("--smoke", action="store_true", help="a tiny shape on the CPU in interpret mode")
    args = parser.parse_args()
    names = ["kda-1x128x2x32"] if args.smoke else args.shapes.split(",")
    print(f"jax {jax.__version__} on {jax.devices()[0].device_kind}", flush=True)
    for shape in map(parse, names):
        inputs = make_inputs(shape, jnp.bfloat16)
        stages = Stages(set(args.sweep.split(",")), SMOKE_BUDGET if args.smoke else Budget(), args.smoke)
        run_stages(stages, *(inputs[n] for n in ("q", "k", "v", "g", "beta")), shape.head_dim ** -0.5)
        print(f"\n{shape.name}: kernel, launch, ms, largest relative difference from the default launch")
        for row in stages.rows:
            print("  ".join(f"{cell:<12}" for cell in row))


if __name__ == "__main__":
    main()
