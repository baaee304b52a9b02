"""The recall suite's report pieces on synthetic run folders: the recall table with seed-paired
differences against the uniform window, and the recall-vs-distance figure."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from aah.report import load_runs, write_report
from aah.report.recall import recall_table
from aah.report.runs import display_name
from aah.report.stats import t_quantile_975

T = 1024


def _eval(loss: float, text: float, far: float, coverage: float) -> dict:
    bins = [{"lo": T * i // 8, "hi": T * (i + 1) // 8, "accuracy": 1.0 if i < 4 else far, "queries": 10}
            for i in range(8)]
    return {
        "val_loss": loss, "causal_coverage": coverage, "seq_len": T, "text_loss": text,
        "recall_accuracy": (1.0 + far) / 2, "recall_queries": 80,
        "recall_accuracy_by_bucket": {"lt_quarter": 1.0, "quarter_half": 1.0, "gt_half": far},
        "recall_queries_by_bucket": {"lt_quarter": 20, "quarter_half": 20, "gt_half": 40},
        "recall_by_distance": bins,
    }


def _run(root: Path, regime: str, seed: int, budget: float | None, ev: dict) -> None:
    run = root / f"{regime}_{budget}" / f"seed{seed}"
    run.mkdir(parents=True)
    aah = {"regime": regime} | ({} if budget is None else {"budget": budget})
    (run / "config.yaml").write_text(yaml.safe_dump({"aah": aah, "train": {"seed": seed}}))
    (run / "meta.json").write_text(json.dumps({"regime": regime, "seed": seed, "status": "complete"}))
    row = {"kind": "train", "step": 10, "loss": 3.0, "tokens_per_s": 1000.0, "causal_coverage": ev["causal_coverage"],
           "windows": [[256] * 8] * 4}
    (run / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    (run / "eval.json").write_text(json.dumps(ev))


FAR = {  # recall beyond T/2 per seed
    ("full_attention", None): [0.9, 0.85, 0.95],
    ("uniform_window", 0.45): [0.1, 0.2, 0.15],
    ("loss_aware", 0.45): [0.8, 0.7, 0.9],
}
COV = {("full_attention", None): 1.0, ("uniform_window", 0.45): 0.437, ("loss_aware", 0.45): 0.449}


@pytest.fixture
def recall_runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for (regime, budget), fars in FAR.items():
        for seed, far in enumerate(fars):
            _run(root, regime, seed, budget, _eval(2.0 + 0.01 * seed, 1.9 + 0.01 * seed, far, COV[(regime, budget)]))
    return root


def test_recall_table_pairs_by_seed_against_the_uniform_window(recall_runs):
    runs, _ = load_runs([recall_runs])
    table = recall_table(runs)
    assert table is not None
    rows = {r[0]: r for r in table.rows}
    la = rows["Loss aware (b = 0.45)"]
    assert la[3] == "Uniform window (b = 0.45)"
    diffs = [100 * (a - b) for a, b in zip(FAR[("loss_aware", 0.45)], FAR[("uniform_window", 0.45)])]
    m = sum(diffs) / 3
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / 2)
    half = t_quantile_975(2) * sd / math.sqrt(3)
    far_cell = la[table.columns.index("Recall ≥ T/2 %")]
    assert far_cell.startswith(f"{100 * sum(FAR[('loss_aware', 0.45)]) / 3:.1f} (+{m:.1f} [")
    assert f"{m - half:+.1f}, {m + half:+.1f}]" in far_cell
    assert rows["Uniform window (b = 0.45)"][3] == "reference"
    # equal text losses per seed: a zero difference without an interval of any width
    assert "+0.0000 [+0.0000, +0.0000]" in la[table.columns.index("Text loss")]


def test_no_recall_table_without_recall_metrics(tmp_path):
    root = tmp_path / "runs"
    ev = {"val_loss": 2.0, "causal_coverage": 1.0}
    _run(root, "full_attention", 0, None, ev)
    runs, _ = load_runs([root])
    assert recall_table(runs) is None


def test_report_has_recall_section_csv_and_figure(recall_runs, tmp_path):
    out = tmp_path / "report"
    path = write_report([recall_runs], out)
    text = path.read_text()
    assert "## Recall of far context (recall corpus)" in text
    assert (out / "recall_vs_distance.png").read_bytes().startswith(b"\x89PNG")
    with (out / "recall.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    la = next(r for r in rows if r["policy"] == "loss_aware@0.45")
    assert float(la["recall_gt_half_mean"]) == pytest.approx(80.0)
    assert float(la["recall_gt_half_delta"]) == pytest.approx(80.0 - 15.0)


def test_a_suite_variant_is_its_own_group_and_finds_the_uniform_window_at_its_budget(tmp_path):
    """``loss_aware_late`` (a variant of ``loss_aware``) and ``uniform_tight`` (of ``uniform_window``)
    share regime, budget and seeds with other rows; the suite row in meta.json keeps them apart."""
    root = tmp_path / "runs"
    rows = {  # suite row: (regime, budget, recall beyond T/2 of seed 0)
        "uniform_window": ("uniform_window", 0.45, 0.1), "loss_aware": ("loss_aware", 0.45, 0.0),
        "loss_aware_late": ("loss_aware", 0.45, 1.0), "uniform_tight": ("uniform_window", 0.3, 0.0),
        "loss_aware_tight": ("loss_aware", 0.3, 0.5),
    }
    for row, (regime, budget, far) in rows.items():
        _run(root / row, regime, 0, budget, _eval(2.0, 1.9, far, budget))
        meta = root / row / f"{regime}_{budget}" / "seed0" / "meta.json"
        meta.write_text(json.dumps(json.loads(meta.read_text()) | {"suite_row": row}))
    runs, notes = load_runs([root])
    assert len(runs) == 5 and not notes  # nothing taken for a repeat of another row
    table = recall_table(runs)
    by_name = {r[0]: r for r in table.rows}
    assert set(by_name) == {"Uniform window (b = 0.45)", "Loss aware (b = 0.45)", "Loss aware late (b = 0.45)",
                            "Uniform tight (b = 0.3)", "Loss aware tight (b = 0.3)"}
    far = table.columns.index("Recall ≥ T/2 %")
    assert by_name["Loss aware late (b = 0.45)"][far].startswith("100.0 (+90.0")
    assert by_name["Loss aware (b = 0.45)"][far].startswith("0.0 (-10.0")
    assert by_name["Loss aware tight (b = 0.3)"][3] == "Uniform tight (b = 0.3)"
    assert by_name["Loss aware tight (b = 0.3)"][far].startswith("50.0 (+50.0")
    # a variant of a regime without a budget reads by its row too
    assert display_name("full_adaptive#full_adaptive_long") == "Full adaptive long"
    assert display_name("full_adaptive") == "Full adaptive"
