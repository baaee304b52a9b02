"""Reading run folders for the report, tolerant of what a run has not written yet.

A run folder holds ``meta.json`` (provenance and status), ``config.yaml`` (the
resolved configuration), ``metrics.jsonl`` (``"train"`` and ``"eval"`` lines)
and, once the run has been evaluated, ``eval.json``. Any of these may be
missing or, for ``metrics.jsonl``, end in a half-written line; the accessors
here then return ``None`` and the tables print a placeholder.

A record (a folder of ``aah experiment --records``) also holds ``manifest.json``, the
checksums of its files: it is read only when every file verifies, and one that does not
(truncated, edited, missing, unreadable) raises :class:`aah.experiment.records.RecordError`
naming the file, never a half-read run.

Full-attention runs follow the paper's rule (section 7.1): ACR and causal
coverage are 1 by definition when not logged, and hierarchy levels used are 0.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ..experiment.records import MANIFEST, verify_record
from .stats import acr_from_fractions, bucket_fractions

__all__ = [
    "FULL_ATTENTION",
    "MAIN_REGIMES",
    "SCREENING_REGIMES",
    "Run",
    "display_name",
    "find_run_dirs",
    "group_by_regime",
    "load_run",
    "load_runs",
    "policy_label",
    "regime_sort_key",
    "split_policy",
]

FULL_ATTENTION = "full_attention"
# The principal regimes of the paper's Tables 4 and 6, in the paper's order.
MAIN_REGIMES = (
    FULL_ATTENTION,
    "grouping_off",
    "full_adaptive",
    "shallow_freeze",
    "deep_practical_reuse",
)
# The rows of the paper's screening ablation (Table 5), in the paper's order.
SCREENING_REGIMES = (
    FULL_ATTENTION,
    "shallow_control_interval_10",
    "shallow_freeze",
    "fixed_random_grouping",
    "fixed_window",
    "shuffle_post_select",
    "full_adaptive_shuffle_post_select",
)
_DISPLAY_NAMES = {
    FULL_ATTENTION: "Full attention",
    "grouping_off": "Grouping off",
    "full_adaptive": "Full adaptive",
    "shallow_freeze": "Shallow freeze",
    "deep_practical_reuse": "Deep practical reuse",
    "shuffle_post_select": "Shallow shuffle-post-select",
    "full_adaptive_shuffle_post_select": "Full adaptive shuffle-post-select",
}
# Regimes whose windows follow aah.budget: one report group per (regime, budget).
BUDGET_REGIMES = ("budgeted", "budgeted_grouped", "uniform_window", "loss_aware", "full_heads")
_POLICY_SEP = "@"
# A suite row that is a variant of its regime (``loss_aware_late`` of ``loss_aware``) tags the group.
_ROW_SEP = "#"
# Full attention by definition (paper section 7.1), used when a value is not logged.
_FULL_ATTENTION_DEFAULTS = {"acr": 1.0, "causal_coverage": 1.0, "levels_used": 0.0}


def policy_label(regime: str, budget: float | None, row: str | None = None) -> str:
    """The report group of a run: ``regime``, or ``regime@budget`` for a budget-driven regime;
    ``#row`` follows when the run is a suite row named otherwise than its regime (a variant)."""
    label = regime
    if regime in BUDGET_REGIMES and budget is not None:
        label = f"{regime}{_POLICY_SEP}{budget:g}"
    return f"{label}{_ROW_SEP}{row}" if row and row != regime else label


def policy_row(label: str) -> str | None:
    """The suite row of a :func:`policy_label` that names one, else ``None``."""
    return label.partition(_ROW_SEP)[2] or None


def split_policy(label: str) -> tuple[str, float | None]:
    """``(regime, budget)`` of a :func:`policy_label` (budget ``None`` for plain regimes)."""
    regime, sep, budget = label.partition(_ROW_SEP)[0].partition(_POLICY_SEP)
    try:
        return regime, float(budget) if sep else None
    except ValueError:
        return label, None


