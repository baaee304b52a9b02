"""AAH windows in vLLM (optional extra: ``pip install -e '.[vllm]'``).

A ``vllm.general_plugins`` entry point (``aah = aah.vllm:register``) that vLLM runs in each of
its processes. :func:`register` puts :class:`aah.vllm.backend.AAHCPUAttentionBackend` in place
of vLLM's CPU attention backend and, on vLLM's ``cuda`` platform,
:class:`aah.vllm.cuda_backend.AAHFlexAttentionBackend` in place of its ``FLEX_ATTENTION``
backend (written and tested on CPU, not run on a GPU yet). The windows file made by ``aah hf calibrate`` is named by the
environment variable ``AAH_WINDOWS`` or by the key ``aah_windows`` of the model's
``config.json``; without one, vLLM runs unchanged. :mod:`aah.vllm.startup` checks the windows
file and the engine's settings in the front-end process, before vLLM starts its engine core, and
keeps a windows file in the model folder out of vLLM's weight files. :mod:`aah.vllm.memory_hook`
lets each layer's KV memory follow its windows (:mod:`aah.vllm.kv_memory`: the blocks outside a
layer's sinks and largest window are freed).

:mod:`aah.vllm.plan` (windows, sinks, tensor-parallel slices) and :mod:`aah.vllm.paged`
(per-head windows with sinks over the paged KV cache) import no vLLM.
"""

from __future__ import annotations

from .plan import CONFIG_KEY, ENV_VAR

__all__ = ["BACKEND", "CONFIG_KEY", "CUDA_BACKEND", "ENV_VAR", "on_cuda", "register"]

#: The class vLLM loads in place of its ``CPU_ATTN`` backend.
BACKEND = "aah.vllm.backend.AAHCPUAttentionBackend"
#: The class vLLM loads in place of its ``FLEX_ATTENTION`` backend on its ``cuda`` platform.
CUDA_BACKEND = "aah.vllm.cuda_backend.AAHFlexAttentionBackend"


def on_cuda() -> bool:
    """Whether vLLM runs on its ``cuda`` platform in this process."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def register() -> None:
    """The entry point: override vLLM's CPU attention backend (and, on ``cuda``, its
    FlexAttention backend), and install the start-up checks (:func:`aah.vllm.startup.install`; a
    windows file on another platform than CPU, or on ``cuda`` with another attention backend than
    FlexAttention, is refused there, since those backends would ignore the windows), and the hook
    through which layers report KV cache specs that follow their windows
    (:func:`aah.vllm.memory_hook.install`)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from .memory_hook import install as install_memory_hook
    from .startup import install

    install()
    install_memory_hook()
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
    if on_cuda():
        register_backend(AttentionBackendEnum.FLEX_ATTENTION, CUDA_BACKEND)
