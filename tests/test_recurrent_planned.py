"""The LN-LSTM's planned training calls (layernorm.recurrent._planned) against the fused path.

A planned call runs the same kernels on the same arguments as the fused path's node, so the two
must agree bit for bit: outputs, final states and every gradient. Each case runs the layer twice
on the same inputs, once with plans and once without, over the options a plan takes (dtypes,
directions, layers, frozen parameters, the projection inside the time loop or before it, the
thread teams) and checks which node ran; the cases a plan does not take run without one. Every
test runs with the C++ node (``csrc_torch/rnn_ops.cpp``, the C++ operators switched on) and
with the Python node (:class:`_planned.PlannedLSTMSequence`, switched off).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence

from kernel_paths import needs_sequence_kernels
from layernorm import LayerNormLSTM
from layernorm.kernels.cpu import rnn_abi, torch_ops
from layernorm.recurrent import _cstep, _fused, _planned
from layernorm.recurrent import layers as recurrent_layers
from test_recurrent_layers import _graph_nodes

pytestmark = needs_sequence_kernels
PLANNED, FUSED = "PlannedLSTMSequenceBackward", "LSTMSequenceBackward"
CPP_PLANNED = "LstmPlannedFn"  # in the C++ node's name, torch::autograd::CppNode<...LstmPlannedFn>


@pytest.fixture(autouse=True, params=["C++ node", "Python node"])
def node(request) -> str:
    """Each test with the C++ training node and with the Python one."""
    cpp = request.param == "C++ node"
    if cpp and not torch_ops.recurrent_nodes():
        pytest.skip("the C++ operators are not built here")
    with torch_ops.switched(cpp):
        yield request.param


def _planned_count(nodes: list[str]) -> int:
    """The planned nodes among ``nodes``, the C++ node's where the operators are on."""
    name = CPP_PLANNED if torch_ops._switch["on"] else PLANNED
    return sum(name in n for n in nodes)


def _model(dtype: torch.dtype, **kw) -> LayerNormLSTM:
    torch.manual_seed(0)
    model = LayerNormLSTM(6, 9, dtype=dtype, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn_like(p)
            p.copy_(1.0 + noise if "ln_weight" in name else noise)
    return model


def _run(model, x, hx, planned: bool, monkeypatch) -> tuple[list[str], list[torch.Tensor | None]]:
    """The nodes of the output and the call's results: output, final states, the gradients of
    the input, the initial states and every parameter (``None`` where not required)."""
    with monkeypatch.context() as mp:
        if not planned:
            mp.setattr(_planned, "lstm_training", lambda *args: None)
        model.zero_grad(set_to_none=True)
        x = x.detach().clone().requires_grad_()
        hx = None if hx is None else tuple(s.detach().clone().requires_grad_() for s in hx)
        out, (h_n, c_n) = model(x, hx)
        weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)
        ((out * weights).sum() + (h_n * h_n).sum() + c_n.sum()).backward()
        grads = [x.grad, *(() if hx is None else (s.grad for s in hx))]
        grads += [p.grad for p in model.parameters()]
        return _graph_nodes(out), [out.detach(), h_n.detach(), c_n.detach(), *grads]


