"""Experiment suites: run every (regime, seed), evaluate, and report (paper Tables 3-6, 8)."""

from .records import RECORD_FILES, RecordError, verify_record, write_manifest
from .suite import (
    RunSpec,
    Suite,
    load_suite,
    plan_runs,
    run_state,
    run_suite,
    sync_records,
)

__all__ = [
    "RECORD_FILES", "RecordError", "RunSpec", "Suite", "load_suite", "plan_runs", "run_state", "run_suite",
    "sync_records", "verify_record", "write_manifest",
]
