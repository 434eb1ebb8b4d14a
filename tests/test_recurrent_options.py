"""The recurrent layers' options: forget_bias, DropConnect, zoneout, recurrent dropout, proj_size.

Each option is checked against its published definition, written out here with plain torch ops
(``hand_*``: the equations, not the library's step functions), and the layers' paths against each
other. Random masks are taken out of the comparison by replacing the layer's ``_draw_masks`` with
given masks (or by recording the masks it drew).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.recurrent import _options
from layernorm.recurrent.cells import LayerNormGRUCell, LayerNormLSTMCell, LayerNormRNNCell

DT = torch.float64
TOL = {"rtol": 1e-10, "atol": 1e-11}
LAYERS = {"lstm": LayerNormLSTM, "gru": LayerNormGRU, "rnn": LayerNormRNN}
GATES = {"lstm": 4, "gru": 3, "rnn": 1}


def randomize(module: torch.nn.Module, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
            p.copy_(1.0 + 0.3 * noise if name.startswith("ln_weight") else 0.4 * noise)


def seq(t: int, b: int, n: int, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, b, n, generator=gen, dtype=DT)


def bernoulli(shape: tuple[int, ...], p: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(shape, generator=gen, dtype=DT) < p).to(DT)


def use_masks(monkeypatch, model, masks: list[_options.Masks]) -> None:
    """Make ``model`` use ``masks`` (one per layer and direction, in call order)."""
    queue = list(masks)
    monkeypatch.setattr(model, "_draw_masks", lambda *a: queue.pop(0))


def record_masks(monkeypatch, model) -> list[_options.Masks]:
    drawn: list[_options.Masks] = []
    original = model._draw_masks

    def spy(*a):
        drawn.append(original(*a))
        return drawn[-1]

    monkeypatch.setattr(model, "_draw_masks", spy)
    return drawn


# -- the published definitions, one layer, one direction, padded (T, B, ·) input ------------------


def _ln(z: torch.Tensor, model, name: str) -> torch.Tensor:
    if model.norm == "none":
        return z
    return F.layer_norm(
        z, (z.shape[-1],), getattr(model, f"ln_weight{name}"), getattr(model, f"ln_bias{name}"),
        model.eps,
    )  # fmt: skip


def _per_step(d: torch.Tensor | None, t: int, b: int) -> torch.Tensor | None:
    return None if d is None else d.view(-1, b, d.shape[-1])[t]


def _zone(d: torch.Tensor | None, prev: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    return new if d is None else d * prev + (1 - d) * new


def hand_lstm(model, x, h, c, masks: _options.Masks):
    """Ba et al.'s LN-LSTM with DropConnect (W_hh ⊙ M), Semeniuta's candidate dropout (m),
    zoneout of h and c (Krueger et al.), and torch's projection ``h = W_hr(o ⊙ tanh(LN(c)))``."""
    w_hh = model.weight_hh_l0 if masks.w_hh is None else model.weight_hh_l0 * masks.w_hh
    w_hr = getattr(model, "weight_hr_l0", None)
    outs = []
    for t in range(x.shape[0]):
        gates = _ln(x[t] @ model.weight_ih_l0.T, model, "_ih_l0") + _ln(h @ w_hh.T, model, "_hh_l0")
        gates = gates + model.bias_ih_l0 + model.bias_hh_l0
        i, f, g, o = gates.chunk(4, dim=1)
        cand = torch.tanh(g) if masks.candidate is None else masks.candidate * torch.tanh(g)
        c_new = torch.sigmoid(f) * c + torch.sigmoid(i) * cand
        c_norm = _ln(c_new, model, "_c_l0")
        h_new = torch.sigmoid(o) * torch.tanh(c_norm)
        if w_hr is not None:
            h_new = h_new @ w_hr.T
        carried = c_norm if model.normalize_cell_state else c_new  # TF-Addons' variant carries LN
        c = _zone(_per_step(masks.zoneout_c, t, x.shape[1]), c, carried)
        h = _zone(_per_step(masks.zoneout_h, t, x.shape[1]), h, h_new)
        outs.append(h)
    return torch.stack(outs), h, c


