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
