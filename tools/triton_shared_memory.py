"""Shared memory, registers, register spills and programs per SM of each Triton kernel of the Pallas paths
(KDA chunked and decode, flash attention) on an H200, estimated without a GPU.

Only the GPU's compiler says how much shared memory a Triton kernel asks for, and a kernel asking for
more than the H200's 232448 bytes fails when it first runs (K = 256 did). This lowers the
chunked forward and backward (or the decode step) for an H200 (`lowering_platforms=("cuda",)`), reads
each Triton call's IR with jaxlib's Triton dialect and compiles it with upstream Triton for sm_90
(ptxas ships in its wheel; `ptxas -v` gives the registers and the spill bytes: a kernel at 255 registers
usually spills, and spills sit on a latency-bound kernel's critical path).
Upstream's passes are not XLA's: Triton 3.9 estimated 237568 bytes where XLA asked for 241664. Triton is
not a dependency; put a wheel's contents in the ignored `.triton/` (not `.whl/`, which travels to the
GPU machine and has to stay small):

    .venv/bin/python -m pip download -q --no-deps --python-version 3.12 \
        --platform manylinux_2_27_x86_64 --only-binary=:all: -d .triton triton==3.6.0
    .venv/bin/python -m pip install -q --no-deps --target .triton/site .triton/triton-3.6.0-*.whl
    PYTHONPATH=src .venv/bin/python tools/triton_shared_memory.py --triton .triton/site [--dtype fp32 --dim 256]
        [--op decode [--launch 64x8] [--v-first] | --op attention] [--value-dim 256]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import jax
import jax.numpy as jnp
from jax._src.lib.mlir import ir
from jaxlib.triton import dialect as triton_dialect

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository: its tests
from hybrax.ops.kda.common.layout import Segments  # noqa: E402
from hybrax.ops.kda.decode.pallas_gpu import fused_recurrent_decode, launch_params  # noqa: E402
from hybrax.ops.kda.pallas_gpu.chunk import kda_chunk  # noqa: E402
from hybrax.ops.kda.pallas_gpu.chunk_fwd import Packing  # noqa: E402
from hybrax.ops.kda.pallas_gpu.tiles import PackedChunks  # noqa: E402
from hybrax import AttentionConfig, attention  # noqa: E402
from hybrax.ops.attention import pallas_flash  # noqa: E402
from hybrax.ops.attention.mask import MaskInfo  # noqa: E402
from tests.helpers import lower_for_h200  # noqa: E402

H200_SHARED_MEMORY = 232448  # bytes per block, what the H200 reported when a kernel asked for more
TRITON_CALL = re.compile(r'ir = "((?:[^"\\]|\\.)*)", name = "([a-z_]+)", num_stages = (\d+) : i32, num_warps = (\d+)')

# Run in a second interpreter with upstream Triton on its path (it must not meet jaxlib's MLIR in one
# process): compile each (name, stages, warps, path of the IR text) for sm_90, print their bytes as JSON.
COMPILE = """
import json, os, re, subprocess, sys
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
import triton
from triton.backends.compiler import GPUTarget
ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
usage = []
for name, stages, warps, path in json.load(sys.stdin):
    options = dict(num_stages=stages, num_warps=warps)
    kernel = triton.compile(path, target=GPUTarget("cuda", 90, 32), options=options)
    with open(path + ".ptx", "w") as f:
        f.write(kernel.asm["ptx"])
    report = subprocess.run([ptxas, "-v", "-arch=sm_90a", path + ".ptx", "-o", path + ".cubin"],
                            capture_output=True, text=True).stderr
    number = lambda pattern: int(re.search(pattern, report).group(1))
    usage.append(dict(shared=kernel.metadata.shared, registers=number(r"Used (\\d+) registers"),
                      spill_stores=number(r"(\\d+) bytes spill stores"),
                      spill_loads=number(r"(\\d+) bytes spill loads")))
