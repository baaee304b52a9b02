"""Synthetic retrieval tasks (aah.hf.evaluation.tasks), their scoring, and the aah hf retrieval command."""

from __future__ import annotations

import json
import re

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")  # the tiny models' tokenizers are trained with it

from aah.cli import main  # noqa: E402
from aah.data.corpora import CorpusNotFoundError  # noqa: E402
from aah.hf import load_windows, save_windows  # noqa: E402
from aah.hf.bridge.windows_file import model_signature  # noqa: E402
from aah.hf.evaluation.compare import Setting  # noqa: E402
from aah.hf.evaluation.retrieval import generate_answers, score, wilson_interval  # noqa: E402
from aah.hf.evaluation.tasks import (  # noqa: E402
    REPEAT_FILLER,
    TASKS,
    Sample,
    build_sample,
    build_samples,
    is_correct,
)

REPEAT_TASKS = [t for t in TASKS if t != "niah_text"]


@pytest.fixture(scope="module")
def tok(byte_bpe):
    """A byte-level BPE trained offline on the filler and needle words (any text still tokenizes)."""
    text = "".join(REPEAT_FILLER) * 20 + " the special magic numbers for is: What are pass key Remember it VAR = " * 20
    return byte_bpe([text], 400)


def _text(tok, sample: Sample) -> str:
    return tok.decode(list(sample.input_ids))


@pytest.mark.parametrize("task", REPEAT_TASKS)
def test_samples_fill_the_length_and_hold_their_answers(tok, task):
    for length, depth in ((600, 0.05), (900, 0.5), (900, 0.95)):
        s = build_sample(tok, task, length, depth, seed=3)
        assert s.task == task and s.length == length
        # The prompt leaves room for the answer and is filled to within one filler sentence.
        assert length - s.max_new_tokens - 12 <= s.prompt_len <= length - s.max_new_tokens
        text = _text(tok, s)
        for answer in s.answers:
            assert re.search(rf"\b{answer}\b", text)
        assert abs(s.needle_depth - depth) < 6 / s.prompt_len  # the nearest sentence boundary
        assert build_sample(tok, task, length, depth, seed=3) == s  # deterministic
        assert build_sample(tok, task, length, depth, seed=4).input_ids != s.input_ids


def test_passkey_is_the_landmark_prompt(tok):
    s = build_sample(tok, "passkey", 700, 0.4, seed=1)
    (key,) = s.answers
    text = _text(tok, s)
    assert re.fullmatch(r"[1-9]\d{4}", key)
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in text
    assert text.endswith(" What is the pass key? The pass key is")
    assert text.count(key) == 2 and "The grass is green. The sky is blue. The sun is yellow." in text
    start, end = text.index("here.\n") + 6, text.index(" What is the pass key?")
    assert abs((text.index(" The pass key") - start) / (end - start) - 0.4) < 0.08  # depth in the haystack


def test_multikey_asks_one_of_several_keys_and_multivalue_wants_all(tok):
    s = build_sample(tok, "niah_multikey", 900, 0.3, seed=2)
    text = _text(tok, s)
    needles = re.findall(r"special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", text)
    assert len(needles) == 4 and len({k for k, _ in needles}) == 4
    asked = re.search(r"What is the special magic number for ([a-z]+-[a-z]+) mentioned", text).group(1)
    assert s.answers == (dict(needles)[asked],)
    m = build_sample(tok, "niah_multivalue", 900, 0.3, seed=2)
    needles = re.findall(r"special magic numbers for ([a-z]+-[a-z]+) is: (\d{7})\.", _text(tok, m))
    assert len({k for k, _ in needles}) == 1 and sorted(v for _, v in needles) == sorted(m.answers)
    assert len(m.answers) == 4


def test_variable_tracking_answers_are_the_chain_that_holds_the_value(tok):
    s = build_sample(tok, "vt", 900, 0.2, seed=5)
    text = _text(tok, s)
    value = re.search(r"assigned the value (\d{5}) in the text above", text).group(1)
    holds = {m.group(1) for m in re.finditer(rf"VAR ([A-Z]{{5}}) = {value}\.", text)}
    links = re.findall(r"VAR ([A-Z]{5}) = VAR ([A-Z]{5})\.", text)
    grown = True
    while grown:  # follow the assignments from the value
        new = {dst for dst, src in links if src in holds} - holds
        holds |= new
        grown = bool(new)
    assert holds == set(s.answers) and len(holds) == 4


