"""The attention benchmark: every backend against full causal SDPA, in one process.

The AAH-v3 paper (section 7.7) separates the routing proxy (ACR) from the
work a backend really does and asks for measured FLOPs rather than inferred
ones. This benchmark reports, per backend, for one attention call of the
given shape:

* ``median_ms`` and ``ratio_to_sdpa``: time (forward, or forward+backward),
  measured interleaved with the full-causal ``sdpa`` baseline in one process:
  a warm-up, then ``repeats`` rounds that each run every backend once, in an
  order rotated every round; the median of each backend's rounds, and the
  ratio of the medians. ``paired_ratio_quartiles`` gives the quartiles of the
  round-by-round ratios (a noisy machine widens them);
* ``acr``, ``causal_coverage`` and ``executed_coverage`` (see
  :mod:`aah.windows`);
* ``counted_flops``: :class:`torch.utils.flop_counter.FlopCounterMode` with
  PyTorch's own formulas. Those count fused SDPA kernels as the full
  ``T x T`` square even when ``is_causal`` is set, and PyTorch has no formula
  for the CPU fused kernel at all (it would count 0); here the CPU kernel gets
  the same full-square formula as the GPU kernels, so both devices count alike;
* ``counted_flops_causal``: the same counter, except that SDPA kernels called
  with ``is_causal=True`` count only the causal triangle (what those kernels
  compute; they skip the tiles above the diagonal);
* ``ideal_flops``: the matrix-product FLOPs an ideal kernel needs for the
  allowed (query, key) pairs: ``2 * D`` per pair and product, with 2 products
  forward and 5 backward (scores recomputed, then dP, dV, dQ, dK), the same
  convention as PyTorch's SDPA formulas;
* ``flops_ratio``: ``counted_flops_causal`` over the baseline's.

Backends the counter cannot trace (compiled FlexAttention) get ``None`` for the
counted figures; their ``executed_coverage`` still says what they compute.

With ``sink_tokens = S > 0`` every windowed backend also keeps the first ``S``
keys (:mod:`aah.windows`), and the coverage and ideal figures count them; the
``sdpa`` baseline is full causal attention, which sinks do not change.
Backends without sink support do not run then.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..backends import (
    backend_names,
    backend_takes_sinks,
    executed_coverage,
    get_backend,
    resolve_backend,
)
from ..backends.base import BackendUnavailable
from ..windows import acr, as_window_tensor, causal_coverage, causal_pairs, check_sink_tokens

__all__ = [
    "MIXES",
    "MIX_BUCKETS",
    "bench_attention",
    "default_backends",
    "format_table",
    "mix_windows",
]

# The paper's final window-bucket distributions (share of heads per window,
# windows T/8, T/4, T/2, T).
MIX_BUCKETS = (8, 4, 2, 1)  # window = T // divisor
MIXES: dict[str, tuple[float, float, float, float]] = {
    "full_adaptive": (63.5, 18.5, 11.4, 6.6),
    "shallow_freeze": (51.3, 17.0, 16.8, 15.0),
    "deep_practical_reuse": (50.3, 20.1, 9.4, 20.1),
    "grouping_off": (32.7, 8.8, 13.6, 44.8),
}

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def mix_head_counts(mix: str, heads: int) -> tuple[int, ...]:
    """Heads per bucket (T/8, T/4, T/2, T) for ``mix``, by largest-remainder rounding.

    Every bucket first gets the whole part of ``share * heads``; the heads left
    over go, one each, to the buckets with the largest fractional parts (ties
    to the shorter window). The counts always sum to ``heads``. For example
    ``full_adaptive`` with 8 heads has quotas 5.08, 1.48, 0.91, 0.53 and gives
    ``(5, 1, 1, 1)``.
    """
    if mix not in MIXES:
        raise ValueError(f"--mix must be one of {', '.join(MIXES)}; got {mix!r}")
    if heads <= 0:
        raise ValueError(f"--heads must be a positive integer, got {heads}")
    shares = MIXES[mix]
    total = sum(shares)
    quotas = [heads * s / total for s in shares]
    counts = [math.floor(x) for x in quotas]
    left = heads - sum(counts)
    order = sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[:left]:
        counts[i] += 1
    return tuple(counts)


def mix_windows(mix: str, heads: int, seq_len: int) -> tuple[int, ...]:
    """One window per head for a paper mix: the short windows on the first heads."""
    if seq_len <= 0:
        raise ValueError(f"--seq-len must be a positive integer, got {seq_len}")
    counts = mix_head_counts(mix, heads)
    windows: list[int] = []
    for divisor, count in zip(MIX_BUCKETS, counts):
        windows.extend([max(1, seq_len // divisor)] * count)
    return tuple(windows)


def default_backends(
    device: torch.device | str, backward: bool, dtype: torch.dtype, sinks: tuple[Sequence[int], int, int] | None = None
) -> list[str]:
    """Registered backends (other than the ``sdpa`` baseline) that can run this request.

    ``sinks`` is ``(windows, seq_len, sink_tokens)`` when the request has sink tokens."""
    names = []
    for name in backend_names():
        if name == "sdpa":
            continue
        if _cannot_run(name, device, backward, dtype, sinks) is None:
            names.append(name)
    return names


def _cannot_run(
    name: str, device: torch.device | str, backward: bool, dtype: torch.dtype,
    sinks: tuple[Sequence[int], int, int] | None = None,
) -> str | None:
    try:
        resolve_backend(name, device, needs_backward=backward)
    except BackendUnavailable as exc:
        return str(exc)
    if name == "flash" and dtype not in (torch.float16, torch.bfloat16):
        return "backend 'flash' needs --dtype float16 or bfloat16"
    if sinks is not None and not backend_takes_sinks(name, *sinks):
        return f"backend {name!r} does not support --sink-tokens with these windows"
    return None


# ---------------------------------------------------------------- FLOPs counting

def _causal_sdpa_pairs(q_len: int, k_len: int) -> int:
    """(query, key) pairs of top-left aligned causal attention: ``sum_i min(i + 1, S)``."""
    full_rows = max(0, min(q_len, k_len))
    pairs = full_rows * (full_rows + 1) // 2
    return pairs + max(0, q_len - k_len) * k_len


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _sdpa_flops(q_shape, k_shape, v_shape, causal: bool, products: int) -> int:
    """Matrix-product FLOPs of attention: ``2 * D`` per pair and product, square or causal."""
    b, h, s_q, d_q = q_shape
    s_k = k_shape[-2]
    d_v = v_shape[-1]
    pairs = _causal_sdpa_pairs(s_q, s_k) if causal else s_q * s_k
    per_pair = d_q + d_v  # fwd: scores (d_q) + values (d_v)
    if products == 5:  # bwd: scores, dP (d_v), dV (d_v), dQ (d_q), dK (d_q)
        per_pair = 3 * d_q + 2 * d_v
    return 2 * b * h * pairs * per_pair


def _flop_mapping(causal_aware: bool) -> dict:
    """Formulas for the counter: the CPU fused SDPA kernels, and (causal-aware) all SDPA kernels."""
    aten = torch.ops.aten
    # op -> (is_causal position among the positional args, forward or backward, shapes positions)
    table = [
        (aten._scaled_dot_product_flash_attention_for_cpu, 4, 2, (0, 1, 2)),
        (aten._scaled_dot_product_flash_attention_for_cpu_backward, 7, 5, (1, 2, 3)),
    ]
    if causal_aware:
        table += [
            (aten._scaled_dot_product_flash_attention, 4, 2, (0, 1, 2)),
            (aten._scaled_dot_product_efficient_attention, 6, 2, (0, 1, 2)),
            (aten._scaled_dot_product_cudnn_attention, 6, 2, (0, 1, 2)),
            (aten._scaled_dot_product_flash_attention_backward, 11, 5, (1, 2, 3)),
            (aten._scaled_dot_product_efficient_attention_backward, 11, 5, (1, 2, 3)),
            (aten._scaled_dot_product_cudnn_attention_backward, 14, 5, (1, 2, 3)),
        ]
    mapping = {}
    for op, causal_at, products, (iq, ik, iv) in table:

        def formula(*args, _c=causal_at, _p=products, _s=(iq, ik, iv), out_shape=None, **kwargs):
            causal = causal_aware and bool(_arg(args, kwargs, _c, "is_causal", False))
            return _sdpa_flops(args[_s[0]], args[_s[1]], args[_s[2]], causal, _p)

        mapping[op] = formula
    return mapping


def _count_flops(run: Callable[[], None], causal_aware: bool) -> int | None:
    from torch.utils.flop_counter import FlopCounterMode

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with FlopCounterMode(display=False, custom_mapping=_flop_mapping(causal_aware)) as counter:
                run()
    except Exception:  # the counter cannot trace this backend (e.g. compiled FlexAttention)
        return None
    return int(counter.get_total_flops())


def _ideal_flops(
    windows: Sequence[int], seq_len: int, batch: int, head_dim: int, backward: bool, sink_tokens: int = 0
) -> int:
    pairs = sum(causal_pairs(w, seq_len, sink_tokens=sink_tokens) for w in windows)
    products = 7 if backward else 2
    return 2 * head_dim * products * pairs * batch


# ---------------------------------------------------------------- the benchmark

def _check_positive(value: Any, option: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{option} must be a positive integer, got {value!r}")
    return value


def bench_attention(
    seq_len: int = 4096,
    heads: int = 8,
    kv_heads: int | None = None,
    head_dim: int = 64,
    batch: int = 1,
    dtype: str | torch.dtype = "float32",
    backends: Sequence[str] | None = None,
    backward: bool = False,
    repeats: int = 7,
    windows: Sequence[int] | None = None,
    mix: str | None = None,
    warmup: int = 2,
    device: str | torch.device | None = None,
    seed: int = 0,
    sink_tokens: int = 0,
) -> dict:
    """Time and count every backend against full causal SDPA; returns a JSON-ready dict.

    ``windows`` (one per head) or ``mix`` (a name in :data:`MIXES`) sets the
    windows; with neither, ``full_adaptive``. ``backends=None`` runs every
    registered backend that can run the request on ``device``. The ``sdpa``
    baseline (all windows = T) always runs and is the first row. ``sink_tokens``
    keeps the first positions visible in every windowed backend.
    """
    seq_len = _check_positive(seq_len, "--seq-len")
    try:
        sinks = check_sink_tokens(sink_tokens)
    except ValueError:
        raise ValueError(f"--sink-tokens must be an integer >= 0, got {sink_tokens!r}") from None
    heads = _check_positive(heads, "--heads")
    kv_heads = heads if kv_heads is None else _check_positive(kv_heads, "--kv-heads")
    if heads % kv_heads:
        raise ValueError(f"--heads ({heads}) must be a multiple of --kv-heads ({kv_heads})")
    head_dim = _check_positive(head_dim, "--head-dim")
    batch = _check_positive(batch, "--batch")
    repeats = _check_positive(repeats, "--repeats")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"warmup must be a non-negative integer, got {warmup!r}")
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
        dtype_name, torch_dtype = dtype, DTYPES[dtype]
    else:
        names = {v: k for k, v in DTYPES.items()}
        if dtype not in names:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}; got {dtype}")
        dtype_name, torch_dtype = names[dtype], dtype
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"--device: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but CUDA is not available; use --device cpu")

    if windows is not None and mix is not None:
        raise ValueError("give either --windows or --mix, not both")
    if windows is None:
        mix = mix or "full_adaptive"
        wins = mix_windows(mix, heads, seq_len)
    else:
        try:
            wins = tuple(int(w) for w in as_window_tensor(windows, name="--windows").tolist())
        except ValueError as exc:
            raise ValueError(str(exc)) from None
        if len(wins) != heads:
            raise ValueError(f"--windows needs {heads} values (one per head, --heads), got {len(wins)}")

    known = backend_names()
    sink_request = (wins, seq_len, sinks) if sinks else None
    if backends is None:
        chosen = default_backends(dev, backward, torch_dtype, sink_request)
    else:
        chosen = []
        for name in backends:
            if name not in known:
                raise ValueError(f"--backends: unknown backend {name!r}; choose from {', '.join(known)}")
            if name == "sdpa":
                continue  # the baseline runs anyway
            reason = _cannot_run(name, dev, backward, torch_dtype, sink_request)
            if reason is not None:
                raise ValueError(f"--backends: {reason}")
            if name not in chosen:
                chosen.append(name)
    full = tuple([seq_len] * heads)
    runs: list[tuple[str, tuple[int, ...]]] = [("sdpa", full)] + [(n, wins) for n in chosen]

    gen = torch.Generator().manual_seed(seed)
    shape_q = (batch, heads, seq_len, head_dim)
    shape_kv = (batch, kv_heads, seq_len, head_dim)
    q = torch.randn(shape_q, generator=gen).to(dev, torch_dtype).requires_grad_(backward)
    k = torch.randn(shape_kv, generator=gen).to(dev, torch_dtype).requires_grad_(backward)
    v = torch.randn(shape_kv, generator=gen).to(dev, torch_dtype).requires_grad_(backward)
    grad = torch.randn(shape_q, generator=gen).to(dev, torch_dtype)
    scale = 1.0 / math.sqrt(head_dim)

    extra = {"sink_tokens": sinks} if sinks else {}

    def make_call(name: str, run_windows: tuple[int, ...]) -> Callable[[], None]:
        backend = get_backend(name)

        def call() -> None:
            if backward:
                out = backend.attend(q, k, v, run_windows, scale, **extra)
                torch.autograd.grad(out, (q, k, v), grad)
            else:
                with torch.no_grad():
                    backend.attend(q, k, v, run_windows, scale, **extra)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)

        return call

    calls = {name: make_call(name, w) for name, w in runs}
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {name: [] for name in calls}
    names = list(calls)
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            calls[name]()
            times[name].append((time.perf_counter() - start) * 1e3)

    rows = []
    for name, run_windows in runs:
        rows.append(
            {
                "backend": name,
                "windows": list(run_windows),
                "median_ms": statistics.median(times[name]),
                "times_ms": times[name],
                "acr": acr(run_windows, seq_len, sink_tokens=sinks),
                "causal_coverage": causal_coverage(run_windows, seq_len, sink_tokens=sinks),
                "executed_coverage": executed_coverage(name, run_windows, seq_len, sink_tokens=sinks),
                "counted_flops": _count_flops(calls[name], causal_aware=False),
                "counted_flops_causal": _count_flops(calls[name], causal_aware=True),
                "ideal_flops": _ideal_flops(run_windows, seq_len, batch, head_dim, backward, sinks),
            }
        )
    base = rows[0]
    for row in rows:
        row["ratio_to_sdpa"] = row["median_ms"] / base["median_ms"]
        # The same ratio round by round (each round times every backend once): its
        # quartiles show how much of the spread is the machine rather than the backend.
        paired = sorted(t / b for t, b in zip(row["times_ms"], base["times_ms"]))
        row["paired_ratio_quartiles"] = _quartiles(paired)
        counted, base_counted = row["counted_flops_causal"], base["counted_flops_causal"]
        row["flops_ratio"] = counted / base_counted if counted is not None and base_counted else None
        row["counted_over_ideal"] = counted / row["ideal_flops"] if counted is not None else None
    return {
        "config": {
            "seq_len": seq_len,
            "heads": heads,
            "kv_heads": kv_heads,
            "head_dim": head_dim,
            "batch": batch,
            "dtype": dtype_name,
            "device": str(dev),
            "backward": backward,
            "repeats": repeats,
            "warmup": warmup,
            "mix": mix,
            "windows": list(wins),
            "sink_tokens": sinks,
            "acr": acr(wins, seq_len, sink_tokens=sinks),
            "causal_coverage": causal_coverage(wins, seq_len, sink_tokens=sinks),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "results": rows,
    }


def _quartiles(values: list[float]) -> list[float]:
    """First quartile, median and third quartile (``statistics.quantiles``, inclusive)."""
    if len(values) == 1:
        return [values[0]] * 3
    q1, q2, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q2, q3]


def _gflop(x: int | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f}"


def format_table(result: dict) -> str:
    """A plain-text table of a :func:`bench_attention` result."""
    cfg = result["config"]
    what = "forward+backward" if cfg["backward"] else "forward"
    label = f"mix {cfg['mix']}" if cfg["mix"] else "windows"
    sinks = f", {cfg['sink_tokens']} sink tokens" if cfg.get("sink_tokens") else ""
    lines = [
        f"attention {what}: B={cfg['batch']} H={cfg['heads']} H_kv={cfg['kv_heads']} "
        f"T={cfg['seq_len']} D={cfg['head_dim']} {cfg['dtype']} on {cfg['device']}, "
        f"median of {cfg['repeats']}",
        f"{label}: windows {','.join(str(w) for w in cfg['windows'])}{sinks}  "
        f"(ACR {cfg['acr']:.3f}, causal coverage {cfg['causal_coverage']:.3f})",
        "",
    ]
    header = (
        f"{'backend':<8} {'ms':>9} {'x sdpa':>7} {'ACR':>6} {'causal':>7} {'exec':>6} "
        f"{'GFLOP cnt':>10} {'GFLOP causal':>12} {'FLOPs x':>8} {'GFLOP ideal':>11}"
    )
    lines += [header, "-" * len(header)]
    for row in result["results"]:
        ratio = "-" if row["flops_ratio"] is None else f"{row['flops_ratio']:.3f}"
        lines.append(
            f"{row['backend']:<8} {row['median_ms']:>9.1f} {row['ratio_to_sdpa']:>7.3f} "
            f"{row['acr']:>6.3f} {row['causal_coverage']:>7.3f} {row['executed_coverage']:>6.3f} "
            f"{_gflop(row['counted_flops']):>10} {_gflop(row['counted_flops_causal']):>12} "
            f"{ratio:>8} {_gflop(row['ideal_flops']):>11}"
        )
    lines += [
        "",
        "causal/exec: causal and executed coverage (over the causal triangle); GFLOP cnt: "
        "FlopCounterMode, SDPA counted as the full square; GFLOP causal: the same with causal "
        "SDPA counted as its triangle; FLOPs x: GFLOP causal over the sdpa row's.",
    ]
    return "\n".join(lines)
