"""Inference plans: a recurrent layer's inference call (no gradient to record, the C sequence
kernels) keeps its checked kernel structs and per-step buffers, and the next call with the same
shapes, schedule and parameters runs them again with its own input, initial state and a new output
(``_fused.InferencePlan``). It runs the same kernel on the same struct values, so its results
equal, bit for bit, those of a call that builds everything afresh (a copy of the layer has no
plan). Anything the plan was built from that changes (a parameter updated in place or replaced,
the shapes, the steps of a packed input, the thread count, the kernel target) makes the next call
build a new one.
"""

from __future__ import annotations

import copy
import pickle
import threading

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

from kernel_paths import needs_sequence_kernels
from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.kernels.cpu import targets
from layernorm.recurrent import _cstep, _fused, layers

pytestmark = needs_sequence_kernels
LAYERS = {"lstm": LayerNormLSTM, "gru": LayerNormGRU, "rnn": LayerNormRNN}
# A parameter of the hidden side's layer norm and one of the input side's, per kind (the Elman
# RNN has one layer norm, of the sum of both sides).
LN_PARAMS = {
    "lstm": ("ln_weight_hh_l0", "ln_bias_ih_l0"),
    "gru": ("ln_weight_hh_l0", "ln_bias_ih_l0"),
    "rnn": ("ln_weight_l0", "ln_bias_l0"),
}


