"""The fused C kernels of the CPU backend: against the float64 reference and the eager fallback.

test_functional.py already sends every variant through whichever CPU path is active; this file
aims at what is specific to the fused kernels: row lengths around the 32-lane partial sums and
512-element blocks, the multi-threaded split (M·N past the one-thread grain), the per-thread
dweight/dbias buffers, the switch back to eager ATen ops, and the build cache.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch

import layernorm.functional as LF
import tolerances
from conftest import make_param, make_x, upcast
from layernorm.kernels.cpu import _native, cbuild, torch_ops
from layernorm.kernels.cpu import layer_norm as cpu_layer_norm
from layernorm.reference import ada_norm_reference, layer_norm_reference, rms_norm_reference

HAVE_CC = cbuild.compiler() is not None
needs_kernels = pytest.mark.skipif(not HAVE_CC, reason="no C compiler: eager path only")

# (atol, rtol) from the error model of tolerances.py; dparam sums M rows, its atol scaled by √M
# below for the summation order.
TOL = {
    dt: {q: tolerances.simple(dt, q) for q in ("y", "dx", "dparam")}
    for dt in (torch.float32, torch.float64)
}

# N around the 32 partial-sum lanes (tails of 0, 1 and 31 elements) and long rows (1537: three
# 512-element blocks and a tail); (80, 1031) has M·N above the grain, so it runs on two threads
# whenever torch has two.
SHAPES = [(3, 1), (5, 31), (5, 32), (7, 33), (2, 65), (4, 1000), (80, 1031), (3, 1537)]

VARIANTS = {
    "ln": ("layer", True, True, {}),
    "ln_simple": ("layer", False, False, {}),
    "ln_weight_only": ("layer", True, False, {}),
    "detach_mean": ("layer", True, True, {"detach_mean": True}),
    "detach_std": ("layer", True, True, {"detach_std": True}),
    "detach_both": ("layer", True, True, {"detach_mean": True, "detach_std": True}),
    "rms": ("rms", True, False, {"eps": 1e-6}),
    "rms_no_weight": ("rms", False, False, {"eps": 1e-6}),
    "ada": ("ada", False, False, {"k": 0.1, "scale": 2.0}),
}


def _run(kind, x, w, b, opts, reference=False):
    n = x.shape[-1]
    if kind == "layer":
        fn = layer_norm_reference if reference else LF.layer_norm
        if reference:
            return fn(
                x, (n,), w, b, 1e-5, opts.get("detach_mean", False), opts.get("detach_std", False)
            )
        return fn(x, (n,), w, b, 1e-5, **opts)
    if kind == "rms":
        return (rms_norm_reference if reference else LF.rms_norm)(x, (n,), w, **opts)
    return (ada_norm_reference if reference else LF.ada_norm)(x, (n,), **opts)


def _forward_backward(kind, x, w, b, opts, dy, reference=False):
    leaves = [t for t in (x, w, b) if t is not None]
    y = _run(kind, x, w, b, opts, reference)
    grads = torch.autograd.grad(y, leaves, dy)
    return y.detach(), grads


def _close(actual, expected, tol, what, scale=1.0):
    atol, rtol = tol
    torch.testing.assert_close(
        actual.double(),
        expected.double(),
        atol=atol * scale,
        rtol=rtol,
        msg=lambda m: f"{what}: {m}",
    )


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("m", "n"), SHAPES, ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_fused_matches_reference(variant, m, n, dtype, monkeypatch):
    monkeypatch.setenv(_native.ENV_SWITCH, "1")
    assert _native.enabled(), "a C compiler is present, so the fused kernels must build"
    kind, use_w, use_b, opts = VARIANTS[variant]
    x = make_x((m, n), dtype, requires_grad=True)
    w = make_param((n,), dtype, center=1.0, requires_grad=True) if use_w else None
    b = make_param((n,), dtype, center=0.0, requires_grad=True) if use_b else None
    dy = torch.randn(m, n, dtype=torch.float64).to(dtype)
    assert _native.supports(x.detach(), w, b)

    y, grads = _forward_backward(kind, x, w, b, opts, dy)
    yr, grads_r = _forward_backward(kind, upcast(x), upcast(w), upcast(b), opts, dy.double(), True)
    _close(y, yr, TOL[dtype]["y"], "output")
    _close(grads[0], grads_r[0], TOL[dtype]["dx"], "dx")
    for g, gr in zip(grads[1:], grads_r[1:], strict=True):
        _close(g, gr, TOL[dtype]["dparam"], "dweight/dbias", scale=math.sqrt(m))


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(("m", "n"), [*SHAPES, (1, 8), (2, 4096)], ids=str)
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_streaming_stores_equal_plain_stores_bitwise(variant, m, n, dtype, monkeypatch):
    """Outputs written past the caches (a row's whole cache lines by non-temporal stores, with
    the next rows prefetched; its partial lines, and short rows that are not whole lines, by
    plain stores) hold exactly the plain stores' values: rows of every alignment (odd N), fewer
    rows than the prefetch distance, two threads."""
    kind, use_w, use_b, opts = VARIANTS[variant]
    x = make_x((m, n), dtype, requires_grad=True)
    w = make_param((n,), dtype, center=1.0, requires_grad=True) if use_w else None
    b = make_param((n,), dtype, center=0.0, requires_grad=True) if use_b else None
    dy = torch.randn(m, n, dtype=torch.float64).to(dtype)
    streamed = []
    for threshold in (1 << 62, 0):  # never, always
        monkeypatch.setattr(_native, "STREAM_MIN_BYTES", threshold)
        assert _native._stream(x, 2) == (threshold == 0)
        y, grads = _forward_backward(kind, x, w, b, opts, dy)
        streamed.append((y, *grads))
    for plain, stream in zip(*streamed, strict=True):
        assert torch.equal(plain, stream)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_forwards_stream_by_threads_and_what_follows(dtype, monkeypatch):
    """A forward streams its output where x and y take STREAM_MIN_BYTES, as a backward's
    tensors do; one that no backward follows on two threads or more only where x alone does
    (its output stays in the last-level cache for the next op); the half types never."""
    x = torch.empty(64, 256, dtype=dtype)
    for threshold, alone_on_two, otherwise in (
        (2 * x.nbytes, 0, 1),  # x and y just take it
        (x.nbytes, 1, 1),  # x alone does
        (2 * x.nbytes + 1, 0, 0),  # neither
    ):
        monkeypatch.setattr(_native, "STREAM_MIN_BYTES", threshold)
        half = x.element_size() == 2
        cases = [(1, False, otherwise), (1, True, otherwise), (2, True, otherwise)]
        cases += [(4, True, otherwise), (2, False, alone_on_two), (4, False, alone_on_two)]
        for threads, for_backward, flag in cases:
            got = _native._stream_forward(x, threads, for_backward)
            assert got == (0 if half else flag), (threshold, threads, for_backward)


@needs_kernels
def test_streaming_output_at_an_unaligned_address():
    """ln_fwd's ``out`` at an element offset (not aligned to any vector): the streamed rows' whole
    lines start after a plain head, and nothing outside ``out`` is written."""
    m, n = 9, 301
    x = make_x((m, n))
    w = make_param((n,), torch.float32, center=1.0)
    b = make_param((n,), torch.float32, center=0.0)
    expected = _native.ln_fwd(x, w, b, 1e-5)[0].clone()
    storage = torch.full((m * n + 2,), 7.0)
    out = storage[1:-1].view(m, n)
    old = _native.STREAM_MIN_BYTES
    try:
        _native.STREAM_MIN_BYTES = 0
        _native.ln_fwd(x, w, b, 1e-5, out=out)
    finally:
        _native.STREAM_MIN_BYTES = old
    assert torch.equal(out, expected)
    assert storage[0] == 7.0 and storage[-1] == 7.0


def test_last_level_cache_size_from_sysfs(tmp_path):
    """The streaming threshold's cache size: the highest level's size, units K/M/G; 32 MiB where
    Linux lists no caches."""
    for index, (level, size) in enumerate([("1", "32K"), ("2", "512K"), ("3", "32768K")]):
        d = tmp_path / f"index{index}"
        d.mkdir()
        (d / "level").write_text(level + "\n")
        (d / "size").write_text(size + "\n")
    assert _native._last_level_cache_bytes(tmp_path) == 32 << 20
    (tmp_path / "index2" / "size").write_text("1M\n")
    assert _native._last_level_cache_bytes(tmp_path) == 1 << 20
    assert _native._last_level_cache_bytes(tmp_path / "missing") == 32 << 20


@needs_kernels
@pytest.mark.parametrize("variant", ["ln", "detach_mean", "rms", "ada"])
def test_fused_matches_eager_fallback(variant, monkeypatch):
    """LAYERNORM_CPU_COMPILE=0 switches to the eager ATen path; both agree (float32, 2 threads)."""
    kind, use_w, use_b, opts = VARIANTS[variant]
    m, n = 96, 768  # M·N = 73728 > 2 × grain: the fused kernels split the rows across threads
    x = make_x((m, n), requires_grad=True)
    w = make_param((n,), torch.float32, center=1.0, requires_grad=True) if use_w else None
    b = make_param((n,), torch.float32, center=0.0, requires_grad=True) if use_b else None
    dy = torch.randn(m, n)
    monkeypatch.setenv(_native.ENV_SWITCH, "1")
    y, grads = _forward_backward(kind, x, w, b, opts, dy)
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    assert not _native.enabled()
    y0, grads0 = _forward_backward(kind, x, w, b, opts, dy)
    _close(y, y0, TOL[torch.float32]["y"], "output")
    _close(grads[0], grads0[0], TOL[torch.float32]["dx"], "dx")
    for g, g0 in zip(grads[1:], grads0[1:], strict=True):
        _close(g, g0, TOL[torch.float32]["dparam"], "dweight/dbias", scale=math.sqrt(m))


@pytest.mark.parametrize("variant", ["ln", "detach_both", "rms", "ada"])
def test_no_grad_runs_the_forward_kernel_without_a_graph_node(variant, monkeypatch):
    """Where nothing needs a gradient (no_grad, or no input requiring one) the ops call the
    forward kernel alone: no autograd.Function, no graph node, the same values bit for bit."""
    from layernorm.ops import ada_norm, layer_norm, rms_norm

    kind, use_w, use_b, opts = VARIANTS[variant]
    m, n = 6, 40
    x = make_x((m, n), requires_grad=True)
    w = make_param((n,), torch.float32, center=1.0, requires_grad=True) if use_w else None
    b = make_param((n,), torch.float32, center=0.0, requires_grad=True) if use_b else None
    with_grad = _run(kind, x, w, b, opts)
    assert with_grad.grad_fn is not None

    def boom(*args, **kwargs):
        raise AssertionError("an autograd.Function ran although nothing needs a gradient")

    for fn in (layer_norm._LayerNormEager, rms_norm._RMSNormEager, ada_norm._AdaNormEager):
        monkeypatch.setattr(fn, "apply", boom)
    with torch.no_grad():
        y = _run(kind, x, w, b, opts)
    detached = [None if t is None else t.detach() for t in (x, w, b)]
    y_plain = _run(kind, *detached, opts)
    for out in (y, y_plain):
        assert out.grad_fn is None and not out.requires_grad
        assert torch.equal(out, with_grad.detach())


@needs_kernels
def test_switch_off_bypasses_kernels(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("fused kernel called although LAYERNORM_CPU_COMPILE=0")

    monkeypatch.setattr(_native, "ln_fwd", boom)
    # the Python path's kernel calls (the C++ operators' are in tests/test_torch_ops.py)
    monkeypatch.setitem(torch_ops._switch, "on", False)
    monkeypatch.setenv(_native.ENV_SWITCH, "0")
    x = make_x((4, 8))
    LF.layer_norm(x, (8,))  # eager path: no call into the fused kernels
    monkeypatch.setenv(_native.ENV_SWITCH, "1")
    with pytest.raises(AssertionError, match="fused kernel called"):
        LF.layer_norm(x, (8,))


@needs_kernels
def test_weight_grads_are_deterministic():
    """Per-thread float64 buffers added in a fixed order: repeated backwards agree bitwise."""
    m, n = 256, 512
    x = make_x((m, n), requires_grad=True)
    w = make_param((n,), torch.float32, center=1.0, requires_grad=True)
    b = make_param((n,), torch.float32, center=0.0, requires_grad=True)
    dy = torch.randn(m, n)
    first = torch.autograd.grad(LF.layer_norm(x, (n,), w, b), (x, w, b), dy)
    for _ in range(3):
        again = torch.autograd.grad(LF.layer_norm(x, (n,), w, b), (x, w, b), dy)
        for a, f in zip(again, first, strict=True):
            assert torch.equal(a, f)


@needs_kernels
def test_statistics_match_torch_native():
    """mean/rstd saved for backward are the ones torch.native_layer_norm returns."""
    x = make_x((50, 300))
    _, mean, rstd = cpu_layer_norm.layer_norm_fwd(x, None, None, 1e-5)
    _, mean_t, rstd_t = torch.native_layer_norm(x, (300,), None, None, 1e-5)
    torch.testing.assert_close(mean, mean_t.view(-1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(rstd, rstd_t.view(-1), atol=1e-6, rtol=1e-6)
    assert mean.dtype == rstd.dtype == torch.float32 and mean.shape == (50,)


@needs_kernels
def test_large_offset_rows_keep_precision():
    """Rows with |mean| ≫ std: the centred second sweep keeps float32 output within tolerance."""
    x = make_x((8, 512), offset=1e3, scale=1.0)
    y = LF.layer_norm(x, (512,))
    yr = layer_norm_reference(x.double(), (512,))
    # μ is applied in float32: its rounding, 1e3·2⁻²⁴ ≈ 6e-5, shifts y by that much (σ ≈ 1).
    _close(y, yr, (1e-4, 1e-4), "output")
    # the functional op keeps it where nothing needs a gradient and on tiny inputs too (torch's
    # own kernel, which LayerNorm runs there, is 0.04 off on these rows)
    x = make_x((4, 1000), offset=1e4, scale=1e-3)
    yr = layer_norm_reference(x.double(), (1000,))
    with torch.no_grad():
        _close(LF.layer_norm(x, (1000,)), yr, (1e-4, 1e-4), "output under no_grad")
    _close(LF.layer_norm(x[:1].requires_grad_(), (1000,)).detach(), yr[:1], (1e-4, 1e-4), "1 row")


@needs_kernels
def test_nan_stays_in_its_row():
    x = make_x((3, 40))
    x[1, 5] = float("nan")
    y = LF.layer_norm(x, (40,))
    assert torch.isnan(y[1]).all()
    assert torch.isfinite(y[0]).all() and torch.isfinite(y[2]).all()


def test_unsupported_inputs_use_eager_path():
    x = make_x((4, 8))
    assert not _native.supports(x.t())  # non-contiguous
    assert not _native.supports(x, torch.ones(8, dtype=torch.float64))  # weight dtype differs
    h = x.to(torch.bfloat16)
    # half x: gains in x's dtype or float32 run the kernels; another half type or float64 do not
    assert not _native.supports(h, torch.ones(8, dtype=torch.float16))
    assert not _native.supports(h, torch.ones(8, dtype=torch.float64))
    assert not _native.supports(h, same=(torch.ones(4, 8),))  # dy must be x's dtype
    assert not _native.supports(x.to(torch.int32))
    w = torch.rand(8, dtype=torch.float64).add(0.5).to(torch.float16)
    y = LF.layer_norm(h, (8,), w)
    yr = layer_norm_reference(h.double(), (8,), w.double())
    _close(y, yr, (8e-3, 8e-3), "bfloat16 output, float16 gain")


@needs_kernels
def test_build_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv(_native.ENV_CACHE, str(tmp_path))
    first = _native._build()
    assert first.parent == tmp_path and first.exists()
    mtime = first.stat().st_mtime_ns
    assert _native._build() == first and first.stat().st_mtime_ns == mtime  # no rebuild
    assert not [p for p in tmp_path.iterdir() if p.is_dir()]  # the temporary build dir is gone


@needs_kernels
def test_cache_key_hashes_every_header_and_the_sanitizer_switch(tmp_path, monkeypatch):
    """A changed header next to the sources, or the sanitizer switch, gives another library."""
    monkeypatch.setenv(_native.ENV_CACHE, str(tmp_path / "cache"))
    src = tmp_path / "csrc"
    src.mkdir()
    (src / "k.h").write_text("#define K 1\n")
    (src / "k.c").write_text('#include "k.h"\nint k(void) { return K; }\n')
    first = cbuild.build_shared_library([src / "k.c"], "k")
    assert cbuild.build_shared_library([src / "k.c"], "k") == first
    (src / "k.h").write_text("#define K 2\n")
    second = cbuild.build_shared_library([src / "k.c"], "k")
    assert second != first
    monkeypatch.setenv(cbuild.ENV_SANITIZE, "1")
    assert "-fsanitize=address,undefined" in cbuild.build_flags()
    monkeypatch.setenv(cbuild.ENV_SANITIZE, "0")
    assert "-fsanitize=address,undefined" not in cbuild.build_flags()


@pytest.mark.skipif(not cbuild.sanitizing(), reason="only under `make sanitize`")
def test_sanitized_build_is_loaded():
    """Under ``make sanitize`` the kernels run from the ASan + UBSan build, not the eager path."""
    assert _native.enabled()
    assert any(f in cbuild.build_flags() for f in cbuild.SANITIZE_FLAGS)
    maps = Path("/proc/self/maps").read_text()
    assert "libasan" in maps and "libubsan" in maps


def test_missing_compiler_raises_clear_error(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(RuntimeError, match="no C compiler"):
        _native._build()


@needs_kernels
def test_every_op_runs_the_fused_kernels(monkeypatch):
    """float32 forward+backward of each family goes through both of its fused kernels (the
    Python path's calls; the C++ operators' results are tests/test_torch_ops.py's)."""
    monkeypatch.setenv(_native.ENV_SWITCH, "1")
    monkeypatch.setitem(torch_ops._switch, "on", False)
    calls: list[str] = []
    for name in ("ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd", "ada_fwd", "ada_bwd"):
        real = getattr(_native, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)

        monkeypatch.setattr(_native, name, counted)
    x = make_x((6, 40), requires_grad=True)
    w = make_param((40,), torch.float32, center=1.0, requires_grad=True)
    for kind in ("layer", "rms", "ada"):
        y = _run(kind, x, w if kind != "ada" else None, None, {})
        y.backward(torch.ones_like(y))
    assert calls == ["ln_fwd", "ln_bwd", "rms_fwd", "rms_bwd", "ada_fwd", "ada_bwd"]


@needs_kernels
def test_concurrent_calls_equal_serial_bitwise():
    """Four Python threads calling the kernels at once (per-thread scratch buffers, OpenMP teams
    started from several threads) give exactly the serial results."""
    from concurrent.futures import ThreadPoolExecutor

    def work(seed: int):
        g = torch.Generator().manual_seed(seed)
        x = (torch.randn(64, 700, generator=g) + 3).requires_grad_()
        w = (torch.rand(700, generator=g) + 0.5).requires_grad_()
        b = torch.randn(700, generator=g).requires_grad_()
        dy = torch.randn(64, 700, generator=g)
        out = []
        for fn in (
            lambda: LF.layer_norm(x, 700, w, b),
            lambda: LF.rms_norm(x, 700, w),
            lambda: LF.ada_norm(x, 700, 0.1, 2.0),
        ):
            y = fn()
            grads = torch.autograd.grad(y, (x, w, b), dy, allow_unused=True)
            out.append((y.detach(), *[gr for gr in grads if gr is not None]))
        return out

    seeds = list(range(8))
    serial = [work(s) for s in seeds]
    with ThreadPoolExecutor(max_workers=4) as pool:
        parallel = list(pool.map(work, seeds))
    for a, b in zip(serial, parallel, strict=True):
        for ta, tb in zip(a, b, strict=True):
            for u, v in zip(ta, tb, strict=True):
                assert torch.equal(u, v)
