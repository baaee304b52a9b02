"""Turn a GGUF checkpoint into a safetensors transformers folder, once.

Loading a GGUF file de-quantizes every tensor (about a minute for SmolLM2-135M on two CPU
cores); the converted folder reloads in about a second and needs neither ``gguf`` nor the
network. The quantization entry is dropped from the config, so the folder holds plain weights
in ``dtype``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ._transformers import require

__all__ = ["convert_gguf"]


def convert_gguf(gguf_file: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32) -> Path:
    """Write ``gguf_file``'s model (and tokenizer, when it has one) to ``out_dir`` as safetensors."""
    source = Path(gguf_file)
    if not source.is_file():
        raise FileNotFoundError(f"GGUF file not found: {source}")
    if source.suffix != ".gguf":
        raise ValueError(f"expected a .gguf file, got {source.name}")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; choose a new folder")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers = require()
    require("gguf")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=dtype
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    plain.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out, safe_serialization=True)
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except (OSError, ValueError, KeyError):
        tokenizer = None  # a GGUF without tokenizer metadata still converts
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out
