"""Paper-scale settings, their provenance and the published numbers in the report (tiny runs)."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from layernorm import cli
from layernorm.experiments import get, names, reproduce
from layernorm.experiments.analysis.report import reference_rows
from layernorm.experiments.definitions import adanorm_study
from layernorm.experiments.engine.io import FolderInUseError
from layernorm.experiments.engine.provenance import command_line
from layernorm.experiments.engine.registry import apply_overrides
from layernorm.experiments.papers import (
    PAPER_SETTINGS,
    REFERENCES,
    budget_table,
    lanes,
    paper_overrides,
)

# mnist-ff's paper setting shrunk to seconds; the paper's models and batch-size pair stay
TINY_FF = ["mnist-ff.n_train=64", "mnist-ff.n_test=32", "mnist-ff.hidden=8", "mnist-ff.epochs=1",
           "mnist-ff.batch_sizes=16,4"]  # fmt: skip


@pytest.mark.parametrize("name", names())
def test_every_experiment_has_a_paper_setting_that_validates(name):
    ps = PAPER_SETTINGS[name]
    cfg = apply_overrides(get(name).config(False), ps.settings)  # __post_init__ validates
    fields = {f.name for f in dataclasses.fields(cfg)}
    if "seeds" in fields:
        assert cfg.seeds >= 3
    if "threads" in fields:  # two one-thread runs side by side use both cores
        assert cfg.threads == 1
    assert ps.paper and ps.basis


def test_the_suite_fits_the_budget_and_splits_into_two_even_lanes():
    total = sum(PAPER_SETTINGS[n].est_cpu_hours for n in names())
    assert 0 < total <= 11.0
    queues = lanes(names())
    assert sorted(n for q in queues for n in q) == sorted(names())
    hours = [sum(PAPER_SETTINGS[n].est_cpu_hours for n in q) for q in queues]
    assert abs(hours[0] - hours[1]) <= max(p.est_cpu_hours for p in PAPER_SETTINGS.values())
    table = budget_table(names())
    assert f"**{total:.2f}**" in table and table.count("\n| `") == len(names())


def test_the_published_budget_table_is_the_settings_table():
    text = (Path(__file__).resolve().parents[1] / "docs" / "results" / "README.md").read_text()
    listed = re.findall(r"^\| `([a-z0-9-]+)` \|", text, flags=re.M)
    assert sorted(listed) == sorted(PAPER_SETTINGS)  # every experiment, each once
    assert budget_table(listed) in text  # regenerate the table after changing a setting


def test_paper_overrides_name_a_missing_setting():
    assert "mnist-ff.epochs=10" in paper_overrides(["mnist-ff"])
    with pytest.raises(KeyError, match="no paper setting"):
        paper_overrides(["not-an-experiment"])
    with pytest.raises(ValueError, match="--quick or --paper"):
        reproduce(["mnist-ff"], quick=True, paper=True)
    assert cli.main(["reproduce", "mnist-ff", "--paper", "--quick"]) == 2


def test_paper_run_writes_provenance_and_keeps_checkpoints_out_of_the_results(tmp_path):
    out, ckpt = tmp_path / "docs" / "results", tmp_path / "checkpoints"
    kw = {"out": out, "device": "cpu", "progress": False, "paper": True, "checkpoints": ckpt,
          "overrides": TINY_FF, "command": "layernorm reproduce mnist-ff --paper"}  # fmt: skip
    md = reproduce(["mnist-ff"], **kw)
    assert md is not None
    exp_dir = out / "mnist-ff"
    prov = json.loads((exp_dir / "provenance.json").read_text())
    assert prov["command"] == "layernorm reproduce mnist-ff --paper"
    assert prov["setting"] == "paper" and prov["threads"] == 1
    assert prov["processor"]["isa"] and prov["processor"]["model"]
    for key in ("git_commit", "torch", "python", "wall_seconds", "load_average_start",
                "load_average_end"):  # fmt: skip
        assert key in prov
    assert json.loads((exp_dir / "meta.json").read_text())["setting"] == "paper"
    assert (exp_dir / "figures" / "mnist_ff.png").stat().st_size > 0  # complete on its own
    # checkpoints and finished-run files live outside the published folder
    assert not [p for p in out.rglob("*") if p.suffix == ".pt" or p.parent.name == "runs"]
    assert list(ckpt.rglob("*.pt")) and list(ckpt.glob("mnist-ff/*/runs/*.json"))
    report = md.read_text()
    assert "**The paper's setting.** 784-1000-1000-10" in report
    assert PAPER_SETTINGS["mnist-ff"].reductions[0] in report
    assert "curves only" in report  # the LN paper's Fig. 6 reference row

    # resuming reads the finished runs back and keeps the first session's provenance
    reproduce(["mnist-ff"], resume=True, **kw)
    again = json.loads((exp_dir / "provenance.json").read_text())
    assert [s["wall_seconds"] for s in again["earlier_sessions"]] == [prov["wall_seconds"]]
    assert "1 earlier session(s)" in md.read_text()
    # `layernorm report DIR` rebuilds it from the saved files
    md.unlink()
    assert cli.main(["report", str(out)]) == 0 and md.exists()


def test_provenance_records_the_command_line():
    line = command_line(["/somewhere/layernorm/__main__.py", "reproduce", "a b", "--paper"])
    assert line == "layernorm reproduce 'a b' --paper"


def test_report_prints_the_published_numbers_and_our_difference():
    # 1% test error on every seed = 99% accuracy, against Xu et al.'s 99.13 for LN
    records = [{"task": "mnist", "model": "layer", "seed": s, "epoch": e, "test_err": err}
               for s in range(3) for e, err in ((1, 0.5), (2, 0.01))]  # fmt: skip
    rows = {r[1]: r for r in reference_rows("adanorm", records)}
    assert rows["LayerNorm"][2] == "99.13"
    assert rows["LayerNorm"][3].startswith("99 ± 0")
    assert rows["LayerNorm"][4] == "-0.13"
    assert rows["AdaNorm"][3] == "—"  # not run: no number of ours
    # every published number belongs to a registered experiment, each with its source
    assert {r.experiment for r in REFERENCES} <= set(names())
    assert all(r.source for r in REFERENCES)
    # the adanorm table reads the same constants
    assert {
        str(r.where["model"]): r.value for r in REFERENCES if r.experiment == "adanorm"
    } == adanorm_study.XU_MNIST_ACC


def test_runs_of_different_experiments_may_share_a_results_folder(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from layernorm.experiments.engine.io import lock_folder\n"
         "with lock_folder(sys.argv[1], shared=True), lock_folder(sys.argv[2]):\n"
         "    print('locked', flush=True)\n    time.sleep(120)",
         str(tmp_path), str(tmp_path / ".locks" / "mnist-ff")],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        reproduce(["invariances"], out=tmp_path, device="cpu", quick=True, progress=False,
                  report=False)  # fmt: skip
        assert (tmp_path / "invariances" / "records.json").exists()
        with pytest.raises(FolderInUseError, match="in use by another run"):  # the same one: no
            reproduce(["mnist-ff"], out=tmp_path, device="cpu", quick=True, progress=False)
    finally:
        holder.kill()
        holder.wait()


def test_published_results_folder_ignores_checkpoints():
    root = Path(__file__).resolve().parents[1]
    paths = ["docs/results/x/ckpt/a.pt", "docs/results/x/runs/a.json",
             "docs/results/.locks/x/.lock", "results/checkpoints/x/a.pt"]  # fmt: skip
    ignored = subprocess.run(["git", "-C", str(root), "check-ignore", *paths],
                             capture_output=True, text=True).stdout.split()  # fmt: skip
    if not ignored and not (root / ".git").exists():
        pytest.skip("not a git checkout")
    assert ignored == paths
    kept = subprocess.run(["git", "-C", str(root), "check-ignore", "docs/results/x/records.json"],
                          capture_output=True, text=True)  # fmt: skip
    assert kept.returncode == 1  # records are not ignored
