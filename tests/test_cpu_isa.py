"""The fused CPU kernels on every instruction-set target this CPU can run, against the references.

Each target (AVX-512, AVX2, portable on x86; AVX2 and portable are emulated on an AVX-512
processor by the compiler's target flags) is its own library, built here and switched to in-process
with :func:`layernorm.kernels.cpu.targets.use`; one test goes through ``LAYERNORM_CPU_ISA`` in a
fresh process. The norm ops are compared with the float64 reference, the recurrent layers (whose
whole-sequence GEMM is written per register file) with ``impl="loop"`` in float64 and with a float64
model in float32. The selection rules (feature checks, refusal of a target the CPU lacks) are
tested on made-up feature sets, so they are checked on any machine.
"""

from __future__ import annotations

import copy
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from torch.nn.utils.rnn import pack_sequence

import layernorm.functional as LF
from conftest import make_param, make_x, upcast
from layernorm import LayerNormGRU, LayerNormLSTM, LayerNormRNN
from layernorm.kernels.cpu import _native, cbuild, isa, rnn, rnn_abi, targets
from layernorm.recurrent import _cstep, _pointwise, register_step_kernels
from layernorm.reference import ada_norm_reference, layer_norm_reference, rms_norm_reference
from tolerances import assert_close_to_rounding

AVAILABLE = targets.available() if cbuild.compiler() is not None else ()
needs_kernels = pytest.mark.skipif(not AVAILABLE, reason="no C compiler: eager path only")
#: Every target name, each run where this CPU can, skipped (with the reason) where it cannot.
ISAS = [
    pytest.param(name, marks=pytest.mark.skipif(name not in AVAILABLE, reason=f"no {name} CPU"))
    for name in targets.NAMES
]
VECTOR_BYTES = {"avx512bf16": 64, "avx512": 64, "avx2": 32, "portable": 16}

AVX2_CPU = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2"})
AVX512_CPU = AVX2_CPU | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
AVX512_BF16_CPU = AVX512_CPU | {"avx512_bf16"}


# ------------------------------------------------------------------------------------------------
# Selection
# ------------------------------------------------------------------------------------------------


def test_best_target_follows_the_features() -> None:
    assert targets.best("x86_64", AVX512_BF16_CPU).name == "avx512bf16"
    assert targets.best("x86_64", AVX512_CPU).name == "avx512"
    assert targets.best("x86_64", AVX512_BF16_CPU - {"avx512cd"}).name == "avx2"
    assert targets.best("x86_64", AVX2_CPU).name == "avx2"
    assert targets.best("x86_64", AVX512_CPU - {"avx512bw"}).name == "avx2"
    assert targets.best("x86_64", AVX2_CPU - {"fma"}).name == "portable"
    assert targets.best("x86_64", frozenset()).name == "portable"
    arm = targets.best("aarch64", frozenset({"fp", "asimd"}))
    assert arm.name == "portable" and arm.flags == ("-march=armv8-a",)
    other = targets.best("riscv64", frozenset())
    assert other.name == "portable" and other.flags == ()


def test_every_x86_flag_is_checked_against_a_feature() -> None:
    """An ISA extension enabled at build time without a matching feature check could crash with
    an illegal instruction on a CPU that passed the check."""
    for t in targets.TARGETS:
        if "x86_64" not in t.machines:
            continue
        enabled = {f[2:] for f in t.flags if f.startswith("-m") and "=" not in f}
        # /proc/cpuinfo's spelling of each extension: its flag's name, but for these
        spelled = {"avx512bf16": "avx512_bf16"}
        assert {spelled.get(e, e) for e in enabled} <= t.features, t.name
        assert all(not f.startswith("-march=") or f == "-march=x86-64" for f in t.flags)


def test_target_the_cpu_lacks_is_refused() -> None:
    with pytest.raises(targets.UnavailableIsaError, match="lacks avx512bw, avx512cd"):
        targets.target("avx512", "x86_64", AVX2_CPU | {"avx512f", "avx512vl", "avx512dq"})
    with pytest.raises(targets.UnavailableIsaError, match="lacks avx2, fma"):
        targets.target("avx2", "x86_64", frozenset({"sse4_2", "avx", "f16c"}))
    with pytest.raises(targets.UnavailableIsaError, match="not built for aarch64"):
        targets.target("avx2", "aarch64", frozenset({"asimd"}))
    with pytest.raises(targets.UnavailableIsaError, match="unknown CPU instruction set 'sse9'"):
        targets.target("sse9", "x86_64", AVX512_CPU)


