"""The CUDA path's window mask against full causal attention, timed on one GPU (not run on one yet).

``python -m aah.vllm.gpu_bench --windows-file FILE --json OUT.json [--seq-lens 4096,16384]``
times, per sequence length ``T``, one prefill of ``T`` tokens through every layer of the windows
file (its windows scaled by ``T`` over the file's calibration length, its sinks, its model's query
heads, KV heads and head size; random bfloat16 queries, keys and values), with FlexAttention
compiled on CUDA, four ways:

* ``paged``: the plugin's CUDA path (:mod:`aah.vllm.cuda_backend`): the window mask over a paged
  cache of 16-slot pages in random order, blocks of 16 queries listing the pages vLLM's direct
  build would keep (pruned by each layer's largest window and its sinks), against vLLM's own
  causal mask over the same pages, unpruned;
* ``contiguous``: the project's ``flex`` backend (one key tensor, 128 x 128 tiles,
  :func:`aah.backends.flex.band_block_mask`) against the causal mask on the same tiles.

JSON keys: ``config`` (the file, its model, ``seq_lens``, ``dtype``, ``page_size``,
``query_block``, ``layers``, ``repeats``); ``device`` and ``torch``; ``results``, one entry per
``(seq_len, layout)`` with ``windows_ms`` and ``causal_ms`` (median over ``--repeats`` passes
through all layers), ``speedup`` (causal over windows) and ``causal_coverage`` (the windows' share
of the causal pairs); and per ``seq_len`` in ``checks`` the largest difference between the paged
and the contiguous windowed outputs of the first layer (``paged_vs_contiguous_max_abs``).

Without CUDA it stops with one line. The helpers that lay out a paged cache and its block mask
(:func:`paged_cache`, :func:`inverse_block_table`, :func:`paged_block_mask`) need no GPU and are
what the tests of the CUDA path use.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import statistics
import sys
from collections.abc import Callable, Sequence

import torch

from ..cli_flags import add_json, add_windows_file, write_json
from ..errors import CLIError
from ..windows import causal_coverage
from .cuda_backend import paged_flex_attention, paged_mask_mod, window_mask_mod, window_pages_hint

__all__ = ["cuda_problem", "inverse_block_table", "main", "paged_block_mask", "paged_cache", "require_cuda"]

#: Slots per page (vLLM's default block size on CUDA) and queries per block of the block mask.
PAGE_SIZE = 16
QUERY_BLOCK = 16


def paged_cache(keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor], page_size: int,
                generator: torch.Generator | None = None, spare_pages: int = 3,
                fill: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """Requests' keys and values (each ``(length, KV heads, D)``) written into pages in random order.

    Returns ``(kv_cache, block_table)``: ``kv_cache`` as vLLM's FlexAttention backend holds it,
    ``(pages, KV heads, page_size, 2 D)`` laid out as ``(pages, page_size, KV heads, 2 D)``;
    ``block_table`` ``(requests, most pages)`` int32, the physical page of each logical page
    (``0``, vLLM's null page, never holds a request's keys and pads the rows). Pages no request
    holds are filled with ``fill`` (NaN: a read of one shows in the output); the slots after a
    request's last key in its last page hold random numbers, as a page of a reused cache would.
    """
    device, kv_heads, dim = keys[0].device, keys[0].shape[1], keys[0].shape[2]
    counts = [math.ceil(len(k) / page_size) for k in keys]
    num_pages = 1 + sum(counts) + spare_pages
    order = torch.randperm(num_pages - 1, generator=generator) + 1
    cache = torch.full((num_pages, page_size, kv_heads, 2 * dim), fill, dtype=torch.float32)
    table = torch.zeros(len(keys), max(counts), dtype=torch.int32)
    used = 0
    for r, (k, v) in enumerate(zip(keys, values)):
        k, v = k.detach().float().cpu(), v.detach().float().cpu()
        for p in range(counts[r]):
            page = int(order[used])
            used += 1
            table[r, p] = page
            chunk = slice(p * page_size, (p + 1) * page_size)
            n = len(k[chunk])
            cache[page] = torch.randn(cache[page].shape, generator=generator)
            cache[page, :n, :, :dim] = k[chunk]
            cache[page, :n, :, dim:] = v[chunk]
    return cache.to(device, keys[0].dtype).transpose(1, 2), table.to(device)


def inverse_block_table(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int,
                        num_pages: int) -> torch.Tensor:
    """``(requests, num_pages)``: the logical page each physical page holds for each request,
    ``-1`` for none (vLLM's ``physical_to_logical``); the null page 0 holds none."""
    requests, width = block_table.shape
    logical = torch.arange(width, device=block_table.device)
    valid = logical[None, :] < (seq_lens[:, None] + page_size - 1) // page_size
    out = torch.full((requests, num_pages), -1, dtype=torch.long, device=block_table.device)
    out.scatter_reduce_(1, torch.where(valid, block_table.long(), 0), torch.where(valid, logical, -1).expand(requests, -1),
                        reduce="amax")
    out[:, 0] = -1
    return out


def paged_block_mask(block_table: torch.Tensor, query_start: torch.Tensor, computed: torch.Tensor,
                     seq_lens: torch.Tensor, page_size: int, num_pages: int, mask_mod: Callable, *,
                     query_block: int = QUERY_BLOCK, hint: Callable | None = None):
    """The ``BlockMask`` vLLM's direct build makes for a step: each block of ``query_block`` packed
    query rows lists the physical pages its rows' requests hold up to each row's position (and,
    with ``hint``, that the hint keeps); every listed page is partial, so ``mask_mod`` decides
    each slot. The step's rows: request ``r`` has rows ``query_start[r]:query_start[r + 1]`` at
    positions from ``computed[r]`` on, and ``seq_lens[r]`` keys."""
    from torch.nn.attention.flex_attention import BlockMask

    device = block_table.device
    rows = int(query_start[-1])
    request = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), query_start[1:] - query_start[:-1])
    position = torch.arange(rows, device=device) - query_start[request] + computed[request]
    logical = torch.arange(block_table.shape[1], device=device)[None, :]
    keep = (logical < ((seq_lens[request] + page_size - 1) // page_size)[:, None]) & (logical * page_size <= position[:, None])
    if hint is not None:
        keep &= hint((position // page_size)[:, None], logical, page_size)
    physical = block_table[request].long()
    keep &= physical != 0
    blocks = -(-rows // query_block)
    used = torch.zeros(blocks, num_pages, dtype=torch.bool, device=device)
    block_of_row = (torch.arange(rows, device=device) // query_block)[:, None].expand_as(physical)
    used[block_of_row[keep], physical[keep]] = True
    kv_num = used.sum(-1).to(torch.int32)
    kv_indices = torch.sort((~used).to(torch.int8), dim=-1, stable=True).indices.to(torch.int32)
    return BlockMask.from_kv_blocks(kv_num[None, None], kv_indices[None, None], BLOCK_SIZE=(query_block, page_size),
                                   mask_mod=mask_mod, seq_lengths=(rows, num_pages * page_size), compute_q_blocks=False)


def cuda_problem() -> str | None:
    """Why the benchmark (or any GPU check) cannot run here, in one line; ``None`` when it can."""
    if not torch.cuda.is_available():
        return f"needs a CUDA GPU: torch {torch.__version__} sees none here (torch.cuda.is_available() is False)"
    if importlib.util.find_spec("triton") is None:
        return "needs triton to compile FlexAttention for CUDA, and it is not installed"
    return None


def require_cuda() -> None:
    """:func:`cuda_problem` as a :class:`~aah.errors.CLIError`."""
    problem = cuda_problem()
    if problem is not None:
        raise CLIError(problem)


def _time_ms(run: Callable[[], object], repeats: int) -> float:
    """Median milliseconds of ``run`` over ``repeats`` timed calls, after one untimed call."""
    run()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _causal(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def _length(seq_len: int, grid: list[list[int]], sinks: int, shape: tuple[int, int, int], flex, repeats: int,
            device: torch.device | str = "cuda"):
    """The four timings of one length (see the module docstring) and the paged-vs-contiguous check."""
    from torch.nn.attention.flex_attention import create_block_mask

    from ..backends.flex import FLEX_BLOCK, band_block_mask

    heads, kv_heads, dim = shape
    device, scale = torch.device(device), 1.0 / math.sqrt(dim)
    g = torch.Generator(device=device).manual_seed(seq_len)
    q, k, v = (torch.randn(seq_len, n, dim, device=device, dtype=torch.bfloat16, generator=g)
               for n in (heads, kv_heads, kv_heads))
    cache, table = paged_cache([k], [v], PAGE_SIZE, torch.Generator().manual_seed(seq_len), fill=0.0)
    step = {"query_start": torch.tensor([0, seq_len], device=device), "computed": torch.zeros(1, dtype=torch.long,
            device=device), "seq_lens": torch.tensor([seq_len], device=device)}
    logical_page = inverse_block_table(table, step["seq_lens"], PAGE_SIZE, cache.shape[0])
    rows = torch.zeros(seq_len, dtype=torch.long, device=device)

    def paged_mask(mask, hint=None):
        on_pages = paged_mask_mod(mask, request_of_row=rows, logical_page=logical_page, page_size=PAGE_SIZE, **step)
        return paged_block_mask(table, step["query_start"], step["computed"], step["seq_lens"], PAGE_SIZE,
                                cache.shape[0], on_pages, hint=hint)

    paged_windows = [paged_mask(window_mask_mod(torch.tensor(row, device=device), sinks), window_pages_hint(max(row), sinks))
                     for row in grid]
    band_windows = [band_block_mask(tuple(row), seq_len, device, sink_tokens=sinks) for row in grid]
    paged_causal = paged_mask(_causal)
    band_causal = create_block_mask(_causal, None, None, seq_len, seq_len, device=device, BLOCK_SIZE=FLEX_BLOCK)
    options = {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": QUERY_BLOCK, "BLOCK_N": PAGE_SIZE}  # vLLM's direct build
    qc, kc, vc = (t.transpose(0, 1)[None] for t in (q, k, v))

    def paged(mask):
        return paged_flex_attention(q, cache, mask, scale, flex=flex, kernel_options=options)

    def contiguous(mask):
        return flex(qc, kc, vc, block_mask=mask, scale=scale, enable_gqa=heads != kv_heads)[0].transpose(0, 1)

    def through(attention, masks):
        for mask in masks:
            attention(mask)

    coverage = causal_coverage(torch.tensor(grid), seq_len, sink_tokens=sinks)
    results = []
    for layout, attention, windowed, full in (("paged", paged, paged_windows, paged_causal),
                                              ("contiguous", contiguous, band_windows, band_causal)):
        windows_ms = _time_ms(functools.partial(through, attention, windowed), repeats)
        causal_ms = _time_ms(functools.partial(through, attention, [full] * len(windowed)), repeats)
        results.append({"seq_len": seq_len, "layout": layout, "windows_ms": windows_ms, "causal_ms": causal_ms,
                        "speedup": causal_ms / windows_ms, "causal_coverage": coverage})
    diff = (paged(paged_windows[0]).float() - contiguous(band_windows[0]).float()).abs().max().item()
    return results, {"seq_len": seq_len, "paged_vs_contiguous_max_abs": diff}


def bench(windows_file: str, seq_lens: Sequence[int], repeats: int) -> dict:
    """The benchmark (see the module docstring); CUDA only."""
    from torch.nn.attention.flex_attention import flex_attention

    from ..hf.bridge.windows_file import load_windows

    require_cuda()
    windows, meta = load_windows(windows_file)
    model, sinks, calibrated = meta["model"], int(meta["sink_tokens"]), int(meta["seq_len"])
    shape = (int(model["num_query_heads"]), int(model["num_kv_heads"]), int(model["head_dim"]))
    # Two masks per layout, two kernel settings and each length compile FlexAttention anew: let
    # them, and never fall back to eager FlexAttention (a dense T x T score matrix per head).
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch._dynamo.config.fail_on_recompile_limit_hit = True
    flex = torch.compile(flex_attention, dynamic=False)
    results, checks = [], []
    for seq_len in seq_lens:
        grid = [[max(1, round(int(w) * seq_len / calibrated)) for w in row] for row in windows.tolist()]
        timed, check = _length(seq_len, grid, sinks, shape, flex, repeats)
        results += timed
        checks.append(check)
    config = {"windows_file": str(windows_file), "model": model, "calibrated_seq_len": calibrated,
              "sink_tokens": sinks, "seq_lens": list(seq_lens), "dtype": "bfloat16", "page_size": PAGE_SIZE,
              "query_block": QUERY_BLOCK, "layers": windows.shape[0], "repeats": repeats}
    return {"config": config, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "results": results, "checks": checks}


def _seq_lens(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of ints >= {PAGE_SIZE}, got {text!r}") from None
    if not values or min(values) < PAGE_SIZE:
        raise argparse.ArgumentTypeError(f"a comma list of ints >= {PAGE_SIZE}, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    """``python -m aah.vllm.gpu_bench --windows-file FILE --json OUT.json``; one line and exit
    status 2 without CUDA."""
    parser = argparse.ArgumentParser(prog="aah.vllm.gpu_bench", description=__doc__.splitlines()[0])
    add_windows_file(parser)
    add_json(parser)
    parser.add_argument("--seq-lens", type=_seq_lens, default=[4096, 16384], metavar="T1,T2,...",
                        help="prompt lengths (default 4096,16384)")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes through all layers (default 5)")
    try:
        args = parser.parse_args(argv)
        report = bench(args.windows_file, args.seq_lens, max(1, args.repeats))
    except CLIError as exc:
        print(f"aah.vllm.gpu_bench: {exc}", file=sys.stderr)
        return 2
    for row in report["results"]:
        print(f"T={row['seq_len']:>6} {row['layout']:>10}: windows {row['windows_ms']:9.2f} ms, causal "
              f"{row['causal_ms']:9.2f} ms, x{row['speedup']:.2f} (causal coverage {row['causal_coverage']:.3f})")
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