def test_niah_text_buries_the_needle_in_held_out_shakespeare(tok):
    try:
        s = build_sample(tok, "niah_text", 900, 0.5, seed=0)
    except CorpusNotFoundError:
        pytest.skip("the shakespeare corpus is not installed")
    text = _text(tok, s)
    assert "The grass is green" not in text and text.count("\n") > 10
    assert "\nOne of the special magic numbers for" in text and s.answers[0] in text


def test_build_samples_grid_order_and_errors(tok):
    samples = build_samples(tok, ["passkey", "vt"], [600, 800], [0.1, 0.9], 2, seed=0)
    assert len(samples) == 2 * 2 * 2 * 2
    assert [(s.task, s.length, s.depth, s.trial) for s in samples[:4]] == [
        ("passkey", 600, 0.1, 0), ("passkey", 600, 0.1, 1), ("passkey", 600, 0.9, 0), ("passkey", 600, 0.9, 1)]
    assert len({s.input_ids for s in samples}) == len(samples)
    with pytest.raises(ValueError, match="tasks must be among passkey"):
        build_samples(tok, ["passkey", "haystack"], [600], [0.5], 1)
    with pytest.raises(ValueError, match="cannot hold"):
        build_sample(tok, "passkey", 40, 0.5)
    with pytest.raises(ValueError, match="depth must be in"):
        build_sample(tok, "passkey", 600, 1.5)


def test_answers_must_be_whole_words():
    s = Sample("niah_multivalue", 100, 0.5, 0, (1,), ("1234567", "7654321"), 10, 0.5)
    assert is_correct(s, " 1234567, 7654321.")
    assert not is_correct(s, " 1234567 and 76543210")
    assert not is_correct(s, " 12345678, 7654321")


