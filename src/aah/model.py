"""A small decoder-only GPT whose attention is AAH or full (paper section 7.1's model family).

The backbone's initialisation depends only on the global seed: the
controllers draw their scorer weights from private generators, so a
full-attention model and an AAH model built under the same seed have
identical backbone weights, and two regimes differ only in attention.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .attention import AAHAttention
from .controller import ControllerConfig, HeadController
from .controller.budgeted import settle_model_budget
from .controller.warmup import settle_warmup
from .decode.block_step import block_step
from .decode.cache import LayerKVCache, WindowKVCache
from .decode.ring_decode import linear
from .windows import acr, causal_coverage

__all__ = ["GPTConfig", "GPT", "NORMS", "ACTIVATIONS", "POSITIONALS"]

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "relu", "swiglu")
POSITIONALS = ("rope", "learned")


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    n_layers: int = 4
    d_model: int = 256
    n_heads: int = 8
    n_kv_heads: int | None = None
    d_ff: int | None = None  # default 4 * d_model
    max_seq_len: int = 1024
    norm: str = "layernorm"
    activation: str = "gelu"
    positional: str = "rope"
    rope_base: float = 10000.0
    tie_embeddings: bool = True
    dropout: float = 0.0
    bias: bool = False
    backend: str = "auto"

    def __post_init__(self) -> None:
        def fail(name: str, message: str) -> None:
            raise ValueError(f"model.{name}: {message}")

        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "max_seq_len", "d_ff"):
            value = getattr(self, name)
            if value is not None and value < 1:
                fail(name, f"must be >= 1, got {value}")
        if not self.backend:
            fail("backend", "must be a backend name or 'auto', got ''")
        if self.d_model % self.n_heads:
            fail("n_heads", f"must divide d_model ({self.d_model}), got {self.n_heads}")
        kv = self.kv_heads
        if kv < 1 or self.n_heads % kv:
            fail("n_kv_heads", f"must be >= 1 and divide n_heads ({self.n_heads}), got {kv}")
        if self.norm not in NORMS:
            fail("norm", f"must be one of {', '.join(NORMS)}; got {self.norm!r}")
        if self.activation not in ACTIVATIONS:
            fail("activation", f"must be one of {', '.join(ACTIVATIONS)}; got {self.activation!r}")
        if self.positional not in POSITIONALS:
            fail("positional", f"must be one of {', '.join(POSITIONALS)}; got {self.positional!r}")
        if not 0.0 <= self.dropout < 1.0:
            fail("dropout", f"must be in [0, 1), got {self.dropout}")
        if self.positional == "rope" and (self.d_model // self.n_heads) % 2:
            fail("positional", "rope needs an even head dim (d_model / n_heads)")

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ff_dim(self) -> int:
        return 4 * self.d_model if self.d_ff is None else self.d_ff

    def to_dict(self) -> dict:
        return asdict(self)


def _norm(kind: str, dim: int) -> nn.Module:
    return nn.LayerNorm(dim) if kind == "layernorm" else nn.RMSNorm(dim)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.activation = cfg.activation
        up = 2 * cfg.ff_dim if cfg.activation == "swiglu" else cfg.ff_dim
        self.up = nn.Linear(cfg.d_model, up, bias=cfg.bias)
        self.down = nn.Linear(cfg.ff_dim, cfg.d_model, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation == "swiglu":
            gate, value = linear(self.up, x).chunk(2, dim=-1)
            h = F.silu(gate) * value
        else:  # the activation applied by the projection (fused in a decode step)
            h = linear(self.up, x, self.activation)
        return linear(self.down, h)


class Block(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: GPTConfig, controller: ControllerConfig | None, layer_idx: int):
        super().__init__()
        self.norm1 = _norm(cfg.norm, cfg.d_model)
        self.attn = AAHAttention(
            cfg.d_model,
            cfg.n_heads,
            cfg.kv_heads,
            max_seq_len=cfg.max_seq_len,
            controller=controller,
            layer_idx=layer_idx,
            rope=cfg.positional == "rope",
            rope_base=cfg.rope_base,
            bias=cfg.bias,
            backend=cfg.backend,
        )
        self.norm2 = _norm(cfg.norm, cfg.d_model)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, *, cache: LayerKVCache | None = None) -> torch.Tensor:
        if cache is not None and x.shape[1] == 1:
            y = block_step(self, x, cache)  # the decode engine's compiled step, where it applies
            if y is not None:
                return y
        x = x + self.dropout(self.attn(self.norm1(x), cache=cache))
        return x + self.dropout(self.mlp(self.norm2(x)))


class GPT(nn.Module):
    """Decoder-only language model; ``controller`` (None = full attention) is shared by all layers."""

    def __init__(self, cfg: GPTConfig, controller: ControllerConfig | None = None):
        super().__init__()
        self.config = cfg
        self.controller_config = controller if controller is not None and controller.enabled else None
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.positional == "learned" else None
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg, self.controller_config, i) for i in range(cfg.n_layers))
        self.norm = _norm(cfg.norm, cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        self._init_backbone()

    def _init_backbone(self) -> None:
        # GPT-2 style: N(0, 0.02), residual output projections scaled by 1/sqrt(2L).
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, HeadController):
                continue
            if isinstance(module, nn.Linear):
                std = residual_std if name.endswith(("attn.out", "mlp.down")) else 0.02
                nn.init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        cache: WindowKVCache | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits (B, T, V) and, with ``targets``, the mean next-token cross-entropy.

        With ``cache`` (from :meth:`new_cache`), ``idx`` holds the next token(s)
        after the cached prefix, at absolute positions ``cache.length ..``; the
        first call may pass the whole prompt (prefill). Inference only: the
        model must be in evaluation mode. See :mod:`aah.decode.cache`.
        """
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (batch, length), got {tuple(idx.shape)}")
        b, t = idx.shape
        offset = 0
        if cache is not None:
            self._check_cache(cache)
            cache.check_step(b, t)
            offset = cache.length
        if offset + t > self.config.max_seq_len:
            raise ValueError(f"sequence length {offset + t} exceeds max_seq_len {self.config.max_seq_len}")
        x = self.embed(idx)
        if self.pos_embed is not None:
            x = x + self.pos_embed(torch.arange(offset, offset + t, device=idx.device))
        x = self.dropout(x)
        for i, block in enumerate(self.blocks):
            x = block(x, cache=None if cache is None else cache.layers[i])
        if self.training and self.controller_config is not None and self.controller_config.budget_scope == "model":
            settle_model_budget(self.controllers())  # one budget for all layers (aah.budget_scope=model)
        logits = linear(self.head, self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

    # ------------------------------------------------------------------ decoding
    def new_cache(
        self,
        batch_size: int,
        max_len: int | None = None,
        *,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> WindowKVCache:
        """An empty per-window KV cache for decoding up to ``max_len`` positions (default max_seq_len).

        The current windows are frozen into the cache; see :mod:`aah.decode.cache`.
        """
        limit = self.config.max_seq_len
        max_len = limit if max_len is None else max_len
        if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
            raise ValueError(f"max_len must be a positive int, got {max_len!r}")
        if max_len > limit:
            raise ValueError(f"max_len {max_len} exceeds the model's max_seq_len {limit}")
        weight = self.embed.weight
        dtype = weight.dtype if dtype is None else dtype
        device = weight.device if device is None else device
        return WindowKVCache([
            LayerKVCache(attn.current_windows(max_len), attn.num_kv_heads, attn.head_dim, batch_size=batch_size,
                         max_len=max_len, dtype=dtype, device=device)
            for attn in self.attention_layers()
        ])

    def _check_cache(self, cache: WindowKVCache) -> None:
        if not isinstance(cache, WindowKVCache):
            raise TypeError(f"cache must be a WindowKVCache (see GPT.new_cache), got {type(cache).__name__}")
        if self.training:
            raise ValueError("decoding with a cache is inference only; call model.eval() first")
        if len(cache.layers) != len(self.blocks):
            raise ValueError(f"the cache has {len(cache.layers)} layers but the model has {len(self.blocks)}")
        for attn, layer_cache in zip(self.attention_layers(), cache.layers):
            attn.check_cache(layer_cache)

    # ------------------------------------------------------------------ AAH access
    def attention_layers(self) -> list[AAHAttention]:
        return [block.attn for block in self.blocks]

    def controllers(self) -> list[HeadController]:
        return [a.aah_state for a in self.attention_layers() if a.aah_state is not None]

    def set_step(self, step: int) -> int | None:
        """Tell every controller the optimizer step (the trainer calls this before each step).

        Returns ``step`` when a far-cost warm-up ended here (:mod:`aah.controller.warmup`), else None.
        """
        for attn in self.attention_layers():
            attn.set_step(step)
        return settle_warmup(self.controllers(), step)

    def aah_windows(self, seq_len: int | None = None) -> torch.Tensor:
        """Current execution windows, LongTensor (layers, heads), at ``seq_len`` (default max length)."""
        return torch.tensor([a.current_windows(seq_len) for a in self.attention_layers()], dtype=torch.long)

    def coverage(self, seq_len: int | None = None) -> dict:
        """ACR and causal coverage, overall and per layer, of the current windows."""
        t = self.config.max_seq_len if seq_len is None else seq_len
        w = self.aah_windows(t)
        return {
            "acr": acr(w, t),
            "causal_coverage": causal_coverage(w, t),
            "acr_per_layer": [acr(row, t) for row in w],
            "causal_coverage_per_layer": [causal_coverage(row, t) for row in w],
        }

    def levels_used(self) -> float:
        """Mean hierarchy levels used over layers (0 for full attention)."""
        ctrls = self.controllers()
        return sum(c.levels_used() for c in ctrls) / len(self.blocks) if ctrls else 0.0

    def backends_used(self) -> list[str]:
        return sorted(set().union(*(a.backends_used for a in self.attention_layers())))

    def num_parameters(self, trainable_only: bool = True) -> int:
        params = {id(p): p for p in self.parameters() if p.requires_grad or not trainable_only}
        return sum(p.numel() for p in params.values())