def test_target_the_compiler_rejects_is_not_chosen(monkeypatch) -> None:
    """A CPU with AVX512-BF16 and a compiler without -mavx512bf16 (GCC before 10) gets the
    AVX-512 build, not a build that would fail and leave only the eager fallback."""
    monkeypatch.setattr(targets, "machine", lambda: "x86_64")
    monkeypatch.setattr(targets, "cpu_features", lambda: AVX512_BF16_CPU)
    monkeypatch.setattr(cbuild, "accepts_flags", lambda flags: "-mavx512bf16" not in flags)
    assert targets.best().name == "avx512"
    assert targets.available() == ("avx512", "avx2", "portable")
    with pytest.raises(targets.UnavailableIsaError, match="does not accept the avx512bf16"):
        targets.target("avx512bf16")
    # made-up feature sets describe a CPU, not this machine's compiler
    assert targets.best("x86_64", AVX512_BF16_CPU).name == "avx512bf16"
    monkeypatch.setattr(cbuild, "accepts_flags", lambda flags: False)
    assert targets.best().name == "portable"  # always offered: its build decides


@pytest.mark.skipif(cbuild.compiler() is None, reason="no C compiler")
def test_accepts_flags_asks_the_compiler() -> None:
    assert cbuild.accepts_flags(("-O2",))
    assert not cbuild.accepts_flags(("-mno-such-extension-layernorm",))


@pytest.mark.parametrize(
    ("requested", "message"),
    [("avx512", "lacks avx512"), ("sse9", "unknown CPU instruction set")],
)
def test_environment_refusal_warns_and_uses_the_best_target(monkeypatch, requested, message):
    monkeypatch.setattr(targets, "machine", lambda: "x86_64")
    monkeypatch.setattr(targets, "cpu_features", lambda: AVX2_CPU)
    monkeypatch.setenv(targets.ENV_ISA, requested)
    with pytest.warns(RuntimeWarning, match=f"{targets.ENV_ISA}={requested} refused.*{message}"):
        chosen = targets._from_environment()
    assert chosen.name == "avx2"


def test_environment_choice_and_default(monkeypatch) -> None:
    monkeypatch.setattr(targets, "machine", lambda: "x86_64")
    monkeypatch.setattr(targets, "cpu_features", lambda: AVX512_CPU)
    monkeypatch.setenv(targets.ENV_ISA, "AVX2")
    assert targets._from_environment().name == "avx2"
    monkeypatch.delenv(targets.ENV_ISA)
    assert targets._from_environment().name == "avx512"


def test_use_switches_and_restores() -> None:
    before = isa()
    with targets.use("portable") as chosen:
        assert chosen.name == "portable" and isa() == "portable"
    assert isa() == before
    unavailable = [n for n in targets.NAMES if n not in targets.available()]
    for name in unavailable:
        with pytest.raises(targets.UnavailableIsaError), targets.use(name):
            pass
        assert isa() == before


# ------------------------------------------------------------------------------------------------
# Norm kernels per target
# ------------------------------------------------------------------------------------------------

# (atol, rtol) against float64, as in test_cpu_fast_paths.py.
NORM_TOL = {
    torch.float32: {"y": (1e-5, 1e-5), "dx": (2e-5, 2e-5), "dparam": (2e-5, 2e-5)},
    torch.float64: {"y": (1e-10, 1e-10), "dx": (1e-9, 1e-9), "dparam": (1e-10, 1e-9)},
}
NORMS = {
    "layer": (layer_norm_reference, True, True),
    "rms": (rms_norm_reference, True, False),
    "ada": (ada_norm_reference, False, False),
}


def _norm(kind: str, x, w, b, reference: bool):
    n = x.shape[-1]
    if kind == "layer":
        return (layer_norm_reference if reference else LF.layer_norm)(x, (n,), w, b, 1e-5)
    if kind == "rms":
        return (rms_norm_reference if reference else LF.rms_norm)(x, (n,), w, eps=1e-6)
    return (ada_norm_reference if reference else LF.ada_norm)(x, (n,), k=0.1, scale=2.0)