def test_wilson_interval_matches_published_values():
    # Wilson (1927) score interval, z = 1.96: 8/10 -> [0.4902, 0.9433]; 0/10 -> [0, z^2 / (n + z^2)].
    assert wilson_interval(8, 10) == pytest.approx([0.49016, 0.94332], abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx([0.0, 1.959964**2 / (10 + 1.959964**2)], abs=1e-6)
    assert wilson_interval(40, 40)[1] == 1.0 and wilson_interval(40, 40)[0] == pytest.approx(0.91238, abs=1e-4)
    assert wilson_interval(0, 0) is None


def test_score_counts_by_length_depth_and_cell():
    def sample(length, depth, answer):
        return Sample("passkey", length, depth, 0, (1,), (answer,), 8, depth)

    samples = [sample(100, 0.1, "11111"), sample(100, 0.9, "22222"), sample(200, 0.1, "33333"),
               sample(200, 0.9, "44444")]
    results = score(samples, {"full": [" 11111.", " 22222", " 33333", " 44444"],
                              "aah": [" 11111.", " 2222", " 33333", " 0"]})
    assert results["full"]["passkey"]["accuracy"] == 1.0
    aah = results["aah"]["passkey"]
    assert (aah["correct"], aah["trials"], aah["accuracy"]) == (2, 4, 0.5)
    assert aah["ci"] == wilson_interval(2, 4)
    assert aah["by_length"]["100"]["correct"] == 1 and aah["by_length"]["200"]["correct"] == 1
    assert aah["by_depth"]["0.1"]["correct"] == 2 and aah["by_depth"]["0.9"]["correct"] == 0
    assert aah["grid"]["200"]["0.9"] == {"accuracy": 0.0, "ci": wilson_interval(0, 1), "correct": 0, "trials": 1}


# ---- greedy answers and the command on a tiny random model -----------------------------------------

def _llama(vocab: int, max_pos: int = 1024):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=max_pos, attn_implementation="sdpa",
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


def test_greedy_answers_equal_transformers_generate(tok):
    model = _llama(len(tok))
    s = build_sample(tok, "niah_single", 400, 0.5, seed=0)
    got = generate_answers(model, Setting("full", None), s, tok)
    ids = torch.tensor([s.input_ids])
    with torch.no_grad():
        ref = model.generate(ids, max_new_tokens=s.max_new_tokens, do_sample=False)
    assert got == tok.decode(ref[0, ids.shape[1]:].tolist())
    # Windows that cover the whole context change nothing.
    wide = Setting("aah", torch.full((2, 4), 1024), 4)
    wide.apply(model)
    try:
        assert generate_answers(model, wide, s, tok) == got
    finally:
        Setting("full", None).apply(model)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("retrieval")
    model = _llama(len(tok))
    model.save_pretrained(root / "model")
    tok.save_pretrained(root / "model")
    windows = torch.tensor([[64, 64, 512, 512], [32, 32, 128, 128]])
    meta = {"model": model_signature(model), "seq_len": 512, "policy": "budgeted", "budget": 0.5,
            "sink_tokens": 4, "acr": 0.4, "causal_coverage": 0.5}
    save_windows(root / "w.safetensors", windows, meta)
    return root


@pytest.mark.slow
def test_retrieval_command_writes_json_and_heatmap(model_dir, tmp_path, capsys):
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    argv = ["hf", "retrieval", str(model_dir / "model"), "--windows-file", str(model_dir / "w.safetensors"),
            "--tasks", "passkey,niah_single", "--lengths", "350,400", "--depths", "0.1,0.9", "--trials", "1",
            "--json", str(out), "--heatmap", str(png)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"config", "filler", "settings", "results", "samples", "peak_rss_bytes"}
    assert isinstance(report["peak_rss_bytes"], int) and report["peak_rss_bytes"] > 0
    assert report["filler"] == report["config"]["filler"] == "repeat"
    assert report["config"]["tasks"] == ["passkey", "niah_single"] and report["config"]["lengths"] == [350, 400]
    assert set(report["results"]) == {"full", "aah", "uniform"}
    for per_task in report["results"].values():
        for task in ("passkey", "niah_single"):
            r = per_task[task]
            assert r["trials"] == 4 and set(r["by_length"]) == {"350", "400"} and set(r["by_depth"]) == {"0.1", "0.9"}
            assert sum(c["trials"] for row in r["grid"].values() for c in row.values()) == 4
            assert r["ci"] == wilson_interval(r["correct"], 4)
    facts = report["settings"]
    assert facts["full"]["400"]["causal_coverage"] == facts["full"]["400"]["executed_coverage"] == 1.0
    for n in ("350", "400"):
        assert facts["aah"][n]["executed_coverage"] == pytest.approx(facts["aah"][n]["causal_coverage"])
        assert facts["uniform"][n]["causal_coverage"] <= facts["aah"][n]["causal_coverage"] + 1e-12
        assert facts["uniform"][n]["window"] is not None and facts["aah"][n]["window"] is None
    assert len(report["samples"]) == 8
    first = report["samples"][0]
    assert set(first["outputs"]) == {"full", "aah", "uniform"} and first["length"] == 350
    # The scores are those of the recorded outputs.
    flags = [re.search(rf"\b{s['answers'][0]}\b", s["outputs"]["full"]) is not None
             for s in report["samples"] if s["task"] == "passkey"]
    assert report["results"]["full"]["passkey"]["correct"] == sum(flags)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "| aah | passkey |" in out and out.startswith("Retrieval accuracy, repeat filler\n")


def test_retrieval_answers_journal_resumes_a_stopped_run(model_dir, tmp_path, monkeypatch, capsys):
    from aah.hf.evaluation import retrieval as retrieval_eval

    journal = tmp_path / "answers.jsonl"
    base = ["hf", "retrieval", str(model_dir / "model"), "--tasks", "passkey", "--lengths", "350",
            "--depths", "0.1,0.9", "--trials", "1", "--settings", "full,aah", "--answers", str(journal)]
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    assert main([*base, "--windows-file", str(model_dir / "w.safetensors"), "--json", str(first)]) == 0
    lines = journal.read_text().splitlines()
    assert len(lines) == 5 and set(json.loads(lines[0])) == {"model"}  # the model, then 2 samples x 2 settings
    # a crash mid-write leaves a cut line; the run after it decodes nothing again
    with journal.open("a") as fh:
        fh.write('{"key": "cut sho')

    def no_decoding(*args, **kwargs):
        raise AssertionError("an answer in the journal was decoded again")

    monkeypatch.setattr(retrieval_eval, "generate_answers", no_decoding)
    assert main([*base, "--windows-file", str(model_dir / "w.safetensors"), "--json", str(second)]) == 0
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    assert a["results"] == b["results"] and a["samples"] == b["samples"]
    # other windows are another run for the windowed settings: their answers are decoded again;
    # full attention's answers do not depend on the windows file and are taken from the journal
    other = tmp_path / "other.safetensors"
    windows, meta = load_windows(model_dir / "w.safetensors")
    save_windows(other, windows.clamp(max=40), meta)
    full_only = [a if a != "full,aah" else "full" for a in base]
    assert main([*full_only, "--windows-file", str(other), "--json", str(second)]) == 0
    assert json.loads(second.read_text())["results"]["full"] == a["results"]["full"]
    with pytest.raises(AssertionError, match="decoded again"):
        main([*base, "--windows-file", str(other)])
    # --sink-tokens as in the file is the same run; other sinks are another
    assert main([*base, "--windows-file", str(model_dir / "w.safetensors"), "--sink-tokens", "4"]) == 0
    with pytest.raises(AssertionError, match="decoded again"):
        main([*base, "--windows-file", str(model_dir / "w.safetensors"), "--sink-tokens", "64"])
    capsys.readouterr()


def test_retrieval_filler_is_reported_and_its_answers_are_kept_apart(model_dir, tmp_path, monkeypatch, capsys):
    """--filler: the report names it (top level, config, each sample, the table's header) and the
    journal keeps the answers of each filler apart."""
    from aah.hf.evaluation import retrieval as retrieval_eval

    out, journal = tmp_path / "r.json", tmp_path / "answers.jsonl"
    argv = ["hf", "retrieval", str(model_dir / "model"), "--windows-file", str(model_dir / "w.safetensors"),
            "--tasks", "passkey,vt", "--lengths", "400", "--depths", "0.5", "--trials", "1", "--settings", "full",
            "--answers", str(journal), "--json", str(out)]
    assert main([*argv, "--filler", "code"]) == 0
    report = json.loads(out.read_text())
    assert report["filler"] == report["config"]["filler"] == "code"
    assert [s["filler"] for s in report["samples"]] == ["code", "code"]
    assert capsys.readouterr().out.startswith("Retrieval accuracy, code filler\n")
    keys = [json.loads(line)["key"] for line in journal.read_text().splitlines()[1:]]
    assert len(keys) == 2 and all(k.endswith("|code") for k in keys)
    assert main([*argv, "--filler", "table"]) == 0  # another haystack: decoded, not taken from the journal
    assert main(argv) == 0  # the default, repeat: keys as before the filler could be chosen
    keys = [json.loads(line)["key"] for line in journal.read_text().splitlines()[1:]]
    tails = [k.rsplit("|", 1)[1] for k in keys]
    assert sorted(t if t in ("code", "table") else "digest" for t in tails) == ["code"] * 2 + ["digest"] * 2 + ["table"] * 2

    def no_decoding(*args, **kwargs):
        raise AssertionError("an answer in the journal was decoded again")

    monkeypatch.setattr(retrieval_eval, "generate_answers", no_decoding)
    for filler in ("code", "table", "repeat"):
        assert main([*argv, "--filler", filler]) == 0
        assert json.loads(out.read_text())["filler"] == filler
    with pytest.raises(AssertionError, match="decoded again"):
        main([*argv, "--filler", "list"])
    capsys.readouterr()


def test_retrieval_journal_is_refused_once_new_weights_are_saved_under_the_same_path(model_dir, tmp_path, capsys):
    """The journal names the model's content, not its path: other weights saved into the same
    folder make a run refuse the journal (exit 2, one line naming it), and nothing is reused."""
    import shutil

    from aah.hf.evaluation.retrieval import model_key

    folder = tmp_path / "model"
    shutil.copytree(model_dir / "model", folder)
    assert model_key(folder) == model_key(model_dir / "model")  # the content, wherever it lies
    journal = tmp_path / "answers.jsonl"
    argv = ["hf", "retrieval", str(folder), "--windows-file", str(model_dir / "w.safetensors"), "--tasks", "passkey",
            "--lengths", "350", "--depths", "0.5", "--trials", "1", "--settings", "full", "--answers", str(journal),
            "--json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    kept = journal.read_text()
    model = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        model.lm_head.weight.mul_(-1.0)
    model.save_pretrained(folder)
    capsys.readouterr()
    assert main(argv) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("aah ")]  # one line
    assert str(journal) in err
    assert "written for another model" in err and f"content of {folder} changed" in err and "start over" in err
    assert journal.read_text() == kept


def test_retrieval_journal_without_a_model_line_is_refused(model_dir, tmp_path, capsys):
    """A journal written before journals named their model cannot be vouched for: refused, saying how to start over."""
    journal = tmp_path / "answers.jsonl"
    journal.write_text(json.dumps({"key": "0123456789abcdef|full|0123", "text": "71432"}) + "\n")
    argv = ["hf", "retrieval", str(model_dir / "model"), "--windows-file", str(model_dir / "w.safetensors"),
            "--lengths", "350", "--depths", "0.5", "--trials", "1", "--settings", "full",
            "--answers", str(journal), "--json", str(tmp_path / "r.json")]
    assert main(argv) == 2
    (err,) = [line for line in capsys.readouterr().err.splitlines() if line.startswith("aah ")]  # one line
    assert str(journal) in err
    assert "does not record which model" in err and "delete it or choose another --answers to start over" in err


def test_retrieval_sink_tokens_override_the_windows_file(model_dir, tmp_path, capsys):
    """More sinks keep the prompt's first tokens in every head's reach: the settings run them, the
    report says so, and their causal coverage is that of the windows with those sinks."""
    out = tmp_path / "r.json"
    argv = ["hf", "retrieval", str(model_dir / "model"), "--windows-file", str(model_dir / "w.safetensors"),
            "--lengths", "400", "--depths", "0.5", "--trials", "1", "--settings", "aah", "--json", str(out)]
    assert main(argv) == 0
    four = json.loads(out.read_text())
    assert main([*argv, "--sink-tokens", "64"]) == 0
    many = json.loads(out.read_text())
    assert four["config"]["sink_tokens"] == 4 and many["config"]["sink_tokens"] == 64
    windows = load_windows(model_dir / "w.safetensors")[0]
    for report, sinks in ((four, 4), (many, 64)):
        pairs = sum(min(w, 400) * 400 - min(w, 400) * (min(w, 400) - 1) // 2 for w in windows.flatten().tolist())
        pairs += sum(max(0, min(sinks, i - w + 1)) for w in windows.flatten().tolist() for i in range(400))
        expected = pairs / (windows.numel() * 400 * 401 // 2)
        assert report["settings"]["aah"]["400"]["causal_coverage"] == pytest.approx(expected)
    capsys.readouterr()


def test_retrieval_kept_keys_are_reported_and_are_another_run(model_dir, tmp_path, monkeypatch, capsys):
    """--tail-tokens/--kept-keys: the config and the per-setting facts say what ran (the tail's pairs
    in the causal coverage, the kept keys in the ACR), and the journal keeps their answers apart."""
    from aah.hf.bridge.kept_keys import KeptKeys, executed_read_coverage, kept_coverage
    from aah.hf.bridge.spec import kv_heads, layer_windows_for
    from aah.hf.evaluation import retrieval as retrieval_eval

    out, journal = tmp_path / "r.json", tmp_path / "answers.jsonl"
    argv = ["hf", "retrieval", str(model_dir / "model"), "--windows-file", str(model_dir / "w.safetensors"),
            "--lengths", "400", "--depths", "0.5", "--trials", "1", "--settings", "aah,uniform",
            "--json", str(out), "--answers", str(journal)]
    assert main(argv) == 0
    plain = json.loads(out.read_text())
    kept_argv = [*argv, "--tail-tokens", "8", "--kept-keys", "16", "--kept-pool", "3"]
    assert main(kept_argv) == 0
    kept = json.loads(out.read_text())
    assert (kept["config"]["tail_tokens"], kept["config"]["kept_keys"], kept["config"]["kept_pool"]) == (8, 16, 3)
    assert plain["config"]["tail_tokens"] is None
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "model")
    windows = load_windows(model_dir / "w.safetensors")[0]
    expected = kept_coverage(layer_windows_for(model, windows, 4), 400, KeptKeys(8, 16, 3), kv_heads(model))
    facts = kept["settings"]["aah"]["400"]
    assert (facts["acr"], facts["causal_coverage"]) == pytest.approx(expected)
    executed = executed_read_coverage(layer_windows_for(model, windows, 4), 400, KeptKeys(8, 16, 3), kv_heads(model))
    assert facts["executed_coverage"] == pytest.approx(executed) and executed > facts["causal_coverage"]
    plain_facts = plain["settings"]["aah"]["400"]
    assert plain_facts["executed_coverage"] == pytest.approx(plain_facts["causal_coverage"])
    assert facts["causal_coverage"] > plain["settings"]["aah"]["400"]["causal_coverage"]
    assert kept["settings"]["uniform"]["400"]["acr"] > plain["settings"]["uniform"]["400"]["acr"]

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(retrieval_eval, "generate_answers", no_decoding)
    assert main(kept_argv) == 0  # the same kept keys: every answer from the journal
    with pytest.raises(AssertionError, match="decoded again"):
        main([*argv, "--tail-tokens", "8", "--kept-keys", "32"])
    with pytest.raises(AssertionError, match="decoded again"):
        main([*kept_argv, "--prefill-kept", "4", "--prefill-block", "64"])
    capsys.readouterr()


def test_retrieval_rolling_kept_keys_are_reported(model_dir, tmp_path, capsys):
    """--prefill-kept/--prefill-block: the config says what ran, the causal coverage counts the
    blocks' kept keys (rolling_coverage_pairs) and the executed coverage the scoring rows too."""
    from aah.hf.bridge.kept_keys import KeptKeys, executed_read_coverage, kept_coverage
    from aah.hf.bridge.spec import kv_heads, layer_windows_for

    out = tmp_path / "r.json"
    argv = ["hf", "retrieval", str(model_dir / "model"), "--windows-file", str(model_dir / "w.safetensors"),
            "--lengths", "400", "--depths", "0.5", "--trials", "1", "--settings", "aah",
            "--tail-tokens", "8", "--kept-keys", "16", "--json", str(out)]
    assert main([*argv, "--prefill-kept", "4", "--prefill-block", "64"]) == 0
    rolling = json.loads(out.read_text())
    assert (rolling["config"]["prefill_kept"], rolling["config"]["prefill_block"]) == (4, 64)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "model")
    specs = layer_windows_for(model, load_windows(model_dir / "w.safetensors")[0], 4)
    spec = KeptKeys(8, 16, prefill_keys=4, prefill_block=64)
    facts = rolling["settings"]["aah"]["400"]
    assert (facts["acr"], facts["causal_coverage"]) == pytest.approx(kept_coverage(specs, 400, spec, kv_heads(model)))
    assert facts["causal_coverage"] > kept_coverage(specs, 400, KeptKeys(8, 16), kv_heads(model))[1]
    assert facts["executed_coverage"] == pytest.approx(executed_read_coverage(specs, 400, spec, kv_heads(model)))
    assert facts["executed_coverage"] > executed_read_coverage(specs, 400, KeptKeys(8, 16), kv_heads(model))
    assert "executed coverage |" in capsys.readouterr().out
    assert main(argv) == 0
    config = json.loads(out.read_text())["config"]
    assert (config["prefill_kept"], config["prefill_block"]) == (0, None)
    capsys.readouterr()


def _error(argv, capsys) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    return err


def test_retrieval_command_refuses_bad_input(model_dir, capsys):
    base = ["hf", "retrieval", str(model_dir / "model"), "--windows-file", str(model_dir / "w.safetensors")]
    assert "--tasks must be distinct names among passkey" in _error([*base, "--lengths", "400", "--tasks", "pk"],
                                                                     capsys)
    assert "--depths must be" in _error([*base, "--lengths", "400", "--depths", "0.5,1.5"], capsys)
    assert "--lengths must be" in _error([*base, "--lengths", "400,x"], capsys)
    assert "--settings must be" in _error([*base, "--lengths", "400", "--settings", "full,best"], capsys)
    assert "--filler must be one of repeat, prose, dialogue, code, table, list; got 'xml'" in _error(
        [*base, "--lengths", "400", "--filler", "xml"], capsys)
    assert "--filler: niah_text has its own filler, dialogue; for the list filler ask niah_single" in _error(
        [*base, "--lengths", "400", "--tasks", "passkey,niah_text", "--filler", "list"], capsys)
    assert "--trials must be >= 1" in _error([*base, "--lengths", "400", "--trials", "0"], capsys)
    assert "--sink-tokens takes an int >= 0" in _error([*base, "--lengths", "400", "--sink-tokens", "-1"], capsys)
    assert "go together" in _error([*base, "--lengths", "400", "--kept-keys", "16"], capsys)
    assert "--kept-pool needs" in _error([*base, "--lengths", "400", "--kept-pool", "3"], capsys)
    assert "--prefill-kept needs --tail-tokens and --kept-keys" in _error(
        [*base, "--lengths", "400", "--prefill-kept", "3"], capsys)
    kept = [*base, "--lengths", "400", "--tail-tokens", "8", "--kept-keys", "16"]
    assert "--prefill-block needs --prefill-kept >= 1" in _error([*kept, "--prefill-block", "64"], capsys)
    assert "--prefill-kept must be >= 0, got -2" in _error([*kept, "--prefill-kept", "-2"], capsys)
    assert "--prefill-block must be >= 1, got 0" in _error([*kept, "--prefill-kept", "2", "--prefill-block", "0"],
                                                           capsys)
    assert "--tail-tokens must be >= 1" in _error([*base, "--lengths", "400", "--tail-tokens", "0", "--kept-keys", "4"],
                                                  capsys)
    assert "--kept-pool must be odd" in _error([*base, "--lengths", "400", "--tail-tokens", "4", "--kept-keys", "4",
                                                "--kept-pool", "4"], capsys)
    assert "max_position_embeddings" in _error([*base, "--lengths", "4096"], capsys)
    assert "cannot hold" in _error([*base, "--lengths", "60"], capsys)
    assert "--windows-file: no file nope.safetensors" in _error(
        [*base[:-1], "nope.safetensors", "--lengths", "400"], capsys)


def test_retrieval_baselines_windows_alone_and_duo(model_dir, tmp_path, monkeypatch, capsys):
    """``windows`` reads the windows file without kept keys and ``duo`` another file with its own
    sinks: each answers as that setting run alone, and the journal keeps their answers apart from
    aah's (they do not change with the kept-key flags)."""
    from aah.hf.bridge.kept_keys import KeptKeys
    from aah.hf.evaluation import retrieval as retrieval_eval
    from aah.hf.evaluation.compare import Setting

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir / "model")
    duo_windows = torch.tensor([[512, 512, 512, 512], [16, 16, 16, 16]])
    meta = {"model": model_signature(model), "seq_len": 512, "policy": "duo", "budget": 0.5,
            "sink_tokens": 8, "acr": 0.5, "causal_coverage": 0.5}
    save_windows(tmp_path / "duo.safetensors", duo_windows, meta)
    out, journal = tmp_path / "r.json", tmp_path / "answers.jsonl"
    base = ["hf", "retrieval", str(model_dir / "model"), "--windows-file", str(model_dir / "w.safetensors"),
            "--lengths", "300", "--depths", "0.5", "--trials", "1", "--answers", str(journal)]
    argv = [*base, "--settings", "aah,windows,duo", "--duo-file", str(tmp_path / "duo.safetensors"),
            "--tail-tokens", "8", "--kept-keys", "16", "--json", str(out)]
    assert main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"aah", "windows", "duo"}
    assert report["config"]["duo_file"] == str(tmp_path / "duo.safetensors")
    facts = report["settings"]
    assert facts["windows"]["300"]["executed_coverage"] == pytest.approx(facts["windows"]["300"]["causal_coverage"])
    assert facts["aah"]["300"]["executed_coverage"] > facts["windows"]["300"]["executed_coverage"]
    tok = transformers.AutoTokenizer.from_pretrained(model_dir / "model")
    sample = build_samples(tok, ["passkey"], [300], [0.5], 1)[0]
    windows = load_windows(model_dir / "w.safetensors")[0]
    for name, setting in (("windows", Setting("windows", windows, 4)), ("duo", Setting("duo", duo_windows, 8)),
                          ("aah", Setting("aah", windows, 4, KeptKeys(8, 16)))):
        setting.apply(model)
        assert report["samples"][0]["outputs"][name] == retrieval_eval.generate_answers(model, setting, sample, tok)

    def no_decoding(*args, **kwargs):
        raise AssertionError("decoded again")

    monkeypatch.setattr(retrieval_eval, "generate_answers", no_decoding)
    # Other kept keys change aah's answers, not the baselines': those come from the journal.
    assert main([*base, "--settings", "windows,duo", "--duo-file", str(tmp_path / "duo.safetensors"),
                 "--tail-tokens", "8", "--kept-keys", "32"]) == 0
    for bad in (["--settings", "duo"], ["--settings", "aah", "--duo-file", str(tmp_path / "duo.safetensors")]):
        assert main([*base, *bad]) == 2
        assert "--settings duo and --duo-file go together" in capsys.readouterr().err
