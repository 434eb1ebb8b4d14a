"""CPU seconds per update of each experiment's paper setting: the inputs of the budget table in
docs/results/README.md (``est_cpu_hours`` in ``layernorm.experiments.papers``).

Each experiment runs its paper configuration with one thread, one seed and one model, cut to a few
updates, and is timed with ``time.process_time``: the CPU time of this process, which the
machine's other work inflates less than wall-clock time (contention for caches still does, so on a
busy machine the figures are upper bounds; the load average is printed beside them). The time
includes one evaluation and building the model, so it slightly overstates a long run's update.

    python benchmarks/paper_budget.py                  # every experiment with updates to time
    python benchmarks/paper_budget.py mnist-ff convnet
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

from layernorm.experiments import get, names
from layernorm.experiments.data import load_corpus, mnist_subsets
from layernorm.experiments.engine.registry import RunContext, apply_overrides
from layernorm.experiments.engine.runner import run_identity
from layernorm.experiments.papers import PAPER_SETTINGS

# experiment → (settings on top of the paper setting that cut it to a few updates, updates run)
SHORT: dict[str, tuple[dict[str, str], int]] = {
    "mnist-ff": ({"n_train": "1200", "n_test": "100", "epochs": "1", "seeds": "1",
                  "norms": "layer", "batch_sizes": "4"}, 300),
    "convnet": ({"n_train": "6400", "n_test": "1000", "epochs": "1", "seeds": "1",
                 "norms": "layer"}, 50),
    "adanorm": ({"tasks": "mnist", "kinds": "layer", "n_train": "6400", "n_test": "1000",
                 "epochs": "1", "seeds": "1"}, 100),
    "char-lm": ({"steps": "30", "eval_every": "30", "n_valid": "32", "norms": "layer",
                 "seeds": "1"}, 30),
    "gain-init": ({"steps": "30", "eval_every": "30", "n_valid": "32", "models": "layer-g1",
                   "seeds": "1"}, 30),
    "seq-mnist": ({"steps": "10", "eval_every": "10", "n_test": "16", "norms": "layer",
                   "seeds": "1"}, 10),
    "spoken-digits": ({"steps": "100", "eval_every": "100", "seeds": "1",
                       "models": "lstm-layer"}, 100),
    "longer-than-train": ({"steps": "30", "eval_every": "30", "n_valid": "8", "norms": "layer",
                           "seeds": "1"}, 30),
    "draw": ({"n_train": "2560", "n_test": "500", "epochs": "1", "seeds": "1",
              "norms": "cell"}, 20),
}  # fmt: skip


def time_one(name: str) -> tuple[float, int]:
    """``(CPU seconds, updates)`` of the cut-down paper setting of ``name``."""
    exp = get(name)
    short, updates = SHORT[name]
    cfg = apply_overrides(exp.config(False), {**PAPER_SETTINGS[name].settings, **short})
    with tempfile.TemporaryDirectory() as d:
        ctx = RunContext(Path(d), torch.device("cpu"), progress=False,
                         identity=run_identity(name, False, 0, cfg))  # fmt: skip
        c0 = time.process_time()
        exp.run(cfg, ctx)
        return time.process_time() - c0, updates


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("names", nargs="*", help="experiments (default: all with updates to time)")
    a = p.parse_args(argv)
    chosen = a.names or [n for n in names() if n in SHORT]
    torch.set_num_threads(1)
    mnist_subsets(100, 100)  # load the data once, outside the timings
    load_corpus()
    print("| experiment | updates timed | CPU-s per update | load average (1 min) |")
    print("| --- | --- | --- | --- |")
    for n in chosen:
        secs, updates = time_one(n)
        print(f"| `{n}` | {updates} | {secs / updates:.4f} | {os.getloadavg()[0]:.1f} |",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
