"""The report's figures (PNG, matplotlib's Agg renderer), after the paper's Figures 3 and 4.

* ``val_loss.png``: validation loss over optimizer steps for every regime
  (mean over seeds, a band of +/- one sample sd where there are several), with
  a late-training zoom panel on a linear axis (paper Figure 3, top panel);
* ``acr.png`` and ``levels_used.png``: ACR and hierarchy levels used over
  training (paper Figure 3, lower panels);
* ``window_buckets.png``: the aggregate window-bucket heatmap, regime x
  window, cells annotated with percentages of final (layer, head) assignments
  (paper Figure 4). Full attention is left out, as in the paper;
* ``coverage_vs_loss.png``: validation loss (mean and 95% interval over seeds)
  against causal coverage, one point per regime (per regime and budget for the
  budgeted policies), measured training tokens/s in the labels;
* ``lost_mass.png``: per layer, the attention mass beyond each head's window
  (``lost_mass_chosen_per_layer``) over training;
* ``windows_<regime>.png``: the per-layer x per-head window map of each
  regime's final checkpoint (the run with the smallest seed that has windows), from
  ``eval.json`` or, failing that, the last training line that logged windows.

Curves are drawn straight between logged points (no smoothing). Figures are
built with :class:`matplotlib.figure.Figure` directly, so no global pyplot
state is touched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .runs import FULL_ATTENTION, Run, display_name
from .stats import bucket_sort_key, mean_fractions

__all__ = [
    "FigureResult",
    "bucket_matrix",
    "coverage_points",
    "layer_curve",
    "mean_curve",
    "palette_color",
    "plot_bucket_heatmap",
    "plot_coverage_vs_loss",
    "plot_lost_mass",
    "plot_train_metric",
    "plot_val_loss",
    "plot_window_map",
    "save_png",
    "write_figures",
]

ZOOM_FRACTION = 0.3  # the zoom panel shows the last 30% of the logged steps
_MAX_ANNOTATED_CELLS = 400  # window maps larger than this are not annotated cell by cell


@dataclass
class FigureResult:
    """A written figure (``path`` set) or a skipped one (``note`` says why)."""

    title: str
    path: Path | None = None
    note: str | None = None


def palette_color(index: int) -> tuple[float, float, float, float]:
    """The ``index``-th colour of the report's palette (tab10, repeating after ten): one per policy."""
    from matplotlib import colormaps

    return colormaps["tab10"](index % 10)


def save_png(fig: Figure, path: Path) -> Path:
    """Draw ``fig`` off screen and write it to ``path`` as a PNG (120 dpi); returns ``path``."""
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120, format="png")
    return path


