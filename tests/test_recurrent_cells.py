"""Layer-normalized recurrent cells: the paper's equations written out by hand, init, gradients.

The by-hand checks compute μ and σ with explicit sums (not the library's layer norm), so a bug in
the cell's wiring *or* in the op it uses would show.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kernel_paths import needs_sequence_kernels, outcome
from layernorm import LayerNormGRUCell, LayerNormLSTMCell, LayerNormRNNCell

DT = torch.float64
EPS = 1e-5


def ln_by_hand(a: torch.Tensor, g: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Eq. 3–4: μ = (1/H) Σ a_i, σ = sqrt((1/H) Σ (a_i − μ)² + eps), g/σ ⊙ (a − μ) + b."""
    n = a.shape[-1]
    mu = a.sum(-1, keepdim=True) / n
    sigma = (((a - mu) ** 2).sum(-1, keepdim=True) / n + EPS).sqrt()
    out = g / sigma * (a - mu)
    return out if b is None else out + b


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    """Parameters away from their init (gains ≠ 1, biases ≠ 0): nothing hides behind identities."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1.0 + 0.3 * noise if "ln_weight" in name else 0.5 * noise)


def inputs(b: int, n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return 2.0 + 1.5 * torch.randn(b, n, generator=gen, dtype=DT)


# the Elman step records its ops where a gradient may be taken, else updates its own
# pre-activation in place: both must be Eq. 4
GRAD_MODES = [pytest.param(True, id="recorded"), pytest.param(False, id="no_grad")]


@pytest.mark.parametrize("grad", GRAD_MODES)
def test_rnn_cell_is_eq4(grad: bool) -> None:
    cell = LayerNormRNNCell(5, 7, dtype=DT)
    randomize(cell)
    x, h = inputs(3, 5), inputs(3, 7, seed=2)
    a = h @ cell.weight_hh.T + x @ cell.weight_ih.T  # a_t = W_hh h_{t−1} + W_xh x_t
    b = cell.ln_bias + cell.bias_ih + cell.bias_hh
    expected = torch.tanh(ln_by_hand(a, cell.ln_weight, b))
    with torch.set_grad_enabled(grad):
        out = cell(x, h)
    assert out.requires_grad == grad
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("grad", GRAD_MODES)
def test_rnn_cell_relu(grad: bool) -> None:
    cell = LayerNormRNNCell(5, 7, nonlinearity="relu", dtype=DT)
    randomize(cell)
    x, h = inputs(3, 5), inputs(3, 7, seed=2)
    a = h @ cell.weight_hh.T + x @ cell.weight_ih.T
    b = cell.ln_bias + cell.bias_ih + cell.bias_hh
    with torch.set_grad_enabled(grad):
        out = cell(x, h)
    torch.testing.assert_close(out, torch.relu(ln_by_hand(a, cell.ln_weight, b)))


@pytest.mark.parametrize("normalize_cell_state", [False, True])
def test_lstm_cell_is_the_papers_equations(normalize_cell_state: bool) -> None:
    hs = 6
    cell = LayerNormLSTMCell(4, hs, normalize_cell_state=normalize_cell_state, dtype=DT)
    randomize(cell)
    x, h, c = inputs(3, 4), inputs(3, hs, seed=2), inputs(3, hs, seed=3)
    # (i, f, g, o) = LN(W_h h; α1, β1) + LN(W_x x; α2, β2) + b, LN over all 4H units together
    pre = (
        ln_by_hand(h @ cell.weight_hh.T, cell.ln_weight_hh, cell.ln_bias_hh)
        + ln_by_hand(x @ cell.weight_ih.T, cell.ln_weight_ih, cell.ln_bias_ih)
        + cell.bias_ih
        + cell.bias_hh
    )
    i, f, g, o = (pre[:, k * hs : (k + 1) * hs] for k in range(4))
    c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    c_ln = ln_by_hand(c_new, cell.ln_weight_c, cell.ln_bias_c)
    h_new = torch.sigmoid(o) * torch.tanh(c_ln)
    h_out, c_out = cell(x, (h, c))
    torch.testing.assert_close(h_out, h_new, rtol=1e-12, atol=1e-12)
    # the paper carries the un-normalized c_t; the TF-Addons variant carries LN(c_t)
    torch.testing.assert_close(c_out, c_ln if normalize_cell_state else c_new)
    assert not torch.allclose(c_new, c_ln)


def test_gru_cell_is_the_papers_equations() -> None:
    hs = 5
    cell = LayerNormGRUCell(4, hs, dtype=DT)
    randomize(cell)
    x, h = inputs(3, 4), inputs(3, hs, seed=2)
    wx, wh = x @ cell.weight_ih.T, h @ cell.weight_hh.T
    gi, bi, gh, bh = cell.ln_weight_ih, cell.ln_bias_ih, cell.ln_weight_hh, cell.ln_bias_hh
    two = 2 * hs
    # (r, z) = LN(W_h h) + LN(W_x x) (2H units each) + biases
    rz = torch.sigmoid(
        ln_by_hand(wh[:, :two], gh[:two], bh[:two])
        + ln_by_hand(wx[:, :two], gi[:two], bi[:two])
        + cell.bias_ih[:two]
        + cell.bias_hh[:two]
    )
    r, z = rz[:, :hs], rz[:, hs:]
    # ĥ = tanh(LN(W x) + σ(r) ⊙ LN(U h)), torch's b_in / b_hn in their usual places
    cand = torch.tanh(
        ln_by_hand(wx[:, two:], gi[two:], bi[two:])
        + cell.bias_ih[two:]
        + r * (ln_by_hand(wh[:, two:], gh[two:], bh[two:]) + cell.bias_hh[two:])
    )
    expected = (1 - z) * cand + z * h  # torch's z = the paper's 1 − z
    torch.testing.assert_close(cell(x, h), expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("gain_init", [1.0, 0.1])
def test_init_gains_and_biases(gain_init: float) -> None:
    for cell in (
        LayerNormRNNCell(3, 4, gain_init=gain_init),
        LayerNormLSTMCell(3, 4, gain_init=gain_init),
        LayerNormGRUCell(3, 4, gain_init=gain_init),
    ):
        names = dict(cell.named_parameters())
        gains = [p for n, p in names.items() if n.startswith("ln_weight")]
        biases = [p for n, p in names.items() if "bias" in n]
        assert gains and biases
        for p in gains:
            assert torch.all(p == gain_init)
        for p in biases:
            assert torch.all(p == 0)
        bound = 1 / 4**0.5
        assert cell.weight_ih.abs().max() <= bound and cell.weight_ih.std() > 0


def test_bias_false_has_no_bias_parameters() -> None:
    cell = LayerNormLSTMCell(3, 4, bias=False)
    assert all("bias" not in n for n, _ in cell.named_parameters())
    assert cell.bias_ih is None and cell.ln_bias_c is None
    h, c = cell(torch.randn(2, 3))
    assert h.shape == c.shape == (2, 4)


@pytest.mark.parametrize("cls", [LayerNormRNNCell, LayerNormLSTMCell, LayerNormGRUCell])
def test_cell_unbatched_equals_batched_row(cls: type) -> None:
    cell = cls(4, 6, dtype=DT)
    randomize(cell)
    x = inputs(3, 4)
    batched = cell(x)
    single = cell(x[1])
    if isinstance(batched, tuple):
        for a, b in zip(batched, single, strict=True):
            assert b.shape == (6,)
            torch.testing.assert_close(a[1], b)
    else:
        assert single.shape == (6,)
        torch.testing.assert_close(batched[1], single)


@pytest.mark.parametrize("cls", [LayerNormRNNCell, LayerNormLSTMCell, LayerNormGRUCell])
def test_cell_gradcheck(cls: type) -> None:
    cell = cls(3, 4, dtype=DT)
    randomize(cell)
    x = inputs(2, 3).requires_grad_()
    h = inputs(2, 4, seed=2).requires_grad_()
    params = tuple(cell.parameters())
    if cls is LayerNormLSTMCell:
        c = inputs(2, 4, seed=3).requires_grad_()

        def fn(x, h, c, *ps):
            return torch.func.functional_call(
                cell, dict(zip(dict(cell.named_parameters()), ps, strict=True)), (x, (h, c))
            )

        assert torch.autograd.gradcheck(fn, (x, h, c, *params), fast_mode=True)
    else:

        def fn(x, h, *ps):
            return torch.func.functional_call(
                cell, dict(zip(dict(cell.named_parameters()), ps, strict=True)), (x, h)
            )

        assert torch.autograd.gradcheck(fn, (x, h, *params), fast_mode=True)


def test_cell_examples_are_independent() -> None:
    cell = LayerNormLSTMCell(4, 6, dtype=DT)
    randomize(cell)
    x = inputs(5, 4)
    h, c = cell(x)
    h2, c2 = cell(x[2:3])
    torch.testing.assert_close(h[2:3], h2)
    torch.testing.assert_close(c[2:3], c2)


def test_cell_drives_over_time_like_the_layer() -> None:
    from layernorm import LayerNormLSTM

    layer = LayerNormLSTM(4, 6, dtype=DT, impl="loop")
    randomize(layer)
    cell = LayerNormLSTMCell(4, 6, dtype=DT)
    cell.load_state_dict({k.removesuffix("_l0"): v for k, v in layer.state_dict().items()})
    x = inputs(7 * 2, 4).view(7, 2, 4)
    state = None
    outs = []
    for x_t in x:
        state = cell(x_t, state)
        outs.append(state[0])
    out, (_h_n, c_n) = layer(x)
    torch.testing.assert_close(torch.stack(outs), out)
    torch.testing.assert_close(state[1], c_n[0])


def test_cell_errors() -> None:
    cell = LayerNormLSTMCell(4, 6)
    with pytest.raises(
        ValueError, match=r"expects input of shape \(batch, 4\) or \(4,\), got \(2, 5\)"
    ):
        cell(torch.randn(2, 5))
    with pytest.raises(ValueError, match="got \\(1, 2, 4\\)"):
        cell(torch.randn(1, 2, 4))
    with pytest.raises(ValueError, match=r"hx\[0\] must have shape \(2, 6\), got \(3, 6\)"):
        cell(torch.randn(2, 4), (torch.zeros(3, 6), torch.zeros(2, 6)))
    with pytest.raises(
        TypeError, match=r"hx\[1\] has dtype torch.float64 but the input has dtype torch.float32"
    ):
        cell(torch.randn(2, 4), (torch.zeros(2, 6), torch.zeros(2, 6, dtype=DT)))
    with pytest.raises(TypeError, match="tuple"):
        cell(torch.randn(2, 4), torch.zeros(2, 6))
    with pytest.raises(TypeError, match=r"weights are torch\.float32"):
        cell(torch.randn(2, 4, dtype=DT))
    with pytest.raises(ValueError, match="nonlinearity"):
        LayerNormRNNCell(3, 4, nonlinearity="sigmoid")
    with pytest.raises(ValueError, match="hidden_size must be a positive int"):
        LayerNormGRUCell(3, 0)


@pytest.mark.parametrize(
    ("ours", "theirs", "extra"),
    [
        (LayerNormLSTMCell, torch.nn.LSTMCell, {}),
        (LayerNormGRUCell, torch.nn.GRUCell, {}),
        (LayerNormRNNCell, torch.nn.RNNCell, {"nonlinearity": "relu"}),
    ],
)
@pytest.mark.parametrize("bias", [True, False])
def test_cell_from_torch_copies_weights_and_keeps_ln_init(ours, theirs, extra, bias) -> None:
    ref = theirs(3, 5, bias=bias, dtype=torch.float64, **extra)
    cell = ours.from_torch(ref, gain_init=0.5)
    assert cell.bias is bias and cell.weight_ih.dtype == torch.float64
    assert getattr(cell, "nonlinearity", "tanh") == extra.get("nonlinearity", "tanh")
    for name, p in ref.named_parameters():
        assert torch.equal(getattr(cell, name), p), name
    for name, p in cell.named_parameters():
        if name.startswith("ln_weight"):
            assert torch.all(p == 0.5), name
        elif name.startswith("ln_bias"):
            assert torch.all(p == 0.0), name


def test_cell_from_torch_of_another_kind_fails() -> None:
    with pytest.raises(
        TypeError, match=r"LayerNormLSTMCell.from_torch expects a torch.nn.LSTMCell, got GRUCell"
    ):
        LayerNormLSTMCell.from_torch(torch.nn.GRUCell(3, 5))


def test_cell_from_torch_refuses_weights_it_would_drop() -> None:
    with pytest.raises(ValueError, match=r"GRUCell.from_torch: unexpected keys \['bias_ih'"):
        LayerNormGRUCell.from_torch(torch.nn.GRUCell(3, 5), bias=False)


def _cell_step(cell: torch.nn.Module, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """One step's new hidden state (an LSTM cell's ``h'`` and ``c'`` summed into one tensor)."""
    if isinstance(cell, LayerNormLSTMCell):
        h_new, c_new = cell(x, (h, 0.5 * h))
        return h_new + c_new
    return cell(x, h)


@pytest.mark.parametrize("cls", [LayerNormRNNCell, LayerNormLSTMCell, LayerNormGRUCell])
@pytest.mark.parametrize(
    ("dtype", "grad"),
    [(torch.float32, True), (torch.float64, True), (torch.bfloat16, True),
     (torch.bfloat16, False)],  # float32 / float64 without gradients: the step plans, below
)  # fmt: skip
def test_cell_layer_norms_run_torchs_kernel_on_plain_calls(
    cls: type, dtype: torch.dtype, grad: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain CPU call's layer norms run torch's kernel (``torch_layer_norm``: a custom op's
    Python costs more than a step's arithmetic), a forced backend the fused kernels; the two
    agree, forward and gradients."""
    from layernorm.backend import force_backend
    from layernorm.recurrent import _cellstep, _steps

    monkeypatch.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 0)  # the ops (the node: below)
    fused_calls = []
    fused = _steps.layer_norm

    def counted(*args, **kwargs):
        fused_calls.append(1)
        return fused(*args, **kwargs)

    monkeypatch.setattr(_steps, "layer_norm", counted)
    cell = cls(5, 8, dtype=dtype)
    randomize(cell)
    x0, h0 = inputs(3, 5).to(dtype), inputs(3, 8, seed=2).to(dtype)

    def run() -> tuple[torch.Tensor, ...]:
        x, h = x0.clone().requires_grad_(grad), h0.clone().requires_grad_(grad)
        with torch.set_grad_enabled(grad):
            y = _cell_step(cell, x, h)
            if not grad:
                return (y,)
            dy = torch.linspace(-1.0, 1.0, y.numel(), dtype=dtype).view_as(y)
            params = [x, h, *cell.parameters()]
            return (y, *torch.autograd.grad(y, params, dy))

    lean = run()
    assert not fused_calls
    with force_backend("cpu"):
        by_fused = run()
    assert fused_calls
    for a, b in zip(lean, by_fused, strict=True):
        torch.testing.assert_close(a, b)