def hand_gru(model, x, h, masks: _options.Masks):
    hs = model.hidden_size
    w_hh = model.weight_hh_l0 if masks.w_hh is None else model.weight_hh_l0 * masks.w_hh

    def two_lns(z, part):
        # the paper's LN-GRU: the (r, z) block and the candidate block normalized separately
        if model.norm == "none":
            return z
        w, b = getattr(model, f"ln_weight{part}_l0"), getattr(model, f"ln_bias{part}_l0")
        rz = F.layer_norm(z[:, : 2 * hs], (2 * hs,), w[: 2 * hs], b[: 2 * hs], model.eps)
        n = F.layer_norm(z[:, 2 * hs :], (hs,), w[2 * hs :], b[2 * hs :], model.eps)
        return torch.cat((rz, n), dim=1)

    outs = []
    for t in range(x.shape[0]):
        gx = two_lns(x[t] @ model.weight_ih_l0.T, "_ih")
        gh = two_lns(h @ w_hh.T, "_hh")
        gx, gh = gx + model.bias_ih_l0, gh + model.bias_hh_l0
        r = torch.sigmoid(gx[:, :hs] + gh[:, :hs])
        z = torch.sigmoid(gx[:, hs : 2 * hs] + gh[:, hs : 2 * hs])
        n = torch.tanh(gx[:, 2 * hs :] + r * gh[:, 2 * hs :])
        if masks.candidate is not None:
            n = masks.candidate * n
        h_new = (1 - z) * n + z * h
        h = _zone(_per_step(masks.zoneout_h, t, x.shape[1]), h, h_new)
        outs.append(h)
    return torch.stack(outs), h


def hand_rnn(model, x, h, masks: _options.Masks):
    w_hh = model.weight_hh_l0 if masks.w_hh is None else model.weight_hh_l0 * masks.w_hh
    outs = []
    for t in range(x.shape[0]):
        a = _ln(x[t] @ model.weight_ih_l0.T + h @ w_hh.T, model, "_l0")
        h_new = torch.tanh(a + model.bias_ih_l0 + model.bias_hh_l0)
        h = _zone(_per_step(masks.zoneout_h, t, x.shape[1]), h, h_new)
        outs.append(h)
    return torch.stack(outs), h


def hand(kind, model, x, hx, masks):
    if kind == "lstm":
        out, h, c = hand_lstm(model, x, hx[0][0], hx[1][0], masks)
        return out, (h, c)
    fn = hand_gru if kind == "gru" else hand_rnn
    out, h = fn(model, x, hx[0][0], masks)
    return out, (h,)


def hx_for(kind: str, b: int, h: int, p: int | None = None, layers: int = 1):
    gen = torch.Generator().manual_seed(2)
    hs = [torch.randn(layers, b, p or h, generator=gen, dtype=DT)]
    if kind == "lstm":
        hs.append(torch.randn(layers, b, h, generator=gen, dtype=DT))
    return tuple(hs)


def layer_call(model, kind, x, hx):
    out, states = model(x, hx if kind == "lstm" else hx[0])
    states = states if isinstance(states, tuple) else (states,)
    return out, tuple(s[0] for s in states)


def grads_of(outputs, tensors):
    weights = torch.linspace(-1, 2, outputs[0].numel(), dtype=DT).view_as(outputs[0])
    loss = (outputs[0] * weights).sum() + sum((s * s).sum() for s in outputs[1])
    return torch.autograd.grad(loss, tensors)


# -- forget_bias ---------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", ["layer", "none", "batch"])
def test_forget_bias_sets_the_forget_gates_summed_bias_at_init(norm: str) -> None:
    h = 5
    model = LayerNormLSTM(3, h, num_layers=2, bidirectional=True, norm=norm, forget_bias=1.0)
    for k in range(2):
        for sfx in (f"_l{k}", f"_l{k}_reverse"):
            total = getattr(model, f"bias_ih{sfx}") + getattr(model, f"bias_hh{sfx}")
            if norm == "layer":  # the LN biases add to the gate pre-activations too
                total = (
                    total
                    + getattr(model, f"ln_bias_ih{sfx}")
                    + model.get_parameter(f"ln_bias_hh{sfx}")
                )
            torch.testing.assert_close(total[h : 2 * h], torch.ones(h))
            others = torch.cat((total[:h], total[2 * h :]))
            if norm == "none":  # the other gates keep torch's uniform(±1/√H) init
                assert others.std() > 0 and others.abs().max() <= 2 / h**0.5
            else:
                assert torch.all(others == 0)
    with torch.no_grad():
        model.bias_ih_l0.fill_(3.0)
    model.reset_parameters()
    assert torch.all(model.bias_ih_l0[h : 2 * h] == 1.0)


def test_forget_bias_default_keeps_the_init_and_loaded_weights() -> None:
    h = 4
    plain = LayerNormLSTM(3, h, norm="none")
    assert plain.forget_bias is None
    assert plain.bias_ih_l0[h : 2 * h].std() > 0  # torch's init, untouched
    assert torch.all(LayerNormLSTM(3, h).bias_ih_l0 == 0)
    ref = torch.nn.LSTM(3, h)
    ours = LayerNormLSTM.from_torch(ref, norm="none", forget_bias=1.0)
    torch.testing.assert_close(ours.bias_ih_l0, ref.bias_ih_l0)  # loading overrides the init
    cell = LayerNormLSTMCell(3, h, forget_bias=2.5)
    torch.testing.assert_close(
        cell.bias_ih[h : 2 * h] + cell.bias_hh[h : 2 * h], torch.full((h,), 2.5)
    )
    assert torch.all(cell.bias_ih[:h] == 0) and torch.all(cell.bias_ih[2 * h :] == 0)


