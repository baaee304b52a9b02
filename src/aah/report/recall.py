"""The recall suite's table and figure (runs evaluated on a recall corpus, :mod:`aah.evaluate.recall`).

* :func:`recall_table`: per policy the causal coverage, validation loss, text-only
  loss and recall accuracy overall and per distance bucket, each with its
  seed-paired difference to the uniform window at the same budget (else the
  closest causal coverage) and a 95% Student-t interval. Recall accuracies are in
  percentage points. Built only when some run's ``eval.json`` holds recall metrics.
* :func:`plot_recall_vs_distance`: recall accuracy against the definition-to-query
  distance (eighths of the block), one line per policy, mean over seeds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure

from .figures import FigureResult, save_png
from .runs import Run, display_name, group_by_regime, split_policy
from .stats import mean, paired_difference
from .tables import (
    NOT_LOGGED,
    SIGNIFICANT,
    UNIFORM,
    Table,
    by_seed,
    format_difference,
    logged_values,
    uniform_reference,
)

__all__ = ["BUCKET_LABELS", "has_recall", "plot_recall_vs_distance", "recall_table", "recall_value"]

#: eval.json bucket keys and their column labels.
BUCKET_LABELS = {"lt_quarter": "< T/4", "quarter_half": "T/4–T/2", "gt_half": "≥ T/2"}


def recall_value(run: Run, key: str) -> float | None:
    """A recall metric of ``run``'s ``eval.json``: ``text_loss``, ``recall_accuracy`` or a bucket key
    of ``recall_accuracy_by_bucket``; accuracies in percent."""
    data = run.eval_json or {}
    if key in BUCKET_LABELS:
        value = (data.get("recall_accuracy_by_bucket") or {}).get(key)
    else:
        value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return 100.0 * float(value) if key != "text_loss" else float(value)


def has_recall(runs: Sequence[Run]) -> bool:
    return any(recall_value(r, "recall_accuracy") is not None for r in runs)


def _metrics() -> list[tuple[str, str, Callable[[Run], float | None], int]]:
    out = [
        ("val_loss", "Val loss", lambda r: r.policy_val_loss(), 4),
        ("text_loss", "Text loss", lambda r: recall_value(r, "text_loss"), 4),
        ("recall", "Recall %", lambda r: recall_value(r, "recall_accuracy"), 1),
    ]
    for key, label in BUCKET_LABELS.items():
        out.append((f"recall_{key}", f"Recall {label} %", lambda r, k=key: recall_value(r, k), 1))
    return out


def _cell(value: float | None, diff, digits: int, is_reference: bool) -> str:
    if value is None:
        return NOT_LOGGED
    text = f"{value:.{digits}f}"
    if is_reference:
        return text
    return f"{text} ({format_difference(diff, digits)})"


def recall_table(runs: Sequence[Run]) -> Table | None:
    """Loss, text-only loss and recall accuracy per policy against the uniform window (module docstring)."""
    if not has_recall(runs):
        return None
    groups = group_by_regime(runs)
    uniforms = {k: g for k, g in groups.items() if split_policy(k)[0] == UNIFORM}
    metrics = _metrics()
    table = Table(
        title="Recall: loss, text-only loss and recall accuracy by distance, against the uniform window",
        columns=["Policy", "Seeds", "Causal coverage", "Reference", *[m[1] for m in metrics]],
        csv_columns=["policy", "name", "n_seeds", "causal_coverage", "reference",
                     *[c for m in metrics for c in (f"{m[0]}_mean", f"{m[0]}_delta", f"{m[0]}_ci_low",
                                                     f"{m[0]}_ci_high")]],
    )
    for label, group in groups.items():
        cov = mean(logged_values(group, Run.final_coverage))
        ref = uniform_reference(label, group, uniforms) if uniforms else None
        cells, csv = [], []
        for _, _, get, digits in metrics:
            value = mean(logged_values(group, get))
            diff = None
            if ref is not None and ref != label:
                diff = paired_difference(by_seed(group, get), by_seed(uniforms[ref], get))
            cells.append(_cell(value, diff, digits, ref is None or ref == label))
            ci = diff.ci if diff is not None and diff.ci is not None else (None, None)
            csv += [value, None if diff is None else diff.mean, *ci]
        ref_text = "reference" if ref == label else (display_name(ref) if ref else NOT_LOGGED)
        table.rows.append([display_name(label), str(len(group)), NOT_LOGGED if cov is None else f"{cov:.4f}",
                           ref_text, *cells])
        table.csv_rows.append([label, display_name(label), len(group), cov, ref, *csv])
    table.notes = [
        "Each cell: mean over seeds (Δ = policy − reference, paired by seed, 95% Student-t interval; "
        f"{SIGNIFICANT} = interval excludes 0). Reference: the uniform window at the policy's budget, "
        "else the one closest in causal coverage. Recall: share of queries whose whole value is the "
        "model's argmax byte by byte under teacher forcing (exact match), in percent, by the "
        "definition-to-query distance; text loss: loss on the corpus bytes alone (eval.json).",
    ]
    return table


def _distance_curve(runs: Sequence[Run]) -> tuple[np.ndarray, np.ndarray] | None:
    curves = []
    for run in runs:
        bins = (run.eval_json or {}).get("recall_by_distance")
        seq_len = (run.eval_json or {}).get("seq_len")
        if not bins or not seq_len:
            continue
        x = np.array([(b["lo"] + b["hi"]) / 2 / seq_len for b in bins])
        y = np.array([np.nan if b["accuracy"] is None else 100.0 * b["accuracy"] for b in bins])
        curves.append((x, y))
    if not curves:
        return None
    return curves[0][0], np.nanmean(np.stack([c[1] for c in curves]), axis=0)


def plot_recall_vs_distance(groups: dict[str, list[Run]], colors: dict[str, tuple], path: Path) -> FigureResult:
    """Recall accuracy against the definition-to-query distance, one line per policy (seed mean)."""
    title = "Recall accuracy against distance"
    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    drawn = 0
    for label, runs in groups.items():
        curve = _distance_curve(runs)
        if curve is None:
            continue
        ax.plot(curve[0], curve[1], marker="o", label=display_name(label), color=colors.get(label))
        drawn += 1
    if not drawn:
        return FigureResult(title, note="no run recorded recall accuracy by distance")
    for frac in (0.25, 0.5):
        ax.axvline(frac, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("definition-to-query distance / T (bin centres, eighths of the block)")
    ax.set_ylabel("recall accuracy (%)")
    ax.set_ylim(-2, 102)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return FigureResult(title, path=save_png(fig, path))
