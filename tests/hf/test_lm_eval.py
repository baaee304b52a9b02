"""The aah_hf model type of lm-evaluation-harness, offline, on a tiny random model and RULER's niah_single_1."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("lm_eval")
pytest.importorskip("wonderwords")  # RULER's needle keys

from aah.hf.bridge.windows_file import model_signature, save_windows  # noqa: E402

SEQ = 320


@pytest.fixture(scope="module")
def folder(tmp_path_factory, byte_bpe):
    root = tmp_path_factory.mktemp("lm_eval")
    text = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. " * 20
    tok = byte_bpe([text + " special magic numbers for is: What are all mentioned in the provided text"], 400,
                   special_tokens=["<eos>"], eos_token="<eos>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
        bos_token_id=None, pad_token_id=tok.eos_token_id,
    )
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    meta = {"model": model_signature(model), "seq_len": SEQ, "policy": "budgeted", "budget": 0.5, "sink_tokens": 2,
            "acr": 0.5, "causal_coverage": 0.5}
    save_windows(root / "narrow.safetensors", torch.tensor([[16, 16, 64, 64], [8, 8, 32, 32]]), meta)
    save_windows(root / "wide.safetensors", torch.full((2, 4), 512), meta)
    return root


def test_aah_hf_patches_the_model_with_the_file(folder):
    from aah.hf import patched_windows
    from aah.hf.evaluation.lm_eval_model import AAHLM

    lm = AAHLM(pretrained=str(folder / "model"), windows=str(folder / "narrow.safetensors"), device="cpu")
    assert lm.model.config._attn_implementation == "aah" and lm.sink_tokens == 2
    assert torch.equal(patched_windows(lm.model), torch.tensor([[16, 16, 64, 64], [8, 8, 32, 32]]))
    with pytest.raises(ValueError, match="needs windows=FILE"):
        AAHLM(pretrained=str(folder / "model"), device="cpu")


def test_aah_hf_takes_kept_keys_from_model_args(folder, monkeypatch):
    """tail_tokens, kept_keys, kept_pool, prefill_kept and prefill_block, from lm-eval's argument
    string or as keywords, patch the model with them, and lm-eval's generation builds its window
    cache with them; the checks of aah hf eval's flags refuse bad ones before the weights load."""
    from aah.hf import KeptKeys, patched_kept_keys
    from aah.hf.bridge import cache as cache_module
    from aah.hf.evaluation.lm_eval_model import AAHLM

    model, narrow = folder / "model", folder / "narrow.safetensors"
    lm = AAHLM.create_from_arg_string(
        f"pretrained={model},windows={narrow},tail_tokens=4,kept_keys=6,kept_pool=3,prefill_kept=2,prefill_block=16",
        {"device": "cpu", "batch_size": 1},
    )
    spec = KeptKeys(4, 6, 3, prefill_keys=2, prefill_block=16)
    assert lm.kept_keys == spec and patched_kept_keys(lm.model) == spec
    built, new_cache = [], cache_module.new_cache
    monkeypatch.setattr(cache_module, "new_cache",
                        lambda m, **kwargs: built.append(kwargs.get("kept_keys")) or new_cache(m, **kwargs))
    context = torch.randint(0, 50, (1, 40), generator=torch.Generator().manual_seed(0))
    out = lm._model_generate(context, max_length=44, stop=["<eos>"], do_sample=False)
    assert out.shape[1] > 40 and built == [spec]
    plain = AAHLM(pretrained=str(model), windows=str(narrow), device="cpu", tail_tokens="4", kept_keys=6)
    assert plain.kept_keys == KeptKeys(4, 6)
    assert AAHLM(pretrained=str(model), windows=str(narrow), device="cpu").kept_keys is None
    for bad, message in (({"tail_tokens": 4}, "tail_tokens and kept_keys go together"),
                         ({"tail_tokens": 4, "kept_keys": 6, "kept_pool": 2}, "kept_pool must be odd"),
                         ({"tail_tokens": "four", "kept_keys": 6}, "tail_tokens must be an integer"),
                         ({"tail_tokens": 4, "kept_keys": 6, "prefill_block": 8}, "prefill_block needs prefill_kept"),
                         ({"prefill_kept": 2}, "prefill_kept needs tail_tokens and kept_keys")):
        with pytest.raises(ValueError, match=message):
            AAHLM(pretrained=str(folder / "missing"), windows=str(narrow), device="cpu", **bad)


@pytest.mark.slow
def test_module_command_line_runs_niah_single_1(folder, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "aah.hf.evaluation.lm_eval_model", "--model", "aah_hf", "--model_args",
           f"pretrained={folder / 'model'},windows={folder / 'narrow.safetensors'}", "--device", "cpu",
           "--tasks", "niah_single_1", "--metadata", json.dumps({"max_seq_lengths": [SEQ]}), "--limit", "1",
           "--gen_kwargs", "max_gen_toks=4", "--output_path", str(tmp_path / "out")]
    run = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "niah_single_1" in run.stdout and f"|{SEQ}" in run.stdout.replace(" ", "")
