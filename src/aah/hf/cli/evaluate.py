"""``aah hf eval``: perplexity, served perplexity, prefill/decode speed and KV bytes of full attention,
the model's own windows through the bridge (a model with sliding layers of its own, such as Gemma 3),
the windows of a file and one uniform window at the same causal coverage; the process's peak
resident memory."""

from __future__ import annotations

import argparse

from ...cli_flags import write_json
from ...errors import CLIError
from .models import load_model_folder, token_blocks_of
from .setting_flags import kept_keys_config, setting_flags

__all__ = ["evaluate_command"]


def evaluate_command(args: argparse.Namespace) -> int:
    from ..bridge.windows_file import check_windows_for, load_windows
    from ..evaluation.compare import (
        Setting,
        evaluate_settings,
        has_own_windows,
        markdown_table,
        own_setting,
        summary,
        uniform_setting,
    )
    from ..evaluation.memory import format_bytes, peak_rss_bytes

    if args.rounds < 1:
        raise CLIError(f"--rounds must be >= 1, got {args.rounds}")
    sink_tokens, kept = setting_flags(args)
    try:
        windows, meta = load_windows(args.windows_file)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    config, tokenizer, load_model = load_model_folder(args.model_dir, args.seq_len)
    try:
        check_windows_for(config, windows, meta, args.windows_file)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.new_tokens >= args.seq_len:
        raise CLIError(f"--new-tokens must be below --seq-len ({args.seq_len}), got {args.new_tokens}")
    blocks = token_blocks_of(tokenizer, args.corpus, "val", args.seq_len, args.batches)
    model = load_model()
    aah = Setting("aah", windows, int(meta["sink_tokens"]) if sink_tokens is None else sink_tokens, kept)
    # A model with sliding layers of its own also runs them through the bridge (own): execution
    # apart from the choice of windows.
    own = [own_setting(model, args.seq_len)] if has_own_windows(model) else []
    settings = [Setting("full", None), *own, aah]
    uniform = None if args.no_uniform else uniform_setting(model, aah, args.seq_len)
    if uniform is not None:
        settings.append(uniform)
    results = evaluate_settings(
        model, settings, blocks, decode_batch=args.decode_batch, new_tokens=args.new_tokens, rounds=args.rounds
    )
    report = {
        "config": {
            "model": meta["model"], "seq_len": args.seq_len, "corpus": args.corpus, "batches": args.batches,
            "decode_batch": args.decode_batch, "new_tokens": args.new_tokens, "rounds": args.rounds,
            "windows_file": args.windows_file, "policy": meta["policy"], "sink_tokens": aah.sink_tokens,
            "uniform_window": None if uniform is None else int(uniform.windows[0, 0]),
            **kept_keys_config(kept),
        },
        **results,
        **summary(results),
        "peak_rss_bytes": peak_rss_bytes(),  # the whole process so far: the model's load included
    }
    if args.json != "-":
        print(markdown_table(results))
        print(
            f"ppl ratio {report['ppl_ratio']:.4f}, served ppl ratio {report['served_ppl_ratio']:.4f}, "
            f"prefill x{report['prefill_speedup']:.2f}, "
            f"decode x{report['decode_speedup']:.2f} (batch {args.decode_batch}), "
            f"KV bytes ratio {report['kv_bytes_ratio']:.3f} (ACR {results['aah']['acr']:.3f}), "
            f"peak RSS {format_bytes(report['peak_rss_bytes'])} (model load included)"
        )
        if own:
            print(
                f"own windows through the bridge vs full: ppl ratio {report['own_ppl_ratio']:.4f}, "
                f"prefill x{report['own_prefill_speedup']:.2f}, decode x{report['own_decode_speedup']:.2f}; "
                f"aah vs own: ppl ratio {report['aah_vs_own_ppl_ratio']:.4f}, "
                f"prefill x{report['aah_vs_own_prefill_speedup']:.2f}, "
                f"decode x{report['aah_vs_own_decode_speedup']:.2f}"
            )
        if kept is not None:
            print("kept keys count in ACR, KV bytes, speeds and the served perplexity (each block prefilled into "
                  "the setting's cache); the perplexity reads each block without a cache (the windows alone)")
    write_json(args.json, report)
    return 0
