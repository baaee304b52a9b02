"""What the plugin refuses before vLLM's engine starts, each as one line naming the windows file.

:func:`aah.vllm.register` runs in every vLLM process. In the front-end process (the one that
builds the engine's configuration: the API server of ``vllm serve``, the process that calls
``vllm.LLM(...)``) it wraps ``EngineArgs.create_engine_config`` so that, once vLLM knows the
model and before it starts the engine core, :func:`check_engine_config` reads the windows file
and checks it against the model and the engine's settings. A refusal is a
:class:`StartupError` whose message is one line: ``aah.vllm: windows file PATH (named by
SOURCE) ...``. The command-line servers exit with that line (no traceback); ``vllm.LLM(...)``
raises it.

In the processes that load the weights, :func:`drop_windows_files` keeps a windows file that
lies beside the weights in the model folder out of vLLM's list of weight files.

Everything here but :func:`check_engine_config` and :func:`install` is plain Python (no vLLM),
so the checks are testable without vLLM.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..hf.bridge.windows_file import check_windows_for, load_windows
from .plan import CONFIG_KEY, ENV_VAR, resolve_windows_path

__all__ = [
    "CLI_CONTEXTS", "CUDA_ATTENTION_BACKEND", "DECODER_KINDS", "WINDOWS_TENSORS", "StartupError", "WindowsSource",
    "attention_backend_setting", "check_engine_config", "check_settings",
    "check_windows_file", "drop_windows_files", "engine_windows_source", "install", "is_windows_file", "model_folder",
    "windows_source",
]

#: vLLM's usage contexts of its command-line servers: there a refusal ends the process with
#: its one line (``SystemExit``) instead of a traceback.
CLI_CONTEXTS = ("OPENAI_API_SERVER", "API_SERVER", "OPENAI_BATCH_RUNNER")


class StartupError(ValueError):
    """A windows file or an engine setting the plugin refuses; the message is one line."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(str(message).split()))


@dataclass(frozen=True)
class WindowsSource:
    """The windows file to serve and what named it (``$AAH_WINDOWS`` or the config key)."""

    path: Path
    named_by: str

    def refuse(self, problem: str) -> StartupError:
        """``aah.vllm: windows file PATH (named by SOURCE) PROBLEM`` as a :class:`StartupError`."""
        return StartupError(f"aah.vllm: windows file {self.path} (named by {self.named_by}) {problem}")


def model_folder(model_config: Any) -> Path | None:
    """The model's local folder (``None`` when vLLM was given a hub name)."""
    model = getattr(model_config, "model", None)
    return Path(str(model)) if model is not None and Path(str(model)).is_dir() else None


def windows_source(model_dir: str | os.PathLike | None, hf_config: Any,
                   hf_overrides: Any = None) -> WindowsSource | None:
    """The windows file the plugin serves and what named it, or ``None`` (vanilla attention);
    see :func:`aah.vllm.plan.resolve_windows_path`. ``hf_overrides`` is vLLM's
    ``--hf-overrides`` (the config key may come from there rather than from ``config.json``)."""
    path = resolve_windows_path(model_dir, hf_config)
    if path is None:
        return None
    if os.environ.get(ENV_VAR, "").strip():
        return WindowsSource(path, f"${ENV_VAR}")
    if isinstance(hf_overrides, dict) and hf_overrides.get(CONFIG_KEY):
        return WindowsSource(path, f'"{CONFIG_KEY}" of --hf-overrides')
    where = Path(model_dir) / "config.json" if model_dir is not None else "the model's config.json"
    return WindowsSource(path, f'"{CONFIG_KEY}" of {where}')


def check_windows_file(source: WindowsSource, hf_config: Any) -> tuple[torch.Tensor, int]:
    """``(windows, sink_tokens)`` of ``source`` checked against the model's ``hf_config``;
    :class:`StartupError` for a missing, unreadable, malformed or damaged file, a directory, or
    a file calibrated for another model."""
    path = source.path
    if path.is_dir():
        raise source.refuse("is a directory, not a windows file")
    if not path.exists():
        raise source.refuse("does not exist")
    if not path.is_file():
        raise source.refuse("is not a regular file")
    names = _header_names(path)
    if names is not None and names not in WINDOWS_TENSORS:  # weights, say: refused without reading them
        shown = ", ".join(sorted(names)[:3]) + (", ..." if len(names) > 3 else "")
        raise source.refuse(f"is not a windows file: it holds {len(names)} tensors ({shown}), a windows file "
                            "holds 'windows' and 'sha256'")
    try:
        windows, meta = load_windows(path)
        check_windows_for(hf_config, windows, meta, str(path))
    except (OSError, ValueError) as exc:
        message = str(exc)
        if isinstance(exc, OSError) and not isinstance(exc, FileNotFoundError):
            message = f"is not readable: {exc.strerror or exc}"
        elif message.startswith(str(path)):
            message = message[len(str(path)):].lstrip()
            if message.startswith(":"):
                message = "is refused" + message
        raise source.refuse(message) from None
    except (AttributeError, TypeError) as exc:  # a model configuration without the fields of the check
        raise source.refuse(f"cannot be checked against this model's configuration ({exc})") from None
    return windows, int(meta["sink_tokens"])


