"""Section 5.2 of Ba et al. 2016, checked numerically: the geometry of normalized generalized
linear models under the (empirical) Fisher metric.

Model: H independent Bernoulli GLMs on D inputs, ``p_i = sigmoid(g_i·(a_i − μ)/σ + b_i)`` with
``a = W x`` and μ, σ taken over the H summed inputs of each case (layer norm), compared with the
standard GLM ``p_i = sigmoid(w_iᵀx + b_i)`` and a weight-normalized GLM
(``w_i = g_i v_i/‖v_i‖``). The empirical Fisher is ``F = (1/N) Σ_n ∇ℓ_n ∇ℓ_nᵀ`` over per-case
gradients of the log-likelihood ``ℓ_n``; per-case gradients come from giving every case its own
copy of the parameters, so one backward pass yields all of them. Float64 throughout.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ...functional import layer_norm
from ..analysis.plots import plt, save_figure
from ..engine.registry import Claim, Experiment, Record, RunContext, Verdict, check_config, register

DT = torch.float64


@dataclass(frozen=True)
class GeometryConfig:
    """Attributes: ``cases`` N, ``inputs`` D, ``units`` H, ``scales`` the factors δ applied to
    the weights and c to the inputs, ``slope_tol`` how far a fitted log-log slope may be from the
    theory, ``output_tol`` how much the predictions may move when they should not."""

    cases: int = 2000
    inputs: int = 20
    units: int = 8
    scales: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    slope_tol: float = 0.02
    output_tol: float = 1e-9

    def __post_init__(self) -> None:
        check_config(self, ("cases", "inputs", "units", "scales", "slope_tol", "output_tol"))
        if len(set(self.scales)) < 2:
            raise ValueError(f"GeometryConfig.scales needs two distinct values, got {self.scales}")


def config(quick: bool) -> GeometryConfig:
    return GeometryConfig(cases=400) if quick else GeometryConfig()


def _per_case(p: Tensor, n: int) -> Tensor:
    return p.detach().unsqueeze(0).repeat(n, *([1] * p.dim())).requires_grad_(True)


def _ln_glm(
    W: Tensor, b: Tensor, g: Tensor, X: Tensor, Y: Tensor
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """Per-case gradients of the layer-normalized GLM: (probabilities, {name: (N, *shape)}, ŷ)."""
    n = X.shape[0]
    Wn, bn, gn = _per_case(W, n), _per_case(b, n), _per_case(g, n)
    a = torch.einsum("nhd,nd->nh", Wn, X)
    a_hat = layer_norm(a, a.shape[-1], eps=1e-30)
    z = gn * a_hat + bn
    loglik = -torch.nn.functional.binary_cross_entropy_with_logits(z, Y, reduction="sum")
    gW, gb, gg = torch.autograd.grad(loglik, (Wn, bn, gn))
    return torch.sigmoid(z).detach(), {"W": gW, "b": gb, "g": gg}, a_hat.detach()


def _wn_glm(
    V: Tensor, b: Tensor, g: Tensor, X: Tensor, Y: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    n = X.shape[0]
    Vn, bn, gn = _per_case(V, n), _per_case(b, n), _per_case(g, n)
    w = gn.unsqueeze(-1) * Vn / Vn.norm(dim=-1, keepdim=True)
    z = torch.einsum("nhd,nd->nh", w, X) + bn
    loglik = -torch.nn.functional.binary_cross_entropy_with_logits(z, Y, reduction="sum")
    gV, gb, gg = torch.autograd.grad(loglik, (Vn, bn, gn))
    return torch.sigmoid(z).detach(), {"W": gV, "b": gb, "g": gg}


def _std_glm(W: Tensor, b: Tensor, X: Tensor, Y: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    n = X.shape[0]
    Wn, bn = _per_case(W, n), _per_case(b, n)
    z = torch.einsum("nhd,nd->nh", Wn, X) + bn
    loglik = -torch.nn.functional.binary_cross_entropy_with_logits(z, Y, reduction="sum")
    gW, gb = torch.autograd.grad(loglik, (Wn, bn))
    return torch.sigmoid(z).detach(), {"W": gW, "b": gb}


def _fisher_trace_rows(gW: Tensor) -> Tensor:
    """trace of the empirical Fisher block of each row w_i: (1/N) Σ_n ‖∂ℓ_n/∂w_i‖²  → (H,)."""
    return gW.pow(2).sum(-1).mean(0)


def run(cfg: GeometryConfig, ctx: RunContext) -> list[Record]:
    gen = torch.Generator().manual_seed(ctx.seed)
    N, D, H = cfg.cases, cfg.inputs, cfg.units
    X = 0.5 + torch.randn(N, D, generator=gen, dtype=DT)
    teacher = torch.randn(H, D, generator=gen, dtype=DT) / math.sqrt(D)
    Y = torch.bernoulli(torch.sigmoid(X @ teacher.T), generator=gen)
    W = torch.randn(H, D, generator=gen, dtype=DT) / math.sqrt(D)
    b = 0.1 * torch.randn(H, generator=gen, dtype=DT)
    g = 1.0 + 0.1 * torch.randn(H, generator=gen, dtype=DT)
    records: list[Record] = []

    # 1. Weight growth at fixed output: LN is invariant to scaling the whole W, weight norm to
    #    scaling one v_i; the Fisher block along the grown weights should fall as 1/‖w‖².
    p0, _, _ = _ln_glm(W, b, g, X, Y)
    q0, _ = _wn_glm(W, b, g, X, Y)
    for d in cfg.scales:
        p, grads, _ = _ln_glm(W * d, b, g, X, Y)
        records.append(
            {
                "part": "weight growth",
                "model": "layer norm",
                "scale": d,
                "weight_norm": float((W * d).norm(dim=1).mean()),
                "metric": float(_fisher_trace_rows(grads["W"]).mean()),
                "output_change": float((p - p0).abs().max()),
            }
        )
        V = W.clone()
        V[0] *= d  # grow one unit's direction vector only
        q, gq = _wn_glm(V, b, g, X, Y)
        records.append(
            {
                "part": "weight growth",
                "model": "weight norm",
                "scale": d,
                "weight_norm": float(V[0].norm()),
                "metric": float(_fisher_trace_rows(gq["W"])[0]),
                "output_change": float((q - q0).abs().max()),
            }
        )

    # 2. Input scale at fixed predictions: x' = c·x. LN: same parameters (invariant to re-scaling
    #    the data set). Standard GLM: w' = w/c so that every prediction (and error) is unchanged.
    s0, _ = _std_glm(W, b, X, Y)
    for c in cfg.scales:
        p, grads, a_hat = _ln_glm(W, b, g, X * c, Y)
        gain_metric = grads["g"].pow(2).mean(0)  # diagonal of the Fisher block of the gains
        # the paper: the gain's metric depends only on the prediction error (y − p) times the
        # normalized input, whose scale is fixed by the normalization
        from_error = ((Y - p) * a_hat).pow(2).mean(0)
        records.append(
            {
                "part": "input scale",
                "model": "layer norm (gain)",
                "scale": c,
                "input_norm": float((X * c).norm(dim=1).mean()),
                "metric": float(gain_metric.mean()),
                "error_formula_gap": float(((gain_metric - from_error).abs() / from_error).max()),
                "output_change": float((p - p0).abs().max()),
            }
        )
        s, gs = _std_glm(W / c, b, X * c, Y)
        u = W / W.norm(dim=1, keepdim=True)  # direction of each w_i: moving along it = magnitude
        along = torch.einsum("nhd,hd->nh", gs["W"], u).pow(2).mean(0)
        records.append(
            {
                "part": "input scale",
                "model": "standard GLM (weight magnitude)",
                "scale": c,
                "input_norm": float((X * c).norm(dim=1).mean()),
                "metric": float(along.mean()),
                "output_change": float((s - s0).abs().max()),
            }
        )
    return records


def _slope(records: Sequence[Record], part: str, model: str) -> tuple[float, float]:
    """Least-squares slope of log(metric) against log(scale), and the largest output change."""
    rs = [r for r in records if r["part"] == part and r["model"] == model]
    xs = [math.log(float(r["scale"])) for r in rs]
    ys = [math.log(float(r["metric"])) for r in rs]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return slope, max(float(r["output_change"]) for r in rs)


def verdicts(records: Sequence[Record], cfg: GeometryConfig) -> list[Verdict]:
    out = []
    (s_ln, o_ln), (s_wn, o_wn) = (
        _slope(records, "weight growth", m) for m in ("layer norm", "weight norm")
    )
    ok = all(abs(s + 2) < cfg.slope_tol for s in (s_ln, s_wn)) and max(o_ln, o_wn) < cfg.output_tol
    out.append(
        Verdict(
            "geo-shrink",
            "holds" if ok else "does not hold",
            f"log-log slope of the Fisher trace along w_i against ‖w_i‖: layer norm "
            f"{s_ln:.4f}, weight norm {s_wn:.4f} (theory −2, i.e. the metric length "
            f"halves when the norm doubles); largest change of any prediction "
            f"{max(o_ln, o_wn):.1e}",
            f"holds if both slopes are within ±{cfg.slope_tol} of −2 and predictions "
            f"move by less than {cfg.output_tol:g}",
        )
    )
    (s_g, o_g), (s_std, o_std) = (
        _slope(records, "input scale", m)
        for m in ("layer norm (gain)", "standard GLM (weight magnitude)")
    )
    ok = (
        abs(s_g) < cfg.slope_tol
        and abs(s_std - 2) < cfg.slope_tol
        and max(o_g, o_std) < cfg.output_tol
    )
    out.append(
        Verdict(
            "geo-input-scale",
            "holds" if ok else "does not hold",
            f"log-log slope against the input scale: gain metric (layer norm) "
            f"{s_g:.4f}, weight-magnitude metric (standard GLM) {s_std:.4f}; largest "
            f"change of any prediction {max(o_g, o_std):.1e}",
            f"holds if the gain slope is within ±{cfg.slope_tol} of 0 and the standard "
            f"GLM's within ±{cfg.slope_tol} of 2, predictions fixed",
        )
    )
    gaps = [float(r["error_formula_gap"]) for r in records if "error_formula_gap" in r]
    ok = bool(gaps) and max(gaps) < 1e-9
    out.append(
        Verdict(
            "geo-gain-error",
            "holds" if ok else "does not hold",
            f"largest relative gap between the gain's Fisher diagonal and "
            f"mean_n[(y_i − p_i)² â_i²]: {max(gaps) if gaps else math.nan:.1e}",
            "holds if the gap is below 1e-9 at every input scale",
        )
    )
    return out


def plot(records: Sequence[Record], cfg: GeometryConfig, fig_dir: Path) -> list[Path]:
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, part, xlab in (
        (axes[0], "weight growth", "weight scale δ (‖w_i‖ ∝ δ, output fixed)"),
        (axes[1], "input scale", "input scale c (predictions fixed)"),
    ):
        for model in dict.fromkeys(r["model"] for r in records if r["part"] == part):
            rs = [r for r in records if r["part"] == part and r["model"] == model]
            ax.loglog([r["scale"] for r in rs], [r["metric"] for r in rs], "o-", label=model)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(cfg.scales), [f"{v:g}" for v in cfg.scales])
        ax.minorticks_off()
        ax.set_xlabel(xlab)
        ax.set_ylabel("empirical Fisher metric")
        ax.grid(alpha=0.3, which="major")
        ax.legend(fontsize=8)
    axes[0].set_title("metric along w_i vs its norm (theory: slope −2)", fontsize=10)
    axes[1].set_title("metric vs input scale (theory: gain 0, standard GLM 2)", fontsize=10)
    return [save_figure(fig, fig_dir / "geometry.png")]


EXPERIMENT = register(
    Experiment(
        name="geometry",
        title="Geometry of normalized GLMs under the Fisher metric (Section 5.2)",
        section="Ba et al. 2016, §5.2",
        claims=(
            Claim(
                "geo-shrink",
                "“If the norm of the weight vector w_i grows twice as large, even though the "
                "model’s output remains the same, the Fisher information matrix will be "
                "different. The curvature along the w_i direction will change by a factor of 1/2 "
                "because the σ_i will also be twice as large.” (§5.2)",
                "Grow the weights at fixed output (the whole W for layer norm, one v_i for weight "
                "norm) and fit the slope of log trace(F_{w_i}) against log ‖w_i‖; theory: −2 for "
                "the Fisher (ds², so a factor 1/2 in ds per doubling).",
            ),
            Claim(
                "geo-input-scale",
                "“Riemannian metric along the magnitude of the incoming weights for the standard "
                "GLM is scaled by the norm of its input, whereas learning the gain parameters for "
                "the batch normalized and layer normalized models depends only on the magnitude "
                "of the prediction error.” (§5.2)",
                "Scale the inputs by c at fixed predictions: the layer-norm GLM's gain metric "
                "should not change (slope 0), the standard GLM's metric along the weight "
                "magnitude should grow as c² (slope 2).",
            ),
            Claim(
                "geo-gain-error",
                "“learning the gain parameters […] depends only on the magnitude of the "
                "prediction error” (§5.2)",
                "The gain's Fisher diagonal computed by autograd equals the mean of (y_i − "
                "p_i)²·â_i², the squared prediction error times the normalized input.",
            ),
        ),
        config=config,
        run=run,
        verdicts=verdicts,
        plot=plot,
        quick_budget_s=5.0,
        order=10,
    )
)
