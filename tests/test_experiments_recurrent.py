"""The recurrent-network and AdaNorm experiments: tiny end-to-end runs, verdicts computed from the
records, and exact resumption of the update-counted training loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from layernorm.experiments import get, reproduce
from layernorm.experiments.analysis import curves, stats
from layernorm.experiments.engine import steps
from layernorm.experiments.engine.io import read_json
from layernorm.experiments.engine.registry import STATUSES, RunContext, config_from_json

TINY = {
    "char-lm": ["seq_len=8", "batch_size=4", "hidden=8", "embed=4", "steps=4", "eval_every=2",
                "n_valid=4", "seeds=1"],
    "seq-mnist": ["hidden=8", "batch_size=4", "steps=4", "eval_every=2", "n_train=64",
                  "n_test=32", "seeds=1"],
    "spoken-digits": ["hidden=4", "steps=3", "eval_every=3", "seeds=1"],
    "gain-init": ["seq_len=8", "batch_size=4", "hidden=8", "embed=4", "steps=4", "eval_every=2",
                  "n_valid=4", "seeds=1"],
    "longer-than-train": ["train_len=4", "eval_factor=4", "batch_size=4", "hidden=8", "embed=4",
                          "steps=4", "eval_every=2", "n_valid=4", "seeds=1"],
    "adanorm": ["n_train=96", "n_test=64", "epochs=1", "batch_size=32", "channels=2,4", "fc=8",
                "d_model=8", "nhead=2", "d_ff=16", "layers=1", "seq_len=8", "lm_batch=4",
                "lm_steps=4", "lm_eval_every=2", "n_valid=4", "seeds=1"],
}  # fmt: skip


@pytest.mark.parametrize("name", list(TINY))
def test_tiny_run_records_verdicts_report(name, tmp_path):
    exp = get(name)
    md = reproduce([name], out=tmp_path, quick=True, overrides=TINY[name], progress=False)
    assert md is not None and name in md.read_text()
    records = read_json(tmp_path / name / "records.json")
    assert records and all("model" in r and "seed" in r for r in records)
    for r in records:
        if "step" in r:  # update-counted runs carry both clocks
            assert r["seconds"] >= 0 and isinstance(r["diverged"], bool)
    saved = read_json(tmp_path / name / "config.json")
    cfg = config_from_json(exp, True, saved["config"])
    verdicts = exp.verdicts(records, cfg)
    assert [v.claim_id for v in verdicts] == [c.id for c in exp.claims]
    for v in verdicts:
        assert v.status in STATUSES and v.statistic and v.rule
    pngs = exp.plot(records, cfg, tmp_path / "figs")
    assert pngs and all(p.exists() and p.stat().st_size > 0 for p in pngs)
    assert exp.tables is not None and "|" in exp.tables(records, cfg)


def _lm_records(ln_bpc: float, base_bpc: float, seeds: int = 3) -> list[dict]:
    """Synthetic char-lm records: LN and baseline curves that end at the given BPC."""
    out = []
    for s in range(seeds):
        for model, end in (("layer", ln_bpc), ("none", base_bpc), ("batch", 4.0)):
            for k, step in enumerate((10, 20)):
                bpc = end + (0.5 if k == 0 else 0.0) + 0.001 * s
                out.append({"model": model, "seed": s, "step": step, "seconds": 1.0 + k,
                            "diverged": False, "valid_bpc": bpc})  # fmt: skip
    return out


def test_char_lm_verdicts_follow_the_records():
    exp = get("char-lm")
    cfg = exp.config(True)
    good = {v.claim_id: v.status for v in exp.verdicts(_lm_records(2.0, 2.5), cfg)}
    bad = {v.claim_id: v.status for v in exp.verdicts(_lm_records(2.5, 2.0), cfg)}
    same = {v.claim_id: v.status for v in exp.verdicts(_lm_records(2.0, 2.0), cfg)}
    assert good["lm-lower"] == good["lm-faster"] == good["lm-per-second"] == "holds"
    assert bad["lm-lower"] == bad["lm-faster"] == "does not hold"
    assert same["lm-lower"] == "does not hold"  # measurably no effect
    assert good["lm-vs-bn"] == "holds"


def test_compare_not_worse_three_outcomes():
    kw = {"quantity": "x", "margin": 0.1}
    not_worse = stats.compare_not_worse
    assert not_worse("A", [1.0, 1.02], "B", [1.0, 1.01], **kw).status == "holds"
    assert not_worse("A", [2.0, 2.01], "B", [1.0, 1.01], **kw).status == "does not hold"
    assert not_worse("A", [1.0, 1.6], "B", [1.0, 1.01], **kw).status == "inconclusive"
    nan = not_worse("A", [math.nan], "B", [1.0], **kw)
    assert nan.status == "inconclusive"


def test_at_time_and_final_use_each_seed():
    recs = [{"model": "m", "seed": s, "step": k, "seconds": float(k), "diverged": d, "v": 10.0 - k}
            for s, d in ((0, False), (1, True)) for k in (1, 2, 3)]  # fmt: skip
    assert curves.at_time(recs, "v", 2.5, model="m") == [7.5, 7.5]  # between the evaluations
    assert curves.at_time(recs, "v", 0.5, model="m") == [9.0, 9.0]  # before the first one
    assert curves.common_time(recs, [{"model": "m"}]) == 3.0
    fin = curves.final(recs, "v", model="m")
    assert fin[0] == 7.0 and math.isnan(fin[1])  # a diverged run never counts as finished


class _Crash(RuntimeError):
    pass


def _tiny_run(out, resume: bool):
    gen_data = torch.arange(200) % 7

    def build() -> nn.Module:
        return nn.Sequential(nn.Embedding(7, 4), nn.LSTM(4, 6, batch_first=True))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = build()
            self.head = nn.Linear(6, 7)

        def forward(self, ids):
            return self.head(self.body(ids)[0])

    def sample(g):
        start = torch.randint(0, 190, (3,), generator=g)
        return gen_data[start[:, None] + torch.arange(9)]

    def loss(m, b):
        logits = m(b[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, 7), b[:, 1:].reshape(-1))

    def evaluate(m):
        return {"valid": float(loss(m, gen_data[:45].view(5, 9)))}

    ctx = RunContext(out, torch.device("cpu"), resume=resume, progress=False)
    return steps.train_steps("r", Model, sample, loss, evaluate, steps.StepSpec(6, 2, 1e-2, 3), ctx,
                          {"model": "lstm", "seed": 3})  # fmt: skip


def test_resume_after_crash_matches_uninterrupted_run(tmp_path, monkeypatch):
    whole = _tiny_run(tmp_path / "a", resume=False)
    calls = {"n": 0}

    def crash_after_first_checkpoint() -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise _Crash

    monkeypatch.setattr(steps, "checkpoint_written", crash_after_first_checkpoint)
    with pytest.raises(_Crash):
        _tiny_run(tmp_path / "b", resume=False)
    assert (tmp_path / "b" / "ckpt" / "r.pt").exists()
    torch.manual_seed(12345)  # a crash loses the process's RNG state; the checkpoint restores it
    resumed = _tiny_run(tmp_path / "b", resume=True)
    assert calls["n"] == 3  # resumed at update 2: two more checkpoints, not three

    def strip(rs):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in rs]

    assert [r["step"] for r in resumed] == [2, 4, 6]
    assert strip(resumed) == strip(whole)  # bitwise the same numbers
    # a finished run is read back, not retrained
    assert strip(_tiny_run(tmp_path / "b", resume=True)) == strip(whole)


def test_char_lm_resume_through_the_runner(tmp_path, monkeypatch):
    """Crash inside the second model's run, then ``--resume``: same records as a clean run."""
    sets = TINY["char-lm"]
    reproduce(["char-lm"], out=tmp_path / "a", quick=True, overrides=sets, progress=False,
              report=False)  # fmt: skip
    calls = {"n": 0}

    def crash_on_third_checkpoint() -> None:
        calls["n"] += 1
        if calls["n"] == 3:  # the first model wrote 2 checkpoints; this is the second's first
            raise _Crash

    monkeypatch.setattr(steps, "checkpoint_written", crash_on_third_checkpoint)
    with pytest.raises(_Crash):
        reproduce(["char-lm"], out=tmp_path / "b", quick=True, overrides=sets, progress=False,
                  report=False)  # fmt: skip
    reproduce(["char-lm"], out=tmp_path / "b", quick=True, overrides=sets, progress=False,
              report=False, resume=True)  # fmt: skip

    def strip(path):
        return [{k: v for k, v in r.items() if k != "seconds"} for r in read_json(path)]

    assert calls["n"] == 3 + 1 + 2  # resumed: one more for the second model, two for the third
    a = strip(tmp_path / "a" / "char-lm" / "records.json")
    assert a == strip(tmp_path / "b" / "char-lm" / "records.json")
    assert {r["model"] for r in a} == {"none", "layer", "batch"}


