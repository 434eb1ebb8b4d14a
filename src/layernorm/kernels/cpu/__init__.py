"""CPU backend (any device without Triton).

float32/float64 CPU tensors run fused one-pass C kernels (``csrc/norms.c``, built on first use by
:mod:`._native` for the processor's instruction set, see :mod:`.targets`); half types, other devices
and ``LAYERNORM_CPU_COMPILE=0`` run compositions of PyTorch's native ATen ops, which are always
available and serve as the fallback.
"""

from . import targets


def isa() -> str:
    """The instruction-set target the fused CPU kernels are built for in this process:
    ``"avx512"``, ``"avx2"`` or ``"portable"`` (see :mod:`.targets`; ``LAYERNORM_CPU_ISA``
    overrides the choice made from the CPU's features)."""
    return targets.selected().name
