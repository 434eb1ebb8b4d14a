"""Why DetachNorm trails LN-simple in the ``adanorm`` quick MNIST experiment: controlled runs.

Xu et al. (2019, Table 1) report 99.10% (DetachNorm) vs 99.09% (LN-simple) MNIST accuracy; the
``adanorm`` quick setting (4,000 images, 3 epochs, conv 8-16, fc 64, batch 64, Adam 1e-3) ends
near 28% vs 4% test error. This script varies one factor at a time around that setting and logs,
per epoch, the test error and what the detached backward changes: the norm ‖W‖ of the weights in
front of each normalization (relative to its initial value).

DetachNorm (Xu et al. §3): ``y = (x − μ)/σ`` with μ and σ constants in backward, so
``∂L/∂x = (∂L/∂y)/σ``. Its forward is invariant to scaling the weights ``W`` in front of it, but
unlike LN's gradient, whose projection keeps ``⟨∂L/∂W, W⟩ = 0``, the detached gradient has a
radial part ``⟨∂L/∂W, W⟩ = Σ_i (∂L/∂y_i) y_i`` that moves ‖W‖ without changing the output.

Run (one thread, as the quick experiments do)::

    PYTHONPATH=src python benchmarks/detachnorm_study.py --out docs/results/detachnorm --full

Writes ``records.csv`` (one row per run and epoch) and ``summary.md`` (final test error per
variant, mean ± sd over seeds) under ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import math
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import Tensor, nn

import layernorm
from layernorm import LayerNorm
from layernorm.data import load_mnist

# positions of the three normalizations in the CNN below: conv1, conv2, fc
NORM_AT = (2, 6, 11)
# positions of the four weight layers: conv1, conv2, fc, logits
LAYERS = (1, 5, 10, 13)
COS = ("conv1", "conv2", "fc", "logits")


@dataclass(frozen=True)
class Variant:
    """One setting. ``norms`` gives the normalization at (conv1, conv2, fc): ``simple`` (LN-simple),
    ``detach`` (μ and σ detached), ``detach_mean``, ``detach_std`` (one of the two detached).
    ``conv_axes``: the convolutions' norms over all units ``chw`` (as in ``adanorm``) or over the
    channels at each position ``c`` (a Transformer-style LN over the last dimension)."""

    name: str
    norms: tuple[str, str, str] = ("detach", "detach", "detach")
    lr: float = 1e-3
    n_train: int = 4000
    epochs: int = 3
    batch_size: int = 64
    channels: tuple[int, int] = (8, 16)
    fc: int = 64
    conv_axes: str = "chw"


def _norm(kind: str, shape: tuple[int, ...]) -> nn.Module:
    dm = kind in ("detach", "detach_mean")
    ds = kind in ("detach", "detach_std")
    return LayerNorm(shape, elementwise_affine=False, detach_mean=dm, detach_std=ds)


class _OverChannels(nn.Module):
    """Apply ``norm`` over the channels of ``(n, C, H, W)`` at each position."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def build(v: Variant) -> nn.Sequential:
    """The ``adanorm`` experiment's MNIST CNN (conv5 → norm → ReLU → pool, twice, fc → norm →
    ReLU → 10 logits), each norm over all of its layer's units, chosen per position."""
    c1, c2 = v.channels
    if v.conv_axes == "chw":
        n1, n2 = _norm(v.norms[0], (c1, 24, 24)), _norm(v.norms[1], (c2, 8, 8))
    else:
        n1, n2 = _OverChannels(_norm(v.norms[0], (c1,))), _OverChannels(_norm(v.norms[1], (c2,)))
    n3 = _norm(v.norms[2], (v.fc,))
    return nn.Sequential(
        nn.Unflatten(1, (1, 28, 28)),
        nn.Conv2d(1, c1, 5), n1, nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5), n2, nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(c2 * 16, v.fc), n3, nn.ReLU(), nn.Linear(v.fc, 10),
    )  # fmt: skip


def _weight_norms(net: nn.Sequential) -> list[float]:
    return [float(net[i - 1].weight.detach().norm()) for i in NORM_AT]  # type: ignore[union-attr]


def _grads(net: nn.Sequential, x: Tensor, y: Tensor) -> list[Tensor]:
    net.zero_grad(set_to_none=True)
    nn.functional.cross_entropy(net(x), y).backward()
    return [net[i].weight.grad.flatten().clone() for i in LAYERS]  # type: ignore[union-attr]


