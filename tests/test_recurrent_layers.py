"""Sequence layers: fused path vs the step-by-step reference, torch equivalence, packing, shapes.

Tolerances (float64 unless said): the fused path and the reference loop run the same arithmetic
in a different order (one GEMM for all input projections, per-step GEMMs, gain gradients summed
once over all steps instead of per step), so they agree to a few ulps times the number of steps:
``FUSED_TOL``. Against ``torch.nn.LSTM``/``GRU``/``RNN`` with ``norm="none"`` the same holds
(``TORCH_TOL``). float32 has its own row: the C kernels' exp/tanh are within ~2 ulp of libm's
(float32's); the float64 kernels' within 4 ulp of libm's (``test_rnn_gate_math.py``).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pack_sequence, pad_packed_sequence

from kernel_paths import cell_nodes, needs_sequence_kernels, outcome, planned_nodes
from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.recurrent import StepKernels, _pointwise, register_step_kernels
from layernorm.recurrent import layers as recurrent_layers
from layernorm.recurrent.cells import LayerNormGRUCell, LayerNormLSTMCell, LayerNormRNNCell

DT = torch.float64
FUSED_TOL = {"rtol": 1e-10, "atol": 1e-11}
TORCH_TOL = {"rtol": 1e-10, "atol": 1e-12}
F32_TOL = {"rtol": 2e-5, "atol": 2e-5}
LAYERS = {"lstm": (LayerNormLSTM, torch.nn.LSTM), "gru": (LayerNormGRU, torch.nn.GRU),
          "rnn": (LayerNormRNN, torch.nn.RNN)}  # fmt: skip
LENGTHS = [5, 2, 5, 1]  # unsorted on purpose: enforce_sorted=False


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1.0 + 0.3 * noise if "_weight" in name and "ln" in name else 0.4 * noise)


def seq(t: int, b: int, n: int, seed: int = 1, dtype: torch.dtype = DT) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = 1.0 + 1.5 * torch.randn(t, b, n, generator=gen, dtype=torch.float64)
    return (x + torch.linspace(-1, 1, b, dtype=torch.float64).view(1, b, 1)).to(dtype)


def states(kind: str, layers: int, b: int, h: int, seed: int = 2) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    n = 2 if kind == "lstm" else 1
    return tuple(torch.randn(layers, b, h, generator=gen, dtype=DT) for _ in range(n))


def run(model, x, hx, packed: bool, before_backward=None):
    """Output data, final states, and gradients of input, initial states and every parameter
    (``before_backward()`` called between the forward and the backward, where given)."""
    model.zero_grad()
    x = x.detach().clone().requires_grad_()
    hx = tuple(s.detach().clone().requires_grad_() for s in hx)
    inp = pack_padded_sequence(x, torch.tensor(LENGTHS), enforce_sorted=False) if packed else x
    out, h_n = model(inp, hx if len(hx) == 2 else hx[0])
    data = out.data if packed else out
    h_n = h_n if isinstance(h_n, tuple) else (h_n,)
    weights = torch.linspace(-1, 2, data.numel(), dtype=data.dtype, device=data.device)
    weights = weights.view_as(data)
    loss = (data * weights).sum() + sum((s * s).sum() for s in h_n)
    if before_backward is not None:
        before_backward()
    loss.backward()
    grads = [x.grad, *(s.grad for s in hx)]
    grads += [p.grad for _, p in model.named_parameters()]
    return [data.detach(), *(s.detach() for s in h_n)], grads


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("norm", ["layer", "none"])
@pytest.mark.parametrize("packed", [False, True])
def test_fused_equals_reference_loop(kind: str, norm: str, packed: bool) -> None:
    cls, _ = LAYERS[kind]
    model = cls(3, 4, num_layers=2, bidirectional=True, norm=norm, dtype=DT)
    randomize(model)
    x, hx = seq(5, 4, 3), states(kind, 4, 4, 4)
    model.impl = "fused"
    out_f, grads_f = run(model, x, hx, packed)
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)


@pytest.mark.usefixtures("python_training_node")  # it watches rnn.run_sequence
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("norm", ["layer", "none"])
@pytest.mark.parametrize("inputs", [16, 4], ids=["rows<=inputs", "rows>inputs"])
def test_one_step_of_a_batch_equals_reference_loop(kind, norm, inputs, monkeypatch) -> None:
    """One time step of more rows than the sequence kernels read their weights as stored for (a
    step of a batch): the GRU trains on the C step kernels around torch's GEMMs, not the sequence
    kernels, and its input projection is one GEMM split into the layer norms' blocks where the
    rows are at most the inputs (else a GEMM per block); forward and every gradient are the
    loop's."""
    from layernorm.kernels.cpu import rnn
    from layernorm.recurrent import _cstep

    batch = _cstep.direct_rows() + 4
    cls, _ = LAYERS[kind]
    model = cls(inputs, 5, norm=norm, dtype=DT)
    randomize(model)
    x, hx = seq(1, batch, inputs), states(kind, 1, batch, 5)
    sequences = []
    real = rnn.run_sequence
    monkeypatch.setattr(rnn, "run_sequence", lambda k, *a: sequences.append(k) or real(k, *a))
    model.impl = "fused"
    out_f, grads_f = run(model, x, hx, packed=False)
    if _cstep.sequence_gemm():
        assert ("gru" not in "".join(sequences)) if kind == "gru" else sequences
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed=False)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("bias", [True, False])
def test_fused_equals_loop_with_a_large_eps(kind: str, bias: bool) -> None:
    """eps reaches every layer norm of the fused path (the input side's too): with eps = 0.3 on
    inputs whose pre-activations have variance of order 0.3, any norm left at the default 1e-5
    moves the outputs by far more than the tolerance."""
    cls, _ = LAYERS[kind]
    model = cls(3, 4, eps=0.3, bias=bias, dtype=DT)
    randomize(model)
    x, hx = 0.3 * seq(5, 4, 3), states(kind, 1, 4, 4)
    model.impl = "fused"
    out_f, grads_f = run(model, x, hx, packed=True)
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed=True)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)


