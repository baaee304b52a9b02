"""aah.hf calibration policies, the windows file, and the aah hf calibrate/eval commands."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from aah.cli import main  # noqa: E402
from aah.controller import HeadController  # noqa: E402
from aah.hf.calibrate import calibrate, share_within_kv_groups, uniform_window_for_budget  # noqa: E402
from aah.hf.windows_file import load_windows, model_signature, save_windows  # noqa: E402
from aah.regimes import get as get_regime  # noqa: E402
from aah.windows import causal_coverage  # noqa: E402

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
        calibrate(model, batch, policy="uniform", budget=0.5, granularity="layer")


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
    assert torch.equal(windows[:, 0::2], windows[:, 1::2])  # kv_group granularity by default
    report_path = tmp_path / "eval.json"
    assert main(["hf", "eval", str(model_dir), "--windows", str(out), "--corpus", str(corpus), "--seq-len", "64",
                 "--batches", "1", "--decode-batch", "2", "--new-tokens", "3", "--rounds", "1",
                 "--json", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    for name in ("full", "aah", "uniform"):
        assert {"ppl", "prefill_tok_s", "decode_tok_s", "kv_bytes", "acr", "causal_coverage"} <= set(report[name])
    assert "ppl_ratio" in report["uniform"]
    for key in ("ppl_ratio", "prefill_speedup", "decode_speedup", "kv_bytes_ratio"):
        assert report[key] > 0
    assert report["ppl_ratio"] == pytest.approx(report["aah"]["ppl"] / report["full"]["ppl"])
    assert report["full"]["causal_coverage"] == 1.0
    assert report["uniform"]["causal_coverage"] <= report["aah"]["causal_coverage"] + 1e-12
    # KV bytes: the window cache holds S + window entries per KV head of a 61-token prompt.
    slots = sum(2 + min(int(w), 64) for w in windows[:, ::2].flatten())
    assert report["aah"]["kv_bytes"] == 2 * 2 * slots * 8 * 4
    assert report["full"]["kv_bytes"] == 2 * 2 * 2 * 2 * (64 - 3) * 8 * 4
    assert "| aah |" in capsys.readouterr().out


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
        ["hf", "eval", str(model_dir), "--windows", str(other), *base, "--seq-len", "64"], capsys)
    assert "windows file not found" in _error(
        ["hf", "eval", str(model_dir), "--windows", str(tmp_path / "none"), *base, "--seq-len", "64"], capsys)
