"""``aah eval RUN_DIR [--checkpoint STEP] [--corpus NAME]``."""

from __future__ import annotations

import argparse

from ..config import ConfigError
from ..errors import CLIError
from ..train.checkpoint import CheckpointError
from .core import evaluate_run, print_summary


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "eval",
        help="evaluate a run's checkpoint: loss, perplexity, coverage, windows, tokens/s",
        description="Evaluate a checkpoint (default: the latest) of RUN_DIR and write eval.json.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--checkpoint", type=int, default=None, metavar="STEP", help="checkpoint step (default: latest)")
    p.add_argument("--corpus", default=None, help="evaluate on another corpus (written to eval_<corpus>.json)")
    p.add_argument("--device", default=None, choices=("auto", "cpu", "cuda"),
                   help="device (default: the run's train.device)")
    p.add_argument("--batches", type=int, default=None, help="max validation batches (default: eval.batches)")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.batches is not None and args.batches < 1:
        raise CLIError(f"--batches must be >= 1, got {args.batches}")
    if args.checkpoint is not None and args.checkpoint < 1:
        raise CLIError(f"--checkpoint must be a step >= 1, got {args.checkpoint}")
    try:
        result = evaluate_run(
            args.run_dir, checkpoint=args.checkpoint, corpus=args.corpus, device=args.device,
            max_batches=args.batches,
        )
    except (ConfigError, CheckpointError, FileNotFoundError, ImportError) as exc:
        raise CLIError(str(exc)) from None
    print_summary(result)
    print(f"wrote {result['path']}")
    return 0
