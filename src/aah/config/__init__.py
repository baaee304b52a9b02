"""Run configuration: the typed, validated settings of one training run, read from YAML.

Seven sections, each a frozen dataclass (:mod:`.schemas`): ``model`` (every GPTConfig field),
``aah`` (a regime and overrides of its ControllerConfig fields), ``data``, ``optim``, ``train``,
``eval`` and ``log``. :func:`load_config` (:mod:`.loader`) reads a YAML file (which may inherit
from others through ``base:``), applies ``section.key=value`` overrides and validates everything
before any work starts: every error is a :class:`ConfigError` (:mod:`.values`) naming the full
key (``train.max_steps``) and what is allowed. :func:`controller_config` and :func:`model_config`
turn a :class:`RunConfig` into the objects the model is built from. See ``docs/configuration.md``.
"""

from .loader import BASE_KEY, config_from_dict, config_to_dict, load_config, save_config
from .schemas import (
    DEVICES,
    DISTRIBUTED,
    PRECISIONS,
    SECTIONS,
    AAHConfig,
    DataConfig,
    EvalConfig,
    LogConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    controller_config,
    model_config,
)
from .values import ConfigError

__all__ = [
    "AAHConfig", "BASE_KEY", "ConfigError", "DataConfig", "DEVICES", "DISTRIBUTED", "EvalConfig",
    "LogConfig", "ModelConfig", "OptimConfig", "PRECISIONS", "RunConfig", "SECTIONS", "TrainConfig",
    "config_from_dict", "config_to_dict", "controller_config", "load_config", "model_config",
    "save_config",
]
