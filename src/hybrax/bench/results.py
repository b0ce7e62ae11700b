"""Benchmark results as data: one JSON object per line in benchmarks/results/<device>/<op>.jsonl, appended.

A row holds what was measured and everything needed to trust or repeat it:

    op, impl, shape, dtype, mode     the problem and our implementation ("auto": the library's choice)
    time_ms                          median time of one step (timer.py), and tflops / gbps from the op's work
    anchors                          {name: {time_ms, ratio (= ours / theirs, below 1: ours faster), timer,
                                     rel_diff (of the outputs, fwd), memory_mb}}
    extras                           op-specific fields measured beside it (floors, baselines, memory_mb)
    timer                            how the time was taken (method, rounds, reps, spread)
    device, versions, commit, dirty, command
    imported: true                   rows converted from an earlier log, with the versions and command it gave
    smoke: true                      rows of `--smoke` runs (the summary leaves them out)
"""

from __future__ import annotations

import importlib.metadata
import json
import pathlib
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping
from typing import Any


def device_dir(device_kind: str) -> str:
    """The folder name of a device kind: 'NVIDIA H200' -> 'nvidia_h200', 'TPU v5 lite' -> 'tpu_v5_lite'."""
    return re.sub(r"[^a-z0-9]+", "_", device_kind.lower()).strip("_") or "unknown"


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions(anchor_versions: Mapping[str, str] = {}) -> dict[str, str]:
    """Python, jax, jaxlib and hybrax versions, and those of the anchors' packages."""
    import jax
    import jaxlib

    import hybrax

    found = {"python": sys.version.split()[0], "jax": jax.__version__, "jaxlib": jaxlib.__version__,
             "hybrax": hybrax.__version__}
    return {**found, **anchor_versions}


def git_state(root: pathlib.Path | None = None) -> tuple[str | None, bool | None]:
    """(commit, whether src/ differs from it) of the checkout hybrax is imported from; (None, None) outside git."""
    import hybrax

    where = root or pathlib.Path(hybrax.__file__).resolve().parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=where, capture_output=True,
                                 text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None, None
    return commit, bool(changed)


def append(rows: Iterable[Mapping[str, Any]], out: pathlib.Path, device: str, op: str) -> pathlib.Path:
    """Append rows to out/<device>/<op>.jsonl; returns the file."""
    path = pathlib.Path(out) / device / f"{op}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as file:
        for row in rows:
            file.write(json.dumps(row, sort_keys=False) + "\n")
    return path


def load(results: pathlib.Path) -> list[dict[str, Any]]:
    """Every row under results/<device>/<op>.jsonl, in file order, each with its "device_dir"."""
    rows = []
    for path in sorted(pathlib.Path(results).glob("*/*.jsonl")):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number} is not a JSON object: {error}") from error
            rows.append({**row, "device_dir": path.parent.name})
    return rows


def key(row: Mapping[str, Any]) -> tuple:
    """What a row measures: device, op, implementation, shape, dtype and mode."""
    return row["device_dir"], row["op"], row["impl"], row["shape"], row["dtype"], row["mode"]


def current(rows: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The last row of every key (smoke rows left out), in the order keys first appear, each with "anchor_rows":
    anchor name -> (the last row of the key that timed that anchor, whether that is the row itself)."""
    latest: dict[tuple, Mapping[str, Any]] = {}
    anchored: dict[tuple, dict[str, Mapping[str, Any]]] = {}
    for row in rows:
        if row.get("smoke"):
            continue
        latest[key(row)] = row
        for name in row.get("anchors", {}):
            anchored.setdefault(key(row), {})[name] = row
    return [{**row, "anchor_rows": {name: (source, source is row) for name, source in anchored.get(k, {}).items()}}
            for k, row in latest.items()]
