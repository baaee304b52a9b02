"""Experiment reports: tables, CSVs and figures from a set of run folders.

:func:`write_report` reads run folders (or folders holding them), and writes
``report.md`` with the paper-shaped tables (Tables 4, 5 and 6 of section 7),
their CSVs, and the training-dynamics, window-bucket and per-head window
figures (Figures 3 and 4), and, for window-policy comparisons, the
coverage-vs-loss figure, per-layer lost-mass curves and the equal-coverage
table against the uniform window. Numbers are aggregated over seeds, and differences
to full attention are paired by seed with 95% Student-t intervals
(:mod:`aah.report.stats`). :func:`main_table_text` returns the training table
for printing.
"""

from __future__ import annotations

import csv
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from .figures import FigureResult, bucket_matrix, palette_color, write_figures
from .recall import plot_recall_vs_distance, recall_table
from .runs import Run, display_name, find_run_dirs, group_by_regime, load_run, load_runs
from .stats import paired_difference, t_quantile_975
from .tables import Table, equal_coverage_table, inference_table, screening_table, training_table

__all__ = [
    "Run",
    "Table",
    "display_name",
    "equal_coverage_table",
    "find_run_dirs",
    "finished_runs",
    "inference_table",
    "load_run",
    "load_runs",
    "main_table_text",
    "paired_difference",
    "recall_table",
    "screening_table",
    "t_quantile_975",
    "training_table",
    "write_report",
]

METRICS_STATEMENT = (
    "ACR is the paper's rectangular selected-window proxy: a routing diagnostic that says "
    "which windows the controller chose, not what was computed. Causal coverage is derived "
    "from the same windows (allowed pairs over the causal triangle). Executed coverage (the "
    "work the backend really did) and tokens/s are measurements, as is peak memory."
)


def _load(run_dirs: Iterable[Path | str]) -> tuple[list[Run], list[str]]:
    runs, notes = load_runs(run_dirs)
    if not runs:
        raise ValueError("no run folders (folders holding meta.json) were found")
    return runs, notes


def finished_runs(runs: Sequence[Run], include_unfinished: bool = False) -> tuple[list[Run], list[str]]:
    """The runs the tables and figures average over, and a note on those left out.

    A run that has not completed (still running, interrupted, failed) would
    mix a shorter training into a regime's mean, so it is left out while at
    least one run has completed; ``include_unfinished`` keeps every run (their
    rows then use the last values logged).
    """
    complete = [r for r in runs if r.status == "complete"]
    if include_unfinished or not complete or len(complete) == len(runs):
        return list(runs), []
    left = [r for r in runs if r.status != "complete"]
    return complete, ["Left out of the tables and figures until they complete (`--include-unfinished` "
                      "keeps them): " + ", ".join(f"`{r.name}` ({r.status})" for r in left) + "."]


def main_table_text(run_dirs: Iterable[Path | str], include_unfinished: bool = False) -> str:
    """The training table (paper Table 4 shape) of ``run_dirs`` as Markdown text."""
    runs, _ = _load(run_dirs)
    return training_table(finished_runs(runs, include_unfinished)[0]).to_markdown()


def write_report(run_dirs: list[Path], out_dir: Path, include_unfinished: bool = False) -> Path:
    """Write ``report.md``, CSVs and PNG figures for ``run_dirs`` into ``out_dir``.

    Each entry of ``run_dirs`` is a run folder or a folder searched for run
    folders. Runs that have not completed are listed but left out of the
    tables and figures unless ``include_unfinished`` (:func:`finished_runs`).
    Returns the path of ``report.md``. Raises ``ValueError`` when no run
    folder is found and ``FileNotFoundError`` for a path that does not exist.
    """
    every_run, notes = _load(run_dirs)
    runs, left_out = finished_runs(every_run, include_unfinished)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = group_by_regime(runs)
    tables = [("training", training_table(runs)), ("inference", inference_table(runs))]
    screening = screening_table(runs)
    if screening is not None:
        tables.append(("screening", screening))
    policies = equal_coverage_table(runs)
    if policies is not None:
        tables.append(("policies", policies))
    recall = recall_table(runs)
    if recall is not None:
        tables.append(("recall", recall))
    for stem, table in tables:
        table.write_csv(out_dir / f"{stem}.csv")
    figures = write_figures(groups, out_dir)
    if recall is not None:
        colors = {regime: palette_color(i) for i, regime in enumerate(groups)}
        figures.insert(0, plot_recall_vs_distance(groups, colors, out_dir / "recall_vs_distance.png"))
    bucket_lines = _write_bucket_csv(groups, out_dir / "window_buckets.csv")
    text = _render(runs, every_run, tables, figures, bucket_lines, notes + left_out + _run_notes(runs))
    path = out_dir / "report.md"
    path.write_text(text, encoding="utf-8")
    return path


