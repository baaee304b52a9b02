"""AAH: Asymmetric Attention Heads.

Multi-head attention in which every head gets its own causal local window,
chosen by the hierarchical AAH-v3 controller and executed by backends that
skip the work outside each window.
"""

from . import regimes, windows
from .attention import AAHAttention
from .backends import attend, backend_names, register_backend
from .controller import ControllerConfig, Decision, HeadController
from .decode.cache import WindowKVCache
from .decode.generate import generate
from .model import GPT, GPTConfig

__version__ = "0.1.0"

__all__ = [
    "AAHAttention",
    "ControllerConfig",
    "Decision",
    "GPT",
    "GPTConfig",
    "HeadController",
    "WindowKVCache",
    "attend",
    "backend_names",
    "generate",
    "register_backend",
    "regimes",
    "windows",
    "__version__",
]