def _close(actual, expected, tol, what, scale=1.0) -> None:
    atol, rtol = tol
    torch.testing.assert_close(actual.double(), expected.double(), atol=atol * scale, rtol=rtol,
                               msg=lambda m: f"{what}: {m}")  # fmt: skip


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("kind", list(NORMS))
# Widths against the kernels' loops: a row shorter than a block, one element past it, a whole
# vector past the blocks (48, 1008: the backwards' vector tail step, one row and a pair of rows at
# a time), long rows with and without a scalar tail.
@pytest.mark.parametrize(
    ("m", "n"), [(5, 31), (7, 33), (6, 48), (3, 1000), (4, 1008), (80, 1031)], ids=str
)
@pytest.mark.parametrize("stores", ["plain", "streaming"])
def test_norm_kernels_match_reference(name, dtype, kind, m, n, stores, monkeypatch) -> None:
    """Each target's kernels, with plain stores and with the outputs streamed past the caches
    (each target has its own non-temporal stores)."""
    monkeypatch.setattr(_native, "STREAM_MIN_BYTES", 0 if stores == "streaming" else 1 << 62)
    _, use_w, use_b = NORMS[kind]
    x = make_x((m, n), dtype, requires_grad=True)
    w = make_param((n,), dtype, center=1.0, requires_grad=True) if use_w else None
    b = make_param((n,), dtype, center=0.0, requires_grad=True) if use_b else None
    dy = torch.randn(m, n, dtype=torch.float64).to(dtype)
    leaves = [t for t in (x, w, b) if t is not None]
    with targets.use(name):
        assert _native.supports(x.detach(), w, b), "the target's library must build and load"
        assert _native._build().name.startswith(f"layernorm_cpu_{name}_")
        y = _norm(kind, x, w, b, reference=False)
        grads = torch.autograd.grad(y, leaves, dy)
    xr, wr, br = upcast(x), upcast(w) if use_w else None, upcast(b) if use_b else None
    ref_leaves = [t for t in (xr, wr, br) if t is not None]
    yr = _norm(kind, xr, wr, br, reference=True)
    grads_r = torch.autograd.grad(yr, ref_leaves, dy.double())
    tol = NORM_TOL[dtype]
    _close(y, yr, tol["y"], "output")
    _close(grads[0], grads_r[0], tol["dx"], "dx")
    for g, gr in zip(grads[1:], grads_r[1:], strict=True):
        _close(g, gr, tol["dparam"], "dweight/dbias", scale=math.sqrt(m))


def _forward_outputs(kind: str, x, w, b) -> tuple[torch.Tensor, ...]:
    if kind == "layer":
        return _native.ln_fwd(x, w, b, 1e-5)
    if kind == "rms":
        return _native.rms_fwd(x, w, 1e-6)
    return _native.ada_fwd(x, 0.1, 2.0, 1e-5)


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    ("kind", "affine"),
    [("layer", True), ("layer", False), ("rms", True), ("rms", False), ("ada", False)],
    ids=["layer", "layer, no affine", "rms", "rms, no gain", "ada"],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_norm_forwards_in_row_groups_equal_rows_alone(name, dtype, kind, affine, threads,
                                                      monkeypatch) -> None:  # fmt: skip
    """The forwards take rows of up to 512 elements in groups of eight (norms_impl.h
    ``group_stats``: the rows' square roots and divisions as one vector): 19 rows in one call
    (two groups and a rest; with two threads each thread's rows start a group of their own) give
    the bits of each row in a call of its own, y and the statistics, at widths around the vectors
    and around the widest grouped row. Rows of different scales and offsets, so that a row
    given another's statistics would show."""
    monkeypatch.setattr(_native, "_GRAIN", 1)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with targets.use(name):
            for n in (1, 17, 64, 100, 256, 512, 513):
                x = torch.randn(19, n, dtype=torch.float64) * torch.logspace(-2, 3, 19).view(-1, 1)
                x = (x + torch.linspace(-50, 50, 19, dtype=torch.float64).view(-1, 1)).to(dtype)
                w = make_param((n,), dtype, center=1.0) if affine else None
                b = make_param((n,), dtype, center=0.0) if affine and kind == "layer" else None
                together = _forward_outputs(kind, x, w, b)
                alone = [_forward_outputs(kind, x[i : i + 1].clone(), w, b) for i in range(19)]
                for k, out in enumerate(together):
                    rows = torch.cat([one[k].reshape(1, -1) for one in alone])
                    assert torch.equal(out.reshape(19, -1), rows), f"output {k} at width {n}"
    finally:
        torch.set_num_threads(previous)


# Centred norms of one-element rows: x̂ = 0, so y is the bias and dx is exactly 0 (the gradient
# through the mean cancels the direct one). Not within a tolerance: exactly, which a multiply-add
# contracted across ``dy·w − mean(dy·w)`` breaks by rstd = 1/√eps times a rounding.
ONE_ELEMENT = {
    "layer": dict(affine=True, detach_std=False),
    "layer, no affine": dict(affine=False, detach_std=False),
    "detach_std": dict(affine=True, detach_std=True),
    "ada": dict(affine=False, detach_std=False),
}


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16],
                         ids=str)  # fmt: skip
