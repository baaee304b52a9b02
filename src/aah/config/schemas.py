"""The seven sections of a run and the whole (:class:`RunConfig`): frozen dataclasses whose values are
converted to their annotations, then checked once, where they are used: the ``model`` fields by
:class:`~aah.model.GPTConfig`, the ``aah`` overrides by :class:`ControllerConfig`, the others here,
the sections against each other by :mod:`aah.config.checks`. Also the model's and controller's
settings built from a :class:`RunConfig`."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .. import regimes
from ..controller.config import ControllerConfig
from ..data.recall import DISTANCES as RECALL_DISTANCES
from ..data.recall import KEY_FORMATS as RECALL_KEY_FORMATS
from ..data.recall import RECALL_CORPORA, RecallSpec
from ..model import GPTConfig
from .checks import check_controller, check_seq_len
from .values import ConfigError, check_type, fail, field_hints, one_of

PRECISIONS = ("fp32", "bf16", "auto")
DEVICES = ("auto", "cpu", "cuda")
DISTRIBUTED = ("ddp", "fsdp")
#: Vocabulary used to check the model section before the tokenizer is known.
_PLACEHOLDER_VOCAB = 256


@dataclass(frozen=True)
class Section:
    """Common behaviour: values are type-checked (and normalised) on construction, then validated."""

    section: ClassVar[str] = ""
    #: Fields of the configured object that the section does not take, with the reason.
    not_settable: ClassVar[dict[str, str]] = {}

    def __post_init__(self) -> None:
        hints = field_hints(type(self))
        for f in dataclasses.fields(self):
            value = check_type(self.key(f.name), getattr(self, f.name), hints[f.name])
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
            fail(self.key(name), f"must be >= {minimum}, got {value}")

    def _in_unit(self, name: str, *, closed: bool = False) -> None:
        value = getattr(self, name)
        if not (0.0 <= value <= 1.0 if closed else 0.0 <= value < 1.0):
            fail(self.key(name), f"must be in [0, 1{']' if closed else ')'}, got {value}")


@dataclass(frozen=True)
class ModelConfig(Section):
    """Backbone settings: the fields of :class:`~aah.model.GPTConfig`, with its defaults and checks.

    ``vocab_size`` None = the tokenizer's vocabulary; ``max_seq_len`` None = ``data.seq_len``.
    """

    section = "model"
    vocab_size: int | None = None
    n_layers: int = GPTConfig.n_layers
    d_model: int = GPTConfig.d_model
    n_heads: int = GPTConfig.n_heads
    n_kv_heads: int | None = GPTConfig.n_kv_heads
    d_ff: int | None = GPTConfig.d_ff
    max_seq_len: int | None = None
    norm: str = GPTConfig.norm
    activation: str = GPTConfig.activation
    positional: str = GPTConfig.positional
    rope_base: float = GPTConfig.rope_base
    tie_embeddings: bool = GPTConfig.tie_embeddings
    dropout: float = GPTConfig.dropout
    bias: bool = GPTConfig.bias
    backend: str = GPTConfig.backend

    def gpt_config(self, vocab_size: int, max_seq_len: int) -> GPTConfig:
        """These settings as a :class:`GPTConfig` of ``vocab_size`` tokens and ``max_seq_len`` positions."""
        try:
            return GPTConfig(**{**dataclasses.asdict(self), "vocab_size": vocab_size, "max_seq_len": max_seq_len})
        except ValueError as exc:
            raise ConfigError(str(exc)) from None

    def _validate(self) -> None:
        vocab, length = self.vocab_size, self.max_seq_len  # stand-ins for the tokenizer's and data.seq_len
        self.gpt_config(_PLACEHOLDER_VOCAB if vocab is None else vocab, 1 if length is None else length)


@dataclass(frozen=True)
class AAHConfig(Section):
    """The controller regime and flat overrides of its :class:`ControllerConfig` fields, which checks them.

    Every field but ``regime`` is an override; None keeps the regime's value.
    """

    section = "aah"
    not_settable = {
        "seed": "the controller seed is always train.seed",
        "enabled": "use aah.regime=full_attention for a run without a controller",
    }
    regime: str = "full_adaptive"
    windows: tuple[int, ...] | None = None
    min_window: int | None = None
    control_interval: int | None = None
    control_warmup: int | None = None
    feature_ema: float | None = None
    resolution_ema: float | None = None
    grouping: str | None = None
    hierarchy: tuple[int, ...] | None = None
    max_depth: int | None = None
    topology: str | None = None
    scoring: str | None = None
    parent_constraint: bool | None = None
    upper_levels: str | None = None
    keep_collapsed_top: bool | None = None
    standardize_features: bool | None = None
    diagnostics_context: str | None = None
    level0_threshold: float | None = None
    upper_threshold: float | None = None
    norm_penalty: float | None = None
    norm_eps: float | None = None
    shuffle_post_select: bool | None = None
    fixed_window_index: int | None = None
    diagnostic_queries: int | None = None
    base_hidden: int | None = None
    joint_hidden: int | None = None
    budget: float | None = None
    budget_scope: str | None = None
    uniform_exact: bool | None = None
    lost_mass_ema: float | None = None
    window_granularity: str | None = None
    warmup_trigger: str | None = None
    far_cost_threshold: float | None = None
    far_cost_patience: int | None = None
    warmup_max_steps: int | None = None

    def overrides(self) -> dict[str, Any]:
        """The ControllerConfig fields this section sets (all but ``regime`` and unset ones)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "regime" and getattr(self, f.name) is not None
        }

    def controller(self, seed: int) -> ControllerConfig:
        """The regime's controller with these overrides and ``seed``; its errors name ``aah.<field>``."""
        try:
            preset = regimes.get(self.regime)
        except ValueError as exc:
            fail(self.key("regime"), str(exc))
        try:
            return preset.replace(**self.overrides(), seed=seed)
        except ValueError as exc:
            raise ConfigError(re.sub(r"\bcontroller\.", "aah.", str(exc))) from None

    def _validate(self) -> None:
        self.controller(seed=0)


