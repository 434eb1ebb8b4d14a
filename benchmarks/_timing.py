"""Timing for CPU benchmarks on a shared, noisy machine.

Medians, not means: a neighbour's burst inflates a few samples and the median ignores them. When
several providers are compared, :func:`interleaved_ms` runs them in turn within every round, so a
slow period hits all of them alike and their ratio stays meaningful.

The clock is wall time unless :func:`use_clock` picks ``"thread"``: the CPU time of the calling
thread (``time.thread_time``), which does not count the time slices a neighbour takes from it.
That is the better measure on a machine shared with other jobs, and a valid one only with one
torch thread (the time of other threads is not counted); it still counts what a neighbour does to
the caches and to memory bandwidth.
"""

from __future__ import annotations

import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Mapping

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
_clock: Callable[[], float] = time.perf_counter


def use_clock(name: str) -> None:
    """Time with clock ``name`` from now on: ``"wall"`` (the default) or ``"thread"``."""
    global _clock
    _clock = CLOCKS[name]


def median_ms(fn: Callable[[], object], warmup: int = 3, reps: int = 20) -> float:
    """Median wall time of ``fn()`` in milliseconds over ``reps`` calls, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = _clock()
        fn()
        samples.append(_clock() - t0)
    return 1e3 * statistics.median(samples)


def interleaved_ms(
    fns: Mapping[str, Callable[[], object]], warmup: int = 3, reps: int = 20
) -> dict[str, float]:
    """Median milliseconds per provider, running every provider once per round (see
    :func:`interleaved_samples`)."""
    samples = interleaved_samples(fns, warmup, reps)
    return {name: statistics.median(s) for name, s in samples.items()}


def interleaved_samples(
    fns: Mapping[str, Callable[[], object]], warmup: int = 3, reps: int = 20
) -> dict[str, list[float]]:
    """Every sample in milliseconds per provider, running every provider once per round.

    The order is shuffled every round (seeded) so no provider always runs right after the same
    neighbour: caches, page mappings and allocator state carry over from one call to the next, and
    a provider that frees much memory slows whichever one comes next.
    """
    names = list(fns)
    rng = random.Random(0)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    samples: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        order = names[:]
        rng.shuffle(order)
        for name in order:
            t0 = _clock()
            fns[name]()
            samples[name].append(_clock() - t0)
    return {name: [1e3 * t for t in s] for name, s in samples.items()}


def consecutive_samples(
    fns: Mapping[str, Callable[[], object]], blocks: int = 6, calls: int = 30, warmup: int = 5
) -> dict[str, list[float]]:
    """Per provider, the median milliseconds of each of ``blocks`` blocks of ``calls``
    consecutive calls (after ``warmup`` calls), the providers' blocks in turn, the order reversed
    every other block. A provider then runs after itself, as a training loop calls one layer
    after another, where in :func:`interleaved_samples` it runs after the others and finds the
    caches and the allocator as they left them (torch's LSTM takes about 10% longer so at small
    shapes)."""
    names = list(fns)
    medians: dict[str, list[float]] = {name: [] for name in names}
    for block in range(blocks):
        for name in names if block % 2 == 0 else names[::-1]:
            medians[name].append(median_ms(fns[name], warmup, calls))
    return medians


# What restricts torch's own kernels to a narrower instruction set than the processor's: ATen's
# vectorized kernels, MKL's GEMMs and oneDNN's (torch.nn.LSTM's). With all three at AVX2 on an
# AVX-512 processor torch runs as it would on an AVX2 one (benchmarks/run_all.sh's second AVX2
# pass: the emulated AVX2 build against torch's AVX2 kernels).
TORCH_ISA_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def torch_isa() -> str:
    """The instruction set of torch's ATen kernels, with the variables of :data:`TORCH_ISA_ENV`
    that are set (for a results table's device line)."""
    import torch  # here, not at the top: the timing helpers do without it

    caps = torch.backends.cpu.get_cpu_capability()
    env = [f"{k}={os.environ[k]}" for k in TORCH_ISA_ENV if os.environ.get(k)]
    return caps + (f" ({', '.join(env)})" if env else "")


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, for the device line of a results table."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
