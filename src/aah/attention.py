"""The AAH attention module (paper sections 4, 5.1 and 5.8).

Shared Q/K/V projection, rotary positions (optional), the head controller,
the execution backend, flat head concatenation and the output projection.
With the controller disabled it is exactly standard causal multi-head
attention (grouped-query when ``num_kv_heads < num_heads``).
"""

from __future__ import annotations

import torch
from torch import nn

from .backends import attend, resolve_backend
from .controller import ControllerConfig, HeadController
from .decode.cache import LayerKVCache
from .decode.ring_decode import linear

__all__ = ["AAHAttention", "RotaryEmbedding"]


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (rotate-half form) with cached cos/sin tables."""

    def __init__(self, head_dim: int, max_seq_len: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"rotary embedding needs an even head dim, got {head_dim}")
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def forward(self, x: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Rotate ``x`` of shape (B, H, T, D) whose positions are ``offset .. offset + T - 1``."""
        t = x.shape[2]
        if offset < 0 or offset + t > self.cos.shape[0]:
            raise ValueError(
                f"rotary positions {offset}..{offset + t - 1} are outside the table of "
                f"{self.cos.shape[0]} positions"
            )
        cos = self.cos[offset : offset + t].to(x.dtype)
        sin = self.sin[offset : offset + t].to(x.dtype)
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables (positions, head_dim), for the compiled decode step."""
        buffers = self._buffers  # plain dictionary reads: a decode step pays per attribute lookup
        return buffers["cos"], buffers["sin"]


class AAHAttention(nn.Module):
    """Multi-head causal attention whose heads each get their own local window.

    ``controller=None`` (or a disabled config) gives full causal attention;
    otherwise a :class:`HeadController` registered as ``aah_state`` chooses the
    windows. ``backend`` names an execution backend of :mod:`aah.backends`
    (``"auto"``: the fastest one for the device; full attention then uses SDPA).
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        max_seq_len: int,
        controller: ControllerConfig | None = None,
        layer_idx: int = 0,
        rope: bool = True,
        rope_base: float = 10000.0,
        bias: bool = False,
        backend: str = "auto",
    ):
        super().__init__()
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if d_model % num_heads:
            raise ValueError(f"d_model ({d_model}) must be divisible by num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = d_model // num_heads
        self.max_seq_len = max_seq_len
        self.layer_idx = layer_idx
        self.backend = backend
        self.qkv = nn.Linear(d_model, (num_heads + 2 * num_kv_heads) * self.head_dim, bias=bias)
        self.out = nn.Linear(num_heads * self.head_dim, d_model, bias=bias)
        self.rotary = RotaryEmbedding(self.head_dim, max_seq_len, rope_base) if rope else None
        if controller is not None and controller.enabled:
            self.aah_state: HeadController | None = HeadController(
                num_heads, controller, max_seq_len=max_seq_len, layer_idx=layer_idx, num_kv_heads=num_kv_heads
            )
        else:
            self.aah_state = None
        self.backends_used: set[str] = set()
        self.last_windows: tuple[int, ...] = ()

    def forward(self, x: torch.Tensor, *, cache: LayerKVCache | None = None) -> torch.Tensor:
        """Attention output (B, T, d_model) of ``x`` (B, T, d_model).

        With ``cache`` (see :mod:`aah.decode.cache`), ``x`` holds the positions that
        follow the cached prefix; the cache supplies the earlier keys and values
        and the frozen windows, and stores the new ones.
        """
        b, t, _ = x.shape
        offset = 0 if cache is None else cache.length
        if offset + t > self.max_seq_len:
            raise ValueError(f"sequence length {offset + t} exceeds max_seq_len {self.max_seq_len}")
        h, h_kv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = linear(self.qkv, x).view(b, t, h + 2 * h_kv, d)
        if self.rotary is not None:
            # Queries and keys are rotated in one call: (B, T, H + H_kv, D) seen as (B, heads, T, D).
            qk = self.rotary(qkv[:, :, : h + h_kv].transpose(1, 2), offset)
            q, k = qk[:, :h], qk[:, h:]
        else:
            q, k = qkv[:, :, :h].transpose(1, 2), qkv[:, :, h : h + h_kv].transpose(1, 2)
        v = qkv[:, :, h + h_kv :].transpose(1, 2)
        if cache is not None:
            return self._cached_forward(q, k, v, cache)
        if self.aah_state is not None:
            windows = self.aah_state.windows_for(q, k, v)
        else:
            windows = (t,) * h
        backend = self._backend_for(x)
        y = attend(q, k, v, windows, backend=backend)
        if self.aah_state is not None and self.training:
            self.aah_state.watch_output(y)  # the loss_aware policy reads the gradient of y
        self.last_windows = windows
        return linear(self.out, y.transpose(1, 2).reshape(b, t, h * d))

    def check_cache(self, cache: LayerKVCache) -> None:
        """Raise ``ValueError`` unless ``cache`` fits this layer and holds its current windows."""
        layout = (self.num_heads, self.num_kv_heads, self.head_dim)
        if (cache.num_heads, cache.num_kv_heads, cache.head_dim) != layout:
            raise ValueError(
                f"cache layout ({cache.num_heads} heads, {cache.num_kv_heads} KV heads, head dim "
                f"{cache.head_dim}) does not match layer {self.layer_idx} ({layout[0]} heads, "
                f"{layout[1]} KV heads, head dim {layout[2]})"
            )
        windows = self.current_windows(cache.max_len)
        if windows != cache.windows:
            raise ValueError(
                f"layer {self.layer_idx}: the windows changed since the cache was created "
                f"({list(cache.windows)} -> {list(windows)}); create a new cache"
            )

    def _cached_forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: LayerKVCache
    ) -> torch.Tensor:
        b, h, t, d = q.shape
        self.check_cache(cache)
        backend = self._backend_for(q) if cache.length == 0 else "dense"
        y = cache.update_and_attend(q, k, v, backend=backend)
        self.last_windows = cache.windows
        return linear(self.out, y.transpose(1, 2).reshape(b, t, h * d))

    def _backend_for(self, x: torch.Tensor) -> str:
        name = self.backend
        if name == "auto" and self.aah_state is None:
            name = "sdpa"
        name = resolve_backend(name, x.device, needs_backward=torch.is_grad_enabled() and self.training)
        self.backends_used.add(name)
        return name

    def current_windows(self, seq_len: int | None = None) -> tuple[int, ...]:
        """The windows this layer would execute at ``seq_len`` (default: its max length)."""
        t = self.max_seq_len if seq_len is None else seq_len
        if self.aah_state is None:
            return (t,) * self.num_heads
        return self.aah_state.current_windows(t)

    def set_step(self, step: int) -> None:
        if self.aah_state is not None:
            self.aah_state.set_step(step)
