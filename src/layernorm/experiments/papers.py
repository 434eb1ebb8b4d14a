"""The papers' side: the setting each experiment runs at paper scale, and the published numbers the
report prints beside ours. Data only (no training, no imports of experiments), so that the
command line, the runner and the report all read the same table.

``layernorm reproduce --paper`` runs each experiment's full configuration (``config(False)``) with
the ``settings`` of its :class:`PaperSetting` applied on top, one torch thread per run: two runs
side by side use both cores of a 2-core CPU. The settings are chosen so that the whole suite fits
about 10 CPU-hours (``est_cpu_hours``, measured with short timed runs; see
``docs/results/README.md``). Where the paper's own setting does not fit, ``reductions`` says what
was cut, and the report prints it next to ``paper``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "PAPER_SETTINGS",
    "REFERENCES",
    "PaperSetting",
    "Reference",
    "budget_table",
    "lanes",
    "paper_overrides",
    "references_for",
]


@dataclass(frozen=True)
class PaperSetting:
    """How one experiment runs at paper scale.

    Attributes:
        paper: the paper's own setting, in words (model, data, batch, optimizer, epochs).
        reductions: what ours leaves out or shrinks, one item each (empty: the paper's own).
        settings: ``--set`` values applied to ``config(False)`` (text, as on the command line).
        est_cpu_hours: the estimated CPU time of the whole experiment on one thread.
        basis: how the estimate was obtained (the timed run it scales).
    """

    paper: str
    reductions: tuple[str, ...]
    settings: Mapping[str, str]
    est_cpu_hours: float
    basis: str

    def __post_init__(self) -> None:
        if not self.est_cpu_hours >= 0:
            raise ValueError(f"PaperSetting.est_cpu_hours must be >= 0, got {self.est_cpu_hours}")
        if int(self.settings.get("seeds", 3)) < 3:
            raise ValueError("a paper setting runs at least 3 seeds")


#: Paper-scale setting of every experiment, in the order of the budget table. ``basis`` gives the
#: one-thread CPU seconds per update the estimate scales (``time.process_time`` of short runs of
#: the full configuration on a 2-core AMD EPYC (torch's CPU capability AVX512), taken while it was
#: shared at a load average of 11–14, so upper bounds: contention slows each update too); the
#: mnist-ff ones were measured per epoch on the same processor when it was quiet. Evaluations are
#: included as a share.
PAPER_SETTINGS: dict[str, PaperSetting] = {
    "invariances": PaperSetting(
        "Table 1: which of six weight and data transformations leave each normalization's "
        "output unchanged (analytic; the paper reports no measurement)",
        (),
        {},
        0.0,
        "seconds (float64 measurements, no training)",
    ),
    "geometry": PaperSetting(
        "§5: the Fisher information of a normalized GLM (analysis; the paper reports no "
        "measurement)",
        (),
        {},
        0.0,
        "seconds (empirical Fisher of small GLMs)",
    ),
    "mnist-ff": PaperSetting(
        "784-1000-1000-10 ReLU network, 55,000 training images, Adam (lr 1e-3), batch 128 and "
        "batch 4; no norm vs batch norm (unbiased variance at batch 4) vs layer norm on the "
        "hidden layers; training NLL and test error per epoch (Fig. 6)",
        ("10 epochs per run (the text states no epoch count; Fig. 6 gives only curves)",),
        {"epochs": "10", "seeds": "3", "threads": "1"},
        2.75,
        "measured on a quiet machine: 13 s/epoch at batch 128, 95 s/epoch at batch 4 with fused "
        "Adam; 3 models × 3 seeds × 10 epochs × (13 + 95 + 2 for evaluation) s; 300-update "
        "runs at load 8 agree: 82–100 CPU-s/epoch at batch 4 fused, 138–191 unfused",
    ),
    "convnet": PaperSetting(
        "§6.7 remark without a setting: ConvNets with no norm, batch norm and layer norm",
        (
            "the paper names no network: a 2-convolution MNIST CNN (32 and 64 channels) on "
            "55,000 images, batch 128, 4 epochs",
        ),
        {"epochs": "4", "seeds": "3", "threads": "1"},
        0.65,
        "0.137 CPU-s/update × 429 updates × 4 epochs × 9 runs + 10% evaluation",
    ),
    "adanorm": PaperSetting(
        "Xu et al. 2019: their 3-layer MNIST CNN on all 55,000 images, and a 12-layer "
        "Transformer on enwik8 for the char-LM; none vs LN vs LN-simple vs DetachNorm vs AdaNorm",
        (
            "MNIST: our CNN (two 5×5 convolutions of 32 and 64 channels, a 256-unit layer), "
            "batch 64, 6 epochs (their schedule is not in our sources)",
            "char-LM: Shakespeare with a 4-layer Transformer of width 128 on 64-character "
            "windows, 1,000 updates, instead of enwik8 with a 12-layer one (context only)",
        ),
        {
            "epochs": "6",
            "d_model": "128",
            "nhead": "4",
            "d_ff": "512",
            "seq_len": "64",
            "lm_steps": "1000",
            "lm_eval_every": "100",
            "n_valid": "500",
            "seeds": "3",
            "threads": "1",
        },
        1.75,
        "MNIST 0.042 CPU-s/update × 859 × 6 epochs × 15 runs + 10%; Transformer 1.45 CPU-s/"
        "update at width 256 and 128 characters, ÷8 at width 128 and 64 → 0.18 × 1,000 × 15",
    ),
    "char-lm": PaperSetting(
        "context, not an experiment of the LN paper: character-level Penn Treebank with "
        "1000-unit LSTMs (HyperNetworks), LSTM vs LN-LSTM",
        (
            "Shakespeare instead of Penn Treebank (installable data)",
            "512-unit LSTM, 100-character windows, batch 32, 800 updates",
        ),
        {"steps": "800", "eval_every": "80", "n_valid": "500", "seeds": "3", "threads": "1"},
        1.0,
        "0.48 CPU-s/update × 800 × 9 runs + 4% evaluation",
    ),
    "gain-init": PaperSetting(
        "§6.2: the attentive reader with LN gains initialized to 1.0 and 0.1 (CNN corpus, not "
        "available); recurrent batch norm needs γ = 0.1",
        (
            "the char-LM of char-lm in place of the attentive reader, with 256-unit LSTMs",
            "1,000 updates",
        ),
        {
            "hidden": "256",
            "steps": "1000",
            "eval_every": "100",
            "n_valid": "500",
            "seeds": "3",
            "threads": "1",
        },
        0.65,
        "char-lm's 0.48 CPU-s/update at 512 units, ÷2.7 at 256 → 0.18 × 1,000 × 12 runs + 5%",
    ),
    "seq-mnist": PaperSetting(
        "context (Cooijmans et al. 2016): pixel-by-pixel MNIST (784 steps), LSTM vs BN-LSTM, "
        "100-unit LSTMs trained for many epochs",
        ("1,500 updates of batch 16 (under half an epoch)", "test on 1,000 images"),
        {"steps": "1500", "eval_every": "150", "n_test": "1000", "seeds": "3", "threads": "1"},
        0.9,
        "0.21 CPU-s/update × 1,500 × 9 runs + 10 evaluations of 1,000 images per run",
    ),
    "spoken-digits": PaperSetting(
        "§6.5's point (small batches of long sequences; IAM-OnDB is not available): batch 8",
        ("spoken-digit MFCC sequences (6–92 frames) instead of handwriting (~700 steps)",),
        {"seeds": "3", "threads": "1"},
        0.3,
        "0.008–0.020 CPU-s/update in two timings (one evaluation per 100 updates, three times "
        "the run's share) × 6,000 × 12 runs",
    ),
    "longer-than-train": PaperSetting(
        "§3: LN's statistics per time step serve sequences longer than any in training, where "
        "recurrent batch norm needs statistics per step",
        (
            "char-LM on Shakespeare, 512-unit LSTM, 50-character training windows, 1,000 updates",
            "200 validation windows of 400 characters",
        ),
        {"steps": "1000", "eval_every": "100", "n_valid": "200", "seeds": "3", "threads": "1"},
        0.75,
        "0.26 CPU-s/update × 1,000 × 9 runs + 15% evaluation on 8× longer windows",
    ),
    "draw": PaperSetting(
        "§6.4: DRAW with 64 glimpses and 256-unit LSTMs on the fixed binarized MNIST "
        "(Larochelle & Murray; 50,000/10,000/10,000), Adam defaults, batch 128, 100 epochs in "
        "Fig. 4 and 200 for the final bound",
        (
            "16 glimpses and 128-unit LSTMs with z of 20 (paper: 64, 256 and Gregor et al.'s 100)",
            "10 epochs (3,900 updates) instead of 100–200",
            "MNIST binarized once with a seeded Bernoulli draw per pixel (the fixed "
            "Larochelle–Murray binarization is not installable); gradient norm clipped at 10",
        ),
        {"seeds": "3", "threads": "1"},
        1.9,
        "0.27 CPU-s/update (16 glimpses, 128 units, batch 128) × 390 × 10 epochs × 6 runs + 7%",
    ),
}


@dataclass(frozen=True)
class Reference:
    """A number a paper publishes, and how to read ours for the same quantity.

    Attributes:
        experiment: the experiment whose records hold ours.
        quantity: what it is, e.g. ``"MNIST test accuracy (%)"``.
        label: the model, as the paper names it.
        value: the published number (``None`` where the paper gives only a figure).
        source: paper, table/section and its setting.
        where: record columns selecting our runs of the same model.
        metric: the record column (``None``: nothing of ours to compare).
        transform: how our metric maps to the published quantity: ``""`` (as is),
            ``"acc%"`` (``100·(1 − error)``).
        comparable: ``True`` when ours is the same task and data; ``False`` for context
            (another data set or model size): the difference is then printed but not judged.
    """

    experiment: str
    quantity: str
    label: str
    value: float | None
    source: str
    where: Mapping[str, object] = field(default_factory=dict)
    metric: str | None = None
    transform: str = ""
    comparable: bool = True


_XU = "Xu et al. 2019, Table 1 (MNIST, 3-layer CNN, all 55,000 training images)"
_HYPER = "Ha et al. 2016 (HyperNetworks), character-level Penn Treebank, 1000 units"
_COOIJ = "Cooijmans et al. 2016 (Recurrent Batch Normalization), sequential MNIST"
_BPC = "BPC (theirs: PTB test; ours: Shakespeare validation)"
_DRAW = "Ba et al. 2016, §6.4: test variational bound after 200 epochs (64 glimpses, 256 units)"

#: Published numbers beside ours, with their sources. The LN paper states no MNIST test error in
#: its text (Fig. 6 gives only curves), so mnist-ff has one entry with no value.
REFERENCES: tuple[Reference, ...] = (
    Reference("mnist-ff", "test error (%)", "BN / LN, batch 128 and 4", None,
              "Ba et al. 2016, Fig. 6: curves only, no number in the text"),
    *(Reference("adanorm", "MNIST test accuracy (%)", name, acc, _XU,
                {"task": "mnist", "model": kind}, "test_err", "acc%")
      for kind, name, acc in (("none", "w/o Norm", 99.14), ("layer", "LayerNorm", 99.13),
                              ("simple", "LayerNorm-simple", 99.09),
                              ("detach", "DetachNorm", 99.10), ("ada", "AdaNorm", 99.35))),
    Reference("char-lm", _BPC, "LSTM", 1.312, _HYPER, {"model": "none"}, "valid_bpc",
              comparable=False),
    Reference("char-lm", _BPC, "LN-LSTM", 1.267, _HYPER, {"model": "layer"}, "valid_bpc",
              comparable=False),
    Reference("seq-mnist", "test accuracy (%)", "LSTM", 98.9, _COOIJ, {"model": "none"},
              "test_err", "acc%", comparable=False),
    Reference("seq-mnist", "test accuracy (%)", "BN-LSTM", 99.0, _COOIJ, {"model": "batch"},
              "test_err", "acc%", comparable=False),
    Reference("seq-mnist", "permuted test accuracy (%)", "LSTM", 90.2, _COOIJ),
    Reference("seq-mnist", "permuted test accuracy (%)", "BN-LSTM", 95.4, _COOIJ),
    Reference("draw", "test bound (nats)", "baseline", 82.36, _DRAW, {"model": "none"},
              "test_nats", comparable=False),
    Reference("draw", "test bound (nats)", "LN", 82.09, _DRAW, {"model": "cell"}, "test_nats",
              comparable=False),
)  # fmt: skip


def lanes(selected: Sequence[str], k: int = 2) -> list[list[str]]:
    """``selected`` split into ``k`` queues of about equal estimated CPU time (the longest
    first, each to the queue with the least so far), for ``k`` one-thread runs side by side."""
    queues: list[list[str]] = [[] for _ in range(k)]
    load = [0.0] * k
    for name in sorted(selected, key=lambda n: -PAPER_SETTINGS[n].est_cpu_hours):
        i = load.index(min(load))
        queues[i].append(name)
        load[i] += PAPER_SETTINGS[name].est_cpu_hours
    return queues


def budget_table(selected: Sequence[str]) -> str:
    """The Markdown budget table: experiment, setting, reductions, estimated CPU-hours."""
    rows = ["| experiment | paper's setting | ours reduces | est. CPU-hours |",
            "| --- | --- | --- | --- |"]  # fmt: skip
    for n in selected:
        ps = PAPER_SETTINGS[n]
        cut = "; ".join(ps.reductions) or "nothing (the paper's own)"
        rows.append(f"| `{n}` | {ps.paper} | {cut} | {ps.est_cpu_hours:.2f} |")
    total = sum(PAPER_SETTINGS[n].est_cpu_hours for n in selected)
    rows.append(f"| **total** | | | **{total:.2f}** |")
    return "\n".join(rows)


def references_for(experiment: str) -> list[Reference]:
    """The published numbers that belong beside ``experiment``'s."""
    return [r for r in REFERENCES if r.experiment == experiment]


def paper_overrides(selected: Sequence[str]) -> list[str]:
    """``--set`` items (``name.key=value``) that turn the full configurations of ``selected``
    into their paper settings; a ``KeyError`` for an experiment without one."""
    out = []
    for name in selected:
        if name not in PAPER_SETTINGS:
            raise KeyError(
                f"experiment {name!r} has no paper setting; add one to "
                f"layernorm.experiments.papers.PAPER_SETTINGS (have: {', '.join(PAPER_SETTINGS)})"
            )
        out += [f"{name}.{k}={v}" for k, v in PAPER_SETTINGS[name].settings.items()]
    return out