def test_fused_lstm_normalized_cell_state_and_relu_rnn_equal_loop() -> None:
    for model, kind in (
        (LayerNormLSTM(3, 4, normalize_cell_state=True, bias=False, dtype=DT), "lstm"),
        (LayerNormRNN(3, 4, nonlinearity="relu", dtype=DT), "rnn"),
        (LayerNormGRU(3, 4, bias=False, dtype=DT), "gru"),
    ):
        randomize(model)
        x, hx = seq(5, 4, 3), states(kind, 1, 4, 4)
        model.impl = "fused"
        a = run(model, x, hx, packed=False)
        model.impl = "loop"
        b = run(model, x, hx, packed=False)
        for u, v in zip(a[0] + a[1], b[0] + b[1], strict=True):
            torch.testing.assert_close(u, v, **FUSED_TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_eager_step_kernels_equal_reference(kind: str) -> None:
    """The device seam's eager implementation (used off-CPU) agrees with the loop as well."""
    cls, _ = LAYERS[kind]
    model = cls(3, 4, bidirectional=True, dtype=DT)
    randomize(model)
    x, hx = seq(5, 4, 3), states(kind, 2, 4, 4)
    calls = []

    def counted(fn):
        def wrapper(st, off, bs):
            calls.append(bs)
            return fn(st, off, bs)

        return wrapper

    eager = _pointwise.EAGER
    fns = (eager.lstm_fwd, eager.lstm_bwd, eager.gru_fwd, eager.gru_bwd)
    register_step_kernels("cpu", StepKernels(*(counted(f) for f in fns)))
    try:
        model.impl = "fused"
        out_f, grads_f = run(model, x, hx, packed=True)
    finally:
        register_step_kernels("cpu", None)
    assert len(calls) == 2 * 2 * max(LENGTHS)  # 2 directions x 5 steps, forward and backward
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed=True)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_float32_fused_close_to_float64_reference(kind: str) -> None:
    cls, _ = LAYERS[kind]
    m64 = cls(8, 16, dtype=DT, impl="loop")
    randomize(m64)
    m32 = cls(8, 16, impl="fused")
    m32.load_state_dict({k: v.float() for k, v in m64.state_dict().items()})
    x = seq(20, 3, 8, dtype=torch.float32)
    out32, _h32 = m32(x)
    out64, _h64 = m64(x.double())
    torch.testing.assert_close(out32.double(), out64, **F32_TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_layer_gradcheck(kind: str) -> None:
    cls, _ = LAYERS[kind]
    model = cls(2, 3, bidirectional=True, dtype=DT)
    randomize(model)
    names = [n for n, _ in model.named_parameters()]
    x = seq(3, 2, 2).requires_grad_()

    def fn(x, *ps):
        out, _ = torch.func.functional_call(model, dict(zip(names, ps, strict=True)), (x,))
        return out

    assert torch.autograd.gradcheck(fn, (x, *model.parameters()), fast_mode=True)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_norm_none_equals_torch_after_strict_state_dict_load(kind: str) -> None:
    cls, tcls = LAYERS[kind]
    kwargs = {"nonlinearity": "relu"} if kind == "rnn" else {}
    ref = tcls(3, 5, num_layers=2, bidirectional=True, batch_first=True, **kwargs).double()
    ours = cls(
        3, 5, num_layers=2, bidirectional=True, batch_first=True, norm="none", dtype=DT, **kwargs
    )
    ours.load_state_dict(ref.state_dict(), strict=True)
    assert [n for n, _ in ref.named_parameters()] == [n for n, _ in ours.named_parameters()]
    x = seq(6, 4, 3).transpose(0, 1).contiguous()  # (B, T, I) = (4, 6, 3)
    hx = states(kind, 4, 4, 5)  # (layers x directions, B, H)
    h_arg = hx if kind == "lstm" else hx[0]
    out_r, h_r = ref(x, h_arg)
    out_o, h_o = ours(x, h_arg)
    torch.testing.assert_close(out_o, out_r, **TORCH_TOL)
    for a, b in zip(
        h_o if kind == "lstm" else (h_o,), h_r if kind == "lstm" else (h_r,), strict=True
    ):
        torch.testing.assert_close(a, b, **TORCH_TOL)
    # and back: our state_dict loads strictly into torch's module
    back = tcls(3, 5, num_layers=2, bidirectional=True, batch_first=True, **kwargs).double()
    back.load_state_dict(ours.state_dict(), strict=True)
    torch.testing.assert_close(back(x, h_arg)[0], out_r, rtol=0, atol=0)
    # gradients too
    out_r.sum().backward()
    out_o.sum().backward()
    for (n, p), (_, q) in zip(ref.named_parameters(), ours.named_parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, **TORCH_TOL, msg=n)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_norm_none_equals_torch_on_packed_unbatched_and_float32(kind: str) -> None:
    cls, tcls = LAYERS[kind]
    ref = tcls(3, 4)
    ours = cls(3, 4, norm="none")
    ours.load_state_dict(ref.state_dict())
    x = seq(5, 4, 3, dtype=torch.float32)
    packed = pack_padded_sequence(x, torch.tensor(LENGTHS), enforce_sorted=False)
    hx = tuple(torch.randn(1, 4, 4) for _ in range(2 if kind == "lstm" else 1))
    h_arg = hx if kind == "lstm" else hx[0]
    out_r, h_r = ref(packed, h_arg)
    out_o, h_o = ours(packed, h_arg)
    assert isinstance(out_o, torch.nn.utils.rnn.PackedSequence)
    torch.testing.assert_close(out_o.data, out_r.data, **F32_TOL)
    torch.testing.assert_close(out_o.unsorted_indices, out_r.unsorted_indices)
    for a, b in zip(
        h_o if kind == "lstm" else (h_o,), h_r if kind == "lstm" else (h_r,), strict=True
    ):
        torch.testing.assert_close(a, b, **F32_TOL)
    # unbatched (T, I) input and (L, H) states, as torch
    out_r, _ = ref(x[:, 0])
    out_o, h_o = ours(x[:, 0])
    assert out_o.shape == (5, 4)
    assert (h_o[0] if kind == "lstm" else h_o).shape == (1, 4)
    torch.testing.assert_close(out_o, out_r, **F32_TOL)


def test_from_torch_and_non_strict_load_keep_norm_init() -> None:
    ref = torch.nn.LSTM(3, 4, num_layers=2)
    ours = LayerNormLSTM.from_torch(ref, gain_init=0.5)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(getattr(ours, name), p)
    assert torch.all(ours.ln_weight_hh_l1 == 0.5) and torch.all(ours.ln_bias_c_l0 == 0)
    other = LayerNormLSTM(3, 4, num_layers=2)
    result = other.load_state_dict(ref.state_dict(), strict=False)
    assert not result.unexpected_keys
    assert all(k.startswith("ln_") for k in result.missing_keys)
    torch.testing.assert_close(other.weight_hh_l1, ref.weight_hh_l1)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_packed_equals_each_sequence_alone(kind: str) -> None:
    cls, _ = LAYERS[kind]
    model = cls(3, 4, bidirectional=True, num_layers=2, dtype=DT)
    randomize(model)
    x = seq(5, 4, 3)
    out, h_n = model(pack_padded_sequence(x, torch.tensor(LENGTHS), enforce_sorted=False))
    padded, _lengths = pad_packed_sequence(out)
    h_n = h_n[0] if kind == "lstm" else h_n
    for b, length in enumerate(LENGTHS):
        alone, h_alone = model(x[:length, b])  # unbatched
        h_alone = h_alone[0] if kind == "lstm" else h_alone
        torch.testing.assert_close(padded[:length, b], alone, **FUSED_TOL)
        torch.testing.assert_close(h_n[:, b], h_alone, **FUSED_TOL)
        assert torch.all(padded[length:, b] == 0)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_example_in_batch_equals_example_alone(kind: str) -> None:
    cls, _ = LAYERS[kind]
    model = cls(3, 4, dtype=DT)
    randomize(model)
    x = seq(6, 5, 3)
    out, _ = model(x)
    alone, _ = model(x[:, 3:4])
    torch.testing.assert_close(out[:, 3:4], alone, **FUSED_TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_shapes_bidirectional_multilayer_batch_first(kind: str) -> None:
    cls, tcls = LAYERS[kind]
    for kwargs in ({}, {"num_layers": 3, "bidirectional": True, "batch_first": True}):
        ours, ref = cls(3, 4, **kwargs), tcls(3, 4, **kwargs)
        x = torch.randn(2, 5, 3) if kwargs.get("batch_first") else torch.randn(5, 2, 3)
        out_o, h_o = ours(x)
        out_r, h_r = ref(x)
        assert out_o.shape == out_r.shape
        if kind == "lstm":
            assert h_o[0].shape == h_r[0].shape and h_o[1].shape == h_r[1].shape
        else:
            assert h_o.shape == h_r.shape


def test_dropout_between_layers_only_in_training() -> None:
    model = LayerNormLSTM(3, 4, num_layers=2, dropout=0.5)
    x = torch.randn(5, 2, 3)
    model.eval()
    a, _ = model(x)
    b, _ = model(x)
    torch.testing.assert_close(a, b)
    model.train()
    torch.manual_seed(1)
    c, _ = model(x)
    torch.manual_seed(2)
    d, _ = model(x)
    assert not torch.allclose(c, d)
    with pytest.warns(UserWarning, match="no effect with num_layers=1"):
        single = LayerNormLSTM(3, 4, num_layers=1, dropout=0.5)
    torch.testing.assert_close(single(x)[0], single(x)[0])  # no dropout after the last layer


def test_nan_input_is_not_hidden() -> None:
    for kind in ("lstm", "gru", "rnn"):
        cls, _ = LAYERS[kind]
        x = torch.randn(4, 2, 3)
        x[1, 0, 2] = float("nan")
        out, _ = cls(3, 4)(x)
        assert torch.isnan(out[1:, 0]).all() and not torch.isnan(out[:, 1]).any()


def test_torch_compile_of_a_layer() -> None:
    model = LayerNormLSTM(3, 4)
    x = torch.randn(3, 2, 3)
    compiled = torch.compile(model, backend="aot_eager")
    out_c, (_h_c, _) = compiled(x)
    out_e, (_h_e, _) = model(x)
    torch.testing.assert_close(out_c, out_e)
    out_c.sum().backward()
    assert model.ln_weight_hh_l0.grad is not None


def test_gain_init_option() -> None:
    model = LayerNormLSTM(3, 4, gain_init=0.1, num_layers=2)
    for name, p in model.named_parameters():
        if name.startswith("ln_weight"):
            assert torch.all(p == 0.1)
        elif "bias" in name:
            assert torch.all(p == 0)


def test_double_backward_refused_on_fused_path_supported_by_loop() -> None:
    model = LayerNormGRU(2, 3, dtype=DT)
    randomize(model)
    x = seq(3, 2, 2).requires_grad_()
    with pytest.raises(RuntimeError, match="impl='loop'"):
        torch.autograd.grad(model(x)[0].sum(), x, create_graph=True)
    model.impl = "loop"
    assert torch.autograd.gradgradcheck(lambda x: model(x)[0], (x,), fast_mode=True)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_batched_backward_refused_on_fused_path_supported_by_loop(kind: str) -> None:
    """A batched backward (``jacobian(..., vectorize=True)``, ``is_grads_batched=True``) hands
    the fused node batched tensors, whose memory its kernels cannot read: refused by name, where
    it raised "Cannot access data pointer"; the loop gives torch's own batched jacobian."""
    cls, _ = LAYERS[kind]
    model = cls(2, 3, dtype=DT)
    randomize(model)
    x = seq(3, 2, 2)
    with pytest.raises(RuntimeError, match=r"no batched backward.*impl='loop'"):
        torch.autograd.functional.jacobian(lambda x: model(x)[0], x, vectorize=True)
    model.impl = "loop"
    batched = torch.autograd.functional.jacobian(lambda x: model(x)[0], x, vectorize=True)
    one_by_one = torch.autograd.functional.jacobian(lambda x: model(x)[0], x)
    torch.testing.assert_close(batched, one_by_one, **FUSED_TOL)


_TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_triton_step_kernels_equal_reference(kind: str) -> None:
    """The fused path with the Triton steps (on CUDA, or the interpreter on CPU) vs the loop."""
    cls, _ = LAYERS[kind]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = cls(3, 8, bidirectional=True, device=device)
    randomize(model)
    x, hx = seq(5, 4, 3, dtype=torch.float32), states(kind, 2, 4, 8)
    x, hx = x.to(device), tuple(s.float().to(device) for s in hx)
    steps = _pointwise._triton_step_kernels()
    assert steps is not None
    register_step_kernels(device, steps)
    try:
        model.impl = "fused"
        out_f, grads_f = run(model, x, hx, packed=True)
    finally:
        register_step_kernels(device, None)
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed=True)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_layer_full_gradcheck_tiny(kind: str) -> None:
    """Full (not randomized) gradcheck of the fused path's hand-written backward, tiny sizes."""
    cls, _ = LAYERS[kind]
    model = cls(2, 2, num_layers=2, dtype=DT)
    randomize(model)
    names = [n for n, _ in model.named_parameters()]
    x = seq(3, 2, 2).requires_grad_()
    hx = tuple(s.requires_grad_() for s in states(kind, 2, 2, 2))

    def fn(x, *args):
        h, ps = args[: len(hx)], args[len(hx) :]
        h_arg = h if kind == "lstm" else h[0]
        out, h_n = torch.func.functional_call(model, dict(zip(names, ps, strict=True)), (x, h_arg))
        return out, *(h_n if kind == "lstm" else (h_n,))

    assert torch.autograd.gradcheck(fn, (x, *hx, *model.parameters()))


@pytest.mark.parametrize("cls", [LayerNormLSTM, LayerNormGRU, LayerNormRNN])
def test_fused_backward_never_reads_unwritten_buffers(cls, monkeypatch):
    """With every fresh buffer poisoned with NaN, the fused path's gradients must still be finite
    and match the reference loop (regression: the C step backward of ``recurrent/_csrc.py`` once
    computed ``0 · dx`` on an uninitialized ``dx``, which is NaN when the memory happens to be)."""
    real_new_empty, real_empty_like = torch.Tensor.new_empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *a, **k: poison(real_new_empty(self, *a, **k)))  # fmt: skip
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    torch.manual_seed(0)
    fused = cls(5, 6, impl="fused")
    loop = cls(5, 6, impl="loop")
    loop.load_state_dict(fused.state_dict())
    x = pack_sequence([torch.randn(n, 5) for n in (7, 3, 6, 1)], enforce_sorted=False)
    for m in (fused, loop):
        out, state = m(x)
        h = state[0] if isinstance(state, tuple) else state
        (out.data.square().sum() + h.sum()).backward()
    for (name, p), q in zip(fused.named_parameters(), loop.parameters(), strict=True):
        assert torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("bias", [True, False])
