"""aah.vllm: per-head windows and sinks over a paged KV cache, the tensor-parallel slice, and
vLLM with the plugin against aah.hf's patched model (end to end, in the vLLM environment)."""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from aah.decode import ring_decode
from aah.vllm import paged as paged_module
from aah.vllm.paged import Batch, PagedKV, windowed_attention
from aah.vllm.plan import plan_layer, rank_heads

from ..conftest import reference_attention

D = 16
BLOCK = 8


def _dense_reference(q, k, v, positions, windows, sinks, scale):
    """float64 attention of queries at ``positions`` over keys ``0..`` (one request), by the rule:
    query ``i`` sees key ``j`` when ``j <= i`` and (``i - j < W`` or ``j < S``)."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    i = positions[:, None]
    j = torch.arange(k.shape[0])[None, :]
    w = torch.tensor(windows)[:, None, None]
    allowed = (j <= i) & ((i - j < w) | (j < sinks))  # (H, Tq, Tk)
    scores = torch.einsum("thd,jhd->htj", q, k) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("htj,jhd->thd", scores.softmax(-1), v)


def _paged(requests, kv_heads, transposed, seed=0, block=BLOCK, garbage=None):
    """Write each request's keys and values into shuffled pages; returns the cache and block table.
    The slots outside the requests hold random numbers, or ``garbage`` (NaN, say) when given."""
    g = torch.Generator().manual_seed(seed)
    dim = requests[0][0].shape[-1]
    pages = [math.ceil(len(k) / block) for k, _ in requests]
    num_blocks = sum(pages) + 3
    perm = torch.randperm(num_blocks, generator=g)
    keys = torch.randn(num_blocks, kv_heads, block, dim, generator=g).to(requests[0][0].dtype)
    values = torch.randn(num_blocks, kv_heads, block, dim, generator=g).to(requests[0][0].dtype)
    if garbage is not None:
        keys.fill_(garbage)
        values.fill_(garbage)
    table = torch.zeros(len(requests), max(pages), dtype=torch.int32)
    used = 0
    for r, (k, v) in enumerate(requests):
        for p in range(pages[r]):
            page_index = int(perm[used])
            used += 1
            table[r, p] = page_index
            chunk_k, chunk_v = k[p * block : (p + 1) * block], v[p * block : (p + 1) * block]
            n = len(chunk_k)
            values[page_index, :, :n] = chunk_v.transpose(0, 1)
            if transposed:  # the page of a head holds K^T (D, block)
                page = keys[page_index].reshape(kv_heads, dim, block)
                page[:, :, :n] = chunk_k.permute(1, 2, 0)
            else:
                keys[page_index, :, :n] = chunk_k.transpose(0, 1)
    return PagedKV(keys, values, transposed), table


def _fake_kernel(requests):
    """A sliding-window kernel computed from the requests' own keys (not from the pages)."""

    def kernel(q, kv_head, starts, seq_lens, table, window):
        out = torch.empty_like(q)
        for n in range(len(seq_lens)):
            a, b = int(starts[n]), int(starts[n + 1])
            r = kernel.rows[n]
            k, v = requests[r]
            length = int(seq_lens[n])
            positions = torch.arange(length - (b - a), length)
            w = window if window > 0 else length
            heads = slice(None) if kv_head is None else slice(kv_head, kv_head + 1)
            ref = _dense_reference(q[a:b], k[:length, heads], v[:length, heads], positions, [w] * q.shape[1], 0, 0.25)
            out[a:b] = ref.float()
        return out

    return kernel


