"""Which of the recurrent layers' C paths the selected target runs, as skip markers, stated once.

The portable target (other architectures, or a compiler without the x86 targets' flags) has the
C step kernels but no whole-sequence kernels: there the layers run their steps one by one and
keep no plans, so a test of a sequence kernel, a plan or a planned node skips."""

from __future__ import annotations

import pytest
import torch

from layernorm.recurrent import _cstep

#: The C kernels built and the selected target's whole-sequence kernels with them.
HAS_SEQUENCE_KERNELS = bool(_cstep.available(torch.zeros(1)) and _cstep.sequence_gemm())

needs_sequence_kernels = pytest.mark.skipif(
    not HAS_SEQUENCE_KERNELS,
    reason="needs the C kernels (a C compiler) on a target with the whole-sequence path",
)
