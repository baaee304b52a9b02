"""Evaluation of trained runs: validation loss, perplexity, coverage, windows, tokens/s."""

from .core import eval_filename, evaluate_run, print_summary, validation_loss

__all__ = ["eval_filename", "evaluate_run", "print_summary", "validation_loss"]
