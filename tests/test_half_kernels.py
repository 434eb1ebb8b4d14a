"""The bfloat16 and float16 CPU kernels: their conversions, bit for bit against torch's casts on
every build target the processor can run, and every norm against float64 on the same rounded
inputs (the fused error model of :mod:`tolerances`: float32 arithmetic, one final rounding)."""

from __future__ import annotations

import ctypes
import functools
import platform

import pytest
import torch

import layernorm.functional as LF
from layernorm.kernels.cpu import _native, abi, cbuild
from layernorm.reference import ada_norm_reference, layer_norm_reference, rms_norm_reference
from tolerances import UNIT_ROUNDOFF, assert_within, row_stats

pytestmark = pytest.mark.skipif(not _native.enabled(), reason="fused CPU kernels unavailable")

HALF = (torch.bfloat16, torch.float16)

# Build targets, each with the conversion code it selects, and the CPU flags it needs to run.
TARGETS = {
    "native": ((), ()),
    "x86-64": (("-march=x86-64",), ()),  # portable bit manipulation only
    "haswell": (("-march=haswell",), ("avx2", "f16c", "fma")),  # AVX2 shifts, F16C
    "skylake-avx512": (  # AVX-512F conversions, no bfloat16 instruction
        ("-march=skylake-avx512",),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    ),
    "avx512-bf16": (  # AVX512-BF16 vcvtneps2bf16 (which flushes subnormals: handled apart)
        (
            "-march=x86-64",
            "-mavx2",
            "-mfma",
            "-mf16c",
            "-mavx512f",
            "-mavx512bw",
            "-mavx512vl",
            "-mavx512bf16",
        ),
        ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16"),
    ),
}


def _cpu_flags() -> set[str]:
    return set(cbuild.cpu_flags().split(":", 1)[-1].split())


@functools.cache
def _library(target: str) -> ctypes.CDLL:
    flags, needs = TARGETS[target]
    if target == "native":  # the selected target's library, as the ops load it
        return ctypes.CDLL(str(_native._build()))
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 build targets")
    missing = [f for f in needs if f not in _cpu_flags()]
    if missing:
        pytest.skip(f"this processor lacks {missing}")
    path = cbuild.build_shared_library(
        _native.SOURCES, f"layernorm_cpu_{target}", _native.EXTRA_FLAGS, isa_flags=flags
    )
    return ctypes.CDLL(str(path))


