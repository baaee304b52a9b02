"""The compiled decode step over per-head-window ring buffers (CPU), built once per machine.

One decode step of :class:`aah.cache.LayerKVCache` is small: a token's query
against, per head, the last ``W`` cached keys (paper section 5.8, windowed
execution at inference). In PyTorch it takes a dozen operator calls (the
query gathered per chunk, one fused attention call, the chunks joined by
their log-sum-exps), whose fixed per-call costs outweigh the keys a short
window saves. ``csrc/ring_decode.cpp`` does the whole step in one call: every
(batch row, head) reads only its window of its KV head's ring, in spans of at
most 256 entries spread over the threads, and the spans of a head are joined
exactly by their maxima and sums.

It is built with ``torch.utils.cpp_extension`` (a C++ compiler and ninja) the
first time a process needs it, into ``$TORCH_EXTENSIONS_DIR`` (default
``~/.cache/torch_extensions``), which takes about a minute once per machine and
torch version; later processes load the built library. Where it cannot be
built, the cache keeps its PyTorch path, with the same results (tested against
each other). ``AAH_RING_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

__all__ = ["decode_step_label", "load", "ring_decode", "unavailable_reason"]

_NAME = "aah_ring_decode"
_SOURCE = Path(__file__).with_name("csrc") / "ring_decode.cpp"
_state: dict[str, object] = {}  # "module" or "error", once tried


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return "DEFAULT"


def _flags() -> list[str]:
    """Optimised, vectorised (``-ffast-math``: the kernel uses no infinities) and threaded; AVX2 where the CPU has it."""
    flags = ["-O3", "-ffast-math", "-fopenmp"]  # OpenMP: ATen's parallel_for runs serially without it
    if _capability().startswith("AVX"):
        flags += ["-mavx2", "-mfma"]
    return flags


def _build_directory() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions"
    )
    tag = f"torch{torch.__version__}_py{sys.version_info.major}{sys.version_info.minor}_{_capability()}"
    return Path(root) / f"{_NAME}_{tag.replace('+', '_').lower()}"


def load():
    """The built extension module, or ``None`` when it is turned off or cannot be built."""
    if os.environ.get("AAH_RING_KERNEL", "1") == "0":
        return None
    if not _state:
        try:
            from torch.utils.cpp_extension import load as load_extension

            build = _build_directory()
            build.mkdir(parents=True, exist_ok=True)
            if not (build / f"{_NAME}.so").exists():
                print("aah: building the compiled decode step (once per machine and torch "
                      f"version, about a minute) in {build}", file=sys.stderr, flush=True)
            _state["module"] = load_extension(
                name=_NAME, sources=[str(_SOURCE)], build_directory=str(build),
                extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, a read-only home: keep the PyTorch path
            _state["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return _state.get("module")


def unavailable_reason() -> str | None:
    """Why :func:`load` gives ``None`` (``None`` when the compiled step is in use)."""
    if os.environ.get("AAH_RING_KERNEL", "1") == "0":
        return "turned off by AAH_RING_KERNEL=0"
    load()
    return _state.get("error")  # type: ignore[return-value]


def decode_step_label(device: torch.device | str) -> str:
    """Which decode step a cache on ``device`` runs: ``compiled`` or ``pytorch (why)``, for reports."""
    reason = unavailable_reason() if torch.device(device).type == "cpu" else "not on CPU"
    return "compiled" if reason is None else f"pytorch ({reason})"


def ring_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ring_start: torch.Tensor,
    capacity: torch.Tensor,
    windows: torch.Tensor,
    length: int,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` (B, H, D) over the last ``min(W_h, length, C)`` entries of each head's ring.

    ``keys`` and ``values`` (B, S, D) hold every KV head's ring, KV head ``g``
    in slots ``ring_start[g] .. ring_start[g] + capacity[g]`` with position
    ``p`` in slot ``p % capacity[g]``; query head ``h`` reads KV head
    ``h // (H // H_kv)`` with window ``windows[h]``; ``length`` positions are
    written (the newest included). Returns (B, H, D). Raises ``RuntimeError``
    when the extension is not available (see :func:`load`).
    """
    module = load()
    if module is None:
        raise RuntimeError(f"the compiled decode step is not available: {unavailable_reason()}")
    return module.ring_decode(q, keys, values, ring_start, capacity, windows, int(length), float(scale))
