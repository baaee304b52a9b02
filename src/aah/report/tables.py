"""The report's tables, as Markdown and CSV, in the shape of the paper's Tables 4, 5 and 6.

* :func:`training_table` (paper Table 4, section 7.2): per regime the number of
  seeds, the final training-loop validation loss (mean +/- sample sd over
  seeds), its seed-paired difference to full attention with a 95% interval,
  and the last logged ACR, causal coverage, tokens/s and the peak memory.
* :func:`inference_table` (paper Table 6, section 7.6): the same quality and
  routing columns from each run's ``eval.json``, plus executed coverage and
  inference tokens/s; a regime without any ``eval.json`` is marked missing.
* :func:`screening_table` (paper Table 5, section 7.3): validation loss of the
  screening regimes and their difference to the pure (full-attention) baseline;
  built only when a screening-only regime is among the runs.
* :func:`equal_coverage_table`: every window policy against the ``uniform_window``
  baseline at the same budget (or the closest causal coverage), seed-paired;
  built only when a uniform-window run is among the runs.

Differences are ``regime - full attention`` per seed (negative = lower loss
than full attention). A ``*`` marks a 95% interval that excludes 0. Numbers
other than the loss are means over the regime's runs.
"""

from __future__ import annotations

import csv
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .runs import (
    FULL_ATTENTION,
    SCREENING_REGIMES,
    Run,
    display_name,
    group_by_regime,
    split_policy,
)
from .stats import PairedDifference, mean, paired_difference, sample_std

__all__ = [
    "MISSING",
    "NOT_LOGGED",
    "Table",
    "equal_coverage_table",
    "format_difference",
    "inference_table",
    "screening_table",
    "training_table",
]

NOT_LOGGED = "—"  # the run did not record this value
MISSING = "missing"  # the file that would hold it (eval.json) does not exist
SIGNIFICANT = "*"
SCREENING_NAMES = {FULL_ATTENTION: "Pure baseline"}
_SCREENING_ONLY = set(SCREENING_REGIMES) - {FULL_ATTENTION, "shallow_freeze"}


