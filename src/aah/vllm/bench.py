"""``aah bench vllm``: vanilla vLLM and vLLM with AAH windows, side by side, on one model.

Both engines run in the vLLM environment (``make vllm-env``), one after the other, with the same
engine arguments (float32, vLLM's defaults otherwise, prefix caching on), on random token prompts
of ``--seq-len`` tokens:

* prefill: ``--rounds`` fresh prompts, one at a time, each generating one token;
  ``prefill_tok_s`` is prompt tokens over wall time (median over the rounds);
* decode: ``--decode-batch`` fresh prompts are prefilled (one token each), then the same
  prompts generate ``--new-tokens`` tokens (their prefill is a prefix-cache hit), ``--rounds``
  times; ``decode_tok_s`` is the generated tokens over the engine's time from the first to the
  last generated token (median over the rounds).

JSON keys: ``config``; ``vanilla`` and ``aah``, each with ``prefill_tok_s``, ``decode_tok_s``,
``prefill_s`` and ``decode_s`` (every round) and ``startup_s``; top-level ``prefill_speedup``
and ``decode_speedup`` (``aah`` over ``vanilla``).

``--load`` runs the load mode instead (:mod:`aah.vllm.load`): ``--requests`` prompts of ``--seq-len``
random tokens, distinct per request (``--shared-prefix K``: their first K tokens the same), each
generating ``--new-tokens`` tokens, arriving at once or, with ``--rate``, as a Poisson process
(``--seed``), against each engine with ``max_model_len`` = prompt + output tokens and the same KV
cache size. Its JSON keys: ``config``; ``vanilla`` and ``aah``, each with the keys of
:data:`aah.vllm.load.ENGINE_KEYS`; ``ratios`` (``aah`` over ``vanilla`` for
:data:`aah.vllm.load.RATIO_KEYS`); it prints them as a table.

``--check`` adds one more round to each engine, a fresh ``--seq-len`` prompt with its prompt
log-probabilities and 4 greedy tokens, and compares them with transformers in this process
(``aah.hf``'s patched model for ``aah``, the unpatched model for ``vanilla``): the key
``exactness`` holds, per engine, ``max_abs_logprob_diff`` and ``mean_abs_logprob_diff`` over
the prompt and generated tokens against the model in float32, ``greedy_equal``, and the same
differences against the model in float64 (``float64_max_abs_logprob_diff``, ...; see
:func:`exactness`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from ..cli_flags import (
    add_decode_batch,
    add_json,
    add_new_tokens,
    add_seq_len,
    add_windows_file,
    write_json,
)
from ..errors import CLIError
from .load import token_prompts
from .startup import StartupError, WindowsSource, check_windows_file

__all__ = ["add_command", "exactness", "format_load_table", "main", "run", "run_load", "vllm_python"]


def vllm_python(explicit: str | None = None) -> Path:
    """The vLLM environment's interpreter: ``--vllm-python``, ``$AAH_VLLM_PYTHON`` or ``.venv-vllm``."""
    path = explicit or os.environ.get("AAH_VLLM_PYTHON") or ".venv-vllm/bin/python"
    path = Path(path)
    if not path.exists():
        raise CLIError(f"no vLLM environment at {path}: build it with `make vllm-env` or pass --vllm-python")
    return path


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model folder (safetensors and config.json)")
    add_windows_file(p)
    add_seq_len(p)
    add_new_tokens(p)
    add_decode_batch(p)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each kind (default 3)")
    p.add_argument("--kv-cache-gib", type=float, default=4,
                   help="KV cache space of each engine in GiB, > 0, fractions allowed (default 4)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                   help="vLLM's token budget per step for both engines (default: vLLM's); a sliding-window "
                        "layer reserves its window plus N tokens per request")
    p.add_argument("--vllm-python", default=None, help="interpreter of the vLLM environment (default .venv-vllm)")
    p.add_argument("--check", action="store_true",
                   help="also compare each engine's log-probabilities with transformers (aah.hf for the windows)")
    load = p.add_argument_group("load mode")
    load.add_argument("--load", action="store_true",
                      help="run --requests requests of --seq-len prompt and --new-tokens output tokens against "
                           "each engine; report vLLM's maximum concurrency, the peak of running requests, "
                           "output tokens/s, time to first token and end-to-end latency")
    load.add_argument("--requests", type=int, default=16, help="load: requests (default 16)")
    load.add_argument("--rate", type=float, default=None,
                      help="load: Poisson arrivals at this many requests/s (default: all at once)")
    load.add_argument("--seed", type=int, default=0, help="load: seed of the prompts and arrivals (default 0)")
    load.add_argument("--shared-prefix", type=int, default=0, metavar="K",
                      help="load: the first K prompt tokens are the same for every request (default 0: distinct)")
    add_json(p)


