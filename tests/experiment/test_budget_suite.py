"""The policies suite: one command plans every policy, budget and seed."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from aah.config import ConfigError
from aah.experiment.suite import load_suite, plan_runs

SUITE = Path(__file__).resolve().parents[2] / "configs" / "suites" / "cpu" / "policies.yaml"


def test_policies_suite_plans_every_policy_budget_and_seed(tmp_path):
    suite = load_suite(SUITE)
    specs = plan_runs(suite, tmp_path)
    assert len(specs) == 7 * 3
    by_name = {(s.regime, s.seed): s for s in specs}
    assert len(by_name) == len(specs)
    assert len({s.run_dir for s in specs}) == len(specs)
    for seed in (0, 1, 2):
        aah = {name: by_name[(name, seed)].resolved["aah"] for name in suite.regimes}
        assert aah["budgeted"]["regime"] == "budgeted" and aah["budgeted"]["budget"] == 0.45
        assert aah["budgeted_grouped"]["budget"] == 0.45
        assert aah["uniform_window"]["budget"] == 0.45 and aah["uniform_window"]["uniform_exact"] is True
        assert aah["budgeted_tight"]["regime"] == "budgeted" and aah["budgeted_tight"]["budget"] == 0.3
        assert aah["uniform_tight"]["regime"] == "uniform_window" and aah["uniform_tight"]["budget"] == 0.3
        assert aah["full_adaptive"].get("budget") is None
        assert by_name[("budgeted_tight", seed)].run_dir == tmp_path / "budgeted_tight" / f"seed{seed}"
    assert {s.max_steps for s in specs} == {600}


def test_variants_are_validated(tmp_path):
    base = {"config_dir": str(SUITE.parent / "../../cpu"), "regimes": ["budgeted", "tight"]}
    for variants, match in (
        ({"tight": {"regime": "nope"}}, "unknown regime 'nope'"),
        ({"tight": {"overrides": []}}, "needs 'regime'"),
        ({"other": {"regime": "budgeted"}}, "not listed in regimes"),
    ):
        path = tmp_path / "suite.yaml"
        path.write_text(yaml.safe_dump(base | {"variants": variants}))
        with pytest.raises(ConfigError, match=match):
            load_suite(path)
