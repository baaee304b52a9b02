"""Atomic checkpoints with the full AAH state (paper section 7.1's checkpoint protocol).

A checkpoint is one folder ``checkpoints/step_NNNNNNN/`` holding

* ``model.safetensors``: every model tensor, the controllers' ``aah_state``
  buffers (feature EMA, topology, resolution EMA, windows, scorer weights)
  included;
* ``train_state.safetensors`` and ``train_state.json``: optimizer, step, data
  position and RNG states (every rank's under ``torchrun``): the tensors, and
  the structure with everything else (see :mod:`aah.train.state_codec`);
* ``info.json``: step, wall time and the manifest: the size and sha256 of
  every other file of the folder.

Nothing is unpickled: a run folder from anyone can be evaluated, sampled from
and resumed without running code it holds. Older versions wrote the training
state as a pickle (``train_state.pt``); :func:`read_train_state` refuses it
(:class:`PickledStateError`) unless the caller says it trusts the folder.
Evaluation and generation read the weights only (``with_state=False``), so a
missing or damaged training state does not stop them.

It is written into a temporary folder and renamed into place, so a crash or a
full disk never leaves a half-written checkpoint behind. Loading verifies the
manifest first: a truncated, altered or missing file makes the checkpoint
*bad* (:class:`CheckpointError`, naming the file and what is wrong), and
:func:`newest_good_checkpoint` falls back to the newest checkpoint that
verifies. The manifest catches damage, not malice: whoever writes a folder
can rewrite its manifest too. A checkpoint written before manifests existed
(``info.json`` without ``files``) is loaded unverified, with a warning; if its
files cannot be read it counts as bad like any other.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, load_model, save_file, save_model

from .state_codec import decode, encode

__all__ = [
    "CheckpointError",
    "PickledStateError",
    "checkpoint_dir",
    "verify_checkpoint",
    "newest_good_checkpoint",
    "checkpoint_at",
    "list_checkpoints",
    "latest_checkpoint",
    "save_checkpoint",
    "load_checkpoint",
    "load_weights",
    "read_train_state",
    "rng_state",
    "set_rng_state",
    "full_state_dicts",
    "load_sharded_checkpoint",
]

MODEL_FILE = "model.safetensors"
STATE_JSON = "train_state.json"
STATE_TENSORS = "train_state.safetensors"
#: The training state as older versions wrote it: a pickle, read only when trusted.
PICKLED_STATE_FILE = "train_state.pt"
INFO_FILE = "info.json"
#: Version of the checkpoint layout; 2 adds the ``files`` manifest, 3 the training state without pickle.
FORMAT = 3


class CheckpointError(Exception):
    """A checkpoint that is missing, incomplete or damaged; the message says which file and why."""


class PickledStateError(CheckpointError):
    """A training state written by an older version as a pickle, which was not trusted."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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


def _read_info(folder: Path) -> dict:
    path = folder / INFO_FILE
    if not path.is_file():
        raise CheckpointError(f"{INFO_FILE} is missing (the checkpoint was never completed)")
    try:
        info = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{INFO_FILE} cannot be read ({exc})") from None
    if not isinstance(info, dict):
        raise CheckpointError(f"{INFO_FILE} does not hold a JSON object")
    return info


def _state_files(names) -> list[str]:
    """The files of the training state among ``names``: the pair, or an older version's pickle."""
    if PICKLED_STATE_FILE in names and STATE_JSON not in names:
        return [PICKLED_STATE_FILE]
    return [STATE_JSON, STATE_TENSORS]


