"""``aah train CONFIG [key=value ...] [--out DIR]`` and ``aah train --resume RUN_DIR``."""

from __future__ import annotations

import argparse
import sys
from datetime import datetime
from pathlib import Path

from ..cli_flags import add_output
from ..config import ConfigError, RunConfig, load_config
from ..errors import CLIError
from .checkpoint import CheckpointError
from .trainer import TrainingStopped, train


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "train",
        help="train a model (one regime, one seed) into a run folder",
        description=(
            "Train from a YAML config with optional section.key=value overrides, "
            "e.g. aah train configs/cpu/shallow_freeze.yaml train.max_steps=50 --out runs/sf. "
            "Resume an interrupted run with aah train --resume RUN_DIR."
        ),
    )
    p.add_argument("config", nargs="?", metavar="CONFIG", help="YAML config file")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="overrides such as train.max_steps=50")
    add_output(p, "--out", folder=True, metavar="DIR", help="run folder (default: <train.out_dir>/<regime>-seed<seed>-<time>)")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue RUN_DIR from its latest checkpoint")
    p.add_argument(
        "--trust-pickled-state", action="store_true",
        help="with --resume: read a training state that an older version pickled (train_state.pt); "
        "unpickling runs any code the file holds, so only for run folders you trust",
    )
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    """Expected failures (config, missing corpus or package, bad checkpoints) become
    :class:`CLIError`: one line, exit status 2. A run stopped by a non-finite loss or a failed
    checkpoint write exits with status 1, an interrupted one with 130."""
    try:
        cfg, run_dir = _config_and_run_dir(args)
        result = train(cfg, run_dir, resume=bool(args.resume), trust_pickled_state=args.trust_pickled_state)
    except TrainingStopped as exc:
        print(f"aah train: {exc}", file=sys.stderr)
        return 1
    except (ConfigError, CheckpointError, FileNotFoundError, ImportError) as exc:
        # ImportError: a missing optional package (tokenizers), named in the message.
        raise CLIError(str(exc)) from None
    print(f"{result.status} at step {result.step}; run folder: {result.run_dir}")
    return 0 if result.status == "complete" else 130


def _config_and_run_dir(args: argparse.Namespace) -> tuple[RunConfig, Path]:
    if args.trust_pickled_state and not args.resume:
        raise ConfigError("--trust-pickled-state goes with --resume RUN_DIR")
    if args.resume:
        if args.config or args.overrides:
            raise ConfigError("--resume takes the run folder's own config; give no CONFIG or overrides")
        run_dir = Path(args.resume)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"--resume: {run_dir} is not a run folder (no config.yaml)")
        return load_config(run_dir / "config.yaml"), run_dir
    if args.config is None:
        raise ConfigError("give a CONFIG file (see configs/) or --resume RUN_DIR")
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.out) if args.out else _default_run_dir(cfg)
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--out: {run_dir} is a file, not a folder")
    if (run_dir / "checkpoints").is_dir() and any((run_dir / "checkpoints").iterdir()):
        raise ConfigError(f"--out: {run_dir} already holds checkpoints; use --resume {run_dir} or another folder")
    return cfg, run_dir


def _default_run_dir(cfg) -> Path:
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path(cfg.train.out_dir) / f"{cfg.aah.regime}-seed{cfg.train.seed}-{stamp}"
