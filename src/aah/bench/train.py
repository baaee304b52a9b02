"""``aah bench train``: tokens/s of a full training step, full attention vs an AAH window mix.

Both models are the small GPT of :mod:`aah.model` with the same backbone
(same seed); the AAH model's windows are pinned to the requested mix (its
controller never updates), so the comparison isolates the execution cost of
the windows. Steps (forward, backward, AdamW) of the two models are timed
interleaved in one process; medians and their ratio are reported.

A third model runs the controller of a regime (default ``full_adaptive``)
live, from step 0 (no warm-up), so its control updates (paper, sections
5.3 to 5.7: features and diagnostics, hierarchy, scoring, commit) happen
every ``control_interval`` steps. The time spent inside those updates is
measured directly and reported as ``controller_overhead``: the median
update's cost spread over the control interval, over the median step time of
that model without its control work. By default enough rounds are timed to
include at least three control updates, and the update time is broken down by
part (scores, lost mass, features, decision, commit, diagnostics).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from .. import regimes
from ..backends.auto import auto_label
from ..cli_flags import add_json, add_seq_len, add_windows, write_json
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
    repeats: int | None = None,
    warmup: int = 2,
    device: str = "cpu",
    regime: str | None = "full_adaptive",
) -> dict:
    """Median step time and tokens/s of full attention and of AAH with pinned windows.

    With ``regime`` set, a third model runs that regime's controller live and
    the result holds the controller's measured overhead (``regime=None`` skips it).
    ``repeats=None`` times 10 rounds, more if needed to include
    ``MIN_CONTROL_UPDATES`` control updates of the live model.
    """
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
    clock = _ControlClock()
    if regime is not None:
        if regime not in regimes.names():
            raise ValueError(f"--regime must be one of {', '.join(regimes.names())}; got {regime!r}")
        ctrl_cfg = regimes.get(regime, control_warmup=0)
        torch.manual_seed(0)
        live = GPT(cfg, ctrl_cfg).to(dev)
        if live.controllers():
            models["controlled"] = live
            for ctrl in live.controllers():
                clock.wrap(ctrl)
    if repeats is None:
        repeats = _default_repeats(ctrl_cfg if "controlled" in models else None, warmup)
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-4) for name, m in models.items()}
    steps_done = {name: 0 for name in models}
    control_per_step: list[float] = []
    parts_per_step: list[dict[str, float]] = []
    plain_steps: list[float] = []

    def step(name: str) -> float:
        model, opt = models[name], opts[name]
        model.set_step(steps_done[name])
        steps_done[name] += 1
        clock.take()
        start = time.perf_counter()
        _, loss = model(x, x)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        elapsed = time.perf_counter() - start
        if name == "controlled":
            total, parts = clock.take()
            control_per_step.append(total)
            parts_per_step.append(parts)
            plain_steps.append(elapsed - total)
        return elapsed

    for _ in range(warmup):
        for name in models:
            step(name)
    if "controlled" in models:  # the warm-up rounds' control updates are not counted
        control_per_step.clear()
        parts_per_step.clear()
        plain_steps.clear()
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(repeats):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            times[name].append(step(name))
    med = {name: statistics.median(ts) for name, ts in times.items()}
    tokens = batch * seq_len
    controller = None
    if "controlled" in models:
        live = models["controlled"]
        interval = live.controllers()[0].config.control_interval
        updates = [i for i, t in enumerate(control_per_step) if t > 0]
        per_update = statistics.median(control_per_step[i] for i in updates) if updates else 0.0
        plain = statistics.median(plain_steps)  # the step without its control work
        controller = {
            "regime": regime,
            "control_interval": interval,
            "steps": len(control_per_step),
            "control_updates": len(updates),
            "update_ms": per_update * 1e3,
            "step_ms": plain * 1e3,
            "overhead": per_update / interval / plain,
            "backend": auto_label(live.backends_used()),
            "causal_coverage_end": live.coverage(seq_len)["causal_coverage"],
            "updates_ms": [control_per_step[i] * 1e3 for i in updates],
            "parts_ms": _median_parts([parts_per_step[i] for i in updates]),
        }
    return {
        "seq_len": seq_len, "layers": layers, "d_model": d_model, "heads": heads, "batch": batch,
        "windows": list(windows), "acr": acr(windows, seq_len), "causal_coverage": causal_coverage(windows, seq_len),
        "backend_full": auto_label(full.backends_used()), "backend_aah": auto_label(aah.backends_used()),
        "full_step_ms": med["full"] * 1e3, "aah_step_ms": med["aah"] * 1e3,
        "full_tokens_per_s": tokens / med["full"], "aah_tokens_per_s": tokens / med["aah"],
        "speedup": med["full"] / med["aah"], "repeats": repeats, "device": str(dev),
        "threads": torch.get_num_threads(), "controller": controller,
        "controller_overhead": None if controller is None else controller["overhead"],
    }


#: Control updates the default number of rounds includes (their median is the update time;
#: three, so that one update slowed by another process does not set it).
MIN_CONTROL_UPDATES = 3

#: The parts of a control update (paper, sections 5.3 to 5.8) timed separately.
CONTROL_PARTS = {
    "sample_scores": "scores",  # sampled query scores, shared by the two measurements below
    "record_lost_mass": "lost_mass",
    "observe": "features",  # activation moments and the feature EMA
    "decide": "decision",  # hierarchy, scoring, selection
    "commit": "commit",
    "record_diagnostics": "diagnostics",
}


def _default_repeats(config, warmup: int, at_least: int = 10) -> int:
    """Rounds from step ``warmup`` on that include ``MIN_CONTROL_UPDATES`` control updates (at least 10)."""
    if config is None:
        return at_least
    rounds, updates = 0, 0
    while rounds < at_least or updates < MIN_CONTROL_UPDATES:
        s = warmup + rounds
        updates += s >= config.control_warmup and (s - config.control_warmup) % config.control_interval == 0
        rounds += 1
    return rounds


def _median_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    """Median milliseconds of each part over the control updates, and what the parts leave out."""
    names = list(CONTROL_PARTS.values()) + ["other"]
    return {n: statistics.median(p.get(n, 0.0) for p in parts) * 1e3 for n in names} if parts else {}


class _ControlClock:
    """Seconds the wrapped controllers spend in control work, in total and by part, since :meth:`take`."""

    def __init__(self) -> None:
        self.total = 0.0
        self.parts: dict[str, float] = defaultdict(float)

    def wrap(self, ctrl) -> None:
        """Time ``ctrl``'s control updates and warm-up observations, and the parts inside them."""
        for attr in ("control_update", "_warmup_observation"):
            self._patch(ctrl, attr, None)
        for attr, part in CONTROL_PARTS.items():
            self._patch(ctrl, attr, part)

    def _patch(self, ctrl, attr: str, part: str | None) -> None:
        original = getattr(ctrl, attr)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                if part is None:
                    self.total += elapsed
                else:
                    self.parts[part] += elapsed

        setattr(ctrl, attr, timed)

    def take(self) -> tuple[float, dict[str, float]]:
        """The seconds since the last call (total, by part with ``other`` the rest), then reset."""
        total, parts = self.total, dict(self.parts)
        if total > 0:
            parts["other"] = max(0.0, total - sum(parts.values()))
        self.total, self.parts = 0.0, defaultdict(float)
        return total, parts