def verify_checkpoint(folder: Path, *, with_state: bool = True) -> bool:
    """Check the files of ``folder`` against its manifest: every file, or with
    ``with_state=False`` the weights only (what evaluation and generation read).

    Returns True when the manifest verified, False for an older checkpoint without a
    manifest (its files exist but cannot be checked); raises :class:`CheckpointError`
    naming the first problem otherwise.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"no such checkpoint folder {folder}")
    info = _read_info(folder)
    files = info.get("files")
    if files is None:  # written before manifests: check presence and the safetensors lengths only
        needed = [MODEL_FILE, *_state_files(os.listdir(folder))] if with_state else [MODEL_FILE]
        for name in needed:
            if not (folder / name).is_file():
                raise CheckpointError(f"{name} is missing")
        for name in needed:
            if name.endswith(".safetensors"):
                _check_safetensors_length(folder / name)
        return False
    if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
        raise CheckpointError(f"the manifest in {INFO_FILE} is not a table of files")
    needed = [MODEL_FILE, *_state_files(files)] if with_state else [MODEL_FILE]
    if any(name not in files for name in needed):
        raise CheckpointError(f"the manifest in {INFO_FILE} does not list {' and '.join(needed)}")
    if not with_state:
        files = {MODEL_FILE: files[MODEL_FILE]}
    for name, entry in sorted(files.items()):
        if Path(name).name != name:
            raise CheckpointError(f"the manifest in {INFO_FILE} names {name!r}, which is not a file of the folder")
        path = folder / name
        if not path.is_file():
            raise CheckpointError(f"{name} is missing")
        size = path.stat().st_size
        if size != entry.get("bytes"):
            raise CheckpointError(f"{name} has {size} bytes, the manifest records {entry.get('bytes')} (truncated?)")
        if sha256_file(path) != entry.get("sha256"):
            raise CheckpointError(f"{name} does not match its sha256 in the manifest (the file is damaged)")
    return True


def _check_safetensors_length(path: Path) -> None:
    """A safetensors file is an 8-byte header length, a JSON header and the tensor bytes it
    describes: a file of another length was cut short (or grew)."""
    size = path.stat().st_size
    try:
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            if header_len <= 0 or 8 + header_len > size:
                raise ValueError("header runs past the end of the file")
            header = json.loads(fh.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, IndexError) as exc:
        raise CheckpointError(f"{path.name} is not a readable safetensors file ({exc})") from None
    if 8 + header_len + end != size:
        raise CheckpointError(f"{path.name} has {size} bytes, its header describes {8 + header_len + end} (truncated?)")


def _step_folders(run_dir: Path) -> list[tuple[int, Path]]:
    """Every ``step_N`` folder of a run, complete or not, newest first."""
    root = Path(run_dir) / "checkpoints"
    found = []
    if root.is_dir():
        for entry in root.iterdir():
            if entry.is_dir() and entry.name.startswith("step_") and entry.name[5:].isdigit():
                found.append((int(entry.name[5:]), entry))
    return sorted(found, reverse=True)


def _warn(message: str) -> None:
    print(message, file=sys.stderr)


def newest_good_checkpoint(
    run_dir: Path, *, warn: Callable[[str], None] | None = _warn, with_state: bool = True
) -> tuple[int, Path, list[dict]]:
    """The newest checkpoint of ``run_dir`` that verifies, as (step, folder, skipped).

    ``with_state=False`` checks the weights only (see :func:`verify_checkpoint`). ``skipped`` lists the newer checkpoints passed over, each ``{"step", "reason"}``;
    ``warn`` (stderr by default, None for silence) is told about each one and about an
    unverified older checkpoint. Raises :class:`CheckpointError` when none verifies.
    """
    skipped: list[dict] = []
    folders = _step_folders(run_dir)
    if not folders:
        raise CheckpointError(f"{run_dir} has no checkpoint")
    for step, folder in folders:
        try:
            verified = verify_checkpoint(folder, with_state=with_state)
        except CheckpointError as exc:
            skipped.append({"step": step, "reason": str(exc)})
            if warn is not None:
                warn(f"skipping checkpoint step {step} ({folder}): {exc}")
            continue
        if not verified and warn is not None:
            warn(f"checkpoint step {step} has no manifest (written by an older version): loading it unverified")
        return step, folder, skipped
    reasons = "; ".join(f"step {s['step']}: {s['reason']}" for s in skipped)
    raise CheckpointError(f"no checkpoint of {run_dir} verifies ({reasons})")


def checkpoint_at(
    run_dir: Path, step: int, *, warn: Callable[[str], None] | None = _warn, with_state: bool = True
) -> Path:
    """The checkpoint folder of ``step``, verified (its weights only with ``with_state=False``);
    :class:`CheckpointError` names what is wrong."""
    folder = checkpoint_dir(run_dir, step)
    if not folder.is_dir():
        have = sorted(s for s, _ in _step_folders(run_dir))
        raise CheckpointError(f"no checkpoint at step {step} in {run_dir}; available steps: {have or 'none'}")
    try:
        verified = verify_checkpoint(folder, with_state=with_state)
    except CheckpointError as exc:
        raise CheckpointError(f"checkpoint step {step} ({folder}) is bad: {exc}") from None
    if not verified and warn is not None:
        warn(f"checkpoint step {step} has no manifest (written by an older version): loading it unverified")
    return folder


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

    ``model`` is a module, or (for a sharded model) its gathered full state dict; ``train_state``
    is anything :func:`~aah.train.state_codec.encode` stores.
    """
    structure, tensors = encode(train_state)
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
        save_file(tensors, str(tmp / STATE_TENSORS))
        (tmp / STATE_JSON).write_text(json.dumps(structure) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        # The manifest is hashed from the synced files, so it records what is on disk.
        files = {
            f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)} for f in sorted(tmp.iterdir())
        }
        info = {"format": FORMAT, "step": step, "time": time.time(), "files": files}
        with open(tmp / INFO_FILE, "w") as fh:
            fh.write(json.dumps(info, indent=2, sort_keys=True) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _read_failure(folder: Path, name: str, exc: BaseException) -> CheckpointError:
    return CheckpointError(f"checkpoint {folder}: {name} cannot be read ({type(exc).__name__}: {exc})")


def read_train_state(folder: Path, *, trust_pickled_state: bool = False) -> dict:
    """The training state of a checkpoint, on CPU, read without unpickling anything.

    A state that an older version pickled (``train_state.pt``) raises :class:`PickledStateError`
    unless ``trust_pickled_state``: unpickling runs whatever code the file holds. Files that cannot
    be read, or do not describe a state, raise :class:`CheckpointError` naming the file.
    """
    folder = Path(folder)
    if _state_files(os.listdir(folder)) == [PICKLED_STATE_FILE]:
        return _read_pickled_state(folder, trust_pickled_state)
    for name in (STATE_JSON, STATE_TENSORS):
        if not (folder / name).is_file():
            raise CheckpointError(f"checkpoint {folder}: {name} is missing")
    try:
        structure = json.loads((folder / STATE_JSON).read_text())
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _read_failure(folder, STATE_JSON, exc) from None
    try:
        tensors = load_file(str(folder / STATE_TENSORS))
    except (OSError, ValueError, RuntimeError, SafetensorError) as exc:
        raise _read_failure(folder, STATE_TENSORS, exc) from None
    try:
        state = decode(structure, tensors)
    except (ValueError, TypeError, RecursionError) as exc:
        raise CheckpointError(f"checkpoint {folder}: {STATE_JSON} does not fit {STATE_TENSORS} ({exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {folder}: {STATE_JSON} does not hold a JSON object")
    return state


def _read_pickled_state(folder: Path, trusted: bool) -> dict:
    path = folder / PICKLED_STATE_FILE
    if not trusted:
        raise PickledStateError(
            f"{path} is an older version's pickled training state: reading it would unpickle it, which can "
            "run any code it holds; if you trust whoever wrote this run folder, resume with --trust-pickled-state "
            "(the next checkpoint is saved without pickle)"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=False)
    except Exception as exc:  # a damaged pickle raises anything from EOFError to UnpicklingError
        raise _read_failure(folder, PICKLED_STATE_FILE, exc) from None


def load_weights(folder: Path, model: torch.nn.Module, *, map_location: str | torch.device = "cpu") -> None:
    """Load a checkpoint's weights (and AAH state) into ``model``: all that evaluation needs.

    The caller verifies the folder first (:func:`newest_good_checkpoint`, :func:`checkpoint_at`);
    a file that still fails to read (an unverified older checkpoint) or a checkpoint of another
    model shape raises :class:`CheckpointError`.
    """
    folder = Path(folder)
    if not (folder / MODEL_FILE).is_file():
        raise CheckpointError(f"checkpoint {folder}: {MODEL_FILE} is missing")
    try:
        missing, unexpected = load_model(model, str(folder / MODEL_FILE), strict=False, device=str(map_location))
    except (OSError, ValueError, SafetensorError) as exc:
        raise _read_failure(folder, MODEL_FILE, exc) from None
    except RuntimeError as exc:  # a tensor of another shape
        raise CheckpointError(f"checkpoint {folder} does not fit the model: {str(exc).splitlines()[0]}") from None
    real_missing = [k for k in missing if not k.endswith("head.weight")]  # tied to the embedding
    if real_missing or unexpected:
        raise CheckpointError(
            f"checkpoint {folder} does not fit the model: missing {real_missing[:5]}, unexpected {unexpected[:5]}"
        )


def load_checkpoint(
    folder: Path, model: torch.nn.Module, *, map_location: str | torch.device = "cpu",
    trust_pickled_state: bool = False,
) -> dict:
    """Load weights into ``model`` (:func:`load_weights`) and return the training state
    (:func:`read_train_state`, read first, so a refused state leaves the model untouched)."""
    state = read_train_state(folder, trust_pickled_state=trust_pickled_state)
    load_weights(folder, model, map_location=map_location)
    return state


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


def load_sharded_checkpoint(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, trust_pickled_state: bool = False
) -> dict:
    """Load a checkpoint into an FSDP2-sharded model and its optimizer (every rank calls it);
    return the training state (see :func:`read_train_state`)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    folder = Path(folder)
    state = read_train_state(folder, trust_pickled_state=trust_pickled_state)
    try:
        weights = load_file(str(folder / MODEL_FILE))
    except (OSError, ValueError, SafetensorError) as exc:
        raise _read_failure(folder, MODEL_FILE, exc) from None
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=options)
    # set_model_state_dict goes through load_state_dict, so the controllers' load hooks run.
    set_optimizer_state_dict(model, optimizer, state["optimizer"], options=StateDictOptions(full_state_dict=True))
    return state
