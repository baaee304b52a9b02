"""The fast backends (banded, flex, flash) against the float64 reference, their coverage, the benchmark."""

from __future__ import annotations

import json
import math

import pytest
import torch

import aah
from aah.backends import BackendUnavailable, executed_coverage, get_backend
from aah.backends.banded import (
    _permute_heads,
    band_plan,
    banded_group_attention,
    block_size,
    planned_entries,
    restore_head_order,
)
from aah.backends.flex import FLEX_BLOCK, band_block_mask, band_tiles
from aah.bench.attention import bench_attention, format_table, mix_head_counts, mix_windows
from aah.cli import main
from aah.windows import causal_coverage, causal_pairs, visible

CUDA = torch.cuda.is_available()


def _qkv(b, h, h_kv, t, d, dtype=torch.float64, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    shapes = ((b, h, t, d), (b, h_kv, t, d), (b, h_kv, t, d))
    return tuple(
        torch.randn(s, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_(True)
        for s in shapes
    )


def _check(out, q, k, v, windows, ref_attention, atol, rtol, backward=True, sink_tokens=0):
    ref = ref_attention(q, k, v, windows, sink_tokens=sink_tokens)
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=rtol)
    if not backward:
        return
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v), g.to(out.device, out.dtype))
    ref_grads = torch.autograd.grad(ref, (q, k, v), g.to(ref.device))
    for a, b in zip(grads, ref_grads):  # d/dq, d/dk, d/dv
        torch.testing.assert_close(a.double(), b.double(), atol=atol, rtol=rtol)


# (batch, heads, kv heads, length, head dim, windows): MHA and GQA, odd lengths,
# window 1, W = T, W > T, mixes (uniform GQA groups and uneven ones), batch > 1.
CASES = [
    (2, 4, 4, 37, 8, [1, 5, 37, 50]),
    (1, 4, 4, 100, 16, [1, 1, 1, 1]),
    (2, 4, 4, 61, 8, [61, 61, 61, 61]),
    (1, 4, 4, 45, 8, [90, 200, 45, 46]),
    (1, 4, 2, 130, 16, [7, 7, 20, 130]),
    (2, 6, 2, 99, 8, [3, 3, 3, 3, 3, 3]),
    (1, 4, 2, 53, 8, [5, 9, 5, 9]),
    (1, 4, 2, 77, 8, [5, 5, 5, 9]),
    (2, 8, 1, 300, 8, [40, 40, 200, 17, 300, 1, 64, 129]),
]


