"""``auto``: per-shape choice among the exact windowed backends, calibrated once per machine.

The backend-realized local attention of the AAH-v3 paper (section 7.7) only
pays when the kernel that skips the work is also fast at the shape at hand,
and which kernel is fastest depends on the sequence length, the head
dimension, the batch and the windows. The first time a shape is seen, this
backend times every exact backend that can run it (a short interleaved
timing: one warm-up, then the median of a few rounds) and keeps the fastest.
The choice is cached in memory and on disk, so a machine calibrates a shape
once. Geometry: that of the backend it picks; every candidate computes the rule of
:func:`aah.windows.visible` exactly.

* Candidates: ``strips`` and ``banded`` on CPU; ``flash``, ``flex`` and
  ``banded`` on CUDA; plus ``sdpa`` when every window covers the sequence.
  Only backends that can run the request (device, dtype, backward, sinks)
  compete.
* Shape key: device, dtype, batch (rounded up to a power of two), heads, KV
  heads, length (rounded up to one of eight steps per octave), head dim, the
  set of distinct windows (``full`` for any that covers the length), the sink tokens (only when
  ``S > 0``: keys without sinks are those of before), and whether a backward
  pass is needed; the disk entry adds the host name, thread count, torch
  version and :data:`PLAN_REVISION` (a new revision times every shape again).
* Cache file: ``$AAH_CACHE_DIR/backend_choices.json``, by default
  ``~/.cache/aah/backend_choices.json``. ``AAH_AUTO_CALIBRATE=0`` skips the
  timing and takes the first candidate of the list above.
* :func:`auto_choices` lists the choices this process made (the trainer
  writes them to ``meta.json``).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .base import AttentionBackend, BackendUnavailable
from .sinks import sink_span

__all__ = ["AutoBackend", "auto_choices", "auto_label", "cache_path", "candidates", "length_bucket", "shape_key"]

_CANDIDATES = {"cpu": ("strips", "banded"), "cuda": ("flash", "flex", "banded")}
_LOW_PRECISION_ONLY = {"flash"}
_WARMUP = 1
_ROUNDS = 3

_choices: dict[str, str] = {}  # shape key -> backend, this process
_disk: dict[str, dict] | None = None  # the cache file's entries, loaded lazily


def cache_path() -> Path:
    """Where calibrated choices are stored: ``$AAH_CACHE_DIR`` or ``~/.cache/aah``."""
    root = os.environ.get("AAH_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "aah")
    return Path(root) / "backend_choices.json"


def length_bucket(n: int) -> int:
    """``n`` rounded up to the next of eight steps per octave (4080 -> 4096, 8179 -> 8192).

    Lengths this close rank the backends alike, so prompts of 8,179 and 8,182 tokens share one
    timing instead of paying a calibration each (a prompt set of a hundred lengths would).
    """
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def _length_and_windows(windows: tuple[int, ...], seq_len: int) -> tuple[str, str]:
    """The key parts of a length and its windows: ``T<bucket>`` and the distinct windows, each
    one that covers the whole sequence written ``full`` (what it means at every length)."""
    distinct = sorted({w for w in windows if w < seq_len})
    names = [str(w) for w in distinct] + (["full"] if any(w >= seq_len for w in windows) else [])
    return f"T{length_bucket(seq_len)}", "W" + ",".join(names)


def shape_key(
    q: torch.Tensor, k: torch.Tensor, windows: tuple[int, ...], needs_backward: bool, sink_tokens: int = 0
) -> str:
    """The key of a request: device, dtype, B, H, H_kv, T, D, window set, sinks (if any), direction.

    The batch is rounded up to a power of two and the length to :func:`length_bucket`, so that
    requests that differ by a few rows or tokens share a choice.
    """
    b, h, t, d = q.shape
    length, wins = _length_and_windows(windows, t)
    batch = 1 << max(b - 1, 0).bit_length()
    direction = "fwd+bwd" if needs_backward else "fwd"
    dtype = str(q.dtype).replace("torch.", "")
    sinks = f"|S{sink_tokens}" if sink_tokens else ""
    return f"{q.device.type}|{dtype}|B{batch}|H{h}|KV{k.shape[1]}|{length}|D{d}|{wins}{sinks}|{direction}"


#: Revision of the backends' execution plans: raised when a backend's speed can change
#: (its plan, not only its numbers), so that choices calibrated before are timed again.
PLAN_REVISION = 3


def _machine_key(key: str) -> str:
    return (f"{platform.node()}|threads{torch.get_num_threads()}|torch{torch.__version__}"
            f"|plans{PLAN_REVISION}|{key}")


def candidates(
    device: torch.device, dtype: torch.dtype, windows: tuple[int, ...], seq_len: int, needs_backward: bool,
    sink_tokens: int = 0,
) -> list[str]:
    """Exact windowed backends that can run this request, in preference order."""
    from . import get_backend

    names = list(_CANDIDATES.get(device.type, ("banded",)))
    if any(sink_span(w, seq_len, sink_tokens) for w in windows):
        names = [n for n in names if get_backend(n).supports_sink_tokens]
    if all(w >= seq_len for w in windows):
        names.append("sdpa")
    out = []
    for name in names:
        backend = get_backend(name)
        if backend.unavailable_reason(device) is not None:
            continue
        if needs_backward and not backend.supports_backward(device):
            continue
        if name in _LOW_PRECISION_ONLY and dtype not in (torch.float16, torch.bfloat16):
            continue
        out.append(name)
    return out


def _load_disk() -> dict[str, dict]:
    global _disk
    if _disk is None:
        try:
            _disk = json.loads(cache_path().read_text())
            if not isinstance(_disk, dict):
                _disk = {}
        except (OSError, ValueError):
            _disk = {}
    return _disk


def _save_disk(key: str, entry: dict) -> None:
    disk = _load_disk()
    disk[key] = entry
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(disk, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass  # a read-only home keeps the in-memory choice; nothing else depends on the file


def _calibrate(
    names: list[str], q: torch.Tensor, k: torch.Tensor, windows: tuple[int, ...], scale: float,
    needs_backward: bool, sink_tokens: int = 0,
) -> tuple[str, dict[str, float]]:
    """Time ``names`` on random inputs of this shape, interleaved; the fastest and the medians."""
    from . import get_backend

    gen = torch.Generator(device="cpu").manual_seed(0)
    shapes = (q.shape, k.shape, k.shape)
    q_c, k_c, v_c = (
        torch.randn(s, generator=gen).to(q.device, q.dtype).requires_grad_(needs_backward) for s in shapes
    )
    grad = torch.randn(q.shape, generator=gen).to(q.device, q.dtype)
    sync = torch.cuda.synchronize if q.device.type == "cuda" else (lambda: None)

    def make(name: str) -> Callable[[], None]:
        backend = get_backend(name)
        extra = {"sink_tokens": sink_tokens} if sink_tokens else {}

        def call() -> None:
            if needs_backward:
                with torch.enable_grad():
                    out = backend.attend(q_c, k_c, v_c, windows, scale, **extra)
                    torch.autograd.grad(out, (q_c, k_c, v_c), grad)
            else:
                with torch.no_grad():
                    backend.attend(q_c, k_c, v_c, windows, scale, **extra)
            sync()

        return call

    calls: dict[str, Callable[[], None]] = {}
    for name in names:
        call = make(name)
        try:
            for _ in range(_WARMUP):
                call()
        except (BackendUnavailable, RuntimeError, NotImplementedError):
            continue  # cannot run this request after all
        calls[name] = call
    if not calls:
        raise BackendUnavailable(f"no backend among {names} could run this request")
    times: dict[str, list[float]] = {name: [] for name in calls}
    order = list(calls)
    for rnd in range(_ROUNDS):
        shift = rnd % len(order)
        for name in order[shift:] + order[:shift]:
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    return min(medians, key=medians.__getitem__), medians


def choose(
    q: torch.Tensor, k: torch.Tensor, windows: tuple[int, ...], scale: float, needs_backward: bool,
    sink_tokens: int = 0,
) -> str:
    """The backend ``auto`` runs for this request: cached, or calibrated now."""
    key = shape_key(q, k, windows, needs_backward, sink_tokens)
    names = candidates(q.device, q.dtype, windows, q.shape[2], needs_backward, sink_tokens)
    name = _choices.get(key)
    if name is not None and name in names:  # a key spans lengths; the choice must run this one
        return name
    if not names:
        name = "dense"
    elif len(names) == 1 or os.environ.get("AAH_AUTO_CALIBRATE", "1") == "0":
        name = names[0]
    else:
        entry = _load_disk().get(_machine_key(key))
        if isinstance(entry, dict) and entry.get("backend") in names:
            name = entry["backend"]
        else:
            name, medians = _calibrate(names, q, k, windows, scale, needs_backward, sink_tokens)
            _save_disk(_machine_key(key), {
                "backend": name, "median_ms": {n: round(t * 1e3, 3) for n, t in medians.items()},
                "calibrated": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            })
    _choices[key] = name
    return name


def auto_choices() -> dict[str, str]:
    """Shape key -> backend for every shape ``auto`` has run in this process."""
    return dict(_choices)


def auto_label(backends: list[str]) -> str:
    """``backends`` joined by commas, with ``auto`` spelled as ``auto(<chosen backends>)``."""
    chosen = sorted(set(_choices.values()))
    parts = [f"auto({'/'.join(chosen)})" if name == "auto" and chosen else name for name in backends]
    return ",".join(parts)


def _forget() -> None:
    """Drop the in-memory choices and the loaded cache file (tests)."""
    global _disk
    _choices.clear()
    _disk = None


class AutoBackend(AttentionBackend):
    name = "auto"
    description = "per shape, the fastest exact windowed backend, calibrated once and cached on disk"

    def unavailable_reason(self, device):
        device = torch.device(device)
        if not candidates(device, torch.float16, (1,), 2, False) and not candidates(
            device, torch.float32, (1,), 2, False
        ):
            return f"no exact windowed backend runs on {device.type}"
        return None

    def supports_backward(self, device):
        device = torch.device(device)
        return bool(candidates(device, torch.float16, (1,), 2, True)
                    or candidates(device, torch.float32, (1,), 2, True))

    def attend(self, q, k, v, windows, scale, sink_tokens=0):
        from . import get_backend

        needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        name = choose(q, k, windows, scale, needs_backward, sink_tokens)
        if not sink_tokens:
            return get_backend(name).attend(q, k, v, windows, scale)
        return get_backend(name).attend(q, k, v, windows, scale, sink_tokens=sink_tokens)

    def executed_coverage(self, windows, seq_len, sink_tokens=0):
        """Coverage of the backend chosen for these windows (and sinks) at ``seq_len`` (the
        latest such choice of this process), else of the first CPU candidate."""
        from . import get_backend

        length, wins = _length_and_windows(tuple(windows), seq_len)
        sinks = f"S{sink_tokens}"
        name = None
        for key, chosen in _choices.items():
            parts = key.split("|")
            has_sinks = sinks in parts if sink_tokens else not any(p.startswith("S") for p in parts)
            if length in parts and wins in parts and has_sinks:
                name = chosen
        backend = get_backend(name or _CANDIDATES["cpu"][0])
        if not sink_tokens:
            return backend.executed_coverage(windows, seq_len)
        return backend.executed_coverage(windows, seq_len, sink_tokens=sink_tokens)