# --- pieces of report.md -------------------------------------------------------------------
def _counted(values: Sequence[str | None], unknown: str = "not recorded") -> str:
    counts = Counter(v or unknown for v in values)
    if not counts:
        return unknown
    return ", ".join(f"{v} ({n} run{'s' if n != 1 else ''})" for v, n in counts.most_common())


def _provenance(runs: Sequence[Run]) -> list[str]:
    evaluated = [r for r in runs if r.eval_json is not None]
    commits = [r.commit[:12] if r.commit else None for r in runs]
    lines = [
        "## Provenance",
        "",
        f"- Training backend: {_counted([r.meta.get('backend') for r in runs])}",
        f"- Training device: {_counted([r.meta.get('device') for r in runs])}",
    ]
    if evaluated:
        lines.append(f"- Evaluation backend: {_counted([r.eval_json.get('backend') for r in evaluated])}")
        lines.append(f"- Evaluation device: {_counted([r.eval_json.get('device') for r in evaluated])}")
    else:
        lines.append("- Evaluation: no run has been evaluated yet (no eval.json)")
    lines.append(f"- Commit: {_counted(commits, 'not recorded (not a git checkout)')}")
    lines.append(f"- torch: {_counted([r.meta.get('torch') for r in runs])}; "
                 f"aah: {_counted([r.meta.get('version') for r in runs])}")
    if len({c for c in commits if c}) > 1:
        lines.append("- The runs come from more than one commit; compare rows with that in mind.")
    return lines + ["", f"> {METRICS_STATEMENT}", ""]


def _run_list(runs: Sequence[Run]) -> list[str]:
    lines = ["## Runs", "",
             "| Run | Regime | Seed | Status | Final step | Backend | Device | Commit | eval.json |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        cells = [f"`{r.name}`", r.display_name, str(r.seed if r.seed is not None else "—"),
                 r.status, str(r.final_step if r.final_step is not None else "—"),
                 str(r.meta.get("backend") or "—"), str(r.meta.get("device") or "—"),
                 (r.commit or "—")[:12], "yes" if r.has_eval else "missing"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines + [""]


def _run_notes(runs: Sequence[Run]) -> list[str]:
    notes = []
    unfinished = [r for r in runs if r.status != "complete"]
    if unfinished:
        notes.append("Not complete (their rows use the last values logged so far): "
                     + ", ".join(f"`{r.name}` ({r.status})" for r in unfinished) + ".")
    for r in runs:
        if not r.train:
            notes.append(f"`{r.name}` has no training lines in metrics.jsonl.")
        if r.bad_lines:
            notes.append(f"`{r.name}`: {r.bad_lines} unreadable line(s) in metrics.jsonl skipped.")
    steps = sorted({r.final_step for r in runs if r.final_step is not None})
    if len(steps) > 1:
        notes.append("Runs end at different steps (" + ", ".join(map(str, steps))
                     + "); rows trained for different budgets are not directly comparable.")
    return notes


def _figure_lines(figures: Sequence[FigureResult], bucket_lines: list[str]) -> list[str]:
    lines = ["## Figures", ""]
    for fig in figures:
        if fig.path is not None:
            lines += [f"![{fig.title}]({fig.path.name})", ""]
            if fig.path.name == "window_buckets.png":
                lines += bucket_lines
        else:
            lines += [f"- {fig.title}: not drawn ({fig.note}).", ""]
    return lines


def _write_bucket_csv(groups: dict[str, list[Run]], path: Path) -> list[str]:
    regimes, keys, matrix, sources = bucket_matrix(groups)
    if not regimes:
        return []
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(["regime", "name", "source", *keys])
        for i, regime in enumerate(regimes):
            writer.writerow([regime, display_name(regime), sources[regime], *matrix[i].tolist()])
    sources_text = "; ".join(f"{display_name(r)}: {sources[r]}" for r in regimes)
    return [f"Window-bucket fractions (also in [window_buckets.csv](window_buckets.csv)), "
            f"averaged over seeds; source: {sources_text}.", ""]


def _render(runs: Sequence[Run], every_run: Sequence[Run], tables: list[tuple[str, Table]],
            figures: list[FigureResult], bucket_lines: list[str], notes: list[str]) -> str:
    regimes = group_by_regime(runs)
    lines = [
        "# AAH experiment report",
        "",
        f"{len(runs)} run(s) of {len(regimes)} regime(s): "
        + ", ".join(f"{display_name(r)} ({len(g)})" for r, g in regimes.items()) + ".",
        "",
        *_provenance(runs),
    ]
    headings = {"training": "Training (paper Table 4)", "inference": "Inference (paper Table 6)",
                "screening": "Screening ablation (paper Table 5)",
                "policies": "Window policies at equal coverage",
                "recall": "Recall of far context (recall corpus)"}
    for stem, table in tables:
        lines += [f"## {headings[stem]}", "", table.to_markdown(), "",
                  f"CSV: [{stem}.csv]({stem}.csv)", ""]
    lines += _figure_lines(figures, bucket_lines)
    lines += _run_list(every_run)
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)