def gradient_cosines(net: nn.Sequential, x: Tensor, y: Tensor) -> list[float]:
    """Per weight matrix (conv1, conv2, fc, logits): the cosine between the gradient the model's
    norms give and the true gradient of the same loss (every μ and σ differentiated: LN-simple).

    DetachNorm's forward equals LN-simple's, so both gradients are of the same network at the same
    point; a cosine near 1 means the detached backward points where the loss actually falls."""
    norms = [m for m in net.modules() if isinstance(m, LayerNorm)]
    flags = [(m.detach_mean, m.detach_std) for m in norms]
    used = _grads(net, x, y)
    for m in norms:
        m.detach_mean = m.detach_std = False
    true = _grads(net, x, y)
    for m, (dm, ds) in zip(norms, flags, strict=True):
        m.detach_mean, m.detach_std = dm, ds
    net.zero_grad(set_to_none=True)
    return [
        float(nn.functional.cosine_similarity(a, b, dim=0)) for a, b in zip(used, true, strict=True)
    ]


@torch.no_grad()
def _test_error(net: nn.Module, x: Tensor, y: Tensor) -> float:
    net.eval()
    wrong = sum(int((net(x[i : i + 1000]).argmax(1) != y[i : i + 1000]).sum())
                for i in range(0, x.shape[0], 1000))  # fmt: skip
    net.train()
    return wrong / x.shape[0]


def train(v: Variant, seed: int, data: tuple[Tensor, Tensor, Tensor, Tensor]) -> list[dict]:
    """Adam on the first ``n_train`` images with the same seeding, data order and dropped last
    batch as the experiments' shared loop (``train_classifier``); one row per epoch, and one for
    the initial network (epoch 0). The gradient cosines use the first 512 training images and
    draw no random numbers, so the training itself is the shared loop's."""
    tx, ty, ex, ey = data
    tx, ty = tx[: v.n_train], ty[: v.n_train]
    torch.manual_seed(seed)
    net = build(v)
    opt = torch.optim.Adam(net.parameters(), lr=v.lr)
    order = torch.Generator().manual_seed(seed)
    w0 = _weight_norms(net)
    rows, steps, t0 = [], v.n_train // v.batch_size, time.perf_counter()
    for epoch in range(v.epochs + 1):  # epoch 0: the initial network, before any update
        total = math.nan
        if epoch:
            perm = torch.randperm(v.n_train, generator=order)
            total = 0.0
            for s in range(steps):
                idx = perm[s * v.batch_size : (s + 1) * v.batch_size]
                loss = nn.functional.cross_entropy(net(tx[idx]), ty[idx])
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach())
        w = _weight_norms(net)
        cos = gradient_cosines(net, tx[:512], ty[:512])
        ratios = {f"w_ratio_{n}": w[j] / w0[j] for j, n in enumerate(("conv1", "conv2", "fc"))}
        rows.append({**asdict(v), "norms": "/".join(v.norms),
                     "channels": "x".join(map(str, v.channels)), "seed": seed, "epoch": epoch,
                     "train_loss": total / steps, "test_err": _test_error(net, ex, ey),
                     **ratios, **{f"cos_{n}": c for n, c in zip(COS, cos, strict=True)},
                     "seconds": time.perf_counter() - t0})  # fmt: skip
    return rows


def variants(full: bool) -> list[Variant]:
    """The quick ``adanorm`` setting, then one factor changed at a time."""
    base = Variant("DetachNorm, quick setting")
    simple = replace(base, name="LN-simple, quick setting", norms=("simple",) * 3)
    out = [simple, base]
    out += [replace(base, name="DetachNorm, detach μ only", norms=("detach_mean",) * 3),
            replace(base, name="DetachNorm, detach σ only", norms=("detach_std",) * 3),
            replace(base, name="DetachNorm at conv1 only", norms=("detach", "simple", "simple")),
            replace(base, name="DetachNorm at conv2 only", norms=("simple", "detach", "simple")),
            replace(base, name="DetachNorm at fc only",
                    norms=("simple", "simple", "detach"))]  # fmt: skip
    out += [replace(simple, name="LN-simple, conv norms over channels per position", conv_axes="c"),
            replace(base, name="DetachNorm, conv norms over channels per position", conv_axes="c"),
            replace(base, name="DetachNorm μ only, conv norms over channels per position",
                    conv_axes="c", norms=("detach_mean",) * 3)]  # fmt: skip
    for lr in (1e-4, 3e-4, 3e-3):
        out += [
            replace(simple, name=f"LN-simple, lr {lr:g}", lr=lr),
            replace(base, name=f"DetachNorm, lr {lr:g}", lr=lr),
        ]
    out += [
        replace(simple, name="LN-simple, 10 epochs", epochs=10),
        replace(base, name="DetachNorm, 10 epochs", epochs=10),
    ]
    if full:  # all 55,000 images (13.75 times the updates per epoch of 4,000), 2 epochs
        out += [
            replace(simple, name="LN-simple, 55,000 images, 2 epochs", n_train=55_000, epochs=2),
            replace(base, name="DetachNorm, 55,000 images, 2 epochs", n_train=55_000, epochs=2),
        ]
    return out


