"""aah hf convert on a tiny Llama GGUF written by the test itself."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from aah.cli import main  # noqa: E402

LAYERS, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 2, 32, 4, 2, 8, 64, 97


def _write_tiny_llama_gguf(path) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(128)
    writer.add_embedding_length(DIM)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    writer.add_rope_dimension_count(HEAD_DIM)
    rng = np.random.default_rng(0)

    def tensor(name: str, *shape: int) -> None:
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.05).astype(np.float32))

    tensor("token_embd.weight", VOCAB, DIM)
    tensor("output_norm.weight", DIM)
    tensor("output.weight", VOCAB, DIM)
    for i in range(LAYERS):
        tensor(f"blk.{i}.attn_norm.weight", DIM)
        tensor(f"blk.{i}.ffn_norm.weight", DIM)
        tensor(f"blk.{i}.attn_q.weight", HEADS * HEAD_DIM, DIM)
        tensor(f"blk.{i}.attn_k.weight", KV_HEADS * HEAD_DIM, DIM)
        tensor(f"blk.{i}.attn_v.weight", KV_HEADS * HEAD_DIM, DIM)
        tensor(f"blk.{i}.attn_output.weight", DIM, HEADS * HEAD_DIM)
        tensor(f"blk.{i}.ffn_gate.weight", FFN, DIM)
        tensor(f"blk.{i}.ffn_up.weight", FFN, DIM)
        tensor(f"blk.{i}.ffn_down.weight", DIM, FFN)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_convert_writes_the_weights_transformers_reads_from_the_gguf(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    source = tmp_path / "gguf" / "tiny.gguf"
    source.parent.mkdir()
    _write_tiny_llama_gguf(source)
    out = tmp_path / "converted"
    assert main(["hf", "convert", str(source), str(out)]) == 0
    assert (out / "model.safetensors").is_file()
    assert "quantization_config" not in (out / "config.json").read_text()
    direct = transformers.AutoModelForCausalLM.from_pretrained(
        str(source.parent), gguf_file=source.name, dtype=torch.float32
    )
    converted = transformers.AutoModelForCausalLM.from_pretrained(str(out))
    expected, got = direct.state_dict(), converted.state_dict()
    assert set(got) == set(expected)
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    # A second conversion into the same folder is refused, not overwritten.
    capsys.readouterr()
    assert main(["hf", "convert", str(source), str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