@pytest.mark.parametrize("cls", ["LayerNormLSTM", "LayerNormGRU", "LayerNormRNN"])
def test_fused_backward_never_reads_unwritten_buffers(cls, monkeypatch):
    """The sequence experiments train on the fused path: with every fresh buffer poisoned with
    NaN, its gradients must still be finite and match the reference loop (regression: the C
    step backward once computed ``0 · dx`` on an uninitialized ``dx``)."""
    from torch.nn.utils.rnn import pack_sequence

    import layernorm.recurrent as rec

    real_new_empty, real_empty_like = torch.Tensor.new_empty, torch.empty_like

    def poison(t: torch.Tensor) -> torch.Tensor:
        return t.fill_(math.nan) if t.is_floating_point() else t

    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *a, **k: poison(real_new_empty(self, *a, **k)))  # fmt: skip
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: poison(real_empty_like(*a, **k)))
    torch.manual_seed(0)
    fused = getattr(rec, cls)(5, 6, impl="fused")
    loop = getattr(rec, cls)(5, 6, impl="loop")
    loop.load_state_dict(fused.state_dict())
    x = pack_sequence([torch.randn(n, 5) for n in (7, 3, 6, 1)], enforce_sorted=False)
    for m in (fused, loop):
        out, state = m(x)
        h = state[0] if isinstance(state, tuple) else state
        (out.data.square().sum() + h.sum()).backward()
    for (name, p), q in zip(fused.named_parameters(), loop.parameters(), strict=True):
        assert torch.isfinite(p.grad).all(), name
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-5, msg=name)
