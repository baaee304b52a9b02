"""``aah bench decode``: the JSON schema is a contract (the docs' tables are made from it)."""

from __future__ import annotations

import json

import pytest

from aah.bench.decode import RESULT_KEYS, TOP_KEYS, bench_decode, group_windows
from aah.cli import main
from aah.windows import acr, causal_coverage

SMALL = ["--context", "24", "--new-tokens", "4", "--layers", "1", "--d-model", "32", "--heads", "4",
         "--repeats", "1", "--warmup", "0"]


def _check_schema(result: dict, batch: int) -> None:
    assert set(TOP_KEYS) <= set(result)
    config = result["config"]
    for key in ("acr", "causal_coverage", "windows", "context", "new_tokens", "batch", "kv_heads",
                "window_granularity", "dtype"):
        assert key in config
    assert config["decode_step"] == "compiled" or config["decode_step"].startswith("pytorch (")
    seq_len = config["seq_len"]
    assert config["acr"] == pytest.approx(acr(config["windows"], seq_len))
    assert config["causal_coverage"] == pytest.approx(causal_coverage(config["windows"], seq_len))
    names = [r["name"] for r in result["results"]]
    assert sorted(names) == ["aah", "full"]
    for r in result["results"]:
        assert set(RESULT_KEYS) <= set(r)
        assert r["prefill_s"] > 0 and r["decode_tok_s"] > 0 and r["peak_rss_mb"] > 0
        assert isinstance(r["kv_bytes"], int)
    by = {r["name"]: r for r in result["results"]}
    assert result["decode_speedup"] == pytest.approx(by["aah"]["decode_tok_s"] / by["full"]["decode_tok_s"])
    assert result["prefill_speedup"] == pytest.approx(by["full"]["prefill_s"] / by["aah"]["prefill_s"])
    assert result["kv_bytes_ratio"] == pytest.approx(by["aah"]["kv_bytes"] / by["full"]["kv_bytes"])
    # Full cache: layers x KV heads x T x head dim x 2 (K, V) x batch x 4 bytes (float32).
    layers, head_dim = config["layers"], config["head_dim"]
    assert by["full"]["kv_bytes"] == layers * config["kv_heads"] * seq_len * head_dim * 2 * batch * 4
    json.dumps(result)  # plain JSON values only


def test_cli_json_schema_mha(capsys) -> None:
    assert main(["bench", "decode", *SMALL, "--batch", "2", "--json", "-"]) == 0
    result = json.loads(capsys.readouterr().out)
    _check_schema(result, batch=2)
    config = result["config"]
    assert config["seq_len"] == 32  # 24 + 4 rounded up to a power of two
    # full_adaptive on 4 heads: quotas 2.54, 0.74, 0.46, 0.26 give (3, 1, 0, 0) heads at T/8, T/4.
    assert config["windows"] == [4, 4, 4, 8]
    # MHA: each KV head keeps exactly its window, so the KV bytes ratio is the ACR.
    assert result["kv_bytes_ratio"] == pytest.approx(config["acr"])


def test_kv_group_granularity_makes_kv_bytes_equal_acr() -> None:
    windows = (4, 8, 4, 32)
    assert group_windows(windows, 2) == (8, 8, 32, 32)
    common = dict(context=24, new_tokens=4, layers=1, d_model=32, heads=4, kv_heads=2, repeats=1, warmup=0,
                  windows=windows)
    per_head = bench_decode(**common)
    grouped = bench_decode(**common, granularity="kv_group")
    _check_schema(per_head, batch=1)
    _check_schema(grouped, batch=1)
    assert per_head["config"]["windows"] == list(windows)
    assert grouped["config"]["windows"] == [8, 8, 32, 32]
    # Head granularity: each KV head keeps its largest window, more than the ACR.
    assert per_head["kv_bytes_ratio"] == pytest.approx((8 + 32) / 2 / 32)
    assert per_head["kv_bytes_ratio"] > per_head["config"]["acr"]
    assert grouped["kv_bytes_ratio"] == pytest.approx(grouped["config"]["acr"])


def test_table_output_and_errors(capsys) -> None:
    assert main(["bench", "decode", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "decode speedup" in out and "KV bytes ratio" in out
    for argv, message in [
        ([*SMALL, "--windows", "4,x,8,8"], "comma-separated"),
        ([*SMALL, "--windows", "4,8"], "need 4 windows"),
        ([*SMALL, "--windows", "4,8,8,64"], "[1, 32]"),
        ([*SMALL, "--kv-heads", "3"], "--kv-heads"),
        ([*SMALL, "--seq-len", "16"], "--seq-len"),
        ([*SMALL, "--batch", "0"], "--batch"),
    ]:
        assert main(["bench", "decode", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
