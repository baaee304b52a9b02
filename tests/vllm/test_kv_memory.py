"""aah.vllm's KV memory following the windows: the block arithmetic, the sink-keeping
sliding-window manager on vLLM's block pool, and engines whose layers free the blocks outside
their sinks and largest window (in the vLLM environment; skipped without it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import textwrap

import pytest
import torch

from aah.vllm.kv_blocks import (
    admission_blocks,
    freed_blocks,
    frees_blocks,
    layer_reach,
    max_concurrency,
    read_blocks,
    sink_blocks,
    sliding_admission_blocks,
)

from .test_plugin import (
    MAX_LEN,
    TINY_SINKS,
    TINY_WINDOWS,
    VLLM_PYTHON,
    _check_requests,
    _hf_logprobs,
    _prompts,
    _tiny_model,
    _vllm_unavailable,
    _windows_file,
)

# ---- the block arithmetic (no vLLM) ---------------------------------------------------------


@pytest.mark.parametrize("window,sinks,block", [(20, 10, 8), (40, 4, 32), (7, 0, 4), (5, 17, 4), (33, 32, 16),
                                                (1, 1, 8), (100, 4, 32)])
def test_no_query_reads_a_freed_block(window, sinks, block):
    # at every point of a request, the queries still to come read only blocks that are kept
    for computed in range(0, 300):
        freed = set(freed_blocks(computed, window, sinks, block))
        for position in range(computed, computed + 40):
            assert not read_blocks(position, window, sinks, block) & freed, (computed, position)
        # and every block before the window of the next query but the sinks' is freed
        first_read = max(0, computed - window + 1) // block
        assert freed == set(range(sink_blocks(sinks, block), first_read))


def test_the_kept_blocks_are_the_sinks_and_the_window():
    # S = 10 sinks in blocks of 8: blocks 0 and 1; W = 20: the next query at 100 reads keys 81..100
    assert list(freed_blocks(100, 20, 10, 8)) == list(range(2, 10))  # keys 16..79 freed, block 10 holds key 81
    assert list(freed_blocks(26, 20, 10, 8)) == []                    # key 7 is still in the window
    assert list(freed_blocks(100, 20, 0, 8)) == list(range(0, 10))    # without sinks: vLLM's sliding window
    assert read_blocks(100, 20, 10, 8) == {0, 1, 10, 11, 12}
    assert read_blocks(3, 20, 10, 8) == {0}


def test_a_layer_holds_its_largest_window_and_its_sinks():
    assert layer_reach([16, 16, 40, 40], 4, None) == (40, 4)
    assert layer_reach([30, 12, 24, 7], 4, 24) == (24, 0)   # a layer's own window caps them and drops the sinks
    assert layer_reach([5, 5, 10, 10], 4, 24) == (10, 0)
    # a layer frees blocks only when its window and sinks leave a whole block out of the context
    assert frees_blocks(40, 4, 32, 512) and frees_blocks(100, 4, 32, 512)
    assert not frees_blocks(512, 4, 32, 512) and not frees_blocks(480, 4, 32, 512)
    assert frees_blocks(448, 4, 32, 512) and not frees_blocks(449, 4, 32, 512)   # keys 64.. or 63..: block 1 freed or not
    assert not frees_blocks(40, 100, 32, 128)   # the sinks cover what the window leaves


def test_admission_adds_the_sink_blocks_to_vllms_sliding_window_bound():
    # vLLM: ceil(min(W - 1 + in flight, max_len) / block) + 1
    assert sliding_admission_blocks(40, 32, 64, 512) == 5
    assert admission_blocks(40, 4, 32, 64, 512) == 6
    assert admission_blocks(100, 4, 32, 64, 512) == 8
    assert admission_blocks(100, 0, 32, 64, 512) == 7
    assert admission_blocks(500, 4, 32, 64, 512) == 17    # the window's bound alone is above the full 16 blocks
    assert admission_blocks(400, 64, 32, 64, 512) == 16   # 15 + 1 for the window, 2 sink blocks: capped at 16


def test_concurrency_follows_the_blocks_per_request():
    page = 32 * 2 * 64 * 2 * 4  # 32 tokens, 2 KV heads of 64, keys and values, float32
    memory = 3 * 2**19
    assert max_concurrency(memory, page, [(2, 16)]) == 1.5             # one group of both layers, 16 blocks each
    assert max_concurrency(memory, page, [(1, 6), (1, 8)]) == 48 / 14  # a group per layer: twice the blocks


# ---- vLLM's block pool with the sink-keeping manager -----------------------------------------

MANAGER_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request
    from aah.vllm.kv_memory import SinkWindowManager, SinkWindowSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    BS, W, S, CHUNK, MAX_LEN = 8, 20, 10, 6, 200
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BS, sha256)
    pool = BlockPool(num_gpu_blocks=200, enable_caching=True, hash_block_size=BS)
    spec = SinkWindowSpec(block_size=BS, num_kv_heads=1, head_size=4, dtype=torch.float32, sliding_window=W,
                          sink_tokens=S)
    manager = SinkWindowManager(spec, block_pool=pool, enable_caching=True, kv_cache_group_id=0,
                                scheduler_block_size=BS,
                                max_admission_blocks_per_request=spec.max_admission_blocks_per_request(CHUNK, MAX_LEN))
    report = {"steps": [], "manager": KVCacheSpecRegistry.get_manager_class(spec).__name__,
              "admission": spec.max_admission_blocks_per_request(CHUNK, MAX_LEN)}

    def held(rid):
        return [i for i, b in enumerate(manager.req_to_blocks[rid]) if not b.is_null]

    tokens = list(range(1000, 1120))
    request = Request("a", tokens, SamplingParams(max_tokens=1), None, block_hasher=hasher)
    computed = 0
    while computed < len(tokens):  # chunked prefill, as the scheduler drives it
        n = min(CHUNK, len(tokens) - computed)
        manager.remove_skipped_blocks("a", computed)
        manager.allocate_new_blocks("a", computed + n, computed + n)
        report["steps"].append([computed, n, held("a"), len(manager.req_to_blocks["a"])])
        computed += n
        manager.cache_blocks(request, computed, replay_boundaries=())
    manager.free("a")
    longer = Request("b", tokens + list(range(5000, 5030)), SamplingParams(max_tokens=1), None, block_hasher=hasher)
    hit, length = SinkWindowManager.find_longest_cache_hit(longer.block_hashes, 149, [0], pool, spec, False, BS)
    report["hit"] = [length, [i for i, b in enumerate(hit[0]) if not b.is_null]]
    report["to_allocate"] = manager.get_num_blocks_to_allocate("b", 150, hit[0], length, length, 150)
    manager.add_local_computed_blocks("b", hit[0], length, 0)
    report["hit_held"] = held("b")
    manager.free("b")
    pool.get_new_blocks(pool.get_num_free_blocks())  # every free block taken: the cached ones are evicted
    report["evicted_hit"] = SinkWindowManager.find_longest_cache_hit(longer.block_hashes, 149, [0], pool, spec,
                                                                     False, BS)[1]
    json.dump(report, open(sys.argv[1], "w"))
""")


