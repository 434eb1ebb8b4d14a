"""Wall-clock timing for CPU benchmarks on a shared, noisy machine.

Medians, not means: a neighbour's burst inflates a few samples and the median ignores them. When
several providers are compared, :func:`interleaved_ms` runs them in turn within every round, so a
slow period hits all of them alike and their ratio stays meaningful.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping


def median_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``reps`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(samples)


def interleaved_ms(
    fns: Mapping[str, Callable[[], object]], warmup: int = 3, reps: int = 20
) -> dict[str, float]:
    """Median milliseconds per provider, running every provider once per round (round-robin).

    The order rotates each round so no provider always runs right after the same neighbour
    (caches and allocator state carry over from one call to the next).
    """
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            fns[name]()
            samples[name].append(time.perf_counter() - t0)
    return {name: 1e3 * statistics.median(s) for name, s in samples.items()}
