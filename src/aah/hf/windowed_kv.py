"""The hand-over between an :mod:`aah.hf.cache` layer and the attention function.

transformers calls ``cache.update(k, v, layer_idx)`` and passes what it returns straight to
the attention function. A window cache layer returns this object instead of concatenated
tensors: it carries the new keys and values and their first position, and the layer it
belongs to attends over its rings and then stores them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .cache import WindowCacheLayer


@dataclass
class WindowedKV:
    layer: WindowCacheLayer
    keys: torch.Tensor  # (B, H_kv, T_new, D)
    values: torch.Tensor
    start: int  # absolute position of the first new token

    @property
    def shape(self) -> torch.Size:
        return self.keys.shape
