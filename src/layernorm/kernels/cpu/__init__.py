"""CPU backend (any device without Triton).

float32, float64, bfloat16 and float16 CPU tensors run fused C kernels (``csrc/norms.c``, built on
first use by :mod:`._native` for the processor's instruction set, see :mod:`.targets`; the half
types compute in float32, with gains and biases in the input's dtype or float32). Other dtype
combinations, other devices and ``LAYERNORM_CPU_COMPILE=0`` run compositions of PyTorch's native
ATen ops, which are always available and serve as the fallback. The norm ops call the kernels
through C++ operators whose autograd node is C++ (``csrc_torch/norm_ops.cpp``, :mod:`.torch_ops`,
built against the installed PyTorch by the C++ compiler) where they can, through an
autograd.Function otherwise.
"""

from . import targets


def isa() -> str:
    """The instruction-set target the fused CPU kernels are built for in this process:
    ``"avx512bf16"``, ``"avx512"``, ``"avx2"`` or ``"portable"`` (see :mod:`.targets`;
    ``LAYERNORM_CPU_ISA`` overrides the choice made from the CPU's features)."""
    return targets.selected().name
