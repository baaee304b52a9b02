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
  attention, from a layer's packed QKV projection: the attention part of
  :func:`decode_block`, callable alone for its tests;
* :func:`linear_rows`: a linear layer for a few rows (:func:`linear` picks it),
  each weight row read once for all rows, with GELU or ReLU applied on the
  way out;
* :func:`decode_block`: a whole pre-norm block of :mod:`aah.model` (norms,
  projections, attention, MLP, residuals) in one call, which is what
  ``GPT.forward`` runs for each layer of a decode step;
* :func:`paged_attention`: per-head windows and sink tokens over a paged KV
  cache, the attention :mod:`aah.vllm` runs inside vLLM.

The extension is built with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja) the first time a process needs it, into ``$TORCH_EXTENSIONS_DIR``
(default ``~/.cache/torch_extensions``), in a folder named after the torch
version, the CPU capability and a hash of the sources and their location. It
takes about a minute once per machine, copy of the package and source version;
later processes load the built library from that folder directly. A build runs
in a private temporary folder beside it, which is renamed into place when done,
under a lock the operating system drops when the process dies: a build killed
midway leaves only a temporary folder, removed by the next build. A build that
fails is remembered there too (a ``FAILED`` marker, the whole compiler output in
``build.log``, named by the one warning and by :func:`unavailable_reason`), so
later processes do not try again; set ``AAH_RING_KERNEL_RETRY=1`` or delete the
folder to build again. Without a C++ compiler (``$CXX``, else ``c++`` or ``g++``)
or ninja, nothing is built. In all these cases the PyTorch paths run, with the
same results (tested against each other). ``AAH_RING_KERNEL=0`` turns it off.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import re
import shlex
import shutil
import sys
import sysconfig
import tempfile
import warnings
from pathlib import Path
from typing import NamedTuple

import torch
from torch.nn import functional as F
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

try:
    import fcntl  # the build lock; without it (Windows) builds are not serialised
except ImportError:  # pragma: no cover
    fcntl = None

__all__ = ["ACTIVATIONS", "LINEAR_ROWS_MAX", "decode_step_label", "linear", "linear_rows", "load", "ring_decode", "ring_decode_packed", "decode_block", "Block", "BLOCK_PARTS", "Rings", "paged_attention", "unavailable_reason"]

_NAME = "aah_ring_decode"
_CSRC = Path(__file__).with_name("csrc")
_MAIN_SOURCE = "decode_step.cpp"  # it includes the headers beside it
_LIBRARY_SUFFIX = ".pyd" if os.name == "nt" else ".so"
_FAILED = "FAILED"  # in a build folder: the build failed (holds its first error line)
_LOG = "build.log"  # beside it: the failed build's whole output
_SCRATCH = ".tmp"  # suffix of the private folder a build runs in
_RETRY = "AAH_RING_KERNEL_RETRY"  # =1: build again although a build of these sources failed
_state: dict[str, object] = {}  # "module" or "error", once tried


class _Unavailable(Exception):
    """Why the compiled step cannot be had, as :func:`unavailable_reason` says it."""


class _BuildFailed(_Unavailable):
    """The build of these sources failed (now or in an earlier process): worth a warning."""


def _capability() -> str:
    try:
        return torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        return "DEFAULT"


