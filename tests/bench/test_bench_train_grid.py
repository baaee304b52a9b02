"""``aah bench train`` (with a live controller) and ``aah bench grid``: their JSON contracts."""

from __future__ import annotations

import json

import pytest

from aah.bench.grid import DEFAULT_BATCH, format_markdown, run_grid
from aah.bench.train import bench_train
from aah.cli import main
from aah.windows import causal_coverage

TRAIN_KEYS = {
    "seq_len", "layers", "d_model", "heads", "batch", "windows", "acr", "causal_coverage",
    "backend_full", "backend_aah", "full_step_ms", "aah_step_ms", "full_tokens_per_s",
    "aah_tokens_per_s", "speedup", "repeats", "device", "threads", "controller", "controller_overhead",
}
CONTROLLER_KEYS = {
    "regime", "control_interval", "steps", "control_updates", "update_ms", "step_ms", "overhead",
    "backend", "causal_coverage_end", "updates_ms", "parts_ms",
}


def test_bench_train_reports_speedup_and_live_controller_overhead():
    r = bench_train(seq_len=32, layers=1, d_model=32, heads=4, batch=1, repeats=5, warmup=1)
    assert set(r) == TRAIN_KEYS
    json.dumps(r)
    assert r["speedup"] == pytest.approx(r["full_step_ms"] / r["aah_step_ms"])
    assert r["causal_coverage"] == pytest.approx(causal_coverage(r["windows"], 32))
    assert r["backend_aah"].startswith("auto(") and r["backend_full"] == "sdpa"
    c = r["controller"]
    assert set(c) == CONTROLLER_KEYS and c["regime"] == "full_adaptive"
    # Steps 1..5 are timed (step 0 is the warm-up); the paper's interval 5 acts at step 5.
    assert c["steps"] == 5 and c["control_interval"] == 5 and c["control_updates"] == 1
    # The overhead's size is a timing (the benchmark's job); the test checks how it is formed.
    assert c["update_ms"] > 0 and c["overhead"] > 0
    assert r["controller_overhead"] == c["overhead"]
    assert c["overhead"] == pytest.approx(c["update_ms"] / c["control_interval"] / c["step_ms"])
    assert len(c["updates_ms"]) == 1 and c["updates_ms"][0] == pytest.approx(c["update_ms"])
    parts = c["parts_ms"]
    assert set(parts) == {"scores", "lost_mass", "features", "decision", "commit", "diagnostics", "other"}
    assert all(ms >= 0 for ms in parts.values()) and parts["scores"] > 0 and parts["decision"] > 0
    assert sum(parts.values()) == pytest.approx(c["update_ms"])


def test_bench_train_default_rounds_include_three_control_updates():
    r = bench_train(seq_len=32, layers=1, d_model=32, heads=4, batch=1, warmup=1)
    c = r["controller"]
    assert r["repeats"] == c["steps"] == 15 and c["control_updates"] == 3  # steps 5, 10 and 15
    assert len(c["updates_ms"]) == 3 and c["update_ms"] == pytest.approx(sorted(c["updates_ms"])[1])
    no_ctrl = bench_train(seq_len=32, layers=1, d_model=32, heads=4, batch=1, warmup=0, regime=None)
    assert no_ctrl["repeats"] == 10


def test_bench_train_without_controller_and_bad_regime():
    r = bench_train(seq_len=32, layers=1, d_model=32, heads=4, batch=1, repeats=1, warmup=0, regime=None)
    assert r["controller"] is None and r["controller_overhead"] is None
    with pytest.raises(ValueError, match="--regime must be one of"):
        bench_train(seq_len=32, layers=1, d_model=32, heads=4, batch=1, repeats=1, regime="nope")