def test_forget_bias_errors() -> None:
    with pytest.raises(ValueError, match=r"forget_bias=1.0 needs bias=True"):
        LayerNormLSTM(3, 4, bias=False, forget_bias=1.0)
    with pytest.raises(TypeError, match=r"forget_bias must be a finite float, got str '1'"):
        LayerNormLSTM(3, 4, forget_bias="1")
    with pytest.raises(ValueError, match=r"forget_bias=1.0 needs bias=True"):
        LayerNormLSTMCell(3, 4, bias=False, forget_bias=1.0)


# -- DropConnect ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("impl", ["fused", "loop"])
def test_dropconnect_is_the_mask_on_w_hh_with_gradient_to_kept_weights(
    kind: str, impl: str, monkeypatch
) -> None:
    h, p = 4, 0.5
    model = LAYERS[kind](3, h, weight_dropout=p, impl=impl, dtype=DT)
    randomize(model)
    mask = bernoulli((GATES[kind] * h, h), 1 - p, seed=5) / (1 - p)
    assert 0 < int((mask == 0).sum()) < mask.numel()
    use_masks(monkeypatch, model, [_options.Masks(w_hh=mask)])
    x, hx = seq(5, 3, 3), hx_for(kind, 3, h)
    out, states = layer_call(model, kind, x, hx)
    ref_out, ref_states = hand(kind, model, x, hx, _options.Masks(w_hh=mask))
    for a, b in zip((out, *states), (ref_out, *ref_states), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    params = [model.weight_hh_l0, model.weight_ih_l0]
    got = grads_of((out, states), params)
    want = grads_of((ref_out, ref_states), params)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    assert torch.all(got[0][mask == 0] == 0) and torch.all(got[0][mask != 0] != 0)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_dropconnect_draws_per_call_and_direction_and_is_identity_at_eval(
    kind: str, monkeypatch
) -> None:
    p = 0.3
    model = LAYERS[kind](3, 8, num_layers=2, bidirectional=True, weight_dropout=p, dtype=DT)
    randomize(model)
    x = seq(4, 2, 3)
    drawn = record_masks(monkeypatch, model)
    model(x)
    model(x)
    masks = [m.w_hh for m in drawn]
    assert len(masks) == 8  # 2 calls x 2 layers x 2 directions, each its own mask
    for m in masks:
        assert m.shape == model.weight_hh_l0.shape
        assert set(m.unique().tolist()) == {0.0, 1 / (1 - p)}
    assert all(not torch.equal(a, b) for i, a in enumerate(masks) for b in masks[i + 1 :])
    dropped = torch.stack(masks).eq(0).double().mean().item()
    assert abs(dropped - p) < 0.08  # 8 x 512 or 384 Bernoulli draws
    model.eval()
    plain = LAYERS[kind](3, 8, num_layers=2, bidirectional=True, dtype=DT).eval()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x)[0], plain(x)[0], rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_dropconnect_fused_and_loop_agree_from_the_same_seed(kind: str) -> None:
    model = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, weight_dropout=0.4, dtype=DT)
    randomize(model)
    x = seq(5, 4, 3)
    lengths = torch.tensor([5, 2, 5, 1])
    results = []
    for impl in ("fused", "loop"):
        model.impl = impl
        model.zero_grad()
        torch.manual_seed(7)
        out, _ = model(pack_padded_sequence(x, lengths, enforce_sorted=False))
        out.data.pow(2).sum().backward()
        results.append([out.data.detach(), *(p.grad.clone() for p in model.parameters())])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **TOL)


# -- zoneout -------------------------------------------------------------------------------------