def check_settings(source: WindowsSource, *, platform: str, kv_cache_dtype: str | None, use_mla: bool = False,
                   encoder_decoder: bool = False, attention_free: bool = False,
                   draft_model: str | None = None, attention_backend: str | None = None) -> None:
    """Refuse engine settings the plugin cannot serve with windows (:class:`StartupError`).

    ``attention_backend`` is what :func:`attention_backend_setting` says of the engine's
    attention backend; it matters on the ``cuda`` platform only, where the windows run as
    :data:`CUDA_ATTENTION_BACKEND` (:mod:`aah.vllm.cuda_backend`, not run on a GPU yet).
    """
    if platform == "cuda":
        if attention_backend != CUDA_ATTENTION_BACKEND:
            raise source.refuse(
                f"cannot be served on vLLM's cuda platform: AAH windows run on vLLM's CPU platform only through "
                f"CPU_ATTN, and on cuda only through {CUDA_ATTENTION_BACKEND}; the attention backend here is "
                f"{attention_backend or 'left to vLLM (--attention-backend not given)'}: pass --attention-backend "
                f"{CUDA_ATTENTION_BACKEND} (attention_backend=\"{CUDA_ATTENTION_BACKEND}\" in vllm.LLM)")
    elif platform != "cpu":
        raise source.refuse(f"cannot be served on vLLM's {platform} platform: AAH windows run on vLLM's CPU "
                            f"platform only; unset {ENV_VAR} (and the config key \"{CONFIG_KEY}\")")
    if kv_cache_dtype not in (None, "auto"):
        raise source.refuse(f"cannot be served with kv_cache_dtype={kv_cache_dtype!r}: AAH windows read an "
                            "unquantised KV cache; use kv_cache_dtype='auto'")
    if use_mla:
        raise source.refuse("cannot be served with this model's multi-head latent attention (MLA): AAH windows "
                            "run vLLM's CPU_ATTN backend (FLEX_ATTENTION on cuda) only")
    if encoder_decoder:
        raise source.refuse("cannot be served with an encoder-decoder model: AAH windows run causal decoder "
                            "attention only")
    if attention_free:
        raise source.refuse("cannot be served with an attention-free model")
    if draft_model is not None:
        raise source.refuse(f"cannot be served with speculative decoding by a draft model ({draft_model}): the "
                            "windows are the served model's only")


#: The attention backend the windows run as on vLLM's ``cuda`` platform.
CUDA_ATTENTION_BACKEND = "FLEX_ATTENTION"
#: The kinds of vLLM's per-kind backend overrides (``attention_config.backend_per_kind``) that a
#: decoder layer the windows run in may have.
DECODER_KINDS = ("full_attention", "sliding_window")


def attention_backend_setting(attention_config: Any) -> str | None:
    """The attention backend vLLM's ``attention_config`` names for decoder layers, as one string.

    ``attention_config.backend`` (``--attention-backend``; ``None`` when vLLM chooses), or, when a
    per-kind override (``attention_config.backend_per_kind``) of a decoder kind names another
    backend, that one with the setting that names it.
    """
    def name(backend: Any) -> str | None:
        return None if backend is None else str(getattr(backend, "name", backend))

    default = name(getattr(attention_config, "backend", None))
    per_kind = getattr(attention_config, "backend_per_kind", None) or {}
    for kind in DECODER_KINDS:
        chosen = name(per_kind.get(kind))
        if chosen is not None and chosen != default:
            return f"{chosen} (attention_config.backend_per_kind[{kind!r}])"
    return default


def engine_windows_source(model_config: Any) -> WindowsSource | None:
    """:func:`windows_source` for vLLM's model configuration (its folder, config and overrides)."""
    return windows_source(model_folder(model_config), model_config.hf_config,
                          getattr(model_config, "hf_overrides", None))


