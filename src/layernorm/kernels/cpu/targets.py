"""The instruction sets the fused CPU kernels are built for, and the one this process uses.

One table (:data:`TARGETS`) names every target: its compiler flags, the CPU features it needs and
what the kernels do differently on it. The norm kernels (:mod:`._native`) and the recurrent
kernels (:mod:`.rnn`) each build one cached library per target, lazily, only for the target
selected; the target is part of the library's name and of its cache key.

Selection: the best target of this machine's architecture whose features the CPU lists (the
``flags`` line of ``/proc/cpuinfo`` on x86, ``Features`` on Arm), so one build no longer decides
for every machine that shares a cache, as ``-march=native`` did. ``LAYERNORM_CPU_ISA`` =
``avx512bf16`` / ``avx512`` / ``avx2`` / ``portable`` asks for one (e.g. to run the AVX2 kernels
on an AVX-512 machine); a name the CPU cannot run is refused with a warning and the best target
it can run is used instead, since running it would end in an illegal-instruction crash. The
variable is read once, on the first selection; :func:`use` switches in-process (tests, benchmarks).
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

ENV_ISA = "LAYERNORM_CPU_ISA"

_X86 = ("x86_64", "amd64")
_ARM = ("aarch64", "arm64")


@dataclass(frozen=True)
class Target:
    """One build target of the fused CPU kernels.

    ``features`` are the CPU feature names (as ``/proc/cpuinfo`` spells them) that every
    instruction the ``flags`` allow needs; ``rnn_sequence`` says whether the recurrent layers run
    a whole direction in one C call on this target (where its GEMM was measured to beat the
    per-step loop around ``torch.mm``; see ``benchmarks/RESULTS.md``)."""

    name: str
    machines: tuple[str, ...]
    flags: tuple[str, ...]
    features: frozenset[str]
    rnn_sequence: bool

    def runs_on(self, machine: str, cpu_features: frozenset[str]) -> bool:
        """Whether a CPU of architecture ``machine`` with ``cpu_features`` can run this build."""
        return machine in self.machines and self.features <= cpu_features


# The x86 ISA extensions are enabled one by one, not through -march=x86-64-v3/v4: each flag then
# maps to exactly one feature checked here (the compiler can emit nothing the check did not see),
# and older compilers accept them. -mtune=native only orders and aligns instructions for the host.
_AVX2_FLAGS = ("-march=x86-64", "-mtune=native", "-mavx", "-mavx2", "-mfma", "-mf16c")
_AVX2_FEATURES = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c"})
_AVX512_EXTRA = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd")
_AVX512_FLAGS = (*_AVX2_FLAGS, *(f"-m{f}" for f in _AVX512_EXTRA))
_AVX512_FEATURES = _AVX2_FEATURES | frozenset(_AVX512_EXTRA)

#: Every target, best first within each architecture. -msse4.2 is implied by -mavx.
TARGETS: tuple[Target, ...] = (
    # The AVX-512 kernels with the processor's bfloat16 instructions (AVX512-BF16: Cooper Lake
    # and Sapphire Rapids Xeons, AMD Zen 4 and later): the half kernels round float32 to
    # bfloat16 by one instruction (vcvtneps2bf16) where the others take integer arithmetic.
    Target(
        "avx512bf16",
        _X86,
        (*_AVX512_FLAGS, "-mavx512bf16"),
        _AVX512_FEATURES | {"avx512_bf16"},
        rnn_sequence=True,
    ),
    Target("avx512", _X86, _AVX512_FLAGS, _AVX512_FEATURES, rnn_sequence=True),
    Target("avx2", _X86, _AVX2_FLAGS, _AVX2_FEATURES, rnn_sequence=True),
    # SSE2 and no FMA: the C GEMM ran at 0.35–0.9× torch.mm and the layers were slower than with
    # the per-step loop at 4 of 6 bench shapes (RESULTS.md), so the loop stays; Arm is unmeasured.
    Target("portable", _X86, ("-march=x86-64", "-mtune=native"), frozenset(), rnn_sequence=False),
    Target("portable", _ARM, ("-march=armv8-a",), frozenset(), rnn_sequence=False),
)
#: Every target name, best first.
NAMES: tuple[str, ...] = tuple(dict.fromkeys(t.name for t in TARGETS))


def machine() -> str:
    """This machine's architecture, lower case (``x86_64``, ``aarch64``, ...)."""
    return platform.machine().lower()


