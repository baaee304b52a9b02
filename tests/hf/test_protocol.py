"""docs/results/protocol.json: design and verdict seeds never meet, and each recorded verdict used
a verdict seed once and committed its evidence."""

from __future__ import annotations

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PROTOCOL = json.loads((REPO / "docs" / "results" / "protocol.json").read_text())


def test_design_and_verdict_seeds_are_disjoint():
    design, verdict = set(PROTOCOL["design"]["retrieval_seeds"]), set(PROTOCOL["verdict"]["seeds"])
    assert design and verdict and not design & verdict


def test_each_verdict_uses_its_own_verdict_seed_and_commits_its_evidence():
    seeds = [v["seed"] for v in PROTOCOL["verdicts"]]
    assert len(seeds) == len(set(seeds)) and set(seeds) <= set(PROTOCOL["verdict"]["seeds"])
    for verdict in PROTOCOL["verdicts"]:
        assert verdict["outcome"] in ("met", "missed")
        for path in verdict["evidence"]:
            assert (REPO / path).is_file(), path
