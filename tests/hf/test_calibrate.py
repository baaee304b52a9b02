"""aah.hf calibration policies, the windows file, and the aah hf calibrate/eval commands."""

from __future__ import annotations

import itertools
import json
import math
from fractions import Fraction

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from aah.cli import main  # noqa: E402
from aah.controller import HeadController  # noqa: E402
from aah.controller.lost_mass import lost_mass  # noqa: E402
from aah.hf.bridge.spec import uniform_window_for_budget  # noqa: E402
from aah.hf.bridge.windows_file import load_windows, model_signature, save_windows  # noqa: E402
from aah.hf.calibration.policies import (  # noqa: E402
    budgeted_windows,
    calibrate,
    measure_lost_mass,
    resolve_candidates,
    share_within_kv_groups,
)
from aah.regimes import get as get_regime  # noqa: E402
from aah.windows import causal_coverage, causal_pairs  # noqa: E402

VOCAB = 300


def _llama(layers: int = 2, heads: int = 4, kv_heads: int = 2, max_pos: int = 128):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8,
        max_position_embeddings=max_pos, attn_implementation="sdpa", eos_token_id=None, bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("seq_len,sinks", [(64, 0), (64, 4), (1000, 4), (7, 2)])
def test_uniform_window_is_the_largest_within_budget_by_brute_force(seq_len, sinks):
    for budget in (0.3, 0.45, 0.61, 0.9, 1.0):
        fits = [w for w in range(1, seq_len + 1) if causal_coverage([w], seq_len, sink_tokens=sinks) <= budget]
        if not fits:
            with pytest.raises(ValueError, match="below the causal coverage"):
                uniform_window_for_budget(budget, seq_len, sink_tokens=sinks)
            continue
        assert uniform_window_for_budget(budget, seq_len, sink_tokens=sinks) == max(fits)


def test_kv_group_sharing_takes_the_largest_window_of_each_group():
    windows = torch.tensor([[8, 2, 4, 4, 1, 16], [3, 3, 3, 5, 5, 2]])
    expected = torch.tensor([[8, 8, 8, 16, 16, 16], [3, 3, 3, 5, 5, 5]])
    assert torch.equal(share_within_kv_groups(windows, 2), expected)


def test_aah_v3_calibration_equals_controllers_fed_the_same_qkv():
    model = _llama()
    batches = [torch.randint(0, VOCAB, (1, 64), generator=torch.Generator().manual_seed(s)) for s in range(3)]
    got = calibrate(model, batches, policy="aah_v3", granularity="head", seed=3)

    # Independent capture: an attention function of our own that records q/k/v, then plain SDPA.
    captured: list[list[tuple]] = [[] for _ in range(2)]

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        captured[module.layer_idx].append((query.clone(), key.clone(), value.clone()))
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=True
        )
        return out.transpose(1, 2).contiguous(), None

    transformers.AttentionInterface.register("capture_for_test", capture)
    transformers.masking_utils.AttentionMaskInterface.register(
        "capture_for_test", transformers.masking_utils.sdpa_mask
    )
    model.set_attn_implementation("capture_for_test")
    with torch.no_grad():
        for batch in batches:
            model(batch, use_cache=False)
    config = get_regime("full_adaptive", seed=3).replace(windows=(8, 16, 32, 64), control_warmup=0, control_interval=1)
    expected = []
    for layer, calls in enumerate(captured):
        controller = HeadController(4, config, max_seq_len=64, layer_idx=layer).train()
        for step, (q, k, v) in enumerate(calls):
            controller.set_step(step)
            controller.control_update(q, k, v)
        expected.append(controller.current_windows(64))
    assert torch.equal(got, torch.tensor(expected))
    assert set(got.flatten().tolist()) <= {8, 16, 32, 64}
    assert model.config._attn_implementation == "capture_for_test"  # calibrate left no patch behind


def test_calibrate_validates_its_inputs():
    model = _llama()
    batch = [torch.zeros(1, 16, dtype=torch.long)]
    with pytest.raises(ValueError, match="policy must be one of"):
        calibrate(model, batch, policy="magic")
    with pytest.raises(ValueError, match="needs a budget"):
        calibrate(model, batch, policy="uniform")
    with pytest.raises(ValueError, match="granularity"):
        calibrate(model, batch, policy="uniform", budget=0.5, granularity="block")


def test_windows_file_round_trip_and_refusals(tmp_path):
    model = _llama()
    windows = torch.tensor([[8, 8, 16, 16], [4, 4, 64, 64]])
    meta = {"model": model_signature(model), "seq_len": 64, "policy": "aah_v3", "budget": None,
            "sink_tokens": 4, "acr": 0.4, "causal_coverage": 0.5}
    path = save_windows(tmp_path / "w.safetensors", windows, meta)
    loaded, loaded_meta = load_windows(path)
    assert torch.equal(loaded, windows) and loaded_meta == meta
    with pytest.raises(ValueError, match="lacks"):
        save_windows(tmp_path / "x.safetensors", windows, {"model": {}})
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="not a readable windows file"):
        load_windows(tmp_path / "bad.safetensors")
    # A file written before windows files carried their checksum (the windows tensor alone) still loads.
    from safetensors.torch import save_file

    save_file({"windows": windows}, str(tmp_path / "old.safetensors"),
              metadata={key: json.dumps(value) for key, value in meta.items()})
    old, old_meta = load_windows(tmp_path / "old.safetensors")
    assert torch.equal(old, windows) and old_meta == meta


# ---- the budgeted policy ----------------------------------------------------------------------

CANDS = (8, 16, 32, 64)


def _batches(count: int = 2, seq_len: int = 64) -> list[torch.Tensor]:
    return [torch.randint(0, VOCAB, (1, seq_len), generator=torch.Generator().manual_seed(s)) for s in range(count)]