def display_name(regime: str) -> str:
    """The paper's name for a regime; otherwise underscores as spaces, first letter capital.

    A budget-driven group (``budgeted@0.45``) reads ``Budgeted (b = 0.45)``; a suite variant
    reads by its row (``loss_aware@0.45#loss_aware_late``: ``Loss aware late (b = 0.45)``).
    """
    base, budget = split_policy(regime)
    name = policy_row(regime) or base
    if budget is not None:
        return f"{display_name(name)} (b = {budget:g})"
    if name in _DISPLAY_NAMES:
        return _DISPLAY_NAMES[name]
    text = name.replace("_", " ").strip()
    return text[:1].upper() + text[1:]


def regime_sort_key(regime: str) -> tuple[int, int, str]:
    """Paper order: principal regimes, then screening regimes, then the rest alphabetically
    (budget-driven groups by regime, then by descending budget)."""
    base, budget = split_policy(regime)
    if budget is not None:  # a variant (``#row``) right after its regime's own group
        return (2, 0, f"{base}{_POLICY_SEP}{1.0 - budget:.6f}{_ROW_SEP}{policy_row(regime) or ''}")
    if base in MAIN_REGIMES:
        return (0, MAIN_REGIMES.index(base), regime)
    if base in SCREENING_REGIMES:
        return (1, SCREENING_REGIMES.index(base), regime)
    return (2, 0, regime)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return data if isinstance(data, dict) else {}


def _read_metrics(path: Path) -> tuple[list[dict], list[dict], int]:
    """Train lines, eval lines (each sorted by step) and the number of unreadable lines."""
    train: list[dict] = []
    evals: list[dict] = []
    bad = 0
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return train, evals, 0
    for line in lines:
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            bad += 1  # typically the last line of a run that is still writing
            continue
        if not isinstance(row, dict) or _number(row.get("step")) is None:
            bad += 1
        elif row.get("kind") == "train":
            train.append(row)
        elif row.get("kind") == "eval":
            evals.append(row)
    train.sort(key=lambda r: r["step"])
    evals.sort(key=lambda r: r["step"])
    return train, evals, bad


def _nested(config: dict[str, Any], section: str, key: str) -> Any:
    part = config.get(section)
    return part.get(key) if isinstance(part, dict) else None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value)
    return None


