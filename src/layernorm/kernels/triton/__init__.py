"""Triton backend: fused GPU kernels (also run on CPU tensors under TRITON_INTERPRET=1)."""
