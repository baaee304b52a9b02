"""Save and load calibrated windows: a safetensors file with the facts needed to trust it.

The file holds one int64 tensor ``windows`` of shape (num_layers, num_query_heads) and string
metadata: the model (its type and shape, so a file for another model is refused), the
sequence length, the policy, the budget, the sink tokens and the coverage figures. A second
tensor, ``sha256`` (32 bytes), is the digest of the windows and the metadata, so that a damaged
or edited file is refused rather than used; files written before it existed hold ``windows``
alone and still load. A file whose ``granularity`` is ``kv_group`` (what ``aah hf calibrate``
writes by default) must give the query heads of each KV head one window; one whose
``granularity`` is ``layer`` must give all the query heads of each layer one window.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from ...data._files import atomic_path
from ...windows import as_window_tensor

__all__ = ["MAX_SINK_TOKENS", "MAX_WINDOW", "REQUIRED_META", "check_windows_for", "load_windows", "model_signature",
           "save_windows"]

#: The tensor holding the file's checksum (:func:`_checksum`).
CHECKSUM = "sha256"
#: Metadata every windows file carries.
REQUIRED_META = ("model", "seq_len", "policy", "budget", "sink_tokens", "acr", "causal_coverage")
#: The largest window a file may hold: 2**24 tokens. A window at or above a model's context
#: means full attention for that head; anything larger is a damaged file.
MAX_WINDOW = 2**24
#: The most sink tokens a file may name.
MAX_SINK_TOKENS = 4096


def model_signature(model_or_config) -> dict[str, Any]:
    """What identifies a model's attention layout: type, layers, query and KV heads, head dim."""
    config = getattr(model_or_config, "config", model_or_config)
    heads = config.num_attention_heads
    return {
        "model_type": config.model_type,
        "num_layers": config.num_hidden_layers,
        "num_query_heads": heads,
        "num_kv_heads": getattr(config, "num_key_value_heads", None) or heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // heads,
    }


def save_windows(path: str | os.PathLike, windows: torch.Tensor, meta: dict[str, Any]) -> Path:
    """Write ``windows`` (L, H) and ``meta`` (JSON-serialisable values) to ``path`` atomically."""
    grid = as_window_tensor(windows)
    if grid.dim() != 2:
        raise ValueError(f"windows must be (num_layers, num_query_heads), got shape {tuple(grid.shape)}")
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing:
        raise ValueError(f"windows metadata lacks {missing}; required: {', '.join(REQUIRED_META)}")
    encoded = {key: json.dumps(value) for key, value in meta.items()}
    digest = torch.tensor(list(bytes.fromhex(_checksum(grid, encoded))), dtype=torch.uint8)
    with atomic_path(path) as tmp:
        save_file({"windows": grid.contiguous(), CHECKSUM: digest}, str(tmp), metadata=encoded)
    return Path(path)


def load_windows(path: str | os.PathLike, model=None) -> tuple[torch.Tensor, dict[str, Any]]:
    """``(windows, meta)`` from a file written by :func:`save_windows`, checked.

    ``ValueError`` (naming the file and the field) for anything but an integer (L, H) tensor of
    windows in ``[1, MAX_WINDOW]`` with readable metadata: ``sink_tokens`` an integer in
    ``[0, MAX_SINK_TOKENS]``, ``seq_len`` an integer >= 1. With ``model`` (or its config) the file
    must also have been made for that model (:func:`check_windows_for`).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"windows file not found: {path}")
    try:
        tensors = load_file(str(path))
        with safe_open(str(path), framework="pt") as handle:
            raw = handle.metadata() or {}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"{path} is not a readable windows file: {exc}") from None
    if set(tensors) not in ({"windows"}, {"windows", CHECKSUM}):
        raise ValueError(f"{path} is not a windows file, or a damaged one (tensors: {sorted(tensors)})")
    try:
        meta = {key: json.loads(value) for key, value in raw.items()}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} has unreadable metadata: {exc}") from None
    missing = [key for key in REQUIRED_META if key not in meta]
    if missing:
        raise ValueError(f"{path} lacks metadata {missing}")
    windows = _checked_windows(tensors["windows"], path)
    if CHECKSUM in tensors and bytes(tensors[CHECKSUM].tolist()).hex() != _checksum(windows, raw):
        raise ValueError(f"{path}: its windows or metadata do not match its sha256; the file is damaged or was edited")
    _check_int(meta, "sink_tokens", 0, MAX_SINK_TOKENS, path)
    _check_int(meta, "seq_len", 1, MAX_WINDOW, path)
    if model is not None:
        check_windows_for(model, windows, meta, str(path))
    return windows, meta


def _checksum(windows: torch.Tensor, encoded: dict[str, str]) -> str:
    """sha256 over the int64 windows and the JSON-encoded metadata (keys sorted)."""
    digest = hashlib.sha256(windows.to(torch.int64).contiguous().numpy().tobytes())
    digest.update(json.dumps(encoded, sort_keys=True).encode())
    return digest.hexdigest()


def _checked_windows(tensor: torch.Tensor, path: Path) -> torch.Tensor:
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{path}: windows must be an integer tensor, got {tensor.dtype}")
    if tensor.dim() != 2 or 0 in tensor.shape:
        raise ValueError(f"{path}: windows must be (num_layers, num_query_heads), got shape {tuple(tensor.shape)}")
    low, high = int(tensor.min()), int(tensor.max())
    if low < 1 or high > MAX_WINDOW:
        raise ValueError(
            f"{path}: windows must lie in [1, {MAX_WINDOW}] (a window at or above the context means full "
            f"attention), got values in [{low}, {high}]; the file is damaged or not a windows file"
        )
    return as_window_tensor(tensor)


def _check_int(meta: dict[str, Any], key: str, low: int, high: int, path: Path) -> None:
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{path}: metadata {key} must be an integer in [{low}, {high}], got {value!r}")


def check_windows_for(model_or_config, windows: torch.Tensor, meta: dict[str, Any], path: str = "windows") -> None:
    """Raise ``ValueError`` when a windows file (``windows`` and ``meta`` as :func:`load_windows`
    gives them) was made for another model than ``model_or_config``."""
    expected = model_signature(model_or_config)
    if meta.get("model") != expected:
        raise ValueError(f"{path} was calibrated for {meta.get('model')}, not for this model {expected}")
    shape = (expected["num_layers"], expected["num_query_heads"])
    if tuple(windows.shape) != shape:
        raise ValueError(f"{path} holds windows of shape {tuple(windows.shape)}; this model needs {shape}")
    granularity = meta.get("granularity")
    if granularity in ("kv_group", "layer"):
        groups = expected["num_kv_heads"] if granularity == "kv_group" else 1
        group = shape[1] // groups
        for layer, row in enumerate(windows.tolist()):
            for kv in range(groups):
                heads = row[kv * group:(kv + 1) * group]
                if len(set(heads)) > 1:
                    where = f"the query heads of KV head {kv}" if granularity == "kv_group" else "the query heads"
                    unit = "a KV group" if granularity == "kv_group" else "a layer"
                    raise ValueError(
                        f"{path} says granularity {granularity}, but in layer {layer} {where} "
                        f"have different windows {heads} ({granularity} gives the heads of {unit} one window)"
                    )