def _zoneout_masks(kind, t, b, h, ph, pc, training, seed=11):
    def d(p, s):
        if training:
            return bernoulli((t * b, h), p, seed=s)
        return torch.full((t * b, h), p, dtype=DT)

    return _options.Masks(
        zoneout_h=d(ph, seed), zoneout_c=d(pc, seed + 1) if kind == "lstm" else None
    )


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("impl", ["fused", "loop"])
def test_zoneout_matches_krueger_et_al(kind: str, training: bool, impl: str, monkeypatch) -> None:
    h, ph, pc = 4, 0.3, 0.6
    opts = {"zoneout_hidden": ph} | ({"zoneout_cell": pc} if kind == "lstm" else {})
    model = LAYERS[kind](3, h, dtype=DT, impl=impl, **opts)
    randomize(model)
    model.train(training)
    x, hx = seq(6, 3, 3), hx_for(kind, 3, h)
    masks = _zoneout_masks(kind, 6, 3, h, ph, pc, training)
    if training:
        use_masks(monkeypatch, model, [masks])
    else:  # the layer's own eval coefficients: the expectation p h_{t−1} + (1 − p) h̃_t
        drawn = record_masks(monkeypatch, model)
    x = x.requires_grad_()
    out, states = layer_call(model, kind, x, hx)
    if not training:
        assert torch.all(drawn[0].zoneout_h == ph)
        assert kind != "lstm" or torch.all(drawn[0].zoneout_c == pc)
    ref_out, ref_states = hand(kind, model, x, hx, masks)
    for a, b in zip((out, *states), (ref_out, *ref_states), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    params = [x, model.weight_hh_l0, model.weight_ih_l0]
    for a, b in zip(
        grads_of((out, states), params), grads_of((ref_out, ref_states), params), strict=True
    ):
        torch.testing.assert_close(a, b, **TOL)


def test_zoneout_one_freezes_the_state_and_masks_are_per_unit_and_step(monkeypatch) -> None:
    x, hx = seq(5, 2, 3), hx_for("lstm", 2, 16)
    for norm in ("layer", "none", "batch"):
        model = LayerNormLSTM(3, 16, zoneout_hidden=1.0, zoneout_cell=1.0, norm=norm, dtype=DT)
        out, (_, c) = model(x, hx)
        torch.testing.assert_close(out, hx[0].expand(5, 2, 16), rtol=0, atol=0)
        torch.testing.assert_close(c, hx[1], rtol=0, atol=0)
    model = LayerNormGRU(3, 64, zoneout_hidden=0.25, dtype=DT)
    drawn = record_masks(monkeypatch, model)
    model(seq(50, 4, 3))
    d = drawn[0].zoneout_h
    assert d.shape == (200, 64) and set(d.unique().tolist()) == {0.0, 1.0}
    assert abs(d.mean().item() - 0.25) < 0.03


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_zoneout_at_eval_on_packed_sequences_equals_each_alone(kind: str) -> None:
    opts = {"zoneout_hidden": 0.3} | ({"zoneout_cell": 0.2} if kind == "lstm" else {})
    model = LAYERS[kind](3, 4, bidirectional=True, dtype=DT, **opts).eval()
    randomize(model)
    x, lengths = seq(5, 3, 3), [5, 2, 4]
    packed = pack_padded_sequence(x, torch.tensor(lengths), enforce_sorted=False)
    out, _ = pad_packed_sequence(model(packed)[0])
    for b, n in enumerate(lengths):
        alone, _ = model(x[:n, b : b + 1])
        torch.testing.assert_close(out[:n, b : b + 1], alone, **TOL)


# -- recurrent dropout ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("impl", ["fused", "loop"])
def test_recurrent_dropout_drops_the_candidate_with_one_mask_per_sequence(
    kind: str, impl: str, monkeypatch
) -> None:
    h, p = 4, 0.5
    model = LAYERS[kind](3, h, recurrent_dropout=p, impl=impl, dtype=DT)
    randomize(model)
    drawn = record_masks(monkeypatch, model)
    x, hx = seq(6, 3, 3).requires_grad_(), hx_for(kind, 3, h)
    out, states = layer_call(model, kind, x, hx)
    m = drawn[0].candidate
    assert m.shape == (3, h) and set(m.unique().tolist()) == {0.0, 1 / (1 - p)}
    ref_out, ref_states = hand(kind, model, x, hx, _options.Masks(candidate=m))
    for a, b in zip((out, *states), (ref_out, *ref_states), strict=True):
        torch.testing.assert_close(a, b, **TOL)
    params = [x, model.weight_hh_l0, model.bias_ih_l0]
    for a, b in zip(
        grads_of((out, states), params), grads_of((ref_out, ref_states), params), strict=True
    ):
        torch.testing.assert_close(a, b, **TOL)
    model.eval()
    plain = LAYERS[kind](3, h, impl=impl, dtype=DT).eval()
    plain.load_state_dict(model.state_dict())
    torch.testing.assert_close(model(x)[0], plain(x)[0], rtol=0, atol=0)  # identity at eval


def test_recurrent_dropout_of_a_whole_row_leaves_lstm_c_decaying(monkeypatch) -> None:
    model = LayerNormLSTM(3, 4, recurrent_dropout=0.5, dtype=DT)
    randomize(model)
    m = torch.tensor([[0.0] * 4, [2.0] * 4], dtype=DT)
    use_masks(monkeypatch, model, [_options.Masks(candidate=m)])
    c0 = torch.rand(1, 2, 4, dtype=DT) + 0.5
    _, (_, c) = model(seq(4, 2, 3), (torch.zeros(1, 2, 4, dtype=DT), c0))
    # c_t = σ(f) c_{t−1}: same sign as c_0, smaller, and the other sequence is not affected
    assert torch.all(c[0, 0] > 0) and torch.all(c[0, 0] < c0[0, 0])


# -- proj_size -----------------------------------------------------------------------------------


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("impl", ["fused", "loop"])
def test_proj_size_norm_none_equals_torch_lstm(packed: bool, impl: str) -> None:
    ref = torch.nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2, dtype=DT)
    ours = LayerNormLSTM(
        3, 5, num_layers=2, bidirectional=True, proj_size=2, norm="none", impl=impl, dtype=DT
    )
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    ours.load_state_dict(ref.state_dict())  # strict
    x = seq(5, 4, 3)
    h0, c0 = hx_for("lstm", 4, 5, p=2, layers=4)
    lengths = torch.tensor([5, 2, 5, 1])
    results = []
    for model in (ref, ours):
        xi = x.clone().requires_grad_()
        hx = (h0.clone().requires_grad_(), c0.clone().requires_grad_())
        inp = pack_padded_sequence(xi, lengths, enforce_sorted=False) if packed else xi
        out, (h, c) = model(inp, hx)
        data = out.data if packed else out
        assert data.shape[-1] == 4 and h.shape == (4, 4, 2) and c.shape == (4, 4, 5)
        grads = grads_of((data, (h, c)), [xi, *hx, *model.parameters()])
        results.append([data, h, c, *grads])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert [[p.shape for p in ps] for ps in ours.all_weights] == [
        [p.shape for p in ps] for ps in ref.all_weights
    ]