def add_command(bench_sub: argparse._SubParsersAction) -> None:
    """Add ``vllm`` to the sub-commands of ``aah bench``."""
    p = bench_sub.add_parser("vllm", help="vanilla vLLM against vLLM with AAH windows (prefill and decode, or load)")
    _add_arguments(p)
    p.set_defaults(func=_cli)


def _check(args: argparse.Namespace) -> None:
    for name in ("rounds", "requests"):
        if getattr(args, name) < 1:
            raise CLIError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.kv_cache_gib < float("inf"):
        raise CLIError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib:g}")
    if args.max_num_batched_tokens is not None and args.max_num_batched_tokens < 1:
        raise CLIError(f"--max-num-batched-tokens must be >= 1, got {args.max_num_batched_tokens}")
    if args.load:
        if args.check:
            raise CLIError("--check goes without --load (it checks the prefill and decode rounds)")
        if args.rate is not None and not 0 < args.rate < float("inf"):
            raise CLIError(f"--rate must be > 0 requests/s, got {args.rate:g}")
        if not 0 <= args.shared_prefix < args.seq_len:
            raise CLIError(f"--shared-prefix must be in [0, --seq-len) = [0, {args.seq_len}), got {args.shared_prefix}")
    else:
        for flag, value, default in (("--rate", args.rate, None), ("--shared-prefix", args.shared_prefix, 0)):
            if value != default:
                raise CLIError(f"{flag} goes with --load only")
    if not Path(args.model, "config.json").is_file():
        raise CLIError(f"{args.model} is not a model folder (no config.json)")
    try:  # the windows file against the model's layout, before either engine starts
        config = SimpleNamespace(**json.loads(Path(args.model, "config.json").read_text()))
    except (OSError, ValueError, TypeError) as exc:
        raise CLIError(f"{args.model}/config.json is not readable: {str(exc).splitlines()[0]}") from None
    try:
        check_windows_file(WindowsSource(Path(args.windows_file), "--windows-file"), config)
    except StartupError as exc:
        raise CLIError(str(exc).removeprefix("aah.vllm: ")) from None


#: Greedy tokens generated after the prompt of ``--check``.
CHECK_TOKENS = 4


