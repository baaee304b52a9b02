"""aah.vllm's CUDA path (aah.vllm.cuda_backend), tested on CPU; the tests marked gpu run it on CUDA.

- The window mask (its ``mask_mod``) is the rule, and through torch's compiled FlexAttention it
  equals a float64 reference written here from the rule itself: query ``i`` of head ``h`` reads
  key ``j`` when ``j <= i`` and (``i - j < W_h`` or ``j < S``).
- Over vLLM's paged layout (random page order, mixed batches of prompts, chunks after cached keys
  and decode steps), the same mask gives what the unpaged one gives, with and without the pages
  the windows prune; pages no request holds are NaN and never read.
- With vLLM (its CPU build, in the vLLM environment; skipped with the reason without it): the
  registration on a cuda platform, the inverse block table against vLLM's, the start-up refusal
  of other attention backends, and the backend's own ``forward`` on a step's metadata built by
  vLLM's direct block-mask build, against the reference.
- gpu: the same attention on CUDA in float32 and bfloat16, and, where the vLLM environment is a
  CUDA build, vLLM serving the windows (skipped with the reason otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from aah.backends import get_backend
from aah.hf.bridge.windows_file import model_signature, save_windows
from aah.vllm.cuda_backend import (
    layer_block_mask,
    paged_flex_attention,
    paged_mask_mod,
    window_mask_mod,
    window_pages_hint,
)
from aah.vllm.gpu_bench import inverse_block_table, paged_block_mask, paged_cache
from aah.vllm.startup import StartupError, WindowsSource, attention_backend_setting, check_settings

CUDA = torch.cuda.is_available()
PAGE = 16  # vLLM's block size on CUDA; torch 2.13's compiled CPU FlexAttention is wrong below 16 keys a block


def reference(q, k, v, positions, windows, sinks, scale):
    """float64 attention of queries ``q`` (Tq, H, D) at ``positions`` over keys ``0..`` of ``k``, ``v``
    (Tk, H_kv, D), by the rule written out: ``j <= i`` and (``i - j < W_h`` or ``j < S``)."""
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().cpu().repeat_interleave(group, 1) for t in (k, v))
    i, j = positions[:, None].cpu(), torch.arange(k.shape[0])[None, :]
    allowed = (j <= i) & ((i - j < torch.tensor(windows)[:, None, None]) | (j < sinks))  # (H, Tq, Tk)
    scores = torch.einsum("thd,jhd->htj", q.double().cpu(), k) * scale
    return torch.einsum("htj,jhd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _rule(heads_windows, sinks, t):
    i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
    return (j <= i) & ((i - j < torch.tensor(heads_windows)[:, None, None]) | (j < sinks))


@pytest.fixture(scope="module")
def flex():
    """torch's FlexAttention compiled for this test module, never falling back to the eager one."""
    reason = get_backend("flex").unavailable_reason(torch.device("cpu"))
    if reason is not None:
        pytest.skip(reason)
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield torch.compile(flex_attention, dynamic=False)


#: (query heads, KV heads, T, windows, sinks): GQA and not, windows of 1, windows >= T, sinks 0.
SHAPES = [
    (4, 2, 70, (1, 5, 16, 300), 4),
    (4, 4, 64, (8, 8, 3, 64), 0),
    (6, 2, 100, (7, 1, 30, 100, 200, 2), 16),
    (2, 1, 33, (40, 33), 0),
    (2, 1, 33, (40, 2), 5),
]


@pytest.mark.parametrize("heads,kv_heads,t,windows,sinks", SHAPES)
def test_the_window_mask_is_the_rule(heads, kv_heads, t, windows, sinks):
    mask = create_mask(window_mask_mod(torch.tensor(windows), sinks), None, heads, t, t, device="cpu")[0]
    assert torch.equal(mask, _rule(windows, sinks, t))