def _fits(windows, budget: float, seq_len: int, sinks: int) -> bool:
    """Exact: allowed pairs within floor(b * heads * T (T + 1) / 2), the budget as written."""
    pairs = sum(causal_pairs(int(w), seq_len, sink_tokens=sinks) for w in windows)
    return pairs <= Fraction(repr(budget)) * len(windows) * (seq_len * (seq_len + 1) // 2)


def _brute_force(lost: torch.Tensor, budget: float, sinks: int, groups: list[list[int]]) -> float:
    """Least summed lost mass of any feasible assignment of one candidate to each group of heads."""
    best = float("inf")
    heads = sum(len(g) for g in groups)
    for choice in itertools.product(range(len(CANDS)), repeat=len(groups)):
        windows = [0] * heads
        total = 0.0
        for group, c in zip(groups, choice):
            for h in group:
                windows[h] = CANDS[c]
                total += float(lost[h, c])
        if _fits(windows, budget, 64, sinks):
            best = min(best, total)
    return best


def _summed_lost(lost: torch.Tensor, windows: torch.Tensor) -> float:
    return sum(float(lost[h, CANDS.index(int(w))]) for h, w in enumerate(windows.tolist()))


@pytest.mark.parametrize("kv_heads,granularity", [(4, "head"), (2, "kv_group"), (2, "head"), (1, "kv_group")])
@pytest.mark.parametrize("budget", [0.35, 0.5, 0.72])
def test_budgeted_windows_respect_the_budget_per_layer(kv_heads, granularity, budget):
    model = _llama(kv_heads=kv_heads)
    windows = calibrate(model, _batches(), policy="budgeted", budget=budget, sink_tokens=4, granularity=granularity)
    assert windows.shape == (2, 4) and set(windows.flatten().tolist()) <= set(CANDS)
    for row in windows:
        assert causal_coverage(row, 64, sink_tokens=4) <= budget
    if granularity == "kv_group":
        per = 4 // kv_heads
        assert torch.equal(windows, windows[:, ::per].repeat_interleave(per, dim=1))  # one window per KV group
    assert model.config._attn_implementation == "sdpa"  # left unpatched


def test_model_scope_respects_the_budget_over_all_layers_and_is_no_worse():
    model = _llama(layers=3)
    batches = _batches()
    lost = measure_lost_mass(model, batches, CANDS, sink_tokens=2)
    per_layer = calibrate(model, batches, policy="budgeted", budget=0.5, sink_tokens=2)
    whole = calibrate(model, batches, policy="budgeted", budget=0.5, sink_tokens=2, scope="model")
    assert causal_coverage(whole, 64, sink_tokens=2) <= 0.5
    # Every per-layer solution is feasible for the model, so the model-scope optimum loses no more.
    summed = [sum(_summed_lost(lost[i], w[i]) for i in range(3)) for w in (per_layer, whole)]
    assert summed[1] <= summed[0] + 1e-9
    assert torch.equal(whole, budgeted_windows(lost, CANDS, 0.5, 64, sink_tokens=2, num_kv_heads=2, scope="model"))


def test_calibrate_is_the_knapsack_over_the_measured_lost_mass():
    model = _llama()
    batches = _batches(3)
    lost = measure_lost_mass(model, batches, CANDS, sink_tokens=4)
    assert lost.shape == (2, 4, 4)
    # Averaged over the batches: the mean of one measurement per batch.
    single = torch.stack([measure_lost_mass(model, [b], CANDS, sink_tokens=4) for b in batches]).mean(0)
    torch.testing.assert_close(lost, single)
    assert bool((lost[..., 1:] <= lost[..., :-1] + 1e-6).all()) and float(lost[..., -1].abs().max()) < 1e-6
    got = calibrate(model, batches, policy="budgeted", budget=0.45, sink_tokens=4)
    assert torch.equal(got, budgeted_windows(lost, CANDS, 0.45, 64, sink_tokens=4, num_kv_heads=2))


@pytest.mark.parametrize("source", ["measured", "random"])
@pytest.mark.parametrize("sinks", [0, 4])
def test_budgeted_choice_is_optimal_against_brute_force(source, sinks):
    if source == "measured":
        lost = measure_lost_mass(_llama(layers=1), _batches(), CANDS, sink_tokens=sinks)
    else:  # a spread-out table (random heads are alike): decreasing in the window, zero at T
        raw = torch.rand(1, 4, 4, generator=torch.Generator().manual_seed(sinks)).sort(dim=-1, descending=True).values
        lost = raw * torch.tensor([1.0, 1.0, 1.0, 0.0])
    groups = {"head": [[0], [1], [2], [3]], "kv_group": [[0, 1], [2, 3]], "layer": [[0, 1, 2, 3]]}
    for budget in (0.3, 0.4, 0.45, 0.55, 0.7, 0.9, 1.0):
        for granularity, members in groups.items():
            if not _fits([CANDS[0]] * 4, budget, 64, sinks):
                continue
            windows = budgeted_windows(lost, CANDS, budget, 64, sink_tokens=sinks, num_kv_heads=2,
                                       granularity=granularity)[0]
            assert _fits(windows.tolist(), budget, 64, sinks)
            assert _summed_lost(lost[0], windows) == pytest.approx(
                _brute_force(lost[0], budget, sinks, members), abs=1e-9), (budget, granularity)


def test_model_scope_is_optimal_against_brute_force_over_two_layers():
    lost = torch.rand(2, 2, 4, generator=torch.Generator().manual_seed(5)).sort(dim=-1, descending=True).values
    lost[..., -1] = 0
    for budget in (0.4, 0.5, 0.65, 0.8):
        windows = budgeted_windows(lost, CANDS, budget, 64, sink_tokens=4, granularity="head", scope="model")
        flat = lost.reshape(4, 4)
        assert _fits(windows.flatten().tolist(), budget, 64, 4)
        assert _summed_lost(flat, windows.flatten()) == pytest.approx(
            _brute_force(flat, budget, 4, [[0], [1], [2], [3]]), abs=1e-9)


def test_a_head_whose_attention_is_all_far_away_gets_the_long_window():
    # Hand-built post-RoPE q/k (no model): head 0 attends the query itself, head 1 the first
    # key past the sinks (far away for nearly every query), head 2 a sink, head 3 itself.
    t, sinks, big = 64, 4, 40.0
    eye = torch.eye(t)
    q = torch.zeros(1, 4, t, t)
    k = torch.zeros(1, 4, t, t)
    for h in (0, 3):
        q[0, h], k[0, h] = big * eye, eye
    q[0, 1, :, 0], k[0, 1, sinks, 0] = big, 1.0
    q[0, 2, :, 0], k[0, 2, 0, 0] = big, 1.0
    lost = lost_mass(q, k, CANDS, sink_tokens=sinks, scale=1.0)
    assert float(lost[[0, 2, 3]].max()) < 1e-6  # local and sink mass is never lost
    assert float(lost[1, 0]) > 0.9 and float(lost[1, -1]) < 1e-6
    assert float(lost_mass(q, k, CANDS, scale=1.0)[2, 0]) > 0.9  # without sinks the sink head would lose it
    budget = causal_coverage([8, 64, 8, 8], t, sink_tokens=sinks)
    windows = budgeted_windows(lost[None], CANDS, budget, t, sink_tokens=sinks, granularity="head")
    assert windows[0].tolist() == [8, 64, 8, 8]
    # Per KV group the far head pulls its whole group up; the budget pays for both of its heads.
    grouped = budgeted_windows(lost[None], CANDS, causal_coverage([64, 64, 8, 8], t, sink_tokens=sinks), t,
                               sink_tokens=sinks, num_kv_heads=2)
    assert grouped[0].tolist() == [64, 64, 8, 8]
    tight = budgeted_windows(lost[None], CANDS, budget, t, sink_tokens=sinks, num_kv_heads=2)
    assert tight[0].tolist() in ([32, 32, 8, 8], [16, 16, 8, 8]) and _fits(tight[0].tolist(), budget, t, sinks)


def test_layer_granularity_is_the_knapsack_over_whole_layers_by_hand():
    """T = 64, no sinks: a head at window w keeps w(w+1)/2 + (64-w)w pairs: 484 (8), 904 (16),
    1552 (32), 2080 (64). Budget 0.72 over 2 layers x 4 heads: floor(0.72 * 8 * 2080) = 11980
    pairs, 2995 per head of a layer pair; over one layer floor(0.72 * 4 * 2080) = 5990, 1497 per head.

    Layer 0 (one far-reading head) loses 1.2, 0.95, 0.6, 0 summed over its heads at 8, 16, 32, 64;
    layer 1 loses 0.8, 0.4, 0.2, 0. Over the model the pairs that fit are those of at most 2995:
    (64, 16) costs 2984 and loses 0.4, the least ((32, 32) costs 3104; (64, 8) loses 0.8; (32, 16)
    1.0; (16, 64) 0.95). Per layer 32 (1552) does not fit 1497, so each layer takes 16."""
    far, near, local = [0.9, 0.8, 0.6, 0.0], [0.1, 0.05, 0.0, 0.0], [0.2, 0.1, 0.05, 0.0]
    lost = torch.tensor([[far, near, near, near], [local] * 4], dtype=torch.float64)
    model_scope = budgeted_windows(lost, CANDS, 0.72, 64, sink_tokens=0, num_kv_heads=2, granularity="layer",
                                   scope="model")
    assert model_scope.tolist() == [[64] * 4, [16] * 4]
    layer_scope = budgeted_windows(lost, CANDS, 0.72, 64, sink_tokens=0, num_kv_heads=2, granularity="layer")
    assert layer_scope.tolist() == [[16] * 4, [16] * 4]
    # Per head the far head alone is widened: the layer's other heads stay short.
    heads = budgeted_windows(lost, CANDS, 0.72, 64, sink_tokens=0, granularity="head", scope="model")
    assert heads[0, 0] == 64 and heads[0, 1:].max() < 64


def test_aah_v3_at_layer_granularity_gives_each_layer_its_largest_window():
    model = _llama()
    batches = _batches()
    per_head = calibrate(model, batches, policy="aah_v3", granularity="head", seed=3)
    per_layer = calibrate(model, batches, policy="aah_v3", granularity="layer", seed=3)
    assert torch.equal(per_layer, per_head.max(dim=1, keepdim=True).values.expand_as(per_head))


def test_budgeted_errors_name_the_numbers():
    model = _llama()
    batch = _batches(1)
    with pytest.raises(ValueError, match="policy 'budgeted' needs a budget"):
        calibrate(model, batch, policy="budgeted")
    smallest = causal_coverage([8], 64, sink_tokens=4)
    with pytest.raises(ValueError, match=rf"budget 0.2 is below the smallest feasible causal coverage {smallest:.4f}"):
        calibrate(model, batch, policy="budgeted", budget=0.2, sink_tokens=4)
    with pytest.raises(ValueError, match=r"budget must be in \(0, 1\]"):
        calibrate(model, batch, policy="budgeted", budget=1.5)
    with pytest.raises(ValueError, match="scope must be one of"):
        calibrate(model, batch, policy="budgeted", budget=0.5, scope="global")
    # Exactly the smallest coverage is feasible: every head at the smallest window.
    assert set(calibrate(model, batch, policy="budgeted", budget=smallest, sink_tokens=4).flatten().tolist()) == {8}


# ---- the command line, on a tiny model folder and a text-folder corpus -------------------------

@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    corpus = root / "corpus"
    corpus.mkdir()
    words = ["to", "be", "or", "not", "to", "be", "that", "is", "the", "question", "whether", "tis", "nobler", "in", "the", "mind"]
    g = torch.Generator().manual_seed(0)
    for name in ("a", "b", "c", "d", "e", "f", "g", "h", "i", "j"):
        idx = torch.randint(0, len(words), (600,), generator=g).tolist()
        (corpus / f"{name}.txt").write_text(" ".join(words[i] for i in idx))
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token=None))
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=VOCAB, initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    bpe.train([str(p) for p in sorted(corpus.iterdir())], trainer)
    model_dir = root / "model"
    _llama().save_pretrained(model_dir)
    transformers.PreTrainedTokenizerFast(tokenizer_object=bpe).save_pretrained(model_dir)
    return model_dir, corpus


