"""The small interface every attention backend implements.

A backend receives validated inputs: ``q`` of shape (B, H, T, D), ``k`` and
``v`` of shape (B, H_kv, T, D) with ``H % H_kv == 0`` (query head ``h`` reads
KV head ``h // (H // H_kv)``), ``windows`` as a tuple of ``H`` positive Python
ints in the convention of :mod:`aah.windows`, the softmax ``scale`` and, as a
keyword only when it is not 0, ``sink_tokens``: the first ``S`` keys stay
visible to every later query (validated, an int ``>= 0``).
"""

from __future__ import annotations

import torch

__all__ = ["AttentionBackend", "BackendUnavailable", "expand_kv"]


class BackendUnavailable(RuntimeError):
    """Raised when a backend cannot run a request on this device or build."""


class AttentionBackend:
    """Base class: subclasses set ``name`` and ``description`` and implement ``attend``."""

    name: str = ""
    description: str = ""
    #: Whether ``attend`` runs ``sink_tokens > 0`` (a backend without raises ``BackendUnavailable``).
    supports_sink_tokens: bool = True

    def unavailable_reason(self, device: torch.device) -> str | None:
        """``None`` when the backend can run on ``device``, else a sentence saying why not."""
        return None

    def supports_backward(self, device: torch.device) -> bool:
        """Whether gradients flow through this backend on ``device``."""
        return True

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        windows: tuple[int, ...],
        scale: float,
        sink_tokens: int = 0,
    ) -> torch.Tensor:
        raise NotImplementedError

    def executed_coverage(self, windows: tuple[int, ...], seq_len: int, sink_tokens: int = 0) -> float:
        """Score work this backend computes for ``windows`` over the full causal triangle."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r}>"


def expand_kv(x: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Repeat KV heads so that query head ``h`` sees KV head ``h // (H // H_kv)``."""
    h_kv = x.shape[1]
    if h_kv == num_heads:
        return x
    return x.repeat_interleave(num_heads // h_kv, dim=1)