def test_torch_compatible_attributes(kind: str, bias: bool) -> None:
    """``all_weights``, ``flatten_parameters`` and ``proj_size`` as torch's, for drop-in code."""
    cls, ref_cls = LAYERS[kind]
    ref = ref_cls(3, 4, num_layers=2, bias=bias, bidirectional=True)
    ours = cls.from_torch(ref, norm="none")
    ours.flatten_parameters()
    assert ours.proj_size == 0
    assert len(ours.all_weights) == len(ref.all_weights) == 4
    for mine, theirs in zip(ours.all_weights, ref.all_weights, strict=True):
        assert len(mine) == len(theirs)
        for p, q in zip(mine, theirs, strict=True):
            assert isinstance(p, torch.nn.Parameter)
            assert torch.equal(p, q)


def test_repr_shows_every_non_default_option() -> None:
    assert repr(LayerNormLSTM(3, 4)) == "LayerNormLSTM(3, 4, norm='layer')"
    text = repr(LayerNormRNN(3, 4, 2, "relu", eps=1e-3, impl="loop"))
    for part in ("num_layers=2", "nonlinearity='relu'", "eps=0.001", "impl='loop'"):
        assert part in text, text
    text = repr(LayerNormLSTM(3, 4, normalize_cell_state=True, gain_init=0.5))
    assert "normalize_cell_state=True" in text and "gain_init=0.5" in text, text
    text = repr(LayerNormLSTM(3, 4, norm="batch", momentum=0.2))
    assert "momentum=0.2" in text and "max_steps=100" in text, text


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_from_torch_refuses_weights_it_would_drop(kind: str) -> None:
    cls, ref_cls = LAYERS[kind]
    with pytest.raises(ValueError, match=r"from_torch: unexpected keys \['bias_ih_l0'"):
        cls.from_torch(ref_cls(3, 4), bias=False)


