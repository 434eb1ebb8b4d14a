"""Table 1 of Ba et al. 2016, computed: which normalizations leave a layer's normalized summed
inputs unchanged under six transformations of the weights and the data.

A layer computes ``a = W x`` for a batch of cases; each method normalizes ``a``
(batch norm over the batch per unit, weight norm through ``w_i/‖w_i‖``, layer norm and RMSNorm
over the units per case). A transformation is *invariant* when the normalized output is unchanged
up to rounding: the largest absolute change, relative to the largest output, is below ``tol``
(float64 throughout, ``eps`` tiny so it does not blur the comparison).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn.utils.parametrizations import weight_norm

from ... import BatchNorm, LayerNorm, RMSNorm
from ..analysis.plots import plt, save_figure
from ..engine.registry import Claim, Experiment, Record, RunContext, Verdict, check_config, register

METHODS = ("batch norm", "weight norm", "layer norm", "RMSNorm")
TRANSFORMS = (
    "weight matrix re-scaling",
    "weight matrix re-centering",
    "weight vector re-scaling",
    "dataset re-scaling",
    "dataset re-centering",
    "single training case re-scaling",
)
# Table 1 of the paper (RMSNorm row from Zhang & Sennrich 2019): True = invariant.
PAPER: dict[str, tuple[bool, ...]] = {
    "batch norm": (True, False, True, True, True, False),
    "weight norm": (True, False, True, False, False, False),
    "layer norm": (True, True, False, True, False, True),
    "RMSNorm": (True, False, False, True, False, True),
}


@dataclass(frozen=True)
class InvariancesConfig:
    """Attributes: ``cases`` in the batch, ``inputs`` (D), ``units`` (H), ``trials`` random draws
    of weights, data and transformation constants, ``tol`` the relative change counted as none."""

    cases: int = 64
    inputs: int = 30
    units: int = 40
    trials: int = 5
    tol: float = 1e-9

    def __post_init__(self) -> None:
        check_config(self, ("cases", "inputs", "units", "trials", "tol"))
        if self.cases < 2 or self.units < 2:
            raise ValueError("InvariancesConfig: batch norm and layer norm need cases, units >= 2")


def config(quick: bool) -> InvariancesConfig:
    return InvariancesConfig(trials=3) if quick else InvariancesConfig()


def _normalized(method: str, W: Tensor, X: Tensor) -> Tensor:
    """The normalized summed inputs ``(cases, units)`` of a bias-free layer with weights ``W``."""
    H, D = W.shape
    if method == "weight norm":
        lin = weight_norm(nn.Linear(D, H, bias=False, dtype=W.dtype), dim=0)
        with torch.no_grad():
            lin.parametrizations.weight.original0.fill_(1.0)  # the gains g
            lin.parametrizations.weight.original1.copy_(W)  # the direction v: w = g·v/‖v‖
        return lin(X)
    a = X @ W.T
    if method == "batch norm":
        return BatchNorm(H, eps=1e-30, affine=False, dtype=W.dtype).train()(a)
    if method == "layer norm":
        return LayerNorm(H, eps=1e-30, elementwise_affine=False)(a)
    if method == "RMSNorm":
        return RMSNorm(H, eps=1e-30, elementwise_affine=False)(a)
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


def _transforms(g: torch.Generator, W: Tensor, X: Tensor) -> dict[str, tuple[Tensor, Tensor]]:
    H, D = W.shape
    N = X.shape[0]

    def u(*shape: int, lo: float = 0.5, hi: float = 3.0) -> Tensor:
        return lo + (hi - lo) * torch.rand(*shape, generator=g, dtype=W.dtype)

    unit, case = int(torch.randint(H, (1,), generator=g)), int(torch.randint(N, (1,), generator=g))
    Wv, Xc = W.clone(), X.clone()
    Wv[unit] *= u(1)  # one unit's incoming weights w_i' = δ_i w_i
    Xc[case] *= u(1)  # one training case x_n' = δ_n x_n
    return {
        "weight matrix re-scaling": (W * u(1), X),  # W' = δ W
        "weight matrix re-centering": (W + torch.randn(1, D, generator=g, dtype=W.dtype), X),
        "weight vector re-scaling": (Wv, X),
        "dataset re-scaling": (W, X * u(1)),  # x' = δ x for every case
        "dataset re-centering": (W, X + torch.randn(1, D, generator=g, dtype=W.dtype)),
        "single training case re-scaling": (W, Xc),
    }


def run(cfg: InvariancesConfig, ctx: RunContext) -> list[Record]:
    records: list[Record] = []
    g = torch.Generator().manual_seed(ctx.seed)
    with torch.no_grad():
        for trial in range(cfg.trials):
            W = torch.randn(cfg.units, cfg.inputs, generator=g, dtype=torch.float64)
            # non-zero mean, unequal scales: a data set that centering and scaling can change
            X = 0.7 + torch.randn(cfg.cases, cfg.inputs, generator=g, dtype=torch.float64) * 2.0
            variants = _transforms(g, W, X)
            for method in METHODS:
                base = _normalized(method, W, X)
                for name in TRANSFORMS:
                    W2, X2 = variants[name]
                    change = float((_normalized(method, W2, X2) - base).abs().max())
                    records.append(
                        {
                            "trial": trial,
                            "method": method,
                            "transform": name,
                            "rel_change": change / float(base.abs().max()),
                        }
                    )
    return records


def measured(
    records: Sequence[Record], cfg: InvariancesConfig
) -> dict[tuple[str, str], tuple[bool, float]]:
    """Per (method, transform): invariant in every trial?, and the largest relative change."""
    out: dict[tuple[str, str], tuple[bool, float]] = {}
    for m in METHODS:
        for t in TRANSFORMS:
            ch = [
                float(r["rel_change"]) for r in records if r["method"] == m and r["transform"] == t
            ]
            if ch:
                out[m, t] = (max(ch) < cfg.tol, max(ch))
    return out


def table_text(records: Sequence[Record], cfg: InvariancesConfig) -> str:
    """Markdown: each cell ``ours / paper`` with ✓ where they agree, ✗ where they do not."""
    res = measured(records, cfg)
    head = "| | " + " | ".join(TRANSFORMS) + " |\n|" + " --- |" * (len(TRANSFORMS) + 1)
    rows = []
    for m in METHODS:
        cells = []
        for j, t in enumerate(TRANSFORMS):
            if (m, t) not in res:
                cells.append("—")
                continue
            inv, change = res[m, t]
            paper = PAPER[m][j]
            word = lambda b: "invariant" if b else "no"  # noqa: E731
            mark = "✓" if inv == paper else "✗"
            cells.append(f"{mark} {word(inv)} / {word(paper)} (max change {change:.1e})")
        rows.append(f"| **{m}** | " + " | ".join(cells) + " |")
    trials = len({r["trial"] for r in records})
    return (
        f'Each cell: ours / paper (Table 1), ✓ where they agree; "invariant" means the '
        f"largest change of the normalized summed inputs, relative to their largest value, "
        f"stays below {cfg.tol:g} in all {trials} random trials (float64).\n\n"
        + head
        + "\n"
        + "\n".join(rows)
    )


def verdicts(records: Sequence[Record], cfg: InvariancesConfig) -> list[Verdict]:
    res = measured(records, cfg)
    out = []
    for cid, methods in (("table1", METHODS[:3]), ("rmsnorm", METHODS[3:])):
        cells = [(m, t, j) for m in methods for j, t in enumerate(TRANSFORMS)]
        have = [(m, t, j) for m, t, j in cells if (m, t) in res]
        wrong = [f"{m} / {t}" for m, t, j in have if res[m, t][0] != PAPER[m][j]]
        if len(have) < len(cells):
            status, stat = "inconclusive", f"{len(have)} of {len(cells)} cells measured"
        else:
            status = "holds" if not wrong else "does not hold"
            stat = f"{len(cells) - len(wrong)} of {len(cells)} cells agree with the paper"
            if wrong:
                stat += "; disagree: " + "; ".join(wrong)
        out.append(
            Verdict(
                cid,
                status,
                stat,  # type: ignore[arg-type]
                f"holds if every cell agrees; a cell is invariant when the relative "
                f"change is < {cfg.tol:g} in every trial",
            )
        )
    return out


def plot(records: Sequence[Record], cfg: InvariancesConfig, fig_dir: Path) -> list[Path]:
    res = measured(records, cfg)
    import math

    grid = [
        [math.log10(max(res.get((m, t), (False, math.nan))[1], 1e-17)) for t in TRANSFORMS]
        for m in METHODS
    ]
    fig, ax = plt.subplots(figsize=(9, 3.2))
    im = ax.imshow(grid, cmap="RdYlGn_r", vmin=-17, vmax=0, aspect="auto")
    ax.set_xticks(
        range(len(TRANSFORMS)), [t.replace(" re-", "\nre-") for t in TRANSFORMS], fontsize=7
    )
    ax.set_yticks(range(len(METHODS)), METHODS, fontsize=8)
    for i, m in enumerate(METHODS):
        for j in range(len(TRANSFORMS)):
            inv = res.get((m, TRANSFORMS[j]), (False, 0))[0]
            ax.text(
                j,
                i,
                ("inv" if inv else "no") + ("" if inv == PAPER[m][j] else " ✗"),
                ha="center",
                va="center",
                fontsize=8,
            )
    fig.colorbar(im, ax=ax, label="log10 max relative change")
    ax.set_title("Table 1, measured: change of the normalized summed inputs", fontsize=10)
    return [save_figure(fig, fig_dir / "invariances.png")]


EXPERIMENT = register(
    Experiment(
        name="invariances",
        title="Invariance under weight and data transformations (Table 1)",
        section="Ba et al. 2016, §5.1 and Table 1",
        claims=(
            Claim(
                "table1",
                "“Table 1 highlights the following invariance results for three normalization "
                "methods.” — e.g. “layer normalization is invariant to scaling of the entire "
                "weight matrix and invariant to a shift to all of the incoming weights in the "
                "weight matrix”, and “is invariant to re-scaling of individual training cases” "
                "(§5.1)",
                "All 18 cells of Table 1 (batch, weight and layer norm × six transformations) are "
                "measured on random layers and data.",
            ),
            Claim(
                "rmsnorm",
                "RMSNorm row (Zhang & Sennrich 2019): invariant to re-scaling, not to re-centering",
                "The 6 RMSNorm cells, measured the same way.",
            ),
        ),
        config=config,
        run=run,
        verdicts=verdicts,
        plot=plot,
        tables=table_text,
        quick_budget_s=5.0,
        order=0,
    )
)