def _run(target: str, name: str, **values: object) -> None:
    """Kernel ``name`` of the ``target`` build on checked arguments (parameters in the compute
    type where ``half_params`` is not given)."""
    x = values["x"]
    assert isinstance(x, torch.Tensor)
    kernel = abi.BY_NAME[name]
    if any(a.name == abi.HALF_PARAMS for a in kernel.args):
        values.setdefault(abi.HALF_PARAMS, 0)
    args = abi.Binder(kernel)(values)
    fn = getattr(_library(target), f"{name}_{abi.INSTANCES[x.dtype].suffix}")
    fn.restype = ctypes.c_int
    fn.argtypes = (ctypes.POINTER(abi.structure(kernel, x.dtype)),)
    assert fn(ctypes.byref(args)) == 0


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _float_cases(dtype: torch.dtype) -> torch.Tensor:
    """float32 values that exercise rounding to ``dtype``: every value of dtype, the midpoints
    between neighbours (ties) and the floats either side of them, random bit patterns over the
    whole range, float32 subnormals, the overflow threshold, infinities, NaNs."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    v = every.double()
    v = v[v.isfinite()].unique()
    mid = ((v[1:] + v[:-1]) / 2).float()
    assert bool((mid.double() == (v[1:] + v[:-1]) / 2).all())  # ties are exact in float32
    inf = torch.tensor(float("inf"))
    near = torch.cat([torch.nextafter(mid, inf), torch.nextafter(mid, -inf)])
    g = torch.Generator().manual_seed(0)
    rand = torch.randint(-(1 << 31), 1 << 31, (1 << 18,), generator=g, dtype=torch.int64)
    rand = rand.to(torch.int32).view(torch.float32)
    big = torch.finfo(dtype).max
    special = torch.tensor(
        [0.0, -0.0, 1e-40, -1e-40, 1.4e-45, 2**-126, 2**-25, 2**-24 * 1.5, 2**-149 * 3,
         big, float(big) * (1 + 2**-9), 65519.996, 65520.0, 65536.0, 3.4e38, float("inf"),
         -float("inf"), float("nan")],
        dtype=torch.float32,
    )  # fmt: skip
    payload_nan = torch.tensor([0x7F800001, -0x007FFFFF, 0x7FC12345], dtype=torch.int32)
    return torch.cat([every.float(), mid, near, rand, special, payload_nan.view(torch.float32)])


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_conversions_match_torch_casts_bit_for_bit(dtype, target):
    """half -> float32 on every one of the 65536 patterns and float32 -> half (round to nearest
    even, subnormals kept, overflow to infinity) as torch's own casts; a NaN stays a NaN."""
    x = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    yf = _float_cases(dtype)
    n = max(x.numel(), yf.numel())
    x = x.repeat(n // x.numel() + 1)[:n].reshape(1, n)
    yf = yf.repeat(n // yf.numel() + 1)[:n].reshape(1, n)
    xf, y = torch.empty(1, n), torch.empty_like(x)
    _run(target, "cvt", x=x, xf=xf, yf=yf, y=y)
    want_xf, want_y = x.float(), yf.to(dtype)
    for got, want, what in ((xf, want_xf, "to float32"), (y, want_y, f"to {dtype}")):
        nan = want.isnan()
        assert torch.equal(got.isnan(), nan), what
        bad = (_bits(got) != _bits(want)) & ~nan
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 1])
            src = (x if what == "to float32" else yf)[0, i]
            raise AssertionError(f"{what}: {src.item()!r} gave {got[0, i].item()!r}, "
                                 f"torch {want[0, i].item()!r}")  # fmt: skip


def _ln_case(target: str, dtype: torch.dtype, m: int, n: int, offset: float) -> None:
    g = torch.Generator().manual_seed(m * 7919 + n)
    x64 = torch.randn(m, n, generator=g, dtype=torch.float64) * 2 + offset
    x = x64.to(dtype)
    w = (1 + 0.5 * torch.randn(n, generator=g)).float()
    b = (0.5 * torch.randn(n, generator=g)).float()
    dy = torch.randn(m, n, generator=g).to(dtype)
    y, mean, rstd = torch.empty_like(x), torch.empty(m), torch.empty(m)
    _run(target, "ln_fwd", x=x, weight=w, bias=b, y=y, mean=mean, rstd=rstd, eps=1e-5, threads=2,
         stream=1)  # fmt: skip
    dx, dw, db = torch.empty_like(x), torch.empty(n), torch.empty(n)
    _run(target, "ln_bwd", dy=dy, x=x, mean=mean, rstd=rstd, weight=w, dx=dx, dweight=dw,
         dbias=db, detach_mean=0, detach_std=0, threads=2, stream=1)  # fmt: skip
    xr, wr, br = (t.double().requires_grad_() for t in (x, w, b))
    yr = layer_norm_reference(xr, (n,), wr, br, 1e-5)
    dxr, dwr, dbr = torch.autograd.grad(yr, (xr, wr, br), dy.double())
    xhat, rs, kappa = row_stats(x.double(), 1e-5)
    xmax = xhat.abs().amax(-1, keepdim=True)
    w64, dy64 = w.double(), dy.double()
    y_scale = w64.abs().max() * (xmax + kappa) + b.double().abs().max()
    dx_scale = rs * (dy64 * w64).abs().amax(-1, keepdim=True) * (1 + xmax) * kappa
    what = f"{target} {dtype} ({m}, {n}) offset {offset}"
    assert_within(y, yr, "y", dtype, y_scale, what, fused=True)
    assert_within(dx, dxr, "dx", dtype, dx_scale, what, fused=True)
    dw_scale = (dy64.abs() * (xhat.abs() + kappa)).sum(0)
    assert_within(dw, dwr, "dparam", dtype, dw_scale, what + " dweight", fused=True)
    assert_within(db, dbr, "dparam", dtype, dy64.abs().sum(0), what + " dbias", fused=True)


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_every_build_target_within_the_error_model(dtype, target):
    """The layer-norm kernels of each build (each picks other conversion code, and the compiler
    may contract other products into FMAs) against float64, rows split over two threads."""
    for m, n, offset in ((5, 33, 3.0), (64, 768, 0.5), (3, 4099, 1e2), (2, 9000, -3.0)):
        _ln_case(target, dtype, m, n, offset)


