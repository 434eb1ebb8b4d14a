"""Layer-normalized recurrent networks (Ba, Kiros & Hinton 2016, Section 3.1 and supplementary).

Cells (one time step, like ``torch.nn.LSTMCell``) and sequence layers (``torch.nn.LSTM``'s contract,
weights and state_dict), with a fused fast path, plus the recurrent batch-norm baseline
(``LayerNormLSTM(..., norm="batch")``, Cooijmans et al. 2016).
"""

from ._pointwise import StepKernels, register_step_kernels
from .cells import LayerNormGRUCell, LayerNormLSTMCell, LayerNormRNNCell
from .layers import LayerNormGRU, LayerNormLSTM, LayerNormRNN

__all__ = [
    "LayerNormGRU",
    "LayerNormGRUCell",
    "LayerNormLSTM",
    "LayerNormLSTMCell",
    "LayerNormRNN",
    "LayerNormRNNCell",
    "StepKernels",
    "register_step_kernels",
]
