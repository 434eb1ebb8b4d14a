"""The recurrent layers' inference path: when autograd will not differentiate a direction
(``torch.no_grad()``, or nothing requires grad), the whole-sequence C kernels run with per-row
buffers of the batch's rows only, overwritten every step, and no autograd node.

It runs the same step kernels in the same order as the training path, only writing the kept values
to other addresses. The difference is the input side ``gx = LN(x W_ihᵀ)``: the training path
computes it for all rows (torch's GEMM, the norm kernels), the inference path step by step inside
the C time loop (the sequence kernel's GEMM, the step kernels' layer norm): the same sums in
another order, so results agree to rounding carried through the steps (:data:`TOL`). Where the
time loop does not project the inputs (a W_ih too large for it, zoneout of torch.nn.LSTM's
projected h), ``gx`` is computed before the loop a chunk of rows at a time, or whole with torch's
``layer_norm`` up to ``_fused._NATIVE_BYTES``. The tests also check that the training node is not
entered, and that the C boundary refuses kept buffers of any other row count.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

from kernel_paths import HAS_SEQUENCE_KERNELS, needs_sequence_kernels, spy_projected_calls
from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.kernels.cpu import rnn
from layernorm.recurrent import _cstep, _fused, _planned
from tolerances import assert_close_to_rounding

pytestmark = needs_sequence_kernels
LAYERS = {"lstm": LayerNormLSTM, "gru": LayerNormGRU, "rnn": LayerNormRNN}
# the training nodes of each kind (the LSTM's: the fused path's, and its planned calls')
NODES = {
    "lstm": (_fused.LSTMSequence, _planned.PlannedLSTMSequence),
    "gru": (_fused.GRUSequence,),
    "rnn": (_fused.RNNSequence,),
}
# Both paths' input sides round differently (another summation order, a few ulp of the compute
# dtype), carried through up to 53 steps; bfloat16 layers compute in float32 and round their
# results to bfloat16, where such a difference can move a value by one bfloat16 ulp (2^-8..2^-7).
TOL = {
    torch.float64: {"rtol": 1e-12, "atol": 1e-13},
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 2**-7, "atol": 1e-6},
    torch.float16: {"rtol": 2**-10, "atol": 1e-6},
}


def _model(kind: str, dtype: torch.dtype, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LAYERS[kind](6, 13, dtype=dtype, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn_like(p)
            p.copy_(1.0 + noise if "ln_weight" in name else noise)
    return model


def _inputs(dtype: torch.dtype, packed: bool, batch: int = 5):
    gen = torch.Generator().manual_seed(1)
    lengths = [6 - (i % 4) for i in range(batch)] if packed else [6] * batch
    xs = [0.5 + torch.randn(n, 6, generator=gen, dtype=dtype) for n in lengths]
    return pack_sequence(xs, enforce_sorted=False) if packed else torch.stack(xs, 1)


def _flat(result) -> list[torch.Tensor]:
    out, states = result
    states = states if isinstance(states, tuple) else (states,)
    return [out.data if hasattr(out, "batch_sizes") else out, *states]


def _double(inputs):
    """``inputs`` (a tensor or a PackedSequence) in float64."""
    if hasattr(inputs, "batch_sizes"):
        return inputs._replace(data=inputs.data.double())
    return inputs.double()


def _inferred_by_teams(monkeypatch, call):
    """``call()``'s results under ``no_grad`` with 1 and 2 threads, the sequence kernels' grains
    1 (a team of two threads wherever a step has two rows)."""
    monkeypatch.setattr(_cstep, "_SEQ_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_SEQ_GEMM_GRAIN", 1)
    results = []
    for threads in (1, 2):
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            with torch.no_grad():
                results.append(call())
        finally:
            torch.set_num_threads(before)
    return results


def _refuse(*args, **kwargs):
    raise AssertionError("the training node ran in inference")


def _forbid_training_node(monkeypatch, kind: str) -> None:
    for node in NODES[kind]:
        monkeypatch.setattr(node, "apply", _refuse)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("norm", ["layer", "none"])
@pytest.mark.parametrize("packed", [False, True])
def test_no_grad_equals_the_training_path(kind, norm, packed, dtype, monkeypatch) -> None:
    model = _model(kind, dtype, norm=norm, bidirectional=True, num_layers=2)
    x = _inputs(dtype, packed)
    trained = [t.detach() for t in _flat(model(x))]
    assert trained[0].dtype == dtype
    _forbid_training_node(monkeypatch, kind)
    with torch.no_grad():
        inferred = _flat(model(x))
    for a, b in zip(inferred, trained, strict=True):
        assert not a.requires_grad
        torch.testing.assert_close(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize(("steps", "batch"), [(1, 1), (3, 1), (1, 2), (1, 8)])
@pytest.mark.parametrize("large_w_ih", [False, True])
def test_decoder_steps_equal_the_training_path(
    kind, steps, batch, large_w_ih, dtype, monkeypatch
) -> None:
    """A token at a time (one step of up to ``direct_rows`` rows: the weights read as stored, one
    row of the input by a GEMV of DOT_WIDE rows of W at a time, 4 H or 3 H = 52 or 39 columns,
    not a multiple of it; the projection inside the loop even where W_ih counts as large, here
    every W_ih) and a few steps of one row."""
    if large_w_ih:
        monkeypatch.setattr(_fused, "_LOOP_PROJECTION_MAX_BYTES", 0)
    model = _model(kind, dtype)
    x = _inputs(dtype, packed=False, batch=batch)[:steps]
    trained = [t.detach() for t in _flat(model(x))]
    _forbid_training_node(monkeypatch, kind)
    with torch.no_grad():
        inferred = _flat(model(x))
    for a, b in zip(inferred, trained, strict=True):
        torch.testing.assert_close(a, b, **TOL[dtype])
    one_step = steps * batch <= min(batch, _cstep.direct_rows())
    assert _fused._projects_in_loop(_fused.InputProjection(
        x.reshape(-1, 6), model.weight_ih_l0, None, None, 1e-5, True), batch) == (
        one_step or not large_w_ih)  # fmt: skip


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("norm", ["layer", "none"])
@pytest.mark.parametrize("packed", [True, False], ids=["ragged", "equal lengths"])
def test_inference_projects_the_inputs_inside_the_time_loop(
    kind, norm, packed, monkeypatch
) -> None:
    """Under no_grad the input side is never computed for all rows: the C sequence kernel
    projects each step's rows (here with 1 and 2 threads: the team shares each step of ragged
    sequences, and splits sequences of equal lengths by batch rows)."""
    model = _model(kind, torch.float32, norm=norm, num_layers=2)
    x = _inputs(torch.float32, packed=packed)
    ref = [t.detach() for t in _flat(model(x))]

    def refuse(self):
        raise AssertionError("gx computed for all rows in inference")

    monkeypatch.setattr(_fused.InputProjection, "compute", refuse)
    for got in _inferred_by_teams(monkeypatch, lambda: _flat(model(x))):
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, **TOL[torch.float32])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_few_rows_of_a_large_projection_compute_gx_before_the_loop(kind, monkeypatch) -> None:
    """Below ``_LOOP_PROJECTION_ROWS`` rows with a W_ih past ``_LOOP_PROJECTION_WEIGHT`` (here
    made 0) gx is computed before the loop (packing W_ih costs more than it saves there); from
    that many rows on, inside it, unless W_ih is past ``_LOOP_PROJECTION_MAX_BYTES`` (then
    every step would read it from memory). The values agree either way."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_WEIGHT", 0)
    model = _model(kind, torch.float32)
    rows = _fused._LOOP_PROJECTION_ROWS
    calls = []
    compute = _fused.InputProjection.compute

    def counted(self):
        calls.append(self.data.shape[0])
        return compute(self)

    for steps in (rows // 5, rows // 5 + 1):  # 5 sequences: just below and past the limit
        x = _inputs(torch.float32, packed=False).repeat(steps // 6 + 1, 1, 1)[:steps]
        ref = [t.detach() for t in _flat(model(x))]
        calls.clear()
        monkeypatch.setattr(_fused.InputProjection, "compute", counted)
        with torch.no_grad():
            got = _flat(model(x))
        monkeypatch.setattr(_fused.InputProjection, "compute", compute)
        assert calls == ([steps * 5] if steps * 5 < rows else [])
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, **TOL[torch.float32])
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_MAX_BYTES", 0)
    monkeypatch.setattr(_fused.InputProjection, "compute", counted)
    calls.clear()
    with torch.no_grad():
        copy.deepcopy(model)(x)  # a copy: the model's kept plan decided before the change
    assert calls == [x.shape[0] * 5]


@pytest.mark.parametrize("outpaced", [False, True], ids=["torch.mm at its rate", "outpaced"])
def test_loop_projects_a_larger_w_ih_where_the_c_gemm_outpaces_torch(outpaced, monkeypatch) -> None:
    """The packed W_ih the time loop projects with is limited to _LOOP_PROJECTION_MAX_BYTES, and
    to _LOOP_PROJECTION_OUTPACED_SCALE times that where the C GEMM outpaces torch.mm: a W_ih
    between the two is projected in the loop only there; one past both, before it."""
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: outpaced)
    limit = _fused._LOOP_PROJECTION_MAX_BYTES
    scale = _fused._LOOP_PROJECTION_OUTPACED_SCALE
    assert scale > 1
    assert _fused.loop_projection_max_bytes() == limit * (scale if outpaced else 1)
    rows = _fused._LOOP_PROJECTION_ROWS * 2
    for w_bytes, in_loop in ((limit * 3 // 2, outpaced), (limit * scale * 5 // 4, False)):
        w_ih = torch.empty(512, w_bytes // (4 * 512))
        source = _fused.InputProjection(torch.empty(rows, w_ih.shape[1]), w_ih, None, None,
                                        1e-5, True)  # fmt: skip
        assert _fused._projects_in_loop(source, 32) == in_loop, w_bytes


@pytest.mark.usefixtures("python_training_node")  # it watches the Python training nodes
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_nothing_requiring_grad_takes_the_inference_path(kind, monkeypatch) -> None:
    """Grad mode on, but neither the parameters nor the input require grad (a frozen model)."""
    model = _model(kind, torch.float64).requires_grad_(False)
    x = _inputs(torch.float64, packed=False)
    ref = _flat(model.requires_grad_(True)(x))
    model.requires_grad_(False)
    _forbid_training_node(monkeypatch, kind)
    assert torch.is_grad_enabled()
    for a, b in zip(_flat(model(x)), ref, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float64])
    # an input that requires grad needs the node again
    with pytest.raises(AssertionError, match="training node ran"):
        model(x.clone().requires_grad_())


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
def test_inference_with_masks_in_eval_and_in_training(kind) -> None:
    """Zoneout (eval: the expectation, a dense coefficient) and recurrent dropout (training, the
    same seeded draw on both paths) reach the inference kernels as they reach the training ones
    (the Elman RNN has zoneout only)."""
    extra = {"zoneout_cell": 0.2} if kind == "lstm" else {}
    if kind != "rnn":
        extra["recurrent_dropout"] = 0.25
    model = _model(kind, torch.float64, zoneout_hidden=0.3, **extra)
    x = _inputs(torch.float64, packed=True)
    for training in (False, True):
        model.train(training)
        torch.manual_seed(7)
        ref = [t.detach() for t in _flat(model(x))]
        torch.manual_seed(7)
        with torch.no_grad():
            got = _flat(model(x))
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, **TOL[torch.float64])


@pytest.mark.parametrize("zoneout", [0.0, 0.3])
def test_projection_runs_in_the_time_loop_without_the_node(zoneout, monkeypatch) -> None:
    """torch.nn.LSTM's projection in inference: no training node, kept buffers of the batch's
    rows, the training path's result. The LSTM's sequence kernel computes it in its time loop
    (to rounding: its GEMM sums in another order than torch.mm); with zoneout of h at eval
    (its expectation, acting on the projected h) the per-step C calls run with the projection
    between them, exactly where the projection before the loop takes the norm kernels in both
    (above ``_NATIVE_BYTES`` in inference and ``TORCH_PROJECTION_NUMEL`` in training), to
    rounding where either takes torch's ``layer_norm``. Without the sequence kernels (the
    portable target) the per-step calls run in both cases."""
    model = _model("lstm", torch.float64, proj_size=4, zoneout_hidden=zoneout).eval()
    x = _inputs(torch.float64, packed=True)
    steps: list[int] = []
    by_steps = _cstep.projected_by_steps
    monkeypatch.setattr(
        _cstep,
        "projected_by_steps",
        lambda st, *a: steps.append(st["hp"].shape[0]) or by_steps(st, *a),
    )
    projected_calls = spy_projected_calls(monkeypatch)
    in_loop = zoneout == 0.0 and HAS_SEQUENCE_KERNELS
    exact = TOL[torch.float64] if in_loop else {"rtol": 0, "atol": 0}
    for limit, tol in ((0, exact), (1 << 30, TOL[torch.float64])):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(_fused, "_NATIVE_BYTES", limit)
            mp.setattr(_fused, "TORCH_PROJECTION_NUMEL", limit)
            ref = [t.detach() for t in _flat(model(x))]
            for node in NODES["lstm"]:
                mp.setattr(node, "apply", _refuse)
            with torch.no_grad():
                got = _flat(model(x))
        for a, b in zip(got, ref, strict=True):
            torch.testing.assert_close(a, b, **tol)
    assert steps == ([] if in_loop else [5, 5])  # per step: buffers of the batch's 5 rows
    assert projected_calls == (["lstm_fwd_seq"] * 2 if in_loop else [])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("packed", [True, False], ids=["ragged", "equal lengths"])
@pytest.mark.parametrize(
    "options", [{}, {"bidirectional": True, "num_layers": 2}, {"norm": "none"}],
    ids=["one layer", "two bidirectional layers", "no layer norms"],
)  # fmt: skip
def test_projection_in_the_time_loop_equals_the_training_path(
    options, packed, dtype, monkeypatch
) -> None:
    """torch.nn.LSTM's projection in inference, computed by the LSTM's sequence kernel (the
    projected h its state, the inputs projected in the loop too): the training path's results,
    with 1 and 2 threads (grains of 1: the team shares each step of ragged sequences and splits
    sequences of equal lengths by batch rows), and for a token of two rows (weights as stored).
    float32 to the rounding of the two paths' GEMMs (the C tile or MKL against torch.mm), as
    measured against float64 on the same inputs."""
    model = _model("lstm", dtype, proj_size=5, **options)
    x = _inputs(dtype, packed=packed, batch=10)
    tokens = _inputs(dtype, packed=False, batch=2)[:1]
    refs = [[t.detach() for t in _flat(model(inp))] for inp in (x, tokens)]
    with torch.no_grad():
        double = copy.deepcopy(model).double()
        exacts = [_flat(double(_double(inp))) for inp in (x, tokens)]
    _forbid_training_node(monkeypatch, "lstm")
    projected_calls = spy_projected_calls(monkeypatch)

    def calls():
        return [_flat(model(inp)) for inp in (x, tokens)]

    for got in _inferred_by_teams(monkeypatch, calls):
        for results, ref, exact in zip(got, refs, exacts, strict=True):
            if dtype is torch.float32:
                assert_close_to_rounding(results, ref, exact, **TOL[dtype])
                continue
            for a, b in zip(results, ref, strict=True):
                torch.testing.assert_close(a, b, **TOL[dtype])
    directions = 2 * options.get("num_layers", 1) if options.get("bidirectional") else 1
    assert len(projected_calls) == 2 * 2 * directions  # two calls, two thread counts


def test_inference_state_does_not_alias_the_callers() -> None:
    """The kernels update the state in place: the caller's h_0 / c_0 stay as they were."""
    model = _model("lstm", torch.float64)
    x = _inputs(torch.float64, packed=False)
    h0, c0 = torch.randn(2, 1, 5, 13, dtype=torch.float64).unbind(0)
    before = (h0.clone(), c0.clone())
    with torch.no_grad():
        model(x, (h0, c0))
    assert torch.equal(h0, before[0]) and torch.equal(c0, before[1])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("steps", [25, 53])
def test_input_projection_in_chunks_of_rows_equals_the_whole(steps, dtype, monkeypatch) -> None:
    """Where gx is computed before the time loop in inference (here W_ih counts as too large for
    the loop), the LSTM's LN(W_ih x) runs a chunk of rows at a time (here the smallest chunk, 128
    rows): 125 and 265 rows give one chunk short of full, and two full chunks and a remainder;
    the values are those of one projection of all rows (training), to the GEMM's rounding in
    float32."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_MAX_BYTES", 0)
    chunked: list[int] = []
    by_chunks = _fused.normalized_projection
    monkeypatch.setattr(
        _fused,
        "normalized_projection",
        lambda data, *a, **k: chunked.append(data.shape[0]) or by_chunks(data, *a, **k),
    )
    monkeypatch.setattr(_fused, "_PROJECTION_BYTES", 0)
    monkeypatch.setattr(_fused, "_PROJECTION_BLOCKS_BYTES", 0)
    monkeypatch.setattr(_fused, "_NATIVE_BYTES", 0)  # the chunks whatever the size
    assert _fused._PROJECTION_MIN_ROWS == 128
    model = _model("lstm", dtype, num_layers=2, proj_size=4)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(steps, 5, 6, generator=gen, dtype=dtype)
    ref = [t.detach() for t in _flat(model(x))]
    chunked.clear()
    with torch.no_grad():
        got = _flat(model(x))
        assert chunked == [5 * steps] * 2  # both layers' inputs before their loops
        exact = _flat(copy.deepcopy(model).double()(x.double()))
    assert_close_to_rounding(got, ref, exact, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
@pytest.mark.parametrize("blocks", [None, (26, 13)], ids=["one block", "gru blocks"])
def test_projection_chunks_and_blocks_equal_the_differentiable_one(blocks, dtype, monkeypatch):
    """The inference projection's row chunks (128 rows: two full and a remainder of 9) and the
    GRU's two column blocks, each normalized on its own after one GEMM of all columns, equal the
    differentiable projection (F.linear, then a layer norm per block); float16 takes the
    backend's kernels on a copy of each block."""
    monkeypatch.setattr(_fused, "_PROJECTION_BYTES", 0)
    monkeypatch.setattr(_fused, "_PROJECTION_BLOCKS_BYTES", 0)
    monkeypatch.setattr(_fused, "_NATIVE_BYTES", 0)  # the chunks whatever the size
    gen = torch.Generator().manual_seed(11)
    gates = 39 if blocks else 52
    data = torch.randn(265, 6, generator=gen).to(dtype)
    w_ih = torch.randn(gates, 6, generator=gen).to(dtype)
    weight = (1 + 0.3 * torch.randn(gates, generator=gen)).to(dtype)
    bias = (0.3 * torch.randn(gates, generator=gen)).to(dtype)
    ref = _fused.normalized_projection(data, w_ih.requires_grad_(), weight, bias, 1e-5, blocks)
    with torch.no_grad():
        got = _fused.normalized_projection(data, w_ih, weight, bias, 1e-5, blocks)
    torch.testing.assert_close(got, ref.detach(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("steps", [1, 3, 4])
def test_small_projections_take_torch_s_layer_norm_with_the_same_values(
    kind, steps, dtype, monkeypatch
) -> None:
    """5, 15 and 20 rows, both sides of ``_NATIVE_BYTES`` (set to 16 rows' projection here),
    through the projection computed before the loop (:func:`_fused.normalized_projection`, the
    GRU's two blocks too): without autograd the values are those with it, to the rounding of a
    different summation order."""
    gen = torch.Generator().manual_seed(7)
    hs, blocks = 13, ((26, 13) if kind == "gru" else None)
    gates = 3 * hs if kind == "gru" else 4 * hs
    monkeypatch.setattr(_fused, "_NATIVE_BYTES", 16 * gates * dtype.itemsize)
    data = torch.randn(steps * 5, 6, generator=gen, dtype=dtype)
    w_ih = torch.randn(gates, 6, generator=gen, dtype=dtype)
    weight = 1 + 0.3 * torch.randn(gates, generator=gen, dtype=dtype)
    bias = 0.3 * torch.randn(gates, generator=gen, dtype=dtype)
    ref = _fused.normalized_projection(data, w_ih.requires_grad_(), weight, bias, 1e-5, blocks)
    assert ref.requires_grad
    with torch.no_grad():
        got = _fused.normalized_projection(data, w_ih, weight, bias, 1e-5, blocks)
    torch.testing.assert_close(got, ref.detach(), **TOL[dtype])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_steps_of_few_rows_project_a_large_w_ih_before_the_loop(kind, batch, monkeypatch) -> None:
    """Steps of one or two rows: the LSTM's time loop projects its inputs in inference only while
    W_ih has at most ``_LOOP_PROJECTION_FEW_ROWS``' elements times B² (here made 1: a W_ih of
    4·13·6 elements is past it), else gx is computed before the loop; the GRU's, and steps of
    three rows, as before. The values agree either way."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_FEW_ROWS", {"lstm_fwd_seq": (3, 1)})
    model = _model(kind, torch.float32)
    x = _inputs(torch.float32, packed=False, batch=batch)
    source = _fused.InputProjection(x.reshape(-1, 6), model.weight_ih_l0, None, None, 1e-5, True)
    in_loop = kind == "gru" or batch >= 3
    assert _fused._projects_in_loop(source, batch, f"{kind}_fwd_seq") == in_loop
    ref = [t.detach() for t in _flat(model(x))]
    calls = []
    compute = _fused.InputProjection.compute
    monkeypatch.setattr(_fused.InputProjection, "compute", lambda s: calls.append(1) or compute(s))
    with torch.no_grad():
        got = _flat(model(x))
    assert len(calls) == (0 if in_loop else 1)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float32])


@pytest.mark.usefixtures("python_training_node")  # it watches the projection's calls
@pytest.mark.parametrize("batch", [1, 2, 3])
def test_lstm_training_with_few_rows_projects_a_large_w_ih_before_the_loop(
    batch, monkeypatch
) -> None:
    """The same rule in LN-LSTM training (its in-loop projection from
    ``_LOOP_PROJECTION_TRAINING_ROWS`` rows, here made 0): with one or two rows a step and a W_ih
    past the limit, the node projects all rows before the loop (``_projected``); the outputs and
    gradients are the reference loop's either way."""
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_FEW_ROWS", {"lstm_fwd_seq": (3, 1)})
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_TRAINING_ROWS", 0)
    calls = []
    projected = _fused._projected
    monkeypatch.setattr(_fused, "_projected", lambda *a: calls.append(1) or projected(*a))
    model = _model("lstm", torch.float64)
    x = _inputs(torch.float64, packed=False, batch=batch).requires_grad_()
    results = []
    for impl in ("fused", "loop"):
        model.impl = impl
        model.zero_grad()
        x.grad = None
        out = _flat(model(x))
        sum((o * o).sum() for o in out).backward()
        results.append([o.detach() for o in out] + [x.grad, *(p.grad for p in model.parameters())])
        if impl == "fused" and _cstep.sequence_gemm():
            assert len(calls) == (1 if batch < 3 else 0)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def _lstm_results(model: torch.nn.Module, x: torch.Tensor, train: bool) -> list[torch.Tensor]:
    """The outputs and final states, with ``train`` the gradients of x and every parameter."""
    if not train:
        with torch.no_grad():
            return _flat(model(x))
    x = x.detach().requires_grad_()
    results = _flat(model(x))
    weights = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i), dtype=t.dtype)
               for i, t in enumerate(results)]  # fmt: skip
    grads = torch.autograd.grad(
        sum((w * t).sum() for w, t in zip(weights, results, strict=True)),
        [x, *model.parameters()],
    )
    return [t.detach() for t in (*results, *grads)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("options", [{}, {"bidirectional": True, "zoneout_hidden": 0.3}],
                         ids=["plain", "both directions, zoneout"])  # fmt: skip
def test_lstm_forward_group_changes_no_bit(dtype, train, options) -> None:
    """The LN-LSTM forward step runs its rows in groups whose statistics overlap
    (``rnn.use_forward_group``, by processor by default): every group size gives the same bits,
    outputs, states and gradients, with a last group cut short (19 rows)."""

    torch.manual_seed(0)
    model = LayerNormLSTM(9, 32, dtype=dtype, **options).eval()
    x = 0.5 + torch.randn(7, 19, 9, dtype=dtype)
    try:
        rnn.use_forward_group(4)
        ref = _lstm_results(model, x, train)
        for rows in (1, 3, 8):
            rnn.use_forward_group(rows)
            got = _lstm_results(model, x, train)
            for a, b in zip(got, ref, strict=True):
                assert torch.equal(a, b), rows
    finally:
        rnn.use_forward_group(None)


@needs_sequence_kernels
@pytest.mark.parametrize("train", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("layer", [LayerNormLSTM, LayerNormGRU], ids=["lstm", "gru"])
def test_batch_row_split_and_shared_steps_agree(layer, train, monkeypatch) -> None:
    """Two threads either split the batch's rows, each carrying its rows through every step, or
    share every step's GEMMs by panels (``rnn.use_batch_split_bytes``: the packed weights' bytes
    up to which they split, by processor by default): the same outputs, states and gradients.
    The outputs bit for bit (each value the same sum in the same order); the gradients within
    float64 rounding (the layer norms' gain and bias sums are each thread's rows summed apart,
    the threads' totals then added in order)."""
    monkeypatch.setattr(_cstep, "_SEQ_GRAIN", 1)  # a team of two at this size
    monkeypatch.setattr(_cstep, "_SEQ_GEMM_GRAIN", 1)
    torch.manual_seed(0)
    model = layer(9, 32, dtype=torch.float64).eval()
    x = 0.5 + torch.randn(7, 12, 9, dtype=torch.float64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        results = []
        for limit in (0, 1 << 40):  # never split, always split
            rnn.use_batch_split_bytes(limit)
            results.append(_lstm_results(model, x, train))
    finally:
        rnn.use_batch_split_bytes(None)
        torch.set_num_threads(before)
    (shared, split), outputs = results, len(_flat(model(x)))
    for i, (a, b) in enumerate(zip(shared, split, strict=True)):
        if i < outputs:
            assert torch.equal(a, b), i
        else:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_batch_split_choices(monkeypatch) -> None:
    """16 MiB of packed weights on an AMD Zen 4 (family 25) with an AVX-512 target, 4 MiB
    elsewhere; use_batch_split_bytes takes an int >= 0 or None and names anything else."""
    from layernorm.kernels.cpu import targets

    zen4, other = rnn.ZEN4_BATCH_SPLIT_BYTES, rnn.rnn_abi.BATCH_SPLIT_BYTES_DEFAULT
    cases = [("AuthenticAMD", 25, "avx512bf16", zen4), ("AuthenticAMD", 25, "avx512", zen4),
             ("AuthenticAMD", 25, "avx2", other), ("AuthenticAMD", 26, "avx512bf16", other),
             ("GenuineIntel", 6, "avx512", other), ("HygonGenuine", 24, "avx2", other)]  # fmt: skip
    for vendor, family, isa, limit in cases:
        monkeypatch.setattr(targets, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(targets, "cpu_family", lambda f=family: f)
        assert rnn.batch_split_bytes_by_default(isa) == limit, (vendor, family, isa)
    for bad in (-1, 2.0, "4", True):
        with pytest.raises(ValueError, match=r"limit must be an int >= 0 or None, got"):
            rnn.use_batch_split_bytes(bad)  # type: ignore[arg-type]


def test_forward_group_choices(monkeypatch) -> None:
    """Groups of eight rows on Intel processors and on AMD processors from family 26 with an
    AVX-512 target, four elsewhere; use_forward_group takes 1 to 8 or None and names anything
    else."""
    from layernorm.kernels.cpu import targets

    cases = [("AuthenticAMD", 26, "avx512bf16", 8), ("AuthenticAMD", 25, "avx512bf16", 4),
             ("AuthenticAMD", 26, "avx2", 4), ("GenuineIntel", 6, "avx512", 8),
             ("GenuineIntel", 6, "avx2", 8), ("HygonGenuine", 24, "avx2", 4)]  # fmt: skip
    for vendor, family, isa, rows in cases:
        monkeypatch.setattr(targets, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(targets, "cpu_family", lambda f=family: f)
        assert rnn.forward_group_by_default(isa) == rows, (vendor, family, isa)
    for bad in (0, 9, 2.0, "4", True):
        with pytest.raises(ValueError, match=r"rows must be an int in 1-8 or None, got"):
            rnn.use_forward_group(bad)  # type: ignore[arg-type]
