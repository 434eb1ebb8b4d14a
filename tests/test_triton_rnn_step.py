"""The fused LN-LSTM / LN-GRU time steps against float64 references of the paper's equations.

Runs under the Triton interpreter on CPU tensors (see tests/test_triton_norms.py for why the
environment variable is set before the kernel modules are imported), or compiled with a GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import torch

_HAS_CUDA = torch.cuda.is_available()
if not _HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernel modules are imported

import importlib  # noqa: E402
import math  # noqa: E402

import pytest  # noqa: E402

from layernorm.backend import triton_available  # noqa: E402

if not triton_available():  # pragma: no cover - triton is a dev dependency
    pytest.skip("triton is not installed", allow_module_level=True)

from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

from layernorm.kernels.triton import rnn_step  # noqa: E402

if not _HAS_CUDA and not isinstance(rnn_step._lstm_step_fwd_kernel, InterpretedFunction):
    # imported earlier without TRITON_INTERPRET: decorate again (the row-sum helper first)
    for name in ("_norm_core", "_rnn_kernels", "rnn_step"):
        importlib.reload(importlib.import_module(f"layernorm.kernels.triton.{name}"))
INTERPRETED = isinstance(rnn_step._lstm_step_fwd_kernel, InterpretedFunction)
DEVICE = "cpu" if INTERPRETED else ("cuda" if _HAS_CUDA else None)
in_process = pytest.mark.skipif(
    DEVICE is None,
    reason="the Triton kernels are not interpreted in this process and there is no GPU; "
    "test_rerun_under_interpreter runs this file in a fresh process",
)

# (atol, rtol) against the float64 reference on the same rounded inputs.
TOLERANCES = {
    # float32 throughout the kernels: a few ulps through LN, σ/tanh (exp-based tanh has ~1e-7
    # absolute error) and the 4H-wide reductions; gradients chain ~4 such stages.
    torch.float32: {"out": (2e-6, 1e-5), "grad": (1e-5, 1e-4)},
    # bfloat16 inputs and outputs, float32 inside and float32 saved activations: one rounding of
    # each output (half an ulp is 3.9e-3 relative) and of dgh/dgx/dc_prev.
    torch.bfloat16: {"out": (8e-3, 8e-3), "grad": (1.6e-2, 1.6e-2)},
}


# ----------------------------------------------------------------------------------------------
# float64 references, written from PAPER_NOTES §2 (torch gate order)
# ----------------------------------------------------------------------------------------------


def ln(z: torch.Tensor, gain: torch.Tensor, bias: torch.Tensor, eps: float = 1e-5) -> torch.Tensor:
    """LN(z; α, β) = α ⊙ (z − μ(z))/σ(z) + β over the last dim, biased variance."""
    mu = z.mean(-1, keepdim=True)
    sigma = torch.sqrt(((z - mu) ** 2).mean(-1, keepdim=True) + eps)
    return gain * (z - mu) / sigma + bias


def lstm_reference(gh, gx, c_prev, w_h, b_h, w_x, b_x, bias, w_c, b_c, carry_normalized=False):
    """(i, f, g, o) = LN(W_h h; α1, β1) + LN(W_x x; α2, β2) + b; the carried state is c_t."""
    a = ln(gh, w_h, b_h) + ln(gx, w_x, b_x) + (0 if bias is None else bias)
    i, f, g, o = a.chunk(4, dim=1)
    c = torch.sigmoid(f) * c_prev + torch.sigmoid(i) * torch.tanh(g)
    lc = ln(c, w_c, b_c)
    h = torch.sigmoid(o) * torch.tanh(lc)
    return h, (lc if carry_normalized else c)


def gru_reference(gh, gx, h_prev, w_h, b_h, w_x, b_x, b_hn):
    """(r, z) = LN(W_h h) + LN(W_x x); ĥ = tanh(LN(W x) + σ(r) ⊙ LN(U h)); torch's z convention:
    h_t = (1 − σ(z)) ĥ + σ(z) h_{t−1}, the paper's equation with z → −z."""
    hs = h_prev.shape[1]
    rz = ln(gh[:, : 2 * hs], w_h[: 2 * hs], b_h[: 2 * hs]) + ln(
        gx[:, : 2 * hs], w_x[: 2 * hs], b_x[: 2 * hs]
    )
    r, z = torch.sigmoid(rz).chunk(2, dim=1)
    uh = ln(gh[:, 2 * hs :], w_h[2 * hs :], b_h[2 * hs :]) + (0 if b_hn is None else b_hn)
    cand = torch.tanh(ln(gx[:, 2 * hs :], w_x[2 * hs :], b_x[2 * hs :]) + r * uh)
    return (1 - z) * cand + z * h_prev