CASES = [  # (context, new tokens) per request: prefills, chunks after cached keys, decode steps
    [(0, 37), (50, 1), (0, 1), (90, 40), (200, 1), (13, 1)],
    [(0, 70)],
    [(120, 1), (7, 1), (300, 1), (40, 30)],
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("windows,kv_heads,sinks,layer_window", [
    ((16, 16, 5, 5, 64, 64), 3, 4, None),      # kv_group windows, GQA, sinks
    ((16, 3, 5, 40, 1, 64), 3, 4, None),       # head windows within a group
    ((16, 3, 5, 40, 1, 64), 6, 2, None),       # no GQA
    ((9, 33, 9, 33, 500, 2), 2, 0, None),      # no sinks
    ((20,) * 6, 3, 4, None),                   # one window for every head: one kernel call per layer
    ((1000,) * 4, 2, 4, None),                 # windows over every length: full causal attention
    ((16, 3, 5, 40, 1, 64), 3, 4, 12),         # a layer with its own sliding window keeps no sinks
])
@pytest.mark.parametrize("with_kernel,query_block,compiled", [
    (False, 128, False), (True, 8, False), (True, 32, False), (False, 128, True), (True, 128, True),
])
def test_paged_windows_equal_the_dense_float64_reference(case, windows, kv_heads, sinks, layer_window, with_kernel,
                                                        query_block, compiled, monkeypatch):
    # PyTorch path: without the kernel every query runs there, in blocks of 128 masked queries;
    # with it, the queries that need sinks, in blocks of 8, split into parts joined by
    # log-sum-exp. Compiled path: those queries in the compiled paged attention.
    if compiled and ring_decode.load() is None:
        pytest.skip(f"the compiled kernels are not available: {ring_decode.unavailable_reason()}")
    monkeypatch.setattr(paged_module, "QUERY_BLOCK", query_block)
    g = torch.Generator().manual_seed(case)
    heads = len(windows)
    shapes = CASES[case]
    requests = [(torch.randn(c + n, kv_heads, D, generator=g), torch.randn(c + n, kv_heads, D, generator=g)) for c, n in shapes]
    queries = [torch.randn(n, heads, D, generator=g) for _, n in shapes]
    transposed = case != 2  # vLLM's vec layout (K^T pages) in cases 0 and 1, plain pages in case 2
    paged, table = _paged(requests, kv_heads, transposed, seed=case)
    starts = torch.tensor([0] + list(torch.tensor([n for _, n in shapes]).cumsum(0)), dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in shapes], dtype=torch.int32)
    batch = Batch.from_metadata(starts, seq_lens, table)
    plan = plan_layer(windows, num_kv_heads=kv_heads, sink_tokens=sinks, layer_window=layer_window)
    kernel = None
    if with_kernel:
        kernel = _fake_kernel(requests)
        inner = kernel

        def kernel(q, kv_head, st, sl, tb, window):  # maps the kernel's rows back to requests
            inner.rows = [_row_of(tb[i], table) for i in range(len(sl))]
            return inner(q, kv_head, st, sl, tb, window)

    query = torch.cat(queries)
    out = torch.full_like(query, float("nan"))
    windowed_attention(query, out, paged, batch, plan, 0.25, kernel=kernel, compiled=compiled)
    effective = [min(w, layer_window) for w in windows] if layer_window else list(windows)
    effective_sinks = 0 if layer_window else sinks
    for r, (c, n) in enumerate(shapes):
        k, v = requests[r]
        ref = _dense_reference(queries[r], k, v, torch.arange(c, c + n), effective, effective_sinks, 0.25)
        got = out[int(starts[r]) : int(starts[r + 1])]
        torch.testing.assert_close(got.double(), ref, atol=2e-6, rtol=1e-5)
        by_rule = reference_attention(*(x.transpose(0, 1) for x in (queries[r], k, v)), effective, 0.25, effective_sinks)
        torch.testing.assert_close(got.double(), by_rule.transpose(0, 1), atol=2e-6, rtol=1e-5)


COMPILED_SHAPES = [  # a long prefill (tiles of tokens), mixed chunks and a decode step, decode steps only (split windows)
    [(0, 300)],
    [(0, 100), (37, 60), (500, 45), (20, 1)],
    [(700, 1), (3, 1)],
]


