"""Judging windows on a pretrained model: perplexity, speed and KV bytes (``compare``),
synthetic retrieval tasks (``tasks``) run and scored with an answers journal (``retrieval``),
held-out text (``text``) and the lm-evaluation-harness model type (``lm_eval_model``)."""