def _flags() -> list[str]:
    """Optimised, vectorised (``-ffast-math``: the kernels use no infinities) and threaded; AVX2, or
    AVX-512 with 512-bit vectors, where the CPU has it."""
    flags = ["-O3", "-ffast-math", "-fopenmp"]  # OpenMP: ATen's parallel_for runs serially without it
    if _capability().startswith("AVX"):
        flags += ["-mavx2", "-mfma"]
    if _capability().startswith("AVX512"):
        flags += ["-mavx512f", "-mavx512vl", "-mavx512bw", "-mavx512dq", "-mprefer-vector-width=512"]
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
            _state["module"] = _load_or_build(_build_directory())
        except _Unavailable as exc:  # no compiler or ninja, a failed build
            _state["error"] = str(exc)
            if isinstance(exc, _BuildFailed):
                warnings.warn(f"aah: the compiled decode step is not used: {exc}", RuntimeWarning, stacklevel=2)
        except Exception as exc:  # a read-only home, say: keep the PyTorch path
            _state["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return _state.get("module")


def _load_or_build(folder: Path):
    """The module built in ``folder``; built there first when that folder holds no build yet."""
    module = _finished(folder)
    if module is not None:
        return module
    environment = _toolchain()
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(folder):
        module = _finished(folder)  # built by the process this one waited for
        if module is not None:
            return module
        _remove_leftovers(folder)
        with _environment(environment):
            return _build(folder)


def _finished(folder: Path):
    """The module of the build in ``folder``, ``None`` when there is none; raises for a failed one."""
    if (folder / _FAILED).exists():
        if os.environ.get(_RETRY, "0") != "1":
            raise _failure(folder)
        return None
    libraries = sorted(folder.glob(f"{_NAME}*{_LIBRARY_SUFFIX}"))
    if not libraries:
        return None
    spec = importlib.util.spec_from_file_location(libraries[0].stem, libraries[0])
    try:
        module = importlib.util.module_from_spec(spec)  # opens the library
        spec.loader.exec_module(module)
    except ImportError as exc:
        raise _Unavailable(f"{libraries[0]} does not load ({exc}); delete {folder} to build again") from None
    return module


def _failure(folder: Path) -> _BuildFailed:
    """Why the build in ``folder`` failed: its first error line and where its whole output is."""
    try:
        first = (folder / _FAILED).read_text().strip()
    except OSError:  # removed meanwhile by a build retried
        first = "unknown error"
    return _BuildFailed(
        f"the build failed ({first}); the whole compiler output is in {folder / _LOG}; "
        f"set {_RETRY}=1 or delete {folder} to build again"
    )


def _scripts_directory() -> str | None:
    """Where this Python's installed commands are (the ``ninja`` pip package puts its own there)."""
    return sysconfig.get_path("scripts")


def _toolchain() -> dict[str, str]:
    """The environment changes the build needs; raises :class:`_Unavailable` without a compiler or ninja.

    ``torch.utils.cpp_extension`` compiles with ``$CXX``, else ``c++``, and runs
    ``ninja`` from the ``PATH``: where only ``g++`` exists it is named in
    ``CXX``, and the ninja of this Python's environment (not activated) is put
    on the ``PATH``.
    """
    changes = {}
    named = os.environ.get("CXX", "").strip()
    if named:
        if shutil.which(shlex.split(named)[0]) is None:
            raise _Unavailable(f"no C++ compiler: CXX={named} is not found")
    elif shutil.which("c++") is None:
        if shutil.which("g++") is None:
            raise _Unavailable("no C++ compiler (neither c++ nor g++ is on the PATH, and CXX is not set)")
        changes["CXX"] = "g++"
    if shutil.which("ninja") is None:
        scripts = _scripts_directory()
        if not scripts or shutil.which("ninja", path=scripts) is None:
            raise _Unavailable("no ninja, which builds the extension (pip install ninja)")
        changes["PATH"] = scripts + os.pathsep + os.environ.get("PATH", "")
    return changes


@contextlib.contextmanager
def _environment(changes: dict[str, str]):
    """``os.environ`` with ``changes`` for the duration (what the build's subprocesses see)."""
    saved = {name: os.environ.get(name) for name in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def _build_lock(folder: Path):
    """One build of ``folder`` at a time: a lock on the file ``<folder>.lock``.

    The operating system drops the lock when its process ends, however it ends,
    so a killed build never leaves a lock for others to wait on. The file holds
    the builder's process id, which a waiting process names.
    """
    if fcntl is None:  # pragma: no cover
        yield
        return
    path = folder.with_name(folder.name + ".lock")
    handle = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(handle, 32, 0).decode(errors="replace").strip() or "?"
            print(f"aah: waiting for process {holder}, which builds the compiled decode step (lock: {path})",
                  file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        os.ftruncate(handle, 0)
        os.pwrite(handle, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(handle)  # releases the lock


def _remove_leftovers(folder: Path) -> None:
    """Under the build lock: private folders of builds killed midway, and ``folder`` unless it holds a build.

    ``folder`` without a library is a failed build being retried, or one that an
    older version of this module was killed in the middle of.
    """
    if fcntl is not None:  # no other build runs now
        for leftover in folder.parent.glob(f".{folder.name}.*{_SCRATCH}"):
            shutil.rmtree(leftover, ignore_errors=True)
    if folder.exists():
        shutil.rmtree(folder)


def _build(folder: Path):
    """Build in a private folder beside ``folder`` and rename it to ``folder``, failed or not."""
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=_SCRATCH, dir=folder.parent))
    scratch.chmod(0o755)  # as a folder made the usual way: others may load the build
    print("aah: building the compiled decode step (once per machine and torch "
          f"version, about a minute) in {folder}", file=sys.stderr, flush=True)
    try:
        module = _compile(scratch)
    except Exception as exc:  # remembered: later processes do not try again
        output = f"{type(exc).__name__}: {exc}\n"
        (scratch / _LOG).write_text(output)
        (scratch / _FAILED).write_text(_first_error(output) + "\n")
        _move(scratch, folder)
        raise _failure(folder) from None
    _move(scratch, folder)
    if getattr(module, "__file__", None):
        module.__file__ = str(folder / Path(module.__file__).name)
    return module


def _compile(build: Path):
    """Build the extension in ``build`` with ``torch.utils.cpp_extension`` and import it."""
    from torch.utils.cpp_extension import load as load_extension

    return load_extension(
        name=_NAME, sources=[str(_CSRC / _MAIN_SOURCE)], build_directory=str(build),
        extra_cflags=_flags(), extra_ldflags=["-fopenmp"], verbose=False,
    )


def _first_error(output: str) -> str:
    """The first line of a build's output that reports an error (else its first line), shortened."""
    lines = output.splitlines() or [""]
    found = next((line for line in lines if re.search(r"\berror\b:", line, re.IGNORECASE)), lines[0])
    return found.strip()[:200]


def _move(scratch: Path, folder: Path) -> None:
    """Rename ``scratch`` to ``folder``, at once: others see a whole build or none."""
    try:
        os.rename(scratch, folder)
    except OSError:  # pragma: no cover - another process finished first (no lock between them)
        shutil.rmtree(scratch, ignore_errors=True)


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
    *,
    sinks: int = 0,
    lse: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``q`` (B, H, D) over the last ``min(W_h, length, C)`` entries of each head's ring.

    ``keys`` and ``values`` (B, S, D) hold every KV head's ring, KV head ``g``
    in slots ``ring_start[g] .. ring_start[g] + capacity[g]`` with position
    ``p`` in slot ``p % capacity[g]``; query head ``h`` reads KV head
    ``h // (H // H_kv)`` with window ``windows[h]``; ``length`` positions are
    written (the newest included). With ``sinks`` the ``sinks`` slots before
    each ring hold positions ``0 .. sinks - 1``, and a head also reads those
    that lie before its window (:func:`aah.windows.visible`). Returns (B, H, D); with ``lse``
    (a float32 (B, H) tensor) also writes there each row's log-sum-exp of its scaled scores,
    with which more keys can join the same softmax. Raises ``RuntimeError`` when the extension
    is not available (see :func:`load`).
    """
    return _module().ring_decode(
        q, keys, values, ring_start, capacity, windows, int(length), int(sinks), float(scale), lse
    )


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    keys_transposed: bool,
    token_request: torch.Tensor,
    token_position: torch.Tensor,
    block_table: torch.Tensor,
    windows: torch.Tensor,
    sinks: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of ``query`` (N, H, D) over a paged KV cache, each head with its window and the sinks.

    Token ``t`` belongs to request ``token_request[t]`` (a row of ``block_table``, int32, the
    pages of its keys in order) at position ``token_position[t]``; query head ``h`` reads KV
    head ``h // (H // K)`` of ``key_cache``/``value_cache`` (blocks, K, block_size, D), keys
    ``j <= p`` with ``p - j < windows[h]`` or ``j < sinks``. With ``keys_transposed`` each key
    page holds ``K^T``. ``query`` and ``out`` may be views whose last axis alone is contiguous.
    Returns ``out`` (a new (N, H, D) tensor when not given). Raises ``RuntimeError`` when the
    extension is not available (see :func:`load`).
    """
    return _module().paged_attention(
        query, key_cache, value_cache, bool(keys_transposed), token_request, token_position, block_table,
        windows, int(sinks), float(scale), out,
    )


class Rings(NamedTuple):
    """A layer's ring buffers as the compiled steps read them (:meth:`aah.decode.rings.RingStore.rings`).

    ``keys``, ``values`` (B, S, D): every KV head's ring, KV head ``g`` in slots
    ``ring_start[g] .. ring_start[g] + capacity[g]``; ``unread`` (1, S) float32:
    a row in which the step writes 0.0 at each slot it fills (the stores keep their own
    record of the positions held); ``windows``
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
    qkv: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    rings: Rings,
    length: int,
    scale: float,
    *,
    sinks: int = 0,
) -> torch.Tensor:
    """One whole decode step of a layer from its packed QKV projection; returns (B, H * D).

    ``qkv`` (B, (H + 2 H_kv) D) holds the query heads, key heads and value heads
    of position ``length - 1``. With ``cos`` and ``sin`` (rotary tables,
    (positions, D), or the new position's row alone, (1, D); ``None`` for no
    rotary embedding) the query and the key are rotated at that position as
    :class:`aah.attention.RotaryEmbedding` does (rotate-half). The key and value
    go into slot ``(length - 1) % C`` of their KV head's ring (and that slot of
    ``rings.unread`` becomes 0; the sink slots are not written); then the query
    attends as :func:`ring_decode` with ``sinks``.
    """
    return _module().ring_decode_packed(
        qkv, *_tables(qkv, cos, sin), *rings, int(length), int(sinks), float(scale)
    )


#: The projections and norms of a block, in the order of :attr:`Block.weights` (a weight and a bias each).
BLOCK_PARTS = ("norm1", "qkv", "key", "value", "out", "norm2", "gate", "up", "down")


class Block(NamedTuple):
    """What :func:`decode_block` needs of a pre-norm block besides its cache.

    ``weights``: a weight and a bias for each of :data:`BLOCK_PARTS`, ``None``
    where absent (:meth:`of` builds them from the modules). ``qkv`` is the packed projection (:class:`aah.model.Block`)
    or, with ``key`` and ``value``, the query projection alone (a Llama-style layer);
    ``up`` gives the gate then the value of ``swiglu`` or, with ``gate``, the value alone.
    ``norm``: ``layernorm`` or ``rmsnorm``; ``eps``: the two norms' epsilons;
    ``activation``: ``gelu``, ``relu`` or ``swiglu`` (``silu(gate) * value``).
    """

    weights: list[torch.Tensor | None]
    norm: str
    eps: tuple[float, float]
    activation: str

    @classmethod
    def of(
        cls, dtype: torch.dtype, norm: str, eps: tuple[float, float], activation: str,
        **modules: torch.nn.Module | None,
    ) -> Block | None:
        """The block of the modules named by :data:`BLOCK_PARTS` (missing names: absent), or
        ``None`` when one of their tensors is not a contiguous tensor of ``dtype``."""
        unknown = set(modules) - set(BLOCK_PARTS)
        if unknown:
            raise ValueError(f"unknown block parts {sorted(unknown)}; expected some of {BLOCK_PARTS}")
        weights = []
        for part in BLOCK_PARTS:
            module = modules.get(part)
            params = {} if module is None else module._parameters
            weights += [params.get("weight"), params.get("bias")]
        if not all(t is None or (t.dtype == dtype and t.is_contiguous()) for t in weights):
            return None
        return cls(weights, norm, eps, activation)


def decode_block(
    x: torch.Tensor, block: Block, cos: torch.Tensor | None, sin: torch.Tensor | None, rings: Rings,
    length: int, scale: float, *, sinks: int = 0,
) -> torch.Tensor:
    """One decode step of a pre-norm block, ``x + out(attn(qkv(norm1(x))))`` then ``x + down(act(up(norm2(x))))``.

    ``x`` (B, d_model) at position ``length - 1``; the attention is
    :func:`ring_decode_packed` (the arguments after ``block`` are its own).
    Returns the block's output (B, d_model).
    """
    return _module().decode_block(
        x, block.weights, block.norm, float(block.eps[0]), float(block.eps[1]), block.activation,
        *_tables(x, cos, sin), *rings, int(length), int(sinks), float(scale),
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
