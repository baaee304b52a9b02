"""Decoding: the decode engine shared by the GPT and the Hugging Face bridge (paper section 5.8).

* :mod:`aah.decode.rings`: the ring core, per layer and KV head sink slots and a ring of the
  largest window its query heads read, every KV head in one pair of flat buffers; its masked
  attention follows :func:`aah.windows.visible`;
* :mod:`aah.decode.route`: the one decision of which route a call takes (prefill, compiled block,
  compiled attention, masked) and why no faster one, for the GPT, the bridge and kept keys alike;
* :mod:`aah.decode.cache`: the small GPT's cache on that store;
* :mod:`aah.decode.block_step`: a GPT block's weights mapped for the compiled whole-block step;
* :mod:`aah.decode.extension` builds and loads the compiled CPU steps (``csrc/``, on first use),
  and :mod:`aah.decode.ring_decode` calls them: one query per head over its window of a ring with
  sinks, a whole decoder block in one call, the one-row linear layers and the paged kernel of
  :mod:`aah.vllm`; the Hugging Face bridge's cache (:mod:`aah.hf.bridge.cache`) is the same store
  and runs the same steps;
* :mod:`aah.decode.generate` and :mod:`aah.decode.cli`: token generation and ``aah generate``.
"""