def test_bench_grid_writes_every_cell_with_limits(tmp_path):
    out = tmp_path / "grid.json"
    seen = []
    result = run_grid(
        seq_lens=(32, 64), head_dims=(8,), batches=(1,), mixes=("full_adaptive", "grouping_off"), heads=4, layers=1,
        backends=("strips", "banded"), train_head_dims=(8,), repeats=1, train_repeats=1, out_json=out,
        log=seen.append,
    )
    on_disk = json.loads(out.read_text())
    assert on_disk["rows"] == result["rows"] and len(result["rows"]) == 4
    assert len(seen) == 5  # one line per cell, then the summary
    for row in result["rows"]:
        assert row["batch"] == 1
        assert row["causal_coverage"] == pytest.approx(causal_coverage(row["windows"], row["seq_len"]))
        for part in ("forward", "forward_backward"):
            assert set(row[part]["ratio"]) == {"strips", "banded"} and row[part]["sdpa_ms"] > 0
        tr = row["train"]
        share = min(1.0, 1 * row["forward_backward"]["sdpa_ms"] / tr["full_step_ms"])
        assert tr["attention_share"] == pytest.approx(share)
        assert tr["speedup_limit"] == pytest.approx(1 / (1 - share * (1 - row["causal_coverage"])))
    md = (tmp_path / "grid.md").read_text()
    assert md == format_markdown(result)
    assert md.startswith("| T | D | B | mix |") and md.count("\n| ") == 4  # one line per cell


def test_bench_grid_default_batch_keeps_tokens_per_call():
    assert {t: t * b for t, b in DEFAULT_BATCH.items()} == {512: 4096, 1024: 4096, 2048: 4096, 4096: 4096}


def test_bench_grid_cli_validates_options(tmp_path, capsys):
    assert main(["bench", "grid", "--seq-lens", "6x", "--out", str(tmp_path / "g.json")]) == 2
    assert "--seq-lens must be comma-separated integers" in capsys.readouterr().err
    assert main(["bench", "grid", "--mixes", "nope", "--seq-lens", "32", "--out", str(tmp_path / "g.json")]) == 2
    assert "--mixes: unknown mix 'nope'" in capsys.readouterr().err
    assert not (tmp_path / "g.json").exists()


def test_bench_grid_resume_keeps_finished_cells_and_refuses_other_settings(tmp_path):
    out = tmp_path / "grid.json"
    small = dict(seq_lens=(32,), head_dims=(8,), batches=(1,), heads=4, layers=1, backends=("strips",),
                 train_head_dims=(), repeats=1, out_json=out, log=lambda msg: None)
    first = run_grid(mixes=("full_adaptive",), **small)
    seen = []
    resumed = run_grid(mixes=("full_adaptive", "grouping_off"), resume=True, **{**small, "log": seen.append})
    assert resumed["rows"][0] == first["rows"][0]  # kept as measured, not re-timed
    assert [r["mix"] for r in resumed["rows"]] == ["full_adaptive", "grouping_off"]
    assert "kept from" in seen[0] and "kept from" not in seen[1]
    assert json.loads(out.read_text())["rows"] == resumed["rows"]
    # The kept cells are written too when they come last.
    out.write_text(json.dumps({**json.loads(out.read_text()), "rows": resumed["rows"][1:]}))
    again = run_grid(mixes=("full_adaptive", "grouping_off"), resume=True, **small)
    assert again["rows"][1] == resumed["rows"][1]
    assert json.loads(out.read_text())["rows"] == again["rows"] and len(again["rows"]) == 2
    # A grid over other cells keeps the earlier ones in the file, after its own.
    wider = run_grid(mixes=("full_adaptive",), resume=True, **{**small, "seq_lens": (16,)})
    assert [(r["seq_len"], r["mix"]) for r in wider["rows"]] == [
        (16, "full_adaptive"), (32, "full_adaptive"), (32, "grouping_off")]
    assert json.loads(out.read_text())["rows"] == wider["rows"]
    with pytest.raises(ValueError, match=r"other settings \(repeats\)"):
        run_grid(mixes=("full_adaptive",), resume=True, **{**small, "repeats": 2})
    out.write_text("not json")
    with pytest.raises(ValueError, match="not a grid JSON file"):
        run_grid(mixes=("full_adaptive",), resume=True, **small)
