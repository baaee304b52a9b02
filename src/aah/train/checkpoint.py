"""Atomic checkpoints with the full AAH state (paper section 7.1's checkpoint protocol).

A checkpoint is one folder ``checkpoints/step_NNNNNNN/`` holding

* ``model.safetensors``: every model tensor, the controllers' ``aah_state``
  buffers (feature EMA, topology, resolution EMA, windows, scorer weights)
  included;
* ``train_state.pt``: optimizer, step, data position and RNG states;
* ``info.json``: step and wall time, for humans.

It is written into a temporary folder and renamed into place, so a crash or a
full disk never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_file, save_model

__all__ = [
    "checkpoint_dir",
    "list_checkpoints",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "rng_state",
    "set_rng_state",
    "full_state_dicts",
    "load_sharded_checkpoint",
]

MODEL_FILE = "model.safetensors"
STATE_FILE = "train_state.pt"
INFO_FILE = "info.json"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run, oldest first, as (step, folder)."""
    root = Path(run_dir) / "checkpoints"
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            if entry.name.startswith("step_") and (entry / INFO_FILE).is_file():
                try:
                    found.append((int(entry.name[5:]), entry))
                except ValueError:
                    continue
    return sorted(found)


def latest_checkpoint(run_dir: Path) -> tuple[int, Path] | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this process's device only
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def save_checkpoint(
    run_dir: Path, step: int, model: torch.nn.Module | dict[str, torch.Tensor], train_state: dict
) -> Path:
    """Write the checkpoint of ``step`` atomically and return its folder.

    ``model`` is a module, or (for a sharded model) its gathered full state dict.
    """
    final = checkpoint_dir(run_dir, step)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        if isinstance(model, dict):
            save_file(_without_shared(model), str(tmp / MODEL_FILE))
        else:
            save_model(model, str(tmp / MODEL_FILE))
        torch.save(train_state, tmp / STATE_FILE)
        (tmp / INFO_FILE).write_text(json.dumps({"step": step, "time": time.time()}) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_checkpoint(folder: Path, model: torch.nn.Module, *, map_location: str | torch.device = "cpu") -> dict:
    """Load weights (and AAH state) into ``model``; return the saved training state."""
    folder = Path(folder)
    if not (folder / MODEL_FILE).is_file():
        raise FileNotFoundError(f"no {MODEL_FILE} in checkpoint {folder}")
    missing, unexpected = load_model(model, str(folder / MODEL_FILE), strict=False, device=str(map_location))
    real_missing = [k for k in missing if not k.endswith("head.weight")]  # tied to the embedding
    if real_missing or unexpected:
        raise RuntimeError(
            f"checkpoint {folder} does not fit the model: missing {real_missing[:5]}, unexpected {unexpected[:5]}"
        )
    state_path = folder / STATE_FILE
    return torch.load(state_path, map_location=map_location, weights_only=False) if state_path.is_file() else {}


def _without_shared(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Keep the first name of tensors that share storage (tied embeddings), contiguous."""
    seen: set[int] = set()
    out = {}
    for name, tensor in weights.items():
        ptr = tensor.untyped_storage().data_ptr()
        if ptr in seen:
            continue
        seen.add(ptr)
        out[name] = tensor.contiguous()
    return out


def full_state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Gather full (unsharded) model and optimizer state dicts on CPU: a collective, every rank calls it."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(model, options=options)
    # Tied parameters (the output head shares the embedding) are stored once, under their
    # first name, as safetensors' save_model does for an unsharded model.
    first: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            weights.pop(name, None)
        else:
            first[id(param)] = name
    return weights, get_optimizer_state_dict(model, optimizer, options=options)


def load_sharded_checkpoint(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load a checkpoint into an FSDP2-sharded model and its optimizer (every rank calls it)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folder = Path(folder)
    weights = load_file(str(folder / MODEL_FILE))
    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=False)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    # set_model_state_dict goes through load_state_dict, so the controllers' load hooks run.
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    return state
