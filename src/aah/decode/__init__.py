"""Decoding: the decode engine shared by the GPT and the Hugging Face bridge (paper section 5.8).

* :mod:`aah.decode.rings`: the ring core, per layer and KV head sink slots and a ring of the
  largest window its query heads read, every KV head in one pair of flat buffers; its masked
  attention follows :func:`aah.windows.visible`;
* :mod:`aah.decode.cache`: the small GPT's cache on that store, and the route each call takes;
* :mod:`aah.decode.block_step`: when a GPT block's one-token step runs compiled;
* :mod:`aah.decode.ring_decode`: the compiled CPU steps (``csrc/``, built on first use): one
  query per head over its window of a ring with sinks, a whole decoder block in one call, the
  one-row linear layers and the paged kernel of :mod:`aah.vllm`; the Hugging Face bridge's
  cache (:mod:`aah.hf.cache`) is the same store and runs the same steps;
* :mod:`aah.decode.generate` and :mod:`aah.decode.cli`: token generation and ``aah generate``.
"""
