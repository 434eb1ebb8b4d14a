"""CPU backend (any device without Triton).

float32/float64 CPU tensors run fused one-pass C kernels (``csrc/norms.c``, built on first use by
:mod:`._native`); half types, other devices and ``LAYERNORM_CPU_COMPILE=0`` run compositions of
PyTorch's native ATen ops, which are always available and serve as the fallback.
"""