@pytest.fixture(scope="module")
def vllm_environment():
    reason = _vllm_unavailable()
    if reason:
        pytest.skip(reason)


def test_the_manager_frees_all_but_the_sinks_and_the_window_and_hits_need_the_sinks(vllm_environment, tmp_path):
    script = tmp_path / "manager.py"
    script.write_text(MANAGER_SCRIPT)
    done = subprocess.run([str(VLLM_PYTHON), str(script), str(tmp_path / "out.json")], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((tmp_path / "out.json").read_text())
    window, sinks, block = 20, 10, 8
    assert report["manager"] == "SinkWindowManager"
    assert report["admission"] == admission_blocks(window, sinks, block, 6, 200) == 7
    for computed, n, held, length in report["steps"]:
        freed = set(freed_blocks(computed, window, sinks, block))
        assert set(held) == set(range(length)) - freed, computed
        for position in range(computed, computed + n):  # what this chunk's queries read is held
            assert read_blocks(position, window, sinks, block) <= set(held)
    assert max(len(held) for _, _, held, _ in report["steps"]) <= report["admission"]
    # a prompt extending the first: its 120 cached tokens hit with the sink blocks and the last window
    assert report["hit"] == [120, [0, 1, 12, 13, 14]]
    assert report["hit_held"] == [0, 1, 12, 13, 14]
    assert report["to_allocate"] == 9  # 4 new blocks, and 2 sink and 3 window blocks taken from the free queue
    # without the sink blocks in the cache, nothing of it can be used
    assert report["evicted_hit"] == 0


# ---- engines ---------------------------------------------------------------------------------

BLOCK = 32
#: The KV cache of the engines compared for concurrency: the runner's 1 GiB.
KV_BYTES = 2**30
BATCH_TOKENS = 64
#: Blocks of the engine whose KV memory follows the windows in the exactness test: 40 blocks of one
#: layer's pages, so freed blocks are reused while its requests run (each reserves up to 6 + 8).
TIGHT_BLOCKS = 40


@pytest.fixture(scope="module")
def memory_runs(tmp_path_factory, byte_bpe, vllm_environment):
    """One vLLM subprocess, four engines (chunked prefill and prefix caching on): the windows with
    their KV memory in a small pool; the same windows with every layer's full memory
    (``disable_hybrid_kv_cache_manager``) in 1 GiB; vanilla vLLM and the windows with their KV
    memory in 1 GiB, one short prompt each; with its log."""
    root = tmp_path_factory.mktemp("vllm_memory")
    model_dir = _tiny_model(root, byte_bpe)
    windows = _windows_file(root / "w.safetensors", model_dir, TINY_WINDOWS, TINY_SINKS)
    first = _prompts([460, 37, 130, 2, 90, 200], seed=1)
    second = [first[0] + _prompts([40], 2)[0], first[5][:150] + _prompts([20], 3)[0]]  # prefix-cache hits
    engine_args = {"enforce_eager": True, "max_model_len": MAX_LEN, "block_size": BLOCK,
                   "enable_prefix_caching": True, "enable_chunked_prefill": True,
                   "max_num_batched_tokens": BATCH_TOKENS}
    rounds = [{"prompts": first, "max_tokens": 4, "prompt_logprobs": True}, {"prompts": second, "max_tokens": 6}]
    short = [{"prompts": [first[3]], "max_tokens": 1}]
    spec = {"model": str(model_dir), "in_process": True, "engines": [
        {"name": "memory", "windows": str(windows), "rounds": rounds,
         "engine_args": {**engine_args, "num_gpu_blocks_override": TIGHT_BLOCKS}},
        {"name": "full", "windows": str(windows), "engine_args": {**engine_args, "disable_hybrid_kv_cache_manager": True},
         "rounds": rounds},
        {"name": "vanilla", "windows": None, "engine_args": engine_args, "rounds": short},
        {"name": "memory_1gib", "windows": str(windows), "engine_args": engine_args, "rounds": short},
    ]}
    (root / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k not in ("AAH_WINDOWS", "VLLM_CPU_KVCACHE_SPACE")}
    done = subprocess.run(
        [str(VLLM_PYTHON), "-m", "aah.vllm.runner", str(root / "spec.json"), str(root / "out.json")],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return model_dir, json.loads((root / "out.json").read_text()), spec, done.stdout + done.stderr


@pytest.mark.slow
def test_windows_with_their_kv_memory_equal_the_full_memory_and_the_patched_hf_model(memory_runs):
    model_dir, out, spec, _ = memory_runs
    rounds = spec["engines"][0]["rounds"]
    for got, full, spec_round in zip(out["memory"]["rounds"], out["full"]["rounds"], rounds):
        for a, b in zip(got, full):
            assert a["tokens"] == b["tokens"]
            torch.testing.assert_close(torch.tensor(a["prompt_logprobs"]), torch.tensor(b["prompt_logprobs"]),
                                       atol=1e-4, rtol=0)
            torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), atol=1e-4, rtol=0)
        _check_requests(got, spec_round["prompts"], lambda seqs: _hf_logprobs(model_dir, TINY_WINDOWS, TINY_SINKS, seqs))


