"""``aah report RUN_DIR... [--out DIR]``: write the experiment report and print its main table.

Each ``RUN_DIR`` is a run folder (it holds ``meta.json``) or a folder searched
recursively for run folders. The report (paper Tables 4-6, Figures 3-4) goes
to ``--out`` (default ``report``). Runs that have not completed are listed
but left out of the tables and figures while another run has completed
(``--include-unfinished`` keeps them).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..cli_flags import add_output
from ..errors import CLIError
from . import finished_runs, write_report
from .runs import find_run_dirs, load_runs
from .tables import training_table

__all__ = ["add_commands", "run_report"]


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` sub-command to the ``aah`` command line."""
    parser = subparsers.add_parser(
        "report",
        help="tables, CSVs and figures from run folders",
        description="Write report.md, CSV tables and PNG figures for a set of runs and print "
        "the training table. RUN_DIR may be a run folder or a folder holding run folders.",
    )
    parser.add_argument("run_dirs", nargs="+", type=Path, metavar="RUN_DIR")
    add_output(parser, "--out", folder=True, default="report", metavar="DIR", help="output folder (default: ./report)")
    parser.add_argument("--include-unfinished", action="store_true",
                        help="average runs that have not completed into the tables and figures too "
                        "(by default they are listed but left out while another run has completed)")
    parser.set_defaults(func=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Entry point of ``aah report``; returns the process exit status (CLIError: exit 2)."""
    try:
        run_dirs = find_run_dirs(args.run_dirs)
    except FileNotFoundError as exc:
        raise CLIError(str(exc)) from None
    if not run_dirs:
        names = " ".join(str(p) for p in args.run_dirs)
        raise CLIError(f"no run folders found in {names} "
                       "(a run folder holds meta.json, written when training starts)")
    every_run, _ = load_runs(run_dirs)
    runs, left_out = finished_runs(every_run, args.include_unfinished)
    print(training_table(runs).to_markdown())
    try:
        path = write_report(run_dirs, Path(args.out), args.include_unfinished)
    except PermissionError as exc:
        raise CLIError(f"cannot write the report to {args.out}: {exc}") from None
    counted = f"{len(runs)} of {len(every_run)} run(s) in the tables" if left_out else f"{len(runs)} run(s)"
    print(f"\n{counted}; report written to {path}")
    return 0
