"""Zoneout and recurrent dropout on the C kernels, against the reference loop.

The masks are drawn once per layer and direction (``_draw_masks``) before either path runs, so
with the same seed the fused node on the C kernels and ``impl="loop"`` compute from the same
masks; outputs, final states and every gradient must agree. Both C paths run: the per-step
kernels with the time loop in Python (forced by registering :data:`_pointwise.C_STEPS`, as in
``test_recurrent_cseq.py``) and the whole-sequence kernels (the default where they are built).
A spy on the kernel calls checks that the C path is the one taken, with the masks in its struct.
Every instruction-set target this CPU runs is checked once with all masks (the whole-sequence
GEMM is written per register file; portable builds keep the per-step loop).
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.kernels.cpu import cbuild, rnn, targets
from layernorm.recurrent import _cstep, _pointwise, register_step_kernels

pytestmark = pytest.mark.skipif(
    not _cstep.available(torch.zeros(1)), reason="needs the C step kernels (a C compiler)"
)
TOL = {"rtol": 1e-10, "atol": 1e-11}
# float32: the same arithmetic in another order, compared norm-wise (per tensor); a single
# gradient entry of a long chain of zoned steps may sum many roundings (2.7e-4 relative seen).
F32_NORMWISE = 1e-4
LAYERS = {"lstm": LayerNormLSTM, "gru": LayerNormGRU}
# Each option alone and all together (zoneout_cell is the LSTM's only).
OPTIONS = {
    "zoneout_h": {"zoneout_hidden": 0.3},
    "zoneout_c": {"zoneout_cell": 0.4},
    "dropout": {"recurrent_dropout": 0.35},
    "all": {"zoneout_hidden": 0.3, "zoneout_cell": 0.4, "recurrent_dropout": 0.35,
            "weight_dropout": 0.2},
}  # fmt: skip
MASK_FIELDS = {"zoneout_hidden": "zh", "zoneout_cell": "zc", "recurrent_dropout": "cm"}


def _path(name: str) -> _pointwise.StepKernels | None:
    """The kernels to register for the CPU: the per-step C kernels, or None (the default, the
    whole-sequence kernels where built)."""
    if name == "seq" and not _cstep.sequence_gemm():
        pytest.skip("the whole-sequence kernels are used with AVX-512 builds only")
    return _pointwise.C_STEPS if name == "step" else None


def _model(kind: str, opts: dict, dtype: torch.dtype, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LAYERS[kind](5, 7, bidirectional=True, num_layers=2, dtype=dtype, **opts, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn_like(p)
            p.copy_(1.0 + noise if "ln_weight" in name else noise)
    return model


def _inputs(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [0.5 + torch.randn(n, 5, generator=gen, dtype=dtype) for n in (4, 6, 1, 6, 3)]


def _run(model: torch.nn.Module, xs: list[torch.Tensor], impl: str, steps) -> list[torch.Tensor]:
    """Output, final states and the gradients of inputs, initial states and every parameter,
    with ``impl`` and (for the fused node) the CPU step kernels ``steps``."""
    model.impl = impl
    model.zero_grad()
    xs = [x.detach().clone().requires_grad_() for x in xs]
    gen = torch.Generator().manual_seed(3)
    n_states = 2 if isinstance(model, LayerNormLSTM) else 1
    sizes = (model.output_size, model.hidden_size)[:n_states]  # h has proj_size units
    hx = [torch.randn(4, len(xs), n, generator=gen, dtype=xs[0].dtype).requires_grad_()
          for n in sizes]  # fmt: skip
    register_step_kernels("cpu", steps if impl == "fused" else None)
    try:
        torch.manual_seed(7)  # the same masks on both paths
        packed = pack_sequence(xs, enforce_sorted=False)
        out, h_n = model(packed, tuple(hx) if n_states == 2 else hx[0])
        h_n = h_n if isinstance(h_n, tuple) else (h_n,)
        weights = torch.linspace(-1, 2, out.data.numel(), dtype=out.data.dtype)
        loss = (out.data * weights.view_as(out.data)).sum() + sum((s * s).sum() for s in h_n)
        loss.backward()
    finally:
        register_step_kernels("cpu", None)
    grads = [*(x.grad for x in xs), *(s.grad for s in hx), *(p.grad for p in model.parameters())]
    return [out.data.detach(), *(s.detach() for s in h_n), *grads]


def _assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype == torch.float64:
        torch.testing.assert_close(a, b, **TOL)
    else:
        assert a.shape == b.shape and a.dtype == b.dtype
        err, size = (a - b).double().norm().item(), b.double().norm().item()
        assert err <= F32_NORMWISE * size + 1e-6, (err, size)


def _spy(monkeypatch) -> list[tuple[str, dict[str, int]]]:
    """Record each C kernel call: its name and the mask pointers of its step struct."""
    calls: list[tuple[str, dict[str, int]]] = []

    def fields(args) -> dict[str, int]:
        return {f: getattr(args, f) or 0 for f in ("zh", "zc", "cm") if hasattr(args, f)}

    step, sequence = rnn.step, rnn.run_sequence
    monkeypatch.setattr(rnn, "step", lambda k, d, a, *r: calls.append((k, fields(a))) or
                        step(k, d, a, *r))  # fmt: skip
    monkeypatch.setattr(rnn, "run_sequence", lambda k, d, a, *r: calls.append((k, fields(a))) or
                        sequence(k, d, a, *r))  # fmt: skip
    return calls


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("path", ["step", "seq"])
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("training", [True, False])
def test_c_kernels_with_masks_equal_the_loop(
    kind, option, path, dtype, training, monkeypatch
) -> None:
    opts = dict(OPTIONS[option])
    if kind == "gru":
        if option == "zoneout_c":
            pytest.skip("a GRU has no cell state")
        opts.pop("zoneout_cell", None)
    steps = _path(path)
    model = _model(kind, opts, dtype).train(training)
    xs = _inputs(dtype)
    calls = _spy(monkeypatch)
    ours = _run(model, xs, "fused", steps)
    # the C kernels ran, every call with the masks the options draw (dropouts in training only)
    wanted = {MASK_FIELDS[k] for k in opts if k in MASK_FIELDS}
    if not training:
        wanted.discard("cm")
    kinds = {name.split("_")[-1] for name, _ in calls}
    assert kinds == {path}, calls
    assert len(calls) >= 4 and all(name.startswith(kind) for name, _ in calls)
    for _, ptrs in calls:
        assert {f for f, p in ptrs.items() if p} == wanted
    ref = _run(model, xs, "loop", steps)
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        _assert_close(a, b)


@pytest.mark.parametrize("path", ["step", "seq"])
@pytest.mark.parametrize(
    ("kind", "kw"),
    [
        ("lstm", {"normalize_cell_state": True}),
        ("lstm", {"norm": "none"}),
        ("gru", {"norm": "none"}),
    ],
)
def test_c_kernels_with_masks_without_norm_and_normalized_cell(kind, kw, path) -> None:
    opts = dict(OPTIONS["all"])
    if kind == "gru":
        opts.pop("zoneout_cell")
    steps = _path(path)
    model = _model(kind, opts, torch.float64, **kw)
    xs = _inputs(torch.float64)
    for a, b in zip(_run(model, xs, "fused", steps), _run(model, xs, "loop", steps), strict=True):
        _assert_close(a, b)


def test_c_kernels_with_masks_threaded(monkeypatch) -> None:
    """With the grains at 1 the rows of every step split across threads (masks indexed per row)."""
    monkeypatch.setattr(_cstep, "_GEMM_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_SEQ_GEMM_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_SEQ_GRAIN", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for kind in LAYERS:
            opts = dict(OPTIONS["all"])
            if kind == "gru":
                opts.pop("zoneout_cell")
            model = _model(kind, opts, torch.float64)
            xs = _inputs(torch.float64)
            for steps in (_pointwise.C_STEPS, None):
                ours, ref = _run(model, xs, "fused", steps), _run(model, xs, "loop", steps)
                for a, b in zip(ours, ref, strict=True):
                    _assert_close(a, b)
    finally:
        torch.set_num_threads(threads)


def test_zoneout_one_freezes_the_state_on_the_c_kernels() -> None:
    """A zoneout rate of 1 at eval keeps the initial state at every step (h and c): the mask
    reaches the kernel and is applied as written, not only agreed on by two paths."""
    model = _model("lstm", {"zoneout_hidden": 1.0, "zoneout_cell": 1.0}, torch.float64).eval()
    model.impl = "fused"
    h0 = torch.randn(4, 2, 7, dtype=torch.float64)
    c0 = torch.randn(4, 2, 7, dtype=torch.float64)
    x = torch.randn(5, 2, 5, dtype=torch.float64)
    out, (h_n, c_n) = model(x, (h0, c0))
    torch.testing.assert_close(h_n, h0, rtol=0, atol=0)
    torch.testing.assert_close(c_n, c0, rtol=0, atol=0)
    torch.testing.assert_close(out[:, :, 7:], h0[3].expand(5, 2, 7), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("option", [None, *OPTIONS])
@pytest.mark.parametrize("training", [True, False])
def test_proj_size_on_the_per_step_c_kernels_equals_the_loop(
    option, dtype, training, monkeypatch
) -> None:
    """torch.nn.LSTM's projection ``h = W_hr h̃`` between the C steps (a GEMM in torch), alone and
    with each mask: the zoneout of h acts on the projected h, in Python, so the kernel gets
    none; zoneout of c and recurrent dropout reach the kernel."""
    opts = {"proj_size": 3, **(OPTIONS[option] if option else {})}
    model = _model("lstm", opts, dtype).train(training)
    xs = _inputs(dtype)
    calls = _spy(monkeypatch)
    ours = _run(model, xs, "fused", None)  # the default kernels: the projection needs the steps
    wanted = {MASK_FIELDS[k] for k in opts if k in ("zoneout_cell", "recurrent_dropout")}
    if not training:
        wanted.discard("cm")
    assert calls and {name for name, _ in calls} == {"lstm_fwd_step", "lstm_bwd_step"}
    for _, ptrs in calls:
        assert {f for f, p in ptrs.items() if p} == wanted
    ref = _run(model, xs, "loop", None)
    assert len(ours) == len(ref)
    for a, b in zip(ours, ref, strict=True):
        _assert_close(a, b)


AVAILABLE = targets.available() if cbuild.compiler() is not None else ()


@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.skipif(n not in AVAILABLE, reason=f"no {n} CPU"))
     for n in targets.NAMES],
)  # fmt: skip
def test_masks_on_every_target_equal_the_loop(name, kind) -> None:
    opts = dict(OPTIONS["all"])
    if kind == "gru":
        opts.pop("zoneout_cell")
    model = _model(kind, opts, torch.float64)
    xs = _inputs(torch.float64)
    with targets.use(name):
        ours = _run(model, xs, "fused", None)
    for a, b in zip(ours, _run(model, xs, "loop", None), strict=True):
        _assert_close(a, b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("training", [True, False])
@pytest.mark.parametrize("nonlinearity", ["tanh", "relu"])
def test_elman_zoneout_on_the_sequence_kernels(threads, training, nonlinearity, monkeypatch):
    """The Elman RNN's zoneout of h reaches its sequence kernels (the mask's pointer set forward
    and backward), with its rows split across threads where the grains are 1, and gives the
    loop's values and gradients (training: the same seeded masks; eval: the expectation)."""
    _path("seq")
    for grain in ("_GEMM_GRAIN", "_GRAIN", "_SEQ_GEMM_GRAIN", "_SEQ_GRAIN"):
        monkeypatch.setattr(_cstep, grain, 1)
    torch.manual_seed(0)
    model = LayerNormRNN(5, 7, num_layers=2, bidirectional=True, nonlinearity=nonlinearity,
                         zoneout_hidden=0.3, dtype=torch.float64)  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn_like(p)
            p.copy_(1.0 + noise if "ln_weight" in name else noise)
    model.train(training)
    xs = _inputs(torch.float64)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        calls = _spy(monkeypatch)
        ours = _run(model, xs, "fused", None)
        ref = _run(model, xs, "loop", None)
    finally:
        torch.set_num_threads(saved)
    for kernel in ("elman_fwd_seq", "elman_bwd_seq"):
        assert any(k == kernel and f["zh"] for k, f in calls), kernel
    for a, b in zip(ours, ref, strict=True):
        _assert_close(a, b)
