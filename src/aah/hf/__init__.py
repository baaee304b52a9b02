"""AAH inside pretrained Hugging Face causal LMs (optional extra: ``pip install -e '.[hf]'``).

``patch(model, windows, sink_tokens=4)`` gives every query head of every layer its own causal
window (plus ``S`` always-visible sink tokens) through transformers' ``AttentionInterface``;
``unpatch`` undoes it. ``convert_gguf`` turns a GGUF checkpoint into a safetensors folder once,
so that later loads are fast and fully offline.
"""

from __future__ import annotations

from .convert import convert_gguf
from .patch import AAH_IMPLEMENTATION, LayerWindows, patch, patched_windows, unpatch

__all__ = ["AAH_IMPLEMENTATION", "LayerWindows", "convert_gguf", "patch", "patched_windows", "unpatch"]
