"""The compiled decode step (aah.decode.ring_decode) against a float64 reference built from ring positions."""

from __future__ import annotations

import pytest
import torch

from aah.decode import extension, ring_decode
from aah.windows import visible


def _rings(batch, capacities, dim, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = sum(capacities)
    keys = torch.randn(batch, slots, dim, generator=gen, dtype=torch.float64).to(dtype)
    values = torch.randn(batch, slots, dim, generator=gen, dtype=torch.float64).to(dtype)
    starts = [sum(capacities[:g]) for g in range(len(capacities))]
    return keys, values, starts


def _reference(q, keys, values, starts, capacities, windows, length, scale):
    """Query head h reads positions (length - n, length - 1] of its KV head's ring, n = min(W, length, C)."""
    b, h, d = q.shape
    group = h // len(capacities)
    out = torch.empty(b, h, d, dtype=torch.float64)
    for head in range(h):
        g = head // group
        cap = capacities[g]
        n = min(windows[head], length, cap)
        slots = [starts[g] + p % cap for p in range(length - n, length)]
        k, v = keys[:, slots].double(), values[:, slots].double()
        scores = torch.einsum("bd,bnd->bn", q[:, head].double(), k) * scale
        out[:, head] = torch.einsum("bn,bnd->bd", scores.softmax(-1), v)
    return out


@pytest.mark.parametrize("dim", [8, 32, 64, 128])  # 8: any head dim; 32, 64, 128: unrolled
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_the_reference(compiled, dim, dtype, tol):
    capacities = [4, 600, 37]  # 600 > one span of 256 entries: spans joined by their sums
    windows = [1, 4, 600, 300, 37, 20]  # two query heads per KV head, windows up to the capacity
    keys, values, starts = _rings(2, capacities, dim, dtype)
    q = torch.randn(2, 6, dim, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    for length in (1, 3, 37, 599, 600, 601, 1500):  # rings filling, just full, wrapped
        got = compiled.ring_decode(
            q, keys, values, torch.tensor(starts), torch.tensor(capacities), torch.tensor(windows),
            length, dim ** -0.5,
        )
        assert got.dtype == dtype and got.shape == q.shape
        want = _reference(q, keys, values, starts, capacities, windows, length, dim ** -0.5)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("sinks", [1, 4])
def test_sink_slots_are_read_by_the_window_rule(compiled, sinks):
    """Each KV head's sinks sit in the slots before its ring; the reference picks keys by
    :func:`aah.windows.visible` from a plain list of every position, not from ring ages."""
    dim, capacities, windows = 16, [6, 300], [1, 6, 300, 5]
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, dim, generator=gen, dtype=torch.float64)
    for length in (1, 3, 5, 7, 12, 299, 310, 700):
        history_k = torch.randn(2, 2, length, dim, generator=gen, dtype=torch.float64)  # every position
        history_v = torch.randn(2, 2, length, dim, generator=gen, dtype=torch.float64)
        keys = torch.zeros(2, 2 * sinks + sum(capacities), dim, dtype=torch.float64)
        values = torch.zeros_like(keys)
        starts = [sinks, 2 * sinks + capacities[0]]
        for g, cap in enumerate(capacities):
            for p in range(length):
                slots = ([starts[g] - sinks + p] if p < sinks else []) + ([starts[g] + p % cap] if p >= length - cap else [])
                for slot in slots:
                    keys[:, slot], values[:, slot] = history_k[:, g, p], history_v[:, g, p]
        lse = torch.empty(2, 4, dtype=torch.float32)
        got = compiled.ring_decode(q, keys, values, torch.tensor(starts), torch.tensor(capacities),
                                   torch.tensor(windows), length, 0.25, sinks=sinks, lse=lse)
        pos = torch.arange(length)
        for h, w in enumerate(windows):
            keep = visible(length - 1, pos, w, sinks)
            scores = torch.einsum("bd,bnd->bn", q[:, h], history_k[:, h // 2, keep]) * 0.25
            want = torch.einsum("bn,bnd->bd", scores.softmax(-1), history_v[:, h // 2, keep])
            torch.testing.assert_close(got[:, h], want, atol=1e-12, rtol=1e-12)
            torch.testing.assert_close(lse[:, h].double(), scores.logsumexp(-1), atol=1e-6, rtol=1e-6)


def test_large_scores_stay_finite_and_exact(compiled):
    keys, values, starts = _rings(1, [300], 16, torch.float32)
    q = torch.full((1, 1, 16), 30.0)
    got = compiled.ring_decode(q, keys, values, torch.tensor(starts), torch.tensor([300]),
                               torch.tensor([300]), 300, 1.0)
    want = _reference(q, keys, values, starts, [300], [300], 300, 1.0)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_bad_input_is_an_error(compiled):
    keys, values, starts = _rings(1, [8, 8], 4, torch.float32)
    q = torch.randn(1, 2, 4)
    args = (torch.tensor(starts), torch.tensor([8, 8]), torch.tensor([8, 8]))
    with pytest.raises(RuntimeError, match="share a dtype"):
        compiled.ring_decode(q.double(), keys, values, *args, 4, 0.5)
    with pytest.raises(RuntimeError, match="one window per query head"):
        compiled.ring_decode(q, keys, values, args[0], args[1], torch.tensor([8]), 4, 0.5)
    with pytest.raises(RuntimeError, match="length must be at least 1"):
        compiled.ring_decode(q, keys, values, *args, 0, 0.5)
    with pytest.raises(RuntimeError, match="sink slots before it"):  # no room for sinks before the first ring
        compiled.ring_decode(q, keys, values, *args, 4, 0.5, sinks=1)
    with pytest.raises(RuntimeError, match="lse must be a contiguous float32"):
        compiled.ring_decode(q, keys, values, *args, 4, 0.5, lse=torch.empty(1, 2, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="lse must be a contiguous float32"):
        compiled.ring_decode(q, keys, values, *args, 4, 0.5, lse=torch.empty(1, 3))


def test_turned_off_by_the_environment(monkeypatch):
    monkeypatch.setenv("AAH_RING_KERNEL", "0")
    assert ring_decode.load() is None
    assert ring_decode.unavailable_reason() == "turned off by AAH_RING_KERNEL=0"
    with pytest.raises(RuntimeError, match="not available"):
        ring_decode.ring_decode(*(torch.zeros(1),) * 6, 1, 1.0)


def test_the_build_folder_follows_the_sources_and_their_place(tmp_path, monkeypatch):
    here = extension._build_directory()
    assert here == extension._build_directory()  # stable
    copy = tmp_path / "csrc"
    copy.mkdir()
    for source in extension._CSRC.iterdir():
        if source.suffix in (".cpp", ".h"):
            (copy / source.name).write_bytes(source.read_bytes())
    monkeypatch.setattr(extension, "_CSRC", copy)
    elsewhere = extension._build_directory()
    assert elsewhere != here  # the same sources in another place: their own build
    (copy / "linear_rows.h").write_text((copy / "linear_rows.h").read_text() + "\n// changed\n")
    assert extension._build_directory() not in (here, elsewhere)  # a changed header: a new build