@dataclass(frozen=True)
class DataConfig(Section):
    """Corpus, tokenizer and block length."""

    section = "data"
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
            fail(self.key("corpus"), "must be a corpus name or a path, got ''")
        if self.val_corpus == "":
            fail(self.key("val_corpus"), "must be a corpus name, a path or null, got ''")
        tok = self.tokenizer
        if not (tok in ("byte", "bpe") or (tok.startswith("hf:") and len(tok) > 3)):
            fail(self.key("tokenizer"), f"must be 'byte', 'bpe' or 'hf:/local/path'; got {tok!r}")
        self._at_least("seq_len", 1)
        if not 0.0 < self.val_fraction < 1.0:
            fail(self.key("val_fraction"), f"must be in (0, 1), got {self.val_fraction}")
        self._at_least("bpe_vocab_size", 257)
        self._validate_recall()

    def _validate_recall(self) -> None:
        one_of(self.key("recall_distance"), self.recall_distance, RECALL_DISTANCES)
        one_of(self.key("recall_keys"), self.recall_keys, RECALL_KEY_FORMATS)
        recall = [c for c in (self.corpus, self.val_corpus) if c in RECALL_CORPORA]
        if not recall:
            return
        if self.tokenizer != "byte":
            bytes_only = f"the recall corpus {recall[0]!r} writes its episodes as bytes: use 'byte'"
            fail(self.key("tokenizer"), f"{bytes_only}; got {self.tokenizer!r}")
        try:
            self.recall_spec().validate(self.seq_len, prefix=f"{self.section}.recall_")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class OptimConfig(Section):
    """AdamW and the learning-rate schedule: linear warmup, then cosine to ``lr * min_lr_ratio``
    at ``decay_steps`` (``train.max_steps`` when unset)."""

    section = "optim"
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
            fail(self.key("eps"), f"must be > 0, got {self.eps}")


