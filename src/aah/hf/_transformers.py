"""Import transformers lazily, with a message that says how to install it."""

from __future__ import annotations

import importlib
from types import ModuleType

INSTALL_HINT = "the Hugging Face bridge needs transformers: pip install -e '.[hf]'"


def require(module: str = "transformers") -> ModuleType:
    """Import ``module`` (a transformers sub-module) or raise ``ImportError`` with the install hint."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.split(".")[0] in {"transformers", "gguf", "accelerate"}:
            raise ImportError(f"{INSTALL_HINT} ({exc.name} is missing)") from exc
        raise
