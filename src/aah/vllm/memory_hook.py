"""The hook that lets each attention layer report a KV cache spec following its windows.

:func:`install` (run by :func:`aah.vllm.register` in every vLLM process) wraps
``Attention.get_kv_cache_spec``. The wrapper leaves the spec as vLLM made it unless the layer runs
the plugin's attention with a windows file and vLLM's hybrid KV cache manager is on
(``--disable-hybrid-kv-cache-manager`` keeps every layer's full memory); then it returns
:func:`aah.vllm.kv_memory.memory_spec`. :mod:`aah.vllm.kv_memory` (which subclasses vLLM's KV
cache classes) is imported only then, in the processes that build the model.
"""

from __future__ import annotations

import functools

__all__ = ["install"]

_HOOKED = "_aah_kv_memory_hook"


def install() -> None:
    """Wrap ``Attention.get_kv_cache_spec`` once per process."""
    from vllm.model_executor.layers.attention.attention import Attention

    original = Attention.get_kv_cache_spec
    if getattr(original, _HOOKED, False):
        return

    @functools.wraps(original)
    def get_kv_cache_spec(self, vllm_config):
        spec = original(self, vllm_config)
        served = getattr(getattr(self, "impl", None), "served", None)
        if spec is None or served is None or vllm_config.scheduler_config.disable_hybrid_kv_cache_manager:
            return spec
        from vllm.model_executor.models.utils import extract_layer_index

        from .kv_memory import memory_spec

        index = extract_layer_index(self.layer_name)
        return memory_spec(spec, served.windows[index].tolist(), served.sink_tokens,
                           vllm_config.model_config.max_model_len)

    setattr(get_kv_cache_spec, _HOOKED, True)
    Attention.get_kv_cache_spec = get_kv_cache_spec