def _inputs(b: int, hs: int, blocks: int, dtype: torch.dtype, with_bias: bool) -> list:
    """Pre-activations with non-zero means (rounded to ``dtype``), float32 gains/biases."""
    g = torch.Generator().manual_seed(1234 + hs)

    def rnd(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + offset).float()

    gh = rnd(b, blocks * hs, scale=2.0, offset=1.0).to(dtype)
    gx = rnd(b, blocks * hs, scale=3.0, offset=-1.0).to(dtype)
    state = rnd(b, hs).to(dtype)
    params = [
        rnd(blocks * hs, scale=0.5, offset=1.0),  # w_h
        rnd(blocks * hs, scale=0.5),  # b_h
        rnd(blocks * hs, scale=0.5, offset=1.0),  # w_x
        rnd(blocks * hs, scale=0.5),  # b_x
    ]
    extra = rnd(blocks * hs if blocks == 4 else hs, scale=0.3) if with_bias else None
    return [gh, gx, state, *params, extra]


def _check_against_reference(fn, ref, inputs, upstream, dtype, b):
    """Outputs and every input gradient of ``fn`` vs ``ref`` in float64 on the same inputs."""
    ours = [None if t is None else t.to(DEVICE).requires_grad_() for t in inputs]
    theirs = [None if t is None else t.double().requires_grad_() for t in inputs]
    out, out_ref = fn(*ours), ref(*theirs)
    out = out if isinstance(out, tuple) else (out,)
    out_ref = out_ref if isinstance(out_ref, tuple) else (out_ref,)
    tol = TOLERANCES[dtype]
    for k, (o, r) in enumerate(zip(out, out_ref, strict=True)):
        assert o.dtype == dtype
        atol, rtol = tol["out"]
        torch.testing.assert_close(o.double().cpu(), r.detach(), atol=atol, rtol=rtol,
                                   msg=lambda m, k=k: f"output {k}: {m}")  # fmt: skip
    loss = sum((o.float() * u.to(DEVICE)).sum() for o, u in zip(out, upstream, strict=True))
    loss_ref = sum((r * u.double()).sum() for r, u in zip(out_ref, upstream, strict=True))
    leaves = [t for t in ours if t is not None]
    leaves_ref = [t for t in theirs if t is not None]
    grads = torch.autograd.grad(loss, leaves)
    grads_ref = torch.autograd.grad(loss_ref, leaves_ref)
    for k, (g, r) in enumerate(zip(grads, grads_ref, strict=True)):
        # the upstream gradient reaches the kernels in the outputs' dtype (rounded for bfloat16),
        # so the dtype's gradient tolerance applies to every input
        atol, rtol = tol["grad"]
        if k >= 3:  # gain/bias gradients are float32 sums over the B rows: error grows like √B
            atol *= math.sqrt(b)
        torch.testing.assert_close(g.double().cpu(), r, atol=atol, rtol=rtol,
                                   msg=lambda m, k=k: f"gradient of input {k}: {m}")  # fmt: skip


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("b", "hs", "with_bias", "carry_normalized"),
    [(5, 24, True, False), (3, 13, False, False), (4, 13, True, True), (2, 1, True, False)],
)
def test_lstm_step_matches_reference(b, hs, with_bias, carry_normalized, dtype):
    gh, gx, c_prev, w_h, b_h, w_x, b_x, bias = _inputs(b, hs, 4, dtype, with_bias)
    g = torch.Generator().manual_seed(7)
    w_c = 1.0 + 0.5 * torch.randn(hs, generator=g)
    b_c = 0.5 * torch.randn(hs, generator=g)
    inputs = [gh, gx, c_prev, w_h, b_h, w_x, b_x, bias, w_c, b_c]
    upstream = [torch.randn(b, hs, generator=g), torch.randn(b, hs, generator=g)]

    def fused(*a):
        return rnn_step.ln_lstm_step(*a, carry_normalized=carry_normalized)

    def ref(*a):
        return lstm_reference(*a, carry_normalized=carry_normalized)

    _check_against_reference(fused, ref, inputs, upstream, dtype, b)