@pytest.mark.parametrize(
    ("layer", "cell"),
    [(LayerNormLSTM, LayerNormLSTMCell), (LayerNormGRU, LayerNormGRUCell),
     (LayerNormRNN, LayerNormRNNCell)],
)  # fmt: skip
@pytest.mark.parametrize("bias", [True, False])
def test_one_layer_has_its_cells_parameters(layer, cell, bias: bool) -> None:
    """A one-layer sequence layer's parameters are its cell's, in the same order, named ``*_l0``."""
    ours = [(n.removesuffix("_l0"), p.shape) for n, p in layer(3, 4, bias=bias).named_parameters()]
    assert ours == [(n, p.shape) for n, p in cell(3, 4, bias=bias).named_parameters()]


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("other", ["lstm", "gru", "rnn"])
def test_from_torch_of_another_kind_names_both(kind: str, other: str) -> None:
    cls, ref_cls = LAYERS[kind]
    other_cls = LAYERS[other][1]
    if other == kind:
        assert isinstance(cls.from_torch(other_cls(3, 4)), cls)
        return
    expected = rf"{cls.__name__}.from_torch expects a torch.nn.{ref_cls.__name__}, "
    with pytest.raises(TypeError, match=expected + rf"got {other_cls.__name__}"):
        cls.from_torch(other_cls(3, 4))


@pytest.mark.parametrize(
    ("cell", "torch_cell"),
    [(LayerNormRNNCell, torch.nn.RNNCell), (LayerNormGRUCell, torch.nn.GRUCell)],
)
def test_cell_from_torch_refuses_a_layer(cell: type, torch_cell: type) -> None:
    with pytest.raises(TypeError, match=rf"expects a torch.nn.{torch_cell.__name__}, got Linear"):
        cell.from_torch(torch.nn.Linear(3, 4))


def test_fused_nodes_refuse_jit_trace() -> None:
    # the fused nodes pass raw pointers to C; a trace would replay them on freed memory
    from layernorm.recurrent import _fused

    def fn(x: torch.Tensor) -> torch.Tensor:
        _fused._check_untraced("LSTMSequence")
        return x * 2

    with pytest.raises(RuntimeError, match=r"LSTMSequence cannot be recorded by torch\.jit\.trace"):
        torch.jit.trace(fn, torch.ones(2))
    fn(torch.ones(2))  # outside a trace it passes


@pytest.mark.parametrize("limit", [None, 0], ids=["small", "above the limit"])
def test_small_training_projection_takes_torch_s_layer_norm(limit, monkeypatch) -> None:
    """Where the C block norm does not serve it (no C compiler, a transform), the GRU's input
    projection in training normalizes each block with torch's kernel up to
    ``TORCH_PROJECTION_NUMEL`` elements (float32 / float64 on the CPU), with the fused kernels above
    it; the layer's values and gradients are the loop's either way."""
    from layernorm.recurrent import _fused

    monkeypatch.setattr(_fused, "_blocks_by_c", lambda data, n_blocks: False)
    if limit is not None:
        monkeypatch.setattr(_fused, "TORCH_PROJECTION_NUMEL", limit)
    calls = []
    real = _fused._torch_layer_norm
    monkeypatch.setattr(_fused, "_torch_layer_norm", lambda *a: calls.append(1) or real(*a))
    model = LayerNormGRU(3, 4, dtype=DT)
    randomize(model)
    x, hx = seq(5, 4, 3), states("gru", 1, 4, 4)
    out_f, grads_f = run(model, x, hx, packed=False)
    assert len(calls) == (2 if limit is None else 0)  # the (r, z) and n blocks
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed=False)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)


