"""``aah bench ...``: the benchmark sub-commands.

``aah bench attention`` is defined here (:mod:`aah.bench.attention`); other
benchmarks live in their own modules of :mod:`aah.bench` and add themselves
to the ``bench`` sub-parser through ``add_command(bench_subparsers)``.
"""

from __future__ import annotations

import argparse
import importlib

from ..cli_flags import add_json, add_seq_len, add_sink_tokens, add_windows, write_json
from ..errors import CLIError
from .attention import DTYPES, MIXES, bench_attention, format_table

__all__ = ["add_commands"]

# Further ``aah bench`` sub-commands: modules with ``add_command(bench_subparsers)``.
_EXTRA_COMMANDS = ("aah.bench.train", "aah.bench.grid", "aah.bench.decode", "aah.vllm.bench")


def add_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add ``aah bench`` and its sub-commands to the top-level ``subparsers``."""
    bench = subparsers.add_parser("bench", help="benchmarks: attention backends, training steps")
    bench_sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench.set_defaults(func=lambda args: _print_help(bench))
    _add_attention(bench_sub)
    for name in _EXTRA_COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                continue  # not part of this build
            raise
        module.add_command(bench_sub)


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _add_attention(bench_sub: argparse._SubParsersAction) -> None:
    mixes = ", ".join(f"{name} ({'/'.join(f'{s:g}' for s in shares)} %)" for name, shares in MIXES.items())
    p = bench_sub.add_parser(
        "attention",
        help="time and count every attention backend against full causal SDPA",
        description=(
            "Times one attention call (forward, or forward+backward with --backward) for every "
            "backend and the full-causal sdpa baseline, interleaved in one process (warm-up, "
            "then the median of --repeats rounds in rotating order), and reports time ratios, "
            "ACR, causal and executed coverage and FLOPs counted with FlopCounterMode."
        ),
        epilog=(
            f"Window mixes (share of heads at windows T/8, T/4, T/2, T): {mixes}. Head counts "
            "are rounded by largest remainder."
        ),
    )
    add_seq_len(p)
    p.add_argument("--heads", type=int, default=8, help="query heads H (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    p.add_argument("--head-dim", type=int, default=64, help="head dimension D (default 64)")
    p.add_argument("--batch", type=int, default=1, help="batch size B (default 1)")
    p.add_argument("--dtype", choices=list(DTYPES), default="float32", help="default float32")
    p.add_argument(
        "--backends",
        default=None,
        help="comma-separated backends (default: every backend that can run the request here); "
        "the sdpa baseline always runs",
    )
    p.add_argument("--backward", action="store_true", help="time forward+backward")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed rounds first (default 2)")
    group = p.add_mutually_exclusive_group()
    add_windows(p, into=group)
    group.add_argument("--mix", choices=list(MIXES), default=None, help="a paper window mix (default full_adaptive)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    add_sink_tokens(p)
    add_json(p)
    p.set_defaults(func=_run_attention)


def _run_attention(args: argparse.Namespace) -> int:
    backends = None
    if args.backends is not None:
        backends = [b.strip() for b in args.backends.split(",") if b.strip()]
        if not backends:
            raise CLIError("attention: --backends is empty")
    try:
        settings = ("seq_len", "heads", "kv_heads", "head_dim", "batch", "dtype", "backward", "repeats", "windows",
                    "mix", "warmup", "device", "sink_tokens")
        result = bench_attention(backends=backends, **{name: getattr(args, name) for name in settings})
    except ValueError as exc:
        raise CLIError(f"attention: {exc}") from None
    if args.json != "-":
        print(format_table(result))
    write_json(args.json, result)
    return 0