def add_command(bench_subparsers) -> None:
    p = bench_subparsers.add_parser(
        "train", help="tokens/s of a training step: full attention vs an AAH window mix",
        description="Times forward+backward+AdamW steps of the small GPT with full attention and with "
                    "AAH windows pinned to a mix, interleaved in one process (medians).",
    )
    add_seq_len(p)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--batch", type=int, default=4)
    add_windows(p)
    p.add_argument("--mix", default="full_adaptive", help="paper window mix (see aah bench attention --help)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed rounds (default 10, more if needed to include three control updates "
                        "of the live controller)")
    p.add_argument("--regime", default="full_adaptive",
                   help="regime whose controller runs live to measure its overhead (default full_adaptive)")
    p.add_argument("--no-controller", action="store_true", help="skip the live-controller model")
    p.add_argument("--device", default="cpu")
    add_json(p)
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    try:
        result = bench_train(
            seq_len=args.seq_len, layers=args.layers, d_model=args.d_model, heads=args.heads,
            kv_heads=args.kv_heads, batch=args.batch, windows=args.windows, mix=args.mix,
            backend=args.backend, repeats=args.repeats, device=args.device,
            regime=None if args.no_controller else args.regime,
        )
    except ValueError as exc:
        print(f"aah bench train: {exc}", file=sys.stderr)
        return 2
    write_json(args.json, result)
    if args.json == "-":
        return 0
    r = result
    print(f"T={r['seq_len']} L={r['layers']} d={r['d_model']} H={r['heads']} B={r['batch']} "
          f"windows={r['windows']} (causal coverage {r['causal_coverage']:.3f}) on {r['device']}")
    print(f"{'model':<8}{'backend':<10}{'step ms':>10}{'tokens/s':>12}")
    print(f"{'full':<8}{r['backend_full']:<10}{r['full_step_ms']:>10.1f}{r['full_tokens_per_s']:>12.0f}")
    print(f"{'aah':<8}{r['backend_aah']:<10}{r['aah_step_ms']:>10.1f}{r['aah_tokens_per_s']:>12.0f}")
    print(f"AAH / full tokens/s: {r['speedup']:.3f}x")
    c = r["controller"]
    if c is not None:
        print(f"controller ({c['regime']}, live, every {c['control_interval']} steps): "
              f"{c['update_ms']:.1f} ms per update (median), {c['control_updates']} updates in {c['steps']} "
              f"timed steps; overhead {100 * c['overhead']:.2f} % of the {c['step_ms']:.1f} ms step")
        if c["parts_ms"]:
            print("  per update: " + ", ".join(f"{n} {ms:.1f} ms" for n, ms in c["parts_ms"].items()))
    return 0
