"""``aah bench decode``: prefill time, decode tokens/s and KV-cache bytes, full attention vs AAH.

Both models are the small GPT of :mod:`aah.model` built under the same seed,
so their backbones hold the same weights; the AAH model's windows are pinned
to a mix (its controller never updates), so the comparison isolates what the
windows cost and save at inference (paper section 5.8, windowed execution).

One round of a model: reset its KV cache, prefill a ``context``-token prompt
through it (:meth:`aah.GPT.new_cache`), then decode ``new_tokens`` greedy
tokens one at a time. Rounds of the two models alternate (ABBA order) in one
process after a warm-up round; the figures are medians over rounds. The same
prompt is also run through each model without a cache (``forward_s``), which
is what prefill through the cache is compared with.

The JSON object (``--json``) is a stable schema:

* ``config``: the settings, with ``windows`` (per query head, the AAH model's),
  ``acr`` and ``causal_coverage`` of those windows at the model's length ``seq_len``,
  and ``decode_step``: ``compiled`` (:mod:`aah.decode.ring_decode`, both models) or
  ``pytorch (why)``;
* ``results``: one object per model, ``name`` (``full`` or ``aah``),
  ``prefill_s``, ``decode_tok_s`` (batch x new tokens / decode seconds),
  ``kv_bytes`` (the cache's ring buffers), ``peak_rss_mb`` (peak resident
  memory while that model ran), plus ``forward_s``, ``decode_ms_per_step``,
  ``prefill_over_forward`` and ``backend``;
* ``decode_speedup`` (AAH decode tokens/s over full), ``prefill_speedup``
  (full prefill time over AAH) and ``kv_bytes_ratio`` (AAH over full).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import time
from collections.abc import Sequence

import torch

from ..cli_flags import add_json, add_new_tokens, add_seq_len, add_windows, write_json
from ..controller import ControllerConfig
from ..decode import ring_decode
from ..errors import CLIError
from ..model import GPT, GPTConfig
from ..windows import acr, candidate_windows, causal_coverage, kv_group_reach
from .attention import DTYPES, MIXES, mix_windows

__all__ = ["bench_decode", "add_command", "format_table", "GRANULARITIES", "RESULT_KEYS", "TOP_KEYS"]

GRANULARITIES = ("head", "kv_group")
#: Keys every entry of ``results`` has (the contract of the JSON schema).
RESULT_KEYS = ("name", "prefill_s", "decode_tok_s", "kv_bytes", "peak_rss_mb")
#: Top-level keys of the JSON object.
TOP_KEYS = ("config", "results", "decode_speedup", "prefill_speedup", "kv_bytes_ratio")


def _positive(value: object, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{option} must be a positive integer, got {value!r}")
    return value


def group_windows(windows: Sequence[int], kv_heads: int) -> tuple[int, ...]:
    """``window_granularity="kv_group"`` applied to pinned windows: each KV group takes its largest."""
    return tuple(w for w in kv_group_reach(windows, kv_heads) for _ in range(len(windows) // kv_heads))


# ---------------------------------------------------------------------- peak memory
def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark of this process (Linux); False where that is impossible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    """Peak resident memory of this process in MiB (since the last reset, where resets work)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


