"""The experiment framework: registry, overrides, verdict rules, report from saved data, and small
real runs of the feed-forward experiments."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch

import layernorm
from layernorm.experiments import reproduce
from layernorm.experiments.analysis.report import write_report
from layernorm.experiments.analysis.stats import compare_lower
from layernorm.experiments.definitions import geometry, invariances, mnist_ff
from layernorm.experiments.engine import registry
from layernorm.experiments.engine.registry import RunContext, apply_overrides, get, names
from layernorm.experiments.models.cnn import build_cnn
from layernorm.experiments.models.mlp import build_mlp

TINY_FF = [
    "n_train=256", "n_test=400", "hidden=24", "epochs=2", "seeds=2", "batch_sizes=64,8",
]  # fmt: skip


def test_registry_lists_feed_forward_experiments_in_order():
    ns = names()
    for n in ("invariances", "geometry", "mnist-ff", "convnet"):
        assert n in ns
    assert ns.index("invariances") < ns.index("mnist-ff")


def test_unknown_name_lists_valid_names():
    with pytest.raises(KeyError) as e:
        get("mnist-f")
    msg = str(e.value)
    assert "mnist-ff" in msg and "invariances" in msg and "Did you mean" in msg


def test_register_rejects_duplicates():
    exp = get("geometry")
    other = dataclasses.replace(exp, title="another")
    with pytest.raises(ValueError, match="already registered"):
        registry.register(other)
    with pytest.raises(TypeError):
        registry.register("geometry")  # type: ignore[arg-type]


def test_overrides_typed_and_checked():
    cfg = mnist_ff.config(True)
    new = apply_overrides(cfg, {"hidden": "64", "lr": "0.01", "batch_sizes": "32,2"})
    assert new.hidden == 64 and new.lr == 0.01 and new.batch_sizes == (32, 2)
    with pytest.raises(ValueError, match="valid settings"):
        apply_overrides(cfg, {"hiden": "3"})
    with pytest.raises(ValueError, match="expected a value like"):
        apply_overrides(cfg, {"epochs": "two"})


def test_compare_lower_three_outcomes():
    holds = compare_lower("A", [1.0, 1.1, 0.9], "B", [2.0, 2.1, 1.9], quantity="q", margin=0.1)
    assert holds.status == "holds"
    rev = compare_lower("A", [2.0, 2.1, 1.9], "B", [1.0, 1.1, 0.9], quantity="q", margin=0.1)
    assert rev.status == "does not hold"
    same = compare_lower("A", [1.0, 1.001], "B", [1.0005, 1.0015], quantity="q", margin=0.1)
    assert same.status == "does not hold"  # measurably smaller than the margin
    noisy = compare_lower("A", [0.0, 2.0], "B", [1.0, 3.0], quantity="q", margin=0.1)
    assert noisy.status == "inconclusive"
    assert "mean ± sd over 2 seeds" in noisy.statistic


def test_invariances_match_table1():
    cfg = invariances.config(True)
    rec = invariances.run(cfg, RunContext(Path("."), torch.device("cpu")))
    assert [v.status for v in invariances.verdicts(rec, cfg)] == ["holds", "holds"]
    # the verdict comes from the data: a record that breaks an invariance flips it
    broken = [dict(r) for r in rec]
    for r in broken:
        if r["method"] == "layer norm" and r["transform"] == "dataset re-scaling":
            r["rel_change"] = 0.5
    v = invariances.verdicts(broken, cfg)[0]
    assert v.status == "does not hold" and "layer norm / dataset re-scaling" in v.statistic


def test_geometry_claims_hold():
    cfg = dataclasses.replace(geometry.config(True), cases=64, scales=(0.5, 1.0, 2.0))
    rec = geometry.run(cfg, RunContext(Path("."), torch.device("cpu")))
    assert [v.status for v in geometry.verdicts(rec, cfg)] == ["holds"] * 3


def test_models_use_the_library_norms():
    m4 = build_mlp("batch", 16, batch_size=4)
    bns = [m for m in m4 if isinstance(m, layernorm.BatchNorm)]
    assert len(bns) == 2 and all(b.unbiased for b in bns)
    assert not any(m.unbiased for m in build_mlp("batch", 16, 128) if hasattr(m, "unbiased"))
    lns = [m for m in build_mlp("layer", 16, 4) if isinstance(m, layernorm.LayerNorm)]
    assert len(lns) == 2  # hidden layers only: the logits stay un-normalized
    assert isinstance(build_mlp("layer", 16, 4)[-1], torch.nn.Linear)
    assert isinstance(build_mlp("batch", 16, 4, bn_logits=True)[-1], layernorm.BatchNorm)
    assert isinstance(build_mlp("layer", 16, 4, bn_logits=True)[-1], torch.nn.Linear)
    x = torch.rand(3, 784)
    for norm in ("none", "batch", "layer"):
        assert build_cnn(norm, (2, 3))(x).shape == (3, 10)
    with pytest.raises(ValueError, match="norm must be one of"):
        build_mlp("group", 8, 4)


def test_mnist_ff_tiny_end_to_end(tmp_path):
    out = tmp_path / "res"
    md = reproduce(["mnist-ff"], out=out, device="cpu", quick=True, overrides=TINY_FF,
                   progress=False)  # fmt: skip
    assert md == out / "report.md"
    recs = json.loads((out / "mnist-ff" / "records.json").read_text())
    assert len(recs) == 2 * 2 * 3 * 2  # batch sizes × seeds × models × epochs
    assert {r["model"] for r in recs} == {"none", "batch", "layer"}
    assert all(0 <= r["test_err"] <= 1 and r["train_nll"] > 0 for r in recs)
    assert (out / "mnist-ff" / "records.csv").read_text().startswith("model,batch_size,seed,epoch")
    text = md.read_text()
    for cid in ("ff-faster", "ff-robust", "ff-small-batch"):
        assert f"`{cid}`" in text
    assert "exhibits a faster training convergence" in text  # the paper's words
    assert "figures/mnist_ff.png" in text and (out / "figures" / "mnist_ff.png").stat().st_size
    assert "data:image/png;base64," in (out / "report.html").read_text()

    # The report is drawn from the saved records only: without checkpoints or runs it is rebuilt,
    # and doctored records change the verdicts.
    shutil.rmtree(out / "mnist-ff" / "ckpt")
    shutil.rmtree(out / "mnist-ff" / "runs")
    (out / "report.md").unlink()
    for r in recs:
        r["train_nll"] = 5.0 if r["model"] == "layer" else 0.1 * (1 + r["seed"] % 7)
    (out / "mnist-ff" / "records.json").write_text(json.dumps(recs))
    md2, _ = write_report(out)
    assert "ff-faster`: At the larger" in md2.read_text()
    verdicts = mnist_ff.verdicts(recs, mnist_ff.MnistFFConfig(batch_sizes=(64, 8), seeds=2))
    assert verdicts[0].claim_id == "ff-faster" and verdicts[0].status == "does not hold"


def test_mnist_ff_one_batch_size_judges_only_the_larger_batch_claim():
    """Run at one batch size (e.g. batch norm on the logits at batch 128), the claims about the
    smaller batch are inconclusive, not judged at the one batch size there is."""
    cfg = dataclasses.replace(mnist_ff.config(quick=True), batch_sizes=(128,), seeds=3)
    records = [
        {"model": m, "batch_size": 128, "seed": s, "epoch": e, "train_nll": nll + 0.01 * s,
         "test_err": err, "test_nll": 0.1}
        for m, nll, err in (("batch", 0.5, 0.01), ("layer", 0.2, 0.03))
        for s in range(3) for e in (1, 2)
    ]  # fmt: skip
    got = {v.claim_id: v.status for v in mnist_ff.verdicts(records, cfg)}
    assert got == {"ff-faster": "holds", "ff-robust": "inconclusive",
                   "ff-small-batch": "inconclusive"}  # fmt: skip


def test_resume_with_other_settings_is_refused(tmp_path):
    small = ["n_train=64", "n_test=64", "hidden=8", "epochs=1", "seeds=1", "batch_sizes=32"]
    reproduce(["mnist-ff"], out=tmp_path, device="cpu", quick=True, overrides=small,
              progress=False, report=False)  # fmt: skip
    saved = (tmp_path / "mnist-ff" / "records.json").read_text()
    with pytest.raises(ValueError, match=r"other settings .*config\.hidden: 8 there, 9 now"):
        reproduce(["mnist-ff"], out=tmp_path, device="cpu", quick=True, resume=True,
                  overrides=[*small, "hidden=9"], progress=False, report=False)  # fmt: skip
    assert (tmp_path / "mnist-ff" / "records.json").read_text() == saved  # nothing touched
    # asked for explicitly, the changed experiment starts over in a fresh folder; the old run is
    # kept beside it under its settings id
    old_id = json.loads((tmp_path / "mnist-ff" / "config.json").read_text())["settings_id"]
    reproduce(["mnist-ff"], out=tmp_path, device="cpu", quick=True, resume=True,
              restart_changed=True, overrides=[*small, "hidden=9"], progress=False,
              report=False)  # fmt: skip
    assert (tmp_path / f"mnist-ff.{old_id}" / "records.json").read_text() == saved
    new = json.loads((tmp_path / "mnist-ff" / "config.json").read_text())
    assert new["config"]["hidden"] == 9 and new["settings_id"] != old_id


def test_report_without_results_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="layernorm reproduce"):
        write_report(tmp_path)


def test_report_skips_a_damaged_result_and_keeps_the_others(tmp_path):
    reproduce(["invariances", "geometry"], out=tmp_path, device="cpu", quick=True,
              overrides=["cases=32", "geometry.scales=1,2"], progress=False)  # fmt: skip
    (tmp_path / "geometry" / "records.json").write_text('[{"part": "weight growth"}]')
    with pytest.warns(UserWarning, match="skipping"):
        md, html = write_report(tmp_path)
    text = md.read_text()
    assert "`table1`" in text and "geo-shrink" not in text
    assert "<em>Layer Normalization</em>" in html.read_text()


def test_run_seed_and_check_choices():
    ctx = RunContext(out_dir=Path("."), device=torch.device("cpu"), seed=3)
    assert [ctx.run_seed(s) for s in range(3)] == [3000, 3001, 3002]
    registry.check_choices("mnist-ff", "norms", ("none", "layer"), mnist_ff.NORMS)
    with pytest.raises(ValueError, match=r"mnist-ff: norms must be among .*, got 'group'"):
        registry.check_choices("mnist-ff", "norms", ("layer", "group"), mnist_ff.NORMS)


def test_run_files_restore_what_they_saved(tmp_path):
    from layernorm.experiments.engine.checkpoints import RunFiles

    def parts(seed: int):
        torch.manual_seed(seed)
        model = torch.nn.Linear(3, 2)
        opt = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        return model, opt, torch.Generator().manual_seed(seed)

    ctx = RunContext(out_dir=tmp_path, device=torch.device("cpu"), resume=True)
    files = RunFiles.of(ctx, "r")
    assert files.finished() is None and files.restore(*parts(0), "order_rng") == ({}, [])
    model, opt, gen = parts(1)
    torch.randperm(5, generator=gen)
    history = [{"epoch": 1, "loss": 0.5}, {"epoch": 2, "loss": 0.25}]
    files.save(history, {"epoch": 2}, model, opt, gen, "order_rng")
    rng = torch.get_rng_state()
    torch.rand(3)  # moves the global RNG on; restore must bring it back
    model2, opt2, gen2 = parts(2)
    state, saved = files.restore(model2, opt2, gen2, "order_rng")
    assert state["epoch"] == 2 and saved == history
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.equal(gen2.get_state(), gen.get_state())
    assert torch.equal(model.weight, model2.weight) and torch.equal(model.bias, model2.bias)
    keys = ["epoch", "model", "optimizer", "order_rng", "torch_rng", "settings_id", "settings"]
    assert list(torch.load(files.ckpt, weights_only=False)) == keys
    files.finish(history)
    assert files.finished() == history
    assert dataclasses.replace(files, resume=False).finished() is None


def test_paired_comparison_cancels_what_the_seeds_share():
    # seed-to-seed spread of 1.0 on both sides, but B is 0.5 above A on every seed
    a, b = [1.0, 2.0, 3.0], [1.5, 2.5, 3.5]
    kw = {"quantity": "q", "margin": 0.1}
    assert compare_lower("A", a, "B", b, **kw).status == "inconclusive"
    paired = compare_lower("A", a, "B", b, paired=True, **kw)
    assert paired.status == "holds" and "paired by seed" in paired.statistic
    # differences of varying sign stay inconclusive when paired
    assert compare_lower("A", a, "B", [2.5, 1.5, 3.5], paired=True, **kw).status == "inconclusive"
    # unequal seed counts cannot be paired: the unpaired rule applies
    assert compare_lower("A", a, "B", b[:2], paired=True, **kw) == compare_lower(
        "A", a, "B", b[:2], **kw
    )


def test_epoch_lower_compares_the_two_models_summaries():
    from layernorm.experiments.analysis.compare import lower
    from layernorm.experiments.analysis.epochs import auc

    recs = [{"model": m, "batch_size": 8, "seed": s, "epoch": e, "nll": v + 0.1 * e + 0.01 * s}
            for m, v in (("layer", 1.0), ("batch", 2.0))
            for s in range(3) for e in (1, 2)]  # fmt: skip
    kw = {"quantity": "q", "margin": 0.1}
    c = lower(recs, auc, "nll", ("LN", {"model": "layer"}), ("BN", {"model": "batch"}), **kw)
    ln, bn = auc(recs, "nll", model="layer"), auc(recs, "nll", model="batch")
    assert ln == [pytest.approx(1.15 + 0.01 * s) for s in range(3)]  # mean over epochs 1 and 2
    assert c == compare_lower("LN", ln, "BN", bn, paired=True, **kw)  # same seeds: paired
    assert c.status == "holds" and c.statistic.startswith("q: LN 1.16")
