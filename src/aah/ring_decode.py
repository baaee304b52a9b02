"""The compiled decode step (CPU), built once per machine.

One decode step is small: per layer a token's query against, per head, the
last ``W`` cached keys (paper section 5.8, windowed execution at inference),
and one row through each weight matrix. In PyTorch it takes some fifty
operator calls per layer, whose fixed costs outweigh the keys a short window
saves. ``csrc/`` holds the compiled replacements:

* :func:`ring_decode`: attention of one query per head over each head's
  window of its KV head's ring, in spans of at most 256 entries spread over
  the threads and joined exactly by their maxima and sums;
* :func:`ring_decode_packed`: the rotary embedding, the ring write and that
  attention, from a layer's packed QKV projection (:class:`aah.AAHAttention`);
* :func:`linear_rows`: a linear layer for a few rows (:func:`linear` picks it),
  each weight row read once for all rows, with GELU or ReLU applied on the
  way out;
* :func:`decode_block`: a whole pre-norm block of :mod:`aah.model` (norms,
  projections, attention, MLP, residuals) in one call, which is what
  ``GPT.forward`` runs for each layer of a decode step.

The extension is built with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja) the first time a process needs it, into ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), in a folder named after the torch
version, the CPU capability and a hash of the sources and their location. It takes about a
minute once per machine, copy of the package and source version; later processes load the built
library. Where it cannot be built, the PyTorch paths run, with the same
results (tested against each other). ``AAH_RING_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from torch.nn import functional as F
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

__all__ = ["ACTIVATIONS", "LINEAR_ROWS_MAX", "decode_step_label", "linear", "linear_rows", "load", "ring_decode", "ring_decode_packed", "decode_block", "Block", "Rings", "unavailable_reason"]

_NAME = "aah_ring_decode"
_CSRC = Path(__file__).with_name("csrc")
_SOURCES = [_CSRC / "decode_step.cpp"]  # it includes the headers beside it
_state: dict[str, object] = {}  # "module" or "error", once tried


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return "DEFAULT"


def _flags() -> list[str]:
    """Optimised, vectorised (``-ffast-math``: the kernel uses no infinities) and threaded; AVX2 where the CPU has it."""
    flags = ["-O3", "-ffast-math", "-fopenmp"]  # OpenMP: ATen's parallel_for runs serially without it
    if _capability().startswith("AVX"):
        flags += ["-mavx2", "-mfma"]
    return flags


def _build_directory() -> Path:
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "torch_extensions"
    )
    tag = f"torch{torch.__version__}_py{sys.version_info.major}{sys.version_info.minor}_{_capability()}"
    return Path(root) / f"{_NAME}_{tag.replace('+', '_').lower()}_{_source_digest()}"


def _source_digest() -> str:
    """A short hash of the sources and of where they lie.

    A changed kernel builds into a new folder, next to the old one. So does
    another copy of the package (a second checkout, a virtual environment):
    the build records its source paths, so two copies sharing one folder would
    rebuild it in turn, each time the other one had run.
    """
    digest = hashlib.sha256(str(_CSRC.resolve()).encode())
    for source in sorted(_CSRC.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.read_bytes())
    return digest.hexdigest()[:10]


def load():
    """The built extension module, or ``None`` when it is turned off or cannot be built."""
    if os.environ.get("AAH_RING_KERNEL", "1") == "0":
        return None
    if not _state:
        try:
            from torch.utils.cpp_extension import load as load_extension

            build = _build_directory()
            build.mkdir(parents=True, exist_ok=True)
            if not (build / f"{_NAME}.so").exists():
                print("aah: building the compiled decode step (once per machine and torch "
                      f"version, about a minute) in {build}", file=sys.stderr, flush=True)
            _state["module"] = load_extension(
                name=_NAME, sources=[str(s) for s in _SOURCES], build_directory=str(build),
                extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, a read-only home: keep the PyTorch path
            _state["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return _state.get("module")


def unavailable_reason() -> str | None:
    """Why :func:`load` gives ``None`` (``None`` when the compiled step is in use)."""
    if os.environ.get("AAH_RING_KERNEL", "1") == "0":
        return "turned off by AAH_RING_KERNEL=0"
    load()
    return _state.get("error")  # type: ignore[return-value]


def decode_step_label(device: torch.device | str) -> str:
    """Which decode step a cache on ``device`` runs: ``compiled`` or ``pytorch (why)``, for reports."""
    reason = unavailable_reason() if torch.device(device).type == "cpu" else "not on CPU"
    return "compiled" if reason is None else f"pytorch ({reason})"


def ring_decode(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    ring_start: torch.Tensor,
    capacity: torch.Tensor,
    windows: torch.Tensor,
    length: int,
    scale: float,
) -> torch.Tensor:
    """Attention of ``q`` (B, H, D) over the last ``min(W_h, length, C)`` entries of each head's ring.

    ``keys`` and ``values`` (B, S, D) hold every KV head's ring, KV head ``g``
    in slots ``ring_start[g] .. ring_start[g] + capacity[g]`` with position
    ``p`` in slot ``p % capacity[g]``; query head ``h`` reads KV head
    ``h // (H // H_kv)`` with window ``windows[h]``; ``length`` positions are
    written (the newest included). Returns (B, H, D). Raises ``RuntimeError``
    when the extension is not available (see :func:`load`).
    """
    return _module().ring_decode(q, keys, values, ring_start, capacity, windows, int(length), float(scale))


class Rings(NamedTuple):
    """A layer's ring buffers as the compiled steps read them (built once by :class:`aah.cache.LayerKVCache`).

    ``keys``, ``values`` (B, S, D): every KV head's ring, KV head ``g`` in slots
    ``ring_start[g] .. ring_start[g] + capacity[g]``; ``unread`` (1, S): the
    additive mask of slots not written yet (the PyTorch path's); ``windows``
    (H,): each query head's window. The index tensors are int64.
    """

    keys: torch.Tensor
    values: torch.Tensor
    unread: torch.Tensor
    ring_start: torch.Tensor
    capacity: torch.Tensor
    windows: torch.Tensor


def _tables(reference: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary tables for the extension: empty tensors stand for no rotary embedding."""
    if cos is None or sin is None:
        empty = reference.new_empty(0, dtype=torch.float32)
        return empty, empty
    return cos, sin


def ring_decode_packed(
    qkv: torch.Tensor, cos: torch.Tensor | None, sin: torch.Tensor | None, rings: Rings, length: int, scale: float
) -> torch.Tensor:
    """One whole decode step of a layer from its packed QKV projection; returns (B, H * D).

    ``qkv`` (B, (H + 2 H_kv) D) holds the query heads, key heads and value heads
    of position ``length - 1``. With ``cos`` and ``sin`` (the tables of
    :class:`aah.attention.RotaryEmbedding`, (positions, D); ``None`` for no
    rotary embedding) the query and the key are rotated at that position as
    the module does. The key and value go into slot ``(length - 1) % C`` of
    their KV head's ring (and that slot of ``rings.unread`` becomes 0); then
    the query attends as :func:`ring_decode`.
    """
    return _module().ring_decode_packed(qkv, *_tables(qkv, cos, sin), *rings, int(length), float(scale))


class Block(NamedTuple):
    """What :func:`decode_block` needs of a pre-norm block besides its cache (see :class:`aah.model.Block`).

    ``weights``: the 12 tensors ``[norm1 weight, norm1 bias, qkv weight, qkv
    bias, out weight, out bias, norm2 weight, norm2 bias, up weight, up bias,
    down weight, down bias]``, ``None`` where absent; ``norm``: ``layernorm``
    or ``rmsnorm``; ``eps``: the two norms' epsilons; ``activation``: ``gelu``,
    ``relu`` or ``swiglu`` (the up projection gives the gate, then the value).
    """

    weights: list[torch.Tensor | None]
    norm: str
    eps: tuple[float, float]
    activation: str


def decode_block(
    x: torch.Tensor,
    block: Block,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rings: Rings,
    length: int,
    scale: float,
) -> torch.Tensor:
    """One decode step of a pre-norm block, ``x + out(attn(qkv(norm1(x))))`` then ``x + down(act(up(norm2(x))))``.

    ``x`` (B, d_model) at position ``length - 1``; the attention is
    :func:`ring_decode_packed` (the arguments after ``block`` are its own).
    Returns the block's output (B, d_model).
    """
    return _module().decode_block(
        x, block.weights, block.norm, float(block.eps[0]), float(block.eps[1]), block.activation,
        *_tables(x, cos, sin), *rings, int(length), float(scale),
    )


#: Activations :func:`linear_rows` and :func:`linear` can apply to their output.
ACTIVATIONS = ("none", "gelu", "relu")


def linear_rows(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, activation: str = "none"
) -> torch.Tensor:
    """``activation(x @ weight.T + bias)`` for ``x`` (N, I) of a few rows, reading ``weight`` (O, I) once.

    ``activation`` is one of :data:`ACTIVATIONS`; ``gelu`` is the exact (erf) form.
    """
    return _module().linear_rows(x, weight, bias, activation)


def _module():
    module = load()
    if module is None:
        raise RuntimeError(f"the compiled decode step is not available: {unavailable_reason()}")
    return module


def hooks_or_autocast(*modules: torch.nn.Module) -> bool:
    """Whether a forward hook (global or on one of ``modules``) or CPU autocast asks for the module path."""
    if _global_forward_hooks or _global_forward_pre_hooks or torch.is_autocast_enabled("cpu"):
        return True
    return any(m._forward_hooks or m._forward_pre_hooks for m in modules)


#: Up to this many rows, :func:`linear` runs :func:`linear_rows` (on 2 CPU cores it beats the
#: general matrix product up to 8 rows in float32 and 16 in bfloat16; ``aah bench decode``).
LINEAR_ROWS_MAX = 8


def linear(layer: torch.nn.Linear, x: torch.Tensor, activation: str = "none") -> torch.Tensor:
    """``activation(layer(x))``; in inference on CPU, for at most :data:`LINEAR_ROWS_MAX` rows, in :func:`linear_rows`.

    That is a decode step's case: one row per sequence. Anything else (a
    gradient to keep, many rows, another device or dtype, a subclass of
    ``nn.Linear``, forward hooks, autocast, no compiled step) is the layer's
    own forward.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {', '.join(ACTIVATIONS)}; got {activation!r}")
    weight = layer.weight
    rows = x.numel() // weight.shape[1] if weight.shape[1] else 0
    module = None
    if (
        0 < rows <= LINEAR_ROWS_MAX
        and type(layer) is torch.nn.Linear  # a subclass or wrapper may compute something else
        and x.device.type == "cpu"
        and x.dtype == weight.dtype
        and x.dtype in (torch.float32, torch.bfloat16)
        and weight.is_contiguous()
        and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))
        and not hooks_or_autocast(layer)
    ):
        module = load()
    if module is not None:
        y = module.linear_rows(x.reshape(rows, weight.shape[1]).contiguous(), weight, layer.bias, activation)
        return y.view(*x.shape[:-1], weight.shape[0])
    y = layer(x)
    if activation == "gelu":
        return F.gelu(y)
    if activation == "relu":
        return F.relu(y)
    return y