PLANNED_CELLS = [LayerNormLSTMCell, LayerNormGRUCell]  # the Elman cell's step is few ops


def _by_ops(cell: torch.nn.Module, x: torch.Tensor, hx):
    """The cell's step by the ops of ``_steps`` (gradients on: no step plan), detached."""
    with torch.enable_grad():
        out = cell(x, hx)
    return tuple(t.detach() for t in out) if isinstance(out, tuple) else out.detach()


def _assert_same(a, b) -> None:
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    assert len(a) == len(b)
    for s, t in zip(a, b, strict=True):
        torch.testing.assert_close(s, t)


@needs_sequence_kernels
@pytest.mark.parametrize("cls", PLANNED_CELLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("bias", [True, False])
def test_cell_inference_steps_by_a_kept_plan(
    cls: type, dtype: torch.dtype, bias: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without gradients a float32 / float64 step runs the one-step layer's kept plan: the ops'
    results, from the second call on without them; a state given or not, the plan kept across
    both."""
    from layernorm.recurrent import _steps, cells

    cell = cls(5, 8, bias=bias, dtype=dtype)
    randomize(cell)
    x, h = inputs(3, 5).to(dtype), inputs(3, 8, seed=2).to(dtype)
    hx = (h, 0.5 * h) if cls is LayerNormLSTMCell else h
    expected = {key: _by_ops(cell, x, state) for key, state in (("given", hx), ("none", None))}
    with torch.no_grad():
        _assert_same(cell(x, hx), expected["given"])
    assert cells._STEP_PLANS.get(cell) is not None

    def refused(*args, **kwargs):
        raise AssertionError("a kept step ran the ops")

    for name in ("rnn_step", "lstm_step", "gru_step"):
        monkeypatch.setattr(_steps, name, refused)
    with torch.no_grad():
        for _ in range(2):
            _assert_same(cell(x, hx), expected["given"])
            _assert_same(cell(x, None), expected["none"])
    with torch.inference_mode():
        _assert_same(cell(x, hx), expected["given"])


@pytest.mark.parametrize("cls", PLANNED_CELLS)
def test_cell_step_plan_follows_the_parameters_and_settings(cls: type) -> None:
    """A kept step reads the parameters where they are (an update in place shows in the next
    call), and a parameter replaced, a setting changed, a dtype or a batch size changed each
    give the step of the new cell."""
    cell = cls(5, 8)
    randomize(cell)
    x, h = inputs(3, 5).float(), inputs(3, 8, seed=2).float()
    hx = (h, 0.5 * h) if cls is LayerNormLSTMCell else h

    def check(x, hx):
        expected = _by_ops(cell, x, hx)
        with torch.no_grad():
            _assert_same(cell(x, hx), expected)

    check(x, hx)
    with torch.no_grad():
        cell.weight_hh.mul_(0.5)  # in place: the version counter aside, nothing the key reads
        cell.bias_hh.add_(0.25)  # folded into the input side's bias on every call
    check(x, hx)
    cell.bias_ih = torch.nn.Parameter(cell.bias_ih.detach() + 1.0)
    check(x, hx)
    cell.eps = 1e-2
    check(x, hx)
    if cls is LayerNormLSTMCell:
        cell.normalize_cell_state = True
        check(x, hx)
    check(x[:2], tuple(t[:2] for t in hx) if isinstance(hx, tuple) else hx[:2])
    cell.double()
    check(x.double(), tuple(t.double() for t in hx) if isinstance(hx, tuple) else hx.double())


def test_cell_step_plan_keeps_the_checks() -> None:
    """A call that is not the kept signature's is checked as any step is."""
    cell = LayerNormLSTMCell(4, 6)
    x = torch.randn(2, 4)
    with torch.no_grad():
        cell(x, (torch.zeros(2, 6), torch.zeros(2, 6)))
        with pytest.raises(ValueError, match=r"hx\[0\] must have shape \(2, 6\), got \(3, 6\)"):
            cell(x, (torch.zeros(3, 6), torch.zeros(2, 6)))
        with pytest.raises(ValueError, match=r"expects input of shape \(batch, 4\)"):
            cell(torch.randn(2, 5), (torch.zeros(2, 6), torch.zeros(2, 6)))
        with pytest.raises(TypeError, match="hx must be a tuple"):
            cell(x, torch.zeros(2, 6))


def test_cell_steps_keep_no_plan_in_a_copy() -> None:
    """The kept step lives beside the cell: a deep copy and a pickle of a cell that ran one
    carry none, and the copy computes the same steps."""
    import copy
    import pickle

    cell = LayerNormGRUCell(5, 8)
    x = torch.randn(3, 5)
    with torch.no_grad():
        y = cell(x)
        twin = copy.deepcopy(cell)
        again = pickle.loads(pickle.dumps(cell))
        _assert_same(twin(x), y)
        _assert_same(again(x), y)


def test_elman_cell_steps_by_its_ops_without_gradients(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Elman cell keeps no step plan (its step is fewer ops than a plan's call costs)."""
    from layernorm.recurrent import cells

    cell = LayerNormRNNCell(5, 8)
    with torch.no_grad():
        cell(torch.randn(3, 5))
    assert cells._STEP_PLANS.get(cell) is None


@pytest.mark.parametrize(
    "case",
    ["float32", "float64", "relu", "no biases", "unbatched", "bfloat16", "gradients",
     "zoneout", "autocast", "forced backend"],
)  # fmt: skip
def test_elman_cell_inference_step_where_nothing_is_recorded(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Without gradients a float32 / float64 Elman step runs its fewest ops (the two products
    by one ``addmm_``, torch's layer norm, the biases and nonlinearity in place) with the
    step's ops' values; with gradients, zoneout, autocast, a half dtype or a forced backend the
    step's ops (``_steps.rnn_step``) run it (with gradients, the C++ operators off: on, their
    node runs the step, :func:`test_elman_node_is_taken_where_the_rule_says`)."""
    from layernorm.backend import force_backend
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _steps

    dtype = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(case, torch.float32)
    options = {"nonlinearity": "relu"} if case == "relu" else {}
    if case == "no biases":
        options["bias"] = False
    if case == "zoneout":
        options["zoneout_hidden"] = 0.3
    cell = LayerNormRNNCell(5, 8, dtype=dtype, **options).eval()
    randomize(cell)
    x, h = inputs(3, 5).to(dtype), inputs(3, 8, seed=2).to(dtype)
    if case == "unbatched":
        x, h = x[0], h[0]
    ops = []
    monkeypatch.setattr(_steps, "rnn_step", _counted(_steps.rnn_step, ops))

    def context() -> contextlib.AbstractContextManager:
        if case == "autocast":
            return torch.autocast("cpu", dtype=torch.bfloat16)
        if case == "gradients":
            return torch_ops.switched(False)
        return force_backend("cpu") if case == "forced backend" else contextlib.nullcontext()

    with torch.set_grad_enabled(case == "gradients"), context():
        got = cell(x, h)
    lean = case in ("float32", "float64", "relu", "no biases", "unbatched")
    assert bool(ops) != lean
    monkeypatch.setattr(cell, "_inference_step", lambda x, h: None)  # the step's ops
    with torch.set_grad_enabled(case == "gradients"), context():
        want = cell(x, h)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {}
    torch.testing.assert_close(got, want, **tol)
    assert got.shape == h.shape


ELMAN_CALLS = {
    # name: (x shape, x dtype, hx shape or None, hx dtype, whether the step runs before the checks)
    "batched": ((3, 5), torch.float32, (3, 8), torch.float32, True),
    "float64 cell and input": ((3, 5), torch.float64, (3, 8), torch.float64, True),
    "one row": ((1, 5), torch.float32, (1, 8), torch.float32, True),
    "unbatched": ((5,), torch.float32, (8,), torch.float32, False),
    "no hx": ((3, 5), torch.float32, None, torch.float32, True),
    "unbatched, no hx": ((5,), torch.float32, None, torch.float32, False),
    "hx of another batch": ((3, 5), torch.float32, (2, 8), torch.float32, False),
    "hx of another width": ((3, 5), torch.float32, (3, 7), torch.float32, False),
    "x of another width": ((3, 4), torch.float32, (3, 8), torch.float32, False),
    "x of three dims": ((1, 3, 5), torch.float32, (3, 8), torch.float32, False),
    "x float64, cell float32": ((3, 5), torch.float64, (3, 8), torch.float64, False),
    "hx of another dtype": ((3, 5), torch.float32, (3, 8), torch.float64, False),
    "empty batch": ((0, 5), torch.float32, (0, 8), torch.float32, False),
    "integer x": ((3, 5), torch.int64, (3, 8), torch.float32, False),
}


@pytest.mark.parametrize("case", list(ELMAN_CALLS))
def test_elman_cell_inference_step_before_the_checks_lets_nothing_through(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """Without gradients the Elman cell tries its fewest-ops step before its own checks (a few
    attribute reads of its own): a call it takes gives the full path's values, and every call
    it leaves (a wrong shape, dtype or batch, an unbatched input) gets the full path's result or
    error, word for word."""
    from layernorm.recurrent import cells

    x_shape, x_dtype, h_shape, h_dtype, lean = ELMAN_CALLS[case]
    cell_dtype = torch.float64 if case == "float64 cell and input" else torch.float32
    cell = LayerNormRNNCell(5, 8, dtype=cell_dtype)
    randomize(cell)
    x = (10 * torch.randn(x_shape, generator=torch.Generator().manual_seed(1))).to(x_dtype)
    hx = None if h_shape is None else torch.randn(h_shape, dtype=h_dtype)
    calls: list[tuple[int, ...]] = []
    step = cells.LayerNormRNNCell._inference_step

    def spied(self: LayerNormRNNCell, x_: torch.Tensor, h_: torch.Tensor) -> torch.Tensor | None:
        out = step(self, x_, h_)
        if out is not None:
            calls.append(tuple(x_.shape))
        return out

    monkeypatch.setattr(cells.LayerNormRNNCell, "_inference_step", spied)
    got = outcome(lambda: cell(x, hx))
    taken_first = calls == [tuple(x.shape)] and x.dim() == 2
    assert taken_first == lean
    monkeypatch.setattr(cells.LayerNormRNNCell, "_inference_step", lambda *args: None)
    want = outcome(lambda: cell(x, hx))  # the checks, then the step's ops
    assert got[0] == want[0], (got, want)
    if got[0] == "ok":
        tol = {"rtol": 1e-12, "atol": 1e-12} if cell_dtype == torch.float64 else {}
        torch.testing.assert_close(got[1], want[1], **tol)
    else:
        assert got[1] == want[1]


def test_elman_cell_inference_step_reads_parametrized_biases() -> None:
    """The fewest-ops step reads each weight and bias as the module holds it: a parametrized
    bias (moved out of ``_parameters``) is still added."""
    cell = LayerNormRNNCell(5, 8)
    randomize(cell)
    x, h = inputs(3, 5).float(), inputs(3, 8, seed=2).float()
    with torch.no_grad():
        plain = cell(x, h)
    torch.nn.utils.parametrize.register_parametrization(cell, "bias_hh", _Doubled())
    with torch.no_grad():
        doubled = cell(x, h)
        want = torch.tanh(
            torch.nn.functional.layer_norm(
                x @ cell.weight_ih.t() + h @ cell.weight_hh.t(), (8,), cell.ln_weight,
                cell.ln_bias, cell.eps,
            ) + cell.bias_ih + cell.bias_hh
        )  # fmt: skip
    torch.testing.assert_close(doubled, want)
    assert not torch.allclose(doubled, plain)


class _Doubled(torch.nn.Module):
    def forward(self, t: torch.Tensor) -> torch.Tensor:
        return 2 * t


@needs_sequence_kernels
@pytest.mark.parametrize(
    ("inputs_", "hidden", "threads", "one_step_gemm", "in_loop"),
    [(16, 32, 1, "packed", True), (128, 256, 1, "packed", False), (128, 256, 2, "packed", True),
     (128, 256, 1, "mkl", True)],
)  # fmt: skip
def test_lstm_cell_step_of_a_batch_keeps_its_plan_either_way(
    inputs_: int, hidden: int, threads: int, one_step_gemm: str, in_loop: bool
) -> None:
    """One LSTM step of more rows than the direct GEMM's projects its inputs in the kernel's loop
    with a small W_ih or several threads, by torch's GEMM before it from 2^17 elements on one
    thread (``_fused``'s ``_ONE_STEP_LOOP_PROJECTION_WEIGHT``), where the step packs its weights;
    in the loop where MKL's sgemm reads them as stored (``rnn.use_one_step_gemm``). A plan is
    kept either way, with the ops' results."""
    from layernorm.kernels.cpu import rnn
    from layernorm.recurrent import cells

    if one_step_gemm == "mkl" and rnn.torch_sgemm() is None:
        pytest.skip("this PyTorch exports no MKL sgemm")
    cell = LayerNormLSTMCell(inputs_, hidden)
    randomize(cell)
    x, h = inputs(12, inputs_).float(), inputs(12, hidden, seed=2).float()
    hx = (h, 0.5 * h)
    expected = _by_ops(cell, x, hx)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    rnn.use_one_step_gemm(one_step_gemm)
    try:
        with torch.no_grad():
            _assert_same(cell(x, hx), expected)
            _assert_same(cell(x, hx), expected)
    finally:
        torch.set_num_threads(before)
        rnn.use_one_step_gemm(None)
    kept = cells._STEP_PLANS.get(cell)
    assert kept is not None and kept.plan.in_loop is in_loop


@pytest.mark.parametrize("cls", [LayerNormRNNCell, LayerNormLSTMCell, LayerNormGRUCell])
def test_a_parametrized_or_replaced_weight_steps_by_the_ops(cls: type) -> None:
    """A weight that is not a registered parameter (``parametrizations.weight_norm``'s output,
    or a plain tensor put in its place) cannot back a kept step plan (its structs point at
    registered parameters): without gradients the cell then steps by its ops, with the results
    of a step with gradients."""
    from torch.nn.utils import parametrizations

    from layernorm.recurrent import cells

    for replace in ("weight_norm", "plain tensor"):
        cell = cls(5, 8, dtype=DT)
        randomize(cell)
        if replace == "weight_norm":
            parametrizations.weight_norm(cell, "weight_hh")
        else:
            w = cell.weight_hh.detach().clone()
            del cell.weight_hh
            cell.weight_hh = w
        x, h = inputs(3, 5), inputs(3, 8, seed=2)
        hx = (h, 0.5 * h) if cls is LayerNormLSTMCell else h
        expected = _by_ops(cell, x, hx)
        with torch.no_grad():
            for _ in range(2):
                _assert_same(cell(x, hx), expected)
        assert cells._STEP_PLANS.get(cell) is None


@pytest.mark.parametrize("cls", [LayerNormRNNCell, LayerNormLSTMCell, LayerNormGRUCell])
@pytest.mark.parametrize("name", ["weight_ih", "weight_hh"])
def test_a_missing_weight_is_named(cls: type, name: str) -> None:
    cell = cls(5, 7)
    delattr(cell, name)
    with pytest.raises(AttributeError, match=f"{cls.__name__}: it has no {name}"):
        cell(torch.randn(2, 5))
    with torch.no_grad(), pytest.raises(AttributeError, match=f"it has no {name}"):
        cell(torch.randn(2, 5))


def _lstm_cell_node(monkeypatch: pytest.MonkeyPatch, taken: list[bool]) -> None:
    """Every LSTM cell training step of at least two rows by the planned node (the rule's limits
    at their least, the processor's GEMM taken as outpacing torch's), each step it ran counted."""
    from layernorm.recurrent import _cellstep, _cstep, _planned

    monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_ROWS", 2)
    monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_MACS", 0)
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: True)
    node = _planned.lstm_training

    def counted(*args, **kwargs):
        result = node(*args, **kwargs)
        if result is not None:  # (the one-step layer of an inference plan asks it too)
            taken.append(True)
        return result

    monkeypatch.setattr(_planned, "lstm_training", counted)


def _steps_and_grads(cell: torch.nn.Module, xs: torch.Tensor, hx: object) -> list[torch.Tensor]:
    """Outputs of three steps from ``hx`` and the gradients of a loss on all of them (the input,
    the initial state and every parameter)."""
    xs = xs.detach().requires_grad_(True)
    leaves = [xs] + ([] if hx is None else [t.detach().requires_grad_(True) for t in hx])
    state = None if hx is None else tuple(leaves[1:])
    outs, loss = [], xs.new_zeros(())
    for x in xs:
        state = cell(x, state)
        outs += list(state)
        loss = loss + (state[0] * torch.linspace(-1, 1, state[0].shape[1], dtype=x.dtype)).sum()
        loss = loss + 0.5 * state[1].square().sum()
    params = [p for p in cell.parameters()]
    grads = torch.autograd.grad(loss, leaves + params)
    return [o.detach() for o in outs] + list(grads)


@needs_sequence_kernels
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("given_state", [True, False], ids=["hx", "no hx"])
@pytest.mark.parametrize("threads", [1, 2])
def test_lstm_cell_training_by_the_node_equals_its_ops(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, bias: bool, given_state: bool,
    threads: int,
) -> None:  # fmt: skip
    """Training steps of many rows by the planned node of one step give the step's ops' outputs
    and gradients (input, state, every parameter), three steps in a row, the graph of all
    alive together."""
    from layernorm.recurrent import _cellstep, _cstep

    cell = LayerNormLSTMCell(6, 8, bias=bias, dtype=dtype)
    randomize(cell)
    xs = inputs(3 * 5, 6).view(3, 5, 6).to(dtype)
    hx = None
    if given_state:
        hx = (inputs(5, 8, seed=2).to(dtype), inputs(5, 8, seed=3).to(dtype))
    monkeypatch.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 0)  # the ops (not the cell kernels)
    expected = _steps_and_grads(cell, xs, hx)
    monkeypatch.undo()
    taken: list[bool] = []
    _lstm_cell_node(monkeypatch, taken)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = _steps_and_grads(cell, xs, hx)
    finally:
        torch.set_num_threads(before)
    assert taken == [True] * 3 if _cstep.available(xs) else not taken
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype is torch.float64 else {"rtol": 2e-4, "atol": 2e-4}
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **tol)


@needs_sequence_kernels
@pytest.mark.parametrize(
    "case", ["zoneout", "normalized carry", "unbatched", "no grad", "parametrized", "few rows",
             "small step", "slower GEMM", "float16", "traced", "replaced weight",
             "replaced gain"],
)  # fmt: skip
def test_lstm_cell_training_node_is_taken_where_the_rule_says(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The node runs a training step of at least ``_cellstep.PLANNED_STEP_MIN_ROWS`` rows and
    ``PLANNED_STEP_MIN_MACS`` multiply-adds where the C GEMM outpaces torch's, and not with
    zoneout, a normalized carry, an unbatched input, gradients off, a parametrized weight or a plain
    tensor in a parameter's place, a dtype without C kernels or under a tracer: the step's ops
    (or the inference plan) run those."""
    from layernorm.recurrent import _cellstep, _cstep

    taken: list[bool] = []
    _lstm_cell_node(monkeypatch, taken)
    monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_ROWS", 4)
    monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_MACS", 4 * 4 * 8 * (6 + 8))
    options = {"zoneout_cell": 0.2} if case == "zoneout" else {}
    if case == "normalized carry":
        options["normalize_cell_state"] = True
    cell = LayerNormLSTMCell(6, 8, **options)
    if case == "parametrized":
        torch.nn.utils.parametrizations.weight_norm(cell, "weight_hh")
    if case.startswith("replaced"):  # a plain tensor in a parameter's place
        name = "weight_hh" if case == "replaced weight" else "ln_weight_c"
        t = getattr(cell, name).detach().clone()
        delattr(cell, name)
        setattr(cell, name, t)
    rows = {"few rows": 3, "small step": 4}.get(case, 5)
    if case == "small step":
        monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_MACS", rows * 4 * 8 * (6 + 8) + 1)
    if case == "slower GEMM":
        monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: False)
    dtype = torch.float16 if case == "float16" else torch.float32
    cell = cell.to(dtype)
    x = torch.randn(rows, 6, dtype=dtype)
    if case == "unbatched":
        x = x[0]
    with torch.set_grad_enabled(case != "no grad"):
        if case == "traced":  # a tracer's sizes are tensors: the rule is not even asked
            torch.jit.trace(cell, (x,), check_trace=False)
        else:
            cell(x)
    assert taken == []
    # and the same cell's step of the rule's kind does take it (the setup is not what stops it)
    if case in ("few rows", "small step", "slower GEMM", "unbatched", "no grad") and (
        _cstep.available(x)
    ):
        monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: True)
        monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_MACS", 0)
        cell(torch.randn(5, 6))
        assert taken == [True]


# training steps by the C cell kernels (the Elman cell's step is few ops: it keeps them)
KERNEL_CELLS = {"lstm": (LayerNormLSTMCell, {}), "gru": (LayerNormGRUCell, {})}


def _kernel_cell(kind: str, *args, **kwargs) -> torch.nn.Module:
    cls, options = KERNEL_CELLS[kind]
    return cls(*args, **options, **kwargs)


def _cell_kernels(
    monkeypatch: pytest.MonkeyPatch, taken: list[bool], routes: list[str] | None = None
) -> None:
    """Each cell training step by the C cell kernels' node counted (and the LSTM's planned node
    of many rows kept out of it); with ``routes``, which node ran each: ``"C++"`` (the
    operators of ``csrc_torch/rnn_ops.cpp``) or ``"Python"`` (the autograd.Functions)."""
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cellstep

    monkeypatch.setattr(_cellstep, "PLANNED_STEP_MIN_ROWS", 1 << 30)
    for name in ("lstm_node", "gru_node"):
        monkeypatch.setattr(_cellstep, name, _counted(getattr(_cellstep, name), taken, True))
    if routes is not None:
        for node in (_cellstep.GRUCellStep, _cellstep.LSTMCellStep):
            monkeypatch.setattr(node, "apply", _counted(node.apply, routes, "Python"))
        for name in ("lstm_cell_step", "gru_cell_step"):
            monkeypatch.setattr(torch_ops, name, _counted(getattr(torch_ops, name), routes, "C++"))


def _counted(fn, record: list, value: object = True):
    def counted(*args):
        record.append(value)
        return fn(*args)

    return counted


#: The two nodes of a cell's training step: the C++ operator (where the operators load) and
#: the autograd.Function, chosen by the operators' switch.
NODE_ROUTES = pytest.mark.parametrize("by_operator", [True, False], ids=["C++ node", "Python node"])


def _route(by_operator: bool) -> str:
    from layernorm.kernels.cpu import torch_ops

    return "C++" if by_operator and torch_ops.recurrent_nodes() else "Python"


def _kernel_steps_and_grads(
    cell: torch.nn.Module, xs: torch.Tensor, hx: tuple[torch.Tensor, ...] | None,
    create_graph: bool = False,
) -> list[torch.Tensor]:  # fmt: skip
    """Outputs of steps from ``hx`` (``(h,)`` or ``(h, c)``) and the gradients of a loss on all
    of them (the input, the initial state and every parameter); with ``create_graph`` also the
    gradient of the first gradients' weighted sum (second derivatives)."""
    xs = xs.detach().requires_grad_(True)
    leaves = [xs] + ([] if hx is None else [t.detach().requires_grad_(True) for t in hx])
    state = None if hx is None else (leaves[1] if len(hx) == 1 else tuple(leaves[1:]))
    outs, loss = [], xs.new_zeros(())
    for x in xs:
        state = cell(x, state)
        for t in state if isinstance(state, tuple) else (state,):
            outs.append(t)
            weights = torch.linspace(-1, 1, t.shape[-1], dtype=x.dtype)
            loss = loss + (t * weights).sum() + 0.5 * t.square().sum()
    wrt = leaves + [p for p in cell.parameters()]
    grads = torch.autograd.grad(loss, wrt, create_graph=create_graph)
    if create_graph:
        second = sum((g * torch.cos(torch.arange(g.numel(), dtype=g.dtype)).view_as(g)).sum()
                     for g in grads)  # fmt: skip
        grads = grads + torch.autograd.grad(second, wrt, allow_unused=True, materialize_grads=True)
    return [o.detach() for o in outs] + [g.detach() for g in grads]


def _cell_tolerance(dtype: torch.dtype) -> dict[str, float]:
    tight = dtype is torch.float64
    return {"rtol": 1e-10, "atol": 1e-10} if tight else {"rtol": 2e-4, "atol": 2e-4}


def _initial_state(cls: type, rows: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    shape = (rows, 8) if rows else (8,)
    h = inputs(max(rows, 1), 8, seed=2).view(shape).to(dtype)
    if cls is LayerNormLSTMCell:
        return h, inputs(max(rows, 1), 8, seed=3).view(shape).to(dtype)
    return (h,)


@NODE_ROUTES
@pytest.mark.parametrize("kind", KERNEL_CELLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("given_state", [True, False], ids=["hx", "no hx"])
@pytest.mark.parametrize("rows", [1, 5, 0], ids=["one row", "five rows", "unbatched"])
def test_cell_training_by_the_kernels_equals_its_ops(
    monkeypatch: pytest.MonkeyPatch, kind: str, dtype: torch.dtype, bias: bool,
    given_state: bool, rows: int, by_operator: bool,
) -> None:  # fmt: skip
    """Training steps by the C cell kernels' node (the C++ operator and the autograd.Function)
    give the step's ops' outputs and gradients (input, state, every parameter), three steps in
    a row, the graph of all alive together."""
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cellstep, _cstep

    cell = _kernel_cell(kind, 6, 8, bias=bias, dtype=dtype)
    cls = type(cell)
    randomize(cell)
    shape = (3, rows, 6) if rows else (3, 6)
    xs = inputs(3 * max(rows, 1), 6).view(shape).to(dtype)
    hx = _initial_state(cls, rows, dtype) if given_state else None
    monkeypatch.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 0)  # the ops
    expected = _kernel_steps_and_grads(cell, xs, hx)
    monkeypatch.undo()
    taken: list[bool] = []
    routes: list[str] = []
    _cell_kernels(monkeypatch, taken, routes)
    with torch_ops.switched(by_operator):
        got = _kernel_steps_and_grads(cell, xs, hx)
        assert taken == [True] * 3 if _cstep.available(xs) else not taken
        assert routes == [_route(by_operator)] * len(taken)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **_cell_tolerance(dtype))


@NODE_ROUTES
@pytest.mark.parametrize("kind", KERNEL_CELLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cell_kernels_keep_second_derivatives(
    monkeypatch: pytest.MonkeyPatch, kind: str, dtype: torch.dtype, by_operator: bool
) -> None:
    """With ``create_graph=True`` the node's backward (either node) differentiates the step's
    ops: the gradients of the gradients are the ops' own, over two steps (the second step's
    weights also made its state)."""
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cellstep, _cstep

    cell = _kernel_cell(kind, 5, 8, dtype=dtype)
    randomize(cell)
    xs, hx = inputs(2 * 3, 5).view(2, 3, 5).to(dtype), _initial_state(type(cell), 3, dtype)
    monkeypatch.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 0)
    expected = _kernel_steps_and_grads(cell, xs, hx, create_graph=True)
    monkeypatch.undo()
    taken: list[bool] = []
    routes: list[str] = []
    _cell_kernels(monkeypatch, taken, routes)
    with torch_ops.switched(by_operator):
        got = _kernel_steps_and_grads(cell, xs, hx, create_graph=True)
        assert taken == [True] * 2 if _cstep.available(xs) else not taken
        assert routes == [_route(by_operator)] * len(taken)
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **_cell_tolerance(dtype))


@pytest.mark.parametrize("kind", KERNEL_CELLS)
@pytest.mark.parametrize(
    "case", ["zoneout", "normalized carry", "no grad", "parametrized", "replaced weight",
             "replaced gain", "large half weights", "float64 weights", "traced", "autocast",
             "forced backend", "large step"],
)  # fmt: skip
def test_cell_kernels_are_taken_where_the_rule_says(
    monkeypatch: pytest.MonkeyPatch, kind: str, case: str
) -> None:
    """The node runs a cell's training step of up to ``KERNEL_STEP_MAX_NUMEL`` elements of a
    projection, and not with zoneout, the LSTM's normalized carry, gradients off, a
    parametrized weight or a plain tensor in a parameter's place, half weights of
    ``HALF_MAX_WEIGHTS`` elements or more, weights of another dtype than the input's, under a
    tracer, autocast or a forced backend: the step's ops (or the inference plan) run those."""
    from layernorm.recurrent import _cellstep, _cstep

    if case == "normalized carry" and kind != "lstm":
        pytest.skip("an LSTM option")
    taken: list[bool] = []
    _cell_kernels(monkeypatch, taken)
    options: dict[str, object] = {"zoneout_hidden": 0.2} if case == "zoneout" else {}
    if case == "normalized carry":
        options["normalize_cell_state"] = True
    cell = _kernel_cell(kind, 6, 8, **options)
    if case == "parametrized":
        torch.nn.utils.parametrizations.weight_norm(cell, "weight_hh")
    if case.startswith("replaced"):  # a plain tensor in a parameter's place
        gains = {"lstm": "ln_weight_c", "gru": "ln_weight_hh"}
        name = "weight_hh" if case == "replaced weight" else gains[kind]
        t = getattr(cell, name).detach().clone()
        delattr(cell, name)
        setattr(cell, name, t)
    if case == "large step":
        monkeypatch.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 4 * cell.gate_count * 8)
    dtype = torch.float32
    if case == "large half weights":
        dtype = torch.float16
        weights = cell.gate_count * 8 * (6 + 8)
        monkeypatch.setattr(_cellstep, "HALF_MAX_WEIGHTS", weights)
    cell = cell.to(torch.float64 if case == "float64 weights" else dtype)
    x = torch.randn(5, 6, dtype=dtype)
    with torch.set_grad_enabled(case != "no grad"):
        if case == "traced":
            torch.jit.trace(cell, (x,), check_trace=False)
        elif case == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                cell(x)
        elif case == "forced backend":  # the ops' layer norms honour it
            from layernorm.backend import force_backend

            with force_backend("cpu"):
                cell(x)
        elif case == "float64 weights":  # the ops name the mismatch
            with pytest.raises((TypeError, ValueError), match="float64"):
                cell(x)
        else:
            cell(x)
    assert taken == []
    # and the same cell's step of the rule's kind does take it (the setup is not what stops it)
    if case in ("large step", "no grad", "large half weights") and _cstep.available(x.float()):
        if case == "large half weights":
            monkeypatch.setattr(_cellstep, "HALF_MAX_WEIGHTS", weights + 1)
        cell(torch.randn(4, 6, dtype=dtype))
        assert taken == [True]


@pytest.mark.parametrize("kind", KERNEL_CELLS)
def test_cell_kernels_refuse_buffers_of_the_wrong_shape(kind: str) -> None:
    """The node's structs are checked before C sees a pointer: a gain of the wrong size is
    named, with its shape rule."""
    from layernorm.recurrent import _cellstep, _cstep

    cell = _kernel_cell(kind, 6, 8)
    x = torch.randn(5, 6)
    if not _cstep.available(x):
        pytest.skip("C kernels not built")
    node, names, units = {
        "lstm": (_cellstep.LSTMCellStep, _cellstep.LSTM_PARAMS, 4),
        "gru": (_cellstep.GRUCellStep, _cellstep.GRU_PARAMS, 3),
    }[kind]
    params = [getattr(cell, n) for n in names]
    gain = names.index("ln_weight_ih")
    params[gain] = params[gain][1:]
    state = (torch.zeros(5, 8),) * (2 if kind == "lstm" else 1)
    message = rf"cell_fwd_args\): w_ih must have shape \({units}H\) = \({units * 8},\)"
    with pytest.raises(ValueError, match=message):
        node.apply(x, *state, *params, cell.eps)


@pytest.mark.parametrize("kind", KERNEL_CELLS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("bias", [True, False])
def test_cell_operator_gives_the_functions_bits(kind: str, dtype: torch.dtype, bias: bool) -> None:
    """The C++ node runs the autograd.Function's products, buffers and kernels in its order:
    outputs and every gradient bit for bit, a state that is a strided view included."""
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cstep

    x = inputs(5, 6).to(dtype)
    if not (_cstep.available(x) and torch_ops.recurrent_nodes()):
        pytest.skip("C kernels or C++ operators not built")
    cell = _kernel_cell(kind, 6, 8, bias=bias, dtype=dtype)
    randomize(cell)
    states = [inputs(8, 5, seed=s).to(dtype).t() for s in (2, 3)][: 2 if kind == "lstm" else 1]

    def run(by_operator: bool) -> list[torch.Tensor]:
        leaves = [t.detach().requires_grad_() for t in (x, *states)]
        with torch_ops.switched(by_operator):
            out = cell(leaves[0], tuple(leaves[1:]) if kind == "lstm" else leaves[1])
        outs = out if isinstance(out, tuple) else (out,)
        node = outs[0].grad_fn.name()
        assert ("CellFn" in node) == by_operator, node
        douts = [torch.linspace(-1, 2, o.numel(), dtype=dtype).view_as(o) for o in outs]
        grads = torch.autograd.grad(outs, [*leaves, *cell.parameters()], douts)
        return [*outs, *grads]

    for a, b in zip(run(True), run(False), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", KERNEL_CELLS)
@pytest.mark.parametrize("case", ["gain", "rows", "dtype", "plan"])
def test_cell_operator_refuses_tensors_not_of_its_plan(kind: str, case: str) -> None:
    """The C++ node checks every tensor against its plan's signature before C sees a pointer:
    a gain of the wrong size, an input of other rows, a state of another dtype are named with
    the shape and dtype expected and given; the other cell's plan is refused."""
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cellstep, _cstep

    x = torch.randn(5, 6)
    if not (_cstep.available(x) and torch_ops.recurrent_nodes()):
        pytest.skip("C kernels or C++ operators not built")
    lstm = kind == "lstm"
    cell = _kernel_cell(kind, 6, 8)
    params = [getattr(cell, n) for n in (_cellstep.LSTM_PARAMS if lstm else _cellstep.GRU_PARAMS)]
    state = [torch.zeros(5, 8) for _ in range(2 if lstm else 1)]
    plan = _cellstep.cell_plan(kind, x, 8, cell.eps)
    op = torch_ops.lstm_cell_step if lstm else torch_ops.gru_cell_step
    gates = 4 if lstm else 3
    if case == "gain":
        params[4] = params[4][1:]
        message = rf"expected lw_ih to be a Float CPU tensor of shape \[{gates * 8}\], got Float "
        message += rf"tensor of shape \[{gates * 8 - 1}\]"
    elif case == "rows":
        x = x[1:]
        message = r"expected x to be a Float CPU tensor of shape \[5, 6\], got Float tensor of "
        message += r"shape \[4, 6\]"
    elif case == "dtype":
        state[0] = state[0].double()
        message = r"expected h to be a Float CPU tensor of shape \[5, 8\], got Double tensor"
    else:
        plan = _cellstep.cell_plan("gru" if lstm else "lstm", x, 8, cell.eps)
        message = "needs an LSTM plan" if lstm else "needs a GRU plan"
    with pytest.raises(RuntimeError, match=message):
        op(x, *state, *params, plan)


@pytest.mark.parametrize("kind", KERNEL_CELLS)
def test_cell_kernels_keep_a_nan_in_its_row_and_hold_large_offsets(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """Hostile inputs to the node: a NaN in one example's input makes that example's outputs and
    input gradient NaN and no other's (the parameters' gradients, sums over the examples, too);
    inputs around 1e4, -3e3, 500 and 2e4 with a spread of 1.5 (the projections' rows far from
    zero mean) give the float64 ops' outputs and gradients to float32's tolerance."""
    from layernorm.recurrent import _cellstep, _cstep

    taken: list[bool] = []
    _cell_kernels(monkeypatch, taken)
    cell = _kernel_cell(kind, 6, 8)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))
    if not _cstep.available(x):
        pytest.skip("C kernels not built")
    x[1, 2] = float("nan")
    x.requires_grad_()
    out = cell(x)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.sum() for o in outs).backward()
    assert taken == [True]
    for t in (*outs, x.grad):
        assert torch.isnan(t).any(1).tolist() == [False, True, False]
    assert all(torch.isnan(p.grad).any() for p in cell.parameters())

    wide = _kernel_cell(kind, 6, 8, dtype=torch.float64)
    randomize(wide)
    narrow = _kernel_cell(kind, 6, 8)
    narrow.load_state_dict({k: v.float() for k, v in wide.state_dict().items()})
    xb = torch.tensor([1e4, -3e3, 5e2, 2e4], dtype=torch.float64)[:, None] + inputs(4, 6)
    with monkeypatch.context() as ops:
        ops.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 0)
        want = _kernel_steps_and_grads(wide, xb[None], None)
    got = _kernel_steps_and_grads(narrow, xb[None].float(), None)
    assert len(taken) == 2  # the float32 step by the node; the float64 one by the ops
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g.double(), w, rtol=2e-4, atol=2e-4)


