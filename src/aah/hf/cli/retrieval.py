"""``aah hf retrieval``: passkey, needle-in-a-haystack and variable-tracking accuracy of full
attention, the calibrated windows (with their kept keys, if asked), one uniform window at the
same executed coverage, and three baselines: the model's own windows through the bridge (``own``,
a model with sliding layers of its own such as Gemma 3), the windows alone (no kept keys) and a
DuoAttention-shaped windows file (``--duo-file``, from ``aah hf calibrate --policy duo``)."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path

from ...cli_flags import add_json, add_output, add_windows_file, write_json
from ...errors import CLIError
from .models import load_model_folder
from .setting_flags import add_setting_flags, kept_keys_config, setting_flags

__all__ = ["add_command"]

DEFAULT_DEPTHS = "0.05,0.275,0.5,0.725,0.95"
SETTINGS = ("full", "own", "aah", "uniform", "windows", "duo")
DEFAULT_SETTINGS = ("full", "aah", "uniform")


def add_command(subparsers) -> None:
    """Add ``retrieval`` to the ``aah hf`` subcommands."""
    p = subparsers.add_parser(
        "retrieval",
        help="long-range retrieval accuracy (passkey, needles, variable tracking): full vs AAH vs uniform",
        description=(
            "Synthetic retrieval tasks generated offline from --seed at each --lengths (tokens of the "
            "model's tokenizer, prompt plus answer) and needle depth, in the haystack of --filler; greedy "
            "answers, exact match. Reports "
            "accuracy with Wilson 95% intervals overall, by length and by depth, for full attention, the "
            "windows in --windows-file and one uniform window at their causal coverage at each length."
        ),
    )
    p.add_argument("model_dir", metavar="MODEL_DIR")
    add_windows_file(p)
    p.add_argument("--tasks", default="passkey", metavar="T1,T2,...",
                   help="passkey, niah_single, niah_multikey, niah_multivalue, niah_text, vt (default passkey)")
    p.add_argument("--lengths", required=True, metavar="N1,N2,...", help="context lengths in tokens")
    p.add_argument("--depths", default=DEFAULT_DEPTHS, metavar="D1,D2,...",
                   help=f"needle depths in [0, 1] (default {DEFAULT_DEPTHS})")
    p.add_argument("--trials", type=int, default=2, help="samples per (task, length, depth) cell (default 2)")
    p.add_argument("--settings", default=",".join(DEFAULT_SETTINGS), metavar="S1,S2,...",
                   help="which of full, own (a model with sliding layers of its own, such as Gemma 3: its own "
                        "windows through the bridge, no sinks), aah (the windows file with the sink and kept-key "
                        "flags), uniform (one window at aah's executed coverage, the same sinks and kept keys), "
                        "windows (the windows file with the same sinks, no kept keys) and duo (--duo-file, its "
                        "own sinks, no kept keys) to run (default full,aah,uniform)")
    p.add_argument("--duo-file", metavar="FILE",
                   help="the windows file of the duo setting (aah hf calibrate --policy duo)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filler", default="repeat", metavar="NAME",
                   help="the haystack's genre: repeat (repetitive sentences, the default), prose (King James "
                        "Bible), dialogue (Shakespeare), code (Python standard library source), table "
                        "(generated Markdown rows), list (generated to-do lists)")
    add_json(p)
    add_output(p, "--heatmap", suffixes=(".png", ".pdf", ".svg"), metavar="FILE", help="depth x length accuracy heatmaps (PNG)")
    add_setting_flags(p)
    add_output(p, "--answers", metavar="FILE",
               help="keep every answer in FILE (JSON lines) as it is decoded and reuse those already there: "
                    "a stopped run resumes where it stopped")
    p.set_defaults(func=_retrieval)


def _numbers(flag: str, text: str, kind, check, allowed: str) -> list:
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or not all(check(v) for v in values) or len(set(values)) != len(values):
        raise CLIError(f"{flag} must be distinct comma-separated {allowed}, got {text!r}")
    return values


def _names(flag: str, text: str, allowed: tuple[str, ...]) -> list[str]:
    names = [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or not names or len(set(names)) != len(names):
        raise CLIError(f"{flag} must be distinct names among {', '.join(allowed)}; got {text!r}")
    return names


def _retrieval(args: argparse.Namespace) -> int:
    from ..evaluation.tasks import FILLERS, TASKS, check_filler

    tasks = _names("--tasks", args.tasks, TASKS)
    if args.filler not in FILLERS:
        raise CLIError(f"--filler must be one of {', '.join(FILLERS)}; got {args.filler!r}")
    try:
        check_filler(args.filler, tasks)
    except ValueError as exc:
        raise CLIError(f"--filler: {exc}") from None
    wanted = _names("--settings", args.settings, SETTINGS)
    if ("duo" in wanted) != (args.duo_file is not None):
        raise CLIError("--settings duo and --duo-file go together: give both or neither")
    depths = _numbers("--depths", args.depths, float, lambda d: 0.0 <= d <= 1.0, "depths in [0, 1]")
    if args.trials < 1:
        raise CLIError(f"--trials must be >= 1, got {args.trials}")
    lengths = _numbers("--lengths", args.lengths, int, lambda n: n >= 2, "lengths >= 2")
    sink_tokens, kept = setting_flags(args)

    from ..bridge.windows_file import check_windows_for, load_windows
    from ..evaluation.compare import Setting, own_setting, uniform_setting
    from ..evaluation.memory import format_bytes, peak_rss_bytes
    from ..evaluation.retrieval import (
        AnswerJournal,
        draw_heatmaps,
        model_key,
        run_settings,
        score,
        setting_facts,
    )
    from ..evaluation.tasks import build_samples

    try:
        windows, meta = load_windows(args.windows_file)
        duo = None if args.duo_file is None else load_windows(args.duo_file)
    except (FileNotFoundError, ValueError) as exc:
        raise CLIError(str(exc)) from None
    config, tokenizer, load_model = load_model_folder(args.model_dir, 2)
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and max(lengths) > limit:
        raise CLIError(f"--lengths must be at most {limit} (max_position_embeddings of the model), got {max(lengths)}")
    try:
        check_windows_for(config, windows, meta, args.windows_file)
        if duo is not None:
            check_windows_for(config, duo[0], duo[1], args.duo_file)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if "own" in wanted:
        _check_own(config)
    try:
        samples = build_samples(tokenizer, tasks, lengths, depths, args.trials, seed=args.seed, filler=args.filler)
    except FileNotFoundError as exc:  # a corpus, or the standard library's source, is not installed
        raise CLIError(f"--filler {args.filler}: {exc}") from None
    except ValueError as exc:
        raise CLIError(f"--lengths: {exc}") from None
    model = load_model()
    file_sinks = int(meta["sink_tokens"])
    sinks = file_sinks if sink_tokens is None else sink_tokens
    aah = Setting("aah", windows, sinks, kept)
    journal = None
    if args.answers:
        model_tag = model_key(args.model_dir)[:16]  # the model's content, not its path
        override = b"" if sinks == file_sinks else f"|sinks{sinks}".encode()
        if kept is not None:
            override += f"|tail{kept.tail_tokens}|kept{kept.keys_per_head}|pool{kept.pool_width}".encode()
            if kept.prefill_keys:
                override += f"|roll{kept.prefill_keys}/{kept.prefill_block}".encode()
        windows_bytes = Path(args.windows_file).read_bytes()
        windows_tag = hashlib.sha256(windows_bytes + override).hexdigest()[:16]
        # The baselines read no kept keys: their answers depend on their windows and sinks only.
        setting_tags = {"windows": hashlib.sha256(windows_bytes + f"|sinks{sinks}".encode()).hexdigest()[:16]}
        if duo is not None:
            setting_tags["duo"] = hashlib.sha256(Path(args.duo_file).read_bytes()).hexdigest()[:16]
        setting_tags["own"] = ""  # the model's own windows: its answers depend on the model alone
        journal = AnswerJournal(args.answers, model_tag, windows_tag, setting_tags)
    outputs: dict[str, list[str]] = {name: [] for name in wanted}
    facts: dict[str, dict[str, dict]] = {name: {} for name in wanted}
    for length in lengths:
        settings = {"full": Setting("full", None), "aah": aah, "windows": Setting("windows", windows, sinks)}
        if duo is not None:
            settings["duo"] = Setting("duo", duo[0], int(duo[1]["sink_tokens"]))
        if "uniform" in wanted:
            settings["uniform"] = uniform_setting(model, aah, length)
        group = [s for s in samples if s.length == length]
        if "own" in wanted:  # the global layers' window reaches every position a prompt and its answer take
            settings["own"] = own_setting(model, max([length] + [s.prompt_len + s.max_new_tokens for s in group]))
        chosen = [settings[name] for name in wanted]
        for name, texts in run_settings(model, tokenizer, chosen, group, journal=journal).items():
            outputs[name].extend(texts)
        for setting in chosen:
            facts[setting.name][str(length)] = setting_facts(model, setting, length)
    ordered = [s for length in lengths for s in samples if s.length == length]
    results = score(ordered, outputs)
    report = {
        "config": {
            "model": meta["model"], "windows_file": args.windows_file, "policy": meta["policy"],
            "duo_file": args.duo_file,
            "sink_tokens": aah.sink_tokens, "tasks": tasks, "lengths": lengths, "depths": depths,
            "trials": args.trials, "seed": args.seed, "filler": args.filler, "settings": wanted,
            **kept_keys_config(kept),
        },
        "filler": args.filler,
        "settings": facts,
        "results": results,
        "samples": [
            {"task": s.task, "length": s.length, "depth": s.depth, "trial": s.trial, "filler": s.filler,
             "prompt_tokens": s.prompt_len, "needle_depth": round(s.needle_depth, 4), "answers": list(s.answers),
             "outputs": {name: outputs[name][i] for name in wanted}}
            for i, s in enumerate(ordered)
        ],
        "peak_rss_bytes": peak_rss_bytes(),  # the whole process so far: the model's load included
    }
    if args.json != "-":
        print(_table(results, facts, lengths, args.filler))
        print(f"peak RSS {format_bytes(report['peak_rss_bytes'])} (model load included)")
    write_json(args.json, report)
    if args.heatmap:
        draw_heatmaps(results, args.heatmap, filler=args.filler)
    return 0


def _check_own(config) -> None:
    """``--settings own`` needs sliding layers of the model's own: a one-line error otherwise
    (checked on the model's layers built on the meta device, before the weights load)."""
    import torch

    from .._transformers import require
    from ..evaluation.compare import has_own_windows

    with torch.device("meta"):
        skeleton = require().AutoModelForCausalLM.from_config(config)
    if not has_own_windows(skeleton):
        raise CLIError(f"--settings own needs a model with sliding layers of its own (Gemma 3, Mistral, ...); "
                       f"{type(skeleton).__name__} has none (no sliding_window, no sliding layer types), so its own "
                       "attention is the full setting")


def _table(results: dict, facts: dict, lengths: list[int], filler: str) -> str:
    lines = [f"Retrieval accuracy, {filler} filler", "",
             "| setting | task | accuracy (95% CI) | " + " | ".join(f"{n} tokens" for n in lengths)
             + " | causal coverage | executed coverage |", "|---|---|---|" + "---|" * len(lengths) + "---|---|"]
    for name, per_task in results.items():
        coverage = " | ".join(", ".join(f"{facts[name][str(n)][key]:.3f}" for n in lengths)
                              for key in ("causal_coverage", "executed_coverage"))
        for task, r in per_task.items():
            by_length = " | ".join(
                f"{r['by_length'][str(n)]['correct']}/{r['by_length'][str(n)]['trials']}" for n in lengths
            )
            lines.append(f"| {name} | {task} | {r['accuracy']:.3f} [{r['ci'][0]:.3f}, {r['ci'][1]:.3f}] | "
                         f"{by_length} | {coverage} |")
    return "\n".join(lines)
