"""The whole-sequence C kernels (time loop and recurrent GEMMs in one call) vs the per-step loop.

The per-step loop (``torch.mm`` per step, then the C step kernel) is what ran before the sequence
entry points existed; it is selected here by registering the C step functions without their
``*_seq`` counterparts. Both run the same pointwise C code, so they differ only in the recurrent
GEMM's summation order: a few ulps per step. Sequences of at most 8 rows in all take the unpacked
forward GEMM (dot products of rows of h and of W_hh), longer ones the packed one. Shapes cover
the GEMM's edge cases: row counts that fill no, one and several 8-row tiles, packed steps of
shrinking size, hidden sizes whose gate columns end in a full tile, a single vector and scalar
leftovers, in float64 and float32 (whose vectors hold twice as many values), and both thread paths
of the GEMM.
"""

from __future__ import annotations

import copy
import ctypes
import os
from collections import Counter

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

from kernel_paths import FORTRAN_GEMM, counting, needs_sequence_kernels, one_step_gemm_calls
from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.recurrent import _cstep, _pointwise, register_step_kernels
from layernorm.recurrent import layers as recurrent_layers
from tolerances import UNIT_ROUNDOFF, assert_close_to_rounding

pytestmark = needs_sequence_kernels
TOL = {torch.float64: {"rtol": 1e-10, "atol": 1e-11}, torch.float32: {"rtol": 2e-5, "atol": 2e-5}}
# the Elman RNN's reference (PER_STEP registered) is its loop of PyTorch ops
LAYERS = {"lstm": LayerNormLSTM, "gru": LayerNormGRU, "rnn": LayerNormRNN}
PER_STEP = _pointwise.C_STEPS