def _predicted_concurrency(memory_bytes, layer_windows, sinks) -> float:
    page = BLOCK * 2 * 64 * 2 * 4  # 2 KV heads of 64, keys and values, float32
    if layer_windows is None:
        return max_concurrency(memory_bytes, page, [(len(TINY_WINDOWS), -(-MAX_LEN // BLOCK))])
    groups = [(1, admission_blocks(w, sinks, BLOCK, BATCH_TOKENS, MAX_LEN)) for w in layer_windows]
    return max_concurrency(memory_bytes, page, groups)


@pytest.mark.slow
def test_the_windows_kv_memory_fits_more_requests_than_vanilla_vllm(memory_runs):
    *_, log = memory_runs
    reported = [float(x) for x in re.findall(r"Maximum concurrency for 512 tokens per request: ([0-9.]+)x", log)]
    reach = [max(row) for row in TINY_WINDOWS]  # layers' largest windows: 40 and 100, 4 sinks
    windowed = _predicted_concurrency(KV_BYTES, reach, TINY_SINKS)  # 32768 one-layer blocks / (6 + 8)
    full = _predicted_concurrency(KV_BYTES, None, 0)  # 16384 two-layer blocks / 16
    tight = TIGHT_BLOCKS / (admission_blocks(40, 4, BLOCK, BATCH_TOKENS, MAX_LEN)
                            + admission_blocks(100, 4, BLOCK, BATCH_TOKENS, MAX_LEN))
    assert (round(windowed, 2), round(full, 2), round(tight, 2)) == (2340.57, 1024.0, 2.86)
    # vLLM logs each distinct line once per process: the small pool; the full memory of the windows,
    # whose line vanilla vLLM's repeats; the windows' memory in the same 1 GiB
    assert reported == [round(tight, 2), round(full, 2), round(windowed, 2)], log[-3000:]
