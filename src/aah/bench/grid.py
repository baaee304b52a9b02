"""``aah bench grid``: attention and training-step ratios over a grid of shapes, one table.

For every cell (sequence length ``T``, head dim ``D``, batch ``B``, window mix)
it runs :func:`aah.bench.attention.bench_attention` forward and
forward+backward (every exact windowed backend against full causal SDPA,
interleaved) and, for the head dims named by ``--train-head-dims``,
:func:`aah.bench.train.bench_train` with ``d_model = heads x D``.

Each row also gives its limit, what skipping work outside the windows can buy
at best:

* attention: the time ratio of an ideal kernel is the causal coverage;
* training: ``attention share x causal coverage + (1 - attention share)``,
  where the attention share is the full model's attention time (``layers`` x
  the SDPA forward+backward time of the attention benchmark at the same shape)
  over its step time; ``speedup_limit`` is the inverse.

The JSON file is rewritten after every cell (a crash loses nothing) and the
markdown table next to it; progress goes to stderr. With ``resume`` (``--resume``)
the cells already in that file are kept and only the missing ones run, so a
long grid can be stopped and continued (the settings must be the same).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from ..cli_flags import add_output
from ..errors import CLIError
from .attention import MIXES, bench_attention
from .train import bench_train

__all__ = ["DEFAULT_BATCH", "add_command", "format_markdown", "run_grid"]

SEQ_LENS = (512, 1024, 2048, 4096)
HEAD_DIMS = (32, 64, 128)
# Batch per length when none is given: 4096 tokens per call.
DEFAULT_BATCH = {512: 8, 1024: 4, 2048: 2, 4096: 1}
GRID_BACKENDS = ("strips", "banded", "auto")


def _cell_batches(seq_len: int, batches: tuple[int, ...] | None) -> tuple[int, ...]:
    if batches:
        return batches
    return (DEFAULT_BATCH.get(seq_len, max(1, 4096 // seq_len)),)


def _attention_row(result: dict) -> dict:
    rows = {r["backend"]: r for r in result["results"]}
    return {
        "sdpa_ms": rows["sdpa"]["median_ms"],
        "ratio": {n: r["ratio_to_sdpa"] for n, r in rows.items() if n != "sdpa"},
        "executed_coverage": {n: r["executed_coverage"] for n, r in rows.items() if n != "sdpa"},
    }


def run_grid(
    *,
    seq_lens: tuple[int, ...] = SEQ_LENS,
    head_dims: tuple[int, ...] = HEAD_DIMS,
    batches: tuple[int, ...] | None = None,
    mixes: tuple[str, ...] = tuple(MIXES),
    heads: int = 8,
    layers: int = 4,
    backends: tuple[str, ...] = GRID_BACKENDS,
    train_head_dims: tuple[int, ...] = (32,),
    repeats: int = 5,
    train_repeats: int = 6,
    out_json: str | Path = "bench_grid.json",
    out_md: str | Path | None = None,
    device: str = "cpu",
    resume: bool = False,
    log=None,
) -> dict:
    """Run the grid; returns the JSON-ready result, also written to ``out_json`` cell by cell.

    ``resume`` keeps the rows of an existing ``out_json`` written with the same
    settings and runs only the cells it lacks (``ValueError`` when the settings differ);
    its rows for cells this grid does not name stay in the file, after this grid's.
    """
    for mix in mixes:
        if mix not in MIXES:
            raise ValueError(f"--mixes: unknown mix {mix!r}; choose from {', '.join(MIXES)}")
    for name, values in (("--seq-lens", seq_lens), ("--head-dims", head_dims), ("--batches", batches or (1,))):
        if not values or any(v <= 0 for v in values):
            raise ValueError(f"{name} must be positive integers, got {list(values)}")
    out_json = Path(out_json)
    out_md = Path(out_md) if out_md else out_json.with_suffix(".md")
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    cells = [
        (t, d, b, mix)
        for t in seq_lens for d in head_dims for b in _cell_batches(t, batches) for mix in mixes
    ]
    result = {
        "config": {"heads": heads, "layers": layers, "backends": list(backends), "repeats": repeats,
                   "train_repeats": train_repeats, "train_head_dims": list(train_head_dims),
                   "device": device},
        "rows": [],
    }
    done, earlier_s = _earlier_rows(out_json, result["config"]) if resume else ({}, 0.0)
    # Cells of the earlier file that this grid does not name are kept after its own.
    planned = set(cells)
    others = [row for key, row in done.items() if key not in planned]
    if others:
        log(f"keeping {len(others)} other cells of {out_json}")
    started = time.perf_counter()
    for index, (t, d, b, mix) in enumerate(cells, 1):
        cell = f"[{index}/{len(cells)}] T={t} D={d} B={b} mix={mix}"
        row = done.get((t, d, b, mix))
        if row is None:
            log(f"{cell} ({time.perf_counter() - started:.0f} s so far)")
            row = _measure_cell(t, d, b, mix, heads=heads, layers=layers, backends=backends,
                                train=d in train_head_dims, repeats=repeats, train_repeats=train_repeats,
                                device=device)
        else:
            log(f"{cell}: kept from {out_json}")
        result["rows"].append(row)
        result["elapsed_s"] = earlier_s + time.perf_counter() - started
        on_disk = {**result, "rows": result["rows"] + others}
        _write_atomic(out_json, json.dumps(on_disk, indent=1))
        _write_atomic(out_md, format_markdown(on_disk))
    result["rows"] += others
    log(f"done: {len(cells)} cells in {time.perf_counter() - started:.0f} s; wrote {out_json} and {out_md}")
    return result


def _measure_cell(
    t: int, d: int, b: int, mix: str, *, heads: int, layers: int, backends: tuple[str, ...], train: bool,
    repeats: int, train_repeats: int, device: str,
) -> dict:
    """One row of the grid: attention forward and forward + backward, and the training step if ``train``."""
    common = dict(seq_len=t, heads=heads, head_dim=d, batch=b, mix=mix, backends=list(backends),
                  repeats=repeats, warmup=1, device=device)
    fwd = bench_attention(backward=False, **common)
    bwd = bench_attention(backward=True, **common)
    row = {
        "seq_len": t, "head_dim": d, "batch": b, "mix": mix, "windows": fwd["config"]["windows"],
        "causal_coverage": fwd["config"]["causal_coverage"],
        "forward": _attention_row(fwd), "forward_backward": _attention_row(bwd), "train": None,
    }
    if train:
        tr = bench_train(seq_len=t, layers=layers, d_model=heads * d, heads=heads, batch=b, mix=mix,
                         repeats=train_repeats, device=device, regime=None)
        share = min(1.0, layers * row["forward_backward"]["sdpa_ms"] / tr["full_step_ms"])
        limit_ratio = 1.0 - share * (1.0 - row["causal_coverage"])
        row["train"] = {
            "speedup": tr["speedup"], "full_step_ms": tr["full_step_ms"], "aah_step_ms": tr["aah_step_ms"],
            "backend_aah": tr["backend_aah"], "attention_share": share,
            "step_ratio_limit": limit_ratio, "speedup_limit": 1.0 / limit_ratio,
        }
    return row


def _cell_key(row: dict) -> tuple:
    return (row["seq_len"], row["head_dim"], row["batch"], row["mix"])


def _earlier_rows(path: Path, config: dict) -> tuple[dict, float]:
    """Rows of an earlier run of the same grid at ``path``, by cell, and its elapsed seconds."""
    if not path.exists():
        return {}, 0.0
    try:
        earlier = json.loads(path.read_text())
        earlier_config, rows = earlier["config"], earlier["rows"]
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"--resume: {path} is not a grid JSON file") from None
    changed = sorted(k for k in set(config) | set(earlier_config) if config.get(k) != earlier_config.get(k))
    if changed:
        raise ValueError(
            f"--resume: {path} was written with other settings ({', '.join(changed)}); "
            "use the same options or another --out"
        )
    return {_cell_key(row): row for row in rows}, float(earlier.get("elapsed_s", 0.0))


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def _ratio(row: dict, part: str, backend: str) -> str:
    value = row[part]["ratio"].get(backend)
    return "-" if value is None else f"{value:.2f}"


def format_markdown(result: dict) -> str:
    """The grid as one markdown table (ratios are time over causal SDPA; lower is faster)."""
    backends = result["config"]["backends"]
    cols = (["T", "D", "B", "mix", "causal cov. (attn limit)"]
            + [f"fwd {b}" for b in backends] + [f"fwd+bwd {b}" for b in backends]
            + ["train speedup", "attn share", "train limit"])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for row in result["rows"]:
        tr = row["train"]
        cells = [str(row["seq_len"]), str(row["head_dim"]), str(row["batch"]), row["mix"],
                 f"{row['causal_coverage']:.3f}"]
        cells += [_ratio(row, "forward", b) for b in backends]
        cells += [_ratio(row, "forward_backward", b) for b in backends]
        if tr is None:
            cells += ["-", "-", "-"]
        else:
            cells += [f"{tr['speedup']:.2f}", f"{tr['attention_share']:.2f}", f"{tr['speedup_limit']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "fwd / fwd+bwd: attention time over full causal SDPA at the same shape (lower is faster; an "
        "ideal kernel reaches the causal coverage). train speedup: AAH tokens/s over full attention "
        "(`aah bench train`, windows pinned to the mix). train limit: 1 / (attn share x causal "
        "coverage + 1 - attn share), the best speedup skipping work can give.",
    ]
    return "\n".join(lines) + "\n"


def _ints(text: str, option: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise CLIError(f"grid: {option} must be comma-separated integers, got {text!r}") from None
    if not values or any(v <= 0 for v in values):
        raise CLIError(f"grid: {option} must be positive integers, got {text!r}")
    return values


def add_command(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "grid", help="attention and training-step ratios vs full attention over a grid of shapes",
        description="Runs `aah bench attention` (forward and forward+backward) and `aah bench train` "
                    "over sequence lengths, head dims, batches and window mixes; writes one JSON file "
                    "(rewritten after every cell) and a markdown table.",
    )
    p.add_argument("--seq-lens", default=",".join(map(str, SEQ_LENS)), help="default 512,1024,2048,4096")
    p.add_argument("--head-dims", default=",".join(map(str, HEAD_DIMS)), help="default 32,64,128")
    p.add_argument("--batches", default=None,
                   help="batch sizes for every length (default one per length: "
                        + ", ".join(f"{b} at T={t}" for t, b in DEFAULT_BATCH.items()) + ")")
    p.add_argument("--mixes", default=",".join(MIXES), help="default: every mix")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=4, help="layers of the training-step model (default 4)")
    p.add_argument("--backends", default=",".join(GRID_BACKENDS), help="default strips,banded,auto")
    p.add_argument("--train-head-dims", default="32",
                   help="head dims that also run `bench train` with d_model = heads x D "
                        "(default 32, the CPU config; 'none' for attention only)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per attention call (default 5)")
    p.add_argument("--train-repeats", type=int, default=6, help="timed rounds per training step (default 6)")
    add_output(p, "--out", suffixes=(".json",), default="bench_grid.json", help="JSON output (default bench_grid.json; the "
                   "markdown table goes next to it with suffix .md)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--resume", action="store_true",
                   help="keep the cells already in --out (same settings) and run only the missing ones")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    mixes = tuple(m.strip() for m in args.mixes.split(",") if m.strip())
    backends = tuple(b.strip() for b in args.backends.split(",") if b.strip())
    train_dims = () if args.train_head_dims.strip().lower() == "none" else _ints(args.train_head_dims, "--train-head-dims")
    try:
        result = run_grid(
            seq_lens=_ints(args.seq_lens, "--seq-lens"), head_dims=_ints(args.head_dims, "--head-dims"),
            batches=_ints(args.batches, "--batches") if args.batches else None, mixes=mixes,
            heads=args.heads, layers=args.layers, backends=backends, train_head_dims=train_dims,
            repeats=args.repeats, train_repeats=args.train_repeats, out_json=args.out, device=args.device,
            resume=args.resume,
        )
    except ValueError as exc:
        raise CLIError(f"grid: {exc}") from None
    print(format_markdown(result))
    return 0
