"""``aah hf calibrate``: choose per-head windows on calibration text and save them to a file, and
print the process's peak resident memory (not stored: the same calibration gives the same file)."""

from __future__ import annotations

import argparse
from pathlib import Path

from ...cli_flags import FlagError
from ...errors import CLIError
from .models import load_model_folder, token_blocks_of

__all__ = ["add_duo_flags", "calibrate_command"]


def add_duo_flags(parser: argparse.ArgumentParser) -> None:
    """``--duo-window W``: the short window of ``--policy duo`` (an int >= 1; default 256)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise FlagError(parser.prog, f"--duo-window takes an int in [1, --seq-len); got {text!r}")
        return value

    parser.add_argument(
        "--duo-window", type=parse, default=None, metavar="W",
        help="duo: the streaming items' window, an int in [1, --seq-len) (default 256, DuoAttention's recent "
             "tokens; its 64 sinks are --sink-tokens 64)",
    )


def _check_budget(args: argparse.Namespace, candidates: tuple[int, ...] | None, duo_window: int | None) -> None:
    """Refuse a missing or infeasible budget of a budget policy before the weights load."""
    from ..calibration.policies import check_policy_budget

    try:
        check_policy_budget(
            args.policy, args.budget, args.seq_len, sink_tokens=args.sink_tokens, candidates=candidates,
            duo_window=duo_window,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _duo_window(args: argparse.Namespace, candidates: tuple[int, ...] | None) -> int | None:
    """The short window of ``--policy duo`` (``None`` for any other policy), or a one-line error."""
    from ..calibration.policies import DUO_WINDOW

    given = getattr(args, "duo_window", None)
    if args.policy != "duo":
        if given is not None:
            raise CLIError(f"--duo-window goes with --policy duo only, got --policy {args.policy}")
        return None
    if candidates is not None:
        raise CLIError("--candidates does not apply to --policy duo: its windows are --duo-window and --seq-len")
    window = DUO_WINDOW if given is None else given
    if not 1 <= window < args.seq_len:
        raise CLIError(f"--duo-window must be an int in [1, --seq-len) = [1, {args.seq_len}) (below full "
                       f"attention), got {window}")
    return window


def _parse_candidates(text: str | None, seq_len: int) -> tuple[int, ...] | None:
    """``--candidates`` as increasing windows in [1, seq_len], or a one-line error."""
    if text is None:
        return None
    from ..calibration.policies import resolve_candidates

    try:
        return resolve_candidates(seq_len, [int(w) for w in text.split(",") if w.strip()])
    except ValueError:
        raise CLIError(
            f"--candidates must be increasing comma-separated windows in [1, {seq_len}], got {text!r}"
        ) from None


def _retrieval_sequences(tokenizer, args: argparse.Namespace):
    """The synthetic retrieval sequences of ``--measure kl_retrieval`` or ``--policy duo``, or a one-line error."""
    from ...data.corpora import CorpusNotFoundError
    from ..calibration.answer_loss import calibration_sequences

    try:
        return calibration_sequences(tokenizer, args.seq_len, args.retrieval_sequences, seed=args.seed,
                                     instruction=args.retrieval_reserve > 0)
    except (CorpusNotFoundError, ValueError) as exc:
        what = "--policy duo" if args.policy == "duo" else "--measure kl_retrieval"
        raise CLIError(f"{what}: {exc}") from None


def calibrate_command(args: argparse.Namespace) -> int:
    from ..bridge.kept_keys import executed_read_coverage
    from ..bridge.spec import executed_coverage, kv_heads, layer_windows_for
    from ..bridge.windows_file import model_signature, save_windows
    from ..calibration.policies import (
        GRANULARITIES,
        MEASURES,
        POLICIES,
        SCOPES,
        calibrate,
        check_choice,
        duo_full_items,
    )
    from ..evaluation.memory import format_bytes, peak_rss_bytes

    try:
        for flag, allowed in (("policy", POLICIES), ("granularity", GRANULARITIES), ("scope", SCOPES),
                              ("measure", MEASURES)):
            check_choice(f"--{flag}", getattr(args, flag), allowed)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    candidates = _parse_candidates(args.candidates, args.seq_len)
    duo_window = _duo_window(args, candidates)
    retrieval_flags = args.policy == "budgeted" and args.measure == "kl_retrieval"
    if (retrieval_flags or duo_window) and args.retrieval_sequences < 1:
        raise CLIError(f"--retrieval-sequences must be >= 1, got {args.retrieval_sequences}")
    if retrieval_flags and not args.retrieval_weight >= 0:
        raise CLIError(f"--retrieval-weight must be >= 0, got {args.retrieval_weight}")
    if args.retrieval_reserve and not retrieval_flags:
        raise CLIError("--retrieval-reserve needs --policy budgeted --measure kl_retrieval")
    if retrieval_flags and not 0 <= args.retrieval_reserve < (args.budget or 0):
        raise CLIError(f"--retrieval-reserve must be in [0, --budget), got {args.retrieval_reserve}")
    if retrieval_flags and args.repair_rounds < 1:
        raise CLIError(f"--repair-rounds must be >= 1, got {args.repair_rounds}")
    _, tokenizer, load_model = load_model_folder(args.model_dir, args.seq_len)
    blocks = token_blocks_of(tokenizer, args.corpus, "train", args.seq_len, args.batches)
    _check_budget(args, candidates, duo_window)
    retrieval = _retrieval_sequences(tokenizer, args) if retrieval_flags or duo_window else None
    model = load_model()
    try:
        windows = calibrate(
            model, blocks.split(1), policy=args.policy, budget=args.budget, sink_tokens=args.sink_tokens,
            granularity=args.granularity, seed=args.seed, progress=True, scope=args.scope,
            candidates=candidates, measure=args.measure, retrieval=retrieval,
            retrieval_weight=args.retrieval_weight, retrieval_reserve=args.retrieval_reserve,
            repair_rounds=args.repair_rounds, duo_window=duo_window,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    meta = {
        "model": model_signature(model),
        "model_dir": str(Path(args.model_dir).resolve().name),
        "seq_len": args.seq_len,
        "policy": args.policy,
        "budget": args.budget,
        "sink_tokens": args.sink_tokens,
        "granularity": args.granularity,
        "scope": args.scope if args.policy == "budgeted" else None,
        "measure": args.measure if args.policy == "budgeted" else None,
        "candidates": list(candidates) if candidates else None,
        "corpus": args.corpus,
        "batches": args.batches,
        "retrieval_sequences": args.retrieval_sequences if retrieval_flags else None,
        "retrieval_weight": args.retrieval_weight if retrieval_flags else None,
        "retrieval_reserve": args.retrieval_reserve if retrieval_flags else None,
        "repair_rounds": args.repair_rounds if retrieval_flags and args.retrieval_reserve > 0 else None,
    }
    if duo_window:
        # The retrieval items: [layer, KV group] (or [layer, head], [layer, 0] at --granularity head, layer) at --seq-len.
        full = duo_full_items(windows, args.seq_len, num_kv_heads=kv_heads(model), granularity=args.granularity)
        meta.update(retrieval_sequences=args.retrieval_sequences, duo_window=duo_window, duo_full_items=full)
    specs = layer_windows_for(model, windows, args.sink_tokens)
    meta["acr"], meta["causal_coverage"] = executed_coverage(model, args.seq_len, specs)
    # The windows alone read the causal coverage; the key is written so that every tool reads one.
    meta["executed_coverage"] = executed_read_coverage(specs, args.seq_len, None, kv_heads(model))
    save_windows(args.out, windows, meta)
    print(f"{args.policy} windows for {windows.shape[0]} layers x {windows.shape[1]} heads -> {args.out}")
    if duo_window:
        unit = {"kv_group": "KV groups", "layer": "layers"}.get(args.granularity, "heads")
        print(f"{len(meta['duo_full_items'])} {unit} at full length {args.seq_len}, the rest at window {duo_window}")
    print(f"ACR {meta['acr']:.3f}, causal coverage {meta['causal_coverage']:.3f} as the layers run them "
          f"(with {args.sink_tokens} sinks), peak RSS {format_bytes(peak_rss_bytes())} (model load included)")
    return 0