@pytest.mark.parametrize(
    ("kind", "options"),
    [("lstm", {"proj_size": 2}), ("lstm", {"zoneout_hidden": 0.3}),
     ("gru", {"zoneout_hidden": 0.3})],
    ids=["lstm proj_size", "lstm zoneout", "gru zoneout"],
)  # fmt: skip
@pytest.mark.parametrize("steps", [1, 4])
def test_per_step_backward_without_h0_s_gradient_changes_no_other(
    kind, options, steps, monkeypatch
) -> None:
    """The per-step backward (here on the per-step kernels whatever the target has: the
    sequence kernels' own backward computes every product) leaves out the first step's product
    by W_hh when h0 takes no gradient (it would be h0's alone): every other gradient is the same
    to the bit as when h0 takes one, in a call of one step (where that product is a large share)
    and of several, ragged lengths included."""
    from layernorm.recurrent import _cstep

    monkeypatch.setattr(_cstep, "sequence_gemm", lambda: False)
    layer = {"lstm": LayerNormLSTM, "gru": LayerNormGRU}[kind]
    torch.manual_seed(0)
    model = layer(3, 5, num_layers=2, bidirectional=True, dtype=DT, **options).eval()
    x = seq(steps, 4, 3)
    hx = hx_for(kind, 4, 5, p=options.get("proj_size"), layers=4)
    lengths = torch.tensor([steps, 1, steps, max(1, steps - 1)])
    results = []
    for h0_grad in (True, False):
        xi = x.clone().requires_grad_()
        states = tuple(h.clone().requires_grad_(h0_grad) for h in hx)
        inp = pack_padded_sequence(xi, lengths, enforce_sorted=False)
        out, h_n = model(inp, states if kind == "lstm" else states[0])
        h_n = h_n if isinstance(h_n, tuple) else (h_n,)
        grads = grads_of((out.data, h_n), [xi, *model.parameters()])
        results.append([out.data, *h_n, *grads])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("packed", [False, True])
def test_proj_size_inference_equals_torch_lstm(packed: bool) -> None:
    """Without gradients the LSTM's sequence kernel carries the projected h (the projection's
    GEMM in its time loop): torch.nn.LSTM's outputs and final states, both directions of two
    layers, ragged lengths too."""
    ref = torch.nn.LSTM(3, 5, num_layers=2, bidirectional=True, proj_size=2, dtype=DT)
    ours = LayerNormLSTM.from_torch(ref, norm="none")
    x = seq(5, 4, 3)
    hx = hx_for("lstm", 4, 5, p=2, layers=4)
    lengths = torch.tensor([5, 2, 5, 1])
    results = []
    with torch.no_grad():
        for model in (ref, ours):
            inp = pack_padded_sequence(x, lengths, enforce_sorted=False) if packed else x
            out, (h, c) = model(inp, hx)
            results.append([out.data if packed else out, h, c])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def test_proj_size_from_torch_and_layer_norm_matches_the_equations() -> None:
    ref = torch.nn.LSTM(3, 5, proj_size=3, batch_first=True, dtype=DT)
    ours = LayerNormLSTM.from_torch(ref)
    assert ours.proj_size == 3 and ours.weight_hr_l0.shape == (3, 5)
    torch.testing.assert_close(ours.weight_hr_l0, ref.weight_hr_l0)
    randomize(ours)
    x = seq(4, 2, 3)
    hx = hx_for("lstm", 2, 5, p=3)
    out, (h, c) = ours(x.transpose(0, 1), hx)
    ref_out, h_ref, c_ref = hand_lstm(ours, x, hx[0][0], hx[1][0], _options.Masks())
    torch.testing.assert_close(out.transpose(0, 1), ref_out, **TOL)
    torch.testing.assert_close((h[0], c[0]), (h_ref, c_ref), **TOL)
    with pytest.raises(ValueError, match=r"hx\[0\] must have shape \(1, 2, 3\), got \(1, 2, 5\)"):
        ours(x.transpose(0, 1), (hx[1], hx[1]))


