"""``aah bench train``: tokens/s of a full training step, full attention vs an AAH window mix.

Both models are the small GPT of :mod:`aah.model` with the same backbone
(same seed); the AAH model's windows are pinned to the requested mix (its
controller never updates), so the comparison isolates the execution cost of
the windows. Steps (forward, backward, AdamW) of the two models are timed
interleaved in one process; medians and their ratio are reported.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ..controller import ControllerConfig
from ..model import GPT, GPTConfig
from ..windows import acr, candidate_windows, causal_coverage

__all__ = ["bench_train", "add_command"]


def bench_train(
    *,
    seq_len: int = 1024,
    layers: int = 4,
    d_model: int = 256,
    heads: int = 8,
    kv_heads: int | None = None,
    batch: int = 4,
    windows: tuple[int, ...] | None = None,
    mix: str | None = "full_adaptive",
    backend: str = "auto",
    repeats: int = 5,
    warmup: int = 2,
    device: str = "cpu",
) -> dict:
    """Median step time and tokens/s of full attention and of AAH with pinned windows."""
    if windows is None:
        from .attention import mix_windows

        windows = tuple(mix_windows(mix, heads, seq_len))
    if len(windows) != heads:
        raise ValueError(f"--windows: need {heads} windows (one per head), got {len(windows)}")
    candidates = tuple(sorted(set(candidate_windows(seq_len)) | set(windows)))
    if candidates[-1] > seq_len:
        raise ValueError(f"--windows: every window must be <= --seq-len ({seq_len}), got {max(windows)}")
    dev = torch.device(device)
    cfg = GPTConfig(n_layers=layers, d_model=d_model, n_heads=heads, n_kv_heads=kv_heads,
                    max_seq_len=seq_len, backend=backend)
    torch.manual_seed(0)
    full = GPT(cfg).to(dev)
    torch.manual_seed(0)
    aah = GPT(cfg, ControllerConfig(windows=candidates, scoring="none")).to(dev)
    for ctrl in aah.controllers():
        ctrl.pin_windows(windows)
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=gen).to(dev)
    models = {"full": full, "aah": aah}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}

    def step(name: str) -> float:
        model, opt = models[name], opts[name]
        start = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - start

    for _ in range(warmup):
        for name in models:
            step(name)
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(repeats):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times[name].append(step(name))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    tokens = batch * seq_len
    return {
        "seq_len": seq_len, "layers": layers, "d_model": d_model, "heads": heads, "batch": batch,
        "windows": list(windows), "acr": acr(windows, seq_len), "causal_coverage": causal_coverage(windows, seq_len),
        "backend_full": ",".join(full.backends_used()), "backend_aah": ",".join(aah.backends_used()),
        "full_step_ms": med["full"] * 1e3, "aah_step_ms": med["aah"] * 1e3,
        "full_tokens_per_s": tokens / med["full"], "aah_tokens_per_s": tokens / med["aah"],
        "speedup": med["full"] / med["aah"], "repeats": repeats, "device": str(dev),
    }


def add_command(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "train", help="tokens/s of a training step: full attention vs an AAH window mix",
        description="Times forward+backward+AdamW steps of the small GPT with full attention and with "
                    "AAH windows pinned to a mix, interleaved in one process (medians).",
    )
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--windows", default=None, help="comma-separated windows, one per head")
    p.add_argument("--mix", default="full_adaptive", help="paper window mix (see aah bench attention --help)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--device", default="cpu")
    p.add_argument("--json", action="store_true", help="print a JSON object")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        windows = tuple(int(w) for w in args.windows.split(",")) if args.windows else None
    except ValueError:
        print(f"aah bench train: --windows must be comma-separated integers, got {args.windows!r}", file=sys.stderr)
        return 2
    try:
        result = bench_train(
            seq_len=args.seq_len, layers=args.layers, d_model=args.d_model, heads=args.heads,
            kv_heads=args.kv_heads, batch=args.batch, windows=windows, mix=args.mix,
            backend=args.backend, repeats=args.repeats, device=args.device,
        )
    except ValueError as exc:
        print(f"aah bench train: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    r = result
    print(f"T={r['seq_len']} L={r['layers']} d={r['d_model']} H={r['heads']} B={r['batch']} "
          f"windows={r['windows']} (causal coverage {r['causal_coverage']:.3f}) on {r['device']}")
    print(f"{'model':<8}{'backend':<10}{'step ms':>10}{'tokens/s':>12}")
    print(f"{'full':<8}{r['backend_full']:<10}{r['full_step_ms']:>10.1f}{r['full_tokens_per_s']:>12.0f}")
    print(f"{'aah':<8}{r['backend_aah']:<10}{r['aah_step_ms']:>10.1f}{r['aah_tokens_per_s']:>12.0f}")
    print(f"AAH / full tokens/s: {r['speedup']:.3f}x")
    return 0
