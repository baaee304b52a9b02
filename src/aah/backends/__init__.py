"""Attention execution: a registry of backends by name and the ``attend`` entry point.

Every backend computes the same function, local causal attention with one
window per head (:mod:`aah.windows`), optionally with sink tokens (the first
``S`` keys stay visible; :mod:`aah.backends.sinks`), and is tested forward and backward against
the float64 reference masked by :func:`aah.windows.visible`.
Backends register themselves with :func:`register_backend`; callers only name
them, so new backends need no change anywhere else.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Sequence

import torch

from ..windows import check_sink_tokens, window_tuple
from .base import AttentionBackend, BackendUnavailable, expand_kv
from .sinks import sink_span

__all__ = [
    "AttentionBackend",
    "BackendUnavailable",
    "attend",
    "backend_names",
    "backend_takes_sinks",
    "executed_coverage",
    "expand_kv",
    "get_backend",
    "register_backend",
    "resolve_backend",
]

_REGISTRY: dict[str, AttentionBackend] = {}

# Modules that define the built-in backends, imported on first use of the registry.
_BUILTIN_MODULES = ("dense", "sdpa", "banded", "strips", "flex", "flash", "auto")
_loaded = False



def register_backend(backend: AttentionBackend, *, replace: bool = False) -> AttentionBackend:
    """Add ``backend`` to the registry under ``backend.name``."""
    if not backend.name:
        raise ValueError("a backend needs a non-empty name")
    if backend.name == "auto" and type(backend).__module__ != f"{__name__}.auto":
        raise ValueError("'auto' is reserved for automatic backend choice")
    if backend.name in _REGISTRY and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered")
    _REGISTRY[backend.name] = backend
    return backend


def _load_builtins() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for module in _BUILTIN_MODULES:
        try:
            mod = importlib.import_module(f"{__name__}.{module}")
        except ModuleNotFoundError as exc:
            if exc.name == f"{__name__}.{module}":
                continue  # not written yet in this build
            raise
        for obj in vars(mod).values():
            if (
                isinstance(obj, type)
                and issubclass(obj, AttentionBackend)
                and obj is not AttentionBackend
                and obj.__module__ == mod.__name__
                and obj.name
                and obj.name not in _REGISTRY
            ):
                register_backend(obj())


def backend_names() -> list[str]:
    """Names of all registered backends (available on this machine or not)."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    """The backend registered as ``name``; ``ValueError`` listing the known names otherwise."""
    _load_builtins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; registered backends: "
            f"{', '.join(backend_names())} (or 'auto')"
        ) from None


def resolve_backend(name: str, device: torch.device | str, *, needs_backward: bool = False) -> str:
    """Turn ``name`` into the name of a backend that can run on ``device``.

    ``"auto"`` stays ``"auto"`` (it picks per shape when it runs, see
    :mod:`aah.backends.auto`) when some exact windowed backend can run on the
    device, else it is ``"dense"``. A named backend that cannot run raises
    ``BackendUnavailable``: never a silent fallback.
    """
    device = torch.device(device)
    _load_builtins()
    if name == "auto":
        auto = _REGISTRY["auto"]
        if auto.unavailable_reason(device) is None and (not needs_backward or auto.supports_backward(device)):
            return "auto"
        return "dense"
    backend = get_backend(name)
    reason = backend.unavailable_reason(device)
    if reason is not None:
        raise BackendUnavailable(f"backend {name!r} cannot run on {device}: {reason}")
    if needs_backward and not backend.supports_backward(device):
        raise BackendUnavailable(
            f"backend {name!r} has no backward pass on {device.type}; use it for inference only "
            f"(under torch.no_grad()) or pick another backend"
        )
    return name


def backend_takes_sinks(name: str, windows: Sequence[int], seq_len: int, sink_tokens: int) -> bool:
    """Whether backend ``name`` runs these windows with ``sink_tokens`` (``auto`` always does:
    it leaves out the backends that cannot). Sinks that every window already covers change
    nothing, so any backend takes them."""
    if name == "auto" or not any(sink_span(int(w), seq_len, sink_tokens) for w in windows):
        return True
    return get_backend(name).supports_sink_tokens


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    for label, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{label} must have shape (B, H, T, D), got {tuple(t.shape)}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    b, h, t, d = q.shape
    if k.shape[0] != b or k.shape[2] != t or k.shape[3] != d:
        raise ValueError(
            f"k/v shape {tuple(k.shape)} does not match q shape {tuple(q.shape)} "
            "in batch, length or head dim"
        )
    if h % k.shape[1] != 0:
        raise ValueError(f"query heads ({h}) must be divisible by KV heads ({k.shape[1]})")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    windows: torch.Tensor | Sequence[int],
    *,
    backend: str = "dense",
    scale: float | None = None,
    sink_tokens: int = 0,
) -> torch.Tensor:
    """Causal local attention with one window per query head.

    ``q`` is (B, H, T, D); ``k`` and ``v`` are (B, H_kv, T, D) with ``H``
    divisible by ``H_kv`` (grouped-query attention). ``windows`` holds ``H``
    positive integers: query ``i`` of head ``h`` sees keys ``i - W_h < j <= i``,
    and with ``sink_tokens = S`` also the sinks ``j < S, j <= i`` (the
    convention of :mod:`aah.windows`). Returns (B, H, T, D).
    """
    _check_qkv(q, k, v)
    wins = window_tuple(windows, num_heads=q.shape[1])
    sinks = check_sink_tokens(sink_tokens)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    needs_backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    name = resolve_backend(backend, q.device, needs_backward=needs_backward)
    if not sinks:
        return _REGISTRY[name].attend(q, k, v, wins, float(scale))
    return _REGISTRY[name].attend(q, k, v, wins, float(scale), sink_tokens=sinks)


def executed_coverage(
    backend: str, windows: torch.Tensor | Sequence[int], seq_len: int, *, sink_tokens: int = 0
) -> float:
    """The fraction of causal-triangle score work ``backend`` computes for these windows (and sinks)."""
    sinks = check_sink_tokens(sink_tokens)
    if not sinks:
        return get_backend(backend).executed_coverage(window_tuple(windows), seq_len)
    return get_backend(backend).executed_coverage(window_tuple(windows), seq_len, sink_tokens=sinks)
