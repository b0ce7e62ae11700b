"""The short convolution in float64 NumPy, straight from the math: the tests' oracle."""

from __future__ import annotations

from typing import Any

import numpy as np


def short_conv_reference(
    x: Any, history: Any, weight: Any, bias: Any = None, activation: str | None = "silu"
) -> tuple[np.ndarray, np.ndarray]:
    """One sequence: x [T, D], history [D, W - 1] (its inputs before x, oldest first), weight [D, W].
    Returns y [T, D] and the new history (the last W - 1 inputs)."""
    x, history, weight = (np.asarray(a, np.float64) for a in (x, history, weight))
    taps = weight.shape[1] - 1
    full = np.concatenate([history.T, x], axis=0)
    y = np.array([np.sum(full[t:t + taps + 1].T * weight, axis=1) for t in range(x.shape[0])]).reshape(x.shape)
    if bias is not None:
        y = y + np.asarray(bias, np.float64)
    if activation == "silu":
        y = y / (1.0 + np.exp(-y))
    return y, full[len(full) - taps:].T