@dataclass
class Run:
    """Everything the report reads from one run folder."""

    path: Path
    meta: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    train: list[dict] = field(default_factory=list)
    evals: list[dict] = field(default_factory=list)
    eval_json: dict[str, Any] | None = None
    bad_lines: int = 0

    # --- identity and provenance -------------------------------------------------------
    @property
    def regime(self) -> str:
        regime = self.meta.get("regime") or _nested(self.config, "aah", "regime")
        return str(regime) if regime else "unknown"

    @property
    def budget(self) -> float | None:
        """``aah.budget`` of a budget-driven regime (the regime's preset when the config omits it)."""
        if self.regime not in BUDGET_REGIMES:
            return None
        value = _number(_nested(self.config, "aah", "budget"))
        if value is None:
            try:
                from .. import regimes

                value = regimes.get(self.regime).budget
            except ValueError:
                return None
        return value

    @property
    def row(self) -> str | None:
        """The suite row the run was trained as (``meta.json``'s ``suite_row``, written by ``aah
        experiment``), ``None`` outside a suite."""
        row = self.meta.get("suite_row")
        return str(row) if row else None

    @property
    def policy(self) -> str:
        """The report group: the regime, with its budget for budget-driven regimes, tagged with the
        suite row when that is a variant of the regime."""
        return policy_label(self.regime, self.budget, self.row)

    @property
    def seed(self) -> int | None:
        seed = _as_int(self.meta.get("seed"))
        return seed if seed is not None else _as_int(_nested(self.config, "train", "seed"))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def display_name(self) -> str:
        return display_name(self.policy)

    @property
    def is_full_attention(self) -> bool:
        return self.regime == FULL_ATTENTION

    @property
    def status(self) -> str:
        return str(self.meta.get("status") or "unknown")

    @property
    def commit(self) -> str | None:
        commit = self.meta.get("git_commit") or (self.eval_json or {}).get("git_commit")
        return str(commit) if commit else None

    @property
    def seq_len(self) -> int | None:
        for value in (
            self.meta.get("seq_len"),
            _nested(self.config, "data", "seq_len"),
            (self.eval_json or {}).get("seq_len"),
        ):
            if _as_int(value):
                return _as_int(value)
        return None

    @property
    def candidate_windows(self) -> list[int]:
        for source in (self.meta, self.eval_json or {}):
            cands = source.get("candidate_windows")
            if isinstance(cands, list) and cands and all(_as_int(c) for c in cands):
                return sorted(int(c) for c in cands)
        return []

    @property
    def final_step(self) -> int | None:
        return int(self.train[-1]["step"]) if self.train else None

    # --- training-loop values (paper Table 4, Figure 3) -----------------------------------
    def train_value(self, key: str) -> float | None:
        """``key`` from the last training line that logged it (full-attention defaults apply)."""
        for row in reversed(self.train):
            value = _number(row.get(key))
            if value is not None:
                return value
        return self._default(key)

    def train_tokens_per_s(self) -> float | None:
        """Median ``tokens_per_s`` over the second half of the training lines.

        One logging interval is a few seconds on a CPU and other processes add noise;
        the median over the settled half of the run is the figure to compare.
        """
        values = [v for v in (_number(r.get("tokens_per_s")) for r in self.train) if v is not None]
        if not values:
            return None
        late = sorted(values[len(values) // 2:])
        mid = len(late) // 2
        return late[mid] if len(late) % 2 else (late[mid - 1] + late[mid]) / 2

    def final_coverage(self) -> float | None:
        """Causal coverage of the final windows: ``eval.json``, else the last training line."""
        value = self.eval_value("causal_coverage")
        return value if value is not None else self.train_value("causal_coverage")

    def policy_val_loss(self) -> float | None:
        """Validation loss of the final checkpoint (``eval.json``), else the training loop's last."""
        value = self.eval_value("val_loss")
        return value if value is not None else self.final_val_loss()

    def layer_series(self, key: str) -> list[tuple[int, list[float]]]:
        """``(step, per-layer values)`` of every training line that logged the list ``key``."""
        out = []
        for row in self.train:
            values = row.get(key)
            if isinstance(values, list) and values and all(_number(v) is not None for v in values):
                out.append((int(row["step"]), [float(v) for v in values]))
        return out

    def peak_mem_mb(self) -> float | None:
        """The largest ``peak_mem_mb`` logged during training."""
        values = [v for v in (_number(r.get("peak_mem_mb")) for r in self.train) if v is not None]
        return max(values) if values else None

    def final_val_loss(self) -> float | None:
        """Validation loss of the last ``eval`` line in ``metrics.jsonl``."""
        for row in reversed(self.evals):
            value = _number(row.get("val_loss"))
            if value is not None:
                return value
        return None

    def series(self, kind: str, key: str) -> list[tuple[int, float]]:
        """``(step, value)`` for every ``kind`` line (``"train"`` or ``"eval"``) with ``key``."""
        rows = self.train if kind == "train" else self.evals
        out = []
        for row in rows:
            value = _number(row.get(key))
            if value is None:
                value = self._default(key) if kind == "train" else None
            if value is not None:
                out.append((int(row["step"]), value))
        return out

    # --- final-checkpoint evaluation (paper Table 6, Figure 4) ------------------------------
    @property
    def has_eval(self) -> bool:
        return self.eval_json is not None

    def eval_value(self, key: str) -> float | None:
        """``key`` from ``eval.json``; ``None`` without it (full-attention defaults apply)."""
        if self.eval_json is None:
            return None
        value = _number(self.eval_json.get(key))
        if value is not None:
            return value
        if key == "val_ppl":
            loss = _number(self.eval_json.get("val_loss"))
            return math.exp(loss) if loss is not None and loss < 700 else None
        if key == "acr" and not self.is_full_attention:
            found = self.final_bucket_fractions()
            seq_len = self.seq_len
            if found and found[0] == "eval.json" and seq_len:
                return acr_from_fractions(found[1], seq_len)
        return self._default(key)

    def final_windows(self) -> tuple[str, list] | None:
        """``(source, windows grid)`` of the final checkpoint: eval.json, else the last train line."""
        grid = (self.eval_json or {}).get("windows")
        if _is_grid(grid):
            return "eval.json", grid
        for row in reversed(self.train):
            if _is_grid(row.get("windows")):
                return "last training step", row["windows"]
        return None

    def final_bucket_fractions(self) -> tuple[str, dict[str, float]] | None:
        """``(source, fractions)`` of the final window assignment, or ``None``.

        Preference: ``eval.json`` fractions, then fractions computed from
        ``eval.json`` windows, then the last training line's fractions.
        """
        ev = self.eval_json or {}
        if _is_fractions(ev.get("bucket_fractions")):
            return "eval.json", _clean_fractions(ev["bucket_fractions"])
        cands = self.candidate_windows
        if _is_grid(ev.get("windows")) and cands:
            return "eval.json", bucket_fractions(ev["windows"], cands)
        for row in reversed(self.train):
            if _is_fractions(row.get("bucket_fractions")):
                return "last training step", _clean_fractions(row["bucket_fractions"])
        return None

    def _default(self, key: str) -> float | None:
        return _FULL_ATTENTION_DEFAULTS.get(key) if self.is_full_attention else None


def _is_grid(value: Any) -> bool:
    if not isinstance(value, list) or not value:
        return False
    rows = value if isinstance(value[0], list) else [value]
    return all(
        isinstance(r, list) and r and all(_as_int(w) is not None for w in r) for r in rows
    )


def _is_fractions(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(
        _number(v) is not None for v in value.values()
    )


def _clean_fractions(value: dict[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in value.items()}


def load_run(path: Path) -> Run:
    """Read one run folder; missing or unreadable files leave the matching fields empty.

    A record (a folder with ``manifest.json``) is verified first: :class:`RecordError` names
    the file that does not match."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        verify_record(path)
    train, evals, bad = _read_metrics(path / "metrics.jsonl")
    return Run(
        path=path,
        meta=_read_json(path / "meta.json") or {},
        config=_read_yaml(path / "config.yaml"),
        train=train,
        evals=evals,
        eval_json=_read_json(path / "eval.json"),
        bad_lines=bad,
    )


def find_run_dirs(paths: Iterable[Path | str]) -> list[Path]:
    """Run folders named by ``paths``: each path is a run folder (it holds ``meta.json``) or
    a folder searched recursively for run folders. Order is kept, duplicates dropped.

    Raises ``FileNotFoundError`` for a path that does not exist.
    """
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"no such file or folder: {path}")
        if (path / "meta.json").is_file():
            found.append(path)
        elif path.is_dir():
            found.extend(sorted(meta.parent for meta in path.rglob("meta.json")))
    seen: set[Path] = set()
    unique = []
    for path in found:
        key = path.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(path)
    return unique


def _preference(run: Run) -> tuple[int, str]:
    return (1 if run.status == "complete" else 0, str(run.meta.get("start_time") or ""))


def load_runs(paths: Iterable[Path | str]) -> tuple[list[Run], list[str]]:
    """Load every run folder under ``paths`` and keep one run per (regime, seed).

    When two runs share a regime and seed, a complete run is preferred over an
    incomplete one and, among equals, the later ``start_time``. Returns the kept
    runs and human-readable notes about what was dropped or looks suspicious.
    """
    runs = [load_run(p) for p in find_run_dirs(paths)]
    notes: list[str] = []
    chosen: dict[tuple[str, int], Run] = {}
    kept: list[Run] = []
    for run in runs:
        if run.seed is None:
            kept.append(run)
            notes.append(f"`{run.name}` records no seed; it is left out of the paired differences.")
            continue
        key = (run.policy, run.seed)
        other = chosen.get(key)
        if other is None or _preference(run) > _preference(other):
            chosen[key] = run
        dropped = other if chosen[key] is run else run
        if other is not None:
            notes.append(
                f"`{dropped.name}` repeats {display_name(run.policy)} seed {run.seed}; "
                f"`{chosen[key].name}` is used instead."
            )
    kept.extend(chosen.values())
    kept.sort(key=lambda r: (regime_sort_key(r.policy), r.seed if r.seed is not None else -1))
    return kept, notes


def group_by_regime(runs: Iterable[Run]) -> dict[str, list[Run]]:
    """Runs grouped by regime (by regime and budget for budget-driven regimes), in paper order."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.policy, []).append(run)
    return {r: groups[r] for r in sorted(groups, key=regime_sort_key)}
