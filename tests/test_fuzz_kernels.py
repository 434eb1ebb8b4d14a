"""Adversarial fuzz of the norm ops, forward and backward, against float64 on the same inputs.

Thousands of drawn cases: every dtype, ranks 1–4 (normalizing the last one or two dimensions),
row lengths from 1 to 2²² including non-powers of two, scales and offsets up to 1e4; constant,
near-constant (a few elements one unit in the last place away) and half-zero rows, and rows
holding a NaN or an Inf; every layer-norm variant (gain, bias, DetachNorm flags), RMSNorm and
AdaNorm; half inputs have float32 gains and biases in some cases (mixed precision). Each result
must lie within the error model of :mod:`tolerances` (which refuses a NaN the reference does not
have, so a NaN or Inf never leaks out of its row); results of the fused kernels (every dtype,
gains in x's dtype or float32 for half x) are held to their own, tighter K, and constant rows on
them must give the bias exactly. Cases are drawn from fixed seeds, so a failure names a case
that reproduces.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

import pytest
import torch

import layernorm.functional as LF
from layernorm.kernels.cpu import _native
from layernorm.reference import ada_norm_reference, layer_norm_reference, rms_norm_reference
from tolerances import assert_within, row_stats

DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
FUSED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)  # the C kernels' dtypes
ROW_KINDS = ("random", "random", "random", "constant", "near_constant", "relu", "nan", "inf")
BATCHES = 20
CASES_PER_BATCH = 100


@dataclass
class Case:
    op: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    norm_dims: int
    kind: str
    scale: float
    offset: float
    eps: float
    weight: bool = False
    bias: bool = False
    opts: dict = field(default_factory=dict)
    seed: int = 0
    param_dtype: torch.dtype | None = None  # gain/bias dtype; None: x's

    @property
    def fused(self) -> bool:
        """Whether the fused CPU kernels run this case (else PyTorch's ATen compositions)."""
        pdt = self.param_dtype or self.dtype
        return self.dtype in FUSED and pdt in (self.dtype, torch.float32) and _native.enabled()

    @property
    def n(self) -> int:
        return math.prod(self.shape[len(self.shape) - self.norm_dims :])


def _draw(rng: random.Random, seed: int) -> Case:
    rank = rng.randint(1, 4)
    norm_dims = 1 if rank == 1 else rng.choice((1, 1, 2))
    # Row lengths: powers of two and their neighbours, around the 32 lanes and 512-element
    # blocks, and arbitrary lengths up to a few thousand.
    n = rng.choice(
        [
            1, 2, 3, rng.randint(4, 31), 32, 33, rng.randint(34, 511), 511, 512, 513,
            1024, 1023, 1025, rng.randint(1026, 5000), 4096 + 7,
        ]
    )  # fmt: skip
    if norm_dims == 2:
        d = next((k for k in (8, 4, 3, 2) if n % k == 0 and n > k), 1)
        tail = (d, n // d)
    else:
        tail = (n,)
    lead_total = rng.choice((1, 2, 3, 5, 8))
    lead_rank = rank - len(tail)
    lead: tuple[int, ...] = ()
    if lead_rank >= 1:
        lead = (lead_total,) + (1,) * (lead_rank - 1)
        lead = tuple(rng.sample(lead, len(lead)))
    shape = lead + tail
    op = rng.choice(("ln", "ln", "ln", "rms", "ada"))
    case = Case(
        op=op,
        dtype=rng.choice(DTYPES),
        shape=shape,
        norm_dims=len(tail),
        kind=rng.choice(ROW_KINDS),
        scale=rng.choice((1e-3, 1.0, 1.0, 10.0, 1e4)),
        offset=rng.choice((0.0, 0.0, 1.0, -3.0, 1e2, 1e4, -1e4)),
        eps=rng.choice((1e-5, 1e-5, 1e-3, 1e-12)),
        seed=seed,
    )
    if op == "ln":
        case.weight, case.bias = rng.random() < 0.7, rng.random() < 0.6
        case.opts = {"detach_mean": rng.random() < 0.3, "detach_std": rng.random() < 0.3}
    elif op == "rms":
        case.weight = rng.random() < 0.7
    else:
        case.opts = {"k": rng.choice((0.0, 0.1, 0.5)), "scale": rng.choice((1.0, 2.0, -0.5))}
    # drawn apart from rng, so the cases drawn before mixed precision was added stay the same
    if case.dtype in (torch.float16, torch.bfloat16) and random.Random(seed).random() < 0.3:
        case.param_dtype = torch.float32
    return case


def _inputs(case: Case):
    g = torch.Generator().manual_seed(case.seed)
    n = case.n
    rows = math.prod(case.shape) // n
    x = torch.randn(rows, n, generator=g, dtype=torch.float64) * case.scale + case.offset
    if case.kind == "constant":
        x[:] = x[:, :1]
    elif case.kind == "near_constant":
        x = x[:, :1].expand(rows, n).to(case.dtype).double().clone()
        flip = torch.rand(rows, n, generator=g) < 0.1
        up = torch.nextafter(x.to(case.dtype), torch.tensor(math.inf, dtype=case.dtype)).double()
        x = torch.where(flip, up, x)
    elif case.kind == "relu":
        x = x.clamp_min(case.offset)
    x = x.to(case.dtype)
    if case.kind in ("nan", "inf") and rows > 1:
        x[rows // 2, n // 2] = float(case.kind)
    x = x.reshape(case.shape)
    tail = case.shape[len(case.shape) - case.norm_dims :]
    pdt = case.param_dtype or case.dtype
    w = (1 + 0.5 * torch.randn(tail, generator=g, dtype=torch.float64)).to(pdt)
    b = (0.5 * torch.randn(tail, generator=g, dtype=torch.float64)).to(pdt)
    dy = torch.randn(case.shape, generator=g, dtype=torch.float64).to(case.dtype)
    return x, (w if case.weight else None), (b if case.bias else None), dy


def _apply(case: Case, x, w, b, reference: bool):
    tail = case.shape[len(case.shape) - case.norm_dims :]
    if case.op == "ln":
        if reference:
            return layer_norm_reference(
                x,
                tail,
                w,
                b,
                case.eps,
                case.opts.get("detach_mean", False),
                case.opts.get("detach_std", False),
            )
        return LF.layer_norm(x, tail, w, b, case.eps, **case.opts)
    if case.op == "rms":
        return (rms_norm_reference if reference else LF.rms_norm)(x, tail, w, case.eps)
    fn = ada_norm_reference if reference else LF.ada_norm
    return fn(x, tail, case.opts["k"], case.opts["scale"], case.eps)


def check_case(case: Case) -> None:
    x, w, b, dy = _inputs(case)
    leaves = [t for t in (x, w, b) if t is not None]
    leaves = [t.requires_grad_() for t in leaves]
    y = _apply(case, x, w, b, reference=False)
    grads = torch.autograd.grad(y, leaves, dy)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    xr = ref_leaves[0]
    wr = ref_leaves[1] if w is not None else None
    br = ref_leaves[-1] if b is not None else None
    yr = _apply(case, xr, wr, br, reference=True)
    grads_r = torch.autograd.grad(yr, ref_leaves, dy.double())

    n, what = case.n, repr(case)
    x64 = x.detach().double().reshape(-1, n)
    xhat, rstd, kappa = row_stats(x64, case.eps, centred=case.op != "rms")
    w64 = torch.ones(n, dtype=torch.float64) if w is None else w.detach().double().reshape(n)
    b64 = torch.zeros(n, dtype=torch.float64) if b is None else b.detach().double().reshape(n)
    dy64 = dy.double().reshape(-1, n)
    xmax = xhat.abs().nan_to_num(0).amax(-1, keepdim=True)
    if case.op == "ada":
        k, c = case.opts["k"], case.opts["scale"]
        y_scale = abs(c) * (xmax + kappa) * (1 + 2 * abs(k) * xmax)
        g = dy64.abs() * abs(c) * (1 + abs(k) * xhat.abs())
    else:
        y_scale = w64.abs().max() * (xmax + kappa) + b64.abs().max()
        g = (dy64 * w64).abs()
    dx_scale = rstd * g.nan_to_num(0).amax(-1, keepdim=True) * (1 + xmax) * kappa
    y2, yr2 = y.detach().reshape(-1, n), yr.detach().reshape(-1, n)
    dx2, dxr2 = grads[0].reshape(-1, n), grads_r[0].reshape(-1, n)

    nan_rows = ~x64.isfinite().all(-1)
    if bool(nan_rows.any()):  # a NaN or Inf input gives NaN where the reference has it, in its row
        for a, r in ((y2, yr2), (dx2, dxr2)):
            assert torch.equal(a[nan_rows].isnan(), r[nan_rows].isnan()), what
        keep = ~nan_rows  # the other rows: as if alone (assert_within refuses any extra NaN)
        assert_within(y2[keep], yr2[keep], "y", case.dtype, y_scale[keep], what + " y", case.fused)
        assert_within(
            dx2[keep], dxr2[keep], "dx", case.dtype, dx_scale[keep], what + " dx", case.fused
        )
        return

    if case.kind == "constant" and case.fused and case.op == "ln":
        # exact: x − μ = 0 on a constant row, so y is the bias (or 0) rounded to x's dtype
        assert torch.equal(y2, b64.to(case.dtype).expand_as(y2)), what
    assert_within(y2, yr2, "y", case.dtype, y_scale, what + " y", case.fused)
    assert_within(dx2, dxr2, "dx", case.dtype, dx_scale, what + " dx", case.fused)
    if w is not None:
        dw_scale = (dy64.abs() * (xhat.abs() + kappa)).sum(0)
        dw, dwr = grads[1].reshape(n), grads_r[1].reshape(n)
        assert_within(dw, dwr, "dparam", case.dtype, dw_scale, what + " dweight", case.fused)
    if b is not None:
        db, dbr = grads[-1].reshape(n), grads_r[-1].reshape(n)
        assert_within(db, dbr, "dparam", case.dtype, dy64.abs().sum(0), what + " dbias", case.fused)


@pytest.mark.parametrize("batch", range(BATCHES))
def test_fuzz_batch(batch):
    rng = random.Random(1000 + batch)
    for i in range(CASES_PER_BATCH):
        check_case(_draw(rng, seed=batch * CASES_PER_BATCH + i))


LONG = [
    Case("ln", torch.float32, (1, 1 << 22), 1, "random", 1.0, 1e4, 1e-5, True, True),
    Case("ln", torch.float32, (1, (1 << 22) - 3), 1, "relu", 1.0, 0.0, 1e-5, False, False,
         {"detach_mean": False, "detach_std": True}),
    Case("rms", torch.float32, (1, (1 << 21) + 1), 1, "random", 1.0, 3.0, 1e-6, True),
    Case("ada", torch.float64, (1, (1 << 20) + 7), 1, "random", 10.0, -1e4, 1e-5, False, False,
         {"k": 0.1, "scale": 2.0}),
    Case("ln", torch.float32, (1, 3 * (1 << 18) + 1), 1, "near_constant", 1.0, 1e4, 1e-5, True,
         True, {"detach_mean": True, "detach_std": False}),
    Case("ln", torch.bfloat16, (1, 1 << 19), 1, "random", 1.0, 1e2, 1e-5, True, True,
         {"detach_mean": False, "detach_std": False}),
    Case("ln", torch.float32, (2, 1 << 18), 1, "constant", 1.0, 12345.678, 1e-5, True, True,
         {"detach_mean": False, "detach_std": False}),
]  # fmt: skip


@pytest.mark.parametrize("case", LONG, ids=lambda c: f"{c.op}-{c.dtype}-{c.shape}-{c.kind}")
def test_fuzz_long_rows(case):
    case.seed = 7
    check_case(case)