print(json.dumps(usage))
"""


def programs_per_sm(shared: int, registers: int, warps: int) -> int:
    """How many programs of a kernel fit on one H100/H200 SM at once (CUDA's occupancy rules for sm_90).

    Registers go to warps in units of 256 (8 per thread rounded up, times 32 threads); an SM has 65536 of
    them, 228 KiB of shared memory (1 KiB of it reserved per block), 64 warps and 32 blocks.
    """
    registers_per_warp = -(-registers * 32 // 256) * 256
    by_registers = 65536 // (registers_per_warp * warps)
    by_shared = 233472 // (shared + 1024)
    return min(by_registers, by_shared, 64 // warps, 32)


def unescape(text: str) -> bytes:
    """The bytes of a StableHLO string attribute (\\XX hex escapes, \\\\, \\")."""
    out, index = bytearray(), 0
    while index < len(text):
        if text[index] != "\\":
            out += text[index].encode()
            index += 1
        elif text[index + 1] in '\\"':
            out.append(ord(text[index + 1]))
            index += 2
        else:
            out.append(int(text[index + 1 : index + 3], 16))
            index += 3
    return bytes(out)


def triton_calls(text: str, directory: str) -> list[tuple[str, int, int, str]]:
    """(name, num_stages, num_warps, path of its IR as text) of each Triton call in lowered text."""
    calls = []
    for number, (bytecode, name, stages, warps) in enumerate(TRITON_CALL.findall(text)):
        context = ir.Context()
        triton_dialect.register_dialect(context)
        with context:
            module = ir.Module.parse(unescape(bytecode))
        path = os.path.join(directory, f"{number}_{name}.ttir")
        with open(path, "w") as f:
            f.write(module.operation.get_asm(enable_debug_info=False))
        calls.append((name, int(stages), int(warps), path))
    return calls


def kda_calls(dtype, dim: int, directory: str, chunk: int = 64, packed: bool = False,
              value_dim: int | None = None) -> list[tuple]:
    """The Triton calls of the chunked forward, then of the gradient (its recomputed forward and backward);
    with `packed`, of 100 packed tokens of 3 sequences in 3 padded chunks (the forward reads them in place).
    value_dim: V when it differs from K (context parallelism's pass widens V by K)."""
    batch, length, heads, sequences = 1, 100 if packed else 128, 2, 3 if packed else 1
    value_dim = value_dim or dim
    tokens = (batch, length, heads, dim)
    shapes = [(tokens, dtype)] * 2 + [((batch, length, heads, value_dim), dtype), (tokens, jnp.float32),
                                      ((batch, length, heads), jnp.float32),
                                      ((sequences, heads, dim, value_dim), jnp.float32)]
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in shapes]
    n_chunks = 3  # segments' three arrays, the gathers' two maps, PackedChunks' two arrays
    sizes = (n_chunks,) * 3 + (n_chunks * chunk, length) + (n_chunks,) * 2
    layout = [jax.ShapeDtypeStruct((n,), jnp.int32) for n in sizes]

    def forward(*arrays):  # the six inputs, then with `packed` the layout's arrays
        if not packed:
            return kda_chunk(*arrays, None, None, dim ** -0.5, True, chunk, False)
        segments, (source, destination, *chunks) = Segments(*arrays[6:9]), arrays[9:]
        packing = Packing(source, destination, PackedChunks(*chunks))
        return kda_chunk(*arrays[:6], segments, packing, dim ** -0.5, True, chunk, False)

    def loss(*arrays):
        out, state = forward(*arrays)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(state)

    gradient = jax.grad(loss, argnums=tuple(range(6)))
    args += layout if packed else []
    return [call for fn in (forward, gradient) for call in triton_calls(lower_for_h200(fn, *args), directory)]


def decode_calls(dtype, dim: int, directory: str, launch: dict | None = None, v_first: bool = False
                 ) -> list[tuple[str, int, int, str]]:
    """The Triton call of one decode step for B = 64 requests, H = 32, with the library's launch unless `launch`
    names one (block_v, num_warps); `v_first`: the state V-first."""
    batch, heads = 64, 32
    tokens = (batch, 1, heads, dim)
    args = [jax.ShapeDtypeStruct(shape, dt) for shape, dt in [
        (tokens, dtype), (tokens, dtype), (tokens, dtype), (tokens, jnp.float32), ((batch, 1, heads), jnp.float32),
        ((batch, heads, dim, dim), jnp.float32),
    ]]
    launch = launch or launch_params(batch * heads, dim)

    def step(q, k, v, g, beta, state):
        return fused_recurrent_decode(q, k, v, g, beta, state, scale=dim ** -0.5, state_v_first=v_first, **launch)

    return triton_calls(lower_for_h200(step, *args), directory)


def attention_calls(dtype, dim: int, directory: str, extras: bool = True) -> list[tuple[str, int, int, str]]:
    """The flash attention kernels (forward, backward dQ and dK / dV) of a causal GQA call, T = 2048, 32 query
    heads on 8 kv heads, with the heuristic's blocks; with `extras` segment ids, sinks, soft cap, a bias, a mask
    and dropout on, so every option's code is in."""
    batch, length, heads, kv_heads = 1, 2048, 32, 8
    args = [jax.ShapeDtypeStruct((batch, length, n, dim), dtype) for n in (heads, kv_heads, kv_heads)]
    args += [jax.ShapeDtypeStruct((batch, length), jnp.int32), jax.ShapeDtypeStruct((heads, 1), jnp.float32),
             jax.ShapeDtypeStruct((batch, heads, length, length), jnp.float32),
             jax.ShapeDtypeStruct((batch, 1, length, length), jnp.bool_)]

    def loss(q, k, v, segments, sinks, bias, mask):
        options = dict(logits_soft_cap=30.0, mask_info=MaskInfo(segments, segments, mask), dropout_prob=0.1,
                       deterministic=False) if extras else {}
        out = attention(q, k, v, bias if extras else None, jax.random.key(0) if extras else None,
                        sinks if extras else None, causal=True, cfg=AttentionConfig("pallas", "flash"), **options)
        return jnp.sum(out.astype(jnp.float32))

    # Lowered here for a GPU: the kernels must be compiled, not interpreted as they are on this CPU.
    with mock.patch.object(pallas_flash, "interpret_here", lambda: False):
        return triton_calls(lower_for_h200(jax.grad(loss, argnums=(0, 1, 2)), *args), directory)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--triton", required=True, help="folder holding upstream Triton (a wheel's contents)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--dim", type=int, default=128, help="K = V")
    parser.add_argument("--value-dim", type=int, help="chunked: V when it differs from K")
    parser.add_argument("--op", default="chunked", choices=["chunked", "decode", "attention"])
    parser.add_argument("--chunk", type=int, default=64, help="the chunked path's chunk size")
    parser.add_argument("--packed", action="store_true", help="packed sequences (cu_seqlens), read in place")
    parser.add_argument("--plain", action="store_true", help="attention: causal only, no extras")
    parser.add_argument("--launch", help="decode: block_v x num_warps instead of the library's, e.g. 64x8")
    parser.add_argument("--v-first", action="store_true", help="decode: the state V-first [B, H, V, K]")
    args = parser.parse_args()
    dtype = {"bf16": jnp.bfloat16, "fp32": jnp.float32}[args.dtype]
    with tempfile.TemporaryDirectory() as directory:
        if args.op == "chunked":
            calls = kda_calls(dtype, args.dim, directory, args.chunk, args.packed, args.value_dim)
        elif args.op == "decode":
            launch = dict(zip(("block_v", "num_warps"), map(int, args.launch.split("x")))) if args.launch else None
            calls = decode_calls(dtype, args.dim, directory, launch, args.v_first)
        else:
            calls = attention_calls(dtype, args.dim, directory, extras=not args.plain)
        compiled = subprocess.run(
            [sys.executable, "-c", COMPILE], input=json.dumps(calls), capture_output=True, text=True, check=True,
            env={**os.environ, "PYTHONPATH": args.triton},
        )
    dims = args.dim if args.value_dim is None else f"{args.dim} / {args.value_dim}"
    print(f"{args.op}, {args.dtype}, head dims {dims}; by upstream Triton for sm_90: shared memory (bytes),")
    print("registers per thread, register spills per thread (bytes stored / loaded, static), programs resident per SM")
    for (name, stages, warps, _), usage in zip(calls, json.loads(compiled.stdout)):
        over = "  OVER the H200's limit" if usage["shared"] > H200_SHARED_MEMORY else ""
        resident = programs_per_sm(usage["shared"], usage["registers"], warps)
        print(f"{name:26s} stages {stages}  warps {warps}  shared {usage['shared']:7d}"
              f"  registers {usage['registers']:3d}  spills {usage['spill_stores']:4d}/{usage['spill_loads']:4d}"
              f"  per SM {resident:2d}{over}")


if __name__ == "__main__":
    main()