def check_engine_config(vllm_config: Any) -> WindowsSource | None:
    """The front-end check of vLLM's engine configuration (vLLM imported): the windows file it
    names, read and checked, and the settings; ``None`` when no windows file is named."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    if model_config is None:
        return None
    source = engine_windows_source(model_config)
    if source is None:
        return None
    platform = "cpu" if current_platform.is_cpu() else str(current_platform.device_name or
                                                           type(current_platform).__name__)
    speculative = getattr(vllm_config, "speculative_config", None)
    draft = getattr(speculative, "draft_model_config", None) if speculative is not None else None
    if draft is model_config:  # n-gram and other proposers without a model of their own
        draft = None
    cache_dtype = getattr(vllm_config.cache_config, "cache_dtype", None)
    check_settings(source, platform=platform, kv_cache_dtype=None if cache_dtype is None else str(cache_dtype),
                   use_mla=bool(getattr(model_config, "use_mla", False)),
                   encoder_decoder=bool(getattr(model_config, "is_encoder_decoder", False)),
                   attention_free=bool(getattr(model_config, "is_attention_free", False)),
                   draft_model=None if draft is None else str(getattr(draft, "model", draft)),
                   attention_backend=attention_backend_setting(getattr(vllm_config, "attention_config", None)))
    check_windows_file(source, model_config.hf_config)
    if platform == "cpu":
        _check_page_layout(source, vllm_config)
    return source


def _check_page_layout(source: WindowsSource, vllm_config: Any) -> None:
    """The page layout the engine's CPU kernel will use, checked as the engine does
    (:func:`aah.vllm.page_layout.keys_transposed`), where the configuration already fixes it."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        from .page_layout import keys_transposed
    except ImportError:  # the engine checks it when it starts
        return
    model_config, cache_config = vllm_config.model_config, vllm_config.cache_config
    block_size = getattr(cache_config, "block_size", None)
    if not isinstance(block_size, int) or not isinstance(model_config.dtype, torch.dtype):
        return
    head_size = model_config.get_head_size()
    try:
        isa = _get_attn_isa(model_config.dtype, block_size, head_size, cache_config.cache_dtype)
        keys_transposed(isa, block_size, head_size, model_config.dtype)
    except (ValueError, NotImplementedError) as exc:
        problem = str(exc).removeprefix("aah.vllm: ")
        raise source.refuse(f"cannot be served with dtype {model_config.dtype} here: {problem}") from None


# ---- windows files beside the weights -------------------------------------------------------

#: The largest safetensors header read to tell a windows file from weights (bytes).
_MAX_HEADER = 1 << 20


@functools.lru_cache(maxsize=256)
def _tensor_names(path: str, size: int, mtime: float) -> frozenset[str] | None:
    del size, mtime  # part of the cache key only
    try:
        with open(path, "rb") as fh:
            (length,) = struct.unpack("<Q", fh.read(8))
            if length > _MAX_HEADER:
                return None
            header = json.loads(fh.read(length))
    except (OSError, ValueError, struct.error):
        return None
    return frozenset(name for name in header if name != "__metadata__") if isinstance(header, dict) else None


#: The tensor names of a windows file (files written before the checksum hold ``windows`` alone).
WINDOWS_TENSORS = (frozenset({"windows"}), frozenset({"windows", "sha256"}))


def _header_names(path: str | os.PathLike) -> frozenset[str] | None:
    """The tensor names in the header of the safetensors file ``path`` (``None``: unreadable)."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return _tensor_names(os.fspath(path), stat.st_size, stat.st_mtime)


def is_windows_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a safetensors file holding exactly the tensors of a windows file
    (``windows``, and ``sha256`` in files that carry it); reads the header only."""
    return _header_names(path) in WINDOWS_TENSORS


def drop_windows_files(files: list[str]) -> list[str]:
    """``files`` (vLLM's weight files) without the windows files among them."""
    return [f for f in files if not (str(f).endswith(".safetensors") and is_windows_file(f))]


# ---- hooks into vLLM ------------------------------------------------------------------------

_HOOKED = "_aah_vllm_hook"


def install() -> None:
    """Wrap ``EngineArgs.create_engine_config`` (the front-end check) and the default weight
    loader's file list (windows files are no weights); each once per process."""
    from vllm.engine.arg_utils import EngineArgs

    create = EngineArgs.create_engine_config
    if not getattr(create, _HOOKED, False):
        @functools.wraps(create)
        def create_engine_config(self, usage_context=None, *args, **kwargs):
            vllm_config = create(self, usage_context, *args, **kwargs)
            try:
                check_engine_config(vllm_config)
            except StartupError as exc:
                if getattr(usage_context, "value", usage_context) in CLI_CONTEXTS:
                    raise SystemExit(str(exc)) from None
                raise
            return vllm_config

        setattr(create_engine_config, _HOOKED, True)
        EngineArgs.create_engine_config = create_engine_config

    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    prepare = DefaultModelLoader._prepare_weights
    if not getattr(prepare, _HOOKED, False):
        @functools.wraps(prepare)
        def _prepare_weights(self, *args, **kwargs):
            folder, files, use_safetensors, index_file = prepare(self, *args, **kwargs)
            kept = drop_windows_files(files)
            if files and not kept:
                raise RuntimeError(f"aah.vllm: {folder} holds a windows file and no model weights")
            return folder, kept, use_safetensors, index_file

        setattr(_prepare_weights, _HOOKED, True)
        DefaultModelLoader._prepare_weights = _prepare_weights
