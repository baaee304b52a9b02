"""``aah demo``: the quick AAH-vs-full-attention comparison on the bundled Shakespeare corpus.

Runs the ``quick`` suite (the paper's five principal regimes at a size that
finishes in minutes on a laptop CPU), evaluates every run, and prints the
report's main table and where the figures are.
"""

from __future__ import annotations

from pathlib import Path

from .cli_flags import add_output
from .experiment.cli import run_experiment

DEFAULT_SUITE = Path("configs/suites/cpu/quick.yaml")


def add_commands(subparsers) -> None:
    p = subparsers.add_parser("demo", help="run the quick suite on Shakespeare and print the report's table")
    p.add_argument("--suite", default=str(DEFAULT_SUITE), help=f"suite file (default {DEFAULT_SUITE})")
    add_output(p, "--out", folder=True, default="runs/demo", help="output folder (default runs/demo)")
    p.set_defaults(func=lambda args: run_experiment(args.suite, args.out, None, 1))
