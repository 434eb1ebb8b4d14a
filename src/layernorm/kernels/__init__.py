"""Kernel backends. Each backend module exposes the same functions with the same signatures:

- ``layer_norm_fwd(x, weight, bias, eps, *, for_backward=False) -> (y, mean, rstd)``
- ``layer_norm_bwd(dy, x, mean, rstd, weight, detach_mean, detach_std, need_dx, need_dw, need_db)
  -> (dx | None, dweight | None, dbias | None)``
- ``rms_norm_fwd(x, weight, eps, *, for_backward=False) -> (y, rstd)``
- ``rms_norm_bwd(dy, x, rstd, weight, need_dx, need_dw) -> (dx | None, dweight | None)``
- ``ada_norm_fwd(x, k, scale, eps, *, for_backward=False) -> (z, mean, rstd)``
- ``ada_norm_bwd(dz, x, mean, rstd, k, scale) -> dx``

``x`` and ``dy`` are contiguous 2-D ``(M, N)`` tensors (rows normalized independently); ``mean`` and
``rstd`` are ``(M,)`` tensors in float32 for half inputs and in the input's dtype otherwise.
``for_backward`` says a backward will follow (an autograd node's forward): the CPU backend then
serves the output from reused memory from a smaller size on (see
:mod:`layernorm.kernels.cpu.buffers`); the Triton backend has torch's caching allocator and
ignores it.
"""
