"""PNG plots of one op's current rows: speed against sequence length (or, for decode steps, batch), ours beside
the anchors, one panel per mode.

Speed is the row's TFLOP/s, else its GB/s, else calls per second; an anchor's is the same work in the anchor's
time (the speed of the row that timed it, times its ratio ours / theirs), the stream floor's likewise. A line
joins the rows of one implementation or anchor whose shapes differ only along the x axis (and in batch, for
sequence length: the speed is per token); shapes alone on their line are points. Needs matplotlib, which is no
dependency of hybrax: without it `plot` says so once and draws nothing.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from hybrax.bench.shapes import Shape, parse
from hybrax.bench.workloads import MODES


@functools.cache
def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        print("plots skipped: matplotlib is not installed (pip install matplotlib)")
        return None
    return pyplot


def _metric(rows: Sequence[Mapping[str, Any]]) -> tuple[str, str]:
    for field, label in (("tflops", "TFLOP/s"), ("gbps", "GB/s")):
        if any(field in row for row in rows):
            return field, label
    return "per_second", "calls per second"


def _speed(row: Mapping[str, Any], field: str) -> float | None:
    if field == "per_second":
        return 1e3 / row["time_ms"]
    return row.get(field)


def _axis(op: str) -> tuple[str, str]:
    return ("batch", "batch (requests)") if op.endswith("_decode") else ("seq_len", "sequence length (tokens)")


# Shape fields that tell lines apart, as the legend writes them (fields at their default are left out).
LEGEND = (("seq_len", "T"), ("heads", "H"), ("kv_heads", "KV"), ("head_dim", "D"), ("context", "C"),
          ("sequences", "var"), ("window", "w"), ("segments", "seg"))


def _series(shape: Shape, x_field: str) -> str:
    """What a line holds fixed: every dimension but the x axis (and batch, when x is the sequence length)."""
    defaults = {"kv_heads": shape.heads, "context": 0, "sequences": 0, "window": None, "segments": 1,
                "seq_len": 1}
    return " ".join(f"{short}{getattr(shape, field)}" for field, short in LEGEND
                    if field != x_field and getattr(shape, field) != defaults.get(field, object()))


def _points(rows: Sequence[Mapping[str, Any]], field: str, x_field: str) -> dict[str, dict[int, float]]:
    """legend label -> {x: speed} for ours, every anchor (at the speed of the run that timed it, that run's own
    timing preferred over an earlier one's) and the stream floor of decode steps."""
    lines: dict[str, dict[int, float]] = {}
    earlier: dict[str, dict[int, float]] = {}
    for row in rows:
        ours = _speed(row, field)
        if ours is None:
            continue
        shape = parse(row["shape"])
        series = f"{row['dtype']} {_series(shape, x_field)}"
        x = getattr(shape, x_field)
        lines.setdefault(f"ours {row['impl']} {series}", {})[x] = ours
        for name, (source, same_row) in row["anchor_rows"].items():
            theirs = _speed(source, field) * source["anchors"][name]["ratio"] if _speed(source, field) else None
            if theirs:
                (lines if same_row else earlier).setdefault(f"{name} {series}", {})[x] = theirs
        if "floor_ms" in row["extras"]:
            lines.setdefault(f"stream floor {series}", {})[x] = ours * row["time_ms"] / row["extras"]["floor_ms"]
    for label, points in earlier.items():
        lines[label] = {**points, **lines.get(label, {})}
    return lines


def _styles(labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """A color per implementation or anchor, a marker per series, dashes for anchors and dots for floors."""
    who = list(dict.fromkeys(label.split(" ")[0] + (" " + label.split(" ")[1] if label.startswith("ours") else "")
                             for label in labels))
    series = list(dict.fromkeys(label.split(" ", 2 if label.startswith("ours") else 1)[-1] for label in labels))
    markers = "os^vDP*Xph<>"
    styles = {}
    for label in labels:
        name = label.split(" ")[0] + (" " + label.split(" ")[1] if label.startswith("ours") else "")
        rest = label.split(" ", 2 if label.startswith("ours") else 1)[-1]
        line = "-" if label.startswith("ours") else ":" if label.startswith("stream") else "--"
        styles[label] = dict(color=f"C{who.index(name) % 10}", marker=markers[series.index(rest) % len(markers)],
                             linestyle=line, alpha=0.85)
    return styles


def plot(op: str, rows: Sequence[Mapping[str, Any]], path: pathlib.Path) -> bool:
    """Draw the op's rows (those of `results.current`) to path; False where matplotlib is missing."""
    pyplot = _pyplot()
    if pyplot is None:
        return False
    field, label = _metric(rows)
    x_field, x_label = _axis(op)
    modes = [mode for mode in MODES if any(row["mode"] == mode for row in rows)]
    panels = {mode: _points([row for row in rows if row["mode"] == mode], field, x_field) for mode in modes}
    labels = sorted({name for lines in panels.values() for name in lines})
    styles = _styles(labels)
    legend_rows = -(-len(labels) // 2)
    figure, axes = pyplot.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.0 + 0.2 * legend_rows),
                                   squeeze=False)
    handles = {}
    for axis, mode in zip(axes[0], modes):
        for name, points in sorted(panels[mode].items()):
            xs, ys = zip(*sorted(points.items()))
            handles[name], = axis.plot(xs, ys, label=name, **styles[name])
        axis.set_xscale("log", base=2)
        axis.set(title=f"{op}, {mode}", xlabel=x_label, ylabel=label)
        axis.grid(True, which="both", alpha=0.3)
    figure.legend([handles[name] for name in labels], labels, loc="lower center", ncol=2, fontsize=7, frameon=False)
    figure.tight_layout(rect=(0, 0.2 * legend_rows / (4.0 + 0.2 * legend_rows) + 0.02, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return True
