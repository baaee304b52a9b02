"""Decoding: the per-head-window KV caches' ring storage and the compiled decode steps.

* :mod:`aah.decode.cache`: the small GPT's cache (paper section 5.8 at inference), per layer
  and KV head a ring of the largest window its query heads read;
* :mod:`aah.decode.ring_decode`: the compiled CPU steps (``csrc/``, built on first use): one
  query per head over its window of a ring with sinks, a whole decoder block in one call, the
  one-row linear layers and the paged kernel of :mod:`aah.vllm`; the Hugging Face bridge's
  cache (:mod:`aah.hf.cache`) keeps the same flat ring layout and runs the same steps;
* :mod:`aah.decode.generate` and :mod:`aah.decode.cli`: token generation and ``aah generate``.
"""
