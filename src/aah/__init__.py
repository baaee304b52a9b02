"""AAH: Asymmetric Attention Heads.

Multi-head attention in which every head gets its own causal local window,
chosen by the hierarchical AAH-v3 controller and executed by backends that
skip the work outside each window.
"""

from . import windows
from .backends import attend, backend_names, register_backend

__version__ = "0.1.0"

__all__ = ["attend", "backend_names", "register_backend", "windows", "__version__"]
