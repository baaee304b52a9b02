"""Run configuration: the typed, validated settings of one training run, read from YAML.

A run is described by seven sections, each a frozen dataclass::

    model   backbone shape (every GPTConfig field; vocab_size and max_seq_len may be left to
            the tokenizer and data.seq_len)
    aah     the regime name plus flat overrides of its ControllerConfig fields
    data    corpus, tokenizer, block length, validation split
    optim   AdamW and the warmup + cosine learning-rate schedule
    train   steps, batch, seed, checkpoints, precision, device, output folder
    eval    periodic validation
    log     metric logging and progress display

:func:`load_config` reads a YAML file (which may inherit from others through a
top-level ``base:`` key), applies ``section.key=value`` overrides and validates
everything before any work starts: every error is a :class:`ConfigError` whose
message names the full key (``train.max_steps``) and what is allowed.
:func:`controller_config` and :func:`model_config` turn a :class:`RunConfig`
into the objects the model is built from. See ``docs/configuration.md``.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Union

import yaml

from . import regimes
from .controller.budget import check_budget, check_budget_layout
from .controller.config import BUDGET_SCORINGS, ControllerConfig
from .data.recall import DISTANCES as RECALL_DISTANCES
from .data.recall import KEY_FORMATS as RECALL_KEY_FORMATS
from .data.recall import RECALL_CORPORA, RecallSpec
from .model import GPTConfig
from .windows import candidate_windows

__all__ = [
    "AAHConfig",
    "ConfigError",
    "DataConfig",
    "DEVICES",
    "DISTRIBUTED",
    "EvalConfig",
    "LogConfig",
    "ModelConfig",
    "OptimConfig",
    "PRECISIONS",
    "RunConfig",
    "SECTIONS",
    "TrainConfig",
    "config_from_dict",
    "config_to_dict",
    "controller_config",
    "load_config",
    "model_config",
    "save_config",
]

#: Section names, in the order they are written.
SECTIONS = ("model", "aah", "data", "optim", "train", "eval", "log")
PRECISIONS = ("fp32", "bf16", "auto")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED = ("ddp", "fsdp")
#: Top-level key of a config file naming the file(s) it inherits from.
BASE_KEY = "base"
#: Vocabulary used to validate the model section before the tokenizer is known.
_PLACEHOLDER_VOCAB = 256
#: ControllerConfig fields the aah section may not set, with the reason.
_AAH_FORBIDDEN = {
    "seed": "the controller seed is always train.seed",
    "enabled": "use aah.regime=full_attention for a run without a controller",
}


class ConfigError(ValueError):
    """An invalid run configuration; the message names the offending key or file."""


# ---------------------------------------------------------------------------
# YAML: PyYAML's YAML 1.1 resolver reads ``1e-3`` as a string; accept it as a float.

_FLOAT_RE = re.compile(
    r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""",
    re.X,
)


class _Loader(yaml.SafeLoader):
    pass


class _Dumper(yaml.SafeDumper):
    pass


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_RE, list("-+0123456789."))


def _represent_list(dumper: yaml.SafeDumper, data: list) -> yaml.Node:
    # sections are written in block style, lists of numbers inline: `windows: [128, 256]`
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=True)


_Dumper.add_representer(list, _represent_list)


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader subclass


# ---------------------------------------------------------------------------
# Type checking of field values against their annotations.


class _Mismatch(Exception):
    pass