@pytest.mark.parametrize("impl", ["fused", "loop"])
@pytest.mark.parametrize("carry_normalized", [False, True])
def test_proj_size_with_every_option_against_the_equations(
    impl: str, carry_normalized: bool, monkeypatch
) -> None:
    h, p, t, b = 6, 2, 5, 3
    model = LayerNormLSTM(
        3, h, proj_size=p, forget_bias=1.0, weight_dropout=0.3, zoneout_hidden=0.2,
        zoneout_cell=0.4, recurrent_dropout=0.25, impl=impl, dtype=DT,
        normalize_cell_state=carry_normalized,
    )  # fmt: skip
    randomize(model)
    masks = _options.Masks(
        w_hh=bernoulli((4 * h, p), 0.7, seed=1) / 0.7,
        zoneout_h=bernoulli((t * b, p), 0.2, seed=2),
        zoneout_c=bernoulli((t * b, h), 0.4, seed=3),
        candidate=bernoulli((b, h), 0.75, seed=4) / 0.75,
    )
    use_masks(monkeypatch, model, [masks])
    x, hx = seq(t, b, 3).requires_grad_(), hx_for("lstm", b, h, p=p)
    out, (hn, cn) = model(x, hx)
    ref = hand_lstm(model, x, hx[0][0], hx[1][0], masks)
    torch.testing.assert_close((out, hn[0], cn[0]), ref, **TOL)
    params = [x, *model.parameters()]
    got = grads_of((out, (hn[0], cn[0])), params)
    want = grads_of((ref[0], ref[1:]), params)
    for a, b_ in zip(got, want, strict=True):
        torch.testing.assert_close(a, b_, **TOL)


@pytest.mark.parametrize("impl", ["fused", "loop"])
def test_options_gradcheck(impl: str) -> None:
    model = LayerNormLSTM(
        2, 3, proj_size=2, zoneout_hidden=0.3, zoneout_cell=0.5, impl=impl, dtype=DT
    )
    model.eval()  # deterministic: the zoneout expectation
    randomize(model)
    names = [n for n, _ in model.named_parameters()]
    x = seq(3, 2, 2).requires_grad_()

    def fn(x, *ps):
        return torch.func.functional_call(model, dict(zip(names, ps, strict=True)), (x,))[0]

    assert torch.autograd.gradcheck(fn, (x, *model.parameters()), fast_mode=True)


# -- paths and errors ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("norm", ["layer", "none"])
def test_zoneout_and_recurrent_dropout_fused_equals_loop_from_the_same_seed(
    kind: str, norm: str
) -> None:
    opts = {"weight_dropout": 0.2, "zoneout_hidden": 0.3}
    if kind != "rnn":
        opts["recurrent_dropout"] = 0.4
    if kind == "lstm":  # with a projection too
        opts |= {"zoneout_cell": 0.5, "normalize_cell_state": norm == "layer", "proj_size": 3}
    model = LAYERS[kind](3, 4, num_layers=2, bidirectional=True, norm=norm, dtype=DT, **opts)
    randomize(model)
    x, lengths = seq(5, 4, 3), torch.tensor([5, 2, 5, 1])
    hx = hx_for(kind, 4, 4, p=3 if kind == "lstm" else None, layers=4)
    for training in (True, False):
        model.train(training)
        results = []
        for impl in ("fused", "loop"):
            model.impl = impl
            model.zero_grad()
            xi = x.clone().requires_grad_()
            hi = tuple(s.clone().requires_grad_() for s in hx)
            torch.manual_seed(3)
            out, states = model(
                pack_padded_sequence(xi, lengths, enforce_sorted=False),
                hi if kind == "lstm" else hi[0],
            )
            states = states if isinstance(states, tuple) else (states,)
            grads = grads_of((out.data, states), [xi, *hi, *model.parameters()])
            results.append([out.data, *states, *grads])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_masks_on_one_step_of_a_batch_fused_equals_loop_from_the_same_seed(kind: str) -> None:
    """One time step of more rows than the sequence kernels read their weights as stored for:
    the GRU trains it on the C step kernels around torch's GEMMs; zoneout, recurrent dropout and
    DropConnect give the loop's values and gradients there too."""
    from layernorm.recurrent import _cstep

    batch = _cstep.direct_rows() + 4
    opts = {"weight_dropout": 0.2, "zoneout_hidden": 0.3, "recurrent_dropout": 0.4}
    model = LAYERS[kind](5, 4, dtype=DT, **opts)
    randomize(model)
    x, hx = seq(1, batch, 5), hx_for(kind, batch, 4)
    for training in (True, False):
        model.train(training)
        results = []
        for impl in ("fused", "loop"):
            model.impl = impl
            xi = x.clone().requires_grad_()
            hi = tuple(s.clone().requires_grad_() for s in hx)
            torch.manual_seed(3)
            out, states = model(xi, hi if kind == "lstm" else hi[0])
            states = states if isinstance(states, tuple) else (states,)
            grads = grads_of((out, states), [xi, *hi, *model.parameters()])
            results.append([out, *states, *grads])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, **TOL)