@pytest.mark.parametrize("b, h, h_kv, t, d, windows", CASES)
def test_banded_float64_matches_reference(ref_attention, b, h, h_kv, t, d, windows):
    q, k, v = _qkv(b, h, h_kv, t, d)
    out = aah.attend(q, k, v, windows, backend="banded")
    _check(out, q, k, v, windows, ref_attention, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("b, h, h_kv, t, d, windows", CASES)
def test_banded_float32_matches_reference(ref_attention, b, h, h_kv, t, d, windows):
    q, k, v = _qkv(b, h, h_kv, t, d, dtype=torch.float32)
    out = aah.attend(q, k, v, windows, backend="banded")
    assert out.dtype == torch.float32
    _check(out, q, k, v, windows, ref_attention, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("block", [1, 3, 16, 32, 200])
@pytest.mark.parametrize("h_kv", [4, 2, 1])
def test_banded_any_block_size_is_exact(ref_attention, block, h_kv):
    # Edge blocks, interior chunks (odd chunk remainders) and stacked GQA heads.
    q, k, v = _qkv(2, 4, h_kv, 150, 8)
    out = banded_group_attention(q, k, v, 24, 1 / math.sqrt(8), block=block)
    _check(out, q, k, v, [24] * 4, ref_attention, atol=1e-10, rtol=1e-10)


def test_banded_custom_scale(ref_attention):
    q, k, v = _qkv(1, 2, 1, 40, 8)
    out = aah.attend(q, k, v, [6, 40], backend="banded", scale=0.3)
    torch.testing.assert_close(out, ref_attention(q, k, v, [6, 40], scale=0.3))


def test_banded_bfloat16_gradients_match_float64_reference(ref_attention):
    # bf16 has 8 bits of mantissa: outputs and gradients within a few bf16 ulps of float64.
    q, k, v = _qkv(2, 4, 2, 90, 16)
    windows = [6, 6, 33, 90]
    check_low_precision(q, k, v, windows, "banded", torch.bfloat16, ref_attention)


@pytest.mark.parametrize("order", [[2, 0, 3, 1], [3, 2, 1, 0], [1, 0, 2, 3]])
def test_head_permutation_and_its_gradient_match_indexing(order):
    # The grouped call reorders heads by window; its custom backward must be x[:, order]'s.
    x = torch.randn(2, 4, 5, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(2, 4, 5, 3, dtype=torch.float64)
    (_permute_heads(x, order) * weight).sum().backward()
    ours = x.grad.clone()
    x.grad = None
    (x[:, order] * weight).sum().backward()
    torch.testing.assert_close(ours, x.grad, rtol=0, atol=0)
    permuted = _permute_heads(x, order)
    torch.testing.assert_close(restore_head_order([permuted[:, :1], permuted[:, 1:]], order), x)
    assert torch.autograd.gradcheck(lambda t: _permute_heads(t, order), (x,))


def check_low_precision(q, k, v, windows, backend, dtype, ref_attention, tol=4e-2):
    """Output and d/dq, d/dk, d/dv in ``dtype`` against float64 on the same rounded inputs."""
    low = [x.detach().to(dtype).requires_grad_(True) for x in (q, k, v)]
    exact = [x.detach().double().requires_grad_(True) for x in low]
    out = aah.attend(*low, windows, backend=backend)
    ref = ref_attention(*exact, windows)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, low, g.to(dtype))
    ref_grads = torch.autograd.grad(ref, exact, g)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


# ---------------------------------------------------------------- banded coverage


@pytest.mark.parametrize("window, t", [(1, 37), (5, 37), (24, 150), (40, 300), (512, 4096), (99, 100)])
def test_block_plan_covers_the_band_and_counts_match_brute_force(window, t):
    block = block_size(window, t)
    computed = torch.zeros(t, t, dtype=torch.bool)
    entries = 0
    for chunk in band_plan(window, t, block):
        for e in range(chunk.count):
            qs = chunk.q_start + e * chunk.rows
            ks = chunk.k_start + e * chunk.k_step
            rect = computed[qs : qs + chunk.rows, ks : ks + chunk.keys]
            assert rect.shape == (chunk.rows, chunk.keys), "a rectangle leaves the sequence"
            assert not rect.any(), "rectangles overlap"
            rect[:] = True
            entries += chunk.rows * chunk.keys
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    band = (j <= i) & (j > i - window)
    assert bool(computed[band].all()), "a band entry is not computed"
    assert int(computed.sum()) == entries == planned_entries(window, t, block)
    expected = entries / (t * (t + 1) / 2)
    assert executed_coverage("banded", [window], t) == pytest.approx(expected)


def test_banded_coverage_approaches_causal_coverage_for_small_blocks():
    t, window = 1000, 100
    exact = causal_pairs(window, t)
    # Block 1 computes the band plus one entry per pair of edge rows.
    assert exact <= planned_entries(window, t, 1) < 1.001 * exact
    sizes = [1, 2, 8, 32, 128]
    counts = [planned_entries(window, t, s) for s in sizes]
    assert counts == sorted(counts)
    assert counts[2] / exact < 1.1


def test_banded_coverage_of_mixed_windows_and_full_heads():
    t = 4096
    windows = mix_windows("full_adaptive", 8, t)
    cov = executed_coverage("banded", windows, t)
    ideal = causal_coverage(windows, t)
    assert ideal < cov < 1.15 * ideal
    assert executed_coverage("banded", [t, 2 * t], t) == 1.0


def test_block_size_heuristic():
    assert block_size(512, 4096) == 64
    assert block_size(1024, 4096) == 64
    assert block_size(2048, 4096) == 128
    assert block_size(128, 4096) == 32
    assert block_size(4000, 4096) == 128
    assert block_size(1, 4096) == 16
    assert block_size(8, 5) == 8  # never beyond the next power of two >= T
    for w in (1, 3, 100, 700, 5000):
        b = block_size(w, 8192)
        assert b & (b - 1) == 0 and 16 <= b <= 128


# ---------------------------------------------------------------- flex


@pytest.mark.parametrize(
    "t, windows",
    [(300, [1, 5, 300, 64, 129, 128, 127, 400]), (256, [128, 1, 256, 3]), (1000, [200, 513, 7, 1000])],
)
def test_flex_block_mask_matches_create_block_mask_and_coverage(t, windows):
    from torch.nn.attention.flex_attention import create_block_mask

    ours = band_block_mask(tuple(windows), t, "cpu")
    w = torch.tensor(windows)
    built = create_block_mask(
        lambda b, h, q, kv: visible(q, kv, w[h]), None, len(windows), t, t, device="cpu"
    )
    assert torch.equal(ours.kv_num_blocks, built.kv_num_blocks)
    assert torch.equal(ours.full_kv_num_blocks, built.full_kv_num_blocks)
    assert torch.equal(ours.to_dense(), built.to_dense())
    for mine, theirs, nums in (
        (ours.kv_indices, built.kv_indices, built.kv_num_blocks),
        (ours.full_kv_indices, built.full_kv_indices, built.full_kv_num_blocks),
    ):
        for h in range(len(windows)):
            for row in range(nums.shape[-1]):
                n = int(nums[0, h, row])
                assert torch.equal(mine[0, h, row, :n], theirs[0, h, row, :n])
    # Executed coverage = computed tiles (partial + full) x clipped area, over the triangle.
    tiles = built.to_dense()[0].bool()  # (H, nq, nkv)
    sizes = torch.clamp(t - torch.arange(tiles.shape[-1]) * FLEX_BLOCK, max=FLEX_BLOCK)
    area = sizes[:, None] * sizes[None, :]
    pairs = int((tiles * area).sum())
    triangle = t * (t + 1) / 2
    assert executed_coverage("flex", windows, t) == pytest.approx(pairs / (len(windows) * triangle))
    n_tiles = int(built.kv_num_blocks.sum() + built.full_kv_num_blocks.sum())
    assert n_tiles == int(tiles.sum())


def test_flex_coverage_for_block_multiples_is_tile_count():
    t, windows = 1024, (128, 256, 1024, 1)
    partial_full = [band_tiles(w, t) for w in windows]
    tiles = sum(int((p | f).sum()) for p, f in partial_full)
    expected = tiles * FLEX_BLOCK**2 / (len(windows) * t * (t + 1) / 2)
    assert executed_coverage("flex", windows, t) == pytest.approx(expected)


@pytest.mark.slow
def test_flex_cpu_forward_matches_reference_and_refuses_backward(ref_attention):
    if get_backend("flex").unavailable_reason(torch.device("cpu")) is not None:
        pytest.skip(get_backend("flex").unavailable_reason(torch.device("cpu")))
    windows = [1, 5, 300, 64, 129, 128, 127, 400]
    q, k, v = _qkv(2, 8, 4, 300, 16, dtype=torch.float32)
    with torch.no_grad():
        out = aah.attend(q, k, v, windows, backend="flex")
        again = aah.attend(q, k, v, windows[::-1], backend="flex")  # new mask, same kernel
    _check(out, q, k, v, windows, ref_attention, atol=2e-5, rtol=1e-4, backward=False)
    _check(again, q, k, v, windows[::-1], ref_attention, atol=2e-5, rtol=1e-4, backward=False)
    assert not get_backend("flex").supports_backward(torch.device("cpu"))
    with pytest.raises(BackendUnavailable, match="no backward pass on cpu"):
        aah.attend(q, k, v, windows, backend="flex")


# ---------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("h_kv", [4, 2])
def test_flex_cuda_forward_and_backward(ref_attention, h_kv):
    windows = [1, 100, 300, 64]
    q, k, v = _qkv(2, 4, h_kv, 300, 32, dtype=torch.float32, device="cuda")
    out = aah.attend(q, k, v, windows, backend="flex")
    _check(out, q, k, v, windows, ref_attention, atol=2e-4, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_banded_cuda_forward_and_backward(ref_attention):
    windows = [1, 100, 300, 64]
    q, k, v = _qkv(2, 4, 2, 300, 32, dtype=torch.float32, device="cuda")
    out = aah.attend(q, k, v, windows, backend="banded")
    _check(out, q, k, v, windows, ref_attention, atol=2e-4, rtol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("h_kv", [4, 2])
def test_flash_cuda_forward_and_backward(ref_attention, h_kv):
    reason = get_backend("flash").unavailable_reason(torch.device("cuda"))
    if reason is not None:
        pytest.skip(reason)
    windows = [1, 100, 300, 64]
    q, k, v = _qkv(2, 4, h_kv, 300, 64, dtype=torch.bfloat16, device="cuda")
    out = aah.attend(q, k, v, windows, backend="flash")
    _check(out, q, k, v, windows, ref_attention, atol=3e-2, rtol=3e-2)
    with pytest.raises(BackendUnavailable, match="float16 or bfloat16"):
        aah.attend(*(x.float() for x in (q, k, v)), windows, backend="flash")


def test_flash_says_why_it_cannot_run_on_cpu():
    reason = get_backend("flash").unavailable_reason(torch.device("cpu"))
    assert reason is not None and "CUDA" in reason
    q, k, v = _qkv(1, 2, 2, 8, 8)
    with pytest.raises(BackendUnavailable, match="flash"):
        aah.attend(q, k, v, [2, 8], backend="flash")
    # Flash computes the band itself: count its (query, key) pairs by brute force.
    t, windows = 8, [2, 8]
    pairs = sum(1 for w in windows for i in range(t) for j in range(t) if i - w < j <= i)
    assert executed_coverage("flash", windows, t) == pytest.approx(pairs / (len(windows) * t * (t + 1) / 2))


def test_sdpa_coverage_is_the_counted_causal_triangle():
    # Causal SDPA computes keys j <= i for every query: count them by brute force.
    t, windows = 13, [13, 13, 20]
    pairs = sum(1 for _ in windows for i in range(t) for j in range(t) if j <= i)
    assert executed_coverage("sdpa", windows, t) == pytest.approx(pairs / (len(windows) * t * (t + 1) / 2))


# ---------------------------------------------------------------- the benchmark


@pytest.mark.parametrize(
    "mix, heads, counts",
    [
        ("full_adaptive", 8, (5, 1, 1, 1)),
        ("shallow_freeze", 8, (4, 2, 1, 1)),
        ("deep_practical_reuse", 8, (4, 2, 1, 1)),
        ("grouping_off", 8, (3, 1, 1, 3)),
        ("full_adaptive", 16, (10, 3, 2, 1)),
        ("full_adaptive", 1, (1, 0, 0, 0)),
    ],
)
def test_mix_rounding_is_largest_remainder(mix, heads, counts):
    assert mix_head_counts(mix, heads) == counts


def test_mix_counts_always_sum_to_heads_and_windows_follow():
    for mix in ("full_adaptive", "shallow_freeze", "deep_practical_reuse", "grouping_off"):
        for heads in range(1, 40):
            assert sum(mix_head_counts(mix, heads)) == heads
    assert mix_windows("full_adaptive", 8, 4096) == (512,) * 5 + (1024, 2048, 4096)
    with pytest.raises(ValueError, match="--mix must be one of"):
        mix_windows("nope", 8, 4096)


@pytest.mark.parametrize("backward", [False, True])
def test_bench_attention_reports_times_coverage_and_flops(backward):
    t, heads, d = 96, 4, 16
    result = bench_attention(
        seq_len=t, heads=heads, kv_heads=2, head_dim=d, batch=2, backends=["banded", "dense"],
        backward=backward, repeats=2, warmup=1, mix="full_adaptive", device="cpu",
    )
    json.dumps(result)
    rows = {r["backend"]: r for r in result["results"]}
    assert list(rows) == ["sdpa", "banded", "dense"]
    base, banded = rows["sdpa"], rows["banded"]
    assert base["ratio_to_sdpa"] == 1.0 and base["flops_ratio"] == 1.0
    products = 7 if backward else 2
    triangle = t * (t + 1) // 2
    # Causal SDPA counted as its triangle equals the ideal; as the square, about twice.
    assert base["counted_flops_causal"] == base["ideal_flops"] == 2 * d * products * triangle * heads * 2
    assert base["counted_flops"] == 2 * d * products * t * t * heads * 2
    # The banded count is exactly its executed coverage: the same block plan.
    assert banded["counted_flops_causal"] == pytest.approx(
        banded["executed_coverage"] * heads * 2 * triangle * 2 * d * products
    )
    assert banded["causal_coverage"] == pytest.approx(causal_coverage(banded["windows"], t))
    assert banded["flops_ratio"] < 1.0
    assert len(banded["times_ms"]) == 2 and banded["median_ms"] > 0
    q1, q2, q3 = banded["paired_ratio_quartiles"]
    assert 0 < q1 <= q2 <= q3
    assert "banded" in format_table(result)


def test_bench_attention_validation_names_the_option():
    with pytest.raises(ValueError, match="--windows needs 4 values"):
        bench_attention(seq_len=32, heads=4, windows=[8, 8], repeats=1, device="cpu")
    with pytest.raises(ValueError, match="--dtype must be one of float32, bfloat16, float16"):
        bench_attention(seq_len=32, heads=4, dtype="int8", repeats=1, device="cpu")
    with pytest.raises(ValueError, match="--backends: unknown backend 'nope'; choose from"):
        bench_attention(seq_len=32, heads=4, backends=["nope"], repeats=1, device="cpu")
    with pytest.raises(ValueError, match="--heads .* multiple of --kv-heads"):
        bench_attention(seq_len=32, heads=4, kv_heads=3, repeats=1, device="cpu")
    with pytest.raises(ValueError, match="--seq-len must be a positive integer"):
        bench_attention(seq_len=0, heads=4, repeats=1, device="cpu")
    with pytest.raises(ValueError, match="either --windows or --mix"):
        bench_attention(seq_len=32, heads=4, windows=[8] * 4, mix="full_adaptive", device="cpu")
    with pytest.raises(ValueError, match="--backends: backend 'flex' has no backward pass on cpu"):
        bench_attention(seq_len=32, heads=4, backends=["flex"], backward=True, device="cpu")


def test_bench_attention_cli(capsys):
    code = main(
        ["bench", "attention", "--seq-len", "64", "--heads", "4", "--head-dim", "8", "--repeats", "1",
         "--warmup", "0", "--backends", "banded", "--windows", "8,8,16,64", "--device", "cpu", "--json", "-"]
    )
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["backend"] for r in result["results"]] == ["sdpa", "banded"]
    assert result["config"]["windows"] == [8, 8, 16, 64]
    code = main(["bench", "attention", "--seq-len", "64", "--heads", "4", "--windows", "8,x", "--device", "cpu"])
    assert code == 2 and "--windows takes a comma-separated list of positive ints" in capsys.readouterr().err
    code = main(["bench", "attention", "--seq-len", "64", "--heads", "4", "--windows", "8,8", "--device", "cpu"])
    assert code == 2 and "--windows needs 4 values" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "attention", "--mix", "nope"])
    assert "invalid choice" in capsys.readouterr().err