@pytest.mark.parametrize("node_bytes", [0, 1 << 40], ids=["projection node", "F.linear"])
def test_raw_projection_either_way_equals_reference_loop(node_bytes, monkeypatch) -> None:
    """The GRU's raw input projection (one GEMM for a step of a batch) through the projection
    node, whose result and gradients are buffers of the cache, or through ``F.linear`` below
    ``_PROJECTION_NODE_BYTES``: the loop's values and gradients either way."""
    from layernorm.recurrent import _cstep, _fused

    monkeypatch.setattr(_fused, "_PROJECTION_NODE_BYTES", node_bytes)
    # the fused node at one step, which a training call of one step otherwise leaves to the
    # step ops (layers._LEAN_TRAINING_STEPS)
    monkeypatch.setattr(recurrent_layers, "_LEAN_TRAINING_STEPS", {})
    nodes = []
    real = _fused._Projection.apply
    monkeypatch.setattr(_fused._Projection, "apply", lambda *a: nodes.append(1) or real(*a))
    batch = _cstep.direct_rows() + 4
    model = LayerNormGRU(16, 5, dtype=DT)
    randomize(model)
    x, hx = seq(1, batch, 16), states("gru", 1, batch, 5)
    out_f, grads_f = run(model, x, hx, packed=False)
    if _cstep.sequence_gemm():
        assert len(nodes) == (1 if node_bytes == 0 else 0)
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed=False)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)


def _graph_nodes(t: torch.Tensor) -> list[str]:
    """The names of the autograd nodes ``t`` was computed through (each node once)."""
    seen, todo, names = set(), [t.grad_fn], []
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        # a C++ Function's node is a CppFunction by type: its name says which
        names.append(fn.name() if type(fn).__name__ == "CppFunction" else type(fn).__name__)
        todo.extend(f for f, _ in fn.next_functions)
    return names


@pytest.mark.parametrize("rows", ["in the loop", "before the loop"])
@pytest.mark.parametrize("bias", [True, False])
def test_norm_none_lstm_training_projects_in_its_node(bias: bool, rows: str, monkeypatch) -> None:
    """``norm="none"`` LSTM training hands the raw inputs to the sequence node (the fused one,
    or the planned C++ node where the C++ operators are built), which projects them in the C
    time loop (or, below the loop's rule, before it) and adds torch's biases: no ``F.linear``
    node, torch.nn.LSTM's outputs and gradients (with and without biases)."""
    from layernorm.recurrent import _cstep, _fused

    if not _cstep.sequence_gemm():
        pytest.skip("the C sequence kernels are not built here")
    if rows == "before the loop":
        monkeypatch.setattr(_fused, "_LOOP_PROJECTION_TRAINING_ROWS", 1 << 30)
    ref = torch.nn.LSTM(3, 5, num_layers=2, bidirectional=True, bias=bias).double()
    ours = LayerNormLSTM(3, 5, num_layers=2, bidirectional=True, bias=bias, norm="none", dtype=DT)
    ours.load_state_dict(ref.state_dict(), strict=True)
    x = seq(6, 4, 3)
    results = []
    for model in (ref, ours):
        xg = x.clone().requires_grad_()
        out, (h_n, c_n) = model(xg)
        loss = (out * torch.linspace(-1, 1, out.shape[-1], dtype=DT)).sum() + h_n.sum() + c_n.sum()
        results.append([out, h_n, c_n, *torch.autograd.grad(loss, [xg, *model.parameters()])])
        if model is ours:
            nodes = _graph_nodes(out)
            assert nodes.count("LSTMSequenceBackward") + planned_nodes(nodes) == 4, nodes
            assert not any(n.startswith(("Addmm", "Mm", "Linear")) for n in nodes), nodes
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(b, a, **TORCH_TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_backward_runs_the_kernels_forward_chose(kind: str, monkeypatch) -> None:
    """The C kernels switched off between a training forward and its backward: the backward
    still runs the kernels the forward chose (the buffers it kept are laid out for them) and
    gives the loop's gradients."""
    from layernorm.kernels.cpu import rnn
    from layernorm.recurrent import _cstep

    if not _cstep.sequence_gemm():
        pytest.skip("the sequence kernels do not run on this target")
    cls, _ = LAYERS[kind]
    model = cls(3, 4, dtype=DT)
    randomize(model)
    x, hx = seq(5, 4, 3), states(kind, 1, 4, 4)
    out_f, grads_f = run(
        model, x, hx, packed=False, before_backward=lambda: monkeypatch.setenv(rnn.ENV_SWITCH, "0")
    )
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed=False)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("frozen", ["none", "input side", "all but biases"])
def test_lstm_direction_is_one_node(bias: bool, frozen: str) -> None:
    """A training LN-LSTM direction on the C kernels is one autograd node, which projects the
    inputs and adds torch's biases to the input layer norm's bias itself (no GEMM or addition
    nodes before it), and gives the loop's values and every gradient: of the layer's input
    (the first layer's and the second's, an output of the first), of W_ih, of b_ih, b_hh and
    the layer norm's bias (one gradient, three parameters), also with some of them frozen."""
    from layernorm.recurrent import _cstep

    if not _cstep.sequence_gemm():
        pytest.skip("the sequence kernels do not run on this target")
    model = LayerNormLSTM(3, 4, num_layers=2, bidirectional=True, bias=bias, dtype=DT)
    randomize(model)
    for name, p in model.named_parameters():
        if frozen == "input side" and "_ih" in name:
            p.requires_grad_(False)
        if frozen == "all but biases" and "bias" not in name:
            p.requires_grad_(False)
    x, hx = seq(5, 4, 3), states("lstm", 4, 4, 4)
    out, _ = model(x.detach().clone().requires_grad_(), hx)
    nodes = _graph_nodes(out)
    # the fused path's node, or its planned calls' (layernorm.recurrent._planned)
    assert nodes.count("LSTMSequenceBackward") + planned_nodes(nodes) == 4
    assert not [n for n in nodes if n.startswith(("Mm", "Addmm", "Add", "T", "Projection"))]
    out_f, grads_f = run(model, x, hx, packed=False)
    model.impl = "loop"
    out_l, grads_l = run(model, x, hx, packed=False)
    for a, b in zip(out_f + grads_f, out_l + grads_l, strict=True):
        if a is None or b is None:
            assert a is None and b is None
        else:
            torch.testing.assert_close(a, b, **FUSED_TOL)


