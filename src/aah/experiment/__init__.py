"""Experiment suites: run every (regime, seed), evaluate, and report (paper Tables 3-6, 8)."""

from .suite import RunSpec, Suite, load_suite, plan_runs, run_state, run_suite

__all__ = ["RunSpec", "Suite", "load_suite", "plan_runs", "run_state", "run_suite"]
