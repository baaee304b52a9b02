"""AAH windows in vLLM (optional extra: ``pip install -e '.[vllm]'``).

A ``vllm.general_plugins`` entry point (``aah = aah.vllm:register``) that vLLM runs in each of
its processes. :func:`register` puts :class:`aah.vllm.backend.AAHCPUAttentionBackend` in place
of vLLM's CPU attention backend. The windows file made by ``aah hf calibrate`` is named by the
environment variable ``AAH_WINDOWS`` or by the key ``aah_windows`` of the model's
``config.json``; without one, vLLM runs unchanged.

:mod:`aah.vllm.plan` (windows, sinks, tensor-parallel slices) and :mod:`aah.vllm.paged`
(per-head windows with sinks over the paged KV cache) import no vLLM.
"""

from __future__ import annotations

import os

from .plan import CONFIG_KEY, ENV_VAR

__all__ = ["BACKEND", "CONFIG_KEY", "ENV_VAR", "register"]

#: The class vLLM loads in place of its ``CPU_ATTN`` backend.
BACKEND = "aah.vllm.backend.AAHCPUAttentionBackend"


def register() -> None:
    """The entry point: override vLLM's CPU attention backend (refused on other platforms when
    ``AAH_WINDOWS`` is set, since those backends would ignore the windows)."""
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if os.environ.get(ENV_VAR, "").strip() and not current_platform.is_cpu():
        raise RuntimeError(
            f"aah.vllm: {ENV_VAR} is set, but AAH windows run on vLLM's CPU platform only "
            f"(this is {current_platform.device_name or type(current_platform).__name__}); unset {ENV_VAR}"
        )
    register_backend(AttentionBackendEnum.CPU_ATTN, BACKEND)
