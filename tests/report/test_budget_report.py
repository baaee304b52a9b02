"""The report's window-policy pieces on synthetic run folders: coverage-vs-loss points and
figure, per-layer lost-mass curves, and the equal-coverage table against the uniform window."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
import yaml

from aah.report import load_runs, write_report
from aah.report.figures import coverage_points, layer_curve
from aah.report.runs import display_name, group_by_regime
from aah.report.stats import t_quantile_975
from aah.report.tables import equal_coverage_table

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def make_run(root: Path, regime: str, seed: int, loss: float, coverage: float, *,
             budget: float | None = None, tokens_per_s: float = 1000.0, lost: tuple = (0.1, 0.2)) -> Path:
    name = regime if budget is None else f"{regime}_{budget}"
    run = root / name / f"seed{seed}"
    run.mkdir(parents=True)
    aah = {"regime": regime} | ({} if budget is None else {"budget": budget})
    (run / "config.yaml").write_text(yaml.safe_dump({"aah": aah, "train": {"seed": seed}}))
    (run / "meta.json").write_text(json.dumps({"regime": regime, "seed": seed, "status": "complete"}))
    lines = []
    for step in (10, 20, 30):
        row = {"kind": "train", "step": step, "loss": 3.0, "tokens_per_s": tokens_per_s,
               "causal_coverage": coverage}
        if regime != "full_attention":
            row["lost_mass_chosen_per_layer"] = [lost[0] * step / 30, lost[1] * step / 30]
        lines.append(json.dumps(row))
    lines.append(json.dumps({"kind": "eval", "step": 30, "val_loss": loss + 1.0}))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (run / "eval.json").write_text(json.dumps({"val_loss": loss, "causal_coverage": coverage}))
    return run


@pytest.fixture
def policy_runs(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    losses = {
        ("full_attention", None): [2.00, 2.02, 2.01],
        ("full_adaptive", None): [1.98, 1.99, 1.985],
        ("uniform_window", 0.45): [1.97, 1.99, 1.98],
        ("budgeted", 0.45): [1.95, 1.96, 1.955],
        ("budgeted", 0.3): [1.99, 2.00, 2.005],
        ("uniform_window", 0.3): [2.00, 2.01, 2.02],
    }
    covs = {("full_attention", None): 1.0, ("full_adaptive", None): 0.454, ("uniform_window", 0.45): 0.437,
            ("budgeted", 0.45): 0.449, ("budgeted", 0.3): 0.298, ("uniform_window", 0.3): 0.234}
    for (regime, budget), values in losses.items():
        for seed, loss in enumerate(values):
            make_run(root, regime, seed, loss, covs[(regime, budget)], budget=budget,
                     tokens_per_s=1000.0 + 100 * seed, lost=(0.1, 0.3) if regime == "budgeted" else (0.2, 0.4))
    return root


def test_two_budgets_of_one_regime_stay_apart(policy_runs):
    runs, notes = load_runs([policy_runs])
    assert not [n for n in notes if "repeats" in n]
    groups = group_by_regime(runs)
    assert {"budgeted@0.45", "budgeted@0.3", "uniform_window@0.45", "uniform_window@0.3"} <= set(groups)
    assert all(len(g) == 3 for g in groups.values())
    assert display_name("budgeted@0.3") == "Budgeted (b = 0.3)"


def test_coverage_points_mean_and_95_ci(policy_runs):
    runs, _ = load_runs([policy_runs])
    points = {p["group"]: p for p in coverage_points(group_by_regime(runs))}
    p = points["budgeted@0.45"]
    values = [1.95, 1.96, 1.955]
    m = sum(values) / 3
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / 2)
    assert p["val_loss"] == pytest.approx(m)
    assert p["ci_half_width"] == pytest.approx(t_quantile_975(2) * sd / math.sqrt(3))
    assert p["coverage"] == pytest.approx(0.449)
    assert p["tokens_per_s"] == pytest.approx(1100.0)  # mean over seeds 1000, 1100, 1200
    assert points["full_attention"]["coverage"] == 1.0


def test_equal_coverage_table_pairs_with_the_uniform_window(policy_runs):
    runs, _ = load_runs([policy_runs])
    table = equal_coverage_table(runs)
    rows = {r[0]: r for r in table.csv_rows}
    cols = table.csv_columns
    row = rows["budgeted@0.45"]
    assert row[cols.index("reference")] == "uniform_window@0.45"
    diffs = [a - b for a, b in zip([1.95, 1.96, 1.955], [1.97, 1.99, 1.98])]
    m = sum(diffs) / 3
    sd = math.sqrt(sum((d - m) ** 2 for d in diffs) / 2)
    half = t_quantile_975(2) * sd / math.sqrt(3)
    assert row[cols.index("delta_mean")] == pytest.approx(m)
    assert row[cols.index("delta_ci_low")] == pytest.approx(m - half)
    assert row[cols.index("delta_significant")] == int(m + half < 0)
    assert rows["budgeted@0.3"][cols.index("reference")] == "uniform_window@0.3"
    # Regimes without a budget are compared with the uniform window closest in coverage.
    assert rows["full_adaptive"][cols.index("reference")] == "uniform_window@0.45"
    assert rows["full_attention"][cols.index("reference")] == "uniform_window@0.45"
    assert rows["uniform_window@0.45"][cols.index("delta_mean")] is None
    assert equal_coverage_table([r for r in runs if r.regime != "uniform_window"]) is None


def test_layer_curves_average_seeds(policy_runs):
    runs, _ = load_runs([policy_runs])
    group = group_by_regime(runs)["budgeted@0.45"]
    steps, means = layer_curve(group, "lost_mass_chosen_per_layer", 1)
    assert steps.tolist() == [10.0, 20.0, 30.0]
    assert means.tolist() == pytest.approx([0.1, 0.2, 0.3])


def test_report_writes_policy_figure_lost_mass_and_table(policy_runs, tmp_path):
    out = tmp_path / "report"
    path = write_report([policy_runs], out)
    text = path.read_text()
    assert "## Window policies at equal coverage" in text
    for name in ("coverage_vs_loss.png", "lost_mass.png"):
        assert (out / name).read_bytes().startswith(PNG_MAGIC), name
        assert name in text
    with open(out / "policies.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert {r["policy"] for r in rows} >= {"budgeted@0.45", "full_adaptive", "uniform_window@0.3"}
