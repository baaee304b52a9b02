"""Patched models in lm-evaluation-harness (optional extra: ``pip install -e '.[eval]'``).

Importing this module registers the model type ``aah_hf``: lm-eval's own Hugging Face model
(``HFLM``) whose model is patched with the windows of a windows file (``aah hf calibrate``)
right after it loads. Every ``HFLM`` argument works as usual; these are added:

* ``windows=FILE`` (required): the windows file; a file made for another model is refused;
* ``sink_tokens=S`` (optional): overrides the sink tokens the file records;
* ``tail_tokens=N,kept_keys=K`` (optional, together), ``kept_pool=P``, ``prefill_kept=K2``,
  ``prefill_block=B``: kept keys and rolling kept keys (:mod:`aah.hf.bridge.kept_keys`), with the
  meaning and checks of ``aah hf eval``'s ``--tail-tokens`` ... ``--prefill-block``. The model is
  patched with them, so the window cache of every ``generate`` (the generation tasks: ``niah_single_1``,
  ``ruler_vt``, ...) keeps them; log-likelihood tasks read without that cache, by the windows alone.

lm-eval finds models by name in its registry, so run it through this module, which registers
``aah_hf`` and then hands the command line to lm-eval unchanged::

    python -m aah.hf.evaluation.lm_eval_model --model aah_hf \\
        --model_args pretrained=models/smollm2,windows=w.safetensors --device cpu \\
        --tasks niah_single_1 --metadata '{"max_seq_lengths": [4096]}' --limit 10

From Python, ``import aah.hf.evaluation.lm_eval_model`` before ``lm_eval.simple_evaluate(model="aah_hf", ...)``.
"""

from __future__ import annotations

import os

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as exc:  # pragma: no cover - depends on the optional extra
    raise ImportError(
        "aah.hf.evaluation.lm_eval_model needs lm-evaluation-harness: pip install -e '.[eval]' (lm-eval==0.4.13)"
    ) from exc

from ..bridge.kept_keys import KEPT_SETTINGS, kept_keys_from
from ..bridge.patch import patch
from ..bridge.windows_file import check_windows_for, load_windows

__all__ = ["AAHLM", "MODEL_NAME", "main"]

#: The name under which the patched model type is registered with lm-eval.
MODEL_NAME = "aah_hf"


@register_model(MODEL_NAME)
class AAHLM(HFLM):
    """lm-eval's ``HFLM`` with the model patched with a windows file's per-head windows and sinks,
    and the kept keys of ``tail_tokens``, ``kept_keys``, ... (:func:`aah.hf.bridge.kept_keys.kept_keys_from`)."""

    def __init__(self, pretrained, windows: str | None = None, sink_tokens: int | str | None = None, **kwargs) -> None:
        if not windows:
            raise ValueError(f"model {MODEL_NAME!r} needs windows=FILE in --model_args (a file of aah hf calibrate)")
        settings = {key: _integer(kwargs.pop(key, None)) for key in KEPT_SETTINGS}
        try:
            kept = kept_keys_from(settings)
        except ValueError as exc:
            raise ValueError(f"model {MODEL_NAME!r}, --model_args: {exc}") from None
        grid, meta = load_windows(windows)  # fail on a bad file before the weights load
        super().__init__(pretrained, **kwargs)
        check_windows_for(self.model.config, grid, meta, str(windows))
        sinks = int(meta["sink_tokens"]) if sink_tokens in (None, "") else int(sink_tokens)
        patch(self.model, grid, sink_tokens=sinks, kept_keys=kept)
        self.windows_file, self.windows, self.sink_tokens, self.kept_keys = str(windows), grid, sinks, kept


def _integer(value):
    """A ``model_args`` value as lm-eval or a caller gives it: ``None`` for none or empty, an int for
    an integer string; anything else as it is, for :func:`kept_keys_from` to refuse."""
    if value is None or value == "":
        return None
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        return int(value)
    return value


def main() -> None:
    """``lm_eval``'s command line with ``aah_hf`` registered."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.__main__ import cli_evaluate

    cli_evaluate()


if __name__ == "__main__":
    main()
