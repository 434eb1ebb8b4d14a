"""Recurrent layers on bfloat16/float16 CPU inputs: the fused whole-sequence path, computed in
float32 and returned in the input's dtype, against the float64 step-by-step reference on the same
rounded inputs and parameters."""

from __future__ import annotations

import copy

import pytest
import torch

import layernorm
from layernorm.recurrent import layers
from tolerances import UNIT_ROUNDOFF

LAYERS = (layernorm.LayerNormLSTM, layernorm.LayerNormGRU, layernorm.LayerNormRNN)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("cls", LAYERS, ids=lambda c: c.__name__)
def test_half_layers_take_the_fused_path_and_match_float64(cls, dtype, monkeypatch):
    torch.manual_seed(0)
    m = cls(16, 24, bidirectional=True).to(dtype)
    x = torch.randn(9, 3, 16, dtype=torch.float64).to(dtype).requires_grad_()
    ref = copy.deepcopy(m).double()
    ref.impl = "loop"

    def no_loop(*args, **kwargs):
        raise AssertionError("the step-by-step loop ran")

    monkeypatch.setattr(layers._LNRNNBase, "_loop", no_loop)
    out, state = m(x)
    assert out.dtype == dtype
    for s in state if isinstance(state, tuple) else (state,):
        assert s.dtype == dtype
    dy = torch.randn(out.shape, dtype=torch.float64).to(dtype)
    params = list(m.parameters())
    grads = torch.autograd.grad(out, [x, *params], dy)
    monkeypatch.undo()

    xr = x.detach().double().requires_grad_()
    out_r, _ = ref(xr)
    grads_r = torch.autograd.grad(out_r, [xr, *ref.parameters()], dy.double())
    # float32 arithmetic, one rounding of the outputs and of each gradient to the half type
    u = UNIT_ROUNDOFF[dtype]
    err = (out.double() - out_r).abs().max() / out_r.abs().max()
    assert err <= 4 * u, err
    for k, (g, gr) in enumerate(zip(grads, grads_r, strict=True)):
        assert g.dtype == dtype
        err = (g.double() - gr).abs().max() / gr.abs().max()
        assert err <= 8 * u, (k, err)