@in_process
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("b", "hs", "with_b_hn"), [(5, 24, True), (3, 13, False), (2, 1, True)])
def test_gru_step_matches_reference(b, hs, with_b_hn, dtype):
    gh, gx, h_prev, w_h, b_h, w_x, b_x, b_hn = _inputs(b, hs, 3, dtype, with_b_hn)
    upstream = [torch.randn(b, hs, generator=torch.Generator().manual_seed(8))]
    inputs = [gh, gx, h_prev, w_h, b_h, w_x, b_x, b_hn]
    _check_against_reference(rnn_step.ln_gru_step, gru_reference, inputs, upstream, dtype, b)


@in_process
def test_lstm_step_unrolled_over_time():
    """Three steps chained: gradients flow through the carried c and through h via W_hh."""
    b, hs, n_in, steps = 3, 8, 5, 3
    g = torch.Generator().manual_seed(3)
    w_hh = (torch.randn(4 * hs, hs, generator=g) / 3).double()
    w_ih = (torch.randn(4 * hs, n_in, generator=g) / 2).double()
    xs = (torch.randn(steps, b, n_in, generator=g) + 0.5).double()
    params = [1 + 0.3 * torch.randn(4 * hs, generator=g), 0.3 * torch.randn(4 * hs, generator=g),
              1 + 0.3 * torch.randn(4 * hs, generator=g), 0.3 * torch.randn(4 * hs, generator=g),
              0.3 * torch.randn(4 * hs, generator=g), 1 + 0.3 * torch.randn(hs, generator=g),
              0.3 * torch.randn(hs, generator=g)]  # fmt: skip

    def run(step, dtype, device):
        whh = w_hh.to(device=device, dtype=dtype, copy=True).requires_grad_()
        ps = [p.to(device=device, dtype=dtype, copy=True).requires_grad_() for p in params]
        h = c = torch.zeros(b, hs, dtype=dtype, device=device)
        for t in range(steps):
            x = xs[t].to(dtype).to(device)
            h, c = step(h @ whh.t(), x @ w_ih.to(dtype).to(device).t(), c, *ps)
        (h.sum() + 0.5 * c.sum()).backward()
        return h, [whh.grad, *[p.grad for p in ps]]

    h, grads = run(rnn_step.ln_lstm_step, torch.float32, DEVICE)
    h_ref, grads_ref = run(lstm_reference, torch.float64, "cpu")
    torch.testing.assert_close(h.double().cpu(), h_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(got.double().cpu(), want, atol=5e-5, rtol=1e-4)


# ----------------------------------------------------------------------------------------------
# The layernorm.recurrent step seam
# ----------------------------------------------------------------------------------------------


def _eager_steps():
    try:
        from layernorm.recurrent import _pointwise
    except Exception as err:  # the recurrent package may change shape; the seam test then skips
        pytest.skip(f"layernorm.recurrent step seam not importable: {err}")
    return _pointwise.EAGER


def _run_seam(impl, st: dict, kind: str, bs: int, steps: int) -> dict:
    """Forward ``steps`` steps of ``bs`` rows, then backward in reverse, on a copy of ``st``."""
    st = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
    for t in range(steps):
        impl[f"{kind}_fwd"](st, t * bs, bs)
    for t in reversed(range(steps)):
        impl[f"{kind}_bwd"](st, t * bs, bs)
    return st


def _random_on_device(seed: int):
    """``rnd(*shape, scale, offset)``: seeded normal values (non-zero mean by ``offset``)."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=g) * scale + offset).to(DEVICE)

    return rnd


def _compare_buffers(ours: dict, eager: dict) -> None:
    for key, got in ours.items():
        if isinstance(got, torch.Tensor):
            torch.testing.assert_close(got, eager[key], atol=2e-5, rtol=1e-4,
                                       msg=lambda m, key=key: f"buffer {key!r}: {m}")  # fmt: skip


@in_process
@pytest.mark.parametrize("carry_normalized", [False, True])
def test_seam_lstm_matches_eager_step(carry_normalized: bool):
    eager = _eager_steps()
    bs, hs, steps = 3, 12, 2
    n = bs * steps
    rnd = _random_on_device(5)
    st = {"H": hs, "eps": 1e-5, "normalize": True, "carry_normalized": carry_normalized,
          "gx": rnd(n, 4 * hs, scale=2.0), "hp": rnd(n, 4 * hs, scale=2.0, offset=1.0),
          "w1": rnd(4 * hs, scale=0.5, offset=1.0), "b1": rnd(4 * hs, scale=0.5),
          "w3": rnd(hs, scale=0.5, offset=1.0), "b3": rnd(hs, scale=0.5),
          "h": rnd(bs, hs), "c": rnd(bs, hs), "dout": rnd(n, hs), "dh": rnd(bs, hs),
          "dc": rnd(bs, hs)}  # fmt: skip
    for key, width in (("out", hs), ("hprev", hs), ("cprev", hs), ("acts", 4 * hs), ("cn", hs),
                       ("tc", hs), ("dgates", 4 * hs), ("dhp", 4 * hs), ("dlc", hs)):  # fmt: skip
        st[key] = torch.zeros(n, width, device=DEVICE)
    for key in ("mh", "rh", "mc", "rc"):
        st[key] = torch.zeros(n, device=DEVICE)
    ours = _run_seam(rnn_step.seam_functions(eager), st, "lstm", bs, steps)
    theirs = _run_seam(
        {"lstm_fwd": eager.lstm_fwd, "lstm_bwd": eager.lstm_bwd}, st, "lstm", bs, steps
    )
    _compare_buffers(ours, theirs)


@in_process
def test_seam_gru_matches_eager_step():
    eager = _eager_steps()
    bs, hs, steps = 3, 12, 2
    n = bs * steps
    rnd = _random_on_device(6)
    st = {"H": hs, "eps": 1e-5, "normalize": True,
          "gx": rnd(n, 3 * hs, scale=2.0), "hp": rnd(n, 3 * hs, scale=2.0, offset=1.0),
          "w_rz": rnd(2 * hs, scale=0.5, offset=1.0), "b_rz": rnd(2 * hs, scale=0.5),
          "w_n": rnd(hs, scale=0.5, offset=1.0), "b_n": rnd(hs, scale=0.5),
          "b_hn": rnd(hs, scale=0.3), "h": rnd(bs, hs), "dout": rnd(n, hs),
          "dh": rnd(bs, hs)}  # fmt: skip
    for key, width in (("out", hs), ("hprev", hs), ("rz", 2 * hs), ("n", hs), ("ghn", hs),
                       ("dgx", 3 * hs), ("dgh", 3 * hs), ("dhp", 3 * hs)):  # fmt: skip
        st[key] = torch.zeros(n, width, device=DEVICE)
    for key in ("mh", "rh", "mn", "rn"):
        st[key] = torch.zeros(n, device=DEVICE)
    ours = _run_seam(rnn_step.seam_functions(eager), st, "gru", bs, steps)
    theirs = _run_seam({"gru_fwd": eager.gru_fwd, "gru_bwd": eager.gru_bwd}, st, "gru", bs, steps)
    _compare_buffers(ours, theirs)


def test_seam_defers_to_fallback_without_layer_norm():
    calls: list[str] = []

    class Fallback:
        def lstm_fwd(self, st, off, bs):
            calls.append("lstm_fwd")

        def gru_bwd(self, st, off, bs):
            calls.append("gru_bwd")

    seam = rnn_step.seam_functions(Fallback())
    st = {"normalize": False, "H": 4, "w1": None, "b1": None, "w3": None, "b3": None}
    seam["lstm_fwd"](st, 0, 1)
    x = torch.ones(3)
    big = {
        "normalize": True,
        "H": rnn_step.MAX_HIDDEN + 1,
        "w_rz": x,
        "b_rz": x,
        "w_n": x,
        "b_n": x,
    }
    seam["gru_bwd"](big, 0, 1)
    assert calls == ["lstm_fwd", "gru_bwd"]


def test_seam_routes_float64_to_the_fallback():
    """The kernels compute in float32: float64 buffers must reach the fallback, not the kernels
    (which would refuse them, or worse, round them)."""
    calls: list[str] = []

    class Fallback:
        def lstm_fwd(self, st, off, bs):
            calls.append("lstm_fwd")

        def gru_fwd(self, st, off, bs):
            calls.append("gru_fwd")

    seam = rnn_step.seam_functions(Fallback())
    hs, x = 4, torch.ones(3, dtype=torch.float64)
    gx = torch.zeros(2, 4 * hs, dtype=torch.float64)
    seam["lstm_fwd"]({"normalize": True, "H": hs, "gx": gx, "w1": x, "b1": x, "w3": x, "b3": x},
                     0, 1)  # fmt: skip
    seam["gru_fwd"]({"normalize": True, "H": hs, "gx": gx[:, : 3 * hs], "w_rz": x, "b_rz": x,
                     "w_n": x, "b_n": x}, 0, 1)  # fmt: skip
    assert calls == ["lstm_fwd", "gru_fwd"]


def test_float64_is_refused_by_name():
    # on the kernels' own device, so that the dtype check (not the device check) is what refuses
    b, hs, f64 = 2, 4, dict(dtype=torch.float64, device=DEVICE)
    w4, w1 = torch.ones(4 * hs, **f64), torch.ones(hs, **f64)
    with pytest.raises(TypeError, match=r"ln_lstm_step: .*computes in float32.*got torch\.float64"):
        g4 = torch.zeros(b, 4 * hs, **f64)
        rnn_step.ln_lstm_step(g4, g4, torch.zeros(b, hs, **f64), w4, w4, w4, w4, None, w1, w1)
    with pytest.raises(TypeError, match=r"gru step: .*got torch\.float64"):
        rnn_step.gru_step_fwd(torch.zeros(b, 2 * hs, **f64), torch.zeros(b, hs, **f64),
                              torch.zeros(b, 3 * hs, **f64), torch.zeros(b, hs, **f64),
                              *[torch.ones(2 * hs, **f64)] * 2, w1, w1, None, 1e-5)  # fmt: skip


def test_bad_arguments_name_what_was_expected():
    b, hs = 2, 4
    w4, w1 = torch.ones(4 * hs), torch.ones(hs)
    with pytest.raises(ValueError, match=r"gx must be \(B, 4H\)"):
        rnn_step.ln_lstm_step(torch.zeros(b, 4 * hs), torch.zeros(b, 3 * hs), torch.zeros(b, hs),
                              w4, w4, w4, w4, None, w1, w1)  # fmt: skip
    with pytest.raises(ValueError, match=r"w_c must have shape \(4,\)"):
        rnn_step.ln_lstm_step(torch.zeros(b, 4 * hs), torch.zeros(b, 4 * hs), torch.zeros(b, hs),
                              w4, w4, w4, w4, None, w4, w1)  # fmt: skip
    with pytest.raises(TypeError, match=r"gh is torch\.float64"):
        rnn_step.ln_gru_step(torch.zeros(b, 3 * hs, dtype=torch.float64), torch.zeros(b, 3 * hs),
                             torch.zeros(b, hs), *[torch.ones(3 * hs)] * 4)  # fmt: skip
    big = rnn_step.MAX_HIDDEN + 1
    with pytest.raises(ValueError, match=r"hidden sizes 1\.\.2048"):
        rnn_step.ln_gru_step(torch.zeros(1, 3 * big), torch.zeros(1, 3 * big), torch.zeros(1, big),
                             *[torch.ones(3 * big)] * 4)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.skipif(not _HAS_CUDA, reason="needs a CUDA device")
@pytest.mark.parametrize("hs", [1024, 2048])
def test_gpu_lstm_step_at_paper_size(hs: int):
    if INTERPRETED:
        pytest.skip("kernels are interpreted in this process")
    b = 64
    gh, gx, c_prev, w_h, b_h, w_x, b_x, bias = _inputs(b, hs, 4, torch.bfloat16, True)
    w_c, b_c = torch.ones(hs), torch.zeros(hs)
    upstream = [torch.randn(b, hs), torch.randn(b, hs)]
    inputs = [gh, gx, c_prev, w_h, b_h, w_x, b_x, bias, w_c, b_c]
    _check_against_reference(rnn_step.ln_lstm_step, lstm_reference, inputs, upstream,
                             torch.bfloat16, b)  # fmt: skip


@pytest.mark.skipif(DEVICE is not None, reason="the tests ran in this process")
def test_rerun_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in proc.stdout
