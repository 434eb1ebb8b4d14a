"""Layer-normalized recurrent networks (Ba, Kiros & Hinton 2016, Section 3.1 and supplementary).

Cells (one time step, like ``torch.nn.LSTMCell``) and sequence layers (``torch.nn.LSTM``'s contract,
weights and state_dict), with a fused fast path, plus the recurrent batch-norm baseline
(``LayerNormLSTM(..., norm="batch")``, Cooijmans et al. 2016).

On the CPU the fused path takes its per-row buffers from a cache that hands each out again once
nothing holds it (:mod:`layernorm.kernels.cpu.buffers`, which the norm kernels' large outputs
share): :func:`set_buffer_cache_limit` bounds it (0: off), :func:`clear_buffer_cache` empties it.
"""

from ..kernels.cpu.buffers import buffer_cache_limit, clear_buffer_cache, set_buffer_cache_limit
from ._pointwise import StepKernels, register_step_kernels
from .cells import LayerNormGRUCell, LayerNormLSTMCell, LayerNormRNNCell
from .layers import LayerNormGRU, LayerNormLSTM, LayerNormRNN, bfloat16_recurrent_products

__all__ = [
    "LayerNormGRU",
    "LayerNormGRUCell",
    "LayerNormLSTM",
    "LayerNormLSTMCell",
    "LayerNormRNN",
    "LayerNormRNNCell",
    "StepKernels",
    "bfloat16_recurrent_products",
    "buffer_cache_limit",
    "clear_buffer_cache",
    "register_step_kernels",
    "set_buffer_cache_limit",
]