# ---------------------------------------------------------------------- the benchmark
def bench_decode(
    *,
    context: int = 3840,
    new_tokens: int = 128,
    seq_len: int | None = None,
    batch: int = 1,
    windows: Sequence[int] | None = None,
    mix: str | None = None,
    layers: int = 4,
    d_model: int = 256,
    heads: int = 8,
    kv_heads: int | None = None,
    granularity: str = "head",
    dtype: str = "float32",
    repeats: int = 5,
    warmup: int = 1,
    device: str = "cpu",
    threads: int | None = None,
) -> dict:
    """Run the benchmark and return the JSON object described in the module docstring.

    The model's length ``seq_len`` defaults to ``context + new_tokens``
    rounded up to a power of two (4096 for the default 3840 + 128); the mix
    (default ``full_adaptive``) gives windows at that length, shortest first.
    ``granularity="kv_group"`` gives the query heads of a KV head the largest
    window among them (the controller's rule).
    """
    _positive(context, "--context")
    _positive(new_tokens, "--new-tokens")
    _positive(batch, "--batch")
    _positive(layers, "--layers")
    _positive(d_model, "--d-model")
    _positive(heads, "--heads")
    _positive(repeats, "--repeats")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"--warmup must be an integer >= 0, got {warmup!r}")
    kv = heads if kv_heads is None else _positive(kv_heads, "--kv-heads")
    if heads % kv:
        raise ValueError(f"--kv-heads ({kv}) must divide --heads ({heads})")
    if d_model % heads or (d_model // heads) % 2:
        raise ValueError(f"--d-model ({d_model}) / --heads ({heads}) must be an even integer head dim")
    if granularity not in GRANULARITIES:
        raise ValueError(f"--granularity must be one of {', '.join(GRANULARITIES)}; got {granularity!r}")
    if dtype not in DTYPES or dtype == "float16":
        raise ValueError(f"--dtype must be float32 or bfloat16; got {dtype!r}")
    if windows is not None and mix is not None:
        raise ValueError("give --windows or --mix, not both")
    needed = context + new_tokens
    if seq_len is None:
        seq_len = 1 << (needed - 1).bit_length()
    elif _positive(seq_len, "--seq-len") < needed:
        raise ValueError(f"--seq-len ({seq_len}) must hold --context + --new-tokens ({needed})")
    if windows is None:
        mix = "full_adaptive" if mix is None else mix
        if mix not in MIXES:
            raise ValueError(f"--mix must be one of {', '.join(MIXES)}; got {mix!r}")
        windows = mix_windows(mix, heads, seq_len)
    windows = tuple(int(w) for w in windows)
    if len(windows) != heads:
        raise ValueError(f"--windows: need {heads} windows (one per head), got {len(windows)}")
    if min(windows) < 1 or max(windows) > seq_len:
        raise ValueError(f"--windows: every window must be in [1, {seq_len}] (the model's length)")
    if granularity == "kv_group":
        windows = group_windows(windows, kv)
    dev = torch.device(device)
    torch_dtype = DTYPES[dtype]
    if threads is not None:
        torch.set_num_threads(_positive(threads, "--threads"))

    cfg = GPTConfig(n_layers=layers, d_model=d_model, n_heads=heads, n_kv_heads=kv_heads, max_seq_len=seq_len)
    candidates = tuple(sorted(set(candidate_windows(seq_len)) | set(windows)))
    torch.manual_seed(0)
    full = GPT(cfg).to(dev, torch_dtype).eval()
    torch.manual_seed(0)
    ctrl = ControllerConfig(windows=candidates, scoring="none", window_granularity=granularity)
    aah = GPT(cfg, ctrl).to(dev, torch_dtype).eval()
    for controller in aah.controllers():
        controller.pin_windows(windows)
    models = {"full": full, "aah": aah}
    caches = {name: m.new_cache(batch, seq_len) for name, m in models.items()}
    prompt = torch.randint(0, cfg.vocab_size, (batch, context), generator=torch.Generator().manual_seed(0)).to(dev)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def forward_only(name: str) -> float:
        sync()
        start = time.perf_counter()
        models[name](prompt)
        sync()
        return time.perf_counter() - start

    def one_round(name: str) -> tuple[float, float]:
        model, cache = models[name], caches[name]
        cache.reset()
        sync()
        start = time.perf_counter()
        logits, _ = model(prompt, cache=cache)
        nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
        sync()
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(new_tokens):
            logits, _ = model(nxt, cache=cache)
            nxt = logits[:, -1].argmax(dim=-1, keepdim=True)
        sync()
        return prefill, time.perf_counter() - start

    prefill: dict[str, list[float]] = {name: [] for name in models}
    decode: dict[str, list[float]] = {name: [] for name in models}
    forward: dict[str, list[float]] = {name: [] for name in models}
    peak: dict[str, float] = {}
    with torch.inference_mode():
        for name in models:  # warm-up; the first round of each model also gives its peak memory
            resettable = _reset_peak_rss()
            for _ in range(max(warmup, 1)):
                one_round(name)
                forward_only(name)
            peak[name] = _peak_rss_mb() if resettable else float("nan")
        for r in range(repeats):
            order = list(models) if r % 2 == 0 else list(reversed(models))
            for name in order:
                p, d = one_round(name)
                prefill[name].append(p)
                decode[name].append(d)
            for name in reversed(order):
                forward[name].append(forward_only(name))
    if any(v != v for v in peak.values()):  # no reset available: one process-wide peak for both
        peak = {name: _peak_rss_mb() for name in models}

    results = []
    for name, model in models.items():
        pre = statistics.median(prefill[name])
        dec = statistics.median(decode[name])
        fwd = statistics.median(forward[name])
        results.append(
            {
                "name": name,
                "prefill_s": pre,
                "decode_tok_s": batch * new_tokens / dec,
                "kv_bytes": caches[name].memory_bytes(),
                "peak_rss_mb": peak[name],
                "forward_s": fwd,
                "prefill_over_forward": pre / fwd,
                "decode_ms_per_step": dec / new_tokens * 1e3,
                "decode_route": caches[name].route,
                "backend": ",".join(model.backends_used()),
            }
        )
    by_name = {r["name"]: r for r in results}
    decode_step = ring_decode.decode_step_label(dev)
    return {
        "config": {
            "context": context,
            "new_tokens": new_tokens,
            "seq_len": seq_len,
            "batch": batch,
            "layers": layers,
            "d_model": d_model,
            "heads": heads,
            "kv_heads": kv,
            "head_dim": d_model // heads,
            "dtype": dtype,
            "mix": mix,
            "window_granularity": granularity,
            "windows": list(windows),
            "kv_capacities": caches["aah"].capacities[0].tolist(),
            "acr": acr(windows, seq_len),
            "causal_coverage": causal_coverage(windows, seq_len),
            "repeats": repeats,
            "warmup": warmup,
            "device": str(dev),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "decode_step": decode_step,
        },
        "results": results,
        "decode_speedup": by_name["aah"]["decode_tok_s"] / by_name["full"]["decode_tok_s"],
        "prefill_speedup": by_name["full"]["prefill_s"] / by_name["aah"]["prefill_s"],
        "kv_bytes_ratio": by_name["aah"]["kv_bytes"] / by_name["full"]["kv_bytes"],
    }


def format_table(result: dict) -> str:
    c = result["config"]
    lines = [
        f"T {c['seq_len']}: context {c['context']} + {c['new_tokens']} new tokens, batch {c['batch']}, {c['layers']} layers, "
        f"d_model {c['d_model']}, {c['heads']} heads / {c['kv_heads']} KV heads, {c['dtype']}, {c['device']}",
        f"AAH windows {c['windows']} ({c['window_granularity']} granularity): ACR {c['acr']:.3f}, "
        f"causal coverage {c['causal_coverage']:.3f}; decode step: {c['decode_step']}",
        f"{'model':<6}{'prefill s':>11}{'forward s':>11}{'decode tok/s':>14}{'ms/step':>9}"
        f"{'KV bytes':>13}{'peak RSS MiB':>14}",
    ]
    for r in result["results"]:
        lines.append(
            f"{r['name']:<6}{r['prefill_s']:>11.3f}{r['forward_s']:>11.3f}{r['decode_tok_s']:>14.1f}"
            f"{r['decode_ms_per_step']:>9.2f}{r['kv_bytes']:>13,}{r['peak_rss_mb']:>14.0f}"
        )
    lines.append(
        f"decode speedup {result['decode_speedup']:.3f}, prefill speedup {result['prefill_speedup']:.3f}, "
        f"KV bytes ratio {result['kv_bytes_ratio']:.3f} (medians of {c['repeats']} interleaved rounds)"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------- command line
def add_command(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "decode",
        help="prefill time, decode tokens/s and KV-cache bytes: full attention vs an AAH window mix",
        description=(
            "Prefills a prompt through the KV cache and decodes greedy tokens with the small GPT, "
            "full attention and AAH windows pinned to a mix, same weights, interleaved rounds in "
            "one process (medians)."
        ),
    )
    p.add_argument("--context", type=int, default=3840, help="prompt length (default 3840)")
    add_new_tokens(p)
    add_seq_len(p, default=None,
                help="the model's maximum length T (default: context + new tokens rounded up to a power of two)")
    p.add_argument("--batch", type=int, default=1, help="batch size (default 1)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--mix", choices=list(MIXES), default=None, help="paper window mix (default full_adaptive)")
    add_windows(p, into=group)
    p.add_argument("--layers", type=int, default=4, help="default 4")
    p.add_argument("--d-model", type=int, default=256, help="default 256")
    p.add_argument("--heads", type=int, default=8, help="query heads (default 8)")
    p.add_argument("--kv-heads", type=int, default=None, help="KV heads (default: --heads)")
    p.add_argument(
        "--granularity", choices=list(GRANULARITIES), default="head",
        help="head: one window per query head; kv_group: the query heads of a KV head share the largest",
    )
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="default float32")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds per model (default 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds per model first (default 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    add_json(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise CLIError("--device cuda: no CUDA device is available")
    try:
        result = bench_decode(
            context=args.context, new_tokens=args.new_tokens, seq_len=args.seq_len, batch=args.batch, windows=args.windows,
            mix=args.mix, layers=args.layers, d_model=args.d_model, heads=args.heads,
            kv_heads=args.kv_heads, granularity=args.granularity, dtype=args.dtype,
            repeats=args.repeats, warmup=args.warmup, device=args.device, threads=args.threads,
        )
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    if args.json != "-":
        print(format_table(result))
    write_json(args.json, result)
    sys.stdout.flush()
    return 0

