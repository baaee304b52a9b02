"""AAH inside pretrained Hugging Face causal LMs (optional extra: ``pip install -e '.[hf]'``).

``patch(model, windows, sink_tokens=4)`` gives every query head of every layer its own causal
window (plus ``S`` always-visible sink tokens) through transformers' ``AttentionInterface``;
``unpatch`` undoes it. ``new_cache(model)`` is a KV cache that keeps only each head's window
and sinks; a patched model's ``generate`` uses one unless it is given another cache.
``new_cache(model, kept_keys=KeptKeys(tail, keys))`` also lets the prompt's last tokens read
everything and keeps, per KV head, the far keys they read most.
``calibrate(model, batches, policy=...)`` chooses the windows on real text (``aah_v3``,
``uniform`` or ``budgeted``, the last by lost mass, by the estimated KL each window adds, or by
that plus an answer loss on synthetic retrieval, optionally repaired by ``repair_windows``);
``save_windows`` / ``load_windows`` keep them in a safetensors file with their metadata
(``check_windows_for`` checks a file against a model; ``patch(model, "w.safetensors")`` takes
the file's windows and sink tokens).
``convert_gguf`` turns a GGUF checkpoint into a safetensors folder once, so that later loads
are fast and fully offline.

The names load lazily, so ``import aah.hf`` works (and says what to install) without
transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AAH_IMPLEMENTATION": "patching",
    "LayerWindows": "patching",
    "patch": "patching",
    "patched_windows": "patching",
    "executed_coverage": "patching",
    "unpatch": "patching",
    "WindowCacheLayer": "cache",
    "cache_memory_bytes": "cache",
    "cache_route": "cache",
    "new_cache": "cache",
    "KeptKeys": "kept_keys",
    "convert_gguf": "convert",
    "calibrate": "calibration",
    "measure_lost_mass": "calibration",
    "measure_window_kl": "loss_estimate",
    "measure_answer_loss": "retrieval_calibration",
    "calibration_sequences": "retrieval_calibration",
    "repair_windows": "retrieval_repair",
    "save_windows": "windows_file",
    "load_windows": "windows_file",
    "check_windows_for": "windows_file",
    "MAX_WINDOW": "windows_file",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aah.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
