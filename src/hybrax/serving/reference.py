"""The short convolution in float64 NumPy, straight from the math: the tests' oracle."""

from __future__ import annotations

from typing import Any

import numpy as np


def short_conv_reference(
    x: Any, history: Any, weight: Any, bias: Any = None, activation: str | None = "silu", xp: Any = np
) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: x [T, D], history [D, W - 1] (its inputs before x, oldest first), weight [D, W].
    Returns y [T, D] and the new history (the last W - 1 inputs). `xp` is numpy (float64 here) or jax.numpy
    (the tests' differentiable oracle, on float64 arrays)."""
    if xp is np:
        x, history, weight, bias = (None if a is None else np.asarray(a, np.float64)
                                    for a in (x, history, weight, bias))
    taps, length = weight.shape[1] - 1, x.shape[0]
    full = xp.concatenate([history.T, x], axis=0)
    y = sum(full[tap:tap + length] * weight[:, tap] for tap in range(taps + 1))  # y_t = sum_j full[t + j] w_j
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = y / (1.0 + xp.exp(-y))
    return y, full[len(full) - taps:].T
