"""``aah eval RUN_DIR [--checkpoint STEP] [--corpus NAME]``."""

from __future__ import annotations

import argparse
import sys

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
        print(f"aah eval: --batches must be >= 1, got {args.batches}", file=sys.stderr)
        return 2
    try:
        result = evaluate_run(
            args.run_dir, checkpoint=args.checkpoint, corpus=args.corpus, device=args.device,
            max_batches=args.batches,
        )
    except (FileNotFoundError, ValueError, RuntimeError) as exc:
        print(f"aah eval: {exc}", file=sys.stderr)
        return 2
    print_summary(result)
    print(f"wrote {result['path']}")
    return 0