@pytest.mark.parametrize("shapes", COMPILED_SHAPES)
@pytest.mark.parametrize("dim,block,transposed,dtype", [
    (64, 32, True, torch.float32),    # vLLM's float32 layout: the vectorised tiles
    (128, 64, True, torch.float32),
    (64, 32, False, torch.float32),   # plain key pages
    (48, 16, True, torch.float32),    # a head size and page size the tiles do not take
    (64, 32, True, torch.bfloat16),
])
def test_compiled_paged_attention_equals_the_dense_float64_reference(shapes, dim, block, transposed, dtype):
    if ring_decode.load() is None:
        pytest.skip(f"the compiled kernels are not available: {ring_decode.unavailable_reason()}")
    g = torch.Generator().manual_seed(dim + block)
    windows, kv_heads, sinks = (64, 7, 300, 1, 1000, 33), 2, 4
    requests = [(torch.randn(c + n, kv_heads, dim, generator=g).to(dtype),
                 torch.randn(c + n, kv_heads, dim, generator=g).to(dtype)) for c, n in shapes]
    queries = [torch.randn(n, len(windows), dim, generator=g).to(dtype) for _, n in shapes]
    # every slot outside the requests holds NaN: a kernel that reads one of them fails
    paged, table = _paged(requests, kv_heads, transposed, seed=1, block=block, garbage=float("nan"))
    request = torch.cat([torch.full((n,), r) for r, (_, n) in enumerate(shapes)])
    position = torch.cat([torch.arange(c, c + n) for c, n in shapes])
    scale = dim**-0.5
    got = ring_decode.paged_attention(torch.cat(queries), paged.key_cache, paged.value_cache, transposed, request,
                                      position, table, torch.tensor(windows), sinks, scale)
    start = 0
    tolerance = dict(atol=2e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    for r, (c, n) in enumerate(shapes):
        k, v = requests[r]
        ref = _dense_reference(queries[r], k, v, torch.arange(c, c + n), windows, sinks, scale)
        torch.testing.assert_close(got[start : start + n].double(), ref, **tolerance)
        start += n


@pytest.mark.parametrize("shapes", COMPILED_SHAPES[:2])
def test_compiled_paged_attention_reads_and_writes_views(shapes):
    # the plugin passes a window class's heads as views of the layer's query and output
    if ring_decode.load() is None:
        pytest.skip(f"the compiled kernels are not available: {ring_decode.unavailable_reason()}")
    g = torch.Generator().manual_seed(7)
    requests = [(torch.randn(c + n, 1, 64, generator=g), torch.randn(c + n, 1, 64, generator=g)) for c, n in shapes]
    paged, table = _paged(requests, 1, True, seed=2, block=32)
    n = sum(m for _, m in shapes)
    layer_query = torch.randn(n + 3, 9, 64, generator=g)
    layer_out = torch.full((n + 3, 9, 64), float("nan"))
    request = torch.cat([torch.full((m,), r) for r, (_, m) in enumerate(shapes)])
    position = torch.cat([torch.arange(c, c + m) for c, m in shapes])
    args = (paged.key_cache, paged.value_cache, True, request, position, table, torch.tensor([40, 40, 40]), 4, 0.125)
    expected = ring_decode.paged_attention(layer_query[2 : n + 2, 3:6].contiguous(), *args)
    ring_decode.paged_attention(layer_query[2 : n + 2, 3:6], *args, out=layer_out[2 : n + 2, 3:6])
    torch.testing.assert_close(layer_out[2 : n + 2, 3:6], expected, atol=0, rtol=0)
    assert layer_out[:, :3].isnan().all() and layer_out[:, 6:].isnan().all()  # nothing written beside the view
    assert layer_out[:2].isnan().all() and layer_out[n + 2 :].isnan().all()


def test_compiled_paged_attention_refuses_bad_inputs():
    if ring_decode.load() is None:
        pytest.skip(f"the compiled kernels are not available: {ring_decode.unavailable_reason()}")
    cache = torch.zeros(4, 1, 8, 16)
    q = torch.zeros(2, 2, 16)
    table = torch.tensor([[0, 1]], dtype=torch.int32)
    ok = dict(token_request=torch.zeros(2, dtype=torch.int64), token_position=torch.tensor([0, 1]),
              block_table=table, windows=torch.tensor([3, 3]), sinks=0, scale=0.25)
    ring_decode.paged_attention(q, cache, cache, True, **ok)
    for change, message in [
        (dict(windows=torch.tensor([3, 0])), "window must be >= 1"),
        (dict(token_position=torch.tensor([0, 16])), "beyond the pages"),
        (dict(token_request=torch.tensor([0, 1])), "block table's rows"),
        (dict(block_table=table.long()), "int32"),
        (dict(sinks=-1), "sinks must be >= 0"),
    ]:
        with pytest.raises(RuntimeError, match=message):
            ring_decode.paged_attention(q, cache, cache, True, **{**ok, **change})


def _row_of(row: torch.Tensor, table: torch.Tensor) -> int:
    for r in range(len(table)):
        if torch.equal(table[r], row):
            return r
    raise AssertionError("unknown block-table row")


@pytest.mark.parametrize("heads,kv_heads,tp", [(8, 4, 2), (8, 2, 4), (9, 3, 3), (8, 1, 2), (12, 4, 4)])
def test_tensor_parallel_ranks_slice_the_windows_like_the_heads(heads, kv_heads, tp):
    windows = torch.arange(1, heads + 1) * 10
    group = heads // kv_heads
    seen = []
    for rank in range(tp):
        plan = plan_layer(windows, num_kv_heads=kv_heads, sink_tokens=4, layer_window=None, tp_size=tp, rank=rank)
        queries, kvs = rank_heads(heads, kv_heads, tp, rank)
        # reference: a rank holds a contiguous 1/tp of the query heads, each still reading its own KV head
        local = list(range(rank * heads // tp, (rank + 1) * heads // tp))
        assert list(queries) == local
        assert plan.windows == tuple(int(windows[h]) for h in local)
        for cls in plan.classes:
            for h in cls.q_heads:
                assert local[h] // group == kvs[cls.kv_head]
                assert cls.window == int(windows[local[h]])
        seen += [local[h] for cls in plan.classes for h in cls.q_heads]
    assert sorted(seen) == list(range(heads))


def test_the_windows_file_comes_from_the_environment_then_the_model_config(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from aah.vllm.plan import resolve_windows_path

    monkeypatch.delenv("AAH_WINDOWS", raising=False)
    assert resolve_windows_path(tmp_path, SimpleNamespace()) is None
    config = SimpleNamespace(aah_windows="w.safetensors")
    assert resolve_windows_path(tmp_path, config) == tmp_path / "w.safetensors"
    assert resolve_windows_path(tmp_path, SimpleNamespace(aah_windows="/abs/w.safetensors")) == Path("/abs/w.safetensors")
    monkeypatch.setenv("AAH_WINDOWS", str(tmp_path / "env.safetensors"))
    assert resolve_windows_path(tmp_path, config) == tmp_path / "env.safetensors"


def test_plan_refuses_head_counts_the_ranks_cannot_split():
    with pytest.raises(ValueError, match="num_attention_heads=9 is not divisible by tensor_parallel_size=2"):
        plan_layer([4] * 9, num_kv_heads=3, sink_tokens=0, layer_window=None, tp_size=2, rank=0)
    with pytest.raises(ValueError, match="windows must be >= 1"):
        plan_layer([4, 0], num_kv_heads=1, sink_tokens=0, layer_window=None)


# ---- vLLM with the plugin against aah.hf's patched model (end to end) -----------------------

VLLM_PYTHON = Path(os.environ.get("AAH_VLLM_PYTHON", Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"))
E2E_VOCAB = 300
MAX_LEN = 512
#: (layers, query heads) windows of the tiny model: GQA pairs, one group with two windows.
TINY_WINDOWS = [[16, 16, 40, 40], [7, 9, 100, 100]]
TINY_SINKS = 4
#: Windows of the tiny Mistral: some below its sliding window, some above (capped to it).
TINY_WINDOWS_MISTRAL = [[5, 5, 100, 100], [30, 12, 24, 7]]
#: The tiny Mistral's own sliding window: its windows are capped there, and its layers keep no sinks.
MISTRAL_SLIDING = 24


def _vllm_unavailable() -> str | None:
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON} (build it with `make vllm-env`)"
    probe = ("import importlib.metadata as m, importlib.util as u; "
             "assert u.find_spec('vllm'), 'vllm is not installed'; "
             "assert any(e.value == 'aah.vllm:register' for e in m.entry_points(group='vllm.general_plugins')), "
             "'aah is not installed there (pip install --no-deps -e .)'")
    done = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True, timeout=60)
    if done.returncode:
        return f"the vLLM environment at {VLLM_PYTHON} is not usable: {done.stderr.strip().splitlines()[-1]}"
    return None


def _tiny_model(root: Path, byte_bpe, family: str = "Llama", seed: int = 0, **config) -> Path:
    """A tiny random model of ``family`` (GQA, head size 64) with a byte-level tokenizer, saved
    in ``root / family``; ``config`` adds to its configuration (a Mistral's ``sliding_window``)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = getattr(transformers, f"{family}Config")(
        vocab_size=E2E_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=MAX_LEN,
        eos_token_id=None, bos_token_id=None, tie_word_embeddings=False, **config,
    )
    model_dir = root / family.lower()
    getattr(transformers, f"{family}ForCausalLM")(config).save_pretrained(model_dir)
    texts = ["to be or not to be that is the question whether tis nobler in the mind"] * 20
    byte_bpe(texts, E2E_VOCAB).save_pretrained(model_dir)
    return model_dir


def _windows_file(path: Path, model_dir: Path, windows, sinks: int) -> Path:
    transformers = pytest.importorskip("transformers")
    from aah.hf.bridge.windows_file import model_signature, save_windows

    config = transformers.AutoConfig.from_pretrained(model_dir)
    meta = {"model": model_signature(config), "seq_len": MAX_LEN, "policy": "test", "budget": None,
            "sink_tokens": sinks, "acr": 0.0, "causal_coverage": 0.0}
    return save_windows(path, torch.tensor(windows), meta)


def _prompts(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, E2E_VOCAB, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory, byte_bpe):
    """The vLLM environment checked, a tiny Llama folder (with a tokenizer) and its windows files."""
    reason = _vllm_unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm")
    model_dir = _tiny_model(root, byte_bpe)
    windows = _windows_file(root / "w.safetensors", model_dir, TINY_WINDOWS, TINY_SINKS)
    wide = _windows_file(root / "wide.safetensors", model_dir, [[MAX_LEN] * 4] * 2, TINY_SINKS)
    return root, model_dir, windows, wide


@pytest.fixture(scope="module")
def vllm_runs(tiny_setup):
    """One vLLM subprocess, three engines: windows with chunked prefill and prefix caching, windows
    with neither, and windows >= every length (vanilla attention)."""
    root, model_dir, windows, wide = tiny_setup
    first = _prompts([460, 37, 130, 2, 90, 200], seed=1)  # a mixed batch, the longest near the context (512)
    second = [first[0] + _prompts([40], 2)[0], first[5][:150] + _prompts([20], 3)[0]]  # prefix-cache hits
    eager = {"enforce_eager": True, "max_model_len": MAX_LEN}
    chunked = {**eager, "enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 64}
    whole = {**eager, "enable_prefix_caching": False, "enable_chunked_prefill": False, "max_num_batched_tokens": MAX_LEN}
    logprob_round = {"prompts": first, "max_tokens": 4, "prompt_logprobs": True}
    spec = {"model": str(model_dir), "in_process": True, "engines": [
        {"name": "chunked", "windows": str(windows), "engine_args": chunked,
         "rounds": [logprob_round, {"prompts": second, "max_tokens": 6}]},
        {"name": "whole", "windows": str(windows), "engine_args": whole, "rounds": [logprob_round]},
        {"name": "wide", "windows": str(wide), "engine_args": chunked, "rounds": [logprob_round]},
    ]}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "AAH_WINDOWS"}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-m", "aah.vllm.runner", str(root / "spec.json"), str(root / "out.json")],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return model_dir, json.loads((root / "out.json").read_text()), spec


def _hf_logprobs(model_dir, windows, sinks, sequences, **config_changes):
    """aah.hf's patched model (or the unpatched one for ``windows=None``): per sequence, the
    log-probability of each token given the ones before it, and the argmax and runner-up margin."""
    transformers = pytest.importorskip("transformers")
    from aah import hf

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **config_changes).eval()
    if windows is not None:
        hf.patch(model, torch.tensor(windows), sink_tokens=sinks)
    results = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            logp = model(ids).logits[0].double().log_softmax(-1)
            picked = logp[:-1].gather(1, ids[0, 1:, None])[:, 0]
            top = logp.topk(2, dim=-1)
            results.append((picked, top.indices[:, 0], top.values[:, 0] - top.values[:, 1]))
    return results


def _check_requests(requests, prompts, reference_run):
    sequences = [p + r["tokens"] for p, r in zip(prompts, requests)]
    reference = reference_run(sequences)
    for prompt, request, (picked, argmax, margin) in zip(prompts, requests, reference):
        n = len(prompt)
        if request["prompt_logprobs"]:
            got = torch.tensor(request["prompt_logprobs"], dtype=torch.float64)
            torch.testing.assert_close(got, picked[: n - 1], atol=1e-4, rtol=0)
        got = torch.tensor(request["logprobs"], dtype=torch.float64)
        torch.testing.assert_close(got, picked[n - 1 : n - 1 + len(request["tokens"])], atol=1e-4, rtol=0)
        for step, token in enumerate(request["tokens"]):  # greedy: the reference's argmax, unless a near tie
            if margin[n - 1 + step] > 1e-3:
                assert token == int(argmax[n - 1 + step])


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["chunked", "whole"])
def test_vllm_with_windows_equals_the_patched_hf_model(vllm_runs, engine):
    model_dir, out, spec = vllm_runs
    rounds = next(e for e in spec["engines"] if e["name"] == engine)["rounds"]

    def reference(sequences):
        return _hf_logprobs(model_dir, TINY_WINDOWS, TINY_SINKS, sequences)

    for spec_round, requests in zip(rounds, out[engine]["rounds"]):
        _check_requests(requests, spec_round["prompts"], reference)


@pytest.mark.slow
def test_vllm_with_windows_over_every_length_equals_full_attention(vllm_runs):
    model_dir, out, spec = vllm_runs
    rounds = next(e for e in spec["engines"] if e["name"] == "wide")["rounds"]
    _check_requests(out["wide"]["rounds"][0], rounds[0]["prompts"], lambda seqs: _hf_logprobs(model_dir, None, 0, seqs))
    # and the windows matter: the windowed engine differs from full attention on the long prompt
    windowed = torch.tensor(out["chunked"]["rounds"][0][0]["prompt_logprobs"])
    full = torch.tensor(out["wide"]["rounds"][0][0]["prompt_logprobs"])
    assert (windowed - full).abs().max() > 1e-2


@pytest.fixture(scope="module")
def vllm_process_runs(tiny_setup, byte_bpe):
    """Engines whose workers run in their own processes: the tiny Llama with tensor_parallel_size=2
    (each rank runs one KV head and its two query heads, with their windows), and a tiny Mistral
    (its own sliding window of 24 keys in every layer, windows 5 to 100, 4 sinks in the file)."""
    root, model_dir, windows, _ = tiny_setup
    mistral = _tiny_model(root, byte_bpe, "Mistral", seed=1, sliding_window=MISTRAL_SLIDING)
    mistral_windows = _windows_file(root / "mistral.safetensors", mistral, TINY_WINDOWS_MISTRAL, TINY_SINKS)
    prompts = _prompts([300, 37, 130, 2], seed=4)
    logprob_round = {"prompts": prompts, "max_tokens": 4, "prompt_logprobs": True}
    eager = {"enforce_eager": True, "max_model_len": MAX_LEN, "distributed_executor_backend": "mp"}
    spec = {"model": str(model_dir), "in_process": False, "engines": [
        {"name": "tp2", "windows": str(windows), "engine_args": {**eager, "tensor_parallel_size": 2},
         "rounds": [logprob_round]},
        {"name": "mistral", "model": str(mistral), "windows": str(mistral_windows), "engine_args": eager,
         "rounds": [logprob_round]},
    ]}
    (root / "process_spec.json").write_text(json.dumps(spec))
    # vLLM binds each CPU worker's threads to a NUMA node by default and refuses two workers on
    # one node; with the cores named per rank, two ranks share this machine's one node.
    cores = os.cpu_count() or 1
    bind = "|".join([f"0-{cores // 2 - 1}", f"{cores // 2}-{cores - 1}"] if cores >= 2 else ["0", "0"])
    env = {**{k: v for k, v in os.environ.items() if k != "AAH_WINDOWS"}, "VLLM_CPU_OMP_THREADS_BIND": bind}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-m", "aah.vllm.runner", str(root / "process_spec.json"), str(root / "process_out.json")],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return model_dir, mistral, json.loads((root / "process_out.json").read_text()), prompts


@pytest.mark.slow
def test_vllm_tensor_parallel_2_equals_the_patched_hf_model(vllm_process_runs):
    model_dir, _, out, prompts = vllm_process_runs
    _check_requests(out["tp2"]["rounds"][0], prompts,
                    lambda seqs: _hf_logprobs(model_dir, TINY_WINDOWS, TINY_SINKS, seqs))


@pytest.mark.slow
def test_vllm_keeps_a_models_own_sliding_window_as_the_patched_hf_model_does(vllm_process_runs):
    _, mistral, out, prompts = vllm_process_runs
    _check_requests(out["mistral"]["rounds"][0], prompts,
                    lambda seqs: _hf_logprobs(mistral, TINY_WINDOWS_MISTRAL, TINY_SINKS, seqs))
    # and the model's own window matters: the same windows and sinks without it score differently
    unslid = _hf_logprobs(mistral, TINY_WINDOWS_MISTRAL, TINY_SINKS, [prompts[0]], sliding_window=None)[0][0]
    got = torch.tensor(out["mistral"]["rounds"][0][0]["prompt_logprobs"], dtype=torch.float64)
    assert (got - unslid).abs().max() > 1e-2


def _greedy_request(model_dir, windows, sinks, prompt, steps=2) -> dict:
    """What the runner writes for ``prompt`` when the engine is exactly the reference model."""
    tokens = []
    for _ in range(steps):
        _, argmax, _ = _hf_logprobs(model_dir, windows, sinks, [prompt + tokens + [0]])[0]
        tokens.append(int(argmax[len(prompt) + len(tokens) - 1]))
    picked, _, _ = _hf_logprobs(model_dir, windows, sinks, [prompt + tokens])[0]
    n = len(prompt)
    return {"prompt_logprobs": picked[: n - 1].tolist(), "tokens": tokens, "logprobs": picked[n - 1 :].tolist()}


def test_bench_check_compares_each_engine_with_transformers(tmp_path, byte_bpe):
    pytest.importorskip("transformers")
    from aah.vllm.bench import exactness

    model_dir = _tiny_model(tmp_path, byte_bpe)
    windows = _windows_file(tmp_path / "w.safetensors", model_dir, TINY_WINDOWS, TINY_SINKS)
    prompt = _prompts([120], seed=9)[0]
    requests = {"vanilla": _greedy_request(model_dir, None, 0, prompt),
                "aah": _greedy_request(model_dir, TINY_WINDOWS, TINY_SINKS, prompt)}
    report = exactness(model_dir, windows, prompt, requests)
    for name in ("vanilla", "aah"):
        assert report[name]["max_abs_logprob_diff"] < 1e-9 and report[name]["greedy_equal"]
        # float32 against the same model in float64: small, not zero, and the same as transformers' own
        assert 0 < report[name]["float64_max_abs_logprob_diff"] < 1e-4
        assert report[name]["float64_max_abs_logprob_diff"] == pytest.approx(
            report[name]["transformers_float32_max_abs_logprob_diff"], abs=1e-9)
    # each engine is judged against its own reference: the windowed answers are not full attention's
    swapped = exactness(model_dir, windows, prompt, {"vanilla": requests["aah"], "aah": requests["vanilla"]})
    assert swapped["vanilla"]["max_abs_logprob_diff"] > 1e-3 and swapped["aah"]["max_abs_logprob_diff"] > 1e-3
    requests["aah"]["prompt_logprobs"][5] += 0.01
    report = exactness(model_dir, windows, prompt, requests)
    assert report["aah"]["max_abs_logprob_diff"] >= 0.01 - 1e-9
    assert report["aah"]["float64_max_abs_logprob_diff"] >= 0.01 - 1e-4
    assert report["aah"]["float64_max_at_position"] == 6  # prompt_logprobs[5] scores token 6
    requests["aah"]["tokens"][-1] = (requests["aah"]["tokens"][-1] + 1) % E2E_VOCAB
    report = exactness(model_dir, windows, prompt, requests)
    assert not report["aah"]["greedy_equal"] and report["vanilla"]["greedy_equal"]


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 120) -> dict:
    import urllib.request

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_vllm_serve_answers_a_completion_with_the_windows(tiny_setup):
    """vLLM's OpenAI server on loopback with AAH_WINDOWS: one completion request, greedy tokens and their
    log-probabilities equal the patched model's; the server is stopped by the test (and by a
    `timeout` of its own)."""
    import signal
    import time
    import urllib.request

    root, model_dir, windows, _ = tiny_setup
    port = _free_port()
    env = {**os.environ, "AAH_WINDOWS": str(windows), "VLLM_CPU_KVCACHE_SPACE": "1"}
    # vllm-cpu's `vllm` command looks up the version of a distribution named `vllm` and fails; the
    # server module it would start is the same
    command = ["timeout", "600", str(VLLM_PYTHON), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
               "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--max-model-len", str(MAX_LEN), "--enforce-eager",
               "--gpu-memory-utilization", "0.3", "--served-model-name", "tiny"]
    with open(root / "serve.log", "w") as log:  # the child keeps its own copy of the descriptor
        server = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 420
        while True:
            assert server.poll() is None, (root / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "vllm serve did not become ready"
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                time.sleep(2)
        prompt = _prompts([150], seed=7)[0]
        answer = _post(f"http://127.0.0.1:{port}/v1/completions", {
            "model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 0,
            "ignore_eos": True, "return_tokens_as_token_ids": True,
        })
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:  # the group is still ours: the server never left it
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    choice = answer["choices"][0]
    tokens = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    request = {"prompt_logprobs": [], "tokens": tokens, "logprobs": choice["logprobs"]["token_logprobs"]}
    assert len(tokens) == 5
    _check_requests([request], [prompt], lambda seqs: _hf_logprobs(model_dir, TINY_WINDOWS, TINY_SINKS, seqs))


def test_bench_command_errors_are_one_line(tmp_path, capsys):
    from aah.vllm.bench import main as bench_main

    (tmp_path / "w.safetensors").write_bytes(b"")
    assert bench_main([str(tmp_path), "--windows-file", str(tmp_path / "w.safetensors")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"aah bench vllm: {tmp_path} is not a model folder (no config.json)"
    (tmp_path / "config.json").write_text("{}")
    assert bench_main([str(tmp_path), "--windows-file", str(tmp_path / "w.safetensors"), "--rounds", "0"]) == 2
    assert capsys.readouterr().err.strip() == "aah bench vllm: --rounds must be >= 1, got 0"
    # A windows file for another model is refused before either engine starts, naming the file.
    config, windows = _bench_model(tmp_path)
    config["num_hidden_layers"] = 3
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert bench_main([str(tmp_path), "--windows-file", str(windows)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"aah bench vllm: windows file {windows} (named by --windows-file) was calibrated for ")
    assert "\n" not in err


def _bench_model(folder: Path) -> tuple[dict, Path]:
    """A Llama-shaped config.json in ``folder`` and a windows file made for it."""
    from aah.hf.bridge.windows_file import model_signature, save_windows

    config = {"model_type": "llama", "vocab_size": 50, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "hidden_size": 32}
    (folder / "config.json").write_text(json.dumps(config))
    meta = {"model": model_signature(SimpleNamespace(**config)), "seq_len": 64, "policy": "uniform", "budget": 0.5,
            "sink_tokens": 4, "acr": 0.5, "causal_coverage": 0.5}
    return config, save_windows(folder / "w.safetensors", torch.full((2, 4), 16), meta)


def test_bench_json_keys_and_speedups_from_the_engines_timings(tmp_path, monkeypatch):
    # The runner is replaced by one that answers every round with fixed engine timings: vanilla
    # prefills in 2 s and decodes in 4 s, the windows in 1 s and 2 s, so both speed-ups are 2.
    import sys as _sys

    from aah.vllm import bench

    _bench_model(tmp_path)
    timings = {"vanilla": (2.0, 4.0), "aah": (1.0, 2.0)}

    def fake_runner(cmd, env, stdout):
        spec = json.loads(Path(cmd[3]).read_text())
        results = {}
        for engine in spec["engines"]:
            prefill, decode = timings[engine["name"]]
            rounds, seconds = [], []
            for spec_round in engine["rounds"]:
                tokens = spec_round["max_tokens"]
                rounds.append([{"prompt_logprobs": [], "tokens": [0] * tokens, "logprobs": [0.0] * tokens,
                                "first_token_ts": 10.0, "last_token_ts": 10.0 + (decode if tokens > 1 else 0.0)}
                               for _ in spec_round["prompts"]])
                seconds.append(prefill)
            results[engine["name"]] = {"rounds": rounds, "seconds": seconds, "startup_s": 1.5}
        Path(cmd[4]).write_text(json.dumps(results))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(bench.subprocess, "run", fake_runner)
    out = tmp_path / "bench.json"
    argv = [str(tmp_path), "--windows-file", str(tmp_path / "w.safetensors"), "--seq-len", "64", "--new-tokens", "5",
            "--decode-batch", "2", "--rounds", "3", "--vllm-python", _sys.executable, "--json", str(out)]
    assert bench.main(argv) == 0
    report = json.loads(out.read_text())
    assert set(report) == {"config", "vanilla", "aah", "prefill_speedup", "decode_speedup"}
    for name in ("vanilla", "aah"):
        assert set(report[name]) == {"prefill_tok_s", "decode_tok_s", "prefill_s", "decode_s", "startup_s"}
        assert len(report[name]["prefill_s"]) == len(report[name]["decode_s"]) == 3
    assert report["vanilla"]["prefill_tok_s"] == pytest.approx(64 / 2.0)
    assert report["aah"]["decode_tok_s"] == pytest.approx(2 * (5 - 1) / 2.0)
    assert report["prefill_speedup"] == pytest.approx(2.0) and report["decode_speedup"] == pytest.approx(2.0)
