"""The bridge: per-head windows inside a pretrained transformers causal LM.

Imports run one way: ``spec`` (the windows a layer runs) and ``masks`` (from the one window
rule) under ``attention`` (the function registered with transformers), then ``kept_keys`` and
the window ``cache``, then ``generation`` and ``block_step``, and ``patch`` on top. Nothing is
imported here, so ``import aah.hf`` stays light; the public names are in :mod:`aah.hf`.
"""
