"""AAH inside pretrained Hugging Face causal LMs (optional extra: ``pip install -e '.[hf]'``).

``patch(model, windows, sink_tokens=4)`` gives every query head of every layer its own causal
window (plus ``S`` always-visible sink tokens) through transformers' ``AttentionInterface``;
``unpatch`` undoes it. ``new_cache(model)`` is a KV cache that keeps only each head's window
and sinks; a patched model's ``generate`` uses one unless it is given another cache.
``new_cache(model, kept_keys=KeptKeys(tail, keys))`` also lets the prompt's last tokens read
everything and keeps, per KV head, the far keys they read most (``patch(model, windows,
kept_keys=...)`` gives them to the cache ``generate`` builds).
``calibrate(model, batches, policy=...)`` chooses the windows on real text (``aah_v3``,
``uniform`` or ``budgeted``, the last by lost mass, by the estimated KL each window adds, or by
that plus an answer loss on synthetic retrieval, optionally repaired by ``repair_windows``);
``save_windows`` / ``load_windows`` keep them in a safetensors file with their metadata
(``check_windows_for`` checks a file against a model; ``patch(model, "w.safetensors")`` takes
the file's windows and sink tokens).
``convert_gguf`` turns a GGUF checkpoint into a safetensors folder once, so that later loads
are fast and fully offline.

The package has four rooms, imported one way: ``bridge/`` (the windows a layer runs, their
masks, the attention function, ``patch``, the window cache, ``generate``, the compiled step
adapter, kept keys, windows files), ``calibration/`` (the window policies), ``evaluation/``
(perplexity, speed and KV bytes; retrieval tasks; the lm-eval model type) and ``cli/`` (the
``aah hf`` commands). The names load lazily, so ``import aah.hf`` works (and says what to
install) without transformers.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "AAH_IMPLEMENTATION": "bridge.attention",
    "LayerWindows": "bridge.spec",
    "patch": "bridge.patch",
    "patched_windows": "bridge.spec",
    "patched_kept_keys": "bridge.generation",
    "executed_coverage": "bridge.spec",
    "unpatch": "bridge.patch",
    "WindowCacheLayer": "bridge.cache",
    "cache_memory_bytes": "bridge.cache",
    "cache_route": "bridge.cache",
    "new_cache": "bridge.cache",
    "KeptKeys": "bridge.kept_keys",
    "executed_read_coverage": "bridge.kept_keys",
    "convert_gguf": "convert",
    "calibrate": "calibration.policies",
    "measure_lost_mass": "calibration.policies",
    "measure_window_kl": "calibration.window_kl",
    "measure_answer_loss": "calibration.answer_loss",
    "calibration_sequences": "calibration.answer_loss",
    "repair_windows": "calibration.repair",
    "save_windows": "bridge.windows_file",
    "load_windows": "bridge.windows_file",
    "check_windows_for": "bridge.windows_file",
    "MAX_WINDOW": "bridge.windows_file",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'aah.hf' has no attribute {name!r}")
    return getattr(importlib.import_module(f".{module}", __name__), name)
