"""``aah hf eval``, ``retrieval`` and ``calibrate`` on Gemma 3: the ``own`` setting (the model's own
sliding windows through the bridge), logits computed a chunk of rows at a time, and the process's
peak resident memory in what the commands write. Tiny random Gemma 3 models of test_gemma3.py."""

from __future__ import annotations

import json
import re

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")  # the tiny folders' tokenizers are trained with it

from aah.cli import main  # noqa: E402
from aah.hf import load_windows, save_windows  # noqa: E402
from aah.hf.bridge.spec import layer_specs  # noqa: E402
from aah.hf.bridge.windows_file import model_signature  # noqa: E402
from aah.hf.calibration.answer_loss import RetrievalSequence, measure_answer_loss  # noqa: E402
from aah.hf.calibration.policies import measure_lost_mass  # noqa: E402
from aah.hf.calibration.window_kl import measure_window_kl  # noqa: E402
from aah.hf.evaluation.compare import (  # noqa: E402
    Setting,
    block_nll,
    evaluate_settings,
    own_setting,
    served_block_nll,
    summary,
)
from aah.hf.evaluation.tasks import REPEAT_FILLER  # noqa: E402

from ..conftest import text_corpus, tiny_llama  # noqa: E402
from .test_gemma3 import AAH, SINKS, SLIDING, _gemma, _ids  # noqa: E402

T = 24  # blocks longer than the sliding window of 5


class HeadRows:
    """Rows the LM head computes per call, while open (a forward hook on ``lm_head``)."""

    def __init__(self, model) -> None:
        self.model, self.rows = model, []

    def __enter__(self):
        self.handle = self.model.lm_head.register_forward_hook(
            lambda module, args, out: self.rows.append(args[0].shape[:-1].numel()))
        return self.rows

    def __exit__(self, *exc) -> None:
        self.handle.remove()


def _plain_nll(model, blocks) -> list[float]:
    """The unchunked reference: every position's logits of the unpatched model at once (in float32,
    as the evaluation takes them: hence tolerances of 1e-6 on the mean loss)."""
    with torch.no_grad():
        return [F.cross_entropy(model(b[None], use_cache=False).logits[0, :-1].float(), b[1:]).item() for b in blocks]


# ---- own: the model's own windows through the bridge -----------------------------------------------

def test_own_runs_the_layers_own_windows_and_equals_unpatched_transformers():
    model = _gemma()  # float64
    blocks = _ids(2, T)
    plain = _plain_nll(model, blocks)
    with torch.no_grad():
        plain_tokens = model.generate(blocks[:, :14], max_new_tokens=8, do_sample=False)
    own = own_setting(model, T)
    assert own.windows.tolist() == [[SLIDING] * 4, [T] * 4, [SLIDING] * 4] and own.sink_tokens == 0
    settings = [Setting("full", None), own, Setting("aah", AAH, SINKS)]
    results = evaluate_settings(model, settings, blocks, decode_batch=2, new_tokens=4, rounds=1, progress=False,
                                chunk_rows=5)
    assert list(results) == ["full", "own", "aah"]
    for key in ("block_nll", "served_block_nll"):
        assert results["own"][key] == pytest.approx(plain, abs=1e-6)
        assert results["own"][key] == pytest.approx(results["full"][key], abs=1e-9)
    assert results["own"]["decode_route"] != "transformers"  # the bridge's window cache ran it
    own.apply(model)
    assert [spec.windows for spec in layer_specs(model)] == [(SLIDING,) * 4, (T,) * 4, (SLIDING,) * 4]
    with torch.no_grad():
        own_tokens = model.generate(blocks[:, :14], max_new_tokens=8, do_sample=False)
    assert torch.equal(own_tokens, plain_tokens)
    # The comparison can tell windows apart: the global layer at the sliding window reads another loss.
    narrow = Setting("narrow", torch.full((3, 4), SLIDING), 0)
    narrow.apply(model)
    assert all(abs(a - b) > 1e-4 for a, b in zip(block_nll(model, blocks), plain))
    out = summary(results)
    for key in ("ppl_ratio", "prefill_speedup", "decode_speedup", "kv_bytes_ratio", "served_ppl_ratio"):
        assert key in out
    assert out["own_ppl_ratio"] == pytest.approx(1.0, abs=1e-9)
    assert out["own_prefill_speedup"] == pytest.approx(results["own"]["prefill_tok_s"] / results["full"]["prefill_tok_s"])
    assert out["own_decode_speedup"] == pytest.approx(results["own"]["decode_tok_s"] / results["full"]["decode_tok_s"])
    assert out["aah_vs_own_prefill_speedup"] == pytest.approx(
        results["aah"]["prefill_tok_s"] / results["own"]["prefill_tok_s"])
    assert out["aah_vs_own_decode_speedup"] == pytest.approx(
        results["aah"]["decode_tok_s"] / results["own"]["decode_tok_s"])
    assert out["aah_vs_own_ppl_ratio"] == pytest.approx(results["aah"]["ppl"] / results["own"]["ppl"])