def _outputs_like(x: torch.Tensor, offset: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two zeroed tensors of x's shape and dtype, each starting `offset` elements into its own
    storage (1: off the cache line the streamed stores start on)."""
    out = []
    for _ in range(2):
        flat = torch.zeros(x.numel() + offset, dtype=x.dtype)
        out.append(flat[offset:].view(x.shape))
    return out[0], out[1]


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned output", "output off a cache line"])
def test_streamed_outputs_equal_plain_stores(dtype, target, offset):
    """stream = 1 (non-temporal stores for an output run's whole cache lines where it is whole
    lines or long, plain stores for the rest, the next block's rows prefetched) writes the bits
    stream = 0 writes, for every kernel and over several blocks of rows (forward blocks of 1024
    elements, backward with dw/db of 8192), rows of a multiple of 16 elements and not, two
    threads."""
    g = torch.Generator().manual_seed(5)
    for m, n in ((400, 48), (300, 37), (9, 1000)):
        x = (torch.randn(m, n, generator=g) * 3 + 1).to(dtype)
        dy = torch.randn(m, n, generator=g).to(dtype)
        w, b = 1 + torch.randn(n, generator=g), torch.randn(n, generator=g)
        stats = {k: torch.empty(m) for k in ("mean", "rstd")}
        common = {"threads": 2}
        y = _outputs_like(x, offset)
        for st in (0, 1):
            _run(target, "ln_fwd", x=x, weight=w, bias=b, y=y[st], eps=1e-5, stream=st,
                 **stats, **common)  # fmt: skip
        assert torch.equal(_bits(y[0]), _bits(y[1])), ("ln_fwd", m, n)
        dx, dws = _outputs_like(x, offset), [(torch.empty(n), torch.empty(n)) for _ in range(2)]
        for st in (0, 1):
            _run(target, "ln_bwd", dy=dy, x=x, weight=w, dx=dx[st], dweight=dws[st][0],
                 dbias=dws[st][1], detach_mean=0, detach_std=0, stream=st, **stats,
                 **common)  # fmt: skip
        assert torch.equal(_bits(dx[0]), _bits(dx[1])), ("ln_bwd", m, n)
        assert torch.equal(dws[0][0], dws[1][0]) and torch.equal(dws[0][1], dws[1][1])
        y = _outputs_like(x, offset)
        for st in (0, 1):
            _run(target, "rms_fwd", x=x, weight=w, y=y[st], rstd=stats["rstd"], eps=1e-6,
                 stream=st, **common)  # fmt: skip
        assert torch.equal(_bits(y[0]), _bits(y[1])), ("rms_fwd", m, n)
        dx = _outputs_like(x, offset)
        for st in (0, 1):
            _run(target, "rms_bwd", dy=dy, x=x, rstd=stats["rstd"], weight=w, dx=dx[st],
                 dweight=None, stream=st, **common)  # fmt: skip
        assert torch.equal(_bits(dx[0]), _bits(dx[1])), ("rms_bwd", m, n)
        z = _outputs_like(x, offset)
        for st in (0, 1):
            _run(target, "ada_fwd", x=x, z=z[st], eps=1e-5, k=0.1, scale=2.0, stream=st, **stats,
                 **common)  # fmt: skip
        assert torch.equal(_bits(z[0]), _bits(z[1])), ("ada_fwd", m, n)
        dx = _outputs_like(x, offset)
        for st in (0, 1):
            _run(target, "ada_bwd", dz=dy, x=x, dx=dx[st], k=0.1, scale=2.0, stream=st,
                 **stats, **common)  # fmt: skip
        assert torch.equal(_bits(dx[0]), _bits(dx[1])), ("ada_bwd", m, n)
        assert bool(y[0].isfinite().all() and dx[0].isfinite().all())


def _param_calls(target, x, dy, w, b, half, threads):
    """ln_fwd, ln_bwd, rms_fwd and rms_bwd of one build with gain ``w`` and bias ``b`` (each may
    be None), in x's dtype with ``half`` = 1, else converted to float32: every output."""
    m, n = x.shape
    if not half:
        w, b = (None if t is None else t.float() for t in (w, b))
    pdt = x.dtype if half else torch.float32
    common = {"threads": threads, "stream": 0, "half_params": half}
    y, mean, rstd = torch.empty_like(x), torch.empty(m), torch.empty(m)
    _run(target, "ln_fwd", x=x, weight=w, bias=b, y=y, mean=mean, rstd=rstd, eps=1e-5, **common)
    dx, db = torch.empty_like(x), torch.empty(n)
    dw = None if w is None else torch.empty(n, dtype=pdt)
    _run(target, "ln_bwd", dy=dy, x=x, mean=mean, rstd=rstd, weight=w, dx=dx, dweight=dw,
         dbias=db, detach_mean=0, detach_std=0, **common)  # fmt: skip
    ry, rr = torch.empty_like(x), torch.empty(m)
    _run(target, "rms_fwd", x=x, weight=w, y=ry, rstd=rr, eps=1e-6, **common)
    rdx, rdw = torch.empty_like(x), None if w is None else torch.empty(n, dtype=pdt)
    _run(target, "rms_bwd", dy=dy, x=x, rstd=rr, weight=w, dx=rdx, dweight=rdw, **common)
    return {"y": y, "mean": mean, "rstd": rstd, "dx": dx, "dweight": dw, "dbias": db,
            "rms y": ry, "rms rstd": rr, "rms dx": rdx, "rms dweight": rdw}  # fmt: skip


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_params_give_the_bits_of_float32_params(dtype, target):
    """Gains and biases in x's half type (``half_params`` = 1, converted in C) give the bits
    their float32 values give, and the gain's gradient that float32 gradient rounded once (as
    torch's cast rounds it): layer norm and RMSNorm, forward and backward, gain and bias alone
    or together, one and two threads, rows of one element up to several blocks."""
    g = torch.Generator().manual_seed(11)
    for m, n in ((1, 1), (7, 33), (64, 768), (3, 4099)):
        x = (torch.randn(m, n, generator=g) * 2 + 1).to(dtype)
        dy = torch.randn(m, n, generator=g).to(dtype)
        w = (1 + 0.5 * torch.randn(n, generator=g)).to(dtype)
        b = (0.5 * torch.randn(n, generator=g)).to(dtype)
        for threads in (1, 2):
            for wb in ((w, b), (w, None), (None, b), (None, None)):
                as_f32 = _param_calls(target, x, dy, *wb, 0, threads)
                as_half = _param_calls(target, x, dy, *wb, 1, threads)
                for key, want in as_f32.items():
                    got = as_half[key]
                    what = (key, m, n, threads, [t is not None for t in wb])
                    if want is None:
                        assert got is None, what
                        continue
                    if key.endswith("dweight"):
                        want = want.to(dtype)  # the float32 sum, rounded once
                    assert got.dtype == want.dtype, what
                    assert torch.equal(_bits(got), _bits(want)), what


def _forward_outputs(target: str, op: str, x: torch.Tensor, w, b) -> dict[str, torch.Tensor]:
    """Forward kernel ``op`` of the ``target`` build on ``x`` (gain and bias in float32, or in
    x's half type, or None): its output and statistics."""
    m = x.shape[0]
    y = torch.empty_like(x)
    stats = {"rstd": torch.empty(m)} if op == "rms" else {"mean": torch.empty(m),
                                                          "rstd": torch.empty(m)}  # fmt: skip
    half = int(any(p is not None and p.dtype == x.dtype != torch.float32 for p in (w, b)))
    if op == "ln":
        _run(target, "ln_fwd", x=x, weight=w, bias=b, y=y, eps=1e-5, threads=2, stream=0,
             half_params=half, **stats)  # fmt: skip
    elif op == "rms":
        _run(target, "rms_fwd", x=x, weight=w, y=y, eps=1e-6, threads=2, stream=0,
             half_params=half, **stats)  # fmt: skip
    else:
        _run(target, "ada_fwd", x=x, z=y, eps=1e-5, k=0.1, scale=2.0, threads=2, stream=0,
             **stats)  # fmt: skip
    return {"y": y, **stats}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_forwards_are_the_float32_kernels_rounded_once(dtype, target):
    """The contract of the half kernels (norms_half_impl.h): a forward's output is the float32
    kernel's output on the exactly converted input, rounded once to the half type, and its
    statistics are the float32 kernel's, bit for bit. Over narrow rows (blocks of converted
    rows) and wide ones (read in place, their output a chunk of 256 columns at a time: widths
    around the chunk and the vectors, tails included), gain and bias or not, layer norm, RMSNorm
    and AdaNorm; gains and biases in float32 and in x's half type (against the float32 kernel
    with their float32 values: wide rows convert them in registers)."""
    g = torch.Generator().manual_seed(13)
    for m, n in ((9, 1), (40, 64), (17, 65), (5, 256), (6, 257), (4, 1000), (3, 2048),
                 (3, 4099)):  # fmt: skip
        x = (torch.randn(m, n, generator=g) * 3 + 2).to(dtype)
        x[0, : n // 2] = x[0, 0]  # a row half constant
        w, b = 1 + torch.randn(n, generator=g), torch.randn(n, generator=g)
        wh, bh = w.to(dtype), b.to(dtype)
        cases = {"ln": ((w, b), (w, None), (None, b), (None, None), (wh, bh), (wh, None)),
                 "rms": ((w, None), (None, None), (wh, None)), "ada": ((None, None),)}  # fmt: skip
        for op, params in cases.items():
            for pw, pb in params:
                got = _forward_outputs(target, op, x, pw, pb)
                as_f32 = [None if p is None else p.float() for p in (pw, pb)]
                want = _forward_outputs(target, op, x.float(), *as_f32)
                want["y"] = want["y"].to(dtype)
                what = (op, m, n, pw is not None and pw.dtype, pb is not None and pb.dtype)
                for key, value in want.items():
                    assert torch.equal(_bits(got[key]), _bits(value)), (key, *what)


def _backward_outputs(target: str, op: str, dy, x, w, flags, threads) -> dict[str, torch.Tensor]:
    """Backward kernel ``op`` of the ``target`` build on dy and x, gain w in float32 (or None),
    with the statistics of the float32 forward of x's float32 values (the same for both
    dtypes); ``flags``: (detach_mean, detach_std) of layer norm. dx and the parameters'
    float32 gradients."""
    n = x.shape[1]
    xf = x.float()
    stats = _forward_outputs(target, "rms" if op == "rms" else "ln", xf, None, None)
    dx = torch.empty_like(x)
    out = {"dx": dx}
    if op == "ln":
        out["dweight"] = None if w is None else torch.empty(n)
        out["dbias"] = torch.empty(n)
        _run(target, "ln_bwd", dy=dy, x=x, mean=stats["mean"], rstd=stats["rstd"], weight=w,
             dx=dx, dweight=out["dweight"], dbias=out["dbias"], detach_mean=flags[0],
             detach_std=flags[1], threads=threads, stream=0)  # fmt: skip
    elif op == "rms":
        out["dweight"] = None if w is None else torch.empty(n)
        _run(target, "rms_bwd", dy=dy, x=x, rstd=stats["rstd"], weight=w, dx=dx,
             dweight=out["dweight"], threads=threads, stream=0)  # fmt: skip
    else:
        _run(target, "ada_bwd", dz=dy, x=x, mean=stats["mean"], rstd=stats["rstd"], dx=dx,
             k=0.1, scale=2.0, threads=threads, stream=0)  # fmt: skip
    return {k: v for k, v in out.items() if v is not None}


@pytest.mark.parametrize("target", list(TARGETS))
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_half_backwards_are_the_float32_kernels_rounded_once(dtype, target):
    """The half kernels' contract for the backwards: dx is the float32 kernel's dx on the exactly
    converted dy and x rounded once to the half type, and the gain's and bias's float32
    gradients are the float32 kernel's, bit for bit (the same sums in the same order: rows in
    pairs, flushed to float64 every 16 rows). Layer norm with each DetachNorm setting, gain or
    not, RMSNorm, AdaNorm; one and two threads; odd row counts (a pair short) and widths around
    the vectors and the output chunks."""
    g = torch.Generator().manual_seed(17)
    for m, n in ((9, 1), (40, 64), (17, 65), (5, 256), (7, 300), (4, 1000), (3, 2048),
                 (3, 4099), (37, 513)):  # fmt: skip
        x = (torch.randn(m, n, generator=g) * 3 + 2).to(dtype)
        dy = torch.randn(m, n, generator=g).to(dtype)
        w = 1 + torch.randn(n, generator=g)
        cases = [("ln", w, (0, 0)), ("ln", None, (0, 0)), ("ln", w, (1, 0)), ("ln", w, (0, 1)),
                 ("ln", w, (1, 1)), ("rms", w, (0, 0)), ("rms", None, (0, 0)),
                 ("ada", None, (0, 0))]  # fmt: skip
        for op, pw, flags in cases:
            for threads in (1, 2):
                got = _backward_outputs(target, op, dy, x, pw, flags, threads)
                want = _backward_outputs(target, op, dy.float(), x.float(), pw, flags, threads)
                want["dx"] = want["dx"].to(dtype)
                for key, value in want.items():
                    what = (key, op, m, n, pw is not None, flags, threads)
                    assert torch.equal(_bits(got[key]), _bits(value)), what


# ------------------------------------------------------------------ through the public ops


def _leaves(dtype, pdt, m, n, offset, seed=0, constant=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, n, generator=g, dtype=torch.float64) * 2 + offset
    if constant:
        x[:] = x[:, :1]
    x = x.to(dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(n, generator=g, dtype=torch.float64)).to(pdt).requires_grad_()
    b = (0.5 * torch.randn(n, generator=g, dtype=torch.float64)).to(pdt).requires_grad_()
    dy = torch.randn(m, n, generator=g, dtype=torch.float64).to(dtype)
    return x, w, b, dy


VARIANTS = {
    "ln": lambda x, w, b, n: LF.layer_norm(x, n, w, b),
    "ln no affine": lambda x, w, b, n: LF.layer_norm(x, n),
    "ln gain only": lambda x, w, b, n: LF.layer_norm(x, n, w),
    "detach_mean": lambda x, w, b, n: LF.layer_norm(x, n, w, b, detach_mean=True),
    "detach_std": lambda x, w, b, n: LF.layer_norm(x, n, w, b, detach_std=True),
    "detach both": lambda x, w, b, n: LF.layer_norm(x, n, w, b, detach_mean=True,
                                                    detach_std=True),
    "rms": lambda x, w, b, n: LF.rms_norm(x, n, w, eps=1e-6),
    "rms no gain": lambda x, w, b, n: LF.rms_norm(x, n, eps=1e-6),
    "ada": lambda x, w, b, n: LF.ada_norm(x, n, 0.1, 2.0),
}  # fmt: skip

REFERENCES = {
    "ln": lambda x, w, b, n: layer_norm_reference(x, (n,), w, b),
    "ln no affine": lambda x, w, b, n: layer_norm_reference(x, (n,)),
    "ln gain only": lambda x, w, b, n: layer_norm_reference(x, (n,), w),
    "detach_mean": lambda x, w, b, n: layer_norm_reference(x, (n,), w, b, 1e-5, True, False),
    "detach_std": lambda x, w, b, n: layer_norm_reference(x, (n,), w, b, 1e-5, False, True),
    "detach both": lambda x, w, b, n: layer_norm_reference(x, (n,), w, b, 1e-5, True, True),
    "rms": lambda x, w, b, n: rms_norm_reference(x, (n,), w, 1e-6),
    "rms no gain": lambda x, w, b, n: rms_norm_reference(x, (n,), None, 1e-6),
    "ada": lambda x, w, b, n: ada_norm_reference(x, (n,), 0.1, 2.0),
}


def _used(variant: str) -> tuple[bool, bool]:
    """(uses the gain, uses the bias)."""
    if variant in ("ln no affine", "rms no gain", "ada"):
        return False, False
    if variant in ("ln gain only", "rms"):
        return True, False
    return True, True


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("pdt", ["x's", torch.float32], ids=["params in x's dtype", "float32"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize(("m", "n", "offset"), [(1, 1, 0.0), (7, 3, 1.0), (33, 1000, 3.0),
                                                (4, 4097, 1e3), (2, 20000, -20.0)])  # fmt: skip
def test_half_norms_forward_backward_against_float64(variant, pdt, dtype, m, n, offset):
    pdt = dtype if pdt == "x's" else pdt
    x, w, b, dy = _leaves(dtype, pdt, m, n, offset, seed=m + n)
    uses_w, uses_b = _used(variant)
    assert _native.supports(x.detach(), w, b, same=(dy,))  # the fused kernels, not a fallback
    y = VARIANTS[variant](x, w, b, n)
    assert y.dtype == dtype
    leaves = [x] + [t for t, used in ((w, uses_w), (b, uses_b)) if used]
    grads = torch.autograd.grad(y, leaves, dy)
    for got, leaf in zip(grads, leaves, strict=True):
        assert got.dtype == leaf.dtype
    refs = [t.detach().double().requires_grad_() for t in (x, w, b)]
    yr = REFERENCES[variant](*refs, n)
    ref_leaves = [refs[0]] + [t for t, used in ((refs[1], uses_w), (refs[2], uses_b)) if used]
    grads_r = torch.autograd.grad(yr, ref_leaves, dy.double())

    centred = not variant.startswith("rms")
    eps = 1e-6 if not centred else 1e-5
    xhat, rstd, kappa = row_stats(x.detach().double(), eps, centred=centred)
    xmax = xhat.abs().amax(-1, keepdim=True)
    w64 = w.detach().double() if uses_w else torch.ones(n, dtype=torch.float64)
    b64 = b.detach().double() if uses_b else torch.zeros(n, dtype=torch.float64)
    dy64 = dy.double()
    if variant == "ada":
        y_scale = 2.0 * (xmax + kappa) * (1 + 0.2 * xmax)
        g = dy64.abs() * 2.0 * (1 + 0.1 * xhat.abs())
    else:
        y_scale = w64.abs().max() * (xmax + kappa) + b64.abs().max()
        g = (dy64 * w64).abs()
    dx_scale = rstd * g.amax(-1, keepdim=True) * (1 + xmax) * kappa
    what = f"{variant} {dtype} params {pdt} ({m}, {n})"
    assert_within(y, yr, "y", dtype, y_scale, what + " y", fused=True)
    assert_within(grads[0], grads_r[0], "dx", dtype, dx_scale, what + " dx", fused=True)
    dparam_scales = [(dy64.abs() * (xhat.abs() + kappa)).sum(0), dy64.abs().sum(0)]
    for k, (got, ref) in enumerate(zip(grads[1:], grads_r[1:], strict=True)):
        # dweight/dbias in the param's dtype: its rounding, not x's
        assert_within(got, ref, "dparam", dtype, dparam_scales[k], f"{what} dparam {k}",
                      fused=True)  # fmt: skip


@pytest.mark.parametrize("pdt", ["x's", torch.float32], ids=["params in x's dtype", "float32"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize(("value", "n"), [(1e3 + 0.5, 1000), (-3.1, 33), (12345.678, 5000)])
def test_constant_rows_give_the_bias_exactly(value, n, dtype, pdt):
    pdt = dtype if pdt == "x's" else pdt
    x, w, b, dy = _leaves(dtype, pdt, 3, n, 0.0, seed=n, constant=True)
    with torch.no_grad():
        x.fill_(value)
    y = LF.layer_norm(x, n, w, b)
    assert torch.equal(y, b.detach().to(dtype).expand(3, n))
    assert torch.equal(LF.layer_norm(x.detach(), n), torch.zeros(3, n, dtype=dtype))
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    assert torch.equal(dw, torch.zeros_like(dw))  # x̂ = 0 exactly
    assert db.dtype == pdt and dw.dtype == pdt
    # dx = rstd·(g − mean(g)), rstd = 1/sqrt(eps): float32's error and the rounding to x's dtype
    xr = x.detach().double().requires_grad_()
    yr = layer_norm_reference(xr, (n,), w.detach().double(), b.detach().double())
    (dxr,) = torch.autograd.grad(yr, xr, dy.double())
    rel = (dx.double() - dxr).abs().max() / dxr.abs().max()
    assert rel <= 64 * UNIT_ROUNDOFF[torch.float32] + 2 * UNIT_ROUNDOFF[dtype], rel
    dy64 = dy.double()
    assert_within(db, dy64.sum(0), "dparam", dtype, dy64.abs().sum(0), "dbias", fused=True)


@pytest.mark.parametrize("op", ["ln", "rms", "ada"])
@pytest.mark.parametrize("dtype", HALF, ids=str)
def test_nan_stays_in_its_row(dtype, op):
    x = (torch.randn(6, 1000, dtype=torch.float64) + 2).to(dtype)
    x[2, 17] = float("nan")
    x.requires_grad_()
    fns = {"ln": lambda t: LF.layer_norm(t, 1000), "rms": lambda t: LF.rms_norm(t, 1000),
           "ada": lambda t: LF.ada_norm(t, 1000)}  # fmt: skip
    y = fns[op](x)
    (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
    for t in (y, dx):
        assert bool(t[2].isnan().all())
        keep = torch.tensor([0, 1, 3, 4, 5])
        assert bool(t[keep].isfinite().all())


@pytest.mark.parametrize("dtype", HALF, ids=str)
@pytest.mark.parametrize(("wdt", "bdt"), [("x", torch.float32), (torch.float32, "x"),
                                          ("x", "x"), (torch.float32, torch.float32)])  # fmt: skip
def test_gain_and_bias_dtypes_mixed_give_the_float32_bits(dtype, wdt, bdt):
    """A gain and a bias each in x's half dtype or in float32, through the public op: the bits
    both in float32 give (y, dx; the gradients rounded once to each parameter's dtype), whether
    the kernels take the half parameters as they are (both in x's dtype) or convert one here."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(5, 300, generator=g) * 2 + 1).to(dtype).requires_grad_()
    dy = torch.randn(5, 300, generator=g).to(dtype)
    w32 = (1 + 0.5 * torch.randn(300, generator=g)).to(dtype).float()
    b32 = (0.5 * torch.randn(300, generator=g)).to(dtype).float()

    def run(w, b):
        w, b = w.clone().requires_grad_(), b.clone().requires_grad_()
        y = LF.layer_norm(x, 300, w, b)
        return (y, *torch.autograd.grad(y, (x, w, b), dy))

    want = run(w32, b32)
    got = run(*(t.to(dtype) if d == "x" else t for t, d in ((w32, wdt), (b32, bdt))))
    for k, (a, e) in enumerate(zip(got, want, strict=True)):
        e = e.to(a.dtype)  # a parameter's gradient: the float32 one, rounded once
        assert torch.equal(_bits(a), _bits(e)), (k, wdt, bdt)


def test_other_dtype_mixes_fall_back_to_the_eager_path():
    """bfloat16 x with a float16 or float64 gain is not a kernel instance: the ATen path runs,
    still against float64 within its own (looser) error model."""
    x = (torch.randn(8, 40, dtype=torch.float64) + 3).to(torch.bfloat16)
    for wdt in (torch.float16, torch.float64):
        w = (1 + 0.5 * torch.randn(40, dtype=torch.float64)).to(wdt)
        assert not _native.supports(x, w)
        y = LF.layer_norm(x, 40, w)
        yr = layer_norm_reference(x.double(), (40,), w.double())
        xhat, _, kappa = row_stats(x.double(), 1e-5)
        scale = w.double().abs().max() * (xhat.abs().amax(-1, keepdim=True) + kappa)
        assert_within(y, yr, "y", torch.bfloat16, scale, f"gain {wdt}")
