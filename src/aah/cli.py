"""The ``aah`` command line: one sub-command per job, each defined next to the code it drives."""

from __future__ import annotations

import argparse
import importlib
import sys

from .cli_flags import FlagError
from .errors import EXIT_USAGE, CLIError

# Each module defines ``add_commands(subparsers)``; a sub-command sets ``func`` on its parser.
COMMAND_MODULES = (
    "aah.demo",
    "aah.bench.cli",
    "aah.train.cli",
    "aah.evaluate.cli",
    "aah.experiment.cli",
    "aah.report.cli",
    "aah.decode.cli",
    "aah.hf.cli",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aah", description="Asymmetric Attention Heads: train, evaluate, benchmark, report."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).add_commands(sub)
    return parser


def one_line(message: str) -> str:
    """A message on one line: its lines (a YAML parser's, say) joined with spaces."""
    return " ".join(line.strip() for line in message.splitlines() if line.strip())


def _is_override(text: str) -> bool:
    """Whether ``text`` reads as a ``section.key=value`` override (not an option)."""
    return "=" in text and not text.startswith("-")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
        if extra and isinstance(getattr(args, "overrides", None), list) and all(_is_override(e) for e in extra):
            args.overrides += extra  # KEY=VALUE overrides may follow options too
        elif extra:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    except FlagError as exc:  # a shared flag's bad value (aah.cli_flags)
        print(f"{exc.prog}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        result = args.func(args)
    except CLIError as exc:
        print(f"aah {args.command}: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