def test_own_is_refused_for_a_model_without_sliding_layers():
    with pytest.raises(ValueError, match="no sliding layers of its own.*full setting"):
        own_setting(tiny_llama(), 32)


# ---- logits a chunk of rows at a time ---------------------------------------------------------------

@pytest.mark.parametrize("patched", [False, True])
def test_block_nll_in_chunks_equals_the_whole_logits_and_the_head_reads_a_chunk_at_most(patched):
    model = _gemma(final_logit_softcapping=2.0)  # the cap changes the loss: head_logits must apply it
    blocks = _ids(2, T, seed=3)
    plain = _plain_nll(model, blocks)
    if patched:
        own_setting(model, T).apply(model)
    with HeadRows(model) as rows:
        chunked = block_nll(model, blocks, chunk_rows=5)
    assert chunked == pytest.approx(plain, abs=1e-6)
    assert rows and max(rows) <= 5
    assert sum(rows) == 2 * (T - 1 + 2)  # every predicting row once, and the last position twice (its check)
    with HeadRows(model) as rows:
        served = served_block_nll(model, own_setting(model, T) if patched else Setting("full", None), blocks,
                                  chunk_rows=5)
    assert served == pytest.approx(plain, abs=1e-6) and max(rows) <= 5


def test_calibration_measures_compute_no_whole_block_of_logits():
    model = _gemma()
    batches = [_ids(1, T, seed=s) for s in (5, 6)]
    cands = (2, 4, 8, 24)
    whole = measure_window_kl(model, batches, cands, sink_tokens=2, num_queries=8, chunk_rows=10_000)
    with HeadRows(model) as rows:
        chunked = measure_window_kl(model, batches, cands, sink_tokens=2, num_queries=8, chunk_rows=4)
    torch.testing.assert_close(chunked, whole, atol=1e-7, rtol=1e-6)  # the same sampled labels, the same table
    assert whole.abs().sum() > 0 and max(rows) <= 4
    with HeadRows(model) as rows:
        measure_lost_mass(model, batches, cands, sink_tokens=2)
    assert max(rows) == 1  # the last position only: the logits go unused
    # The answer loss reads its context into a cache and cuts it back after each answer, past the
    # sliding window of 5 here (a sliding layer's own cache would refuse that).
    ids = _ids(1, 30, seed=7)[0].tolist()
    sequence = RetrievalSequence(tuple(ids[:24]), tuple(ids[24:27]), tuple(ids[27:]))
    with HeadRows(model) as rows:
        table = measure_answer_loss(model, [sequence], cands, sink_tokens=2, items=[[0, 1, 2, 3]])
    assert table.shape == (3, 4, 4) and max(rows) <= len(cands) * 3  # the answer's rows of each variant


# ---- the command line on tiny Gemma 3 folders: own, peak_rss_bytes ---------------------------------

WORDS = "".join(REPEAT_FILLER) * 20 + " the special magic numbers for is: What are pass key Remember it VAR = " * 20


def _folder(root, model, tok) -> None:
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    meta = {"model": model_signature(model), "seq_len": 64, "policy": "budgeted", "budget": 0.5,
            "sink_tokens": SINKS, "acr": 0.5, "causal_coverage": 0.5}
    save_windows(root / "w.safetensors", AAH if model.config.num_hidden_layers == 3 else torch.full((2, 4), 8), meta)


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory, byte_bpe):
    root = tmp_path_factory.mktemp("gemma3-eval")
    tok = byte_bpe([WORDS], 400)
    _folder(root, _gemma(vocab_size=len(tok), max_position_embeddings=1024).float(), tok)
    text_corpus(root / "corpus", " ".join(REPEAT_FILLER) * 4, 10)
    return root


