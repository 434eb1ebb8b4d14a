"""The report: ``report.md`` and a self-contained ``report.html``, drawn only from saved records.

:func:`write_report` reads every ``<out>/<experiment>/records.json`` it finds, recomputes the
verdicts and figures from them with the experiment's own functions, and writes both files, so it
can be re-run at any time without training (``layernorm report --out results``).
"""

from __future__ import annotations

import base64
import html
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.io import atomic_write_bytes, read_json
from ..engine.registry import Experiment, Verdict, config_from_json, get, names
from ..papers import PAPER_SETTINGS, Reference, references_for
from .stats import mean_sd

__all__ = ["ExperimentResult", "load_results", "reference_rows", "write_report"]

_MARK = {
    "holds": "✅ holds",
    "does not hold": "❌ does not hold",
    "inconclusive": "❔ inconclusive",
}


@dataclass(frozen=True)
class ExperimentResult:
    exp: Experiment
    config: Any
    meta: dict[str, Any]
    records: list[dict[str, Any]]
    verdicts: list[Verdict]


def load_results(out: Path) -> list[ExperimentResult]:
    """Saved results under ``out`` for every registered experiment that has them, verdicts
    recomputed from the records."""
    results = []
    for name in names():
        d = out / name
        if not (d / "records.json").exists() or not (d / "config.json").exists():
            continue
        exp = get(name)
        saved = read_json(d / "config.json")
        try:
            cfg = config_from_json(exp, bool(saved["quick"]), saved["config"])
            meta = read_json(d / "meta.json") if (d / "meta.json").exists() else {}
            records = read_json(d / "records.json")
            verdicts = exp.verdicts(records, cfg)
        except Exception as e:  # one stale or damaged result must not hide the others
            warnings.warn(f"skipping {d} in the report: {type(e).__name__}: {e}", stacklevel=2)
            continue
        results.append(ExperimentResult(exp, cfg, meta, records, verdicts))
    return results


# A report is a list of blocks rendered twice, to Markdown and to HTML.
Block = tuple[str, Any]


def _md(blocks: Sequence[Block], out: Path) -> str:
    parts = []
    for kind, v in blocks:
        if kind in ("h1", "h2", "h3"):
            parts.append("#" * int(kind[1]) + " " + v)
        elif kind == "p":
            parts.append(v)
        elif kind == "quote":
            parts.append("> " + v)
        elif kind == "md":
            parts.append(v)
        elif kind == "img":
            parts.append(f"![{v[1]}]({v[0].relative_to(out).as_posix()})")
        elif kind == "table":
            head, rows = v
            parts.append("| " + " | ".join(head) + " |\n|" + " --- |" * len(head))
            parts[-1] += "".join("\n| " + " | ".join(r) + " |" for r in rows)
    return "\n\n".join(parts) + "\n"


def _inline(text: str) -> str:
    """The little Markdown the report uses inside text: `code`, **bold**, *emphasis*."""
    t = html.escape(text)
    t = re.sub(r"`([^`]+)`", r"<code>\1</code>", t)
    t = re.sub(r"\*\*([^*]+)\*\*", r"<b>\1</b>", t)
    return re.sub(r"\*([^*\s][^*]*)\*", r"<em>\1</em>", t)


def _md_table_to_html(text: str) -> str:
    out, rows = [], []
    for line in text.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if all(set(c) <= {"-", ":", " "} for c in cells):
                continue
            rows.append(cells)
        else:
            if rows:
                out.append(_html_table(rows[0], rows[1:]))
                rows = []
            if line.strip():
                out.append(f"<p>{_inline(line)}</p>")
    if rows:
        out.append(_html_table(rows[0], rows[1:]))
    return "\n".join(out)