@dataclass(frozen=True)
class TrainConfig(Section):
    """Length, batch, seed, checkpoints and execution settings of the training loop."""

    section = "train"
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
        if any(s < 1 for s in self.checkpoint_steps):
            fail(self.key("checkpoint_steps"), f"steps must be >= 1, got {list(self.checkpoint_steps)}")
        object.__setattr__(self, "checkpoint_steps", tuple(sorted(set(self.checkpoint_steps))))
        one_of(self.key("precision"), self.precision, PRECISIONS)
        one_of(self.key("device"), self.device, DEVICES)
        one_of(self.key("distributed"), self.distributed, DISTRIBUTED)
        if not self.out_dir:
            fail(self.key("out_dir"), "must be a folder path, got ''")


@dataclass(frozen=True)
class EvalConfig(Section):
    """Periodic validation during training."""

    section = "eval"
    every: int = 100
    batches: int = 20
    batch_size: int | None = None

    def _validate(self) -> None:
        self._at_least("every", 0)
        self._at_least("batches", 1)
        self._at_least("batch_size", 1)


@dataclass(frozen=True)
class LogConfig(Section):
    """Metric logging."""

    section = "log"
    every: int = 10
    tensorboard: bool = True
    progress: bool = True

    def _validate(self) -> None:
        self._at_least("every", 1)


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
        for name, cls in SECTION_TYPES.items():
            value = getattr(self, name)
            if not isinstance(value, cls):
                fail(name, f"expected {cls.__name__}, got {type(value).__name__}")
        check_seq_len(self.data.seq_len, self.model.max_seq_len)
        gpt = self.model.gpt_config(self.model.vocab_size or _PLACEHOLDER_VOCAB, self.max_seq_len)
        origin = "model.max_seq_len" if self.model.max_seq_len is not None else "data.seq_len"
        check_controller(self.aah.controller(self.train.seed), gpt, origin)

    @property
    def max_seq_len(self) -> int:
        """The model's maximum length: ``model.max_seq_len``, else ``data.seq_len``."""
        return self.data.seq_len if self.model.max_seq_len is None else self.model.max_seq_len

    @property
    def eval_batch_size(self) -> int:
        """Validation batch size: ``eval.batch_size``, else ``train.batch_size``."""
        return self.train.batch_size if self.eval.batch_size is None else self.eval.batch_size


#: The section classes by name, in the order they are written.
SECTION_TYPES: dict[str, type[Section]] = dict(field_hints(RunConfig))
SECTIONS = tuple(SECTION_TYPES)


def model_config(cfg: RunConfig, vocab_size: int) -> GPTConfig:
    """The :class:`GPTConfig` of ``cfg`` for a tokenizer of ``vocab_size`` tokens.

    ``model.vocab_size``, when set, is used instead (it may pad the tokenizer's
    vocabulary, never shrink it); ``max_seq_len`` defaults to ``data.seq_len``.
    """
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ConfigError(f"vocab_size: expected a positive int, got {vocab_size!r}")
    vocab = cfg.model.vocab_size
    if vocab is not None and vocab < vocab_size:
        fail("model.vocab_size", f"must be >= the tokenizer's vocabulary ({vocab_size}) or null, got {vocab}")
    return cfg.model.gpt_config(vocab_size if vocab is None else vocab, cfg.max_seq_len)


def controller_config(cfg: RunConfig) -> ControllerConfig | None:
    """The regime's controller settings with the ``aah`` overrides and ``seed=train.seed``.

    None for ``full_attention`` or any regime whose controller is disabled.
    """
    if cfg.aah.regime == "full_attention":
        return None
    ctrl = cfg.aah.controller(cfg.train.seed)
    return ctrl if ctrl.enabled else None