def test_retrieval_runs_full_own_and_aah_on_gemma3(gemma_dir, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert main(["hf", "retrieval", str(gemma_dir / "model"), "--windows-file", str(gemma_dir / "w.safetensors"),
                 "--tasks", "passkey", "--lengths", "200", "--depths", "0.5", "--trials", "1",
                 "--settings", "full,own,aah", "--answers", str(tmp_path / "a.jsonl"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert list(report["results"]) == ["full", "own", "aah"] and report["config"]["settings"] == ["full", "own", "aah"]
    (sample,) = report["samples"]
    assert sample["outputs"]["own"] == sample["outputs"]["full"]  # the model's own attention, through the bridge
    own = report["settings"]["own"]["200"]
    assert own["window"] is None and own["causal_coverage"] < 1.0  # the sliding layers' window of 5 cuts
    assert report["peak_rss_bytes"] > 0
    assert "| own | passkey |" in capsys.readouterr().out


def test_eval_and_calibrate_report_own_and_peak_rss_on_gemma3(gemma_dir, tmp_path, capsys):
    windows = tmp_path / "w.safetensors"
    assert main(["hf", "calibrate", str(gemma_dir / "model"), "--corpus", str(gemma_dir / "corpus"), "--seq-len", "32",
                 "--policy", "uniform", "--budget", "0.6", "--batches", "1", "--out", str(windows)]) == 0
    assert "peak_rss_bytes" not in load_windows(windows)[1]  # the same calibration writes the same file
    assert re.search(r"peak RSS \d", capsys.readouterr().out)
    out = tmp_path / "eval.json"
    assert main(["hf", "eval", str(gemma_dir / "model"), "--windows-file", str(gemma_dir / "w.safetensors"),
                 "--corpus", str(gemma_dir / "corpus"), "--seq-len", "32", "--batches", "1", "--decode-batch", "1",
                 "--new-tokens", "2", "--rounds", "1", "--no-uniform", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert {"full", "own", "aah"} <= set(report) and "uniform" not in report
    assert report["own"]["ppl"] == pytest.approx(report["full"]["ppl"], rel=1e-5)
    for key in ("own_prefill_speedup", "own_decode_speedup", "aah_vs_own_prefill_speedup",
                "aah_vs_own_decode_speedup", "prefill_speedup", "decode_speedup", "ppl_ratio", "peak_rss_bytes"):
        assert report[key] > 0
    printed = capsys.readouterr().out
    assert "peak RSS" in printed and "aah vs own" in printed and "| own |" in printed


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory, byte_bpe):
    root = tmp_path_factory.mktemp("llama-own")
    tok = byte_bpe([WORDS], 400)
    _folder(root, tiny_llama(vocab=len(tok)), tok)
    return root


def test_retrieval_refuses_own_for_a_model_without_sliding_layers(llama_dir, tmp_path, capsys):
    capsys.readouterr()
    assert main(["hf", "retrieval", str(llama_dir / "model"), "--windows-file", str(llama_dir / "w.safetensors"),
                 "--lengths", "120", "--settings", "full,own", "--json", str(tmp_path / "r.json")]) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err.startswith("aah") and "--settings own" in err and "no sliding" in err and "LlamaForCausalLM" in err
    assert not (tmp_path / "r.json").exists()
def test_answer_loss_past_the_sliding_window_reads_what_the_model_reads():
    """The answer loss's full-attention NLL of a sequence longer than the sliding window equals the
    NLL of the answer tokens in the unpatched model's own forward over the whole sequence."""
    model = _gemma()
    ids = _ids(1, 30, seed=9)
    sequence = RetrievalSequence(tuple(ids[0, :22].tolist()), tuple(ids[0, 22:26].tolist()), tuple(ids[0, 26:].tolist()))
    full_nll: list[float] = []
    measure_answer_loss(model, [sequence], (2, 4), sink_tokens=2, items=[[0, 1, 2, 3]], full_nll=full_nll)
    with torch.no_grad():
        logits = model(ids).logits[0, 25:-1]
    expected = F.cross_entropy(logits.double(), ids[0, 26:], reduction="sum")
    assert full_nll == [pytest.approx(float(expected), rel=1e-6)]


def test_retrieval_calibration_runs_past_the_sliding_window_on_gemma3(gemma_dir, tmp_path):
    """Both answer-loss calibrations (the retrieval measure and the duo policy) on prompts longer
    than the sliding window."""
    for extra in (["--measure", "kl_retrieval"], ["--policy", "duo", "--duo-window", "8"]):
        out = tmp_path / "w.safetensors"
        args = ["hf", "calibrate", str(gemma_dir / "model"), "--corpus", str(gemma_dir / "corpus"), "--seq-len", "400",
                "--policy", "budgeted", "--budget", "0.5", "--batches", "1", "--retrieval-sequences", "1", "--out", str(out)]
        assert main(args + extra) == 0
