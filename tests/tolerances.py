"""The error model the norm kernels are tested against, defined once.

Every check compares a result with the float64 reference computed on the *same rounded inputs*, so
only the computation's own rounding is measured. With ``u`` the unit roundoff of the dtype the
statistics are computed in (float32 for float16/bfloat16 inputs) and ``u_out`` that of the
result's dtype, an element may differ from the reference by

    |a − r| ≤ K[q] · u · scale_q  +  2·u_out · |r|  +  tiny_out

``scale_q`` is built from the error of x̂ = (x − μ)·rstd, which is at most a few u·(|x̂| + κ):
a relative part, and an absolute part κ = 1 + |μ|·rstd from a mean kept in the working precision
(off by up to u·|μ|, which is u·|μ|·rstd in units of x̂; rows far from zero relative to their
spread, offset 1e4 and σ = 1 say, are that much harder, for PyTorch's kernels as for ours).
Per row (per column for parameter gradients), with g = dy ⊙ w:

    y        max|w| · (max|x̂| + κ) + max|b|     (AdaNorm: |C|·(max|x̂| + κ)·(1 + 2|k|·max|x̂|))
    dx       rstd · max|g| · (1 + max|x̂|) · κ
    dweight  Σ_rows |dy| · (|x̂| + κ)
    dbias    Σ_rows |dy|

so cancellation in a sum does not turn into a relative error. ``2·u_out·|r|`` is the final
rounding to the result's dtype and ``tiny_out`` its smallest subnormal (results below its
smallest normal round to a multiple of it: 6e-8 for float16); beyond the dtype's range an
infinity stands for the largest finite value of its sign (and may appear only where the
reference, moved by the allowed error, leaves the range). ``K[q]`` counts roundings: row sums are
blocked (at most BLOCK_TERMS + 1 = 17 float32 adds before a float64 accumulation, see
csrc/cpu_common.h) and a gradient combines a few of them. PyTorch's ATen path, which runs
half-precision inputs where the fused kernels do not (other dtype mixes, no C compiler), sums long
rows less carefully, hence a larger K there. The fused kernels run a half input as the float32
kernel on the exactly converted values, rounded once at the end: float32's K (``fused=True``)
and the final rounding.
"""

from __future__ import annotations

import torch

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.float16: 2.0**-11,
    torch.bfloat16: 2.0**-8,
}
#: The dtype statistics and arithmetic run in, for each input dtype.
COMPUTE = {
    torch.float64: torch.float64,
    torch.float32: torch.float32,
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
}
#: K[q] per input dtype: multiples of u·κ·scale_q (see the module docstring).
K = {
    torch.float64: {"y": 64, "dx": 256, "dparam": 64},
    torch.float32: {"y": 64, "dx": 256, "dparam": 64},
    torch.float16: {"y": 4096, "dx": 4096, "dparam": 4096},
    torch.bfloat16: {"y": 4096, "dx": 4096, "dparam": 4096},
}


def bound(
    quantity: str,
    in_dtype: torch.dtype,
    ref: torch.Tensor,
    scale: torch.Tensor,
    fused: bool = False,
) -> torch.Tensor:
    """The largest error the model allows for each element of ``ref`` (float64); ``fused``: the
    fused CPU kernels' K, that of the compute dtype."""
    u = UNIT_ROUNDOFF[COMPUTE[in_dtype]]
    u_out = UNIT_ROUNDOFF[in_dtype]
    k = K[COMPUTE[in_dtype] if fused else in_dtype][quantity]
    # below the smallest normal the final rounding is absolute: half the subnormal spacing
    fi = torch.finfo(in_dtype)
    tiny = fi.tiny * fi.eps  # the smallest subnormal
    return k * u * scale + 2 * u_out * ref.abs() + tiny


def assert_within(
    actual: torch.Tensor,
    ref: torch.Tensor,
    quantity: str,
    in_dtype: torch.dtype,
    scale: torch.Tensor,
    what: str = "",
    fused: bool = False,
) -> None:
    """Fail with the worst element unless ``actual`` is within :func:`bound` of ``ref``; NaN
    never passes unless the reference is NaN at the same place."""
    a, r = actual.detach().double(), ref.detach().double()
    assert a.shape == r.shape, (what, a.shape, r.shape)
    nan_a, nan_r = a.isnan(), r.isnan()
    assert torch.equal(nan_a, nan_r), f"{what}: NaN where the reference has none (or vice versa)"
    # Beyond the dtype's range an infinity counts as the largest finite value of its sign; it may
    # appear only where the reference, moved by the allowed error, can leave the range.
    big = torch.finfo(in_dtype).max
    r_in = r.clamp(-big, big)
    lim = bound(quantity, in_dtype, r_in, scale, fused)
    bad_inf = a.isinf() & ~(r.abs() + lim > big)
    assert not bool(bad_inf.any()), f"{what}: overflow where the reference is finite"
    a, r = a.clamp(-big, big), r_in
    err = (a - r).abs().masked_fill(nan_r, 0.0)
    excess = err - lim
    if bool((excess > 0).any()):
        i = int(excess.argmax())
        raise AssertionError(
            f"{what} ({quantity}, {in_dtype}): error {err.flatten()[i].item():.3e} > bound "
            f"{lim.flatten()[i].item():.3e} at flat index {i} (value {a.flatten()[i].item():.6e}, "
            f"reference {r.flatten()[i].item():.6e}); max error {err.max().item():.3e}"
        )


