"""The main job: run every operation on the default device, check it against its float64
reference and time it. `python -m hybrax.demo` prints one table.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import jax
import numpy as np

from hybrax.core import relative_error


@dataclasses.dataclass(frozen=True)
class Case:
    operation: str
    implementation: str
    shape: str
    run: Callable[[], Any]  # a jitted call on fixed inputs
    reference: Callable[[], Any]  # float64 NumPy result of the same math


def median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def attention_cases() -> list[Case]:
    return []


def recurrent_cases() -> list[Case]:
    return []


def kda_cases() -> list[Case]:
    return []


def main() -> None:
    cases = attention_cases() + recurrent_cases() + kda_cases()
    print(f"hybrax demo on {jax.devices()[0].device_kind} (jax {jax.__version__})")
    header = f"{'operation':<26} {'implementation':<22} {'shape':<28} {'rel. error':>10} {'time ms':>9}"
    print(header)
    print("-" * len(header))
    for case in cases:
        error = relative_error(jax.tree.map(np.asarray, case.run()), case.reference())
        ms = median_time(case.run) * 1e3
        print(f"{case.operation:<26} {case.implementation:<22} {case.shape:<28} {error:>10.2e} {ms:>9.3f}")


if __name__ == "__main__":
    main()
