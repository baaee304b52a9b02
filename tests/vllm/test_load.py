"""``aah bench vllm --load``: the percentile, arrival and prompt helpers and the report (no vLLM),
and both engines under load on a tiny model folder (in the vLLM environment; skipped without it)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from aah.vllm.load import (
    ENGINE_KEYS,
    RATIO_KEYS,
    arrival_offsets,
    percentile,
    ratios,
    summarize,
    token_prompts,
)

from .test_plugin import _bench_model, _tiny_model, _vllm_unavailable, _windows_file

# ---- the helpers (no vLLM) -------------------------------------------------------------------


def test_percentile_interpolates_between_the_closest_ranks():
    values = [4.0, 1.0, 3.0, 2.0, 10.0]  # sorted: 1 2 3 4 10
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 10.0
    assert percentile(values, 99) == pytest.approx(4 + 0.96 * 6)  # rank 0.99 * 4 = 3.96
    assert percentile(values, 25) == 2.0 and percentile(values, 90) == pytest.approx(4 + 0.6 * 6)
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_arrivals_at_once_or_poisson_at_a_rate():
    assert arrival_offsets(4, None) == [0.0] * 4
    times = arrival_offsets(2000, 8.0, seed=3)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))
    assert times == arrival_offsets(2000, 8.0, seed=3) and times != arrival_offsets(2000, 8.0, seed=4)
    gaps = [b - a for a, b in zip(times, times[1:])]
    mean = sum(gaps) / len(gaps)
    assert abs(mean - 1 / 8) < 4 * (1 / 8) / math.sqrt(len(gaps))  # the exponential's mean, within 4 sigma
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rate"):
            arrival_offsets(3, bad)
    with pytest.raises(ValueError, match="requests"):
        arrival_offsets(0, None)


def test_prompts_are_distinct_unless_a_prefix_is_shared():
    prompts = token_prompts(6, 40, 50, seed=1)
    assert len(prompts) == 6 and all(len(p) == 40 and max(p) < 50 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 6  # no two share even their first block
    assert prompts == token_prompts(6, 40, 50, seed=1)
    shared = token_prompts(6, 40, 50, seed=1, shared_prefix=32)
    assert len({tuple(p[:32]) for p in shared}) == 1 and len({tuple(p[32:]) for p in shared}) == 6
    with pytest.raises(ValueError, match="shared prefix"):
        token_prompts(2, 40, 50, seed=1, shared_prefix=40)


def _engine_result(scale: float, peak: int, concurrency: float) -> dict:
    # four requests: arrivals 0, 0, 1, 2; first tokens and finishes at hand-picked times
    requests = [{"arrival_s": a, "first_token_s": a + scale * t, "finish_s": a + scale * e, "output_tokens": 10}
                for a, t, e in ((0, 1, 4), (0, 2, 5), (1, 1, 3), (2, 3, 6))]
    return {"requests": requests, "max_concurrency": concurrency, "kv_cache_tokens": 1000, "kv_cache_blocks": 10,
            "block_size": 100, "peak_running": peak, "peak_kv_cache_usage": 0.9, "startup_s": 1.0}


def test_summary_and_ratios_by_hand():
    vanilla = summarize(_engine_result(1.0, 2, 2.5))
    assert set(vanilla) == set(ENGINE_KEYS)
    assert vanilla["requests"] == 4 and vanilla["output_tokens"] == 40
    assert vanilla["duration_s"] == 8.0 and vanilla["output_tok_s"] == 5.0  # first arrival 0, last finish 2 + 6
    assert vanilla["ttft_median_s"] == 1.5 and vanilla["ttft_p99_s"] == pytest.approx(2 + 0.97)  # 1 1 2 3
    assert vanilla["e2e_median_s"] == 4.5 and vanilla["e2e_p99_s"] == pytest.approx(5 + 0.97)  # 3 4 5 6
    aah = summarize(_engine_result(0.5, 4, 5.0))
    got = ratios(aah, vanilla)
    assert set(got) == set(RATIO_KEYS)
    assert got["max_concurrency"] == 2.0 and got["peak_running"] == 2.0
    assert got["ttft_median_s"] == 0.5 and got["e2e_p99_s"] == pytest.approx(0.5)
    assert got["output_tok_s"] == pytest.approx(8.0 / 5.0)  # 40 tokens in 5 s against 8 s
    assert ratios({"peak_running": 3}, {"peak_running": 0})["peak_running"] is None


def test_load_report_keys_and_table_from_the_runners_results(tmp_path, monkeypatch, capsys):
    # The runner is replaced by one that answers each engine's load with hand-made results.
    from aah.vllm import bench

    _bench_model(tmp_path)
    seen = {}

    def fake_runner(cmd, env, stdout):
        spec = json.loads(Path(cmd[3]).read_text())
        seen.update(spec=spec, env=env)
        results = {e["name"]: _engine_result(1.0 if e["name"] == "vanilla" else 0.5, 2 if e["name"] == "vanilla"
                                             else 4, 2.5 if e["name"] == "vanilla" else 5.0) for e in spec["engines"]}
        Path(cmd[4]).write_text(json.dumps(results))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", fake_runner)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "9")
    out = tmp_path / "load.json"
    argv = [str(tmp_path), "--windows-file", str(tmp_path / "w.safetensors"), "--load", "--requests", "4",
            "--seq-len", "40", "--new-tokens", "6", "--rate", "2", "--kv-cache-gib", "0.5",
            "--max-num-batched-tokens", "16", "--vllm-python", sys.executable, "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"config", "vanilla", "aah", "ratios"}
    for name in ("vanilla", "aah"):
        assert set(report[name]) == set(ENGINE_KEYS)
    assert report["ratios"]["max_concurrency"] == 2.0 and report["config"]["max_model_len"] == 46
    engines = seen["spec"]["engines"]
    assert [e["name"] for e in engines] == ["vanilla", "aah"] and engines[0]["load"] == engines[1]["load"]
    assert engines[0]["engine_args"] == engines[1]["engine_args"] == {
        "max_model_len": 46, "enable_prefix_caching": True, "disable_log_stats": False,
        "kv_cache_memory_bytes": 2**29, "max_num_batched_tokens": 16}
    assert "VLLM_CPU_KVCACHE_SPACE" not in seen["env"]  # it would replace the engines' KV cache size
    assert engines[0]["load"]["arrivals"] == arrival_offsets(4, 2.0, 0)
    table = capsys.readouterr().out
    assert "4 requests of 40 + 6 tokens, Poisson at 2/s, KV cache 0.5 GiB per engine" in table
    assert "max concurrency (vLLM)" in table and "2.50" in table and "5.00" in table


def test_load_flag_errors_are_one_line(tmp_path, capsys):
    from aah.vllm.bench import main as bench_main

    _bench_model(tmp_path)
    base = [str(tmp_path), "--windows-file", str(tmp_path / "w.safetensors"), "--vllm-python", sys.executable]
    cases = [
        (["--load", "--requests", "0"], "--requests must be >= 1, got 0"),
        (["--load", "--rate", "0"], "--rate must be > 0 requests/s, got 0"),
        (["--load", "--kv-cache-gib", "0"], "--kv-cache-gib must be > 0, got 0"),
        (["--load", "--seq-len", "64", "--shared-prefix", "64"], "--shared-prefix must be in [0, --seq-len) = [0, 64)"),
        (["--load", "--check"], "--check goes without --load"),
        (["--rate", "2"], "--rate goes with --load only"),
    ]
    for extra, message in cases:
        assert bench_main([*base, *extra]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("aah bench vllm: ") and message in err and "\n" not in err, err


# ---- both engines under load (vLLM) ----------------------------------------------------------

#: Prompt and output tokens of the load test: max_model_len 416 of the tiny model's 512.
PROMPT, OUTPUT = 400, 16


@pytest.mark.slow
def test_load_mode_runs_both_engines_on_a_tiny_kv_budget(tmp_path, byte_bpe):
    """Six requests at once in a KV cache of about 2 MiB: vanilla vLLM fits at most about 2.5
    requests of 416 tokens (2 layers x 2 KV heads x 64 x keys and values x 4 bytes = 2 KiB a token,
    less where blocks are cut); windows of 16 with 4 sinks, far shorter than the prompt, keep a few
    blocks a request, so vLLM reports a larger concurrency for them. No engine runs more requests at
    once than its figure allows."""
    reason = _vllm_unavailable()
    if reason:
        pytest.skip(reason)
    from aah.vllm import bench

    model_dir = _tiny_model(tmp_path, byte_bpe)
    windows = _windows_file(tmp_path / "w.safetensors", model_dir, [[16] * 4] * 2, 4)
    out = tmp_path / "load.json"
    argv = [str(model_dir), "--windows-file", str(windows), "--load", "--requests", "6", "--seq-len", str(PROMPT),
            "--new-tokens", str(OUTPUT), "--kv-cache-gib", "0.002", "--max-num-batched-tokens", "64",
            "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"config", "vanilla", "aah", "ratios"}
    for name in ("vanilla", "aah"):
        result = report[name]
        assert set(result) == set(ENGINE_KEYS)
        assert result["requests"] == 6 and result["output_tokens"] == 6 * OUTPUT
        assert 1 <= result["peak_running"] <= math.ceil(result["max_concurrency"]), (name, result)
        assert 0 < result["ttft_median_s"] <= result["ttft_p99_s"] and result["e2e_median_s"] <= result["e2e_p99_s"]
        assert result["output_tok_s"] > 0
    assert report["vanilla"]["max_concurrency"] < 6
    assert report["aah"]["max_concurrency"] > report["vanilla"]["max_concurrency"]
    assert report["ratios"]["max_concurrency"] == pytest.approx(
        report["aah"]["max_concurrency"] / report["vanilla"]["max_concurrency"])