def _cpuinfo(*keys: str) -> str:
    """The value of the first ``/proc/cpuinfo`` field named one of ``keys`` (lower case), the
    first processor's; empty where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in keys:
                    return value.strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_features() -> frozenset[str]:
    """The CPU's feature names from ``/proc/cpuinfo`` (empty where there is none)."""
    return frozenset(_cpuinfo("flags", "features").split())


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor as ``/proc/cpuinfo`` names it (``GenuineIntel``, ``AuthenticAMD``; empty
    where there is none)."""
    return _cpuinfo("vendor_id")


@functools.cache
def cpu_family() -> int:
    """The x86 CPU family number as ``/proc/cpuinfo`` gives it (AMD Zen 4: 25, Zen 5: 26; 0
    where there is none)."""
    value = _cpuinfo("cpu family")
    return int(value) if value.isdigit() else 0


class UnavailableIsaError(RuntimeError):
    """The named target is unknown, or this CPU lacks features it needs."""


def target(name: str, arch: str | None = None, features: frozenset[str] | None = None) -> Target:
    """The target ``name`` for this machine (or ``arch`` with ``features``); raises
    :class:`UnavailableIsaError` naming what is missing when the CPU cannot run it, or, on this
    machine, when the C compiler does not accept its flags (the portable target is always
    offered)."""
    this_machine = arch is None and features is None
    arch = machine() if arch is None else arch
    features = cpu_features() if features is None else features
    if name not in NAMES:
        raise UnavailableIsaError(
            f"unknown CPU instruction set {name!r}; choose one of {', '.join(NAMES)}"
        )
    candidates = [t for t in TARGETS if t.name == name and arch in t.machines]
    if not candidates:
        if name == "portable":  # any other architecture: the compiler's default target
            return Target("portable", (arch,), (), frozenset(), rnn_sequence=False)
        raise UnavailableIsaError(f"the {name} kernels are not built for {arch} processors")
    missing = candidates[0].features - features
    if missing:
        raise UnavailableIsaError(
            f"this CPU cannot run the {name} kernels: it lacks {', '.join(sorted(missing))}"
        )
    chosen = candidates[0]
    # imported here: `python targets.py` (make check-c) runs this file on its own
    from . import cbuild

    if this_machine and name != "portable" and not cbuild.accepts_flags(chosen.flags):
        raise UnavailableIsaError(
            f"the C compiler ({cbuild.compiler()}) does not accept the {name} kernels' flags "
            f"({' '.join(chosen.flags)})"
        )
    return chosen


def best(arch: str | None = None, features: frozenset[str] | None = None) -> Target:
    """The best target this machine (or ``arch`` with ``features``) can run."""
    for name in NAMES:
        try:
            return target(name, arch, features)
        except UnavailableIsaError:
            continue
    raise AssertionError("the portable target runs everywhere")  # pragma: no cover


def available() -> tuple[str, ...]:
    """The names of the targets this CPU can run, best first."""
    out = []
    for name in NAMES:
        try:
            target(name)
        except UnavailableIsaError:
            continue
        out.append(name)
    return tuple(out)


def _from_environment() -> Target:
    requested = os.environ.get(ENV_ISA, "").strip().lower()
    if not requested or requested in ("auto", "native"):
        return best()
    try:
        return target(requested)
    except UnavailableIsaError as err:
        chosen = best()
        warnings.warn(
            f"layernorm: {ENV_ISA}={requested} refused ({err}); using {chosen.name}",
            RuntimeWarning,
            stacklevel=3,
        )
        return chosen


_SELECTED: list[Target] = []


def selected() -> Target:
    """The target this process's kernels use (chosen on the first call, see the module doc)."""
    if not _SELECTED:
        _SELECTED.append(_from_environment())
    return _SELECTED[-1]


@contextlib.contextmanager
def use(name: str) -> Iterator[Target]:
    """Run the kernels built for target ``name`` inside the ``with`` block (each target's
    libraries are built on first use and stay loaded). Raises :class:`UnavailableIsaError` when
    this CPU cannot run it. Not thread-safe: other threads see the switch too."""
    chosen = target(name)
    selected()
    _SELECTED.append(chosen)
    try:
        yield chosen
    finally:
        _SELECTED.pop()


if __name__ == "__main__":  # `python targets.py`: each target of this architecture and its flags
    for t in TARGETS:
        if machine() in t.machines:
            print(t.name, *t.flags)