@dataclass
class Table:
    """A rendered table: formatted Markdown cells plus raw values for the CSV."""

    title: str
    columns: list[str]
    rows: list[list[str]] = field(default_factory=list)
    csv_columns: list[str] = field(default_factory=list)
    csv_rows: list[list[object]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_markdown(self, *, title: bool = True) -> str:
        """The table as GitHub Markdown, with its title (optional) and notes below it."""
        lines = [f"**{self.title}**", ""] if title else []
        lines.append("| " + " | ".join(self.columns) + " |")
        lines.append("|" + "|".join("---" for _ in self.columns) + "|")
        lines.extend("| " + " | ".join(row) + " |" for row in self.rows)
        if self.notes:
            lines.append("")
            lines.extend(self.notes)
        return "\n".join(lines)

    def write_csv(self, path: Path) -> Path:
        """Write the raw values (empty cell = not available) to ``path``."""
        path = Path(path)
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(self.csv_columns)
            for row in self.csv_rows:
                writer.writerow(["" if v is None else v for v in row])
        return path


# --- formatting ----------------------------------------------------------------------------
def _fmt(value: float | None, digits: int) -> str:
    return NOT_LOGGED if value is None else f"{value:.{digits}f}"


def _fmt_mean_std(values: Sequence[float], digits: int = 4) -> str:
    m, sd = mean(values), sample_std(values)
    if m is None:
        return NOT_LOGGED
    return f"{m:.{digits}f}" if sd is None else f"{m:.{digits}f} ± {sd:.{digits}f}"


def format_difference(diff: PairedDifference | None, digits: int = 4) -> str:
    """``+0.0123 [+0.0010, +0.0236]*``; ``(CI n/a)`` with one seed; the placeholder for none."""
    if diff is None:
        return NOT_LOGGED
    text = f"{diff.mean:+.{digits}f}"
    ci = diff.ci
    if ci is None:
        return f"{text} (CI n/a, n=1)"
    mark = SIGNIFICANT if diff.significant else ""
    return f"{text} [{ci[0]:+.{digits}f}, {ci[1]:+.{digits}f}]{mark}"


def _diff_csv(diff: PairedDifference | None) -> list[object]:
    if diff is None:
        return [None, None, None, 0, None]
    ci = diff.ci or (None, None)
    sig = None if diff.significant is None else int(diff.significant)
    return [diff.mean, ci[0], ci[1], diff.n, sig]


_DIFF_CSV_COLUMNS = ["delta_mean", "delta_ci_low", "delta_ci_high", "delta_n_seeds", "delta_significant"]


# --- shared pieces ---------------------------------------------------------------------------
Getter = Callable[[Run], "float | None"]


def logged_values(runs: Sequence[Run], get: Getter) -> list[float]:
    """``get`` of each run that logged it (runs where it gives ``None`` are left out)."""
    return [v for v in (get(r) for r in runs) if v is not None]


def by_seed(runs: Sequence[Run], get: Getter) -> dict[int, float]:
    """``get`` of each run by its seed, for differences paired by seed (runs without either left out)."""
    out = {}
    for run in runs:
        value = get(run)
        if value is not None and run.seed is not None:
            out[run.seed] = value
    return out


def _difference(
    regime: str, runs: Sequence[Run], reference: Sequence[Run] | None, get: Getter
) -> tuple[str, PairedDifference | None]:
    if regime == FULL_ATTENTION:
        return "reference", None
    if not reference:
        return NOT_LOGGED, None
    diff = paired_difference(by_seed(runs, get), by_seed(reference, get))
    return format_difference(diff), diff


def _seeds(runs: Sequence[Run]) -> str:
    return " ".join(str(r.seed) for r in runs if r.seed is not None)


def _difference_notes(reference_label: str, groups: dict[str, list[Run]]) -> list[str]:
    notes = [
        f"Δ = regime − {reference_label}, paired by seed over the seeds both have; "
        f"95% Student-t interval in brackets; {SIGNIFICANT} = interval excludes 0."
    ]
    if FULL_ATTENTION not in groups:
        notes.append(f"No {reference_label} runs were given, so no differences are shown.")
    return notes


# --- paper Table 4 ---------------------------------------------------------------------------
def _final_val_loss(run: Run) -> float | None:
    return run.final_val_loss()


def speed_vs_reference(runs: Sequence[Run], reference: Sequence[Run] | None) -> PairedDifference | None:
    """Training tokens/s over the reference's, paired by seed, as ``ratio - 1`` with its 95% interval."""
    if not reference:
        return None
    ours = by_seed(runs, Run.train_tokens_per_s)
    theirs = by_seed(reference, Run.train_tokens_per_s)
    ratios = {seed: ours[seed] / theirs[seed] for seed in ours.keys() & theirs.keys() if theirs[seed] > 0}
    if not ratios:
        return None
    return paired_difference(ratios, {seed: 1.0 for seed in ratios})


def format_speed(diff: PairedDifference | None) -> str:
    """``1.17x [1.12, 1.22]*`` (``*``: the interval excludes 1); ``(CI n/a)`` with one seed."""
    if diff is None:
        return NOT_LOGGED
    text = f"{1 + diff.mean:.2f}x"
    if diff.ci is None:
        return f"{text} (CI n/a, n=1)"
    mark = SIGNIFICANT if diff.significant else ""
    return f"{text} [{1 + diff.ci[0]:.2f}, {1 + diff.ci[1]:.2f}]{mark}"


def training_table(runs: Sequence[Run]) -> Table:
    """Final training-loop numbers per regime (paper Table 4)."""
    groups = group_by_regime(runs)
    reference = groups.get(FULL_ATTENTION)
    table = Table(
        title="Training: final validation loss, routing diagnostics and measured cost",
        columns=["Regime", "Seeds", "Val loss (mean ± sd)", "Δ vs full (95% CI)",
                 "ACR", "Causal coverage", "Tokens/s", "Peak memory (MB)", "Speed vs full (95% CI)"],
        csv_columns=["regime", "name", "n_seeds", "seeds", "val_loss_mean", "val_loss_std",
                      *_DIFF_CSV_COLUMNS, "acr", "causal_coverage", "tokens_per_s",
                      "peak_mem_mb", "final_step", "speed_vs_full", "speed_ci_low", "speed_ci_high"],
    )
    for regime, group in groups.items():
        losses = logged_values(group, _final_val_loss)
        delta_text, diff = _difference(regime, group, reference, _final_val_loss)
        acr = mean(logged_values(group, lambda r: r.train_value("acr")))
        cov = mean(logged_values(group, lambda r: r.train_value("causal_coverage")))
        tps = mean(logged_values(group, lambda r: r.train_tokens_per_s()))
        mem = mean(logged_values(group, Run.peak_mem_mb))
        steps = [r.final_step for r in group if r.final_step is not None]
        speed = None if regime == FULL_ATTENTION else speed_vs_reference(group, reference)
        speed_ci = (speed.ci if speed is not None else None) or (None, None)
        table.rows.append([display_name(regime), str(len(group)), _fmt_mean_std(losses),
                           delta_text, _fmt(acr, 4), _fmt(cov, 4), _fmt(tps, 0), _fmt(mem, 1),
                           "reference" if regime == FULL_ATTENTION else format_speed(speed)])
        table.csv_rows.append([regime, display_name(regime), len(group), _seeds(group),
                               mean(losses), sample_std(losses), *_diff_csv(diff), acr, cov,
                               tps, mem, max(steps) if steps else None,
                               None if speed is None else 1 + speed.mean,
                               *(None if c is None else 1 + c for c in speed_ci)])
    table.notes = _difference_notes("full attention", groups) + [
        "Val loss: last validation of the training loop. ACR and causal coverage: last logged "
        "training step. Tokens/s: median over the second half of training. Peak memory: largest "
        "value logged. Means over seeds.",
        f"Speed vs full: training tokens/s over full attention's, paired by seed; 95% Student-t "
        f"interval; {SIGNIFICANT} = interval excludes 1. Runs of a suite share the machine in turn, "
        "so compare runs made under the same conditions (threads, --jobs).",
    ]
    return table


# --- paper Table 6 ---------------------------------------------------------------------------
def _eval_loss(run: Run) -> float | None:
    return run.eval_value("val_loss")


def _eval_mean(group: Sequence[Run], key: str) -> float | None:
    return mean(logged_values(group, lambda r: r.eval_value(key)))


def inference_table(runs: Sequence[Run]) -> Table:
    """Final-checkpoint evaluation per regime from ``eval.json`` (paper Table 6)."""
    groups = group_by_regime(runs)
    reference = [r for r in groups.get(FULL_ATTENTION, []) if r.has_eval]
    table = Table(
        title="Inference: final-checkpoint evaluation",
        columns=["Regime", "Seeds", "Val loss (mean ± sd)", "Val ppl", "ACR", "Causal coverage",
                 "Executed coverage", "Inference tokens/s", "Δ loss vs full (95% CI)"],
        csv_columns=["regime", "name", "n_seeds", "n_runs", "seeds", "val_loss_mean",
                     "val_loss_std", "val_ppl", "acr", "causal_coverage", "executed_coverage",
                     "inference_tokens_per_s", *_DIFF_CSV_COLUMNS],
    )
    missing_runs: list[str] = []
    for regime, group in groups.items():
        evaluated = [r for r in group if r.has_eval]
        missing_runs.extend(r.name for r in group if not r.has_eval)
        name = display_name(regime)
        if not evaluated:
            table.rows.append([name, f"0/{len(group)}", *[MISSING] * 7])
            table.csv_rows.append([regime, name, 0, len(group), "", *[None] * 7,
                                   *_diff_csv(None)])
            continue
        losses = logged_values(evaluated, _eval_loss)
        delta_text, diff = _difference(regime, evaluated, reference, _eval_loss)
        cols = {k: _eval_mean(evaluated, k) for k in
                ("val_ppl", "acr", "causal_coverage", "executed_coverage",
                 "inference_tokens_per_s")}
        seeds = str(len(evaluated)) if len(evaluated) == len(group) else \
            f"{len(evaluated)}/{len(group)}"
        table.rows.append([name, seeds, _fmt_mean_std(losses), _fmt(cols["val_ppl"], 2),
                           _fmt(cols["acr"], 4), _fmt(cols["causal_coverage"], 4),
                           _fmt(cols["executed_coverage"], 4),
                           _fmt(cols["inference_tokens_per_s"], 0), delta_text])
        table.csv_rows.append([regime, name, len(evaluated), len(group), _seeds(evaluated),
                               mean(losses), sample_std(losses), *cols.values(),
                               *_diff_csv(diff)])
    table.notes = _difference_notes("full attention", groups)
    if missing_runs:
        table.notes.append(
            f"{MISSING}: not evaluated yet (no eval.json) — " + ", ".join(f"`{n}`" for n in
                                                                          missing_runs) + "."
        )
    return table


# --- paper Table 5 ---------------------------------------------------------------------------
def screening_table(runs: Sequence[Run]) -> Table | None:
    """Screening ablation rows against the pure baseline (paper Table 5), or ``None``.

    Built when at least one screening-only regime (anything in the paper's
    Table 5 other than the pure baseline and shallow freeze) is among ``runs``.
    """
    groups = group_by_regime(runs)
    if not _SCREENING_ONLY & set(groups):
        return None
    reference = groups.get(FULL_ATTENTION)
    table = Table(
        title="Screening ablation: validation loss against the pure baseline",
        columns=["Row", "Seeds", "Val loss (mean ± sd)", "Δ vs pure baseline (95% CI)"],
        csv_columns=["regime", "name", "n_seeds", "seeds", "val_loss_mean", "val_loss_std",
                     *_DIFF_CSV_COLUMNS],
    )
    for regime in SCREENING_REGIMES:
        group = groups.get(regime)
        if not group:
            continue
        name = SCREENING_NAMES.get(regime, display_name(regime))
        losses = logged_values(group, _final_val_loss)
        delta_text, diff = _difference(regime, group, reference, _final_val_loss)
        table.rows.append([name, str(len(group)), _fmt_mean_std(losses), delta_text])
        table.csv_rows.append([regime, name, len(group), _seeds(group), mean(losses),
                               sample_std(losses), *_diff_csv(diff)])
    table.notes = _difference_notes("pure baseline", groups) + [
        "Val loss: last validation of the training loop."
    ]
    return table


# --- window policies at equal coverage -------------------------------------------------------
UNIFORM = "uniform_window"


def _policy_loss(run: Run) -> float | None:
    return run.policy_val_loss()


def uniform_reference(label: str, group: Sequence[Run], uniforms: dict[str, list[Run]]) -> str:
    """The uniform-window group a policy is compared with: the one at the same budget, else
    the one whose mean causal coverage is closest to the policy's."""
    _, budget = split_policy(label)
    if budget is not None:
        same = [u for u in uniforms if split_policy(u)[1] == budget]
        if same:
            return same[0]
    cov = mean(logged_values(group, Run.final_coverage))
    if cov is None:
        return next(iter(uniforms))
    return min(uniforms, key=lambda u: abs((mean(logged_values(uniforms[u], Run.final_coverage)) or 0.0) - cov))


def equal_coverage_table(runs: Sequence[Run]) -> Table | None:
    """Every policy against the uniform window at (about) the same causal coverage.

    Built only when a ``uniform_window`` group is among the runs. The difference is
    ``policy - uniform_window`` in final validation loss, paired by seed.
    """
    groups = group_by_regime(runs)
    uniforms = {k: g for k, g in groups.items() if split_policy(k)[0] == UNIFORM}
    if not uniforms:
        return None
    table = Table(
        title="Window policies at equal coverage: validation loss against the uniform window",
        columns=["Policy", "Seeds", "Causal coverage", "Uniform reference (coverage)",
                 "Val loss (mean ± sd)", "Δ vs uniform (95% CI)", "Train tokens/s"],
        csv_columns=["policy", "name", "n_seeds", "seeds", "causal_coverage", "reference",
                     "reference_coverage", "val_loss_mean", "val_loss_std", *_DIFF_CSV_COLUMNS,
                     "tokens_per_s"],
    )
    for label, group in groups.items():
        cov = mean(logged_values(group, Run.final_coverage))
        losses = logged_values(group, _policy_loss)
        tps = mean(logged_values(group, lambda r: r.train_tokens_per_s()))
        ref = uniform_reference(label, group, uniforms)
        ref_cov = mean(logged_values(uniforms[ref], Run.final_coverage))
        if label == ref:
            delta_text, diff = "reference", None
        else:
            diff = paired_difference(by_seed(group, _policy_loss), by_seed(uniforms[ref], _policy_loss))
            delta_text = format_difference(diff)
        table.rows.append([display_name(label), str(len(group)), _fmt(cov, 4),
                           f"{display_name(ref)} ({_fmt(ref_cov, 4)})", _fmt_mean_std(losses),
                           delta_text, _fmt(tps, 0)])
        table.csv_rows.append([label, display_name(label), len(group), _seeds(group), cov, ref, ref_cov,
                               mean(losses), sample_std(losses), *_diff_csv(diff), tps])
    table.notes = [
        f"Δ = policy − uniform window, paired by seed; 95% Student-t interval; {SIGNIFICANT} = "
        "interval excludes 0 (the only basis for a claim that one policy beats another).",
        "Reference: the uniform window at the policy's budget, else the one closest in causal "
        "coverage; compare the two coverage columns before reading a difference as a like-for-like "
        "comparison. Val loss: eval.json of the final checkpoint where present, else the training "
        "loop's last validation. Causal coverage: final windows. Tokens/s: training, median over "
        "the second half of each run, mean over seeds.",
    ]
    return table
