"""``aah experiment SUITE.yaml [--seeds 0 1 2] [--rows NAME ...] [--out DIR] [--records DIR] [--jobs N] [key=value ...]``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..cli_flags import add_output
from ..config import ConfigError
from ..errors import CLIError
from ..report import main_table_text, write_report
from .suite import INTERRUPTED, load_suite, run_suite


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "experiment",
        help="run every (regime, seed) of a suite, evaluate each, and write the report",
        description=(
            "Runs a suite from configs/suites/, skipping runs already complete and resuming "
            "interrupted ones, then writes OUT/report/report.md with tables and figures."
        ),
    )
    p.add_argument("suite", metavar="SUITE.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides applied to every run")
    p.add_argument("--seeds", type=int, nargs="+", default=None, help="seeds (default: the suite's)")
    p.add_argument("--rows", nargs="+", metavar="NAME", default=None,
                   help="run only these rows of the suite's regimes (default: all); the report covers every finished run of the seeds")
    add_output(p, "--out", folder=True, metavar="DIR", default=None, help="output folder (default: runs/<suite name>)")
    add_output(p, "--records", folder=True, metavar="DIR", default=None,
               help="keep each finished run's config, meta, metrics and eval (no checkpoints) with a "
                    "checksum manifest in DIR/<row>/seed<k>, and take recorded runs of the same config "
                    "that verify as finished")
    p.add_argument("--jobs", type=int, default=1, help="runs at a time (default 1)")
    p.set_defaults(func=_run)


def run_experiment(suite_path: str, out: str | None, seeds, jobs: int, overrides=(), rows=None,
                   records: str | None = None) -> int:
    """Run a suite and write its report. A bad suite, override, seed or output folder raises
    :class:`CLIError` before any run starts; runs that fail are listed and give exit status 1."""
    if jobs < 1:
        raise CLIError(f"--jobs must be >= 1, got {jobs}")
    if seeds is not None and any(s < 0 for s in seeds):
        raise CLIError(f"--seeds must be >= 0, got {list(seeds)}")
    try:
        suite = load_suite(suite_path)
        out_dir = Path(out) if out else Path("runs") / suite.name
        for flag, folder in (("--out", out_dir), ("--records", Path(records) if records else None)):
            if folder is not None and folder.exists() and not folder.is_dir():
                raise ConfigError(f"{flag}: {folder} is a file, not a folder")
        specs, failures = run_suite(
            suite, out_dir, seeds=tuple(seeds) if seeds else None, jobs=jobs, extra_overrides=tuple(overrides),
            rows=tuple(rows) if rows else None, records=records,
        )
    except ConfigError as exc:
        raise CLIError(str(exc)) from None
    stopped = [f for f in failures if f[1] == INTERRUPTED]
    for spec, code, detail in failures:
        if code != INTERRUPTED:
            print(f"run {spec.name} failed (exit {code}): {detail}", file=sys.stderr)
    if stopped:
        print(f"aah experiment: stopped; {len(stopped)} runs left ("
              + ", ".join(f"{spec.name}: {detail}" for spec, _, detail in stopped)
              + "); run the same command again to resume them", file=sys.stderr)
    done = [s.run_dir for s in specs if (s.run_dir / "meta.json").is_file()]
    if not done:
        print("aah experiment: no run produced results", file=sys.stderr)
        return INTERRUPTED if stopped else 1
    report = write_report(done, out_dir / "report")
    print(main_table_text(done))
    print(f"\nreport: {report}")
    print(f"figures: {report.parent}/*.png")
    if stopped:
        return INTERRUPTED
    return 1 if failures else 0


def _run(args: argparse.Namespace) -> int:
    return run_experiment(args.suite, args.out, args.seeds, args.jobs, args.overrides, args.rows, args.records)