def test_calibrate_then_eval_end_to_end(tiny_model_dir, tmp_path, capsys):
    model_dir, corpus = tiny_model_dir
    out = tmp_path / "w.safetensors"
    assert main(["hf", "calibrate", str(model_dir), "--corpus", str(corpus), "--seq-len", "64",
                 "--policy", "aah_v3", "--batches", "2", "--sink-tokens", "2", "--out", str(out)]) == 0
    windows, meta = load_windows(out)
    assert windows.shape == (2, 4) and meta["policy"] == "aah_v3" and meta["sink_tokens"] == 2
    assert meta["executed_coverage"] == pytest.approx(meta["causal_coverage"])  # no kept keys: the same figure
    assert torch.equal(windows[:, 0::2], windows[:, 1::2])  # kv_group granularity by default
    report_path = tmp_path / "eval.json"
    assert main(["hf", "eval", str(model_dir), "--windows-file", str(out), "--corpus", str(corpus), "--seq-len", "64",
                 "--batches", "1", "--decode-batch", "2", "--new-tokens", "3", "--rounds", "1",
                 "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    for name in ("full", "aah", "uniform"):
        assert {"ppl", "prefill_tok_s", "decode_tok_s", "decode_route", "kv_bytes", "acr", "causal_coverage",
                "executed_coverage"} <= set(report[name])
        assert report[name]["executed_coverage"] == pytest.approx(report[name]["causal_coverage"])
    assert "ppl_ratio" in report["uniform"]
    assert report["full"]["decode_route"] == "transformers"
    from aah.decode import ring_decode

    compiled = ring_decode.unavailable_reason() is None  # the tiny model is a Llama: the whole layer
    assert report["aah"]["decode_route"] == ("compiled block" if compiled else "masked")
    for key in ("ppl_ratio", "prefill_speedup", "decode_speedup", "kv_bytes_ratio"):
        assert report[key] > 0
    assert report["ppl_ratio"] == pytest.approx(report["aah"]["ppl"] / report["full"]["ppl"])
    assert len(report["aah"]["block_nll"]) == 1 and report["ppl_ratio_ci"] is None  # one block: no interval
    for name in ("full", "aah", "uniform"):  # no kept keys: the cached prefill predicts what the windows do
        assert report[name]["served_ppl"] == pytest.approx(report[name]["ppl"], rel=1e-5)
        assert len(report[name]["served_block_nll"]) == 1
    assert report["served_ppl_ratio"] == pytest.approx(report["aah"]["served_ppl"] / report["full"]["served_ppl"])
    assert report["served_ppl_ratio_ci"] is None
    assert report["aah_vs_uniform_ppl_ratio"] == pytest.approx(report["aah"]["ppl"] / report["uniform"]["ppl"])
    assert report["full"]["causal_coverage"] == report["full"]["executed_coverage"] == 1.0
    assert report["uniform"]["causal_coverage"] <= report["aah"]["causal_coverage"] + 1e-12
    # KV bytes: the window cache holds S + window entries per KV head of a 61-token prompt.
    slots = sum(2 + min(int(w), 64) for w in windows[:, ::2].flatten())
    assert report["aah"]["kv_bytes"] == 2 * 2 * slots * 8 * 4
    assert report["full"]["kv_bytes"] == 2 * 2 * 2 * 2 * (64 - 3) * 8 * 4
    out = capsys.readouterr().out
    assert "| aah |" in out and "executed coverage |" in out and "| served perplexity |" in out
    assert "served ppl ratio" in out


def test_eval_takes_sink_tokens_and_kept_keys(tiny_model_dir, tmp_path, capsys):
    """--sink-tokens and --tail-tokens/--kept-keys: the config says what ran, the windowed settings'
    ACR and causal coverage are those of kept_coverage and their executed coverage that of
    executed_read_coverage, their KV bytes hold the kept keys too, and their decode steps run the
    whole layer compiled, kept keys included. The windows file predates executed_coverage."""
    from aah.hf.bridge.kept_keys import KeptKeys, executed_read_coverage, kept_coverage
    from aah.hf.bridge.spec import LayerWindows

    model_dir, corpus = tiny_model_dir
    windows = torch.tensor([[8, 8, 16, 16], [4, 4, 8, 8]])
    path = tmp_path / "w.safetensors"
    save_windows(path, windows, {"model": model_signature(_llama()), "seq_len": 64, "policy": "uniform",
                                 "budget": 0.5, "sink_tokens": 2, "acr": 0.1, "causal_coverage": 0.1})
    base = ["hf", "eval", str(model_dir), "--windows-file", str(path), "--corpus", str(corpus), "--seq-len", "64",
            "--batches", "1", "--decode-batch", "2", "--new-tokens", "3", "--rounds", "1"]
    plain_path, kept_path = tmp_path / "plain.json", tmp_path / "kept.json"
    assert main([*base, "--sink-tokens", "3", "--json", str(plain_path)]) == 0
    assert main([*base, "--sink-tokens", "3", "--tail-tokens", "4", "--kept-keys", "6", "--kept-pool", "3",
                 "--json", str(kept_path)]) == 0
    plain, kept = json.loads(plain_path.read_text()), json.loads(kept_path.read_text())
    assert plain["config"]["sink_tokens"] == kept["config"]["sink_tokens"] == 3
    assert (plain["config"]["tail_tokens"], plain["config"]["kept_keys"], plain["config"]["kept_pool"]) == (None,) * 3
    assert (kept["config"]["tail_tokens"], kept["config"]["kept_keys"], kept["config"]["kept_pool"]) == (4, 6, 3)
    specs = [LayerWindows.build(tuple(int(w) for w in row), 3, "auto", None) for row in windows]
    acr, coverage = kept_coverage(specs, 64, KeptKeys(4, 6, 3), 2)
    assert kept["aah"]["acr"] == pytest.approx(acr) and kept["aah"]["causal_coverage"] == pytest.approx(coverage)
    executed = executed_read_coverage(specs, 64, KeptKeys(4, 6, 3), 2)
    assert kept["aah"]["executed_coverage"] == pytest.approx(executed) and executed > coverage
    assert plain["aah"]["executed_coverage"] == pytest.approx(plain["aah"]["causal_coverage"])
    assert plain["aah"]["causal_coverage"] == pytest.approx(causal_coverage(windows, 64, sink_tokens=3))
    # Each KV head of the 61-token decode prompts keeps 6 far keys (K and V, 8 floats each) per layer.
    assert kept["aah"]["kv_bytes"] - plain["aah"]["kv_bytes"] == 2 * 2 * 2 * 6 * 2 * 8 * 4
    from aah.decode import ring_decode

    compiled = ring_decode.unavailable_reason() is None  # kept keys read beside the rings in the whole-layer step
    assert kept["aah"]["decode_route"] == kept["uniform"]["decode_route"] == ("compiled block" if compiled else "masked")
    assert kept["aah"]["ppl"] == pytest.approx(plain["aah"]["ppl"])  # the perplexity reads the windows alone
    # The served perplexity reads the blocks through each setting's cache: the tail rows read every key.
    assert plain["aah"]["served_ppl"] == pytest.approx(plain["aah"]["ppl"], rel=1e-5)
    assert abs(kept["aah"]["served_ppl"] - kept["aah"]["ppl"]) > 1e-4 * kept["aah"]["ppl"]
    assert kept["full"]["served_ppl"] == pytest.approx(kept["full"]["ppl"], rel=1e-5)
    assert "kept keys count in ACR" in capsys.readouterr().out
    assert "--kept-pool must be odd" in _error([*base, "--tail-tokens", "4", "--kept-keys", "6", "--kept-pool", "2"],
                                               capsys)
    assert "go together" in _error([*base, "--tail-tokens", "4"], capsys)
    assert "--sink-tokens takes an int >= 0" in _error([*base, "--sink-tokens", "-1"], capsys)


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_hf_command_errors_are_one_line(tiny_model_dir, tmp_path, capsys):
    model_dir, corpus = tiny_model_dir
    base = ["--corpus", str(corpus)]
    assert "not a transformers model folder" in _error(
        ["hf", "calibrate", str(tmp_path), *base, "--seq-len", "64", "--policy", "aah_v3", "--out", "x"], capsys)
    vit = tmp_path / "vit"
    transformers.ViTConfig().save_pretrained(vit)
    assert "not a causal LM" in _error(
        ["hf", "calibrate", str(vit), *base, "--seq-len", "64", "--policy", "aah_v3", "--out", "x"], capsys)
    assert "max_position_embeddings" in _error(
        ["hf", "calibrate", str(model_dir), *base, "--seq-len", "4096", "--policy", "aah_v3", "--out", "x"], capsys)
    assert "--policy must be one of" in _error(
        ["hf", "calibrate", str(model_dir), *base, "--seq-len", "64", "--policy", "best", "--out", "x"], capsys)
    assert "need" in _error(
        ["hf", "calibrate", str(model_dir), *base, "--seq-len", "128", "--policy", "uniform", "--budget", "0.5",
         "--batches", "500", "--out", "x"], capsys)
    other = tmp_path / "other.safetensors"
    wrong_model = _llama(layers=3)
    save_windows(other, torch.full((3, 4), 8), {"model": model_signature(wrong_model), "seq_len": 64,
                                               "policy": "uniform", "budget": 0.5, "sink_tokens": 0, "acr": 0.1,
                                               "causal_coverage": 0.1})
    assert "calibrated for" in _error(
        ["hf", "eval", str(model_dir), "--windows-file", str(other), *base, "--seq-len", "64"], capsys)
    assert "--windows-file: no file" in _error(
        ["hf", "eval", str(model_dir), "--windows-file", str(tmp_path / "none"), *base, "--seq-len", "64"], capsys)


def test_budgeted_calibrate_command_writes_policy_and_budget(tiny_model_dir, tmp_path, capsys):
    model_dir, corpus = tiny_model_dir
    out = tmp_path / "b.safetensors"
    assert main(["hf", "calibrate", str(model_dir), "--corpus", str(corpus), "--seq-len", "64", "--policy",
                 "budgeted", "--budget", "0.5", "--batches", "2", "--sink-tokens", "2", "--out", str(out)]) == 0
    windows, meta = load_windows(out)
    assert meta["policy"] == "budgeted" and meta["budget"] == 0.5 and meta["scope"] == "layer"
    assert meta["granularity"] == "kv_group" and torch.equal(windows[:, 0::2], windows[:, 1::2])
    assert meta["causal_coverage"] == causal_coverage(windows, 64, sink_tokens=2) <= 0.5
    assert "budgeted windows for 2 layers x 4 heads" in capsys.readouterr().out


def test_calibrate_command_at_layer_granularity_writes_one_window_per_layer(tiny_model_dir, tmp_path, capsys):
    model_dir, corpus = tiny_model_dir
    out = tmp_path / "layer.safetensors"
    assert main(["hf", "calibrate", str(model_dir), "--corpus", str(corpus), "--seq-len", "64", "--policy",
                 "budgeted", "--budget", "0.5", "--batches", "1", "--sink-tokens", "2", "--granularity", "layer",
                 "--out", str(out)]) == 0
    windows, meta = load_windows(out, transformers.AutoConfig.from_pretrained(model_dir))
    assert meta["granularity"] == "layer" and windows.shape == (2, 4)
    assert all(len(set(row)) == 1 for row in windows.tolist())
    assert causal_coverage(windows, 64, sink_tokens=2) <= 0.5
    assert "budgeted windows for 2 layers x 4 heads" in capsys.readouterr().out
    err = _error(["hf", "calibrate", str(model_dir), "--corpus", str(corpus), "--seq-len", "64", "--policy",
                  "budgeted", "--budget", "0.5", "--granularity", "model", "--out", "x"], capsys)
    assert "--granularity must be one of head, kv_group, layer; got 'model'" in err


def test_a_layer_granularity_file_with_mixed_windows_in_a_layer_is_refused(tmp_path):
    model = _llama()
    meta = {"model": model_signature(model), "seq_len": 64, "policy": "budgeted", "budget": 0.5,
            "sink_tokens": 4, "acr": 0.4, "causal_coverage": 0.5}
    mixed = torch.tensor([[8, 8, 16, 16], [32, 32, 32, 32]])  # one window per KV group, two in layer 0
    kv_file = save_windows(tmp_path / "kv.safetensors", mixed, {**meta, "granularity": "kv_group"})
    assert torch.equal(load_windows(kv_file, model)[0], mixed)
    layer_file = save_windows(tmp_path / "layer.safetensors", mixed, {**meta, "granularity": "layer"})
    with pytest.raises(ValueError, match=r"says granularity layer, but in layer 0 the query heads have different "
                                         r"windows \[8, 8, 16, 16\]"):
        load_windows(layer_file, model)
    even = save_windows(tmp_path / "even.safetensors", torch.tensor([[16] * 4, [32] * 4]),
                        {**meta, "granularity": "layer"})
    assert load_windows(even, model)[1]["granularity"] == "layer"


def test_budgeted_calibrate_command_errors_are_one_line(tiny_model_dir, capsys):
    model_dir, corpus = tiny_model_dir
    base = ["hf", "calibrate", str(model_dir), "--corpus", str(corpus), "--seq-len", "64", "--policy", "budgeted",
            "--batches", "1", "--out", "x"]
    assert "needs a budget" in _error(base, capsys)
    smallest = causal_coverage([8], 64, sink_tokens=4)
    err = _error([*base, "--budget", "0.1"], capsys)
    assert "0.1" in err and f"{smallest:.4f}" in err and "below the smallest feasible causal coverage" in err
    assert "--scope must be one of" in _error([*base, "--budget", "0.5", "--scope", "everything"], capsys)
    for bad in ("16,8", "0,16", "8,65", "8,x", ","):
        assert "--candidates must be increasing" in _error([*base, "--budget", "0.5", "--candidates", bad], capsys)


def test_budgeted_calibrate_command_takes_candidates(tiny_model_dir, tmp_path, capsys):
    model_dir, corpus = tiny_model_dir
    out = tmp_path / "c.safetensors"
    assert main(["hf", "calibrate", str(model_dir), "--corpus", str(corpus), "--seq-len", "64", "--policy",
                 "budgeted", "--budget", "0.6", "--batches", "1", "--candidates", "4,12,24,64",
                 "--out", str(out)]) == 0
    windows, meta = load_windows(out)
    assert meta["candidates"] == [4, 12, 24, 64]
    chosen = set(windows.flatten().tolist())
    assert chosen <= {4, 12, 24, 64} and chosen & {4, 12, 24}  # none of 4, 12, 24 is on the default ladder
    assert causal_coverage(windows, 64, sink_tokens=4) <= 0.6


@pytest.mark.parametrize("bad", [[], [8, 8], [16, 8], [0, 8], [8, 65]])
def test_candidates_are_validated(bad):
    with pytest.raises(ValueError, match="candidates must be increasing windows in \\[1, 64\\]"):
        resolve_candidates(64, bad)


def test_perplexity_ratios_come_with_intervals_paired_by_block():
    from aah.hf.evaluation.compare import ppl_ratio_interval, summary

    def setting(nll, served=None):
        served = nll if served is None else served
        return {"ppl": math.exp(sum(nll) / len(nll)), "block_nll": nll, "prefill_tok_s": 1.0,
                "decode_tok_s": 1.0, "kv_bytes": 1, "served_ppl": math.exp(sum(served) / len(served)),
                "served_block_nll": served}

    results = {"full": setting([2.0, 2.2, 2.4]), "aah": setting([2.05, 2.27, 2.42], served=[2.0, 2.25, 2.4]),
               "uniform": setting([2.1, 2.3, 2.5])}
    out = summary(results)
    # Served: differences 0.0, 0.05, 0.0 from full's: mean 0.016667, sd 0.028868.
    served_half = 4.302653 * 0.028868 / math.sqrt(3)
    assert out["served_ppl_ratio"] == pytest.approx(math.exp(0.016667), rel=1e-5)
    assert out["served_ppl_ratio_ci"] == pytest.approx(
        [math.exp(0.016667 - served_half), math.exp(0.016667 + served_half)], rel=1e-4)
    # Differences 0.05, 0.07, 0.02: mean 0.0467, sd 0.0252, t(0.975, 2) = 4.3027.
    half = 4.302653 * 0.025166 / math.sqrt(3)
    assert out["ppl_ratio"] == pytest.approx(math.exp(0.046667), rel=1e-5)
    assert out["ppl_ratio_ci"] == pytest.approx([math.exp(0.046667 - half), math.exp(0.046667 + half)], rel=1e-4)
    assert results["uniform"]["ppl_ratio_ci"] == pytest.approx([math.exp(0.1), math.exp(0.1)])  # no spread
    assert out["aah_vs_uniform_ppl_ratio"] == pytest.approx(math.exp(0.046667 - 0.1), rel=1e-5)
    # aah - uniform: -0.05, -0.03, -0.08 on the blocks; three blocks leave the interval across 1.
    d = [-0.05, -0.03, -0.08]
    m, sd = sum(d) / 3, math.sqrt(sum((x - sum(d) / 3) ** 2 for x in d) / 2)
    want = [math.exp(m - 4.302653 * sd / math.sqrt(3)), math.exp(m + 4.302653 * sd / math.sqrt(3))]
    assert out["aah_vs_uniform_ppl_ratio_ci"] == pytest.approx(want, rel=1e-5)
    assert want[0] < 1.0 < want[1]
    assert ppl_ratio_interval([2.0], [1.9]) is None  # one block: no interval


# ---- retrieval-preserving calibration (measure kl_retrieval) ----------------------------------

def _bpe_tokenizer(model_dir):
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


def _sequences(tokenizer, seq_len=400, count=2):
    from aah.data.corpora import CorpusNotFoundError
    from aah.hf.calibration.answer_loss import calibration_sequences

    try:
        return calibration_sequences(tokenizer, seq_len, count, seed=1)
    except CorpusNotFoundError:
        pytest.skip("the bible corpus is not installed")


def test_calibration_sequences_use_their_own_templates(tiny_model_dir):
    import re

    tok = _bpe_tokenizer(tiny_model_dir[0])
    seqs = _sequences(tok, 400, 3)
    for seq in seqs:
        total = len(seq.context) + len(seq.question) + len(seq.answer)
        assert 330 <= total <= 400
        context, question, answer = (tok.decode(list(x)) for x in (seq.context, seq.question, seq.answer))
        code = re.fullmatch(r" ([A-Z]{3}-\d{4})\.", answer).group(1)
        locker = re.search(r"access code of the ([a-z]+ [a-z]+) locker\?", question).group(1)
        assert f"the access code of the {locker} locker is {code}." in context
        assert len(re.findall(r"Note for later", context)) == 3
        for words in ("pass key", "magic number", "The grass is green", "VAR "):  # the evaluation's templates
            assert words not in context + question
    assert len({s.answer for s in seqs}) == 3
    from aah.hf.calibration.answer_loss import CALIBRATION_INSTRUCTION, calibration_sequences

    instructed = calibration_sequences(tok, 400, 3, seed=1, instruction=True)
    for plain, seq in zip(seqs, instructed):
        text = tok.decode(list(seq.context))
        assert text.startswith(CALIBRATION_INSTRUCTION) and CALIBRATION_INSTRUCTION not in tok.decode(list(plain.context))
        assert (seq.question, seq.answer) == (plain.question, plain.answer)
        assert 330 <= len(seq.context) + len(seq.question) + len(seq.answer) <= 400
        for words in ("hidden", "memorize", "quiz", "Memorize"):  # the evaluation's introductions
            assert words not in text


def _window_reference_nll(masked_logits, model, ids, read, layer, windows, sinks):
    """Answer NLL of a float64 full forward (no cache) in which only ``layer``'s rows from ``read`` on
    see their head's window and the sinks."""
    def allowed(layer_idx, heads, t):
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        keep = (j <= i).expand(heads, t, t).clone()
        if layer_idx == layer:
            for h, w in enumerate(windows):
                keep[h, read:] = ((j <= i) & ((i - j < w) | (j < sinks)))[read:]
        return keep

    logits = masked_logits(model, ids, allowed)[0, read:-1]
    return float(torch.nn.functional.cross_entropy(logits, ids[0, read + 1:], reduction="sum"))


def test_answer_loss_equals_windowed_forwards_of_the_answer_positions(tiny_model_dir, masked_logits):
    from aah.hf.calibration.answer_loss import measure_answer_loss

    tok = _bpe_tokenizer(tiny_model_dir[0])
    seqs = _sequences(tok, 300, 1)
    model = _llama(max_pos=512).double()
    cands = (16, 64, 300)
    items = [[0, 1], [2, 3]]
    got = measure_answer_loss(model, seqs, cands, sink_tokens=2, items=items)
    want = torch.zeros(2, 4, 3, dtype=torch.float64)
    answer_tokens = 0
    for seq in seqs:
        ids = torch.tensor([seq.context + seq.question + seq.answer])
        read = ids.shape[1] - len(seq.answer) - 1
        answer_tokens += len(seq.answer)
        base = _window_reference_nll(masked_logits, model, ids, read, None, [], 2)
        for layer in range(2):
            for item in items:
                for c, w in enumerate(cands):
                    if w >= ids.shape[1]:
                        continue
                    windows = [10**9] * 4
                    for h in item:
                        windows[h] = w
                    rise = _window_reference_nll(masked_logits, model, ids, read, layer, windows, 2) - base
                    want[layer, item, c] += max(rise, 0.0) / len(item)
    torch.testing.assert_close(got.double(), want / answer_tokens, rtol=1e-4, atol=1e-7)
    assert float(got.abs().sum()) > 0 and float(got[..., -1].abs().max()) == 0.0  # T = 300 loses nothing
    assert torch.equal(got[:, 0], got[:, 1]) and torch.equal(got[:, 2], got[:, 3])  # shared within an item


def test_kl_retrieval_is_the_knapsack_over_kl_plus_weighted_answer_loss(tiny_model_dir):
    from aah.hf.calibration.answer_loss import measure_answer_loss
    from aah.hf.calibration.window_kl import measure_window_kl

    tok = _bpe_tokenizer(tiny_model_dir[0])
    seqs = _sequences(tok, 320, 2)
    model = _llama(max_pos=512)
    batches = _batches(2, seq_len=320)
    cands = (40, 80, 160, 320)
    got = calibrate(model, batches, policy="budgeted", budget=0.5, sink_tokens=2, scope="model",
                    measure="kl_retrieval", retrieval=seqs, retrieval_weight=3.0, candidates=cands)
    kl = measure_window_kl(model, batches, cands, sink_tokens=2, seed=0)
    answer = measure_answer_loss(model, seqs, cands, sink_tokens=2, items=[[0, 1], [2, 3]])
    want = budgeted_windows(kl + 3.0 * answer, cands, 0.5, 320, sink_tokens=2, num_kv_heads=2, scope="model")
    assert torch.equal(got, want)
    assert causal_coverage(got, 320, sink_tokens=2) <= 0.5
    with pytest.raises(ValueError, match="needs retrieval sequences"):
        calibrate(model, batches, policy="budgeted", budget=0.5, measure="kl_retrieval")


def _retrieval_model(model_dir, tmp_path):
    """A model folder long enough for 320-token retrieval sequences, with the BPE tokenizer
    (skips without the bible corpus the sequences are cut from)."""
    _sequences(_bpe_tokenizer(model_dir), 320, 1)
    big = tmp_path / "model"
    _llama(max_pos=512).save_pretrained(big)
    _bpe_tokenizer(model_dir).save_pretrained(big)
    return big


@pytest.mark.slow
def test_calibrate_command_with_kl_retrieval(tiny_model_dir, tmp_path, capsys):
    model_dir, corpus = tiny_model_dir
    big = _retrieval_model(model_dir, tmp_path)
    out = tmp_path / "r.safetensors"
    base = ["hf", "calibrate", str(big), "--corpus", str(corpus), "--seq-len", "320", "--policy", "budgeted",
            "--budget", "0.5", "--scope", "model", "--measure", "kl_retrieval", "--batches", "1"]
    assert main([*base, "--retrieval-sequences", "2", "--out", str(out)]) == 0
    windows, meta = load_windows(out)
    assert meta["measure"] == "kl_retrieval" and meta["retrieval_sequences"] == 2 and meta["retrieval_weight"] == 1.0
    assert causal_coverage(windows, 320, sink_tokens=4) <= 0.5
    capsys.readouterr()
    assert "--retrieval-sequences must be >= 1" in _error([*base, "--retrieval-sequences", "0", "--out", "x"], capsys)
    assert "--retrieval-weight must be >= 0" in _error([*base, "--retrieval-weight", "-1", "--out", "x"], capsys)
    assert meta["retrieval_reserve"] == 0.0 and meta["repair_rounds"] is None
    repaired = tmp_path / "repaired.safetensors"
    longer = [a if a != "320" else "480" for a in base]  # room for the repair's opening instruction
    assert main([*longer, "--retrieval-sequences", "1", "--retrieval-reserve", "0.1", "--repair-rounds", "1",
                 "--out", str(repaired)]) == 0
    windows, meta = load_windows(repaired)
    assert meta["retrieval_reserve"] == 0.1 and meta["repair_rounds"] == 1
    assert causal_coverage(windows, 480, sink_tokens=4) <= 0.5
    capsys.readouterr()
    assert "--retrieval-reserve must be in [0, --budget)" in _error(
        [*base, "--retrieval-reserve", "0.5", "--out", "x"], capsys)
    assert "--repair-rounds must be >= 1" in _error(
        [*base, "--retrieval-reserve", "0.1", "--repair-rounds", "0", "--out", "x"], capsys)
    plain_kl = [a if a != "kl_retrieval" else "kl" for a in base]
    assert "--retrieval-reserve needs --policy budgeted --measure kl_retrieval" in _error(
        [*plain_kl, "--retrieval-reserve", "0.1", "--out", "x"], capsys)


@pytest.mark.parametrize("family", ["gpt2", "bert"])
@pytest.mark.parametrize("command", ["calibrate", "eval", "retrieval"])
def test_every_hf_command_refuses_an_unsupported_model_in_one_line(tiny_model_dir, tmp_path, capsys, family, command):
    """A causal LM the bridge cannot patch (GPT-2's fused projections; BERT as a decoder) is one
    line before any work, in every command, not a traceback after the weights load."""
    model_dir, corpus = tiny_model_dir
    folder = tmp_path / family
    if family == "gpt2":
        config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128)
        transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    else:
        config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=64, max_position_embeddings=128, is_decoder=True)
        transformers.BertLMHeadModel(config).save_pretrained(folder)
    transformers.AutoTokenizer.from_pretrained(model_dir).save_pretrained(folder)
    meta = {"model": model_signature(_llama()), "seq_len": 64, "policy": "uniform", "budget": 0.5, "sink_tokens": 0,
            "acr": 0.5, "causal_coverage": 0.5}
    windows = save_windows(tmp_path / "w.safetensors", torch.full((2, 4), 8), meta)
    argv = {
        "calibrate": ["--seq-len", "64", "--corpus", str(corpus), "--policy", "aah_v3",
                      "--out", str(tmp_path / "out.safetensors")],
        "eval": ["--seq-len", "64", "--corpus", str(corpus), "--windows-file", str(windows)],
        "retrieval": ["--windows-file", str(windows), "--lengths", "64"],
    }[command]
    capsys.readouterr()  # what saving the folders printed
    line = _error(["hf", command, str(folder), *argv], capsys)
    assert str(folder) in line and "aah.hf supports decoder-only causal LMs" in line