def _type_name(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(hint)
        name = " or ".join(_type_name(a) for a in args if a is not type(None))
        return f"{name} or null" if type(None) in args else name
    if origin in (tuple, list):
        return f"list of {_type_name(typing.get_args(hint)[0])}"
    return getattr(hint, "__name__", str(hint))


def _convert(value: Any, hint: Any) -> Any:
    origin = typing.get_origin(hint)
    if origin is Union or origin is types.UnionType:
        args = typing.get_args(hint)
        if value is None and type(None) in args:
            return None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise _Mismatch
        item = typing.get_args(hint)[0]
        return tuple(_convert(v, item) for v in value)
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise _Mismatch
    if isinstance(value, bool):
        raise _Mismatch  # bool is not a number here
    if hint is int and isinstance(value, numbers.Integral):
        return int(value)
    if hint is float and isinstance(value, numbers.Real):
        return float(value)
    if hint is str and isinstance(value, str):
        return value
    raise _Mismatch


def _check_type(key: str, value: Any, hint: Any) -> Any:
    try:
        return _convert(value, hint)
    except _Mismatch:
        raise ConfigError(f"{key}: expected {_type_name(hint)}, got {value!r}") from None


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _fail(key: str, message: str) -> typing.NoReturn:
    raise ConfigError(f"{key}: {message}")


def _one_of(key: str, value: str, allowed: Sequence[str]) -> None:
    if value not in allowed:
        _fail(key, f"must be one of {', '.join(allowed)}; got {value!r}")


# ---------------------------------------------------------------------------
# Sections.


@dataclass(frozen=True)
class _Section:
    """Common behaviour: values are type-checked (and normalised) on construction."""

    section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = _check_type(self.key(f.name), getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
        self._validate()

    @classmethod
    def key(cls, name: str) -> str:
        """The full key of field ``name``, e.g. ``train.max_steps``."""
        return f"{cls.section}.{name}"

    @classmethod
    def field_names(cls) -> list[str]:
        """Field names settable in this section."""
        return [f.name for f in dataclasses.fields(cls)]

    def _validate(self) -> None:
        pass

    def _at_least(self, name: str, minimum: float) -> None:
        value = getattr(self, name)
        if value is not None and value < minimum:
            _fail(self.key(name), f"must be >= {minimum}, got {value}")

    def _in_unit(self, name: str, *, closed: bool = False) -> None:
        value = getattr(self, name)
        if not (0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0):
            _fail(self.key(name), f"must be in [0, 1{']' if closed else ')'}, got {value}")


def _mirror(name: str, section: str, doc: str, *, fields: list, namespace: dict) -> type:
    """A frozen :class:`_Section` named ``name`` with ``fields``, which the two sections below take
    from the dataclass they configure: a setting is defined once, where the code that uses it lives."""
    return dataclasses.make_dataclass(
        name, fields, bases=(_Section,), frozen=True,
        namespace={"section": section, "__doc__": doc, "__module__": __name__, **namespace},
    )


def _validate_model(self) -> None:
    for name in ("vocab_size", "max_seq_len", "d_ff"):
        self._at_least(name, 1)
    if not self.backend:
        _fail(self.key("backend"), "must be a backend name or 'auto', got ''")


ModelConfig = _mirror(
    "ModelConfig", "model",
    "Backbone settings: every :class:`~aah.model.GPTConfig` field.\n\n"
    "``vocab_size`` None = the tokenizer's vocabulary; ``max_seq_len`` None = ``data.seq_len``.",
    fields=[
        (f.name, hint | None, field(default=None)) if f.name in ("vocab_size", "max_seq_len")
        else (f.name, hint, field(default=f.default))
        for f, hint in ((f, typing.get_type_hints(GPTConfig)[f.name]) for f in dataclasses.fields(GPTConfig))
    ],
    namespace={"_validate": _validate_model},
)


def _overrides(self) -> dict[str, Any]:
    """The ControllerConfig fields this section sets (all but ``regime`` and unset ones)."""
    return {
        f.name: getattr(self, f.name)
        for f in dataclasses.fields(self)
        if f.name != "regime" and getattr(self, f.name) is not None
    }


def _validate_aah(self) -> None:
    if self.regime not in regimes.REGIMES:
        _fail(
            self.key("regime"),
            f"unknown regime {self.regime!r}; known regimes: {', '.join(regimes.names())}",
        )
    for name in ("base_hidden", "joint_hidden"):
        self._at_least(name, 1)
    _controller(self, seed=0)  # the controller's own checks, reported as aah.<field>


AAHConfig = _mirror(
    "AAHConfig", "aah",
    "The controller regime and flat overrides of its :class:`ControllerConfig` fields.\n\n"
    "Every field but ``regime`` is an override (``seed`` is ``train.seed``, ``enabled`` the "
    "regime's); None keeps the regime's value.",
    fields=[("regime", str, field(default="full_adaptive"))] + [
        (f.name, typing.get_type_hints(ControllerConfig)[f.name] | None, field(default=None))
        for f in dataclasses.fields(ControllerConfig) if f.name not in ("seed", "enabled")
    ],
    namespace={"overrides": _overrides, "_validate": _validate_aah},
)


def _controller(aah: AAHConfig, seed: int) -> ControllerConfig:
    try:
        return regimes.get(aah.regime).replace(**aah.overrides(), seed=seed)
    except ValueError as exc:
        raise ConfigError(re.sub(r"\bcontroller\.", "aah.", str(exc))) from None


@dataclass(frozen=True)
class DataConfig(_Section):
    """Corpus, tokenizer and block length."""

    section: ClassVar[str] = "data"
    corpus: str = "shakespeare"
    tokenizer: str = "byte"
    seq_len: int = 1024
    val_fraction: float = 0.1
    bpe_vocab_size: int = 4096
    cache_dir: str | None = None
    val_corpus: str | None = None
    # The recall task of a recall corpus (shakespeare_recall, bible_recall; aah.data.recall).
    recall_fraction: float = 0.1
    recall_pairs: int = 8
    recall_value_len: int = 3
    recall_distance: str = "uniform"
    recall_seed: int = 0
    recall_keys: str = "digits"

    def recall_spec(self) -> RecallSpec:
        """The recall task's knobs as a :class:`~aah.data.recall.RecallSpec`."""
        return RecallSpec(
            fraction=self.recall_fraction, pairs=self.recall_pairs, value_len=self.recall_value_len,
            distance=self.recall_distance, seed=self.recall_seed, keys=self.recall_keys,
        )

    def _validate(self) -> None:
        if not self.corpus:
            _fail(self.key("corpus"), "must be a corpus name or a path, got ''")
        if self.val_corpus == "":
            _fail(self.key("val_corpus"), "must be a corpus name, a path or null, got ''")
        tok = self.tokenizer
        if not (tok in ("byte", "bpe") or (tok.startswith("hf:") and len(tok) > 3)):
            _fail(self.key("tokenizer"), f"must be 'byte', 'bpe' or 'hf:/local/path'; got {tok!r}")
        self._at_least("seq_len", 1)
        if not 0.0 < self.val_fraction < 1.0:
            _fail(self.key("val_fraction"), f"must be in (0, 1), got {self.val_fraction}")
        self._at_least("bpe_vocab_size", 257)
        self._validate_recall()

    def _validate_recall(self) -> None:
        _one_of(self.key("recall_distance"), self.recall_distance, RECALL_DISTANCES)
        _one_of(self.key("recall_keys"), self.recall_keys, RECALL_KEY_FORMATS)
        recall = [c for c in (self.corpus, self.val_corpus) if c in RECALL_CORPORA]
        if not recall:
            return
        if self.tokenizer != "byte":
            _fail(
                self.key("tokenizer"),
                f"the recall corpus {recall[0]!r} writes its episodes as bytes: use 'byte'; got {self.tokenizer!r}",
            )
        try:
            self.recall_spec().validate(self.seq_len, prefix=f"{self.section}.recall_")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class OptimConfig(_Section):
    """AdamW and the learning-rate schedule: linear warmup, then cosine to ``lr * min_lr_ratio``
    at ``decay_steps`` (``train.max_steps`` when unset)."""

    section: ClassVar[str] = "optim"
    lr: float = 3e-4
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 100
    min_lr_ratio: float = 0.0
    decay_steps: int | None = None
    grad_clip: float = 1.0

    def _validate(self) -> None:
        for name in ("lr", "weight_decay", "warmup_steps", "grad_clip"):
            self._at_least(name, 0)
        self._at_least("decay_steps", 1)
        self._in_unit("beta1")
        self._in_unit("beta2")
        self._in_unit("min_lr_ratio", closed=True)
        if self.eps <= 0:
            _fail(self.key("eps"), f"must be > 0, got {self.eps}")


@dataclass(frozen=True)
class TrainConfig(_Section):
    """Length, batch, seed, checkpoints and execution settings of the training loop."""

    section: ClassVar[str] = "train"
    max_steps: int = 1000
    batch_size: int = 8
    grad_accum: int = 1
    seed: int = 0
    checkpoint_every: int = 0
    checkpoint_steps: tuple[int, ...] = ()
    precision: str = "auto"
    compile: bool = False
    device: str = "auto"
    out_dir: str = "runs"
    distributed: str = "ddp"

    def _validate(self) -> None:
        for name in ("max_steps", "batch_size", "grad_accum"):
            self._at_least(name, 1)
        for name in ("seed", "checkpoint_every"):
            self._at_least(name, 0)
        bad = [s for s in self.checkpoint_steps if s < 1]
        if bad:
            _fail(self.key("checkpoint_steps"), f"steps must be >= 1, got {list(self.checkpoint_steps)}")
        object.__setattr__(self, "checkpoint_steps", tuple(sorted(set(self.checkpoint_steps))))
        _one_of(self.key("precision"), self.precision, PRECISIONS)
        _one_of(self.key("device"), self.device, DEVICES)
        _one_of(self.key("distributed"), self.distributed, DISTRIBUTED)
        if not self.out_dir:
            _fail(self.key("out_dir"), "must be a folder path, got ''")


@dataclass(frozen=True)
class EvalConfig(_Section):
    """Periodic validation during training."""

    section: ClassVar[str] = "eval"
    every: int = 100
    batches: int = 20
    batch_size: int | None = None

    def _validate(self) -> None:
        self._at_least("every", 0)
        self._at_least("batches", 1)
        self._at_least("batch_size", 1)


@dataclass(frozen=True)
class LogConfig(_Section):
    """Metric logging."""

    section: ClassVar[str] = "log"
    every: int = 10
    tensorboard: bool = True
    progress: bool = True

    def _validate(self) -> None:
        self._at_least("every", 1)


_SECTION_TYPES: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "aah": AAHConfig,
    "data": DataConfig,
    "optim": OptimConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "log": LogConfig,
}


@dataclass(frozen=True)
class RunConfig:
    """All settings of one run; cross-section consistency is checked on construction."""

    model: ModelConfig = field(default_factory=ModelConfig)
    aah: AAHConfig = field(default_factory=AAHConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    log: LogConfig = field(default_factory=LogConfig)

    def __post_init__(self) -> None:
        for name, cls in _SECTION_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                _fail(name, f"expected {cls.__name__}, got {type(value).__name__}")
        self._validate()

    @property
    def max_seq_len(self) -> int:
        """The model's maximum length: ``model.max_seq_len``, else ``data.seq_len``."""
        m = self.model.max_seq_len
        return self.data.seq_len if m is None else m

    @property
    def eval_batch_size(self) -> int:
        """Validation batch size: ``eval.batch_size``, else ``train.batch_size``."""
        b = self.eval.batch_size
        return self.train.batch_size if b is None else b

    def _validate(self) -> None:
        max_len = self.max_seq_len
        if self.model.max_seq_len is not None and self.data.seq_len > max_len:
            _fail("data.seq_len", f"must be <= model.max_seq_len ({max_len}), got {self.data.seq_len}")
        gpt = _gpt_config(self, self.model.vocab_size or _PLACEHOLDER_VOCAB)
        ctrl = _controller(self.aah, self.train.seed)
        origin = "model.max_seq_len" if self.model.max_seq_len is not None else "data.seq_len"
        if ctrl.windows is not None:
            too_long = [w for w in ctrl.windows if w > max_len]
            if too_long:
                _fail(
                    "aah.windows",
                    f"windows must be <= the model's maximum length {max_len} ({origin}); "
                    f"got {list(ctrl.windows)}",
                )
        if ctrl.min_window is not None and ctrl.min_window > max_len:
            _fail(
                "aah.min_window",
                f"must be <= the model's maximum length {max_len} ({origin}), got {ctrl.min_window}",
            )
        if ctrl.enabled and ctrl.scoring in BUDGET_SCORINGS:
            cands = ctrl.windows if ctrl.windows is not None else candidate_windows(max_len)
            try:
                check_budget(ctrl.budget, cands, max_len, ctrl.min_window, field="aah.budget")
                check_budget_layout(
                    ctrl.scoring, ctrl.budget_scope, ctrl.window_granularity, gpt.n_heads, gpt.kv_heads,
                    prefix="aah",
                )
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        if ctrl.enabled and ctrl.scoring == "fixed":
            count = len(ctrl.windows) if ctrl.windows is not None else 4
            if ctrl.fixed_window_index >= count:
                _fail(
                    "aah.fixed_window_index",
                    f"must index one of the {count} candidate windows (0..{count - 1}), "
                    f"got {ctrl.fixed_window_index}",
                )


# ---------------------------------------------------------------------------
# Building the model's and controller's settings.


def _gpt_config(cfg: RunConfig, vocab_size: int) -> GPTConfig:
    values = {f.name: getattr(cfg.model, f.name) for f in dataclasses.fields(cfg.model)}
    values.update(vocab_size=vocab_size, max_seq_len=cfg.max_seq_len)
    try:
        return GPTConfig(**values)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def model_config(cfg: RunConfig, vocab_size: int) -> GPTConfig:
    """The :class:`GPTConfig` of ``cfg`` for a tokenizer of ``vocab_size`` tokens.

    ``model.vocab_size``, when set, is used instead (it may pad the tokenizer's
    vocabulary, never shrink it); ``max_seq_len`` defaults to ``data.seq_len``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError(f"vocab_size: expected a positive int, got {vocab_size!r}")
    vocab = cfg.model.vocab_size
    if vocab is not None and vocab < vocab_size:
        _fail(
            "model.vocab_size",
            f"must be >= the tokenizer's vocabulary ({vocab_size}) or null, got {vocab}",
        )
    return _gpt_config(cfg, vocab_size if vocab is None else vocab)


def controller_config(cfg: RunConfig) -> ControllerConfig | None:
    """The regime's controller settings with the ``aah`` overrides and ``seed=train.seed``.

    None for ``full_attention`` or any regime whose controller is disabled.
    """
    if cfg.aah.regime == "full_attention":
        return None
    ctrl = _controller(cfg.aah, cfg.train.seed)
    return ctrl if ctrl.enabled else None


# ---------------------------------------------------------------------------
# Reading, overriding and writing.


def _where(source: str | None) -> str:
    return f" in {source}" if source else ""


def _section_values(name: str, values: Any, source: str | None) -> dict[str, Any]:
    cls = _SECTION_TYPES[name]
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        _fail(name, f"expected a mapping of keys{_where(source)}, got {values!r}")
    allowed = cls.field_names()
    for key in values:
        if key not in allowed:
            _fail(f"{name}.{key}", _unknown_key_message(name, key, source))
    return dict(values)


def _unknown_key_message(section: str, key: Any, source: str | None) -> str:
    hint = f" ({_AAH_FORBIDDEN[key]})" if section == "aah" and key in _AAH_FORBIDDEN else ""
    allowed = ", ".join(_SECTION_TYPES[section].field_names())
    return f"unknown key{_where(source)}{hint}; allowed keys in {section}: {allowed}"


def config_from_dict(data: Mapping[str, Any] | None, source: str | None = None) -> RunConfig:
    """Build and validate a :class:`RunConfig` from nested plain values (a parsed YAML file).

    Missing sections and keys take their defaults; ``source`` names the origin in errors.
    """
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"config{_where(source)}: expected a mapping of sections, got {data!r}")
    for name in data:
        if name not in _SECTION_TYPES:
            raise ConfigError(
                f"{name}: unknown section{_where(source)}; allowed sections: {', '.join(SECTIONS)}"
            )
    values = {name: _section_values(name, data.get(name), source) for name in _SECTION_TYPES}
    try:
        return RunConfig(**{name: cls(**values[name]) for name, cls in _SECTION_TYPES.items()})
    except ConfigError as exc:
        if source is None:
            raise
        raise ConfigError(f"{exc} (in {source})") from None


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else in ``top`` replaces ``base``."""
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(dict(out[key]), value)
        elif value is None and isinstance(out.get(key), Mapping) and key in _SECTION_TYPES:
            continue  # an empty section header does not erase the inherited section
        else:
            out[key] = value
    return out


def _read_file(path: Path, chain: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Parse ``path`` and the files it inherits from (``base:``), merged base first."""
    shown = str(path)
    resolved = path.resolve()
    if resolved in chain:
        cycle = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigError(f"config file {shown}: base cycle: {cycle}")
    included = f" (base of {chain[-1]})" if chain else ""
    try:
        text = resolved.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file {shown}{included}: not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"config file {shown}{included}: cannot be read ({reason})") from None
    try:
        data = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {shown}{included}: invalid YAML: {exc}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {shown}{included}: expected a mapping of sections at the top level, "
            f"got {type(data).__name__}"
        )
    bases = data.pop(BASE_KEY, None)
    if bases is None:
        return data
    if isinstance(bases, str):
        bases = [bases]
    if not isinstance(bases, list) or not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(
            f"config file {shown}: {BASE_KEY}: expected a file name or a list of file names "
            f"(relative to this file), got {bases!r}"
        )
    merged: dict[str, Any] = {}
    for base in bases:
        merged = _merge(merged, _read_file(resolved.parent / base, (*chain, resolved)))
    return _merge(merged, data)


def _apply_override(data: dict[str, Any], item: str) -> None:
    if not isinstance(item, str) or "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.key=value (e.g. train.max_steps=50)")
    target, text = item.split("=", 1)
    target = target.strip()
    section, dot, key = target.partition(".")
    if not dot or not section or not key:
        raise ConfigError(f"override {item!r}: expected section.key=value (e.g. train.max_steps=50)")
    if section not in _SECTION_TYPES:
        raise ConfigError(
            f"override {item!r}: unknown section {section!r}; allowed sections: {', '.join(SECTIONS)}"
        )
    cls = _SECTION_TYPES[section]
    if key not in cls.field_names():
        raise ConfigError(f"override {item!r}: {target}: {_unknown_key_message(section, key, None)}")
    try:
        value = _yaml_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {exc}") from None
    try:
        _check_type(target, value, _hints(cls)[key])
    except ConfigError as exc:
        raise ConfigError(f"{exc} (override {item!r})") from None
    current = data.get(section)
    if not isinstance(current, Mapping):
        current = {}
    data[section] = {**current, key: value}


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> RunConfig:
    """Read, override and validate a run configuration.

    ``path`` None = all defaults. A file may name the file(s) it inherits from
    with a top-level ``base:`` key (paths relative to it; deep-merged, the
    including file wins; cycles are refused). ``overrides`` are
    ``section.key=value`` strings whose values are parsed as YAML, applied in
    order after the file. Raises :class:`ConfigError` on any problem.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    data = {} if path is None else _read_file(Path(path))
    for item in overrides:
        _apply_override(data, item)
    return config_from_dict(data, None if path is None else str(path))


def config_to_dict(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    """Nested plain values (lists, not tuples) that :func:`config_from_dict` turns back into ``cfg``.

    Unset ``aah`` overrides are left out; every other key is written.
    """
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = getattr(cfg, name)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if name == "aah" and f.name != "regime" and value is None:
                continue
            values[f.name] = list(value) if isinstance(value, tuple) else value
        out[name] = values
    return out


def save_config(cfg: RunConfig, path: str | Path) -> Path:
    """Write ``cfg`` as YAML to ``path`` (parent folders are created); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = yaml.dump(config_to_dict(cfg), Dumper=_Dumper, sort_keys=False, default_flow_style=False)
    path.write_text("# aah run configuration\n" + text, encoding="utf-8")
    return path