def mean_curve(runs: Sequence[Run], kind: str, key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Steps, mean over runs and sample sd (``nan`` where one run) of ``key`` on ``kind`` lines.

    Each step present in any run is kept; the mean at a step is over the runs that logged it.
    """
    per_step: dict[int, list[float]] = {}
    for run in runs:
        for step, value in run.series(kind, key):
            per_step.setdefault(step, []).append(value)
    steps = np.array(sorted(per_step), dtype=float)
    means = np.array([np.mean(per_step[int(s)]) for s in steps])
    sds = np.array([np.std(per_step[int(s)], ddof=1) if len(per_step[int(s)]) > 1 else np.nan
                    for s in steps])
    return steps, means, sds


def _draw_curves(ax, groups: dict[str, list[Run]], colors: dict[str, tuple], kind: str,
                 key: str, marker: str | None = None) -> bool:
    drawn = False
    for regime, runs in groups.items():
        steps, means, sds = mean_curve(runs, kind, key)
        if steps.size == 0:
            continue
        ax.plot(steps, means, color=colors[regime], marker=marker, markersize=3,
                label=f"{display_name(regime)} (n={len(runs)})")
        if np.isfinite(sds).any():
            ax.fill_between(steps, means - np.nan_to_num(sds), means + np.nan_to_num(sds),
                            color=colors[regime], alpha=0.15, linewidth=0)
        drawn = True
    return drawn


def _zoom_limits(groups: dict[str, list[Run]]) -> tuple[tuple[float, float], tuple[float, float]] | None:
    points = [(s, v) for runs in groups.values() for r in runs for s, v in r.series("eval", "val_loss")]
    if not points:
        return None
    last = max(s for s, _ in points)
    start = last * (1 - ZOOM_FRACTION)
    late = [v for s, v in points if s >= start]
    low, high = min(late), max(late)
    pad = max((high - low) * 0.08, 1e-3)
    return (start - 0.02 * last, last * 1.02 + 1), (low - pad, high + pad)


def plot_val_loss(groups: dict[str, list[Run]], colors: dict[str, tuple], path: Path) -> FigureResult:
    """Validation loss over training with a late-training zoom panel (paper Figure 3)."""
    title = "Validation loss over training"
    fig = Figure(figsize=(12, 4.5))
    full_ax, zoom_ax = fig.subplots(1, 2)
    if not _draw_curves(full_ax, groups, colors, "eval", "val_loss", marker="o"):
        return FigureResult(title, note="no validation lines were logged")
    _draw_curves(zoom_ax, groups, colors, "eval", "val_loss", marker="o")
    limits = _zoom_limits(groups)
    if limits:
        zoom_ax.set_xlim(*limits[0])
        zoom_ax.set_ylim(*limits[1])
    full_ax.set_title("Validation loss")
    zoom_ax.set_title(f"Validation loss (last {round(ZOOM_FRACTION * 100)}% of steps)")
    for ax in (full_ax, zoom_ax):
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("val. loss")
        ax.grid(alpha=0.3)
    zoom_ax.legend(fontsize=8)
    fig.tight_layout()
    return FigureResult(title, path=save_png(fig, path))


def plot_train_metric(groups: dict[str, list[Run]], colors: dict[str, tuple], key: str,
                      label: str, path: Path) -> FigureResult:
    """One training-line metric over steps, mean over seeds per regime (paper Figure 3)."""
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    if not _draw_curves(ax, groups, colors, "train", key):
        return FigureResult(label, note=f"no training line logged `{key}`")
    ax.set_title(f"{label} over training")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return FigureResult(f"{label} over training", path=save_png(fig, path))


def bucket_matrix(groups: dict[str, list[Run]]) -> tuple[list[str], list[str], np.ndarray, dict[str, str]]:
    """Regimes (rows), bucket keys (columns), mean fractions and each regime's data source.

    Full attention is left out. A regime's fractions are averaged over its runs that have them.
    """
    per_regime: dict[str, dict[str, float]] = {}
    sources: dict[str, str] = {}
    for regime, runs in groups.items():
        if regime == FULL_ATTENTION:
            continue
        found = [f for f in (r.final_bucket_fractions() for r in runs) if f is not None]
        if found:
            per_regime[regime] = mean_fractions([f for _, f in found])
            sources[regime] = ", ".join(sorted({s for s, _ in found}))
    keys = sorted({k for f in per_regime.values() for k in f}, key=bucket_sort_key)
    matrix = np.array([[per_regime[r].get(k, 0.0) for k in keys] for r in per_regime])
    return list(per_regime), keys, matrix, sources


def plot_bucket_heatmap(groups: dict[str, list[Run]], path: Path) -> FigureResult:
    """Aggregate window-bucket heatmap, regime x window, in percent (paper Figure 4)."""
    title = "Final selected-window distribution"
    regimes, keys, matrix, _ = bucket_matrix(groups)
    if not regimes:
        return FigureResult(title, note="no run logged window-bucket fractions or windows")
    fig = Figure(figsize=(1.6 * len(keys) + 3.5, 0.6 * len(regimes) + 1.8))
    ax = fig.subplots()
    image = ax.imshow(matrix * 100, cmap="inferno", vmin=0, vmax=max(1e-9, matrix.max() * 100),
                      aspect="auto")
    for i in range(len(regimes)):
        for j in range(len(keys)):
            value = matrix[i, j] * 100
            ax.text(j, i, f"{value:.1f}%", ha="center", va="center", fontsize=9,
                    color="black" if value > matrix.max() * 60 else "white")
    ax.set_xticks(range(len(keys)), keys)
    ax.set_yticks(range(len(regimes)), [display_name(r) for r in regimes])
    ax.set_xlabel("selected window")
    ax.set_ylabel("regime")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, label="% of final (layer, head) assignments")
    fig.tight_layout()
    return FigureResult(title, path=save_png(fig, path))


def plot_window_map(run: Run, path: Path) -> FigureResult:
    """Per-layer x per-head windows of ``run``'s final checkpoint, colour on a log2 scale."""
    seed = f" (seed {run.seed})" if run.seed is not None else ""
    title = f"{display_name(run.policy)}{seed}: final window per layer and head"
    found = run.final_windows()
    if found is None:
        return FigureResult(title, note=f"`{run.name}` recorded no per-head windows")
    source, grid = found
    windows = np.array(grid if isinstance(grid[0], list) else [grid], dtype=float)
    layers, heads = windows.shape
    fig = Figure(figsize=(min(max(6.5, 2.5 + 0.5 * heads), 16), min(max(3.0, 1.8 + 0.35 * layers), 14)))
    ax = fig.subplots()
    ticks = sorted(set(run.candidate_windows) | {int(w) for w in windows.ravel()})
    logs = np.log2(windows)
    image = ax.imshow(logs, cmap="viridis", aspect="auto", vmin=math.log2(ticks[0]),
                      vmax=max(math.log2(ticks[-1]), math.log2(ticks[0]) + 1e-9))
    if windows.size <= _MAX_ANNOTATED_CELLS:
        mid = (math.log2(ticks[0]) + math.log2(ticks[-1])) / 2
        for (i, j), w in np.ndenumerate(windows):
            ax.text(j, i, str(int(w)), ha="center", va="center", fontsize=7,
                    color="white" if logs[i, j] < mid else "black")
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.set_xticks(range(heads))
    ax.set_yticks(range(layers))
    ax.set_title(f"{title}\nsource: {source}", fontsize=10)
    bar = fig.colorbar(image, ax=ax, label="window (keys)")
    bar.set_ticks([math.log2(t) for t in ticks], labels=[str(t) for t in ticks])
    fig.tight_layout()
    return FigureResult(title, path=save_png(fig, path))


def write_figures(groups: dict[str, list[Run]], out_dir: Path) -> list[FigureResult]:
    """Write every figure of the report into ``out_dir``; skipped ones carry a note."""
    out_dir = Path(out_dir)
    colors = {regime: palette_color(i) for i, regime in enumerate(groups)}
    results = [
        plot_val_loss(groups, colors, out_dir / "val_loss.png"),
        plot_train_metric(groups, colors, "acr", "ACR", out_dir / "acr.png"),
        plot_train_metric(groups, colors, "levels_used", "Hierarchy levels used",
                          out_dir / "levels_used.png"),
        plot_bucket_heatmap(groups, out_dir / "window_buckets.png"),
        plot_coverage_vs_loss(groups, colors, out_dir / "coverage_vs_loss.png"),
        plot_lost_mass(groups, colors, out_dir / "lost_mass.png"),
    ]
    for regime, runs in groups.items():
        with_windows = [r for r in runs if r.final_windows() is not None] or runs
        run = min(with_windows, key=lambda r: (r.seed is None, r.seed or 0))
        results.append(plot_window_map(run, out_dir / f"windows_{_safe(regime)}.png"))
    return results


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)