@pytest.mark.parametrize("cls", [LayerNormLSTM, LayerNormGRU, LayerNormRNN])
def test_cpu_layers_under_another_default_device(cls) -> None:
    """A layer on CPU tensors gives the same outputs and gradients under ``torch.device("meta")``
    (another default device, as model-initialization helpers set): nothing it makes for the C
    kernels (the steps' table, a packed batch's checks) takes the default device."""
    from torch.nn.utils.rnn import pack_sequence

    from layernorm.recurrent import _cstep

    torch.manual_seed(0)
    layer = cls(6, 8, device="cpu")
    xs = [torch.randn(n, 6) for n in (5, 3, 4)]
    padded = torch.stack([x[:3] for x in xs], 1)

    def run(packed) -> list[torch.Tensor]:
        layer.zero_grad()
        out = layer(packed)[0].data
        out.sum().backward()
        with torch.no_grad():
            inferred = layer(padded)[0]
        return [out.detach(), inferred, packed.data.grad, layer.weight_hh_l0.grad]

    def packed_input():  # made outside: torch's pack_sequence follows the default device
        packed = pack_sequence(xs, enforce_sorted=False)
        return packed._replace(data=packed.data.clone().requires_grad_())

    plain = run(packed_input())
    packed = packed_input()
    _cstep._steps.cache_clear()  # a cached table would hide the one made under the context
    with torch.device("meta"):
        moved = run(packed)
    for a, b in zip(plain, moved, strict=True):
        assert b.device.type == "cpu"
        torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.parametrize("norm", ["layer", "none"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("packed", "bidirectional", "dtype"),
    [(False, False, torch.float64), (True, True, torch.float64), (False, True, torch.float32)],
    ids=["padded", "packed-bidirectional", "float32"],
)
def test_training_projection_in_the_time_loop_equals_reference_loop(
    packed, bidirectional, dtype, threads, norm, monkeypatch
) -> None:
    """LN-LSTM training with the input projection inside the C time loop (forward: each step's
    gx rows into the kept raw gx, with ``norm="none"`` the biases added; backward: each step's dgx
    rows times W_ih into x's gradient): the loop's outputs and gradients, and the rule
    consulted; below its rows the projection is one GEMM in the node before the loop, as
    without the rule. Two threads with the grains at 1: a team splitting the batch's rows
    (padded) or sharing each step (packed: steps of fewer rows)."""
    from layernorm.recurrent import _cstep, _fused

    if not _cstep.sequence_gemm():
        pytest.skip("the C sequence kernels are not built here")
    if threads > 1:
        monkeypatch.setattr(_cstep, "_SEQ_GEMM_GRAIN", 1)
        monkeypatch.setattr(_cstep, "_SEQ_GRAIN", 1)
    calls: list[int] = []
    real = _fused._loop_projection_pays
    monkeypatch.setattr(_fused, "_loop_projection_pays", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_TRAINING_ROWS", 0)
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = LayerNormLSTM(7, 5, bidirectional=bidirectional, dtype=dtype, norm=norm)
        randomize(model)
        layers = 2 if bidirectional else 1
        x, hx = seq(5, 4, 7, dtype=dtype), tuple(s.to(dtype) for s in states("lstm", layers, 4, 5))
        out_f, grads_f = run(model, x, hx, packed=packed)
        assert len(calls) == layers  # one rule per direction
        monkeypatch.setattr(_fused, "_LOOP_PROJECTION_TRAINING_ROWS", 1 << 30)
        out_b, grads_b = run(model, x, hx, packed=packed)
        assert len(calls) == layers  # not consulted below its rows
        model.impl = "loop"
        out_l, grads_l = run(model, x, hx, packed=packed)
    finally:
        torch.set_num_threads(old_threads)
    tol = FUSED_TOL if dtype == torch.float64 else F32_TOL
    for a, b, c in zip(out_f + grads_f, out_b + grads_b, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, c, **tol)
        torch.testing.assert_close(a, b, **tol)
    assert all(g is not None for g in grads_f)


_NODES = ("LSTMSequenceBackward", "PlannedLSTMSequenceBackward", "GRUSequenceBackward",
          "RNNSequenceBackward")  # fmt: skip


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize(
    "options",
    [{}, {"num_layers": 2, "bidirectional": True}, {"norm": "none"}],
    ids=["one layer", "two layers, both directions", "no layer norms"],
)
def test_one_step_training_runs_the_step_ops(kind: str, options: dict) -> None:
    """A training call of up to ``layers._LEAN_TRAINING_STEPS[norm]`` steps (one with layer
    norms, two without) runs the step ops (with torch's layer-norm kernel, or none with
    ``norm="none"``; the LN-LSTM's and LN-GRU's step by the cells' node, tested below), no
    fused node, with the loop's values and gradients; from one step more, and with
    ``impl="fused"`` asked for, the fused node runs."""
    cls, _ = LAYERS[kind]
    torch.manual_seed(0)
    model = cls(16, 5, dtype=DT, **options)
    randomize(model)
    loop = copy.deepcopy(model)
    loop.impl = "loop"
    layers = model.num_layers * model.num_directions
    steps = {"layer": 1, "none": 2}[model.norm]
    assert recurrent_layers._LEAN_TRAINING_STEPS[model.norm] == steps
    x, hx = seq(steps, 3, 16), states(kind, layers, 3, 5)
    out, grads = run(model, x, hx, packed=False)
    out_l, grads_l = run(loop, x, hx, packed=False)
    for a, b in zip(out + grads, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)
    nodes = _graph_nodes(model(x.requires_grad_(), hx if kind == "lstm" else hx[0])[0])
    assert not set(nodes) & set(_NODES) and not planned_nodes(nodes)
    more_steps = _graph_nodes(model(seq(steps + 1, 3, 16).requires_grad_())[0])
    assert set(more_steps) & set(_NODES) or planned_nodes(more_steps)
    fused = copy.deepcopy(model)
    fused.impl = "fused"
    fused_nodes = _graph_nodes(fused(x)[0])
    assert set(fused_nodes) & set(_NODES) or planned_nodes(fused_nodes)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("steps", [1, 2], ids=["one step", "two steps"])
@pytest.mark.parametrize("rows", [6, 5], ids=["large step", "below the rule"])
@pytest.mark.parametrize("tile_faster", [True, False], ids=["C GEMM faster", "torch.mm faster"])
def test_large_steps_without_layer_norms_train_by_the_fused_node(
    monkeypatch: pytest.MonkeyPatch, kind: str, steps: int, rows: int, tile_faster: bool
) -> None:
    """Without layer norms, a training call of one or two steps runs the step ops only below
    ``layers._LEAN_NONE_STEP_MACS[steps]`` multiply-adds of a step (rows · G·H · (I + H)); from
    there the fused node (each direction), one step only where the C GEMM outpaces torch's;
    with the loop's values and gradients either way."""
    from layernorm.recurrent import _cstep

    cls, _ = LAYERS[kind]
    gates = {"lstm": 4, "gru": 3, "rnn": 1}[kind]
    rule = 6 * gates * 5 * (16 + 5)
    monkeypatch.setattr(recurrent_layers, "_LEAN_NONE_STEP_MACS", {1: rule, 2: rule})
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: tile_faster)
    torch.manual_seed(0)
    model = cls(16, 5, dtype=DT, norm="none", bidirectional=True)
    randomize(model)
    loop = copy.deepcopy(model)
    loop.impl = "loop"
    x, hx = seq(steps, rows, 16), states(kind, 2, rows, 5)
    out, grads = run(model, x, hx, packed=False)
    out_l, grads_l = run(loop, x, hx, packed=False)
    for a, b in zip(out + grads, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)
    nodes = set(_graph_nodes(model(x.requires_grad_(), hx if kind == "lstm" else hx[0])[0]))
    node = bool(nodes & set(_NODES)) or planned_nodes(list(nodes)) > 0
    assert node == (rows == 6 and (steps == 2 or tile_faster))


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize(
    "options",
    [{}, {"num_layers": 2, "bidirectional": True}, {"bias": False},
     {"normalize_cell_state": True}, {"norm": "none"}, {"nonlinearity": "relu"}],
    ids=["one layer", "two layers, both directions", "no biases", "normalized carry",
         "no layer norms", "relu"],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_one_step_training_of_ln_lstm_and_gru_by_the_cells_node(
    kind: str, options: dict, dtype: torch.dtype
) -> None:
    """An LN-LSTM's or LN-GRU's training call of one step runs each direction as the cells'
    node of C cell kernels (one autograd node each), an LN-RNN's as the Elman cell's C++ node of
    its ops, with the loop's outputs and gradients; not with the LSTM's normalized carry or
    without layer norms (the step ops run those)."""
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cstep

    if options.get("normalize_cell_state") and kind != "lstm":
        pytest.skip("an LSTM option")
    if options.get("nonlinearity") and kind != "rnn":
        pytest.skip("an Elman option")
    cls, _ = LAYERS[kind]
    model = cls(16, 5, dtype=dtype, **options)
    randomize(model)
    loop = copy.deepcopy(model)
    loop.impl = "loop"
    layers = model.num_layers * model.num_directions
    x, hx = seq(1, 3, 16, dtype=dtype), tuple(s.to(dtype) for s in states(kind, layers, 3, 5))
    out, grads = run(model, x, hx, packed=False)
    out_l, grads_l = run(loop, x, hx, packed=False)
    tol = FUSED_TOL if dtype == torch.float64 else F32_TOL
    for a, b in zip(out + grads, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **tol)
    nodes = _graph_nodes(model(x.requires_grad_(), hx if kind == "lstm" else hx[0])[0])
    taken = model.norm == "layer" and not options.get("normalize_cell_state")
    built = torch_ops.recurrent_nodes() if kind == "rnn" else _cstep.available(x)
    assert bool(cell_nodes(nodes)) == (taken and built)
    assert not set(nodes) & set(_NODES)


@needs_sequence_kernels
@pytest.mark.parametrize(
    "options",
    [{}, {"num_layers": 2, "bidirectional": True}, {"normalize_cell_state": True}],
    ids=["one layer", "two layers, both directions", "normalized carry"],
)
@pytest.mark.parametrize("rows", [6, 5], ids=["many rows", "below the rule"])
def test_one_step_training_of_many_rows_by_the_planned_node(
    monkeypatch: pytest.MonkeyPatch, options: dict, rows: int
) -> None:
    """An LN-LSTM's training call of one step of at least ``_cellstep.PLANNED_STEP_MIN_ROWS``
    rows and ``PLANNED_STEP_MIN_MACS`` multiply-adds, where the C GEMM outpaces torch's, runs the
    planned node of one step (as a cell's step of that size), with the loop's outputs and
    gradients; below the rule, the cells' node of C cell kernels. With the normalized carry
    (which the planned node does not take), the step's ops either way."""
    from layernorm.recurrent import _cellstep, _cstep

    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: True)
    monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_ROWS", 6)
    # (both layers of two: the second's input is both directions' outputs, 10 wide)
    monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_MACS", 6 * 4 * 5 * (10 + 5))
    model = LayerNormLSTM(16, 5, dtype=DT, **options)
    randomize(model)
    loop = copy.deepcopy(model)
    loop.impl = "loop"
    layers = model.num_layers * model.num_directions
    x, hx = seq(1, rows, 16), states("lstm", layers, rows, 5)
    out, grads = run(model, x, hx, packed=False)
    out_l, grads_l = run(loop, x, hx, packed=False)
    for a, b in zip(out + grads, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)
    nodes = set(_graph_nodes(model(x.requires_grad_(), hx)[0]))
    carry = options.get("normalize_cell_state", False)
    planned = rows == 6 and not carry and _cstep.available(x)
    assert (planned_nodes(list(nodes)) > 0) == planned
    assert not nodes & {"LSTMSequenceBackward"}
    cells_node = not planned and not carry and _cstep.available(x)
    assert bool(cell_nodes(list(nodes), "lstm")) == cells_node


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("steps", [1, 5], ids=["one step", "sequence"])
def test_a_parametrized_weight_runs_on_every_path(kind: str, steps: int) -> None:
    """Weight normalization as torch applies it (``parametrizations.weight_norm``): the weight
    is then a parametrization's output, not a registered parameter. Training (the fused path and
    the step ops) gives the reference loop's outputs and gradients (those of the
    parametrization's own parameters included), and inference, where no plan may point at a
    computed weight, the same outputs on every call."""
    from torch.nn.utils import parametrizations

    cls, _ = LAYERS[kind]
    torch.manual_seed(0)
    model = cls(16, 5, dtype=DT, num_layers=2)
    randomize(model)
    parametrizations.weight_norm(model, "weight_hh_l0")
    parametrizations.weight_norm(model, "weight_ih_l1")
    loop = copy.deepcopy(model)
    loop.impl = "loop"
    x, hx = seq(steps, 3, 16), states(kind, 2, 3, 5)
    out, grads = run(model, x, hx, packed=False)
    out_l, grads_l = run(loop, x, hx, packed=False)
    assert all(g is not None for g in grads)
    for a, b in zip(out + grads, out_l + grads_l, strict=True):
        torch.testing.assert_close(a, b, **FUSED_TOL)
    with torch.no_grad():
        for _ in range(2):
            torch.testing.assert_close(model(x, hx if kind == "lstm" else hx[0])[0], out[0],
                                       **FUSED_TOL)  # fmt: skip


ELMAN_ONE_STEP = {
    # name: (layer options, x shape, hx shape or None, x dtype, whether the cell's ops take it)
    "a token": ({}, (1, 3, 5), (1, 3, 8), torch.float32, True),
    "one row": ({}, (1, 1, 5), (1, 1, 8), torch.float32, True),
    "float64": ({"dtype": torch.float64}, (1, 3, 5), (1, 3, 8), torch.float64, True),
    "batch first": ({"batch_first": True}, (3, 1, 5), (1, 3, 8), torch.float32, True),
    "unbatched": ({}, (1, 5), (1, 8), torch.float32, True),
    "relu": ({"nonlinearity": "relu"}, (1, 3, 5), (1, 3, 8), torch.float32, True),
    "no biases": ({"bias": False}, (1, 3, 5), (1, 3, 8), torch.float32, True),
    "weight dropout at eval": ({"weight_dropout": 0.3}, (1, 3, 5), (1, 3, 8), torch.float32, True),
    "two steps": ({}, (2, 3, 5), (1, 3, 8), torch.float32, False),
    "batch first, two steps": ({"batch_first": True}, (3, 2, 5), (1, 3, 8), torch.float32, False),
    "two layers": ({"num_layers": 2}, (1, 3, 5), (2, 3, 8), torch.float32, False),
    "both directions": ({"bidirectional": True}, (1, 3, 5), (2, 3, 8), torch.float32, False),
    "no layer norm": ({"norm": "none"}, (1, 3, 5), (1, 3, 8), torch.float32, False),
    "impl loop": ({"impl": "loop"}, (1, 3, 5), (1, 3, 8), torch.float32, False),
    "zoneout": ({"zoneout_hidden": 0.2}, (1, 3, 5), (1, 3, 8), torch.float32, False),
    "no hx": ({}, (1, 3, 5), None, torch.float32, True),
    "unbatched, no hx": ({}, (1, 5), None, torch.float32, True),
    "hx of another batch": ({}, (1, 3, 5), (1, 2, 8), torch.float32, False),
    "hx of another width": ({}, (1, 3, 5), (1, 3, 7), torch.float32, False),
    "hx for two layers": ({}, (1, 3, 5), (2, 3, 8), torch.float32, False),
    "hx unbatched for batched x": ({}, (1, 3, 5), (1, 8), torch.float32, False),
    "x of another width": ({}, (1, 3, 4), (1, 3, 8), torch.float32, False),
    "x float64, layer float32": ({}, (1, 3, 5), (1, 3, 8), torch.float64, False),
    "empty batch": ({}, (1, 0, 5), (1, 0, 8), torch.float32, False),
}


@pytest.mark.parametrize("case", list(ELMAN_ONE_STEP))
def test_elman_layer_one_step_by_the_cell_s_ops(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Without gradients a one-step call of a one-layer, one-direction LN-RNN (a decoder's token)
    runs the cell's fewest ops before the layer's checks and plans: its output and ``h_n`` are
    the full path's (``h_n`` a tensor of its own, as torch's), and every call it leaves gets the
    full path's result or error, word for word."""
    options, x_shape, h_shape, x_dtype, taken = ELMAN_ONE_STEP[case]
    model = LayerNormRNN(5, 8, **options).eval()
    randomize(model)
    dtype = options.get("dtype", torch.float32)
    gen = torch.Generator().manual_seed(3)
    x = (2.0 + 3.0 * torch.randn(x_shape, generator=gen, dtype=torch.float64)).to(x_dtype)
    hx = None if h_shape is None else torch.randn(h_shape, generator=gen).to(x_dtype)
    steps: list[bool] = []
    step = LayerNormRNN._inference_step

    def spied(self: LayerNormRNN, *args: torch.Tensor):
        out = step(self, *args)
        steps.append(out is not None)
        return out

    monkeypatch.setattr(LayerNormRNN, "_inference_step", spied)
    got = outcome(lambda: model(x, hx))
    assert any(steps) == taken
    monkeypatch.setattr(LayerNormRNN, "_inference_step", lambda *args: None)
    want = outcome(lambda: model(x, hx))
    assert got[0] == want[0], (got, want)
    if got[0] != "ok":
        assert got[1] == want[1]
        return
    (out, h_n), (want_out, want_h) = got[1], want[1]  # type: ignore[misc]
    tol = FUSED_TOL if dtype == torch.float64 else F32_TOL
    torch.testing.assert_close(out, want_out, **tol)
    torch.testing.assert_close(h_n, want_h, **tol)
    before = h_n.clone()
    out.add_(1.0)  # h_n is not a view of the output
    torch.testing.assert_close(h_n, before, rtol=0, atol=0)


def test_elman_layer_one_step_records_gradients_by_the_full_path() -> None:
    """With gradients the one-step call takes the layer's own path (the cell's in-place ops
    record nothing): the gradients flow."""
    model = LayerNormRNN(5, 8)
    x = torch.randn(1, 3, 5, requires_grad=True)
    out, h_n = model(x, torch.randn(1, 3, 8))
    (out.sum() + h_n.sum()).backward()
    assert x.grad is not None and model.weight_hh_l0.grad is not None


def test_elman_layer_one_step_leaves_weight_dropout_in_training_to_the_layer() -> None:
    """In training mode with weight dropout each call draws its mask (the layer's path), so the
    cell's ops do not take the step even where nothing is recorded."""
    model = LayerNormRNN(5, 8, weight_dropout=0.5).train()
    x, hx = torch.randn(1, 3, 5), torch.randn(1, 3, 8)
    assert model._inference_step(x, hx) is None
    assert model.eval()._inference_step(x, hx) is not None


def test_elman_layer_one_step_leaves_a_large_recurrent_weight_to_the_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Past ``_ELMAN_STEP_OPS_NUMEL`` elements of W_hh the one-step call keeps the layer's
    kernel (which reads the weights as stored, faster there than torch's ops)."""
    model = LayerNormRNN(5, 8).eval()
    x, hx = torch.randn(1, 3, 5), torch.randn(1, 3, 8)
    assert model._inference_step(x, hx) is not None
    monkeypatch.setattr(recurrent_layers, "_ELMAN_STEP_OPS_NUMEL", 8 * 8 - 1)
    assert model._inference_step(x, hx) is None