def _model(kind: str, hidden: int, norm: str, dtype: torch.dtype, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LAYERS[kind](6, hidden, norm=norm, dtype=dtype, **kw)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = 0.3 * torch.randn_like(p)
            p.copy_(1.0 + noise if "ln_weight" in name else noise)
    return model


def _run(model: torch.nn.Module, xs: list[torch.Tensor], packed: bool) -> list[torch.Tensor]:
    """Outputs, final states and the gradients of inputs, initial states and all parameters."""
    model.zero_grad()
    xs = [x.detach().clone().requires_grad_() for x in xs]
    batch, hidden = len(xs), model.hidden_size
    gen = torch.Generator().manual_seed(3)
    n_states = 2 if isinstance(model, LayerNormLSTM) else 1
    dirs = 2 if model.bidirectional else 1
    # drawn in float32 and converted, so a float64 run of a float32 case sees the same values
    hx = [torch.randn(dirs, batch, hidden, generator=gen).to(xs[0].dtype).requires_grad_()
          for _ in range(n_states)]  # fmt: skip
    inp = pack_sequence(xs, enforce_sorted=False) if packed else torch.stack(xs, 1)
    out, h_n = model(inp, tuple(hx) if n_states == 2 else hx[0])
    data = out.data if packed else out
    h_n = h_n if isinstance(h_n, tuple) else (h_n,)
    weights = torch.linspace(-1, 2, data.numel()).to(data.dtype).view_as(data)
    ((data * weights).sum() + sum((s * s).sum() for s in h_n)).backward()
    grads = [*(x.grad for x in xs), *(s.grad for s in hx), *(p.grad for p in model.parameters())]
    return [data.detach(), *(s.detach() for s in h_n), *grads]


def _both(model: torch.nn.Module, xs: list[torch.Tensor], packed: bool):
    ours = _run(model, xs, packed)
    register_step_kernels("cpu", PER_STEP)
    try:
        ref = _run(model, xs, packed)
    finally:
        register_step_kernels("cpu", None)
    return ours, ref


def _assert_matches_per_step_loop(model: torch.nn.Module, xs: list[torch.Tensor], packed: bool):
    """The sequence kernels' results against the per-step loop's: float64 within TOL; float32,
    whose two GEMMs' orders differ by the processor's BLAS, within a bound that follows the size
    of the per-step loop's rounding, measured against the same layer run in float64."""
    ours, ref = _both(model, xs, packed)
    dtype = xs[0].dtype
    if dtype == torch.float64:
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, **TOL[dtype])
        return
    exact = _run(copy.deepcopy(model).double(), [x.double() for x in xs], packed)
    assert_close_to_rounding(ours, ref, exact, **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize(("batch", "hidden"), [(3, 5), (8, 16), (11, 37), (17, 8)])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("steps", [1, 2, 5])
def test_sequence_kernels_equal_per_step_loop(kind, batch, hidden, packed, steps, dtype) -> None:
    """Up to 8 rows in all steps the forward GEMM reads W_hh unpacked (dot products, DIRECT_ROWS
    in rnn_seq_impl.h): one step of 3 or 8 rows, two steps of 3; more rows take the packed one."""
    assert _pointwise.step_kernels(torch.zeros(1, dtype=dtype)).lstm_fwd_seq is not None
    model = _model(kind, hidden, "layer", dtype, bidirectional=True)
    gen = torch.Generator().manual_seed(1)
    lengths = [steps - (i % min(steps, 4)) for i in range(batch)] if packed else [steps] * batch
    xs = [0.5 + torch.randn(n, 6, generator=gen, dtype=dtype) for n in lengths]
    _assert_matches_per_step_loop(model, xs, packed)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("packed", [False, True])
def test_sequence_kernels_with_rows_4_kib_apart(dtype, packed) -> None:
    """A GEMM whose A rows lie a multiple of 4 KiB apart reads a copy of them spread a cache line
    further each (``spread_block`` in rnn_seq_impl.h, where a row tile outnumbers an L1 set's
    ways): here the LSTM backward's dhp, G = 4H values a row (4 KiB at H = 256 in float32, 128 in
    float64), over steps of 40 rows (20 a thread where two share them by rows) and, packed, of
    fewer."""
    hidden = 4096 // (4 * torch.finfo(dtype).bits // 8)
    model = _model("lstm", hidden, "layer", dtype)
    gen = torch.Generator().manual_seed(2)
    lengths = [3 - (i % 3) for i in range(40)] if packed else [3] * 40
    xs = [0.5 + torch.randn(n, 6, generator=gen, dtype=dtype) for n in lengths]
    _assert_matches_per_step_loop(model, xs, packed)


@pytest.mark.parametrize("prefetch", [0, 16])
def test_gemm_prefetch_changes_no_result(monkeypatch, prefetch) -> None:
    """A build of the kernels with another GEMM prefetch distance (rnn._library_for's variant
    flags, as benchmarks/ab_rnn.py --cflags builds them) gives the default build's results to the
    bit: prefetching only asks for cache lines. Ragged float32 batch, forward and backward."""
    from layernorm.kernels.cpu import rnn, targets

    model = _model("lstm", 37, "layer", torch.float32)
    gen = torch.Generator().manual_seed(5)
    xs = [0.5 + torch.randn(9 - i % 4, 6, generator=gen) for i in range(21)]
    default = _run(model, xs, packed=True)
    variant = rnn._library_for(targets.selected().name, (f"-DGEMM_PREFETCH={prefetch}",))
    assert variant is not None and variant is not rnn._library()
    monkeypatch.setattr(rnn, "_library", lambda: variant)
    for a, b in zip(_run(model, xs, packed=True), default, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("norm", ["none", "layer"])
def test_sequence_kernels_without_norm_and_normalized_cell(kind, norm) -> None:
    kw = {"normalize_cell_state": True} if kind == "lstm" and norm == "layer" else {}
    model = _model(kind, 20, norm, torch.float64, bias=False, **kw)
    gen = torch.Generator().manual_seed(1)
    xs = [0.5 + torch.randn(4, 6, generator=gen, dtype=torch.float64) for _ in range(9)]
    ours, ref = _both(model, xs, packed=False)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def _saved_tensors(model: torch.nn.Module, x: torch.Tensor, hx: tuple) -> list[torch.Tensor]:
    saved: list[torch.Tensor] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x, hx)
    return saved


@pytest.mark.parametrize("steps", [1, 2, 6])
def test_lstm_keeps_no_previous_state_on_padded_sequences(steps, monkeypatch) -> None:
    """On a padded sequence the LSTM's recurrent weight gradient takes h_{t−1} from the output
    shifted by a step (h0 for the first): no (N, H) copy of h_{t−1} is saved for backward, in
    either direction, and every gradient equals the per-step path's, which keeps that copy."""
    # the fused node at one step, which a training call of one step otherwise leaves to the
    # step ops (layers._LEAN_TRAINING_STEPS)
    monkeypatch.setattr(recurrent_layers, "_LEAN_TRAINING_STEPS", {})
    model = _model("lstm", 7, "layer", torch.float64, bidirectional=True)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(steps, 6, generator=gen, dtype=torch.float64) for _ in range(3)]
    x = torch.stack(xs, 1).requires_grad_()
    hx = tuple(torch.randn(2, 3, 7, generator=gen, dtype=torch.float64) for _ in range(2))
    with torch.no_grad():
        out, _ = model(x, hx)
    fwd = torch.cat([hx[0][:1], out[:-1, :, :7]]).reshape(-1, 7)  # h_{t−1} forward in time
    rev = torch.cat([out[1:, :, 7:], hx[0][1:]]).reshape(-1, 7)  # and in reverse

    def kept(saved: list[torch.Tensor]) -> bool:
        # a copy: h_{t−1}'s values in memory of their own, not h0 itself (one step: all of
        # h_{t−1}) nor a slice of the output's buffer, which is saved as the output too
        storages = Counter(t.untyped_storage().data_ptr() for t in saved)
        h0 = hx[0].untyped_storage().data_ptr()
        return any(t.shape == fwd.shape and any(torch.allclose(t, v, rtol=1e-9, atol=0)
                                                for v in (fwd, rev))
                   and t.untyped_storage().data_ptr() != h0
                   and storages[t.untyped_storage().data_ptr()] == 1 for t in saved)  # fmt: skip

    assert not kept(_saved_tensors(model, x, hx))
    register_step_kernels("cpu", PER_STEP)
    try:
        assert kept(_saved_tensors(model, x, hx))  # the check sees a kept copy
    finally:
        register_step_kernels("cpu", None)
    ours, ref = _both(model, xs, packed=False)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def test_lstm_keeps_neither_previous_state_copy() -> None:
    """What a padded LSTM sequence keeps for backward is two (N, H) buffers smaller than what the
    per-step path keeps (its copies of h_{t−1} and of the carried c_{t−1}), counting distinct
    storages other than the input state's and the output's, which both paths hold anyway; and
    three vectors that the sequence kernels' backward does not read back: the biases of the
    layer norms of gx (4H: the per-step path's is an autograd node before the steps, which keeps
    it), of hp (4H) and of c_t (H), which the fused node keeps where a training call has no plan
    (layernorm.recurrent._planned)."""
    model = _model("lstm", 7, "layer", torch.float64)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(5, 3, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    hx = tuple(torch.randn(1, 3, 7, generator=gen, dtype=torch.float64) for _ in range(2))

    def kept_bytes() -> int:
        saved: list[torch.Tensor] = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = model(x, hx)[0]
        held = {t.untyped_storage().data_ptr() for t in (*hx, x, out)}
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved}
        return sum(n for p, n in storages.items() if p not in held)

    ours = kept_bytes()
    register_step_kernels("cpu", PER_STEP)
    try:
        per_step = kept_bytes()
    finally:
        register_step_kernels("cpu", None)
    assert per_step - ours == 2 * 5 * 3 * 7 * 8 + (4 * 7 + 4 * 7 + 7) * 8


