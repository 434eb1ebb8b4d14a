"""ATen backend: compositions of PyTorch native ops, for CPU (and any device without Triton)."""
