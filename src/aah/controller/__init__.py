"""The AAH-v3 controller: features, hierarchy, scoring, selection (paper sections 5.3-5.8)."""

from .config import (
    DIAGNOSTIC_CONTEXTS,
    GROUPINGS,
    SCORINGS,
    TOPOLOGIES,
    UPPER_LEVELS,
    ControllerConfig,
)
from .controller import Decision, HeadController, LevelDecision, derive_seed
from .features import FEATURE_NAMES, NUM_FEATURES, attention_diagnostics, qkv_statistics

__all__ = [
    "ControllerConfig",
    "DIAGNOSTIC_CONTEXTS",
    "Decision",
    "FEATURE_NAMES",
    "GROUPINGS",
    "HeadController",
    "LevelDecision",
    "NUM_FEATURES",
    "SCORINGS",
    "TOPOLOGIES",
    "UPPER_LEVELS",
    "attention_diagnostics",
    "derive_seed",
    "qkv_statistics",
]
