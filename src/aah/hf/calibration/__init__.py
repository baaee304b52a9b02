"""Window policies for pretrained models: choose each head's window on calibration text.

``policies`` holds :func:`aah.hf.calibrate` and its policies; ``window_kl`` estimates the KL
each window adds, ``answer_loss`` what it costs on synthetic retrieval, and ``repair`` widens the
KV groups that most lower the answer loss. The public names are in :mod:`aah.hf`.
"""
