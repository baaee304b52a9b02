"""A nested training state as named tensors plus a JSON structure, so it is stored without pickle.

:func:`encode` walks dicts, lists, tuples, tensors, NumPy arrays and JSON scalars (the optimizer's
state dict, the RNG states of Python, NumPy and torch, the data position, ...). Every tensor is
taken out under the path that leads to it (``optimizer/state/0/exp_avg``) and a reference is left
in its place. What JSON cannot say by itself is tagged:

* ``{"__tensor__": NAME}``: the tensor called NAME;
* ``{"__tuple__": [...]}``: a tuple (Python's and NumPy's RNG states are tuples);
* ``{"__items__": [[KEY, VALUE], ...]}``: a dict whose keys are not all strings (the optimizer's
  parameter ids), or that holds a key a tag uses;
* ``{"__ndarray__": [...], "dtype": DTYPE}``: a numeric NumPy array, as nested lists.

NumPy scalars become Python numbers. :func:`decode` rebuilds the state from the structure and the
tensors and raises :class:`ValueError` on anything it does not describe; neither side runs code
from the data, whoever wrote it.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["encode", "decode"]

TENSOR, TUPLE, ITEMS, NDARRAY = "__tensor__", "__tuple__", "__items__", "__ndarray__"
TAGS = (TENSOR, TUPLE, ITEMS, NDARRAY)
SCALARS = (str, int, float, bool, type(None))


def encode(state: object) -> tuple[object, dict[str, torch.Tensor]]:
    """``(structure, tensors)``: a JSON-ready structure and the CPU tensors it names.

    Tensors that share memory are copied apart (a safetensors file stores each one whole).
    A value of another type raises :class:`TypeError` naming its path.
    """
    tensors: dict[str, torch.Tensor] = {}
    storages: set[int] = set()

    def tensor_ref(value: torch.Tensor, path: str) -> dict:
        name = path or "tensor"
        if name in tensors:
            name = f"{name}#{len(tensors)}"
        value = value.detach().cpu().contiguous()
        ptr = value.untyped_storage().data_ptr()
        if ptr and ptr in storages:
            value = value.clone()
        storages.add(value.untyped_storage().data_ptr())
        tensors[name] = value
        return {TENSOR: name}

    def walk(value: object, path: str) -> object:
        def at(key: object) -> str:
            return f"{path}/{key}" if path else str(key)

        if isinstance(value, torch.Tensor):
            return tensor_ref(value, path)
        if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
            return {NDARRAY: value.tolist(), "dtype": value.dtype.str}
        if isinstance(value, np.generic):
            return walk(value.item(), path)
        if isinstance(value, SCALARS):
            return value
        if isinstance(value, list):
            return [walk(v, at(i)) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            return {TUPLE: [walk(v, at(i)) for i, v in enumerate(value)]}
        if isinstance(value, dict):
            if all(isinstance(k, str) and k not in TAGS for k in value):
                return {k: walk(v, at(k)) for k, v in value.items()}
            return {ITEMS: [[walk(k, path), walk(v, at(k))] for k, v in value.items()]}
        raise TypeError(f"{path or 'the state'}: cannot store a {type(value).__name__} without pickle")

    return walk(state, ""), tensors


def decode(structure: object, tensors: dict[str, torch.Tensor]) -> object:
    """The state that :func:`encode` took apart; :class:`ValueError` if the two do not fit."""
    used: set[str] = set()

    def walk(node: object) -> object:
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            if not isinstance(node, SCALARS):
                raise ValueError(f"unexpected {type(node).__name__} in the structure")
            return node
        if TENSOR in node:
            name = node[TENSOR]
            if not isinstance(name, str) or name not in tensors:
                raise ValueError(f"the structure names a tensor {name!r} that the tensor file lacks")
            used.add(name)
            return tensors[name]
        if TUPLE in node:
            return tuple(walk(v) for v in _list(node[TUPLE], TUPLE))
        if ITEMS in node:
            out = {}
            for pair in _list(node[ITEMS], ITEMS):
                if not isinstance(pair, list) or len(pair) != 2:
                    raise ValueError(f"{ITEMS} holds {pair!r}, not a [key, value] pair")
                key = walk(pair[0])
                if not isinstance(key, (*SCALARS, tuple)):
                    raise ValueError(f"a dict key cannot be a {type(key).__name__}")
                out[key] = walk(pair[1])
            return out
        if NDARRAY in node:
            dtype = np.dtype(str(node.get("dtype")))
            if dtype.kind not in "biuf":
                raise ValueError(f"an array of dtype {dtype} is not numeric")
            return np.array(_list(node[NDARRAY], NDARRAY), dtype=dtype)
        return {k: walk(v) for k, v in node.items()}

    state = walk(structure)
    unnamed = sorted(set(tensors) - used)
    if unnamed:
        raise ValueError(f"the tensor file holds {len(unnamed)} tensor(s) the structure never names ({unnamed[0]!r})")
    return state


def _list(value: object, tag: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{tag} holds a {type(value).__name__}, not a list")
    return value