@pytest.mark.parametrize("heads,kv_heads,t,windows,sinks", SHAPES)
def test_the_window_mask_through_flex_attention_equals_the_float64_reference(flex, heads, kv_heads, t, windows,
                                                                              sinks):
    g = torch.Generator().manual_seed(t + heads)
    q, k, v = (torch.randn(t, n, 16, generator=g) for n in (heads, kv_heads, kv_heads))
    mask = create_block_mask(window_mask_mod(torch.tensor(windows), sinks), None, heads, t, t, device="cpu")
    with torch.no_grad():
        out = flex(*(x.transpose(0, 1)[None] for x in (q, k, v)), block_mask=mask, scale=0.25,
                   enable_gqa=heads != kv_heads)[0].transpose(0, 1)
    want = reference(q, k, v, torch.arange(t), windows, sinks, 0.25)
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=0)
    if min(windows) < t:  # and the windows matter: plain causal attention differs
        assert (reference(q, k, v, torch.arange(t), [t] * heads, 0, 0.25) - want).abs().max() > 1e-3


def test_the_pages_hint_keeps_every_page_a_query_reads():
    for page in (4, 16):
        q, k = torch.arange(130)[:, None], torch.arange(130)[None, :]
        for window in (1, 5, 16, 17, 40):
            for sinks in (0, 3, 16, 20):
                hint = window_pages_hint(window, sinks)(q // page, k // page, page)
                for w in {1, window // 2 + 1, window}:  # any head's window up to the largest
                    read = (k <= q) & ((q - k < w) | (k < sinks))
                    assert not (read & ~hint).any(), (page, window, sinks, w)
    assert not window_pages_hint(5, 0)(torch.tensor(7), torch.tensor(0), 16)  # page 0, far behind: dropped
    assert window_pages_hint(5, 3)(torch.tensor(7), torch.tensor(0), 16)  # unless it holds a sink


def test_the_inverse_block_table_maps_each_page_to_its_latest_logical_page():
    table = torch.tensor([[3, 5, 3, 9], [7, 0, 2, 4]], dtype=torch.int32)  # request 0 holds page 3 twice
    inverse = inverse_block_table(table, torch.tensor([40, 20]), 16, 10)  # 3 and 2 pages in use
    want = torch.full((2, 10), -1)
    want[0, 3], want[0, 5] = 2, 1  # page 9 lies past request 0's length
    want[1, 7] = 0  # page 0 is vLLM's null page
    assert torch.equal(inverse, want)


def test_a_layers_block_mask_keeps_the_steps_pages_and_takes_its_mask():
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    step = paged_block_mask(torch.tensor([[1, 2]], dtype=torch.int32), torch.tensor([0, 20]), torch.tensor([0]),
                            torch.tensor([20]), PAGE, 3, causal)
    mask = window_mask_mod(torch.tensor([4]), 0)
    layer = layer_block_mask(step, mask)
    assert layer.mask_mod is mask and layer.kv_indices is step.kv_indices and layer.kv_num_blocks is step.kv_num_blocks
    with pytest.raises(ValueError, match="full blocks"):  # full blocks would skip the layer's mask
        layer_block_mask(create_block_mask(causal, None, None, 256, 256, device="cpu"), mask)


#: (tokens already cached, new tokens) per request: prompts, chunks after cached keys, decode steps.
BATCHES = [
    [(0, 37), (50, 1), (0, 1), (90, 40), (13, 1)],
    [(120, 1), (7, 1), (300, 1), (40, 30)],
]


def _step(batch, heads, kv_heads, dim=16, seed=0, device="cpu", dtype=torch.float32):
    """A step of ``batch`` over a paged cache: queries, the requests' keys and values, the cache
    (pages in random order, spare pages NaN), and what vLLM's metadata holds."""
    g = torch.Generator().manual_seed(seed)
    lens = [c + n for c, n in batch]
    keys = [torch.randn(n, kv_heads, dim, generator=g) for n in lens]
    values = [torch.randn(n, kv_heads, dim, generator=g) for n in lens]
    queries = [torch.randn(n, heads, dim, generator=g) for _, n in batch]
    cache, table = paged_cache([k.to(device, dtype) for k in keys], [v.to(device, dtype) for v in values], PAGE, g)
    starts = torch.tensor([0] + [n for _, n in batch]).cumsum(0)
    meta = {"query_start": starts.to(device), "computed": torch.tensor([c for c, _ in batch], device=device),
            "seq_lens": torch.tensor(lens, device=device)}
    rows = torch.repeat_interleave(torch.arange(len(batch)), starts[1:] - starts[:-1]).to(device)
    logical = inverse_block_table(table, meta["seq_lens"], PAGE, cache.shape[0])
    return SimpleNamespace(keys=keys, values=values, queries=queries, query=torch.cat(queries).to(device, dtype),
                           cache=cache, table=table, meta=meta, rows=rows, logical=logical, starts=starts)


def _paged_out(step, windows, sinks, flex, hint=None, kernel_options=None):
    mask = paged_mask_mod(window_mask_mod(torch.tensor(windows, device=step.query.device), sinks),
                          request_of_row=step.rows, logical_page=step.logical, page_size=PAGE, **step.meta)
    block_mask = paged_block_mask(step.table, step.meta["query_start"], step.meta["computed"], step.meta["seq_lens"],
                                  PAGE, step.cache.shape[0], mask, hint=hint)
    with torch.no_grad():
        out = paged_flex_attention(step.query, step.cache, block_mask, 0.25, flex=flex, kernel_options=kernel_options)
    return out, int(block_mask.kv_num_blocks.sum())


@pytest.mark.parametrize("batch", range(len(BATCHES)))
@pytest.mark.parametrize("windows,sinks", [
    ((16, 3, 5, 64), 4),     # per-head windows within GQA groups, sinks
    ((9, 33, 2, 500), 0),    # no sinks, one window over every length
])
def test_the_paged_mask_gives_the_unpaged_attention(flex, batch, windows, sinks):
    step = _step(BATCHES[batch], heads=4, kv_heads=2, seed=batch)
    every_page, listed = _paged_out(step, windows, sinks, flex)
    pruned, kept = _paged_out(step, windows, sinks, flex, hint=window_pages_hint(max(windows), sinks))
    assert torch.isfinite(every_page).all() and torch.isfinite(pruned).all()  # no NaN page was read
    for r, (c, n) in enumerate(BATCHES[batch]):
        rows = slice(int(step.starts[r]), int(step.starts[r + 1]))
        positions = torch.arange(c, c + n)
        want = reference(step.queries[r], step.keys[r], step.values[r], positions, windows, sinks, 0.25)
        torch.testing.assert_close(every_page[rows].double(), want, atol=2e-5, rtol=0)
        torch.testing.assert_close(pruned[rows].double(), want, atol=2e-5, rtol=0)
        # the unpaged attention: the same logical mask on the request's own keys, positions from c
        logical = window_mask_mod(torch.tensor(windows), sinks)
        unpaged_mask = create_block_mask(lambda b, h, q, k, logical=logical, c=c: logical(b, h, q + c, k), None, None,
                                         n, c + n, device="cpu", _compile=False)
        with torch.no_grad():
            unpaged = flex_attention(*(x.transpose(0, 1)[None] for x in (step.queries[r], step.keys[r], step.values[r])),
                                     block_mask=unpaged_mask, scale=0.25, enable_gqa=True)[0].transpose(0, 1)
        torch.testing.assert_close(every_page[rows], unpaged, atol=2e-5, rtol=0)
    if batch == 1 and max(windows) < 100:  # long contexts, short windows: pages are left out
        assert kept < listed


def test_a_non_flex_gpu_backend_is_refused_in_one_line(tmp_path):
    source = WindowsSource(tmp_path / "w.safetensors", "$AAH_WINDOWS")
    check_settings(source, platform="cuda", kv_cache_dtype="auto", attention_backend="FLEX_ATTENTION")  # served
    for backend, shown in ((None, "left to vLLM (--attention-backend not given)"), ("FLASH_ATTN", "FLASH_ATTN")):
        with pytest.raises(StartupError) as refused:
            check_settings(source, platform="cuda", kv_cache_dtype="auto", attention_backend=backend)
        assert str(refused.value) == (
            f"aah.vllm: windows file {source.path} (named by $AAH_WINDOWS) cannot be served on vLLM's cuda platform: "
            "AAH windows run on vLLM's CPU platform only through CPU_ATTN, and on cuda only through FLEX_ATTENTION; "
            f"the attention backend here is {shown}: pass --attention-backend FLEX_ATTENTION "
            '(attention_backend="FLEX_ATTENTION" in vllm.LLM)')
    with pytest.raises(StartupError, match="cannot be served on vLLM's rocm platform: AAH windows run on vLLM's CPU "
                                           "platform only; unset AAH_WINDOWS"):
        check_settings(source, platform="rocm", kv_cache_dtype="auto", attention_backend="FLEX_ATTENTION")


def test_the_attention_backend_setting_names_what_decoder_layers_run():
    def enum(name):
        return SimpleNamespace(name=name)

    assert attention_backend_setting(SimpleNamespace(backend=None, backend_per_kind={})) is None
    assert attention_backend_setting(SimpleNamespace(backend=enum("FLEX_ATTENTION"), backend_per_kind={
        "mla_attention": enum("TRITON_MLA")})) == "FLEX_ATTENTION"  # not a decoder kind the windows run in
    assert attention_backend_setting(SimpleNamespace(backend=enum("FLEX_ATTENTION"), backend_per_kind={
        "sliding_window": enum("TRITON_ATTN")})) == "TRITON_ATTN (attention_config.backend_per_kind['sliding_window'])"


# ---- with vLLM (its CPU build, in the vLLM environment) ---------------------------------------

#: Run in the vLLM environment: ARGS (JSON) names the windows file, the model config and the
#: batches; it writes what it saw to ARGS["out"].
VLLM_SIDE = r'''
import json, os, sys
from pathlib import Path
from types import SimpleNamespace

import torch


def reference(q, k, v, positions, windows, sinks, scale):
    group = q.shape[1] // k.shape[1]
    k, v = (t.double().repeat_interleave(group, 1) for t in (k, v))
    i, j = positions[:, None], torch.arange(k.shape[0])[None, :]
    allowed = (j <= i) & ((i - j < torch.tensor(windows)[:, None, None]) | (j < sinks))
    scores = torch.einsum("thd,jhd->htj", q.double(), k) * scale
    return torch.einsum("htj,jhd->thd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def registry():
    import aah.vllm as plugin
    from vllm.v1.attention.backends import flex_attention as vf
    from vllm.v1.attention.backends.registry import AttentionBackendEnum as E

    out = {}
    for platform, cuda in (("cpu", False), ("cuda", True)):
        plugin.on_cuda = lambda cuda=cuda: cuda
        plugin.register()
        out[platform] = {"CPU_ATTN": E.CPU_ATTN.get_path(), "FLEX_ATTENTION": E.FLEX_ATTENTION.get_path()}
    cls = E.FLEX_ATTENTION.get_class()
    out["class"] = f"{cls.__module__}.{cls.__qualname__}"
    out["name"] = cls.get_name()
    out["subclasses"] = [issubclass(cls, vf.FlexAttentionBackend), issubclass(cls.get_impl_cls(), vf.FlexAttentionImpl),
                         issubclass(cls.get_builder_cls(), vf.FlexAttentionMetadataBuilder)]
    return out


def inverse_table():
    from vllm.v1.attention.backends.flex_attention import physical_to_logical_mapping
    from aah.vllm.gpu_bench import inverse_block_table

    g = torch.Generator().manual_seed(0)
    table = torch.randint(0, 12, (5, 7), generator=g, dtype=torch.int32)
    table[2, 1] = table[2, 4]  # a page held twice
    seq_lens = torch.tensor([1, 50, 100, 16, 17], dtype=torch.int32)
    return torch.equal(inverse_block_table(table, seq_lens, 16, 12), physical_to_logical_mapping(table, seq_lens, 16, 12))


def startup(windows_file, config):
    import vllm.platforms
    from vllm.config import AttentionConfig
    from aah.vllm.startup import StartupError, check_engine_config

    class Cuda:
        device_name = "cuda"

        def is_cpu(self):
            return False

    vllm.platforms._current_platform = Cuda()
    os.environ["AAH_WINDOWS"] = windows_file
    out = {}
    for backend in (None, "FLASH_ATTN", "FLEX_ATTENTION"):
        model = SimpleNamespace(model="hub-model", hf_config=SimpleNamespace(**config), hf_overrides=None)
        vllm_config = SimpleNamespace(model_config=model, cache_config=SimpleNamespace(cache_dtype="auto"),
                                      speculative_config=None, attention_config=AttentionConfig(backend=backend))
        try:
            out[str(backend)] = {"served": str(check_engine_config(vllm_config).path)}
        except StartupError as exc:
            out[str(backend)] = {"refused": str(exc)}
    return out


def forward(batches, page):
    from torch.nn.attention.flex_attention import flex_attention
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends import flex_attention as vf
    from aah.vllm import cuda_backend
    from aah.vllm.backend import ServedWindows
    from aah.vllm.gpu_bench import paged_cache

    # torch 2.13's CPU FlexAttention template fails to build with the dynamic shapes vLLM's compiled
    # flex_attention takes on its second shape; one static compilation per shape here.
    vf.flex_attention_compiled = torch.compile(flex_attention, dynamic=False)
    heads, kv_heads, dim, scale, sinks = 4, 2, 16, 0.25, 4
    windows = torch.tensor([[1000] * heads, [16, 3, 5, 64]])
    cuda_backend.model_kv_heads_and_rank = lambda: (kv_heads, 1, 0)  # the model's KV heads, one rank
    out = {"refusals": {}, "steps": []}
    for served in (ServedWindows(Path("w.safetensors"), windows, sinks), None):
        cuda_backend.served_windows = lambda served=served: served
        if served is not None:
            for name, extra in (("encoder", {"attn_type": AttentionType.ENCODER_ONLY}),
                                ("sinks", {"sinks": torch.zeros(heads)})):
                try:
                    cuda_backend.AAHFlexAttentionImpl(heads, dim, scale, kv_heads, None, None, "auto", **extra)
                    out["refusals"][name] = None
                except ValueError as exc:
                    out["refusals"][name] = str(exc)
        impl = cuda_backend.AAHFlexAttentionImpl(heads, dim, scale, kv_heads, None, None, "auto")
        layer = SimpleNamespace(layer_name="model.layers.1.self_attn.attn")
        windowed = served is not None
        if windowed:
            out["plan"] = list(impl.prepare(layer, "cpu").windows)
        for number, batch in enumerate(batches):
            g = torch.Generator().manual_seed(number)
            lens = [c + n for c, n in batch]
            keys = [torch.randn(n, kv_heads, dim, generator=g) for n in lens]
            values = [torch.randn(n, kv_heads, dim, generator=g) for n in lens]
            queries = [torch.randn(n, heads, dim, generator=g) for _, n in batch]
            cache, table = paged_cache(keys, values, page, g)
            # the block table's columns past each request's pages hold stale page ids, as vLLM's may
            table = torch.cat([table, torch.randint(1, cache.shape[0], (len(batch), 2), generator=g, dtype=torch.int32)], 1)
            starts = torch.tensor([0] + [n for _, n in batch]).cumsum(0).to(torch.int32)
            seq_lens = torch.tensor(lens, dtype=torch.int32)
            rows, groups = int(starts[-1]), -(-int(starts[-1]) // 16)
            metadata = vf.FlexAttentionMetadata(
                causal=True, num_actual_tokens=rows, max_query_len=max(n for _, n in batch), query_start_loc=starts,
                query_start_loc_cpu=starts, max_seq_len=max(lens), seq_lens=seq_lens, block_table=table,
                slot_mapping=torch.zeros(rows, dtype=torch.long), total_cache_tokens=cache.shape[0] * page,
                block_size=page, max_possible_sequence_length=512, num_reqs=len(batch),
                physical_to_logical=vf.physical_to_logical_mapping(table, seq_lens, page, cache.shape[0]),
                decode_offset=torch.tensor([c for c, _ in batch], dtype=torch.int32),
                num_blocks_per_seq=(seq_lens + page - 1) // page,
                persistent_kv_indices=torch.empty(groups, 16 * table.shape[1], dtype=torch.int32),
                persistent_kv_num_blocks=torch.empty(groups, dtype=torch.int32),
                persistent_doc_ids=torch.empty(rows, dtype=torch.int32), q_block_size=16, kv_block_size=page,
            )
            metadata.block_mask = metadata._build_block_mask_direct()  # as vLLM's builder does
            causal_pages = int(metadata.block_mask.kv_num_blocks.sum())
            if windowed:  # as the plugin's builder does, for a group whose largest window is 64
                cuda_backend.window_metadata(metadata, vf.BlockSparsityHint(cuda_backend.window_pages_hint(64, sinks)))
            query = torch.cat(queries)
            output = torch.full_like(query, float("nan"))
            impl.forward(layer, query, None, None, cache, metadata, output)
            plan = impl.plan.windows if windowed else [10**6] * heads
            errors = []
            for r, (c, n) in enumerate(batch):
                want = reference(queries[r], keys[r], values[r], torch.arange(c, c + n), plan, sinks if windowed else 0, scale)
                errors.append((output[int(starts[r]):int(starts[r + 1])].double() - want).abs().max().item())
            out["steps"].append({"windows": windowed, "errors": errors, "causal_pages": causal_pages,
                                 "pages": int(metadata.block_mask.kv_num_blocks.sum())})
    return out


if __name__ == "__main__":
    args = json.loads(Path(sys.argv[1]).read_text())
    result = {"registry": registry(), "inverse_table_equal": inverse_table(),
              "startup": startup(args["windows_file"], args["config"]), "forward": forward(args["batches"], args["page"])}
    Path(args["out"]).write_text(json.dumps(result))
'''

#: A Llama-shaped configuration: 2 layers, 4 query heads on 2 KV heads.
CONFIG = {"model_type": "llama", "vocab_size": 50, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "hidden_size": 64}


@pytest.fixture(scope="module")
def vllm_side(tmp_path_factory):
    """What the vLLM environment's process saw (see VLLM_SIDE); skipped, with the reason, without it."""
    from .test_plugin import VLLM_PYTHON, _vllm_unavailable

    reason = _vllm_unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("cuda_path")
    meta = {"model": model_signature(SimpleNamespace(**CONFIG)), "seq_len": 64, "policy": "uniform", "budget": 0.5,
            "sink_tokens": 4, "acr": 0.5, "causal_coverage": 0.5}
    windows = save_windows(root / "w.safetensors", torch.full((2, 4), 8), meta)
    (root / "side.py").write_text(VLLM_SIDE)
    (root / "args.json").write_text(json.dumps({"windows_file": str(windows), "config": CONFIG, "batches": BATCHES,
                                                "page": PAGE, "out": str(root / "out.json")}))
    env = {k: v for k, v in os.environ.items() if k != "AAH_WINDOWS"}
    done = subprocess.run([str(VLLM_PYTHON), str(root / "side.py"), str(root / "args.json")], capture_output=True,
                          text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads((root / "out.json").read_text()), windows


def test_register_puts_the_cuda_backend_in_place_of_flex_attention_on_cuda_only(vllm_side):
    registry = vllm_side[0]["registry"]
    assert registry["cpu"] == {"CPU_ATTN": "aah.vllm.backend.AAHCPUAttentionBackend",
                               "FLEX_ATTENTION": "vllm.v1.attention.backends.flex_attention.FlexAttentionBackend"}
    assert registry["cuda"] == {"CPU_ATTN": "aah.vllm.backend.AAHCPUAttentionBackend",
                                "FLEX_ATTENTION": "aah.vllm.cuda_backend.AAHFlexAttentionBackend"}
    assert registry["class"] == "aah.vllm.cuda_backend.AAHFlexAttentionBackend"
    assert registry["name"] == "FLEX_ATTENTION" and registry["subclasses"] == [True, True, True]


def test_the_inverse_block_table_is_vllms(vllm_side):
    assert vllm_side[0]["inverse_table_equal"] is True


def test_the_engine_check_on_cuda_refuses_backends_other_than_flex_attention(vllm_side):
    startup, windows = vllm_side
    line = (f"aah.vllm: windows file {windows} (named by $AAH_WINDOWS) cannot be served on vLLM's cuda platform: AAH "
            "windows run on vLLM's CPU platform only through CPU_ATTN, and on cuda only through FLEX_ATTENTION; the "
            "attention backend here is {}: pass --attention-backend FLEX_ATTENTION "
            '(attention_backend="FLEX_ATTENTION" in vllm.LLM)')
    assert startup["startup"] == {
        "None": {"refused": line.format("left to vLLM (--attention-backend not given)")},
        "FLASH_ATTN": {"refused": line.format("FLASH_ATTN")},
        "FLEX_ATTENTION": {"served": str(windows)},
    }


def test_the_backends_forward_on_vllms_step_metadata_equals_the_float64_reference(vllm_side):
    side = vllm_side[0]["forward"]
    assert side["plan"] == [16, 3, 5, 64]  # layer 1 of the windows
    assert side["refusals"]["encoder"].endswith("cannot run with attention type: AttentionType.ENCODER_ONLY "
                                                "(only decoder attention)")
    assert side["refusals"]["sinks"].endswith("cannot run with learned attention sinks: set")
    windowed = [s for s in side["steps"] if s["windows"]]
    vanilla = [s for s in side["steps"] if not s["windows"]]  # vLLM's own FlexAttention, on the same steps
    assert len(windowed) == len(vanilla) == len(BATCHES)
    for step in windowed + vanilla:
        assert max(step["errors"]) < 2e-5, step
    assert windowed[1]["pages"] < windowed[1]["causal_pages"]  # the windows' pages hint left pages out
    assert all(s["pages"] == s["causal_pages"] for s in vanilla)


# ---- on CUDA ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cuda_flex():
    from aah.vllm.gpu_bench import cuda_problem

    problem = cuda_problem()
    if problem is not None:
        pytest.skip(problem)
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield torch.compile(flex_attention, dynamic=False)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("batch", range(len(BATCHES)))
def test_the_paged_window_attention_on_cuda_equals_the_float64_reference(cuda_flex, dtype, atol, batch):
    windows, sinks = (16, 3, 5, 64), 4
    step = _step(BATCHES[batch], heads=4, kv_heads=2, dim=64, seed=batch, device="cuda", dtype=dtype)
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": PAGE}  # vLLM's, direct build
    out, _ = _paged_out(step, windows, sinks, cuda_flex, hint=window_pages_hint(max(windows), sinks),
                        kernel_options=options)
    assert out.dtype == dtype and torch.isfinite(out).all()
    for r, (c, n) in enumerate(BATCHES[batch]):
        rows = slice(int(step.starts[r]), int(step.starts[r + 1]))
        q, k, v = (x.to(dtype) for x in (step.queries[r], step.keys[r], step.values[r]))  # what the GPU saw
        want = reference(q, k, v, torch.arange(c, c + n), windows, sinks, 0.25)
        torch.testing.assert_close(out[rows].double().cpu(), want, atol=atol, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_a_long_prompt_with_real_windows_on_cuda_equals_the_float64_reference(cuda_flex):
    windows, sinks = (256, 256, 2048, 256, 512, 256, 256, 2048), 64  # a calibrated layer's mix, scaled to 2048
    step = _step([(0, 2048)], heads=8, kv_heads=2, dim=64, seed=7, device="cuda", dtype=torch.bfloat16)
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 16, "BLOCK_N": PAGE}
    out, _ = _paged_out(step, windows, sinks, cuda_flex, hint=window_pages_hint(max(windows), sinks),
                        kernel_options=options)
    q, k, v = (x.to(torch.bfloat16) for x in (step.queries[0], step.keys[0], step.values[0]))
    want = reference(q, k, v, torch.arange(2048), windows, sinks, 0.25)
    torch.testing.assert_close(out.double().cpu(), want, atol=3e-2, rtol=0)


def _vllm_cuda_unavailable() -> str | None:
    from .test_plugin import VLLM_PYTHON, _vllm_unavailable

    reason = _vllm_unavailable()
    if reason:
        return reason
    probe = "from vllm.platforms import current_platform as p; assert p.is_cuda(), f'its platform is {p.device_name}'"
    done = subprocess.run([str(VLLM_PYTHON), "-c", probe], capture_output=True, text=True, timeout=120)
    if done.returncode:
        return (f"the vLLM environment at {VLLM_PYTHON} is not vLLM's CUDA build: "
                f"{(done.stderr.strip().splitlines() or ['?'])[-1]}")
    return None


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_vllm_on_cuda_with_flex_attention_serves_the_windows_as_the_patched_hf_model(tiny_setup_cuda, tmp_path):
    from .test_plugin import (
        MAX_LEN,
        TINY_SINKS,
        TINY_WINDOWS,
        VLLM_PYTHON,
        _check_requests,
        _hf_logprobs,
        _prompts,
    )

    model_dir, windows = tiny_setup_cuda
    prompts = _prompts([460, 37, 130, 2, 90, 200], seed=1)
    base = {"max_model_len": MAX_LEN, "attention_backend": "FLEX_ATTENTION", "enable_prefix_caching": True,
            "enable_chunked_prefill": True, "max_num_batched_tokens": 64}
    logprob_round = {"prompts": prompts, "max_tokens": 4, "prompt_logprobs": True}
    spec = {"model": str(model_dir), "in_process": True, "engines": [
        {"name": "eager", "windows": str(windows), "engine_args": {**base, "enforce_eager": True},
         "rounds": [logprob_round]},
        {"name": "graphs", "windows": str(windows), "engine_args": base, "rounds": [logprob_round]},
    ]}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != "AAH_WINDOWS"}
    done = subprocess.run([str(VLLM_PYTHON), "-m", "aah.vllm.runner", str(tmp_path / "spec.json"),
                           str(tmp_path / "out.json")], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads((tmp_path / "out.json").read_text())
    for engine in ("eager", "graphs"):
        _check_requests(out[engine]["rounds"][0], prompts,
                        lambda seqs: _hf_logprobs(model_dir, TINY_WINDOWS, TINY_SINKS, seqs))
    # without --attention-backend FLEX_ATTENTION the run stops with the one line
    spec["engines"] = [{"name": "auto", "windows": str(windows),
                        "engine_args": {"max_model_len": MAX_LEN, "enforce_eager": True}, "rounds": [logprob_round]}]
    (tmp_path / "auto.json").write_text(json.dumps(spec))
    done = subprocess.run([str(VLLM_PYTHON), "-m", "aah.vllm.runner", str(tmp_path / "auto.json"),
                           str(tmp_path / "auto_out.json")], capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].endswith(
        'pass --attention-backend FLEX_ATTENTION (attention_backend="FLEX_ATTENTION" in vllm.LLM)')


@pytest.fixture(scope="module")
def tiny_setup_cuda(tmp_path_factory, byte_bpe):
    """The tiny Llama of test_plugin and its windows file, where the vLLM environment is a CUDA build."""
    from .test_plugin import TINY_SINKS, TINY_WINDOWS, _tiny_model, _windows_file

    reason = _vllm_cuda_unavailable()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("vllm_cuda")
    model_dir = _tiny_model(root, byte_bpe)
    return model_dir, _windows_file(root / "w.safetensors", model_dir, TINY_WINDOWS, TINY_SINKS)


def test_the_gpu_benchmark_stops_in_one_line_without_cuda(capsys):
    if CUDA:
        pytest.skip("CUDA is here: the benchmark runs (make gpu-check)")
    from aah.vllm.gpu_bench import main

    windows = Path(__file__).resolve().parents[2] / "docs/results/hf/verdicts/201/k030_8192.safetensors"
    assert main(["--windows-file", str(windows)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("aah.vllm.gpu_bench: needs a CUDA GPU: torch ")