def row_stats(x64: torch.Tensor, eps: float, centred: bool = True):
    """(x̂, rstd, κ) of float64 rows ``x64`` (2-D): the reference's own statistics."""
    mu = x64.mean(-1, keepdim=True) if centred else torch.zeros_like(x64[:, :1])
    var = ((x64 - mu) ** 2).mean(-1, keepdim=True)
    rstd = (var + eps).rsqrt()
    return (x64 - mu) * rstd, rstd, 1 + mu.abs() * rstd


def simple(in_dtype: torch.dtype, quantity: str, kappa: float = 4.0) -> tuple[float, float]:
    """``(atol, rtol)`` for :func:`torch.testing.assert_close` on inputs whose rows have
    x̂, w, dy of order one and κ ≤ ``kappa`` (``conftest.make_x``'s offset 3 and scale 2 give
    κ ≈ 2.5): the model above with every scale replaced by its order of magnitude."""
    u = UNIT_ROUNDOFF[COMPUTE[in_dtype]]
    tol = K[in_dtype][quantity] * u * kappa
    return tol, max(tol, 2 * UNIT_ROUNDOFF[in_dtype])


def assert_close_to_rounding(
    actual: list[torch.Tensor],
    ref: list[torch.Tensor],
    exact: list[torch.Tensor],
    *,
    atol: float,
    rtol: float,
    factor: float = 16.0,
) -> None:
    """``actual`` and ``ref``: the results of one computation (a layer's outputs and gradients,
    say) done twice in one dtype along paths that round differently, such as a recurrent layer
    whose GEMMs sum in another order (the C tile against BLAS, whose blocking and vector width
    follow the processor: MKL's AVX-512 kernels on an Intel Xeon put float32 results of a 5-step
    LN-LSTM 2.6e-5 from the per-step loop's, past a fixed 2e-5); ``exact``: the same computation
    in float64 on the same rounded inputs.

    How far rounding moves such results depends on the problem (steps, layer norms of rows with
    little spread, sums over many rows), and which of two paths lands nearer ``exact`` varies from
    result to result (a GEMM order can be lucky on one direction's gradients), so the bound is
    the problem's measured sensitivity: ``ref``'s largest error relative to its result's size,
    over all results, ``ρ = max_i ‖ref_i − exact_i‖∞ / ‖exact_i‖∞``. Each ``actual_i`` may differ
    from ``ref_i`` by ``atol + rtol·|ref_i|`` or by ``factor · ρ · ‖ref_i‖∞``, whichever is
    larger: differences of the order of the rounding pass on any processor, a wrong value (many
    times the rounding) does not, and ``actual``'s own errors cannot widen the bound. The factor
    covers two paths' errors adding up and a path less accurate than the reference on some
    results (the C tile's sums against MKL's blocked ones: up to 15x on one direction's weight
    gradients, where the other direction's set ρ); 5-step LN-LSTM cases give ρ ≈ 3e-6, so 16·ρ
    is 5e-5 of a result's size, and a perturbation of 3e-4 of it fails each of them (31 steps:
    ρ ≈ 2e-5, and 1e-3 fails)."""
    assert len(actual) == len(ref) == len(exact), (len(actual), len(ref), len(exact))
    rho = max(
        (r.detach().double() - e.detach().double()).abs().max().item()
        / max(e.detach().double().abs().max().item(), torch.finfo(torch.float64).tiny)
        for r, e in zip(ref, exact, strict=True)
        if e.numel()
    )
    for i, (a, r) in enumerate(zip(actual, ref, strict=True)):
        scale = r.detach().double().abs().max().item() if r.numel() else 0.0
        torch.testing.assert_close(
            a,
            r,
            rtol=rtol,
            atol=max(atol, factor * rho * scale),
            msg=lambda m, i=i: f"result {i}: {m}",
        )
