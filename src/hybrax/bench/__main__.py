"""python -m hybrax.bench: time hybrax's implementations beside other libraries' and append the rows as JSON lines.

    python -m hybrax.bench --op kda --impl pallas:chunked,xla:chunked --shapes kda-1x8192x32x128 --anchors fla
    python -m hybrax.bench --op kda --impl pallas:chunked --base main   # ours / main's, measured in one run
    python -m hybrax.bench --smoke                     # every op at a tiny shape on the CPU, into a temp folder
    python -m hybrax.bench.summary                     # BENCHMARKS.md (and the plots) from benchmarks/results
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shlex
import sys
import tempfile

from hybrax.bench import anchors, base_revision, runner, shapes
from hybrax.bench.timer import SMOKE_BUDGET, Budget
from hybrax.bench.workloads import MODES, WORKLOADS


def _list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def _epilog() -> str:
    ops = "\n".join(f"  {op:17s} families {', '.join(w.families)}; default impls {', '.join(w.impls)}; anchors "
                    f"{', '.join(w.anchors) or '-'}; modes {', '.join(w.modes)}" for op, w in WORKLOADS.items())
    return (f"ops:\n{ops}\n\nshape names (hybrax.bench.shapes):\n" + "\n\n".join(shapes.__doc__.split("\n\n")[1:3])
            + "\n\nimpl: 'auto' (the library's choice), a platform ('xla', 'pallas', 'cuda') or 'platform:backend' "
              "(e.g. pallas:chunked, xla:blockwise); context parallelism: shard:N, mesh:N.")


def parser() -> argparse.ArgumentParser:
    description = __doc__.splitlines()[0].split(": ", 1)[1]
    parse = argparse.ArgumentParser(prog="python -m hybrax.bench", description=description, epilog=_epilog(),
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parse.add_argument("--op", choices=sorted(WORKLOADS), help="the op to time (with --smoke: default every op)")
    parse.add_argument("--impl", type=_list, help="our implementations, comma-separated (default: the op's)")
    parse.add_argument("--shapes", type=_list, help="shape names, comma-separated (default: the op's benchmark "
                       "shapes; with --smoke its tiny one)")
    parse.add_argument("--anchors", type=_list, default=[], help=f"other libraries to time beside ours: "
                       f"{','.join(anchors.ANCHORS)} (those not installed decline)")
    parse.add_argument("--dtype", default="bf16", choices=sorted(runner.DTYPES), help="q, k, v dtype (default bf16)")
    parse.add_argument("--mode", type=_list, default=list(MODES), help="fwd, fwd+bwd or both (default both; "
                       "decode ops time fwd only)")
    parse.add_argument("--out", type=pathlib.Path, help="results folder (default benchmarks/results; with --smoke a "
                       "fresh temp folder)")
    parse.add_argument("--base", help="a git revision (or a folder holding its hybrax package) to run the same "
                       "benchmark on first: its times become the anchor 'base' of every row (ours / base)")
    parse.add_argument("--commit", help="the commit to record where git cannot tell (a copy of the tree without .git)")
    parse.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, two short rounds: checks that "
                       "the benchmark runs, in seconds (rows marked smoke)")
    return parse


def _check(parse: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if not args.smoke and not args.op:
        parse.error("--op is required (or --smoke)")
    for name in args.anchors:
        if name not in anchors.ANCHORS:
            parse.error(f"--anchors: each must be one of {','.join(anchors.ANCHORS)}, got {name!r}")
    for mode in args.mode:
        if mode not in MODES:
            parse.error(f"--mode: each must be one of {','.join(MODES)}, got {mode!r}")
    for name in args.shapes or ():
        try:
            shapes.parse(name)
        except ValueError as error:
            parse.error(f"--shapes: {error}")


def _without_base(argv: list[str]) -> list[str]:
    """The command line for the base's run: the same, less --base, --out and --commit (the base sets its own)."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--base", "--out", "--commit"):
            skip = True
        elif not arg.startswith(("--base=", "--out=", "--commit=")):
            kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parse = parser()
    args = parse.parse_args(argv)
    _check(parse, args)
    if args.smoke:
        import jax

        jax.config.update("jax_platforms", "cpu")
    if "fla" in args.anchors:  # JAX and PyTorch share the GPU: JAX must not take most of its memory up front
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = args.out or (pathlib.Path(tempfile.mkdtemp(prefix="hybrax-bench-")) if args.smoke
                       else pathlib.Path("benchmarks/results"))
    command = shlex.join(["python", "-m", "hybrax.bench", *argv])
    base_rows = {}
    if args.base:
        base_rows = base_revision.run_base(args.base, _without_base(argv))
    for op in [args.op] if args.op else list(WORKLOADS):
        workload = WORKLOADS[op]
        options = runner.Options(
            op=op, impls=args.impl or (workload.impls[:1] if args.smoke else workload.impls),
            shapes=args.shapes or ([shapes.SMOKE_SHAPES[op]] if args.smoke else shapes.BENCHMARK_SHAPES[op]),
            anchors=args.anchors, dtype=args.dtype, modes=args.mode, out=out,
            budget=SMOKE_BUDGET if args.smoke else Budget(), smoke=args.smoke, command=command,
            commit=args.commit, base_rows=base_rows,
        )
        runner.run(options)
    print(f"results in {out}; BENCHMARKS.md from them: python -m hybrax.bench.summary --results {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
