"""Served perplexity (aah.hf.evaluation.compare.served_block_nll): the held-out blocks read through a
setting's own cache prefill, its loss taken from the final hidden states a chunk of rows at a time."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from aah.hf.bridge.kept_keys import KeptKeys  # noqa: E402
from aah.hf.evaluation.compare import (  # noqa: E402
    Setting,
    block_nll,
    evaluate_settings,
    markdown_table,
    ppl_ratio_interval,
    served_block_nll,
    summary,
)

VOCAB = 97
WINDOWS = torch.tensor([[3, 3, 5, 5], [4, 4, 2, 2]])
KEPT = {
    "tail_only": KeptKeys(8, 3, 1),
    "rolling": KeptKeys(4, 3, 1, prefill_keys=2, prefill_block=6),
}


def _blocks(count: int = 2, length: int = 30) -> torch.Tensor:
    return torch.randint(0, VOCAB, (count, length), generator=torch.Generator().manual_seed(5))


def _prefill_nll(model, setting: Setting, blocks: torch.Tensor) -> list[float]:
    """The reference: each block prefilled into a fresh cache of the setting, the plain way, with
    the logits of every position at once."""
    out = []
    for block in blocks:
        ids = block[None]
        logits = model(ids, past_key_values=setting.new_cache(model), use_cache=True).logits[0, :-1].float()
        out.append(F.cross_entropy(logits, ids[0, 1:]).item())
    return out


@torch.no_grad()
@pytest.mark.parametrize("kept", sorted(KEPT))
def test_served_nll_of_kept_keys_is_that_of_the_cached_prefills_full_logits(kept, llama):
    model = llama()
    setting = Setting("aah", WINDOWS, 2, KEPT[kept])
    setting.apply(model)
    blocks = _blocks()
    served = served_block_nll(model, setting, blocks, chunk_rows=7)
    assert served == pytest.approx(_prefill_nll(model, setting, blocks), abs=2e-6)
    # The kept keys change what the prefill predicts: the windows alone give another loss.
    windows_alone = block_nll(model, blocks)
    assert all(abs(a - b) > 1e-4 for a, b in zip(served, windows_alone))


@torch.no_grad()
def test_served_chunks_never_ask_the_head_for_more_rows(llama):
    """Each call of the LM head reads at most ``chunk_rows`` rows (one for the model's own last
    logits and the check against them), and the loss is that of one chunk over the whole block."""
    model = llama()
    setting = Setting("aah", WINDOWS, 2, KEPT["rolling"])
    setting.apply(model)
    blocks = _blocks()
    rows: list[int] = []
    handle = model.lm_head.register_forward_pre_hook(lambda module, args: rows.append(args[0].shape[-2]))
    try:
        chunked = served_block_nll(model, setting, blocks, chunk_rows=4)
        chunked_rows, rows[:] = list(rows), []
        whole = served_block_nll(model, setting, blocks, chunk_rows=1000)
    finally:
        handle.remove()
    assert max(chunked_rows) == 4 and sum(r for r in chunked_rows if r > 1) >= 4 * 7
    assert max(rows) == blocks.shape[1] - 1  # one chunk: every predicting row at once (the hook sees it)
    assert chunked == pytest.approx(whole, rel=1e-6)
    assert chunked == pytest.approx(_prefill_nll(model, setting, blocks), abs=2e-6)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="chunk_rows must be an integer >= 1"):
            served_block_nll(model, setting, blocks, chunk_rows=bad)


@torch.no_grad()
def test_evaluate_reports_served_perplexity_beside_perplexity(llama):
    """Full attention and windows without kept keys serve what they read without a cache; the kept
    keys' served perplexity is that of their cached prefill. The summary's served ratio and interval
    are those of the served losses, the table shows them."""
    model = llama()
    aah = Setting("aah", WINDOWS, 2, KEPT["rolling"])
    settings = [Setting("full", None), aah, Setting("windows", WINDOWS, 2)]
    blocks = _blocks(3)
    results = evaluate_settings(model, settings, blocks, decode_batch=2, new_tokens=3, rounds=1, progress=False,
                                chunk_rows=5)
    for name in ("full", "windows"):
        assert results[name]["served_block_nll"] == pytest.approx(results[name]["block_nll"], abs=2e-6)
        assert results[name]["served_ppl"] == pytest.approx(results[name]["ppl"], rel=1e-5)
    aah.apply(model)
    assert results["aah"]["served_block_nll"] == pytest.approx(_prefill_nll(model, aah, blocks), abs=2e-6)
    assert results["aah"]["block_nll"] == pytest.approx(results["windows"]["block_nll"], rel=1e-6)  # no cache
    assert abs(results["aah"]["served_ppl"] - results["aah"]["ppl"]) > 1e-4
    out = summary(results)
    full = results["full"]
    assert out["served_ppl_ratio"] == pytest.approx(results["aah"]["served_ppl"] / full["served_ppl"])
    ci = ppl_ratio_interval(results["aah"]["served_block_nll"], full["served_block_nll"])
    assert ci is not None and out["served_ppl_ratio_ci"] == pytest.approx(ci)
    assert out["ppl_ratio"] == pytest.approx(results["aah"]["ppl"] / full["ppl"])
    assert out["ppl_ratio_ci"] == pytest.approx(ppl_ratio_interval(results["aah"]["block_nll"], full["block_nll"]))
    table = markdown_table(results).splitlines()
    assert "| served perplexity | served / full (95% CI) |" in table[0]
    assert all(line.count("|") == table[0].count("|") for line in table)
    aah_row = next(line for line in table if line.startswith("| aah |")).split(" | ")
    assert aah_row[3] == f"{results['aah']['served_ppl']:.3f}"
    assert aah_row[4].startswith(f"{results['aah']['served_ppl'] / full['served_ppl']:.4f} [")


def _gemma2(cap: float):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, final_logit_softcapping=cap,
        attn_logit_softcapping=None, attn_implementation="eager", eos_token_id=None, bos_token_id=None,
        pad_token_id=None,
    )
    return transformers.Gemma2ForCausalLM(config).eval()


@torch.no_grad()
def test_served_nll_applies_the_models_final_logit_softcapping():
    model = _gemma2(cap=0.05)
    blocks = _blocks(2, 20)
    full = Setting("full", None)
    served = served_block_nll(model, full, blocks, chunk_rows=6)
    assert served == pytest.approx(block_nll(model, blocks), abs=2e-6)
    model.config.final_logit_softcapping = None  # the head alone: another loss, so the cap counted
    raw = block_nll(model, blocks)
    assert all(abs(a - b) > 1e-3 for a, b in zip(served, raw))


@torch.no_grad()
def test_served_nll_refuses_a_head_it_does_not_reproduce(llama):
    """A Llama whose config names a softcapping its forward never applies: the head's logits of the
    last position differ from the model's own, and no served loss comes out."""
    model = llama()
    model.config.final_logit_softcapping = 1e-3
    with pytest.raises(ValueError, match="computes its logits otherwise"):
        served_block_nll(model, Setting("full", None), _blocks(1, 12))