@pytest.mark.parametrize("variant", list(ONE_ELEMENT))
def test_one_element_rows_give_exactly_zero_dx(name, dtype, variant) -> None:
    opts = ONE_ELEMENT[variant]
    x = (3 * torch.randn(37, 1, dtype=torch.float64) + 1).to(dtype).requires_grad_()
    w = (2 * torch.randn(1, dtype=torch.float64)).to(dtype) if opts["affine"] else None
    b = torch.randn(1, dtype=torch.float64).to(dtype) if opts["affine"] else None
    dy = torch.randn(37, 1, dtype=torch.float64).to(dtype)
    with targets.use(name):
        if variant == "ada":
            y = LF.ada_norm(x, (1,), k=0.1, scale=2.0)
        else:
            y = LF.layer_norm(x, (1,), w, b, 1e-5, detach_std=opts["detach_std"])
        (dx,) = torch.autograd.grad(y, (x,), dy)
    assert torch.equal(y, b.expand_as(y) if b is not None else torch.zeros_like(y)), y
    assert torch.equal(dx, torch.zeros_like(dx)), f"dx not exactly 0: max {dx.abs().max()}"


# ------------------------------------------------------------------------------------------------
# Recurrent kernels per target
# ------------------------------------------------------------------------------------------------

LAYERS = {"lstm": LayerNormLSTM, "gru": LayerNormGRU, "rnn": LayerNormRNN}