def summarize(rows: Sequence[dict]) -> str:
    """Per variant, after the last epoch: test error, training loss (mean over the last epoch),
    ‖W‖/‖W₀‖ in front of each norm and the gradient cosines, mean ± sd over seeds."""
    lines = ["| variant | lr | images | epochs | test error (%) | train loss | ‖W‖/‖W₀‖ conv1 | "
             "conv2 | fc | cos conv1 | conv2 | fc | logits | s/run |",
             "|" + " --- |" * 14]  # fmt: skip
    names = list(dict.fromkeys(r["name"] for r in rows))
    for name in names:
        last = {}
        for r in rows:
            if r["name"] == name:
                last[r["seed"]] = r  # rows come in epoch order
        fin = list(last.values())

        def ms(key: str, scale: float = 1.0, fmt: str = "{:.2f}", fin=fin) -> str:
            vals = [scale * float(r[key]) for r in fin]
            sd = statistics.stdev(vals) if len(vals) > 1 else 0.0
            return f"{fmt.format(statistics.fmean(vals))} ± {fmt.format(sd)}"

        r0 = fin[0]
        lines.append(f"| {name} | {r0['lr']:g} | {r0['n_train']} | {r0['epochs']} | "
                     f"{ms('test_err', 100.0)} | {ms('train_loss', fmt='{:.3f}')} | "
                     + " | ".join(ms(f"w_ratio_{n}") for n in COS[:3]) + " | "
                     + " | ".join(ms(f"cos_{n}") for n in COS)
                     + f" | {ms('seconds', fmt='{:.1f}')} |")  # fmt: skip
    return "\n".join(lines)


def init_table(rows: Sequence[dict]) -> str:
    """Per distinct choice of norms: the gradient cosines of the initial network (epoch 0, the
    quick setting's first seed), before training has moved the weights."""
    lines = ["| norms (conv1/conv2/fc) | conv axes | cos conv1 | conv2 | fc | logits |",
             "|" + " --- |" * 6]  # fmt: skip
    seen = set()
    for r in rows:
        key = (r["norms"], r["conv_axes"])
        if r["epoch"] == 0 and r["seed"] == 0 and key not in seen:
            seen.add(key)
            cells = " | ".join(f"{float(r[f'cos_{n}']):.2f}" for n in COS)
            lines.append(f"| {r['norms']} | {r['conv_axes']} | {cells} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--full", action="store_true", help="also the 55,000-image runs")
    p.add_argument("--full-seeds", type=int, default=2, help="seeds of the 55,000-image runs")
    p.add_argument("--only", default="", help="run only variants whose name contains this")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    m = load_mnist()
    data = (m.train_x, m.train_y, m.test_x, m.test_y)
    rows: list[dict] = []
    t0 = time.perf_counter()
    for v in variants(a.full):
        if a.only and a.only not in v.name:
            continue
        for seed in range(min(a.seeds, a.full_seeds) if v.n_train > 4000 else a.seeds):
            rows += train(v, seed, data)
        print(summarize([r for r in rows if r["name"] == v.name]).splitlines()[-1], flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    with open(a.out / "records.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    env = (f"torch {torch.__version__}, layernorm {layernorm.__version__}, "
           f"{platform.processor() or platform.machine()}, 1 thread, "
           f"total wall time {time.perf_counter() - t0:.0f} s")  # fmt: skip
    text = (f"After the last epoch:\n\n{summarize(rows)}\n\nGradient cosines at initialization:"
            f"\n\n{init_table(rows)}\n\n{env}\n")  # fmt: skip
    (a.out / "summary.md").write_text(text)
    print(env)


if __name__ == "__main__":
    main()
