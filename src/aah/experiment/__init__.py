"""Experiment suites: run every (regime, seed), evaluate, and report (paper Tables 3-6, 8)."""

from .suite import (
    RECORD_FILES,
    RunSpec,
    Suite,
    load_suite,
    plan_runs,
    run_state,
    run_suite,
    sync_records,
)

__all__ = ["RECORD_FILES", "RunSpec", "Suite", "load_suite", "plan_runs", "run_state", "run_suite", "sync_records"]