# ---- policy duo: full length or one short window, ranked by the answer loss -------------------

# Per-head answer-loss rise at the short window, (L=2, H=4); the KV groups are heads {0, 1} and {2, 3}.
# Group sums: (0, 0) 0.3, (0, 1) 0.5, (1, 0) 0.5, (1, 1) 0.1, so the ranking is (0, 1) (the tie with
# (1, 0) goes to the lower layer), (1, 0), (0, 0), (1, 1). By head: (0, 2) 0.5, (1, 0) and (1, 1)
# 0.25 (lower index first), (0, 1) 0.2, (0, 0) and (1, 3) 0.1 (lower layer first), (0, 3) and
# (1, 2) 0 (lower layer first).
DUO_RISE = torch.tensor([[0.1, 0.2, 0.5, 0.0], [0.25, 0.25, 0.0, 0.1]])
DUO_GROUP_RANKING = [(0, 1), (1, 0), (0, 0), (1, 1)]
DUO_HEAD_RANKING = [(0, 2), (1, 0), (1, 1), (0, 1), (0, 0), (1, 3), (0, 3), (1, 2)]


def _duo_budget(full_heads: int, heads: int, window: int, seq_len: int, sinks: int) -> float:
    """The least budget (to 1e-9, rounded up) at which ``full_heads`` of ``heads`` heads take ``seq_len``."""
    pairs = full_heads * causal_pairs(seq_len, seq_len) + (heads - full_heads) * causal_pairs(window, seq_len,
                                                                                               sink_tokens=sinks)
    return min(1.0, math.ceil(Fraction(pairs, heads * seq_len * (seq_len + 1) // 2) * 10**9) / 10**9)


def _expected_duo(ranking, taken: int, window: int, seq_len: int, per: int) -> torch.Tensor:
    want = torch.full((2, 4), window)
    for layer, item in ranking[:taken]:
        want[layer, item * per:(item + 1) * per] = seq_len
    return want


@pytest.mark.parametrize("granularity,ranking,per", [("kv_group", DUO_GROUP_RANKING, 2), ("head", DUO_HEAD_RANKING, 1)])
@pytest.mark.parametrize("sinks", [0, 2])
def test_duo_windows_give_full_length_to_the_top_of_the_hand_worked_ranking(granularity, ranking, per, sinks):
    from aah.hf.calibration.policies import duo_windows

    for taken in range(len(ranking) + 1):
        budget = _duo_budget(taken * per, 8, 8, 64, sinks)
        got = duo_windows(DUO_RISE, 8, budget, 64, sink_tokens=sinks, num_kv_heads=2, granularity=granularity)
        assert torch.equal(got, _expected_duo(ranking, taken, 8, 64, per)), (taken, got)
        assert set(got.flatten().tolist()) <= {8, 64}
        assert causal_coverage(got, 64, sink_tokens=sinks) <= budget
        if granularity == "kv_group":
            assert torch.equal(got[:, 0::2], got[:, 1::2])  # one window per KV group
        # Just below that budget one item fewer fits.
        if taken:
            below = duo_windows(DUO_RISE, 8, budget - 1e-6, 64, sink_tokens=sinks, num_kv_heads=2,
                                granularity=granularity)
            assert torch.equal(below, _expected_duo(ranking, taken - 1, 8, 64, per))


def test_duo_windows_cost_a_layers_own_sliding_window_as_it_runs():
    """Layer 1 slides within 16 tokens (no sinks there): its groups cost little to widen, so where
    the second-ranked group (in layer 0) no longer fits, both groups of layer 1 after it still do."""
    from aah.hf.calibration.policies import duo_windows

    rise = torch.tensor([[0.6, 0.6, 1.0, 1.0], [0.5, 0.5, 0.2, 0.2]])  # ranking (0, 1), (0, 0), (1, 0), (1, 1)
    short0, full0 = causal_pairs(8, 64, sink_tokens=4), causal_pairs(64, 64)
    full1 = causal_pairs(16, 64)
    budget = math.ceil(Fraction(2 * full0 + 2 * short0 + 4 * full1, 8 * (64 * 65 // 2)) * 10**9) / 10**9
    got = duo_windows(rise, 8, budget, 64, sink_tokens=4, num_kv_heads=2, layer_windows=[None, 16])
    assert torch.equal(got, torch.tensor([[8, 8, 64, 64], [64, 64, 64, 64]]))
    # Without the sliding window, layer 1 costs what layer 0 does: only the first-ranked group fits.
    got = duo_windows(rise, 8, budget, 64, sink_tokens=4, num_kv_heads=2)
    assert torch.equal(got, torch.tensor([[8, 8, 64, 64], [8, 8, 8, 8]]))


def test_duo_calibration_ranks_by_the_answer_loss_at_the_short_window(monkeypatch):
    """``calibrate(policy="duo")`` measures the answer loss of each KV group at the candidates
    (W, T) and hands the W column to the ranking: with a known table the choice is exact."""
    import aah.hf.calibration.policies as policies

    calls = []

    def fake_answer_loss(model, sequences, candidates, *, sink_tokens, items, progress=False, full_nll=None):
        calls.append((tuple(candidates), [list(i) for i in items], sink_tokens, len(sequences)))
        return torch.stack([DUO_RISE, torch.zeros(2, 4)], dim=-1)

    monkeypatch.setattr(policies, "measure_answer_loss", fake_answer_loss)
    model = _llama()
    budget = _duo_budget(4, 8, 8, 64, 2)
    got = calibrate(model, _batches(1), policy="duo", budget=budget, sink_tokens=2, duo_window=8,
                    retrieval=["a", "b"])
    assert calls == [((8, 64), [[0, 1], [2, 3]], 2, 2)]
    assert torch.equal(got, _expected_duo(DUO_GROUP_RANKING, 2, 8, 64, 2))
    assert policies.duo_full_items(got, 64, num_kv_heads=2) == [[0, 1], [1, 0]]
    heads = calibrate(model, _batches(1), policy="duo", budget=_duo_budget(3, 8, 8, 64, 2), sink_tokens=2,
                      duo_window=8, retrieval=["a"], granularity="head")
    assert calls[-1][:2] == ((8, 64), [[0], [1], [2], [3]])
    assert torch.equal(heads, _expected_duo(DUO_HEAD_RANKING, 3, 8, 64, 1))
    assert policies.duo_full_items(heads, 64, granularity="head") == [[0, 2], [1, 0], [1, 1]]


def test_duo_calibration_errors_name_the_numbers():
    model, batch = _llama(), _batches(1)
    with pytest.raises(ValueError, match="policy 'duo' needs a budget"):
        calibrate(model, batch, policy="duo", duo_window=8, retrieval=["a"])
    smallest = causal_coverage([8], 64, sink_tokens=4)
    with pytest.raises(ValueError, match=rf"budget 0.2 is below the smallest feasible causal coverage {smallest:.4f} "
                                         r"\(every head at window 8 with 4 sink tokens at length 64\)"):
        calibrate(model, batch, policy="duo", budget=0.2, duo_window=8, retrieval=["a"])
    for bad in (0, 64, 256, 8.0, True):
        with pytest.raises(ValueError, match=r"duo_window must be an integer in \[1, 64\)"):
            calibrate(model, batch, policy="duo", budget=0.5, duo_window=bad, retrieval=["a"])
    with pytest.raises(ValueError, match=r"duo_window must be an integer in \[1, 64\).*got 256"):
        calibrate(model, batch, policy="duo", budget=0.5, retrieval=["a"])  # the default 256 is too long here
    with pytest.raises(ValueError, match="duo_window needs policy 'duo', got 'budgeted'"):
        calibrate(model, batch, policy="budgeted", budget=0.5, duo_window=8)
    with pytest.raises(ValueError, match="policy 'duo' needs retrieval sequences"):
        calibrate(model, batch, policy="duo", budget=0.5, duo_window=8)


def test_duo_calibration_is_the_ranking_of_the_measured_answer_loss(tiny_model_dir):
    from aah.hf.calibration.answer_loss import measure_answer_loss
    from aah.hf.calibration.policies import duo_windows

    seqs = _sequences(_bpe_tokenizer(tiny_model_dir[0]), 320, 2)
    model = _llama(max_pos=512)
    budget = 0.6
    got = calibrate(model, _batches(1, seq_len=320), policy="duo", budget=budget, sink_tokens=2, duo_window=32,
                    retrieval=seqs)
    answer = measure_answer_loss(model, seqs, (32, 320), sink_tokens=2, items=[[0, 1], [2, 3]])
    assert float(answer[..., 1].abs().max()) == 0.0 and float(answer[..., 0].sum()) > 0
    assert torch.equal(got, duo_windows(answer[..., 0], 32, budget, 320, sink_tokens=2, num_kv_heads=2))
    assert set(got.flatten().tolist()) == {32, 320} and torch.equal(got[:, 0::2], got[:, 1::2])
    assert causal_coverage(got, 320, sink_tokens=2) <= budget


@pytest.mark.slow
def test_duo_calibrate_command_records_the_window_and_the_full_groups(tiny_model_dir, tmp_path, capsys):
    model_dir, corpus = tiny_model_dir
    big = _retrieval_model(model_dir, tmp_path)
    out = tmp_path / "duo.safetensors"
    assert main(["hf", "calibrate", str(big), "--corpus", str(corpus), "--seq-len", "320", "--policy", "duo",
                 "--budget", "0.65", "--duo-window", "32", "--sink-tokens", "2", "--retrieval-sequences", "1",
                 "--batches", "1", "--out", str(out)]) == 0
    windows, meta = load_windows(out)
    assert meta["policy"] == "duo" and meta["duo_window"] == 32 and meta["budget"] == 0.65
    assert meta["retrieval_sequences"] == 1 and meta["granularity"] == "kv_group"
    assert meta["scope"] is meta["measure"] is meta["candidates"] is meta["retrieval_weight"] is None
    assert set(windows.flatten().tolist()) == {32, 320} and torch.equal(windows[:, 0::2], windows[:, 1::2])
    full = [[layer, g] for layer in range(2) for g in range(2) if int(windows[layer, 2 * g]) == 320]
    assert meta["duo_full_items"] == full and len(full) == 2  # 0.65 holds two of the four groups at full length
    assert meta["causal_coverage"] == pytest.approx(causal_coverage(windows, 320, sink_tokens=2))
    assert meta["causal_coverage"] <= 0.65
    printed = capsys.readouterr().out
    assert "duo windows for 2 layers x 4 heads" in printed
    assert "2 KV groups at full length 320, the rest at window 32" in printed


def test_duo_calibrate_command_errors_are_one_line(tiny_model_dir, capsys):
    model_dir, corpus = tiny_model_dir
    base = ["hf", "calibrate", str(model_dir), "--corpus", str(corpus), "--seq-len", "64", "--batches", "1",
            "--out", "x"]
    duo = [*base, "--policy", "duo"]
    assert "--duo-window goes with --policy duo only, got --policy budgeted" in _error(
        [*base, "--policy", "budgeted", "--budget", "0.5", "--duo-window", "8"], capsys)
    for bad in ("0", "-3", "x", "8.5"):
        assert f"--duo-window takes an int in [1, --seq-len); got '{bad}'" in _error(
            [*duo, "--budget", "0.5", "--duo-window", bad], capsys)
    err = _error([*duo, "--budget", "0.5", "--duo-window", "64"], capsys)
    assert "--duo-window must be an int in [1, --seq-len) = [1, 64)" in err and "got 64" in err
    assert "got 256" in _error([*duo, "--budget", "0.5"], capsys)  # the default window is too long at 64 tokens
    assert "policy 'duo' needs a budget" in _error([*duo, "--duo-window", "8"], capsys)
    smallest = causal_coverage([8], 64, sink_tokens=4)
    err = _error([*duo, "--budget", "0.1", "--duo-window", "8"], capsys)
    assert "below the smallest feasible causal coverage" in err and f"{smallest:.4f}" in err and "window 8" in err
    assert "--candidates does not apply to --policy duo" in _error(
        [*duo, "--budget", "0.5", "--duo-window", "8", "--candidates", "8,64"], capsys)
    assert "--retrieval-sequences must be >= 1" in _error(
        [*duo, "--budget", "0.5", "--duo-window", "8", "--retrieval-sequences", "0"], capsys)
    assert "--retrieval-reserve needs --policy budgeted --measure kl_retrieval" in _error(
        [*duo, "--budget", "0.5", "--duo-window", "8", "--retrieval-reserve", "0.1"], capsys)


def test_eval_without_the_uniform_setting(tiny_model_dir, tmp_path):
    """--no-uniform: full and aah alone, the same keys otherwise (the summary without uniform's)."""
    model_dir, corpus = tiny_model_dir
    path = tmp_path / "w.safetensors"
    save_windows(path, torch.tensor([[8, 8, 16, 16], [4, 4, 8, 8]]),
                 {"model": model_signature(_llama()), "seq_len": 64, "policy": "uniform", "budget": 0.5,
                  "sink_tokens": 2, "acr": 0.1, "causal_coverage": 0.1})
    out = tmp_path / "e.json"
    assert main(["hf", "eval", str(model_dir), "--windows-file", str(path), "--corpus", str(corpus), "--seq-len", "64",
                 "--batches", "1", "--decode-batch", "2", "--new-tokens", "3", "--rounds", "1", "--no-uniform",
                 "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "uniform" not in report and {"full", "aah", "prefill_speedup", "decode_speedup"} <= set(report)
    assert report["config"]["uniform_window"] is None and "aah_vs_uniform_ppl_ratio" not in report