@pytest.mark.parametrize("per_cpu", [False, True], ids=["2 threads", "3 per CPU"])
def test_sequence_kernels_threaded(monkeypatch, per_cpu) -> None:
    """With the grains at 1 the sequence kernels run a team of threads (at most one per CPU
    however many torch is given): sequences of equal lengths split by batch rows, each thread
    running its rows through every step; ragged ones share every step, its GEMM columns and its
    rows split across the threads."""
    monkeypatch.setattr(_cstep, "_GEMM_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_SEQ_GEMM_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_SEQ_GRAIN", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(3 * (os.cpu_count() or 1) if per_cpu else 2)
    try:
        for kind in LAYERS:
            model = _model(kind, 40, "layer", torch.float64)
            gen = torch.Generator().manual_seed(1)
            # the direct forward GEMM; the packed one by batch rows, and on shared steps
            for steps, batch, ragged in ((8, 1, False), (6, 10, False), (6, 10, True)):
                xs = [0.5 + torch.randn(steps - (i % 3 if ragged else 0), 6, generator=gen,
                                        dtype=torch.float64)
                      for i in range(batch)]  # fmt: skip
                ours, ref = _both(model, xs, packed=True)
                for a, b in zip(ours, ref, strict=True):
                    torch.testing.assert_close(a, b, **TOL[torch.float64])
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(("rows", "gates", "cols"), [(9, 512, 256), (9, 512, 255), (9, 500, 256)])
def test_transposed_product_either_order(rows, gates, cols) -> None:
    """dᵀ · x as torch.mm computes it, in either operand order (the first shape takes dᵀ.mm(x),
    the others (xᵀ.mm(d))ᵀ), row-major."""
    gen = torch.Generator().manual_seed(5)
    d = torch.randn(rows, gates, generator=gen, dtype=torch.float64)
    x = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
    got = _cstep.transposed_product(d, x)
    assert got.is_contiguous() and got.shape == (gates, cols)
    torch.testing.assert_close(got, d.t() @ x, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("rows", "gates", "hidden"), [(300, 148, 37), (7, 64, 16), (0, 12, 3)])
def test_weight_grad_equals_mm(rows, gates, hidden, dtype) -> None:
    """dhpᵀ · hprev over chunks of k (rows > 128), partial row tiles and column tails."""
    gen = torch.Generator().manual_seed(4)
    dhp = torch.randn(rows, gates, generator=gen, dtype=torch.float64)
    hprev = 0.5 + torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    got = _cstep.weight_grad(dhp.to(dtype), hprev.to(dtype))
    assert got.shape == (gates, hidden) and got.dtype == dtype
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(got.double(), dhp.t() @ hprev, **tol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("rows", "gates", "hidden"), [(300, 148, 16), (300, 148, 37), (130, 40, 3), (5, 29, 1)]
)
def test_weight_grad_is_the_same_on_any_threads(rows, gates, hidden, dtype) -> None:
    """The C weight gradient shared out among threads (by its rows where the columns make fewer
    panels than threads, by panels where not) gives each value the same sum in the same order:
    the same bits as one thread, and dhpᵀ · hprev."""
    if not _cstep.available(torch.zeros(1, dtype=dtype)):
        pytest.skip("needs the C kernels")
    gen = torch.Generator().manual_seed(7)
    dhp = torch.randn(rows, gates, generator=gen, dtype=torch.float64)
    hprev = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    one = _cstep.rnn.weight_grad(dhp.to(dtype), hprev.to(dtype), 1, 1)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(one.double(), dhp.t() @ hprev, **tol)
    for threads in (2, 3, 5):
        got = _cstep.rnn.weight_grad(dhp.to(dtype), hprev.to(dtype), threads, 1)
        assert torch.equal(got, one), threads


@pytest.mark.parametrize(
    ("norm", "gains_grad", "dgh_rows"),
    [("layer", True, "B"), ("layer", False, "B"), ("none", True, "N")],
    ids=["layer norms, gains trained", "layer norms, gains frozen", "no layer norms"],
)
def test_gru_backward_keeps_dgh_only_where_it_is_read_after_the_loop(
    norm, gains_grad, dgh_rows, monkeypatch
) -> None:
    """The LN-GRU backward's dgh is a step's scratch of B rows where the sequence kernel sums the
    layer norms' gain and bias gradients itself (or none are needed), and N rows without layer
    norms, where it is hp's gradient for W_hh's: (N, 3H) less memory at the backward's peak."""
    seen = []
    prepare = _cstep.rnn.prepare

    def spy(struct, dtype, values, sizes):
        if struct.name == "gru_bwd_step_args":
            seen.append((sizes["D"], sizes["N"], sizes["B"]))
        return prepare(struct, dtype, values, sizes)

    monkeypatch.setattr(_cstep.rnn, "prepare", spy)
    model = _model("gru", 16, norm, torch.float32)
    for name, p in model.named_parameters():
        if name.startswith("ln_"):
            p.requires_grad_(gains_grad)
    xs = [torch.randn(7, 6) for _ in range(5)]
    _run(model, xs, packed=False)
    assert seen, "the GRU backward ran no C kernel"
    for d, n, b in seen:
        assert d == {"B": b, "N": n}[dgh_rows], (d, n, b)


# MKL's packed GEMM in the sequence kernels (kernels/cpu/rnn.py use_gemm): cblas_sgemm_compute's
# C signature, to count its calls through a forwarder placed in the loaded library.
_MKL_COMPUTE = ctypes.CFUNCTYPE(
    None, *(ctypes.c_int,) * 6, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
    ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
)  # fmt: skip


@pytest.fixture
def mkl_calls():
    """Choose MKL's packed GEMM and count the selected library's cblas_sgemm_compute calls: a
    list whose one item counts. Afterwards the processor's default again, set from PyTorch's own
    entry points (not from anything the test made)."""
    from layernorm.kernels.cpu import rnn, targets

    real = rnn.torch_packed_gemm()
    if real is None:
        pytest.skip("this PyTorch exports no MKL packed GEMM")
    assert rnn._library() is not None
    calls, forwarder = counting(_MKL_COMPUTE, real[2])
    try:
        rnn.use_gemm("mkl")
        set_packed_gemm = rnn._GEMM.setters[targets.selected().name, ()]
        assert set_packed_gemm(real[0], real[1], ctypes.cast(forwarder, ctypes.c_void_p)) == 0
        yield calls
    finally:
        rnn.use_gemm(None)


def _grains_one(monkeypatch) -> None:
    for name in ("_GEMM_GRAIN", "_GRAIN", "_SEQ_GEMM_GRAIN", "_SEQ_GRAIN"):
        monkeypatch.setattr(_cstep, name, 1)


@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize(
    ("threads", "lengths", "uses_mkl"),
    [(1, [7] * 5, True), (2, [6] * 9, True), (2, [6, 5, 6, 4, 6, 3, 6, 6, 5], False)],
    ids=["one thread", "threads by batch rows", "threads share ragged steps"],
)
def test_mkl_packed_gemm_against_float64(monkeypatch, mkl_calls, kind, threads, lengths, uses_mkl):
    """With MKL's packed GEMM chosen, float32 outputs and gradients are as near the float64 run
    as the tile's, and MKL runs wherever each GEMM runs on one thread: one thread, or a team whose
    threads each carry their own rows of the batch through every step; where a team shares each
    step's GEMM by columns (ragged batches), the tile runs."""
    from layernorm.kernels.cpu import rnn

    if not uses_mkl and len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: the kernels form no team (at most one thread per CPU)")
    _grains_one(monkeypatch)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        model = _model(kind, 37, "layer", torch.float32)
        gen = torch.Generator().manual_seed(2)
        xs = [0.5 + torch.randn(n, 6, generator=gen) for n in lengths]
        ours = _run(model, xs, packed=True)
        called = mkl_calls[0]
        rnn.use_gemm("tile")
        tile = _run(model, xs, packed=True)
        assert mkl_calls[0] == called  # the tile's run makes no MKL call
    finally:
        torch.set_num_threads(saved)
    assert (called > 0) == uses_mkl, called
    exact = _run(copy.deepcopy(model).double(), [x.double() for x in xs], packed=True)
    assert_close_to_rounding(ours, tile, exact, **TOL[torch.float32])


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_mkl_packed_gemm_inference_projection(mkl_calls, kind) -> None:
    """Inference (no gradient): the input projection runs in the time loop by MKL's packed GEMM
    too (x · W_ihᵀ and h · W_hhᵀ each step); results as near float64 as the tile's."""
    from layernorm.kernels.cpu import rnn

    model = _model(kind, 24, "layer", torch.float32)
    x = 0.5 + torch.randn(9, 6, 6, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = list(model(x)[0:1])
        assert mkl_calls[0] >= 2 * 9, mkl_calls[0]
        rnn.use_gemm("tile")
        tile = list(model(x)[0:1])
        exact = list(copy.deepcopy(model).double()(x.double())[0:1])
    assert_close_to_rounding(ours, tile, exact, **TOL[torch.float32])


def test_mkl_packed_gemm_not_for_float64(mkl_calls) -> None:
    """MKL's packed GEMM is float32 only: float64 layers keep the tile."""
    model = _model("lstm", 16, "layer", torch.float64)
    xs = [0.5 + torch.randn(5, 6, dtype=torch.float64) for _ in range(4)]
    _run(model, xs, packed=False)
    assert mkl_calls[0] == 0


@pytest.fixture
def sgemm_calls():
    """The selected library's calls of MKL's sgemm, counted (one_step_gemm_calls)."""
    with one_step_gemm_calls("sgemm") as calls:
        yield calls


def _one_step_case(kind: str, dtype: torch.dtype, steps: int = 1, rows: int | None = None):
    """A layer of ``kind`` (``lstm-proj``: torch.nn.LSTM's projection, 8 units), an input of
    ``steps`` steps of ``rows`` rows (default: five past the direct GEMM's) and random initial
    states, so that every product of a wrong operand order or layout shows."""
    base, _, proj = kind.partition("-")
    model = _model(base, 24, "layer", dtype, **({"proj_size": 8} if proj else {}))
    batch = _cstep.direct_rows() + 5 if rows is None else rows
    gen = torch.Generator().manual_seed(4)
    x = (0.5 + torch.randn(steps, batch, 6, generator=gen)).to(dtype)
    h0 = torch.randn(1, batch, 8 if proj else 24, generator=gen).to(dtype)
    hx = (h0, torch.randn(1, batch, 24, generator=gen).to(dtype)) if base == "lstm" else h0
    return model, x, hx


def _inference(model: torch.nn.Module, x: torch.Tensor, hx) -> list[torch.Tensor]:
    with torch.no_grad():
        out, h_n = model(x, hx)
    return [out, *(h_n if isinstance(h_n, tuple) else (h_n,))]


@pytest.mark.parametrize("kind", ["lstm", "gru", "lstm-proj"])
@pytest.mark.parametrize("threads", [1, 2])
def test_one_step_sgemm_against_float64(sgemm_calls, kind, threads) -> None:
    """One step of a batch past the direct GEMM's rows in inference (a decoder's token): with MKL's
    sgemm chosen, the forward kernel's products (x · W_ihᵀ, h · W_hhᵀ, with the projection
    h̃ · W_hrᵀ) read the weights as stored by it, and the outputs and final states are as near
    the float64 run as those of the packed weights, which make no sgemm call. (The Elman RNN
    projects its input before the loop and multiplies one step by torch's GEMM.)"""
    from layernorm.kernels.cpu import rnn

    model, x, hx = _one_step_case(kind, torch.float32)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        ours = _inference(model, x, hx)
        called = sgemm_calls[0]
        rnn.use_one_step_gemm("packed")
        packed = _inference(copy.deepcopy(model), x, hx)
    finally:
        torch.set_num_threads(saved)
    assert called == (3 if kind == "lstm-proj" else 2), called
    assert sgemm_calls[0] == called  # the packed run makes none
    hx64 = tuple(h.double() for h in hx) if isinstance(hx, tuple) else hx.double()
    exact = _inference(copy.deepcopy(model).double(), x.double(), hx64)
    assert_close_to_rounding(ours, packed, exact, **TOL[torch.float32])


@pytest.mark.parametrize(
    ("dtype", "steps", "rows"),
    [(torch.float32, 2, None), (torch.float32, 1, 3), (torch.float64, 1, None)],
    ids=["two steps", "direct rows", "float64"],
)
def test_one_step_sgemm_only_for_one_float32_step(sgemm_calls, dtype, steps, rows) -> None:
    """MKL's sgemm serves one float32 step of more rows than the direct GEMM takes, nothing else:
    two steps pack their weights (each read by both), a step within the direct rows takes the dot
    kernel, float64 the tile."""
    model, x, hx = _one_step_case("gru", dtype, steps, rows)
    out = _inference(model, x, hx)
    assert sgemm_calls[0] == 0
    exact = _inference(copy.deepcopy(model).double(), x.double(), hx.double())
    tol = TOL[dtype]
    for got, want in zip(out, exact, strict=True):
        torch.testing.assert_close(got.double(), want, rtol=tol["rtol"], atol=tol["atol"])


def test_use_one_step_gemm_choices(monkeypatch) -> None:
    """use_one_step_gemm names its choices when given another. By default MKL's sgemm serves one
    step wherever PyTorch exports it, except where the C GEMM outpaces torch.mm."""
    from layernorm.kernels.cpu import rnn, targets

    with pytest.raises(ValueError, match=r"one of \('mkl', 'packed'\) or None, got 'tile'"):
        rnn.use_one_step_gemm("tile")
    isa = targets.selected().name
    monkeypatch.setattr(rnn, "tile_outpaces_torch_gemm", lambda isa: True)
    assert not rnn.one_step_sgemm_by_default(isa)
    assert rnn.one_step_gemm_in_use() == "packed"
    monkeypatch.setattr(rnn, "tile_outpaces_torch_gemm", lambda isa: False)
    assert rnn.one_step_sgemm_by_default(isa)
    assert rnn.one_step_gemm_in_use() == ("mkl" if rnn.torch_sgemm() else "packed")
    try:
        rnn.use_one_step_gemm("packed")
        assert rnn.one_step_gemm_in_use() == "packed"
        assert not _cstep.one_step_sgemm(torch.float32)
    finally:
        rnn.use_one_step_gemm(None)


def test_sgemm_check_refuses_a_function_that_does_not_multiply() -> None:
    """The small product torch_sgemm checks an sgemm by: PyTorch's own passes; a function that
    writes nothing, writes past C's columns, or reads 8-byte sizes (ILP64) does not; nor does
    MKL's bfloat16 GEMM on float32 operands or its sgemm on bfloat16 ones (torch_half_gemm's
    check)."""
    from layernorm.kernels.cpu import rnn

    real = rnn.torch_sgemm()
    if real is None:
        pytest.skip("this PyTorch exports no MKL sgemm")
    assert rnn._sgemm_multiplies(real)
    idle = FORTRAN_GEMM(lambda *args: None)
    assert not rnn._sgemm_multiplies(ctypes.cast(idle, ctypes.c_void_p).value)
    real_sgemm = FORTRAN_GEMM(real)

    def padding_too(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        real_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
        ctypes.cast(c, ctypes.POINTER(ctypes.c_float))[4] = 0.0  # past row 0's four columns

    padded = FORTRAN_GEMM(padding_too)
    assert not rnn._sgemm_multiplies(ctypes.cast(padded, ctypes.c_void_p).value)

    def wide_sizes(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
        # an ILP64 sgemm reads 8-byte sizes; negative ones it refuses, computing nothing
        sizes = [ctypes.cast(v, ctypes.POINTER(ctypes.c_int64))[0] for v in (m, n, k, ldc)]
        if min(sizes) >= 0:
            real_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    wide = FORTRAN_GEMM(wide_sizes)
    assert not rnn._sgemm_multiplies(ctypes.cast(wide, ctypes.c_void_p).value)
    # the bfloat16 GEMM passes on bfloat16 operands; each GEMM fails on the other's
    half = rnn.torch_half_gemm()
    assert half is not None and rnn._sgemm_multiplies(half, torch.bfloat16)
    assert not rnn._sgemm_multiplies(half, torch.float32)
    assert not rnn._sgemm_multiplies(real, torch.bfloat16)


def test_packed_gemm_entry_points_all_or_none() -> None:
    """The C setter takes MKL's three entry points together or none, and changes nothing when
    given some: the layers then run as before."""
    from layernorm.kernels.cpu import rnn, targets

    assert rnn._library() is not None
    set_packed_gemm = rnn._GEMM.setters[targets.selected().name, ()]
    assert set_packed_gemm(None, None, ctypes.c_void_p(8)) == -1
    assert set_packed_gemm(ctypes.c_void_p(8), None, None) == -1
    model = _model("lstm", 16, "layer", torch.float32)
    out = model(torch.randn(5, 4, 6))[0]  # would crash through address 8
    assert torch.isfinite(out).all()


def test_use_gemm_choices(monkeypatch) -> None:
    """use_gemm names its choices when given another. By default MKL's packed GEMM runs where
    PyTorch exports it, on an Intel processor with AVX-512, for a target without AVX-512 only."""
    from layernorm.kernels.cpu import rnn, targets

    with pytest.raises(ValueError, match=r"one of \('mkl', 'tile'\) or None, got 'blas'"):
        rnn.use_gemm("blas")
    avx512 = frozenset({"avx2", "avx512f"})
    cases = [
        ("GenuineIntel", avx512, "avx2", True),
        ("GenuineIntel", avx512, "avx512", False),
        ("GenuineIntel", avx512, "avx512bf16", False),
        ("GenuineIntel", frozenset({"avx2"}), "avx2", False),
        ("AuthenticAMD", avx512, "avx2", False),
    ]
    for vendor, features, isa, expected in cases:
        monkeypatch.setattr(targets, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(targets, "cpu_features", lambda f=features: f)
        assert rnn.mkl_by_default(isa) == expected, (vendor, features, isa)
    monkeypatch.setattr(rnn, "mkl_by_default", lambda isa: True)
    assert rnn.gemm_in_use() == ("mkl" if rnn.torch_packed_gemm() else "tile")
    try:
        rnn.use_gemm("tile")
        assert rnn.gemm_in_use() == "tile"
    finally:
        rnn.use_gemm(None)


def test_tile_outpaces_torch_gemm_on_wide_amd_avx512(monkeypatch) -> None:
    """The C GEMM takes torch.mm's products on AMD processors from family 26 (Zen 5, AVX-512 units
    512 bits wide, where MKL runs its AVX2 code) with a target that has AVX-512; not on Zen 4
    (family 25), nor on Intel, nor with the AVX2 or portable targets."""
    from layernorm.kernels.cpu import rnn, targets

    cases = [
        ("AuthenticAMD", 26, "avx512bf16", True),
        ("AuthenticAMD", 26, "avx512", True),
        ("AuthenticAMD", 27, "avx512", True),
        ("AuthenticAMD", 26, "avx2", False),
        ("AuthenticAMD", 26, "portable", False),
        ("AuthenticAMD", 25, "avx512bf16", False),
        ("GenuineIntel", 26, "avx512", False),
        ("GenuineIntel", 6, "avx512bf16", False),
        ("", 0, "avx512", False),
    ]
    for vendor, family, isa, expected in cases:
        monkeypatch.setattr(targets, "cpu_vendor", lambda v=vendor: v)
        monkeypatch.setattr(targets, "cpu_family", lambda f=family: f)
        assert rnn.tile_outpaces_torch_gemm(isa) == expected, (vendor, family, isa)


@pytest.mark.parametrize("outpaced", [False, True], ids=["torch.mm at its rate", "outpaced"])
def test_weight_grad_takes_the_c_gemm_at_every_size_where_it_outpaces_torch(
    outpaced, monkeypatch
) -> None:
    """Past the limits measured where both GEMMs run at one rate (many multiply-adds, a large
    gradient, fewer column panels than threads) a weight's gradient is torch.mm's, unless the C
    GEMM outpaces it, which then needs a panel or a tile of 16 rows for every other thread only
    (one panel and 128 rows: four threads; one panel and 16 rows: two, not four); either way the
    product is dᵀ · x."""
    if _cstep.rnn.vector_bytes() < 64:
        pytest.skip("the limits apply to the AVX-512 targets' C GEMM")
    calls = []
    c_gemm = _cstep.rnn.weight_grad
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: outpaced)
    monkeypatch.setattr(
        _cstep.rnn,
        "weight_grad",
        lambda *a: calls.append("C") or c_gemm(*a),  # type: ignore
    )
    gen = torch.Generator().manual_seed(6)
    # (rows, gates, hidden, threads): past the multiply-adds, the bytes, the panels; then past
    # the panels for the outpacing GEMM too
    cases = [(300, 2048, 160, 1), (3000, 600, 32, 1), (64, 128, 24, 2), (64, 128, 24, 4),
             (64, 16, 24, 2), (64, 16, 24, 4)]  # fmt: skip
    threads = torch.get_num_threads()
    taken = []
    for rows, gates, hidden, use_threads in cases:
        d = torch.randn(rows, gates, generator=gen)
        x = torch.randn(rows, hidden, generator=gen)
        torch.set_num_threads(use_threads)
        try:
            got = _cstep.weight_grad(d, x)
        finally:
            torch.set_num_threads(threads)
        taken.append(calls.pop() if calls else "torch.mm")
        torch.testing.assert_close(got.double(), d.double().t() @ x.double(), rtol=1e-5, atol=1e-3)
    assert taken == (["C"] * 5 + ["torch.mm"] if outpaced else ["torch.mm"] * 6)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("transposed", [True, False], ids=["x·Wᵀ", "x·W"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(
    ("rows", "inner", "cols"),
    [(300, 70, 130), (37, 5, 11), (1, 1, 1), (5, 0, 3), (0, 4, 3), (1100, 1024, 40)],
)
def test_matmul_equals_mm(rows, inner, cols, dtype, transposed, threads) -> None:
    """The C GEMM of the input projection (``rnn.matmul``): x · Wᵀ with W as a layer stores it,
    or x · W, equal to torch.mm's product to the dtype's rounding, over row tiles, column tails,
    an empty inner size (zeros) or no rows, rows of x a multiple of 4 KiB apart (read from
    copies that spread them, block after block of rows: ``spread_block``), on one thread or with
    the panels shared by two."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(rows, inner, generator=gen, dtype=torch.float64)
    w = torch.randn(*((cols, inner) if transposed else (inner, cols)), generator=gen,
                    dtype=torch.float64)  # fmt: skip
    out = torch.full((rows, cols), float("nan"), dtype=dtype)
    x, w = x.to(dtype).double(), w.to(dtype).double()  # the rounded inputs
    got = _cstep.rnn.matmul(x.to(dtype), w.to(dtype), transposed, out, threads, 1)
    assert got is out
    wk = w.t() if transposed else w
    # a sum of `inner` products in the dtype: within inner · u · Σ|x||w| (each product exact
    # in float64 here, every addition one rounding), plus the result's own rounding
    u = UNIT_ROUNDOFF[dtype]
    bound = inner * u * (x.abs() @ wk.abs()) + 2 * u * (x @ wk).abs()
    err = (got.double() - x @ wk).abs()
    assert not got.isnan().any() and bool((err <= bound).all()), float((err - bound).max())


def test_matmul_refuses_a_w_of_the_other_orientation() -> None:
    """W's shape must be that of the ``transposed`` flag (the struct's check cannot see it):
    (N, K) for x · Wᵀ, (K, N) for x · W; nothing is written otherwise."""
    x, out = torch.randn(4, 3), torch.zeros(4, 5)
    with pytest.raises(ValueError, match=r"w must be \(N, K\) with transposed=1"):
        _cstep.rnn.matmul(x, torch.randn(3, 5), True, out, 1, 1)
    with pytest.raises(ValueError, match=r"w must be \(N, K\) with transposed=1"):
        _cstep.rnn.matmul(x, torch.randn(5, 3), False, out, 1, 1)
    with pytest.raises(ValueError, match=r"w must be \(N, K\) with transposed=1"):
        _cstep.rnn.matmul(x, torch.randn(5, 3), True, torch.zeros(4, 6), 1, 1)  # N = 6
    assert not out.any()
    with pytest.raises(ValueError, match=r"y must have shape \(M, N\)"):  # the struct's check
        _cstep.rnn.matmul(x, torch.randn(5, 3), True, torch.zeros(20), 1, 1)


@pytest.mark.parametrize("outpaced", [False, True], ids=["torch.mm at its rate", "outpaced"])
def test_input_products_take_the_c_gemm_where_it_outpaces_torch(outpaced, monkeypatch) -> None:
    """An input product (the projection of all rows, x · W_ihᵀ, and its input gradient, d · W_ih)
    is the C GEMM's where it outpaces torch.mm, from ``_INPUT_PRODUCT_MIN`` multiply-adds and
    ``_INPUT_PRODUCT_MIN_ROWS`` rows, with a panel of output columns for every other thread;
    torch.mm's otherwise. Either way the product is torch.mm's to rounding."""
    calls = []
    c_gemm = _cstep.rnn.matmul
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: outpaced)
    monkeypatch.setattr(_cstep.rnn, "matmul", lambda *a: calls.append("C") or c_gemm(*a))
    monkeypatch.setattr(_cstep, "_INPUT_PRODUCT_MIN", 64 * 32 * 48)
    panel = 2 * _cstep.rnn.vector_bytes() // 4
    gen = torch.Generator().manual_seed(8)
    # (rows, inner, cols, threads): at the minimum, below it, one panel for four threads and for
    # two, past the minimum in fewer rows than _INPUT_PRODUCT_MIN_ROWS
    rows_min = _cstep._INPUT_PRODUCT_MIN_ROWS
    # the one-panel products at the minimum or past it on any target (a panel is 16 columns on
    # the AVX2 build, 32 on AVX-512)
    inner = max(64, -(-_cstep._INPUT_PRODUCT_MIN // (64 * panel)))
    cases = [(64, 32, 48, 1), (63, 32, 48, 1), (64, inner, panel, 4), (64, inner, panel, 2),
             (rows_min - 1, 128, 128, 1)]  # fmt: skip
    threads = torch.get_num_threads()
    taken = []
    for rows, inner, cols, use_threads in cases:
        x = torch.randn(rows, inner, generator=gen)
        for transposed in (True, False):
            w = torch.randn(*((cols, inner) if transposed else (inner, cols)), generator=gen)
            torch.set_num_threads(use_threads)
            try:
                got = _cstep.input_product(x, w, transposed, torch.empty(rows, cols))
            finally:
                torch.set_num_threads(threads)
            taken.append(calls.pop() if calls else "torch.mm")
            want = x.double() @ (w.t() if transposed else w).double()
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)
    expected = ["C", "C", "torch.mm", "torch.mm", "torch.mm", "torch.mm", "C", "C", "torch.mm",
                "torch.mm"]  # fmt: skip
    assert taken == (expected if outpaced else ["torch.mm"] * 10)


@pytest.mark.usefixtures("python_training_node")  # it watches rnn.matmul
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("mode", ["training", "inference"])
def test_layers_with_the_c_input_products_equal_the_reference_loop(kind, mode, monkeypatch) -> None:
    """With every input product the C GEMM's (as where it outpaces torch.mm), the projection
    before the time loop (W_ih past the loop's limit) and the GRU's blocks projected by their own
    node (at any size), the layers' outputs and gradients are the reference loop's (float64),
    and the C GEMM ran."""
    from layernorm.recurrent import _fused

    calls = []
    c_gemm = _cstep.rnn.matmul
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: True)
    monkeypatch.setattr(_cstep.rnn, "matmul", lambda *a: calls.append(1) or c_gemm(*a))
    monkeypatch.setattr(_cstep, "_INPUT_PRODUCT_MIN", 0)
    monkeypatch.setattr(_fused, "_LOOP_PROJECTION_MAX_BYTES", 0)
    monkeypatch.setattr(_fused, "_PROJECTION_NODE_BYTES", 0)  # the GRU's blocks: raw_projection
    torch.manual_seed(0)
    model = LAYERS[kind](6, 8, num_layers=2, bidirectional=True, dtype=torch.float64)
    x = 0.5 + torch.randn(5, 40, 6, dtype=torch.float64)
    results = []
    for impl in ("fused", "loop"):
        model.impl = impl
        model.zero_grad()
        xg = x.clone().requires_grad_(mode == "training")
        with torch.set_grad_enabled(mode == "training"):
            out, state = model(xg)
        flat = [out, *(state if isinstance(state, tuple) else (state,))]
        if mode == "training":
            sum((t * t).sum() for t in flat).backward()
            flat += [xg.grad, *(p.grad for p in model.parameters())]
        results.append([t.detach() for t in flat])
        if impl == "fused":
            assert calls, "the C GEMM did not run"
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


@pytest.mark.parametrize("bias", [True, False])
def test_an_unnormalized_projection_without_gradients_takes_the_input_product(
    bias, monkeypatch
) -> None:
    """``InputProjection.compute`` without layer norm (the Elman layers' input side, and every
    layer's with ``norm="none"``): where nothing is differentiated, ``input_product`` (the C GEMM
    where it outpaces torch.mm) and the folded bias added in place; with gradients ``F.linear``,
    differentiable, and where the C GEMM would not be taken. The same values either way; the
    Elman layer's inference the reference loop's."""
    from layernorm.recurrent import _fused

    calls = []
    product = _cstep.input_product
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: True)
    monkeypatch.setattr(_cstep, "_INPUT_PRODUCT_MIN", 0)
    monkeypatch.setattr(_cstep, "_INPUT_PRODUCT_MIN_ROWS", 0)
    monkeypatch.setattr(_cstep, "input_product", lambda *a: calls.append(1) or product(*a))
    gen = torch.Generator().manual_seed(9)
    data = torch.randn(40, 6, generator=gen, dtype=torch.float64)
    w_ih = torch.randn(12, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b_ih, b_hh = (torch.randn(12, generator=gen, dtype=torch.float64) for _ in range(2))
    source = _fused.InputProjection(data, w_ih, None, None, 1e-5, False,
                                    torch_biases=(b_ih, b_hh) if bias else None)  # fmt: skip
    want = data @ w_ih.detach().t() + ((b_ih + b_hh) if bias else 0)
    with torch.no_grad():
        got = source.compute()
    assert calls == [1]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    trained = source.compute()
    assert calls == [1] and trained.grad_fn is not None
    torch.testing.assert_close(trained.detach(), want, rtol=1e-12, atol=1e-12)
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: False)
    with torch.no_grad():  # torch.mm's rate: F.linear, one op (a one-row call's µs)
        torch.testing.assert_close(source.compute(), want, rtol=1e-12, atol=1e-12)
    assert calls == [1]
    monkeypatch.setattr(_cstep, "tile_outpaces_torch_gemm", lambda: True)
    torch.manual_seed(0)
    model = LayerNormRNN(6, 8, num_layers=2, bias=bias, dtype=torch.float64).eval()
    x = torch.randn(5, 40, 6, dtype=torch.float64)
    with torch.no_grad():
        fused = model(x)
        model.impl = "loop"
        loop = model(x)
    for a, b in zip(fused, loop, strict=True):
        torch.testing.assert_close(a, b, **TOL[torch.float64])


def test_packed_gemm_checked_on_a_small_product() -> None:
    """MKL's entry points are taken only where they give torch.mm's product on a small case: a
    compute entry that writes nothing (as one with another integer width could) is refused."""
    from layernorm.kernels.cpu import rnn

    real = rnn.torch_packed_gemm()
    if real is None:
        pytest.skip("this PyTorch exports no MKL packed GEMM")
    assert rnn._packed_gemm_multiplies(*real)
    nothing = _MKL_COMPUTE(lambda *args: None)
    assert not rnn._packed_gemm_multiplies(
        real[0], real[1], ctypes.cast(nothing, ctypes.c_void_p).value
    )


def test_packed_gemm_check_ignores_default_device_and_dtype() -> None:
    """The small-product check makes its CPU float32 tensors itself, whatever the defaults."""
    from layernorm.kernels.cpu import rnn

    real = rnn.torch_packed_gemm()
    if real is None:
        pytest.skip("this PyTorch exports no MKL packed GEMM")
    saved = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta"):
            assert rnn._packed_gemm_multiplies(*real)
    finally:
        torch.set_default_dtype(saved)