def _html_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    h = "".join(f"<th>{_inline(c)}</th>" for c in head)
    b = "".join("<tr>" + "".join(f"<td>{_inline(c)}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><thead><tr>{h}</tr></thead><tbody>{b}</tbody></table>"


def _html(blocks: Sequence[Block]) -> str:
    parts = []
    for kind, v in blocks:
        if kind in ("h1", "h2", "h3"):
            parts.append(f"<{kind}>{_inline(v)}</{kind}>")
        elif kind == "p":
            parts.append(f"<p>{_inline(v)}</p>")
        elif kind == "quote":
            parts.append(f"<blockquote>{_inline(v)}</blockquote>")
        elif kind == "md":
            parts.append(_md_table_to_html(v))
        elif kind == "img":
            data = base64.b64encode(v[0].read_bytes()).decode()
            parts.append(f'<img alt="{html.escape(v[1])}" src="data:image/png;base64,{data}">')
        elif kind == "table":
            parts.append(_html_table(*v))
    style = (
        "body{font-family:sans-serif;max-width:60em;margin:2em auto;line-height:1.45}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #bbb;"
        "padding:.25em .5em;text-align:left;vertical-align:top}img{max-width:100%}"
        "blockquote{border-left:4px solid #ccc;margin-left:0;padding-left:1em;color:#333}"
        "code{background:#f3f3f3}"
    )
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>layernorm: reproducing '
        f"the paper</title><style>{style}</style></head><body>\n"
        + "\n".join(parts)
        + "\n</body></html>\n"
    )


_HOW_TO_READ = (
    "**How to read it.** Each experiment tests claims of the papers; for each claim the report "
    "quotes the paper, states the test we run (often on a substitute task, since the paper's data "
    "is not available here), gives our numbers and the rule that turned them into a verdict. "
    "In the training experiments the numbers are per-seed values (mean ± standard deviation over "
    "seeds), and a claim that one model is lower **holds** when the difference of the means is "
    "larger than both 2 standard errors and a minimum size that matters; it **does not hold** "
    "when the difference is clearly the other way, or measurably smaller than that minimum; it "
    "is **inconclusive** when the seed-to-seed noise is too large to tell. Models trained with "
    "the same seeds see the same data in the same order, so they are compared paired by seed "
    "(the standard error is that of the per-seed differences). A claim that a change "
    'costs nothing ("not worse") holds when even the pessimistic end, the difference minus 2 '
    "standard errors, stays within the margin. A verdict is about this run, at this size: the "
    "quick setting trains small models for minutes, so a claim that does not hold there is not "
    "refuted for the paper's models, only not shown at that scale; the paper setting states "
    "next to each experiment what it reduces, and a claim that does not hold there does not "
    "hold at that scale."
)


def _tally(results: Sequence[ExperimentResult]) -> str:
    counts = {s: 0 for s in _MARK}
    for res in results:
        for v in res.verdicts:
            counts[v.status] += 1
    settings = {_setting(r.meta) for r in results}
    return (f"{sum(counts.values())} claims in {len(results)} experiment(s), "
            f"{' and '.join(sorted(settings))} setting: "
            + ", ".join(f"{n} {_MARK[s]}" for s, n in counts.items()) + ".")  # fmt: skip


def _setting(meta: dict[str, Any]) -> str:
    """``quick``, ``full`` or ``paper`` (metadata written before the label existed: from
    ``quick``)."""
    return str(meta.get("setting") or ("quick" if meta.get("quick") else "full"))


def _final_per_seed(records: Sequence[dict[str, Any]], ref: Reference) -> list[float]:
    """Per seed, ``ref.metric`` at the last epoch or evaluation of the runs ``ref.where`` selects,
    in the published quantity's units (NaN for a run that diverged)."""
    last: dict[Any, dict[str, Any]] = {}
    for r in records:
        if ref.metric not in r or any(r.get(k) != v for k, v in ref.where.items()):
            continue
        when = (int(r.get("epoch", 0)), int(r.get("step", 0)))
        s = r.get("seed")
        if s not in last or when >= last[s]["_when"]:
            last[s] = {**r, "_when": when}
    out = []
    for s in sorted(last, key=str):
        v = math.nan if last[s].get("diverged") else float(last[s][ref.metric])
        out.append(100.0 * (1.0 - v) if ref.transform == "acc%" else v)
    return out


def reference_rows(name: str, records: Sequence[dict[str, Any]]) -> list[list[str]]:
    """One row per published number of :data:`~layernorm.experiments.papers.REFERENCES` for
    experiment ``name``: the paper's value, ours (mean ± sd over seeds) and ours − theirs."""
    rows = []
    for ref in references_for(name):
        theirs = "curves only" if ref.value is None else f"{ref.value:.4g}"
        vals = _final_per_seed(records, ref) if ref.metric else []
        if not vals:
            ours, diff = "—", "—"
        elif not all(math.isfinite(v) for v in vals):
            ours, diff = "diverged", "—"
        else:
            mu, sd = mean_sd(vals)
            ours = f"{mu:.4g} ± {sd:.2g} ({len(vals)} seeds)"
            diff = "—" if ref.value is None else f"{mu - ref.value:+.3g}"
            if ref.value is not None and not ref.comparable:
                diff += " (other data or model: context, not a test)"
        rows.append([ref.quantity, ref.label, theirs, ours, diff, ref.source])
    return rows


def _paper_blocks(name: str, meta: dict[str, Any]) -> list[Block]:
    """The paper's setting and what ours reduces, for a run of the paper setting."""
    ps = PAPER_SETTINGS.get(name)
    if ps is None or _setting(meta) != "paper":
        return []
    cut = "; ".join(ps.reductions) if ps.reductions else "none: the paper's own setting"
    return [("p", f"**The paper's setting.** {ps.paper}."), ("p", f"**Ours reduces.** {cut}.")]


def _provenance_text(prov: dict[str, Any]) -> str:
    cpu = prov.get("processor", {})
    return (f"Run by `{prov.get('command')}` at commit `{prov.get('git_commit')}` on "
            f"{cpu.get('model', '?')} ({cpu.get('isa', '?')}, {cpu.get('cpus', '?')} CPUs), "
            f"{prov.get('threads')} thread(s), python {prov.get('python')}, torch "
            f"{prov.get('torch')}; wall time {prov.get('wall_seconds')} s; load average "
            f"(1, 5, 15 min) {prov.get('load_average_start')} at the start, "
            f"{prov.get('load_average_end')} at the end (other work on the machine)"
            + _sessions_text(prov) + ".")  # fmt: skip


def _sessions_text(prov: dict[str, Any]) -> str:
    earlier = prov.get("earlier_sessions") or []
    if not earlier:
        return ""
    total = sum(float(p.get("wall_seconds") or 0) for p in [*earlier, prov])
    return (f"; resumed: {len(earlier)} earlier session(s), {total:.0f} s of wall time in all "
            f"(see provenance.json)")  # fmt: skip


def verdict_rows(results: Sequence[ExperimentResult]) -> list[list[str]]:
    rows = []
    for res in results:
        claims = {c.id: c for c in res.exp.claims}
        for v in res.verdicts:
            rows.append(
                [
                    f"`{res.exp.name}`",
                    f"`{v.claim_id}`: {claims[v.claim_id].test}",
                    _MARK[v.status],
                    v.statistic,
                ]
            )
    return rows


def write_report(out: Path) -> tuple[Path, Path]:
    """Write ``out/report.md`` and ``out/report.html`` from the saved records under ``out``."""
    results = load_results(out)
    if not results:
        raise FileNotFoundError(
            f"no saved results under {out}: run `layernorm reproduce` first (or pass --out)"
        )
    fig_dir = out / "figures"
    blocks: list[Block] = [
        (
            "h1",
            "Reproducing *Layer Normalization* (Ba, Kiros & Hinton 2016) and *Understanding "
            "and Improving Layer Normalization* (Xu et al. 2019)",
        ),
        (
            "p",
            "Every number below is read from the saved records in this directory "
            "(`<experiment>/records.json`, also as CSV); verdicts are computed from them with "
            "the thresholds stated next to each one. Regenerate with `layernorm report --out "
            f"{out}`.",
        ),
        ("p", _HOW_TO_READ),
        ("h2", "Verdicts"),
        ("p", _tally(results)),
        ("table", (["experiment", "claim", "verdict", "statistic"], verdict_rows(results))),
    ]
    for res in results:
        exp, meta = res.exp, res.meta
        blocks.append(("h2", f"`{exp.name}`: {exp.title}"))
        setting = _setting(meta)
        blocks.append(
            (
                "p",
                f"{exp.section}. Setting: **{setting}**, seed {meta.get('seed')}, "
                f"device {meta.get('device')} ({meta.get('machine', '?')}), "
                f"{meta.get('world_size', 1)} process(es), torch {meta.get('torch')}, "
                f"{meta.get('seconds', '?')} s, {meta.get('date', '?')}.",
            )
        )
        prov_file = out / exp.name / "provenance.json"
        if prov_file.exists():
            blocks.append(("p", _provenance_text(read_json(prov_file))))
        blocks += _paper_blocks(exp.name, meta)
        cfg_txt = ", ".join(f"{k}={v}" for k, v in vars(res.config).items())
        blocks.append(("p", f"Configuration: `{cfg_txt}`."))
        refs = reference_rows(exp.name, res.records)
        if refs:
            blocks.append(
                (
                    "p",
                    "**The papers' numbers beside ours** (ours: the last epoch or "
                    "evaluation, mean ± sd over seeds; difference: ours − theirs).",
                )
            )
            blocks.append(("table", (["quantity", "model", "paper", "ours", "difference",
                                      "source"], refs)))  # fmt: skip
        if exp.tables is not None:
            blocks.append(("md", exp.tables(res.records, res.config)))
        for png in exp.plot(res.records, res.config, fig_dir):
            blocks.append(("img", (png, f"{exp.name} figure")))
        verdicts = {v.claim_id: v for v in res.verdicts}
        for claim in exp.claims:
            v = verdicts.get(claim.id)
            blocks.append(("h3", f"Claim `{claim.id}`: {_MARK[v.status] if v else 'no verdict'}"))
            blocks.append(("quote", claim.quote))
            blocks.append(("p", f"**Test.** {claim.test}"))
            if v:
                blocks.append(("p", f"**Our numbers.** {v.statistic}"))
                blocks.append(("p", f"**Rule.** {v.rule}"))
    md_path, html_path = out / "report.md", out / "report.html"
    atomic_write_bytes(md_path, _md(blocks, out).encode())
    atomic_write_bytes(html_path, _html(blocks).encode())
    return md_path, html_path
