"""`--base`: the same benchmark run first on another revision of hybrax, its times an anchor of ours ("base").

The base revision's package runs in a subprocess (one hybrax per interpreter) with this checkout's benchmark code
loaded into it as `hybrax.bench`, so both sides are measured by the same runner, timer and inputs, one after the
other on the same machine. The base is a git revision (its src/ taken with `git archive`) or a folder holding
a `hybrax` package (or a checkout whose src/ does), for machines whose copy of the tree has no .git.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from hybrax.bench import results

BENCH_DIR = pathlib.Path(__file__).resolve().parent
# Run in the subprocess: import the base's hybrax, graft this checkout's hybrax.bench onto it, run the CLI.
BOOTSTRAP = """
import importlib.util, sys
import hybrax
bench_dir, argv = sys.argv[1], sys.argv[2:]
spec = importlib.util.spec_from_file_location("hybrax.bench", bench_dir + "/__init__.py",
                                              submodule_search_locations=[bench_dir])
module = importlib.util.module_from_spec(spec)
sys.modules["hybrax.bench"] = hybrax.bench = module
spec.loader.exec_module(module)
from hybrax.bench.__main__ import main
sys.exit(main(argv))
"""


def source_folder(base: str, workdir: pathlib.Path) -> tuple[pathlib.Path, str]:
    """(the folder holding the base's `hybrax` package, the name to record for it)."""
    folder = pathlib.Path(base)
    if folder.is_dir():
        for candidate in (folder, folder / "src"):
            if (candidate / "hybrax" / "__init__.py").is_file():
                return candidate.resolve(), base
        raise ValueError(f"--base: folder {base!r} holds no hybrax package (nor src/hybrax)")
    root = pathlib.Path(results.__file__).resolve().parents[3]
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", base], cwd=root, capture_output=True, text=True,
                                check=True).stdout.strip()
        archive = subprocess.run(["git", "archive", "--format=tar", commit, "src"], cwd=root, capture_output=True,
                                 check=True).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        raise ValueError(f"--base: {base!r} is neither a folder nor a git revision of {root} ({error})") from error
    subprocess.run(["tar", "-x", "-C", str(workdir)], input=archive, check=True)
    return workdir / "src", commit


def run_base(base: str, argv: Sequence[str]) -> dict[tuple, Mapping[str, Any]]:
    """Run `python -m hybrax.bench ARGV` on the base revision; returns its rows by (op, impl, shape, dtype, mode),
    each with "base" (the revision's name)."""
    with tempfile.TemporaryDirectory(prefix="hybrax-base-") as workdir:
        src, name = source_folder(base, pathlib.Path(workdir))
        out = pathlib.Path(workdir) / "results"
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, "-c", BOOTSTRAP, str(BENCH_DIR), *argv, "--out", str(out), "--commit", name]
        print(f"base {name}: running the same benchmark with hybrax from {src}", flush=True)
        subprocess.run(command, env=env, check=True)
        return {_key(row): {**row, "base": name} for row in results.load(out)}


def _key(row: Mapping[str, Any]) -> tuple:
    return row["op"], row["impl"], row["shape"], row["dtype"], row["mode"]


def anchor_entry(base_rows: Mapping[tuple, Mapping[str, Any]], key: tuple, time_ms: float) -> dict[str, Any] | None:
    """The "base" anchor of our row `key`: the base's time, ours / base, its revision; None where it has none."""
    row = base_rows.get(key)
    if row is None:
        return None
    return {"time_ms": row["time_ms"], "ratio": round(time_ms / row["time_ms"], 4), "timer": row["timer"],
            "commit": row["base"], "versions": row["versions"]}