# --- window policies at a coverage budget ------------------------------------------------------
def _mean_ci(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95% Student-t interval (``None`` with one value)."""
    from .stats import t_quantile_975

    m = float(np.mean(values))
    if len(values) < 2:
        return m, None
    return m, t_quantile_975(len(values) - 1) * float(np.std(values, ddof=1)) / math.sqrt(len(values))


def coverage_points(groups: dict[str, list[Run]]) -> list[dict]:
    """Per group: mean causal coverage, val loss mean and 95% CI half-width, train tokens/s."""
    points = []
    for regime, runs in groups.items():
        covs = [c for c in (r.final_coverage() for r in runs) if c is not None]
        losses = [v for v in (r.policy_val_loss() for r in runs) if v is not None]
        if not covs or not losses:
            continue
        tps = [t for t in (r.train_tokens_per_s() for r in runs) if t is not None]
        loss, half = _mean_ci(losses)
        points.append({
            "group": regime, "coverage": float(np.mean(covs)), "val_loss": loss, "ci_half_width": half,
            "n": len(losses), "tokens_per_s": float(np.mean(tps)) if tps else None,
        })
    return points


def plot_coverage_vs_loss(groups: dict[str, list[Run]], colors: dict[str, tuple], path: Path) -> FigureResult:
    """Validation loss (mean, 95% CI over seeds) against causal coverage, one point per group."""
    title = "Validation loss against causal coverage"
    points = coverage_points(groups)
    if not points:
        return FigureResult(title, note="no run has both a validation loss and a causal coverage")
    fig = Figure(figsize=(8, 5))
    ax = fig.subplots()
    for p in points:
        tps = "tok/s n/a" if p["tokens_per_s"] is None else f"{p['tokens_per_s']:.0f} tok/s"
        label = f"{display_name(p['group'])} (n={p['n']}, {tps})"
        ax.errorbar([p["coverage"]], [p["val_loss"]],
                    yerr=None if p["ci_half_width"] is None else [[p["ci_half_width"]], [p["ci_half_width"]]],
                    fmt="o", capsize=4, color=colors[p["group"]], label=label)
    ax.set_xlabel("causal coverage (allowed pairs / causal triangle)")
    ax.set_ylabel("val. loss (mean, 95% CI over seeds)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return FigureResult(title, path=save_png(fig, path))


def layer_curve(runs: Sequence[Run], key: str, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """Steps and the mean over runs of layer ``layer`` of the per-layer list ``key``."""
    per_step: dict[int, list[float]] = {}
    for run in runs:
        for step, values in run.layer_series(key):
            if layer < len(values):
                per_step.setdefault(step, []).append(values[layer])
    steps = np.array(sorted(per_step), dtype=float)
    return steps, np.array([np.mean(per_step[int(s)]) for s in steps])


def plot_lost_mass(groups: dict[str, list[Run]], colors: dict[str, tuple], path: Path) -> FigureResult:
    """Per-layer lost attention mass at the chosen windows over training (mean over seeds)."""
    title = "Lost attention mass per layer"
    key = "lost_mass_chosen_per_layer"
    layers = max((len(v) for runs in groups.values() for r in runs for _, v in r.layer_series(key)), default=0)
    if layers == 0:
        return FigureResult(title, note=f"no training line logged `{key}`")
    cols = min(layers, 4)
    rows = math.ceil(layers / cols)
    fig = Figure(figsize=(4 * cols, 3.2 * rows))
    axes = np.atleast_1d(fig.subplots(rows, cols, squeeze=False)).ravel()
    for layer in range(layers):
        ax = axes[layer]
        for regime, runs in groups.items():
            steps, means = layer_curve(runs, key, layer)
            if steps.size:
                ax.plot(steps, means, color=colors[regime], label=display_name(regime))
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("lost mass (mean over heads)")
        ax.grid(alpha=0.3)
    for ax in axes[layers:]:
        ax.set_visible(False)
    axes[0].legend(fontsize=7)
    fig.suptitle("Attention mass beyond each head's window (sampled queries, EMA over control updates)")
    fig.tight_layout()
    return FigureResult(title, path=save_png(fig, path))
