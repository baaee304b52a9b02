"""Training harness: the paper's protocol (section 7.1) with checkpoints, resume and torchrun."""

from __future__ import annotations

__all__ = ["TrainResult", "TrainingStopped", "lr_at", "param_groups", "train"]


def __getattr__(name: str):
    # Imported lazily: evaluation uses the checkpoint helpers without pulling in the trainer.
    if name in __all__:
        from . import trainer

        return getattr(trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