def test_the_fused_path_runs_masks_and_proj_size_on_the_c_kernels(monkeypatch) -> None:
    """Zoneout, recurrent dropout and proj_size stay on the fused node, on the C kernels where
    they are built (in training the projection on the per-step ones: the sequence kernels take
    it in inference only)."""
    from layernorm.recurrent import _fused, _planned, _pointwise

    used = []
    original = _fused._kernels
    monkeypatch.setattr(
        _fused, "_kernels", lambda gx, st: used.append(original(gx, st)) or used[-1]
    )
    native = _pointwise.step_kernels(torch.randn(1))  # C kernels when built, else eager
    model = LayerNormLSTM(3, 4, zoneout_hidden=0.1, recurrent_dropout=0.2, impl="fused")
    model(torch.randn(3, 2, 3))[0].sum().backward()
    assert used and all(k is native for k in used)
    used.clear()
    # without masks a training call runs by its plan, which checks for the C kernels itself
    monkeypatch.setattr(_planned, "lstm_training", lambda *args: None)
    LayerNormLSTM(3, 4, impl="fused")(torch.randn(3, 2, 3))
    assert used and used[0] is native
    used.clear()
    LayerNormLSTM(3, 4, proj_size=2, impl="fused")(torch.randn(3, 2, 3))[0].sum().backward()
    c_steps = _pointwise.C_STEPS if native is _pointwise.C_KERNELS else native
    assert used and all(k is c_steps for k in used)


@pytest.mark.parametrize(
    ("kwargs", "exc", "message"),
    [
        ({"weight_dropout": 1.0}, ValueError, r"weight_dropout must be .* \[0, 1\), got 1.0"),
        ({"recurrent_dropout": -0.1}, ValueError, r"recurrent_dropout must be .* \[0, 1\)"),
        ({"zoneout_hidden": 1.5}, ValueError, r"zoneout_hidden must be .* \[0, 1\], got 1.5"),
        ({"zoneout_cell": "0.1"}, TypeError, r"zoneout_cell must be .* \[0, 1\], got str"),
        ({"weight_dropout": True}, TypeError, r"weight_dropout must be .* \[0, 1\), got bool"),
    ],
)  # fmt: skip
def test_option_errors_name_what_was_expected(kwargs, exc, message) -> None:
    with pytest.raises(exc, match=message):
        LayerNormLSTM(3, 4, **kwargs)


def test_options_are_keywords_of_the_right_layers_and_shown_in_repr() -> None:
    with pytest.raises(TypeError):
        LayerNormGRU(3, 4, zoneout_cell=0.1)  # a GRU has no cell state
    with pytest.raises(TypeError):
        LayerNormRNN(3, 4, recurrent_dropout=0.1)  # Semeniuta's candidate: LSTM and GRU
    with pytest.raises(ValueError, match=r"proj_size is an LSTM option"):
        LayerNormGRU.__mro__[1].__init__(LayerNormGRU.__new__(LayerNormGRU), 3, 4, proj_size=2)
    opts = {"proj_size": 2, "forget_bias": 0.0, "weight_dropout": 0.1, "zoneout_hidden": 0.2,
            "zoneout_cell": 0.3, "recurrent_dropout": 0.4}  # fmt: skip
    r = repr(LayerNormLSTM(3, 4, **opts))
    for s in ("proj_size=2", "forget_bias=0.0", "weight_dropout=0.1", "zoneout_hidden=0.2",
              "zoneout_cell=0.3", "recurrent_dropout=0.4"):  # fmt: skip
        assert s in r


_TRITON_OK = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