@pytest.fixture(autouse=True)
def _elman_steps_by_plans(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-step call of a one-layer LN-RNN runs the cell's ops before any plan
    (``LayerNormRNN._inference_step``, tested in test_recurrent_layers.py): off here, where the
    plans are what is tested."""
    monkeypatch.setattr(LayerNormRNN, "_inference_step", lambda *args: None)


def _model(kind: str, dtype: torch.dtype = torch.float32, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LAYERS[kind](6, 13, dtype=dtype, **kw).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "ln_weight" in name else 0.0) + 0.3 * torch.randn_like(p))
    return model


def _flat(result) -> list[torch.Tensor]:
    out, states = result
    return [out, *(states if isinstance(states, tuple) else (states,))]


def _fresh(model: torch.nn.Module, *args) -> list[torch.Tensor]:
    """What ``model`` returns when nothing is kept: a copy of it has no plan."""
    with torch.no_grad():
        return _flat(copy.deepcopy(model)(*args))


def _planned(model: torch.nn.Module, *args) -> list[torch.Tensor]:
    with torch.no_grad():
        return _flat(model(*args))


def _plans(model: torch.nn.Module) -> dict:
    return layers._INFERENCE_PLANS.get(model, {})


def _runs(monkeypatch) -> list[int]:
    """Count the calls that ran a kept plan."""
    runs: list[int] = []
    run = _fused.InferencePlan.run

    def counted(self, *args):
        runs.append(1)
        return run(self, *args)

    monkeypatch.setattr(_fused.InferencePlan, "run", counted)
    return runs


def _exactly(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize(
    ("steps", "batch", "options"),
    [
        (1, 1, {}),  # a decoder's token
        (1, 3, {"num_layers": 2}),
        (4, 2, {"bidirectional": True}),
        (3, 5, {"batch_first": True, "num_layers": 2, "bidirectional": True}),
        (30, 5, {}),  # past _LOOP_PROJECTION_ROWS: the projection inside the time loop
        (3, 2, {"bias": False}),  # no bias to fold: the kernel's zeros stay
        (3, 2, {"bias": False, "norm": "none"}),
    ],
)
def test_a_kept_plan_returns_what_a_fresh_call_does(
    kind, dtype, steps, batch, options, monkeypatch
) -> None:
    model = _model(kind, dtype, **options)
    runs = _runs(monkeypatch)
    gen = torch.Generator().manual_seed(2)
    shape = (batch, steps, 6) if options.get("batch_first") else (steps, batch, 6)
    directions = model.num_layers * model.num_directions
    for call in range(3):
        x = torch.randn(*shape, generator=gen, dtype=dtype)
        h0 = torch.randn(directions, batch, 13, generator=gen, dtype=dtype)
        hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
        args = (x,) if call == 0 else (x, hx)  # zeros, then given states
        _exactly(_planned(model, *args), _fresh(model, *args))
    assert len(runs) == 2 * directions  # the first call built the plans, the next two ran them
    assert len(_plans(model)) == directions


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_few_rows_of_a_large_projection_run_it_before_the_loop(kind, monkeypatch) -> None:
    """With gx computed before the time loop (here every W_ih counts as large), the plan computes
    it from each call's input."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_WEIGHT", 0)
    model = _model(kind)
    runs = _runs(monkeypatch)
    for seed in range(3):
        x = torch.randn(2, 3, 6, generator=torch.Generator().manual_seed(seed))
        _exactly(_planned(model, x), _fresh(model, x))
    assert len(runs) == 2
    ((_, plan),) = _plans(model).values()
    assert not plan.in_loop


@pytest.fixture
def packed_one_step():
    """Float32 steps of one step pack their weights as every other call does (no MKL sgemm
    inside the sequence kernel, which takes such a step where PyTorch has it: the one-step tests
    of test_recurrent_cseq.py); afterwards the processor's default again."""
    from layernorm.kernels.cpu import rnn

    rnn.use_one_step_gemm("packed")
    try:
        yield
    finally:
        rnn.use_one_step_gemm(None)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_one_step_of_a_batch_runs_torch_gemm_then_the_step_kernel(
    kind, dtype, monkeypatch, packed_one_step
) -> None:
    """One step of more rows than the direct GEMM takes, its projection before the loop: the
    recurrent GEMM by torch.mm and the C step kernel (_cstep.StepCall), kept in the plan, which
    reads W_hh where it is (an update in place is seen); the results are the step-by-step
    reference's (torch's GEMM taken as fast as the C GEMM: see the test below)."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_WEIGHT", 0)
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: False)
    model = _model(kind, dtype)
    reference = LAYERS[kind](6, 13, dtype=dtype, impl="loop").eval()
    reference.load_state_dict(model.state_dict())
    runs = _runs(monkeypatch)
    gen = torch.Generator().manual_seed(3)
    batch = _cstep.direct_rows() + 3
    for call in range(3):
        x = torch.randn(1, batch, 6, generator=gen, dtype=dtype)
        h0 = torch.randn(1, batch, 13, generator=gen, dtype=dtype)
        hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
        if call == 2:
            with torch.no_grad():
                model.weight_hh_l0.mul_(0.5)
                reference.weight_hh_l0.mul_(0.5)
        got = _planned(model, x, hx)
        _exactly(got, _fresh(model, x, hx))
        with torch.no_grad():
            want = _flat(reference(x, hx))
        tol = {"atol": 1e-12, "rtol": 1e-12} if dtype == torch.float64 else {}
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, **tol)
    assert len(runs) == 2
    ((_, plan),) = _plans(model).values()
    assert isinstance(plan.call, _cstep.StepCall) and not plan.in_loop


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("outpaces", [True, False], ids=["C GEMM faster", "torch GEMM as fast"])
def test_one_step_of_many_rows_runs_the_sequence_kernel_where_its_gemm_is_faster(
    kind, outpaces, monkeypatch, packed_one_step
) -> None:
    """One step of at least ``_ONE_STEP_TILE_MIN_ROWS`` rows runs the sequence kernel (its own
    GEMM) where the C GEMM outpaces torch's, and torch.mm with the step kernel elsewhere; the
    results are the step-by-step reference's either way."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_WEIGHT", 0)
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: outpaces)
    batch = _cstep.direct_rows() + 3
    monkeypatch.setattr(_fused, "_ONE_STEP_TILE_MIN_ROWS", batch)
    model = _model(kind)
    reference = LAYERS[kind](6, 13, impl="loop").eval()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, batch, 6, generator=gen)
    h0 = torch.randn(1, batch, 13, generator=gen)
    hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
    got = _planned(model, x, hx)
    with torch.no_grad():
        want = _flat(reference(x, hx))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)
    ((_, plan),) = _plans(model).values()
    assert isinstance(plan.call, _cstep.StepCall) == (not outpaces)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_one_step_of_a_batch_with_zoneout_by_torch_gemm(kind, monkeypatch) -> None:
    """Zoneout at eval (its constant coefficients) in that one step: the step kernel takes the
    masks, the results are the step-by-step reference's (no plan is kept with masks)."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_WEIGHT", 0)
    calls: list[int] = []
    by_steps = _cstep.by_steps
    monkeypatch.setattr(_cstep, "by_steps", lambda *a: calls.append(1) or by_steps(*a))
    zoneout = {"zoneout_hidden": 0.3, **({"zoneout_cell": 0.2} if kind == "lstm" else {})}
    model = _model(kind, torch.float64, **zoneout)
    reference = LAYERS[kind](6, 13, dtype=torch.float64, impl="loop", **zoneout).eval()
    reference.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(4)
    batch = _cstep.direct_rows() + 2
    x = torch.randn(1, batch, 6, generator=gen, dtype=torch.float64)
    h0 = torch.randn(1, batch, 13, generator=gen, dtype=torch.float64)
    hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
    with torch.no_grad():
        got, want = _flat(model(x, hx)), _flat(reference(x, hx))
    assert calls == [1]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_results_are_new_tensors_every_call(kind) -> None:
    """A call's output and states are its own: the next call writes into none of them."""
    model = _model(kind)
    x1, x2 = torch.randn(2, 1, 3, 6).unbind(0)
    first = _planned(model, x1)
    kept = [t.clone() for t in first]
    second = _planned(model, x2)
    _exactly(first, kept)
    for a, b in zip(first, second, strict=True):
        assert a.data_ptr() != b.data_ptr()