def _engine_rounds(args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    rounds = [{"prompts": token_prompts(1, 64, vocab, 0), "max_tokens": 2}]  # warm-up
    for r in range(args.rounds):
        rounds.append({"prompts": token_prompts(1, args.seq_len, vocab, 100 + r), "max_tokens": 1})
    for r in range(args.rounds):
        prompts = token_prompts(args.decode_batch, args.seq_len, vocab, 200 + r)
        rounds.append({"prompts": prompts, "max_tokens": 1})
        rounds.append({"prompts": prompts, "max_tokens": args.new_tokens})
    if args.check:
        rounds.append({"prompts": token_prompts(1, args.seq_len, vocab, 300), "max_tokens": CHECK_TOKENS,
                       "prompt_logprobs": True})
    return rounds


def exactness(model_dir: str | Path, windows: str | Path, prompt: list[int],
              requests: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Compare each engine's request (``prompt_logprobs``, ``tokens``, ``logprobs``, as
    :mod:`aah.vllm.runner` writes them) on ``prompt`` with transformers: ``aah`` with ``aah.hf``'s
    patched model on ``windows``, ``vanilla`` with the unpatched model. Against the model in float32:
    ``max_abs_logprob_diff``, ``mean_abs_logprob_diff`` and ``greedy_equal``; against the same model
    in float64 (the true values of its attention): ``float64_max_abs_logprob_diff`` (at the
    token position ``float64_max_at_position``, counted from 0 in prompt + generated tokens) and
    ``float64_mean_abs_logprob_diff``, with transformers' own float32 distance from it beside them
    (``transformers_float32_max_abs_logprob_diff``), the yardstick of float32 arithmetic alone."""
    report = {}
    for name in ("vanilla", "aah"):
        if name not in requests:
            continue
        request = requests[name]
        sequence = list(prompt) + list(request["tokens"])
        patched = windows if name == "aah" else None
        logp32 = _reference_logprobs(model_dir, patched, sequence, torch.float32)
        logp64 = _reference_logprobs(model_dir, patched, sequence, torch.float64)
        targets = torch.tensor(sequence[1:])[:, None]
        picked32, picked64 = (lp[:-1].gather(1, targets)[:, 0] for lp in (logp32, logp64))
        got = torch.tensor(request["prompt_logprobs"] + request["logprobs"], dtype=torch.float64)
        diff32, diff64 = ((got - picked[: len(got)]).abs() for picked in (picked32, picked64))
        n = len(prompt)
        greedy = logp32[n - 1 : n - 1 + len(request["tokens"])].argmax(-1).tolist()
        report[name] = {"max_abs_logprob_diff": float(diff32.max()), "mean_abs_logprob_diff": float(diff32.mean()),
                        "greedy_equal": greedy == list(request["tokens"]),
                        "float64_max_abs_logprob_diff": float(diff64.max()),
                        "float64_max_at_position": int(diff64.argmax()) + 1,
                        "float64_mean_abs_logprob_diff": float(diff64.mean()),
                        "transformers_float32_max_abs_logprob_diff":
                            float((picked32 - picked64)[: len(got)].abs().max())}
    return report


def _reference_logprobs(model_dir: str | Path, windows: str | Path | None, sequence: list[int],
                        dtype: torch.dtype) -> torch.Tensor:
    """Log-probabilities (float64, one row per position) of transformers' model loaded in ``dtype``
    on ``sequence``, patched with the windows file ``windows`` unless it is ``None``."""
    from .. import hf
    from ..hf._transformers import require

    model = require().AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    if windows is not None:
        hf.patch(model, str(windows))
    with torch.no_grad():
        return model(torch.tensor([sequence])).logits[0].double().log_softmax(-1)


def _summary(args: argparse.Namespace, result: dict[str, Any]) -> dict[str, Any]:
    seconds = result["seconds"]
    prefill_s = seconds[1 : 1 + args.rounds]
    decode_s = []
    for r in range(args.rounds):
        requests = result["rounds"][1 + args.rounds + 2 * r + 1]
        if all("first_token_ts" in q for q in requests):
            decode_s.append(max(q["last_token_ts"] for q in requests) - min(q["first_token_ts"] for q in requests))
        else:
            decode_s.append(seconds[1 + args.rounds + 2 * r + 1])
    steps = args.decode_batch * (args.new_tokens - 1)
    return {
        "prefill_tok_s": args.seq_len / statistics.median(prefill_s),
        "decode_tok_s": steps / statistics.median(decode_s) if steps else None,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        "startup_s": result["startup_s"],
    }


def _engine_args(args: argparse.Namespace, max_len: int) -> dict[str, Any]:
    """The engine arguments both engines share: the KV cache size in bytes (``--kv-cache-gib``)."""
    engine_args = {"max_model_len": max_len, "enable_prefix_caching": True, "disable_log_stats": False,
                   "kv_cache_memory_bytes": int(args.kv_cache_gib * 2**30)}
    if args.max_num_batched_tokens is not None:
        engine_args["max_num_batched_tokens"] = args.max_num_batched_tokens
    return engine_args


def _run_engines(args: argparse.Namespace, work: dict[str, Any]) -> dict[str, Any]:
    """Run vanilla vLLM and vLLM with the windows on ``work`` (each engine's ``engine_args`` and
    ``rounds`` or ``load``) in the vLLM environment, one after the other; the runner's results."""
    python = vllm_python(args.vllm_python)
    engines = [{"name": "vanilla", "windows": None, **work},
               {"name": "aah", "windows": str(Path(args.windows_file).resolve()), **work}]
    with tempfile.TemporaryDirectory() as tmp:
        spec, out = Path(tmp, "spec.json"), Path(tmp, "out.json")
        spec.write_text(json.dumps({"model": str(Path(args.model).resolve()), "engines": engines}))
        # The KV cache size is an engine argument; vLLM's CPU platform would replace it with this variable.
        env = {k: v for k, v in os.environ.items() if k not in ("AAH_WINDOWS", "VLLM_CPU_KVCACHE_SPACE")}
        done = subprocess.run([str(python), "-m", "aah.vllm.runner", str(spec), str(out)], env=env,
                              stdout=subprocess.DEVNULL)  # vLLM's log goes to stderr
        if done.returncode:
            raise CLIError(f"the vLLM run failed with exit status {done.returncode} (its log is above)")
        return json.loads(out.read_text())


def run_load(args: argparse.Namespace) -> dict[str, Any]:
    """The load mode: both engines on the same requests (see the module docstring for the keys)."""
    from .load import arrival_offsets, ratios, summarize

    vocab = int(json.loads(Path(args.model, "config.json").read_text())["vocab_size"])
    load = {"prompts": token_prompts(args.requests, args.seq_len, vocab, args.seed, args.shared_prefix),
            "arrivals": arrival_offsets(args.requests, args.rate, args.seed), "max_tokens": args.new_tokens}
    results = _run_engines(args, {"engine_args": _engine_args(args, args.seq_len + args.new_tokens), "load": load})
    report: dict[str, Any] = {
        "config": {"model": str(args.model), "windows": args.windows_file, "mode": "load", "requests": args.requests,
                   "prompt_tokens": args.seq_len, "output_tokens": args.new_tokens,
                   "max_model_len": args.seq_len + args.new_tokens, "rate": args.rate, "seed": args.seed,
                   "shared_prefix": args.shared_prefix, "kv_cache_gib": args.kv_cache_gib,
                   "max_num_batched_tokens": args.max_num_batched_tokens, "dtype": "float32"},
    }
    for name in ("vanilla", "aah"):
        report[name] = summarize(results[name])
    report["ratios"] = ratios(report["aah"], report["vanilla"])
    return report


#: The rows of the load table: (label, JSON key, format).
LOAD_ROWS = (
    ("max concurrency (vLLM)", "max_concurrency", "{:.2f}"),
    ("peak running requests", "peak_running", "{:d}"),
    ("output tokens/s", "output_tok_s", "{:.1f}"),
    ("TTFT median (s)", "ttft_median_s", "{:.3f}"),
    ("TTFT p99 (s)", "ttft_p99_s", "{:.3f}"),
    ("E2E median (s)", "e2e_median_s", "{:.3f}"),
    ("E2E p99 (s)", "e2e_p99_s", "{:.3f}"),
)


def format_load_table(report: dict[str, Any]) -> str:
    """The load results as a text table: a row per figure, a column per engine and their ratio."""
    config = report["config"]
    arrivals = "at once" if config["rate"] is None else f"Poisson at {config['rate']:g}/s"
    lines = [f"{config['requests']} requests of {config['prompt_tokens']} + {config['output_tokens']} tokens, "
             f"{arrivals}, KV cache {config['kv_cache_gib']:g} GiB per engine",
             f"{'':<24}{'vanilla':>12}{'aah':>12}{'aah/vanilla':>13}"]

    def cell(value, fmt: str, width: int) -> str:
        return f"{'-' if value is None else fmt.format(value):>{width}}"

    for label, key, fmt in LOAD_ROWS:
        lines.append(f"{label:<24}{cell(report['vanilla'][key], fmt, 12)}{cell(report['aah'][key], fmt, 12)}"
                     f"{cell(report['ratios'][key], '{:.2f}', 13)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run both engines and return the results (see the module docstring for the keys)."""
    _check(args)
    vllm_python(args.vllm_python)
    if args.load:
        return run_load(args)
    config = json.loads(Path(args.model, "config.json").read_text())
    vocab = int(config["vocab_size"])
    rounds = _engine_rounds(args, vocab)
    results = _run_engines(args, {"engine_args": _engine_args(args, args.seq_len + args.new_tokens + 16),
                                  "rounds": rounds})
    report: dict[str, Any] = {
        "config": {"model": str(args.model), "windows": args.windows_file, "seq_len": args.seq_len,
                   "new_tokens": args.new_tokens, "decode_batch": args.decode_batch, "rounds": args.rounds,
                   "dtype": "float32"},
    }
    for name in ("vanilla", "aah"):
        report[name] = _summary(args, results[name])
    if args.check:
        prompt = rounds[-1]["prompts"][0]
        report["exactness"] = exactness(args.model, args.windows_file, prompt,
                                        {name: results[name]["rounds"][-1][0] for name in ("vanilla", "aah")})
    report["prefill_speedup"] = report["aah"]["prefill_tok_s"] / report["vanilla"]["prefill_tok_s"]
    if report["aah"]["decode_tok_s"] and report["vanilla"]["decode_tok_s"]:
        report["decode_speedup"] = report["aah"]["decode_tok_s"] / report["vanilla"]["decode_tok_s"]
    else:
        report["decode_speedup"] = None
    return report


def _cli(args: argparse.Namespace) -> int:
    report = run(args)
    if args.load:  # the table, on stderr when stdout carries the JSON
        print(format_load_table(report), file=sys.stderr if args.json == "-" else sys.stdout)
    elif args.json != "-":
        print(json.dumps(report, indent=2))
    write_json(args.json, report)
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m aah.vllm.bench MODEL --windows-file FILE ...`` (the same as ``aah bench vllm``)."""
    parser = argparse.ArgumentParser(prog="aah bench vllm", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    try:
        return _cli(parser.parse_args(argv))
    except CLIError as exc:  # FlagError too: its prog is this parser's
        print(f"aah bench vllm: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
