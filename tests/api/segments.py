"""What the segment_ids tests share: batches of runs of ids (uneven runs, padding ids, runs of one token, odd T),
and the float64 reference that runs each run on its own from its initial state (one per run, row-major order,
padding runs included) with zero output at padding tokens."""

from __future__ import annotations

import numpy as np

IDS = {
    "B=2": np.array([[0, 0, 0, 1, 1, 2, -1], [5, -1, -1, 3, 3, 3, 3]]),
    "B=3": np.array([[1, 1, 1, 1, 1], [0, 2, 2, -1, -1], [4, 4, 7, 7, 4]]),
}


def row_cu_seqlens(row: np.ndarray) -> list[int]:
    """Boundaries of the runs of equal ids in one row."""
    starts = [0] + [t for t in range(1, len(row)) if row[t] != row[t - 1]]
    return starts + [len(row)]


def num_runs(ids: np.ndarray) -> int:
    return sum(len(row_cu_seqlens(row)) - 1 for row in ids)


def flat_cu_seqlens(ids: np.ndarray) -> np.ndarray:
    """The runs' boundaries over the rows flattened into one."""
    length = ids.shape[1]
    bounds = [b * length + t for b, row in enumerate(ids) for t in row_cu_seqlens(row)[:-1]]
    return np.array(bounds + [ids.size], np.int32)


def reference(run, arrays, ids: np.ndarray, initial_state, xp):
    """(o [B, T, ...], final states [R, ...]) from run(*row_arrays, initial_state=, cu_seqlens=, xp=) over each row's
    runs (the fla reference's packed form), padding tokens' outputs zeroed."""
    outputs, finals, first = [], [], 0
    for b, row in enumerate(ids):
        cu = row_cu_seqlens(row)
        h0 = None if initial_state is None else initial_state[first:first + len(cu) - 1]
        o, final = run(*(None if x is None else x[b:b + 1] for x in arrays), initial_state=h0, cu_seqlens=cu, xp=xp)
        keep = (row >= 0).reshape(1, -1, *([1] * (o.ndim - 2)))
        outputs.append(o * keep)
        finals.append(final)
        first += len(cu) - 1
    return xp.concatenate(outputs), xp.concatenate(finals)