# Values changed where they are: the plan runs again and reads them (the one value folded from
# parameters, the input side's bias, is passed again each call; fused Adam and writes through
# .data leave the version counters as they were).
VALUE_CHANGES = ["in place", "through .data", "fused Adam", "SGD", "load_state_dict"]
# What the plan's key holds: a new one is built.
KEY_CHANGES = ["new parameter", "eps", "nonlinearity", "shape", "threads"]


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("change", VALUE_CHANGES + KEY_CHANGES)
@pytest.mark.parametrize("projection", ["in the loop", "before it"])
def test_what_a_plan_was_built_from_changes_and_the_next_call_sees_it(
    kind, change, projection, monkeypatch
) -> None:
    if projection == "before it":
        monkeypatch.setattr(_fused, "_LOOP_PROJECTION_WEIGHT", 0)
    model = _model(kind)
    x = torch.randn(3, 2, 6, generator=torch.Generator().manual_seed(3))
    _planned(model, x)
    _planned(model, x)  # runs the plan
    hidden_ln, input_ln = (getattr(model, name) for name in LN_PARAMS[kind])
    if change == "nonlinearity" and kind != "rnn":
        pytest.skip("the Elman RNN's setting")
    if change == "in place":
        with torch.no_grad():
            model.bias_ih_l0.mul_(0.5)
            hidden_ln.mul_(0.5)
    elif change == "through .data":
        model.bias_hh_l0.data.add_(1.0)
        input_ln.data.add_(1.0)
    elif change in ("fused Adam", "SGD"):
        out, _ = model(x)
        out.square().sum().backward()
        opt = (
            torch.optim.Adam(model.parameters(), lr=0.1, fused=True)
            if change == "fused Adam"
            else torch.optim.SGD(model.parameters(), lr=0.1)
        )
        opt.step()
    elif change == "load_state_dict":
        state = {k: v + 0.25 for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    elif change == "new parameter":
        model.bias_hh_l0 = torch.nn.Parameter(model.bias_hh_l0.detach() + 1.0)
    elif change == "eps":
        model.eps = 0.5
    elif change == "nonlinearity":  # a setting the kernel structs hold
        model.nonlinearity = "relu"
    elif change == "shape":
        x = torch.cat([x, x[:1]])  # another step
    else:
        threads = torch.get_num_threads()
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    runs = _runs(monkeypatch)
    _exactly(_planned(model, x), _fresh(model, x))
    assert (runs == []) == (change in KEY_CHANGES)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_packed_inputs_of_other_lengths_but_as_many_rows_get_their_own_schedule(kind) -> None:
    model = _model(kind)
    gen = torch.Generator().manual_seed(4)
    for lengths in ([4, 2], [3, 3], [5, 1]):  # six rows of two sequences each time
        xs = [torch.randn(n, 6, generator=gen) for n in lengths]
        packed = pack_sequence(xs, enforce_sorted=False)
        got, want = _planned(model, packed), _fresh(model, packed)
        _exactly(got[1:], want[1:])
        _exactly([got[0].data], [want[0].data])


def test_another_kernel_target_builds_its_own_plan(monkeypatch) -> None:
    model = _model("lstm")
    x = torch.randn(2, 2, 6)
    _planned(model, x)
    other = next((n for n in targets.available() if n != targets.selected().name), None)
    if other is None:
        pytest.skip("this CPU runs one kernel target")
    runs = _runs(monkeypatch)
    with targets.use(other):
        if not _cstep.sequence_gemm():
            pytest.skip(f"target {other} has no whole-sequence path")
        _exactly(_planned(model, x), _fresh(model, x))
    assert runs == []


def test_gradients_and_training_keep_no_plan(monkeypatch) -> None:
    model = _model("gru")
    x = torch.randn(3, 2, 6, requires_grad=True)
    model(x)[0].sum().backward()  # recorded: the training node, no plan
    assert _plans(model) == {}
    model.train()
    model.zoneout_hidden = 0.1  # masks: never kept
    with torch.no_grad():
        model(x)
    assert _plans(model) == {}


def test_a_layer_with_a_plan_copies_and_pickles_without_it() -> None:
    model = _model("lstm")
    x = torch.randn(2, 2, 6)
    want = _planned(model, x)
    assert _plans(model)
    for other in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert _plans(other) == {}
        _exactly(_planned(other, x), want)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_threads_sharing_a_layer_each_get_their_own_results(kind) -> None:
    """A plan runs one call at a time; a call that finds it busy takes the ordinary path."""
    model = _model(kind)
    gen = torch.Generator().manual_seed(5)
    inputs = [torch.randn(4, 2, 6, generator=gen) for _ in range(4)]
    wants = [_fresh(model, x) for x in inputs]
    _planned(model, inputs[0])
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            for _ in range(30):
                _exactly(_planned(model, inputs[i]), wants[i])
        except BaseException as err:  # reported by the main thread
            errors.append(err)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_a_plan_never_writes_into_what_the_call_that_built_it_returned(kind) -> None:
    """The call that builds a plan returns its final states straight from the kernel's state
    buffers; the plan runs on copies of them."""
    model = _model(kind)
    gen = torch.Generator().manual_seed(6)
    data, data2 = torch.randn(2, 8, 6, generator=gen).unbind(0)
    h0, c0 = torch.randn(2, 2, 13, generator=gen).unbind(0)
    c0 = c0 if kind == "lstm" else None
    with torch.no_grad():
        first = model._direction(data, [2] * 4, "_l0", False, h0, c0)
    returned = [t.clone() for t in first if t is not None]
    ((_, plan),) = _plans(model).values()

    def fold(out):
        return model._input_bias("_l0", model.bias_ih_l0, model.bias_hh_l0, model._get, out)

    with torch.no_grad():
        again = plan.run(data2, h0 + 1.0, None if c0 is None else c0 - 1.0, fold)
    _exactly([t for t in first if t is not None], returned)
    assert not torch.equal(again[1], first[1])


# ------------------------------------------------------------------------------ planned calls


def _planned_calls(monkeypatch) -> list[bool]:
    """Per call that found a planned call (``layers._CallPlan``): whether it was taken."""
    taken: list[bool] = []
    run = layers._CallPlan.run

    def counted(self, *args):
        result = run(self, *args)
        taken.append(result is not None)
        return result

    monkeypatch.setattr(layers._CallPlan, "run", counted)
    return taken


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize(
    ("shape", "options", "states"),
    [
        ((1, 1, 6), {}, "zeros"),  # a decoder's token
        ((1, 1, 6), {}, "given"),
        ((4, 6), {}, "given"),  # unbatched
        ((4, 6), {}, "zeros"),
        ((2, 3, 6), {"batch_first": True, "num_layers": 2, "bidirectional": True}, "given"),
        ((3, 2, 6), {"num_layers": 2, "dropout": 0.5}, "zeros"),  # eval: no dropout
    ],
)
def test_a_planned_call_returns_what_the_full_call_does(
    kind, shape, options, states, monkeypatch
) -> None:
    """Once an inference call has run every direction by a kept plan (the second call), a call
    of the same signature runs the plans straight away, and returns, bit for bit, what a call
    that builds everything does."""
    model = _model(kind, **options)
    taken = _planned_calls(monkeypatch)
    gen = torch.Generator().manual_seed(5)
    n_states = model.num_layers * model.num_directions
    state_shape = (
        (n_states, 13) if len(shape) == 2 else (n_states, shape[0 if model.batch_first else 1], 13)
    )
    for _ in range(4):
        x = torch.randn(*shape, generator=gen)
        hx = None
        if states == "given":
            h0 = torch.randn(*state_shape, generator=gen)
            hx = (h0, torch.randn_like(h0)) if kind == "lstm" else h0
        _exactly(_planned(model, x, hx), _fresh(model, x, hx))
    assert taken == [True, True]


def _write(model: torch.nn.Module, change: str) -> None:
    if change == "batch_first":
        model.batch_first = True
    elif change == "train":
        model.train()
    elif change == "normalize_cell_state":
        model.normalize_cell_state = True
    elif change == "impl":
        model.impl = "loop"
    elif change == "parameter moved":
        model.bias_hh_l0.data = model.bias_hh_l0.data.clone() + 1.0
    elif change == "dtype":
        model.double()


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize(
    "change",
    ["batch_first", "train", "normalize_cell_state", "impl", "parameter moved", "dtype"],
)
def test_a_setting_written_or_a_parameter_moved_ends_the_planned_call(
    kind, change, monkeypatch
) -> None:
    """Anything the planned call's signature holds (a setting written, ``train()``, a parameter's
    address or dtype) makes the next call the full one, with its results."""
    if change == "normalize_cell_state" and kind != "lstm":
        pytest.skip("an LSTM option")
    model = _model(kind)
    x = torch.randn(3, 3, 6, generator=torch.Generator().manual_seed(6))
    _planned(model, x)
    _planned(model, x)  # runs the kept plans: the call is planned
    taken = _planned_calls(monkeypatch)
    _write(model, change)
    y = x.double() if change == "dtype" else x
    _exactly(_planned(model, y), _fresh(model, y))
    assert taken == [False]


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_parameter_cut_in_place_is_refused_after_a_planned_call(kind) -> None:
    """A parameter shortened through ``.data`` (its address kept) is refused as without a plan,
    not read past its end."""
    model = _model(kind)
    x = torch.randn(1, 1, 6)
    _planned(model, x)
    _planned(model, x)
    model.ln_bias_ih_l0.data = model.ln_bias_ih_l0.data[:-1]
    with pytest.raises(ValueError, match="ln_bias_ih_l0"):
        _planned(model, x)


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_no_planned_call_with_gradients_a_list_state_or_a_trace(kind, monkeypatch) -> None:
    """Gradients on, a list of states, or a tracer (``make_fx``): the full call, its results."""
    from torch.fx.experimental.proxy_tensor import make_fx

    model = _model(kind)
    x = torch.randn(2, 1, 6)
    h0 = torch.randn(1, 1, 13)
    hx = [h0, torch.randn_like(h0)] if kind == "lstm" else h0
    _planned(model, x, hx)
    _planned(model, x, hx)
    taken = _planned_calls(monkeypatch)
    _exactly(_planned(model, x, hx), _fresh(model, x, hx))
    out, _ = model(x, hx)  # gradients on: recorded
    assert out.grad_fn is not None
    with torch.no_grad():
        traced = make_fx(lambda t: model(t, hx)[0])(x)
    torch.testing.assert_close(traced(x), _fresh(model, x, hx)[0])
    if kind == "lstm":
        assert layers._CALL_PLANS.get(model) is None  # a list of states is never planned
    else:
        assert taken == [True, False, False]


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_a_kept_plan_can_leave_out_the_final_hidden_state(kind) -> None:
    """A cell's step asks its plan for no copy of ``h_n`` (the step's output is ``h_n``): the plan
    then returns ``None`` in its place, and the output and ``c_n`` it returns with it."""
    model = _model(kind)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(1, 3, 6, generator=gen)
    _planned(model, x)  # builds the plan of a one-step call of 3 rows
    ((_, (_, plan)),) = _plans(model).items()
    rows = torch.randn(3, 6, generator=gen)
    h0 = torch.randn(3, 13, generator=gen)
    c0 = torch.randn(3, 13, generator=gen) if kind == "lstm" else None
    with torch.no_grad():
        full = model._run_kept(plan, rows, h0, c0)
        lean = model._run_kept(plan, rows, h0, c0, final_hidden=False)
    assert full is not None and lean is not None
    assert lean[1] is None
    torch.testing.assert_close(full[1], full[0], rtol=0, atol=0)  # one step: h_n is the output
    _exactly([lean[0]], [full[0]])
    if kind == "lstm":
        _exactly([lean[2]], [full[2]])
    else:
        assert lean[2] is None and full[2] is None


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_a_layer_with_kept_plans_is_freed_when_dropped(kind) -> None:
    """The plans are kept beside the layer by a weak reference to it: nothing a plan holds (its
    bias fold included) may refer back to the layer, or a dropped layer, its plans and their
    buffers would live as long as the process."""
    import gc
    import weakref

    model = _model(kind)
    with torch.no_grad():
        for _ in range(2):
            model(torch.randn(3, 2, 6))
    assert _plans(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_a_cell_with_a_kept_step_is_freed_when_dropped(kind) -> None:
    """As the layers: a cell's kept step (and the one-step layer behind it) keeps no reference
    back to the cell."""
    import gc
    import weakref

    from layernorm import LayerNormGRUCell, LayerNormLSTMCell
    from layernorm.recurrent import cells

    cell = {"lstm": LayerNormLSTMCell, "gru": LayerNormGRUCell}[kind](6, 13)
    with torch.no_grad():
        for _ in range(2):
            cell(torch.randn(2, 6))
    assert cells._STEP_PLANS.get(cell) is not None
    ref = weakref.ref(cell)
    del cell
    gc.collect()
    assert ref() is None