def _model(kind: str, hidden: int, dtype: torch.dtype, impl: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = LAYERS[kind](6, hidden, dtype=dtype, bidirectional=True, impl=impl)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = 0.3 * torch.randn_like(p)
            p.copy_(1.0 + noise if "ln_weight" in pname else noise)
    return model


def _run(model: torch.nn.Module, xs: list[torch.Tensor], packed: bool) -> list[torch.Tensor]:
    """Output, final states, and the gradients of inputs, initial states and parameters."""
    model.zero_grad()
    xs = [x.detach().clone().requires_grad_() for x in xs]
    dtype, batch, hidden = xs[0].dtype, len(xs), model.hidden_size
    gen = torch.Generator().manual_seed(3)
    n_states = 2 if isinstance(model, LayerNormLSTM) else 1
    # values representable in float32, so a float64 run of a float32 case sees the same ones
    hx = [torch.randn(2, batch, hidden, generator=gen).to(dtype).requires_grad_()
          for _ in range(n_states)]  # fmt: skip
    inp = pack_sequence(xs, enforce_sorted=False) if packed else torch.stack(xs, 1)
    out, h_n = model(inp, tuple(hx) if n_states == 2 else hx[0])
    data = out.data if packed else out
    h_n = h_n if isinstance(h_n, tuple) else (h_n,)
    weights = torch.linspace(-1, 2, data.numel()).to(dtype).view_as(data)
    ((data * weights).sum() + sum((s * s).sum() for s in h_n)).backward()
    grads = [*(x.grad for x in xs), *(s.grad for s in hx), *(p.grad for p in model.parameters())]
    return [data.detach(), *(s.detach() for s in h_n), *grads]


def _inputs(batch: int, packed: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    lengths = [6 - (i % 4) for i in range(batch)] if packed else [6] * batch
    return [0.5 + torch.randn(n, 6, generator=gen, dtype=torch.float64) for n in lengths]


def _run_sequence_kernels(name: str, model: torch.nn.Module, xs: list[torch.Tensor]):
    """:func:`_run` of a packed batch on target ``name``'s whole-sequence kernels (registered
    also where the target leaves them off by default)."""
    with targets.use(name):
        register_step_kernels("cpu", _pointwise.C_KERNELS)
        try:
            return _run(model, xs, packed=True)
        finally:
            register_step_kernels("cpu", None)


# Rows that fill no, one and several row tiles (6 rows with AVX2/SSE, 14 with AVX-512, split into
# near-equal tiles), hidden sizes whose gate columns end in a full panel, part of a vector and
# scalar leftovers for every vector width.
RNN_SHAPES = [(4, 16), (11, 37), (17, 8)]


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_recurrent_gemm_every_row_count(name, dtype) -> None:
    """A packed batch of 31 sequences of lengths 31 down to 1: step t has 31 − t rows, so the
    forward and backward GEMMs run every row count from 31 to 1 (the wide tile's 1–4, every case
    of the row tile up to GEMM_MR, and splits into two and three near-equal tiles) against the
    per-step loop; hidden 37 leaves a partial panel of 148 gate columns."""
    gen = torch.Generator().manual_seed(4)
    xs = [0.5 + torch.randn(n, 6, generator=gen, dtype=dtype) for n in range(31, 0, -1)]
    ours = _run_sequence_kernels(name, _model("lstm", 37, dtype, "fused"), xs)
    loop = _model("lstm", 37, dtype, "loop")
    ref = _run(loop, xs, packed=True)
    if dtype == torch.float64:
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
        return
    # float32: the loop's GEMM is torch.mm's, in another order; bound by the rounding's size here
    exact = _run(copy.deepcopy(loop).double(), [x.double() for x in xs], packed=True)
    assert_close_to_rounding(ours, ref, exact, rtol=2e-5, atol=2e-5)


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("rows", "gates", "hidden"), [(300, 64, 16), (140, 148, 37)])
def test_weight_grad_per_target_on_any_threads(name, dtype, rows, gates, hidden) -> None:
    """Each target's weight gradient dhpᵀ · hprev (``rnn.weight_grad``) shared among threads by
    its rows (16 columns: one panel on every target) or by panels: the one thread's bits, and
    torch.mm's product to rounding."""
    gen = torch.Generator().manual_seed(12)
    dhp = torch.randn(rows, gates, generator=gen, dtype=torch.float64)
    hprev = torch.randn(rows, hidden, generator=gen, dtype=torch.float64)
    with targets.use(name):
        one = rnn.weight_grad(dhp.to(dtype), hprev.to(dtype), 1, 1)
        shared = [rnn.weight_grad(dhp.to(dtype), hprev.to(dtype), t, 1) for t in (2, 3)]
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-4}
    torch.testing.assert_close(one.double(), dhp.t() @ hprev, **tol)
    for got in shared:
        assert torch.equal(got, one)


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("transposed", [True, False], ids=["x·Wᵀ", "x·W"])
@pytest.mark.parametrize(("rows", "inner", "cols"), [(9, 37, 70), (20, 64, 96), (3, 16, 33)])
def test_matmul_per_target_equals_mm(name, dtype, transposed, rows, inner, cols) -> None:
    """Each target's input-product GEMM (``rnn.matmul``), whose packing of W as stored transposes
    whole blocks of the vector's lanes in registers and the rest element by element: full and
    partial panels, inner sizes with and without a tail, torch.mm's product to rounding."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(rows, inner, generator=gen, dtype=torch.float64)
    w = torch.randn(*((cols, inner) if transposed else (inner, cols)), generator=gen,
                    dtype=torch.float64)  # fmt: skip
    with targets.use(name):
        got = rnn.matmul(x.to(dtype), w.to(dtype), transposed, torch.empty(rows, cols, dtype=dtype),
                         1, 1)  # fmt: skip
    want = x @ (w.t() if transposed else w)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got.double(), want, **tol)


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize(("batch", "hidden"), RNN_SHAPES, ids=str)
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_recurrent_kernels_match_loop_float64(name, kind, batch, hidden, packed) -> None:
    xs = _inputs(batch, packed)
    fused = _model(kind, hidden, torch.float64, "fused")
    with targets.use(name):
        if targets.machine() in ("x86_64", "amd64"):
            assert rnn.vector_bytes() == VECTOR_BYTES[name]
        kernels = _pointwise.step_kernels(xs[0])
        assert kernels is (_pointwise.C_KERNELS if rnn.sequence_enabled() else _pointwise.C_STEPS)
        ours = _run(fused, xs, packed)
        # the whole-sequence kernels too where the target leaves them off by default
        register_step_kernels("cpu", _pointwise.C_KERNELS)
        try:
            ours_seq = _run(fused, xs, packed)
        finally:
            register_step_kernels("cpu", None)
    ref = _run(_model(kind, hidden, torch.float64, "loop"), xs, packed)
    for a, a_seq, b in zip(ours, ours_seq, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(a_seq, b, rtol=1e-9, atol=1e-10)


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
def test_gates_saturate_and_nan_passes_per_target(name, kind, grad) -> None:
    """The float32 kernels' exp (the gates' sigmoid and tanh), vectorized (37 units: full vectors
    and a tail), on pre-activations far outside its clamp, at its edges and near float32's
    largest: torch's float64 layer's outputs within float32's tolerance; a NaN in one sequence
    makes that sequence's outputs NaN from its step on, and only those (the clamp passes it)."""
    ours_cls, ref_cls = LAYERS[kind], getattr(torch.nn, kind.upper())
    values = [0.5, -2.0, 87.5, -87.5, 88.5, -88.5, 100.0, -100.0, 1e30, -1e30, 3e38, -3e38]
    x = torch.tensor(values).view(-1, 1, 1).repeat(1, 2, 1)
    x[4, 1, 0] = float("nan")  # the second sequence's fifth step
    ours = ours_cls(1, 37, norm="none")
    with torch.no_grad():
        for pname, p in ours.named_parameters():
            # gates = x·w, spread over (0.5, 1]: no two gates alike
            p.copy_(torch.linspace(0.5, 1.0, p.numel()).view(p.shape) if "weight_ih" in pname
                    else torch.zeros_like(p))  # fmt: skip
    ref = ref_cls(1, 37).double()
    ref.load_state_dict({k: v.double() for k, v in ours.state_dict().items()})
    with targets.use(name), torch.set_grad_enabled(grad):
        register_step_kernels("cpu", _pointwise.C_KERNELS)
        try:
            out = ours(x.clone().requires_grad_(grad))[0].detach()
        finally:
            register_step_kernels("cpu", None)
    want = ref(x.double())[0].detach()
    assert torch.isnan(out[4:, 1]).all() and not torch.isnan(out[:4, 1]).any()
    assert not torch.isnan(out[:, 0]).any()
    tol = {"rtol": 2e-5, "atol": 2e-5}
    torch.testing.assert_close(out[:, 0].double(), want[:, 0], **tol)
    torch.testing.assert_close(out[:4, 1].double(), want[:4, 1], **tol)


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("kind", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("grad", [True, False], ids=["training", "inference"])
@pytest.mark.parametrize("rows", [3, 8])
def test_recurrent_direct_gemm_per_target(name, kind, dtype, grad, rows) -> None:
    """A decoder's call (one step of 3 or 8 rows: the GEMMs read W as stored, dot products whose
    lanes are summed four vectors at a time, or a 4 × 4 block's sixteen in one vector) on each
    target's whole-sequence kernels (also where the target leaves them off by default), with
    hidden sizes ending in part of a vector and in a block of fewer than four rows of W,
    against the float64 loop."""
    xs = [x[:1] for x in _inputs(rows, packed=False)]
    tol = {"rtol": 1e-9, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for hidden in (5, 37):
        fused = _model(kind, hidden, torch.float64, "fused").to(dtype)
        register_step_kernels("cpu", _pointwise.C_KERNELS)
        try:
            with targets.use(name), torch.set_grad_enabled(grad):
                if grad:
                    ours = _run(fused, [x.to(dtype) for x in xs], packed=False)
                else:
                    ours = [fused(torch.stack([x.to(dtype) for x in xs], 1))[0]]
        finally:
            register_step_kernels("cpu", None)
        loop = _model(kind, hidden, torch.float64, "loop")
        if grad:
            ref = _run(loop, xs, packed=False)
        else:
            with torch.no_grad():
                ref = [loop(torch.stack(xs, 1))[0]]
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a.double(), b, **tol)


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_recurrent_kernels_float32_close_to_float64(name, kind) -> None:
    """float32 on each target against the float64 loop: every value within 2e-5 of the largest
    of its tensor (the GEMMs of a build without FMA round each product, so elementwise relative
    bounds would be tighter than float32 rounding across 12 steps permits)."""
    batch, hidden = 11, 37
    xs = _inputs(batch, packed=True)
    m32 = _model(kind, hidden, torch.float64, "fused").float()
    with targets.use(name):
        ours = _run(m32, [x.float() for x in xs], packed=True)
    ref = _run(_model(kind, hidden, torch.float64, "loop"), xs, packed=True)
    for a, b in zip(ours, ref, strict=True):
        scale = b.abs().max().clamp_min(1.0).item()
        torch.testing.assert_close(a.double(), b, rtol=0, atol=2e-5 * scale)


@needs_kernels
def test_environment_variable_selects_the_target_in_a_fresh_process() -> None:
    """LAYERNORM_CPU_ISA picks the library the process loads: the last target this CPU can run
    (portable on any machine), and the layer still matches the loop."""
    name = AVAILABLE[-1]
    code = (
        "import torch\n"
        "from layernorm import LayerNormLSTM\n"
        "from layernorm.kernels.cpu import isa, rnn\n"
        "torch.manual_seed(0)\n"
        "m = LayerNormLSTM(5, 12, dtype=torch.float64)\n"
        "x = torch.randn(7, 3, 5, dtype=torch.float64)\n"
        "ref = LayerNormLSTM(5, 12, dtype=torch.float64, impl='loop')\n"
        "ref.load_state_dict(m.state_dict())\n"
        "err = (m(x)[0] - ref(x)[0]).abs().max().item()\n"
        "print(isa(), rnn._build().name.split('_')[2], err)\n"
    )
    env = {**os.environ, targets.ENV_ISA: name}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    chosen, built, err = proc.stdout.split()
    assert chosen == built == name
    assert float(err) < 1e-10


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
def test_recurrent_kernels_threaded_match_loop(name, monkeypatch) -> None:
    """With the grains at 1 each step's GEMM splits its panels (and the packing its columns)
    across two threads, and the weight gradient runs long enough (> 128 rows) to be chunked."""
    monkeypatch.setattr(_cstep, "_GEMM_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_SEQ_GEMM_GRAIN", 1)
    monkeypatch.setattr(_cstep, "_SEQ_GRAIN", 1)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for kind in LAYERS:
            xs = _inputs(40, packed=True)
            ours = _run_sequence_kernels(name, _model(kind, 37, torch.float64, "fused"), xs)
            ref = _run(_model(kind, 37, torch.float64, "loop"), xs, packed=True)
            for a, b in zip(ours, ref, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-10)
    finally:
        torch.set_num_threads(threads)


def _lstm_step_buffers(hs: int, rows: int, dtype: torch.dtype, input_norm: bool):
    """An LSTM forward step's buffers for ``rows`` rows (N = B = rows): hp and gx of rows spread
    around offsets far from zero, states and gains at random, the outputs zeroed."""
    gen = torch.Generator().manual_seed(hs * 100 + rows)

    def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return (shift + scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    g = 4 * hs
    t = {
        "hp": rand(rows, g, scale=2.0, shift=30.0),
        "gx": rand(rows, g, shift=-7.0),
        "h": rand(rows, hs),
        "c": rand(rows, hs),
        "w1": rand(g, scale=0.3, shift=1.0),
        "b1": rand(g, scale=0.3),
        "w3": rand(hs, scale=0.3, shift=1.0),
        "b3": rand(hs, scale=0.3),
    }
    t.update({k: torch.zeros(rows, c, dtype=dtype)
              for k, c in (("out", hs), ("hprev", hs), ("cprev", hs), ("acts", g), ("cn", hs),
                           ("tc", hs))})  # fmt: skip
    stats = ("mh", "rh", "mc", "rc") + (("mx", "rx") if input_norm else ())
    t.update({k: torch.zeros(rows, dtype=dtype) for k in stats})
    if input_norm:
        t.update(w0=rand(g, scale=0.3, shift=1.0), b0=rand(g, scale=0.3))
    return t


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("input_norm", [False, True], ids=["gx normalized", "gx raw"])
@pytest.mark.parametrize("group", [4, 8], ids=["groups of 4", "groups of 8"])
def test_lstm_step_rows_in_groups_equal_rows_one_by_one(name, dtype, input_norm, group) -> None:
    """The LSTM forward step finds the layer norms' statistics of a group of rows in one pass
    over the group (rnn_step_impl.h moments_rows): a step of 9 rows (groups of 4, 4, 1, or of 8
    and 1: ``rnn.use_forward_group``) gives the same bits as the 9 rows each in a call of its
    own, at hidden sizes whose rows end in part of a vector (5, 37) and span several of the row
    sums' blocks (160: 4H = 640, taken one row at a time)."""
    rows = 9
    rnn.use_forward_group(group)
    try:
        _compare_grouped_with_one_by_one(name, dtype, input_norm, rows)
    finally:
        rnn.use_forward_group(None)


def _compare_grouped_with_one_by_one(name, dtype, input_norm, rows) -> None:
    for hs in (5, 37, 160):
        runs = []
        for one_by_one in (False, True):
            t = _lstm_step_buffers(hs, rows, dtype, input_norm)
            values = {**t, "eps": 1e-5, "off": 0, "rows": 0, "threads": 1, "layer_norm": 1,
                      "normalize_cell_state": 0}  # fmt: skip
            sizes = {"N": rows, "B": rows, "H": hs, "G": 4 * hs, "R": rows, "X": rows}
            with targets.use(name):
                if not one_by_one:
                    args = rnn.prepare(rnn_abi.LSTM_FWD, dtype, values, sizes)
                    rnn.step("lstm_fwd_step", dtype, args, 0, rows, 1)
                for i in range(rows if one_by_one else 0):
                    # row i alone: a step of one row whose state is row i of h and c
                    state = {"h": t["h"][i : i + 1], "c": t["c"][i : i + 1]}
                    args = rnn.prepare(rnn_abi.LSTM_FWD, dtype, {**values, **state},
                                       {**sizes, "B": 1})  # fmt: skip
                    rnn.step("lstm_fwd_step", dtype, args, i, 1, 1)
            runs.append(t)
        grouped, alone = runs
        assert grouped["mh"].abs().sum() > 0 and grouped["rc"].abs().sum() > 0
        for key, value in grouped.items():
            assert torch.equal(value, alone[key]), (hs, key)


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
def test_gate_math_is_inlined(name) -> None:
    """The recurrent library of each target has no out-of-line copy of the gate math or of the
    row sums' helpers (fast_expf, fast_tanhf, their float64 counterparts, sigm, sld, lanes_add,
    lanes_fold: always inlined):
    called out of line, GCC's inliner having given up on a large caller, a gate loop becomes a
    call per element instead of vector code (an LN-LSTM forward step with groups of eight rows
    took 1.35x as long so)."""
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm to list the library's symbols")
    symbols = subprocess.run([nm, str(rnn._build(targets.target(name)))], capture_output=True,
                             text=True, check=True).stdout.split()  # fmt: skip
    helpers = ("fast_expf", "fast_tanhf", "sigm_", "sld_", "lanes_add_", "lanes_fold_")
    doubles = {"fast_exp", "fast_tanh", "fast_expm1_neg", "expm1_reduced"}  # (fast_exp_lo: data)
    assert not [s for s in symbols if s.startswith(helpers) or s.split(".")[0] in doubles]


@needs_kernels
@pytest.mark.parametrize("name", ISAS)
@pytest.mark.parametrize("kind", ["lstm", "gru"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("by_operator", [True, False], ids=["C++ node", "Python node"])
def test_cell_training_kernels_per_target(name, kind, dtype, by_operator, monkeypatch) -> None:
    """A cell's training step by the C cell kernels (hidden sizes ending in part of a vector) on
    each target, by the C++ operator and by the autograd.Function, against the step's ops in
    float64: the outputs and every gradient."""
    from layernorm import LayerNormGRUCell, LayerNormLSTMCell
    from layernorm.kernels.cpu import torch_ops
    from layernorm.recurrent import _cellstep

    monkeypatch.setattr(_cellstep, "KERNEL_STEP_MAX_NUMEL", 0)  # the cell's own call: the ops
    if by_operator and not torch_ops.recurrent_nodes():
        pytest.skip("the C++ operators are not loaded")
    cls, node, params = {
        "lstm": (LayerNormLSTMCell, _cellstep.lstm_node, _cellstep.LSTM_PARAMS),
        "gru": (LayerNormGRUCell, _cellstep.gru_node, _cellstep.GRU_PARAMS),
    }[kind]
    states = 2 if kind == "lstm" else 1
    gen = torch.Generator().manual_seed(3)
    tol = {"rtol": 1e-10, "atol": 1e-10} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    for hidden in (5, 37):
        cell = cls(7, hidden, dtype=torch.float64)
        with torch.no_grad():
            for p in cell.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        x = torch.randn(3, 7, generator=gen, dtype=torch.float64).requires_grad_()
        state = [torch.randn(3, hidden, generator=gen, dtype=torch.float64).requires_grad_()
                 for _ in range(2 if kind == "lstm" else 1)]  # fmt: skip
        leaves = [x, *state, *(getattr(cell, n) for n in params)]
        out = cell(x, tuple(state) if kind == "lstm" else state[0])  # the ops (float64 model)
        outs = out if isinstance(out, tuple) else (out,)
        weights = [torch.randn(o.shape, generator=gen, dtype=o.dtype) for o in outs]
        want = [*outs, *torch.autograd.grad(outs, leaves, weights)]
        with targets.use(name), torch_ops.switched(by_operator):
            low = [t.detach().to(dtype).requires_grad_() for t in leaves]
            got_out = node(*low[: 1 + states], low[1 + states :], cell.eps)
            got_outs = got_out if isinstance(got_out, tuple) else (got_out,)
            assert ("CellFn" in got_outs[0].grad_fn.name()) == by_operator
            got = [*got_outs, *torch.autograd.grad(got_outs, low, [w.to(dtype) for w in weights])]
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.double(), w.detach(), **tol)