def _assert_same(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> None:
    assert len(a) == len(b)
    for u, v in zip(a, b, strict=True):
        assert (u is None) == (v is None)
        if u is not None:
            assert torch.equal(u, v)


CASES = {
    "float64": ({"dtype": torch.float64}, (5, 4)),
    "float32": ({"dtype": torch.float32}, (5, 4)),
    "bidirectional, two layers": (
        {"dtype": torch.float64, "bidirectional": True, "num_layers": 2},
        (5, 4),
    ),
    "batch_first": ({"dtype": torch.float32, "batch_first": True}, (4, 5)),
    "no torch biases": ({"dtype": torch.float64, "bias": False}, (5, 4)),
    "one step": ({"dtype": torch.float64}, (1, 3)),
    "long": ({"dtype": torch.float32}, (60, 3)),
    # without layer norms: the C++ node's plans alone (the Python node runs the fused path)
    "no layer norms": ({"dtype": torch.float64, "norm": "none"}, (5, 4)),
    "no layer norms, no biases": ({"dtype": torch.float32, "norm": "none", "bias": False}, (6, 3)),
    "no layer norms, two layers both ways": (
        {"dtype": torch.float64, "norm": "none", "bidirectional": True, "num_layers": 2},
        (5, 4),
    ),
}


@pytest.mark.parametrize("in_loop", [True, False], ids=["projection in the loop", "before it"])
@pytest.mark.parametrize("given_state", [True, False], ids=["h0 given", "zero h0"])
@pytest.mark.parametrize("case", list(CASES))
def test_planned_call_equals_the_fused_path(case, given_state, in_loop, monkeypatch) -> None:
    kw, (t, b) = CASES[case]
    # the fused node at one step, which a training call of one step otherwise leaves to the
    # step ops (layers._LEAN_TRAINING_STEPS)
    monkeypatch.setattr(recurrent_layers, "_LEAN_TRAINING_STEPS", {})
    if not in_loop:  # the projection one GEMM before the time loop
        monkeypatch.setattr(_fused, "_LOOP_PROJECTION_TRAINING_ROWS", 1 << 30)
    model = _model(**kw)
    dtype, layers = kw["dtype"], model.num_layers * model.num_directions
    gen = torch.Generator().manual_seed(1)
    x = 0.5 + torch.randn(t, b, 6, generator=gen, dtype=dtype)
    hx = tuple(torch.randn(layers, x.shape[1 - model.batch_first], 9, generator=gen,
                           dtype=dtype) for _ in range(2)) if given_state else None  # fmt: skip
    planned_kind = kw.get("norm") != "none" or torch_ops._switch["on"]
    for _ in range(2):  # a plan made, then kept
        nodes, planned = _run(model, x, hx, True, monkeypatch)
        if planned_kind:
            assert _planned_count(nodes) == layers and FUSED not in nodes
        else:
            assert nodes.count(FUSED) == layers
    nodes, fused = _run(model, x, hx, False, monkeypatch)
    assert nodes.count(FUSED) == layers and _planned_count(nodes) == 0
    _assert_same(planned, fused)


@pytest.mark.parametrize("one_buffer", [True, False], ids=["one kept buffer", "buffers apart"])
def test_planned_call_with_its_buffers_apart(one_buffer, monkeypatch) -> None:
    """Kept buffers past _ONE_BUFFER_BYTES are buffers of their own: the same results."""
    if not one_buffer:
        monkeypatch.setattr(_planned, "_ONE_BUFFER_BYTES", 0)
    model = _model(torch.float64, bidirectional=True)
    x = torch.randn(6, 3, 6, dtype=torch.float64)
    nodes, planned = _run(model, x, None, True, monkeypatch)
    # buffers apart: the Python node (the C++ node's allocations would not reuse the cache's)
    assert sum(PLANNED in n or CPP_PLANNED in n for n in nodes) == 2
    assert one_buffer or PLANNED in nodes
    _, fused = _run(model, x, None, False, monkeypatch)
    _assert_same(planned, fused)


@pytest.mark.parametrize(
    "frozen", ["weight_ih", "ln_", "bias", "weight_hh", "ln_bias"], ids=lambda s: s + " frozen"
)
def test_planned_call_with_frozen_parameters(frozen, monkeypatch) -> None:
    """Gradients only where they are required: a plan is keyed on none of that."""
    model = _model(torch.float64, bidirectional=True)
    for name, p in model.named_parameters():
        p.requires_grad_(frozen not in name)
    x = torch.randn(4, 3, 6, dtype=torch.float64)
    nodes, planned = _run(model, x, None, True, monkeypatch)
    assert _planned_count(nodes) == 2
    _, fused = _run(model, x, None, False, monkeypatch)
    _assert_same(planned, fused)
    frozen_grads = planned[4:]  # output, h_n, c_n, x's gradient, then the parameters'
    assert any(g is None for g in frozen_grads) and any(g is not None for g in frozen_grads)


@pytest.mark.parametrize("threads", [1, 2])
def test_planned_call_on_a_team_of_threads(threads, monkeypatch) -> None:
    """With the grains at 1 the kernels split the batch's rows over a team (two threads)."""
    monkeypatch.setattr(_cstep, "_SEQ_GEMM_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_SEQ_GRAIN", 1)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model(torch.float32, bidirectional=True)
        x = torch.randn(7, 6, 6)
        _, planned = _run(model, x, None, True, monkeypatch)
        _, fused = _run(model, x, None, False, monkeypatch)
    finally:
        torch.set_num_threads(old)
    _assert_same(planned, fused)


def test_graphs_alive_together_keep_their_own_buffers(monkeypatch) -> None:
    """Two forward calls before one backward (a loss over both): each call's kept buffers are
    its own, so both gradients are those of calls made one at a time."""
    model = _model(torch.float64)
    x1, x2 = torch.randn(5, 4, 6, dtype=torch.float64), torch.randn(5, 4, 6, dtype=torch.float64)
    (model(x1)[0].sum() + 2 * model(x2)[0].square().sum()).backward()
    together = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    with monkeypatch.context() as mp:
        mp.setattr(_planned, "lstm_training", lambda *args: None)
        model(x1)[0].sum().backward()
        (2 * model(x2)[0].square().sum()).backward()
    for a, p in zip(together, model.parameters(), strict=True):
        torch.testing.assert_close(a, p.grad, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kw",
    [{"zoneout_hidden": 0.2}, {"recurrent_dropout": 0.3}, {"proj_size": 4},
     {"normalize_cell_state": True}],
    ids=["zoneout", "recurrent dropout", "proj_size", "normalized carry"],
)  # fmt: skip
def test_calls_a_plan_does_not_take_run_on_the_fused_path(kw) -> None:
    model = LayerNormLSTM(6, 9, **kw)
    out, _ = model(torch.randn(4, 3, 6))
    assert _planned_count(_graph_nodes(out)) == 0
    # nor a packed batch of sequences of different lengths, nor a call autograd does not record
    packed = pack_padded_sequence(torch.randn(4, 3, 6), torch.tensor([4, 2, 1]))
    assert _planned_count(_graph_nodes(LayerNormLSTM(6, 9)(packed)[0].data)) == 0
    with torch.no_grad():
        assert LayerNormLSTM(6, 9)(torch.randn(4, 3, 6))[0].grad_fn is None


def test_planned_call_refuses_double_backward() -> None:
    """As the fused path's node: a gradient of its gradients would miss terms (impl='loop')."""
    model = _model(torch.float64)
    out, _ = model(torch.randn(3, 2, 6, dtype=torch.float64))
    assert _planned_count(_graph_nodes(out)) == 1
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(out.square().sum(), [model.weight_hh_l0], create_graph=True)


@pytest.mark.parametrize("how", ["checkpoint", "save_on_cpu"])
def test_planned_call_under_saved_tensor_hooks(how, monkeypatch) -> None:
    """Activation checkpointing (the forward run again in backward) and hooks that move what a
    node saves (``save_on_cpu`` copies it): the gradients of a plain call."""
    from torch.utils.checkpoint import checkpoint

    model = _model(torch.float64, bidirectional=True)
    x = torch.randn(5, 3, 6, dtype=torch.float64)
    _, plain = _run(model, x, None, True, monkeypatch)
    model.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    if how == "checkpoint":
        out, (h_n, c_n) = checkpoint(model, xg, use_reentrant=False)
    else:
        with torch.autograd.graph.save_on_cpu():
            out, (h_n, c_n) = model(xg)
    assert _planned_count(_graph_nodes(out)) == 2
    weights = torch.linspace(-1, 2, out.numel(), dtype=out.dtype).view_as(out)
    ((out * weights).sum() + (h_n * h_n).sum() + c_n.sum()).backward()
    hooked = [
        out.detach(),
        h_n.detach(),
        c_n.detach(),
        xg.grad,
        *(p.grad for p in model.parameters()),
    ]
    _assert_same(hooked, plain)


def test_planned_backward_twice_with_retained_graph() -> None:
    """A retained graph's second backward reads the kept buffers as the first left them (the
    kernels write only the call's scratch): twice the gradients of one."""
    model = _model(torch.float64, bidirectional=True)
    x = torch.randn(5, 3, 6, dtype=torch.float64, requires_grad=True)
    out, _ = model(x)
    assert _planned_count(_graph_nodes(out)) == 2
    loss = out.square().sum()
    loss.backward(retain_graph=True)
    once = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    loss.backward()
    for a, b in zip(once, [*(p.grad for p in model.parameters()), x.grad], strict=True):
        torch.testing.assert_close(2 * a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "routes",
    [(True, False), (False, False), (False, True)],
    ids=["C GEMM", "transposed product", "transposed product swapped"],
)
@pytest.mark.parametrize("input_by_c", [True, False], ids=["C input product", "torch.mm"])
def test_planned_call_on_every_product_route(routes, input_by_c, monkeypatch) -> None:
    """The weights' gradients, the input projection and its gradient by each route the fused
    path can take (the routes' predicates forced, which both nodes consult): the same bits."""
    by_c, swaps = routes
    monkeypatch.setattr(_fused, "weight_grad_by_mm", lambda *args: False)
    monkeypatch.setattr(_cstep, "weight_grad_by_c", lambda *args: by_c)
    monkeypatch.setattr(_cstep, "transposed_product_swaps", lambda *args: swaps)
    monkeypatch.setattr(_cstep, "input_product_by_c", lambda *args: input_by_c)
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_TRAINING_ROWS", 1 << 30)
    _planned._PLANS.clear()  # plans made under other routes
    model = _model(torch.float32, bidirectional=True)
    x = torch.randn(7, 5, 6)
    nodes, planned = _run(model, x, None, True, monkeypatch)
    assert _planned_count(nodes) == 2
    _, fused = _run(model, x, None, False, monkeypatch)
    _assert_same(planned, fused)
    _planned._PLANS.clear()


def test_bound_struct_template_packs_as_pack() -> None:
    """A struct filled from :meth:`BoundStruct.template` (the C++ node's way) holds the bytes of
    :meth:`BoundStruct.pack` for the same call: every per-call field and block at its place."""
    x, h0 = torch.randn(12, 6), torch.randn(3, 9)
    plan = _planned._build(x, h0, torch.randn(36, 9), torch.randn(36, 6), 4, False, 1e-5, True, 0)
    kept = torch.empty(plan.kept_numel)
    values = {"kept": kept, "gx": None, "h": h0.clone(), "c": h0.clone(),
              "out": torch.empty(12, 9), **plan.defaults}  # fmt: skip
    packed = plan.forward.pack(values)
    template, slots = plan.forward.template()
    filled = bytearray(template)
    for name, offset, add, required in slots:
        if add < 0:
            filled[offset : offset + 4] = int(values[name]).to_bytes(4, "little", signed=True)
            continue
        v = values.get(name)
        assert v is not None or not required
        address = 0 if v is None else v.data_ptr() + add
        filled[offset : offset + 8] = address.to_bytes(8, "little")
    assert bytes(filled) == bytes(packed)
    assert {name for name, *_ in slots} >= {"kept", "h", "c", "out", "w1", "b0"}
    seq_template, seq_slots = plan.forward_sequence.template()
    assert ("threads", -1) in {(name, add) for name, _, add, _ in seq_slots}
    assert len(seq_template) == len(bytes(rnn_abi.structure(rnn_abi.SEQ_FWD, torch.float32)()))


def test_cpp_node_checks_its_arguments(node) -> None:
    """At the C++ boundary: a tensor of the wrong shape or dtype is refused naming what was
    expected and what came; a plan of the wrong parts is refused when made."""
    if node != "C++ node":
        pytest.skip("the C++ node's own checks")
    model = _model(torch.float32)
    x = torch.randn(5, 4, 6, requires_grad=True)
    model(x)[0].sum().backward()
    plan = next(p.node for p in _planned._PLANS.values() if p.node is not None)
    h0 = torch.zeros(4, 9)
    args = [model.weight_hh_l0, None, None, None, None, None, None, model.weight_ih_l0, None, None]
    expected = r"expected x to be a Float CPU tensor of shape \[20, 6\]"
    with pytest.raises(RuntimeError, match=expected):
        torch_ops.lstm_planned(torch.randn(20, 7), h0, h0, *args, plan)
    with pytest.raises(RuntimeError, match="expected h0"):
        torch_ops.lstm_planned(torch.randn(20, 6), h0.double(), h0, *args, plan)
    with pytest.raises(RuntimeError, match="both of torch's biases"):
        torch_ops.lstm_planned(torch.randn(20, 6), h0, h0, *args[:-2], model.bias_ih_l0, None, plan)
    refusals = {"double_backward": "no", "batched_backward": "no"}
    with pytest.raises(RuntimeError, match="a plan takes"):
        torch_ops.lstm_plan([], [], [], [0, 0, 0, 0], {}, [], refusals)
    # the settings by name: every one of the node's, no other
    settings = plan.settings()
    assert settings["rows"] == 20 and settings["hidden"] == 9 and settings["layer_norm"] == 1
    structs = [torch.zeros(8, dtype=torch.uint8)] * 8
    ones = [torch.ones(3)] * 6
    with pytest.raises(RuntimeError, match="a plan's settings lack rows"):
        lacking = {k: v for k, v in settings.items() if k != "rows"}
        torch_ops.lstm_plan(structs, [], [], [1, 1, 0, 0], lacking, ones, refusals)
    with pytest.raises(RuntimeError, match="takes the 16 settings of kConfigNames, got 17"):
        torch_ops.lstm_plan(structs, [], [], [1, 1, 0, 0], {**settings, "row": 20}, ones,
                            refusals)  # fmt: skip
    with pytest.raises(RuntimeError, match="its backward's refusals"):
        torch_ops.lstm_plan(structs, [], [], [1, 1, 0, 0], settings, ones, {})
    with pytest.raises(RuntimeError, match="lies outside its struct"):
        torch_ops.lstm_plan(structs, ["h"], [0, 8, 0, 1], [1, 1, 0, 0], settings, ones, refusals)
    with pytest.raises(RuntimeError, match="count field step is no value a call gives"):
        torch_ops.lstm_plan(structs, ["step"], [0, 0, -1, 1], [1, 1, 0, 0], settings, ones,
                            refusals)  # fmt: skip
    # without gradients the operator runs the forward alone: the node's forward results
    with torch.no_grad():
        data = torch.randn(20, 6)
        bare = torch_ops.lstm_planned(data, h0, h0, *args, plan)
    recorded = torch_ops.lstm_planned(data, h0, h0, *args, plan)
    assert recorded[0].grad_fn is not None and bare[0].grad_fn is None
    for a, b in zip(bare, recorded, strict=True):
        assert torch.equal(a, b.detach())


def test_weights_past_the_node_limit_keep_the_python_node(monkeypatch) -> None:
    """A signature whose weights' gradients pass _NODE_MAX_WEIGHT_BYTES runs the Python node
    (buffers of the cache), one within it the C++ node where the operators are on."""
    model = _model(torch.float64)
    x = torch.randn(5, 4, 6, dtype=torch.float64)
    monkeypatch.setattr(_planned, "_NODE_MAX_WEIGHT_BYTES", 36 * 9 * 8 - 1)  # W_hh's, one short
    _planned._PLANS.clear()
    nodes, past = _run(model, x, None, True, monkeypatch)
    assert PLANNED in nodes
    monkeypatch.setattr(_planned, "_NODE_MAX_WEIGHT_BYTES", 36 * 9 * 8)
    _planned._PLANS.clear()
    nodes, within = _run(model, x, None, True, monkeypatch)
    assert (CPP_PLANNED if torch_ops._switch["on"] else PLANNED) in "".join(nodes)
    _assert_same(past, within)
    _planned._PLANS.clear()