@pytest.mark.skipif(not _TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_triton_steps_take_dropconnect_and_defer_masks_to_the_eager_steps(kind: str) -> None:
    """The Triton steps (CUDA, or the interpreter on CPU) with DropConnect, and with zoneout and
    recurrent dropout (which the fused node runs on its eager steps), vs the loop, same seed."""
    from layernorm.recurrent import _pointwise, register_step_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    steps = _pointwise._triton_step_kernels()
    assert steps is not None
    for opts in ({"weight_dropout": 0.3}, {"weight_dropout": 0.3, "zoneout_hidden": 0.2,
                                           "recurrent_dropout": 0.25}):  # fmt: skip
        model = LAYERS[kind](3, 8, bidirectional=True, device=device, **opts)
        randomize(model)
        x = seq(5, 4, 3).float().to(device)
        results = []
        for impl in ("fused", "loop"):
            model.impl = impl
            model.zero_grad()
            register_step_kernels(device, steps if impl == "fused" else None)
            try:
                torch.manual_seed(9)
                out, _ = model(x)
                out.pow(2).sum().backward()
            finally:
                register_step_kernels(device, None)
            results.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
        for a, b in zip(*results, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# -- cells ---------------------------------------------------------------------------------------

CELLS = {"lstm": LayerNormLSTMCell, "gru": LayerNormGRUCell, "rnn": LayerNormRNNCell}


def _cell_opts(kind: str, ph: float, pc: float) -> dict[str, float]:
    return {"zoneout_hidden": ph} | ({"zoneout_cell": pc} if kind == "lstm" else {})


def _cell_states(kind: str, out) -> tuple[torch.Tensor, ...]:
    return out if isinstance(out, tuple) else (out,)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_cell_zoneout_eval_is_the_expectation_and_training_picks_old_or_new(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from layernorm.recurrent import _cellstep

    # the plain cell's new state by the step's ops, as a cell with zoneout computes it (to the
    # bit: the C cell kernels' training step agrees to rounding)
    monkeypatch.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 0)
    ph, pc = 0.3, 0.7
    cell = CELLS[kind](3, 64, dtype=DT, **_cell_opts(kind, ph, pc))
    plain = CELLS[kind](3, 64, dtype=DT)
    randomize(cell)
    plain.load_state_dict(cell.state_dict())
    x = seq(1, 40, 3)[0]
    gen = torch.Generator().manual_seed(4)
    prev = tuple(
        torch.randn(40, 64, generator=gen, dtype=DT) for _ in range(2 if kind == "lstm" else 1)
    )
    hx = prev if kind == "lstm" else prev[0]
    new = _cell_states(kind, plain(x, hx))
    rates = (ph, pc)
    cell.eval()
    for got, old, nw, p in zip(_cell_states(kind, cell(x, hx)), prev, new, rates, strict=False):
        torch.testing.assert_close(got, p * old + (1 - p) * nw, **TOL)
    cell.train()
    first = _cell_states(kind, cell(x, hx))
    second = _cell_states(kind, cell(x, hx))
    for got, again, old, nw, p in zip(first, second, prev, new, rates, strict=False):
        kept = got == old
        assert torch.all(kept | (got == nw))  # each unit is either the old or the new state
        assert abs(kept.double().mean().item() - p) < 0.05  # 2560 Bernoulli(p) draws
        assert not torch.equal(got, again)  # a new mask each call (each step)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_layer_zoneout_at_eval_equals_its_cell_driven_over_time(kind: str) -> None:
    opts = _cell_opts(kind, 0.25, 0.5)
    layer = LAYERS[kind](3, 4, dtype=DT, **opts).eval()
    randomize(layer)
    cell = CELLS[kind](3, 4, dtype=DT, **opts).eval()
    cell.load_state_dict({k.removesuffix("_l0"): v for k, v in layer.state_dict().items()})
    x = seq(6, 2, 3)
    out, _ = layer(x)
    state = None
    for t in range(6):
        state = cell(x[t], state)
        h = state[0] if kind == "lstm" else state
        torch.testing.assert_close(out[t], h, **TOL)


@pytest.mark.parametrize(
    "cfg",
    [
        {"num_layers": 1, "bidirectional": False, "batch_first": False, "bias": True},
        {"num_layers": 2, "bidirectional": True, "batch_first": True, "bias": False},
        {"num_layers": 3, "bidirectional": False, "batch_first": True, "bias": True},
    ],
)
@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("with_hx", [True, False])
def test_proj_size_as_torch_over_configurations(cfg: dict, batched: bool, with_hx: bool) -> None:
    ref = torch.nn.LSTM(3, 6, proj_size=2, dtype=DT, **cfg)
    ours = LayerNormLSTM.from_torch(ref, norm="none")
    assert ours.proj_size == 2
    n_states = cfg["num_layers"] * (2 if cfg["bidirectional"] else 1)
    gen = torch.Generator().manual_seed(3)
    shape = ((2, 4) if cfg["batch_first"] else (4, 2)) if batched else (4,)
    x = torch.randn(*shape, 3, generator=gen, dtype=DT)
    lead = (n_states, 2) if batched else (n_states,)
    hx = (
        (
            torch.randn(*lead, 2, generator=gen, dtype=DT),
            torch.randn(*lead, 6, generator=gen, dtype=DT),
        )
        if with_hx
        else None
    )
    want = ref(x, hx)
    got = ours(x, hx)
    torch.testing.assert_close(got[0], want[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(got[1], want[1], rtol=1e-10, atol=1e-12)