@NODE_ROUTES
@pytest.mark.parametrize("kind", KERNEL_CELLS)
def test_cell_kernels_batched_backward_is_the_ops(
    monkeypatch: pytest.MonkeyPatch, kind: str, by_operator: bool
) -> None:
    """A batched backward through the node (either node; ``jacobian(..., vectorize=True)``:
    batched output gradients, whose memory no kernel can read) differentiates the step's ops
    instead: the jacobians of the input and the state are the ops' own."""
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cellstep

    taken: list[bool] = []
    routes: list[str] = []
    _cell_kernels(monkeypatch, taken, routes)
    cell = _kernel_cell(kind, 4, 5, dtype=DT)
    randomize(cell)
    x, h = inputs(2, 4), inputs(2, 5, seed=2)
    hx = (h, 0.5 * h) if kind == "lstm" else h

    def step(x, h):
        out = cell(x, (h, 0.5 * h) if kind == "lstm" else h)
        return out[0] if isinstance(out, tuple) else out

    with torch_ops.switched(by_operator):
        got = torch.autograd.functional.jacobian(step, (x, h), vectorize=True)
    assert taken and hx is not None
    assert routes == [_route(by_operator)] * len(taken)
    with monkeypatch.context() as ops:
        ops.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 0)
        want = torch.autograd.functional.jacobian(step, (x, h), vectorize=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("kind", KERNEL_CELLS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cell_kernels_in_half_are_float32_rounded_once(
    monkeypatch: pytest.MonkeyPatch, kind: str, dtype: torch.dtype
) -> None:
    """A bfloat16 / float16 step by the node computes in float32 on its inputs converted
    exactly: its outputs and every gradient are those of the float32 node on the same values,
    each rounded once to the half dtype, bit for bit."""
    from layernorm.recurrent import _cstep

    taken: list[bool] = []
    _cell_kernels(monkeypatch, taken)
    half = _kernel_cell(kind, 6, 8)
    randomize(half)
    half = half.to(dtype)
    wide = _kernel_cell(kind, 6, 8)
    wide.load_state_dict({k: v.float() for k, v in half.state_dict().items()})
    x = inputs(3, 6).to(dtype)
    state = _initial_state(type(half), 3, dtype)
    if not _cstep.available(x.float()):
        pytest.skip("C kernels not built")

    def step(cell: torch.nn.Module, to: torch.dtype) -> list[torch.Tensor]:
        leaves = [t.to(to).requires_grad_() for t in (x, *state)]
        out = cell(leaves[0], tuple(leaves[1:]) if kind == "lstm" else leaves[1])
        outs = out if isinstance(out, tuple) else (out,)
        gen = torch.Generator().manual_seed(5)
        douts = [torch.randn(o.shape, generator=gen).to(dtype).to(to) for o in outs]
        grads = torch.autograd.grad(outs, [*leaves, *cell.parameters()], douts)
        return [*outs, *grads]

    got, wanted = step(half, dtype), step(wide, torch.float32)
    assert taken == [True, True]
    for g, w in zip(got, wanted, strict=True):
        assert g.dtype == dtype
        torch.testing.assert_close(g, w.to(dtype), rtol=0, atol=0)


# -- the Elman cell's training step as one C++ node of torch's ops --------------------------------


def _elman_nodes(monkeypatch: pytest.MonkeyPatch, taken: list[bool]) -> None:
    """Each Elman training step by the C++ node counted."""
    from layernorm.recurrent import _cellstep

    monkeypatch.setattr(_cellstep, "elman_node", _counted(_cellstep.elman_node, taken))


def _elman_operator_loaded() -> bool:
    from layernorm.kernels.cpu import torch_ops

    return torch_ops.recurrent_nodes()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("given_state", [True, False], ids=["hx", "no hx"])
@pytest.mark.parametrize("rows", [1, 5, 0], ids=["one row", "five rows", "unbatched"])
def test_elman_training_by_the_node_is_the_ops_bits(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, nonlinearity: str, bias: bool,
    given_state: bool, rows: int,
) -> None:  # fmt: skip
    """Training steps of the Elman cell by the C++ node (torch's ops of the step, autograd's
    derivatives of them, in one node) give the step's ops' outputs and gradients (input, state,
    every parameter) bit for bit, three steps in a row."""
    from layernorm.kernels.cpu import torch_ops

    cell = LayerNormRNNCell(6, 8, bias=bias, nonlinearity=nonlinearity, dtype=dtype)
    randomize(cell)
    shape = (3, rows, 6) if rows else (3, 6)
    xs = inputs(3 * max(rows, 1), 6).view(shape).to(dtype)
    hx = _initial_state(LayerNormRNNCell, rows, dtype) if given_state else None
    with torch_ops.switched(False):
        expected = _kernel_steps_and_grads(cell, xs, hx)
    taken: list[bool] = []
    _elman_nodes(monkeypatch, taken)
    got = _kernel_steps_and_grads(cell, xs, hx)
    assert taken == ([True] * 3 if _elman_operator_loaded() else [])
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_elman_node_keeps_second_derivatives(
    monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, nonlinearity: str
) -> None:
    """With ``create_graph=True`` the node's backward differentiates the step's ops
    (``layernorm::cell_reference_grads``): the gradients of the gradients are the ops' own."""
    from layernorm.kernels.cpu import torch_ops

    cell = LayerNormRNNCell(5, 8, nonlinearity=nonlinearity, dtype=dtype)
    randomize(cell)
    xs, hx = inputs(2 * 3, 5).view(2, 3, 5).to(dtype), (inputs(3, 8, seed=2).to(dtype),)
    with torch_ops.switched(False):
        expected = _kernel_steps_and_grads(cell, xs, hx, create_graph=True)
    taken: list[bool] = []
    _elman_nodes(monkeypatch, taken)
    got = _kernel_steps_and_grads(cell, xs, hx, create_graph=True)
    assert taken == ([True] * 2 if _elman_operator_loaded() else [])
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, **_cell_tolerance(dtype))


def test_elman_node_batched_backward_is_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batched backward through the node (``jacobian(..., vectorize=True)``) differentiates
    the step's ops: the jacobians of the input and the state are the ops' own."""
    from layernorm.kernels.cpu import torch_ops

    taken: list[bool] = []
    _elman_nodes(monkeypatch, taken)
    cell = LayerNormRNNCell(4, 5, dtype=DT)
    randomize(cell)
    x, h = inputs(2, 4), inputs(2, 5, seed=2)
    got = torch.autograd.functional.jacobian(cell, (x, h), vectorize=True)
    assert taken == ([True] if _elman_operator_loaded() else [])
    with torch_ops.switched(False):
        want = torch.autograd.functional.jacobian(cell, (x, h), vectorize=True)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    "case", ["taken", "zoneout", "no grad", "parametrized", "replaced gain", "bfloat16",
             "traced", "autocast", "forced backend", "large step", "operators off",
             "compiled code off"],
)  # fmt: skip
def test_elman_node_is_taken_where_the_rule_says(
    monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    """The node runs an Elman training step of float32 / float64 rows of up to torch's
    layer-norm kernel's size in the ops (``_dispatch.TORCH_KERNEL_NUMEL``); not with zoneout,
    gradients off, a parametrized weight or a plain tensor in a parameter's place, a half
    dtype, under a tracer, autocast or a forced backend, past that size, with the C++ operators
    off or compiled code switched off: the step's ops run those."""
    from layernorm.backend import force_backend
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cellstep

    if not _elman_operator_loaded():
        pytest.skip("the C++ operators are not built")
    taken: list[bool] = []
    _elman_nodes(monkeypatch, taken)
    cell = LayerNormRNNCell(6, 8, zoneout_hidden=0.2 if case == "zoneout" else 0.0)
    if case == "parametrized":
        torch.nn.utils.parametrizations.weight_norm(cell, "weight_hh")
    if case == "replaced gain":
        gain = cell.ln_weight.detach().clone()
        del cell.ln_weight
        cell.ln_weight = gain
    if case == "large step":
        monkeypatch.setattr(_cellstep, "TORCH_KERNEL_NUMEL", 5 * 8 - 1)
    if case == "compiled code off":
        monkeypatch.setenv("LAYERNORM_CPU_COMPILE", "0")
    dtype = torch.bfloat16 if case == "bfloat16" else torch.float32
    cell = cell.to(dtype)
    x = torch.randn(5, 6, dtype=dtype)
    context: contextlib.AbstractContextManager = contextlib.nullcontext()
    if case == "autocast":
        context = torch.autocast("cpu", dtype=torch.bfloat16)
    elif case == "forced backend":
        context = force_backend("cpu")
    elif case == "operators off":
        context = torch_ops.switched(False)
    with torch.set_grad_enabled(case != "no grad"), context:
        if case == "traced":
            torch.jit.trace(cell, (x,), check_trace=False)
        else:
            cell(x)
    assert taken == ([True] if case == "taken" else [])


@pytest.mark.parametrize("case", ["rows", "width", "dtype", "gain", "eps"])
def test_elman_operator_refuses_tensors_of_other_shapes(case: str) -> None:
    """The C++ node checks its tensors before any op reads them: an input of other rows or
    width, a state of another dtype, a gain of the wrong size are named with the shape and dtype
    expected and given; eps must be positive."""
    from layernorm.kernels.cpu import torch_ops

    if not _elman_operator_loaded():
        pytest.skip("the C++ operators are not built")
    cell = LayerNormRNNCell(6, 8)
    x, h = torch.randn(5, 6), torch.zeros(5, 8)
    params = [getattr(cell, n) for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh",
                                         "ln_weight", "ln_bias")]  # fmt: skip
    eps = cell.eps
    if case == "rows":
        h = h[1:]
        message = r"expected h to be a Float CPU tensor of shape \[5, 8\], got Float tensor of "
        message += r"shape \[4, 8\]"
    elif case == "width":
        x = torch.randn(5, 7)
        message = r"expected w_ih to be a Float CPU tensor of shape \[8, 7\], got Float tensor"
    elif case == "dtype":
        h = h.double()
        message = r"expected h to be a Float CPU tensor of shape \[5, 8\], got Double tensor"
    elif case == "gain":
        params[4] = params[4][1:]
        message = r"expected lw to be a Float CPU tensor of shape \[8\], got Float tensor of "
        message += r"shape \[7\]"
    else:
        eps = 0.0
        message = "eps must be finite and > 0, got 0"
    with pytest.raises(RuntimeError, match=message):
        torch_ops.elman_cell_step(x, h, *params, eps, False)
