"""Kept keys in the compiled decode step (aah.decode.ring_decode with KeptSlots, aah.decode.rings.pack_kept).

The reference is one float64 softmax per (row, query head) over the keys :func:`aah.windows.visible`
allows (its window and the sinks before it), taken from a plain list of every position's key,
and every valid kept key of its KV head (:mod:`aah.hf.bridge.kept_keys`).
"""

from __future__ import annotations

import copy

import pytest
import torch

from aah.attention import RotaryEmbedding
from aah.decode.rings import KeptSlots, RingStore, pack_kept
from aah.windows import visible

F64 = torch.float64


def _history(batch, kv_heads, length, dim, dtype, gen):
    """Keys and values (B, H_kv, length, D) of every position, rounded to ``dtype`` (kept in float64)."""
    return tuple(torch.randn(batch, kv_heads, length, dim, generator=gen, dtype=F64).to(dtype).double() for _ in "kv")


def _lay_out(hist_k, hist_v, capacities, sinks, dtype):
    """Flat (B, S, D) buffers holding the history as the ring store lays it out: per KV head its
    sink slots (positions 0..sinks-1), then its ring (position p in slot p % C); and ring_start."""
    batch, kv_heads, length, dim = hist_k.shape
    starts, offset = [], 0
    for cap in capacities:
        starts.append(offset + sinks)
        offset += sinks + cap
    keys, values = torch.zeros(batch, offset, dim, dtype=F64), torch.zeros(batch, offset, dim, dtype=F64)
    for g, cap in enumerate(capacities):
        ring = torch.arange(max(0, length - cap), length)
        sink = torch.arange(min(sinks, length))
        for buffer, hist in ((keys, hist_k), (values, hist_v)):
            buffer[:, starts[g] + ring % cap] = hist[:, g, ring]
            buffer[:, starts[g] - sinks + sink] = hist[:, g, sink]
    return keys.to(dtype), values.to(dtype), torch.tensor(starts)


def _kept_per_head(batch, counts, dim, dtype, gen):
    """Per KV head: kept keys, values (B, K_g, D) and valid (B, K_g); rows hold different numbers
    of keys with holes (row 0 holds none), so some spans of 256 entries hold no valid entry."""
    kept = []
    for count in counts:
        k, v = (torch.randn(batch, count, dim, generator=gen, dtype=F64).to(dtype).double() for _ in "kv")
        limit = torch.randint(0, count + 1, (batch, 1), generator=gen)
        limit[0] = 0
        if batch > 1:
            limit[1] = count
        ok = (torch.arange(count) < limit) & (torch.rand(batch, count, generator=gen) > 0.3)
        kept.append((k, v, ok))
    return kept


def _reference(q, hist_k, hist_v, windows, sinks, kept, scale):
    """float64 attention at position length - 1 (q (B, H, D)) and its log-sum-exp (B, H)."""
    batch, heads, dim = q.shape
    kv_heads, length = hist_k.shape[1], hist_k.shape[2]
    group = heads // kv_heads
    out, lse = torch.empty(batch, heads, dim, dtype=F64), torch.empty(batch, heads, dtype=F64)
    pos = torch.arange(length)
    for h, w in enumerate(windows):
        g = h // group
        kk, kv, ok = kept[g]
        keys = torch.cat([hist_k[:, g], kk], dim=1)
        values = torch.cat([hist_v[:, g], kv], dim=1)
        allowed = torch.cat([visible(length - 1, pos, w, sinks).expand(batch, -1), ok], dim=1)
        scores = torch.einsum("bd,bnd->bn", q[:, h].double(), keys) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[:, h] = torch.einsum("bn,bnd->bd", scores.softmax(-1), values)
        lse[:, h] = scores.logsumexp(-1)
    return out, lse


def _slots(kept, dtype, order, gap=0):
    """KeptSlots of per-head ``kept`` laid out in the KV head ``order`` given, ``gap`` unread slots
    (valid, huge values) between heads: the kernel must read each head's run alone."""
    batch, dim = kept[0][0].shape[0], kept[0][0].shape[-1]
    start, count = [0] * len(kept), [0] * len(kept)
    parts, offset = [], 0
    junk = (torch.full((batch, gap, dim), 1e3, dtype=F64),) * 2 + (torch.ones(batch, gap, dtype=torch.bool),)
    for g in order:
        start[g], count[g] = offset, kept[g][0].shape[1]
        parts += [kept[g], junk]
        offset += count[g] + gap
    k, v, ok = (torch.cat([p[i] for p in parts], dim=1) for i in range(3))
    return KeptSlots(k.to(dtype).contiguous(), v.to(dtype).contiguous(), ok.contiguous(), torch.tensor(start),
                     torch.tensor(count))


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("dim", [8, 64])  # 8: any head dim; 64: unrolled
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_kept_keys_join_the_windows_softmax(compiled, batch, sinks, dim, dtype, tol):
    capacities = [5, 300, 64]  # 300: a window over more than one span of 256 entries
    windows = [1, 5, 5, 300, 100, 7, 64, 64, 2]  # three query heads per KV head
    counts = [40, 0, 300]  # KV head 1 keeps no key; KV head 2 keeps more than one span
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(batch, 9, dim, generator=gen, dtype=F64).to(dtype)
    kept = _kept_per_head(batch, counts, dim, dtype, gen)
    slots = _slots(kept, dtype, order=[2, 1, 0], gap=3)
    for length in (1, 4, 6, 64, 70, 299, 301, 700):  # windows longer and shorter than length
        hist_k, hist_v = _history(batch, 3, length, dim, dtype, gen)
        keys, values, starts = _lay_out(hist_k, hist_v, capacities, sinks, dtype)
        lse = torch.empty(batch, 9, dtype=torch.float32)
        got = compiled.ring_decode(q, keys, values, starts, torch.tensor(capacities), torch.tensor(windows), length,
                                   dim ** -0.5, sinks=sinks, lse=lse, kept=slots)
        assert got.dtype == dtype and got.shape == q.shape
        want, want_lse = _reference(q, hist_k, hist_v, windows, sinks, kept, dim ** -0.5)
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
        torch.testing.assert_close(lse.double(), want_lse, atol=max(tol, 1e-5), rtol=max(tol, 1e-5))


@pytest.mark.parametrize("dim", [8, 64])
def test_no_valid_kept_key_is_the_step_without_kept_keys(compiled, dim):
    """Kept keys of which no row holds one, empty runs or empty buffers: bit for bit the plain step."""
    capacities, windows, sinks = [5, 300], [5, 1, 300, 40], 2
    gen = torch.Generator().manual_seed(1)
    hist_k, hist_v = _history(8, 2, 500, dim, torch.float32, gen)
    keys, values, starts = _lay_out(hist_k, hist_v, capacities, sinks, torch.float32)
    q = torch.randn(8, 4, dim, generator=gen)
    args = (q, keys, values, starts, torch.tensor(capacities), torch.tensor(windows), 500, 0.3)
    plain_lse = torch.empty(8, 4)
    plain = compiled.ring_decode(*args, sinks=sinks, lse=plain_lse)
    kept = [(torch.randn(8, 300, dim, dtype=F64),) * 2 + (torch.zeros(8, 300, dtype=torch.bool),)] * 2
    none_valid = _slots(kept, torch.float32, order=[0, 1])
    empty_runs = none_valid._replace(count=torch.zeros(2, dtype=torch.long))
    empty = KeptSlots(torch.empty(8, 0, dim), torch.empty(8, 0, dim), torch.empty(8, 0, dtype=torch.bool),
                      torch.zeros(2, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    for slots in (none_valid, empty_runs, empty):
        lse = torch.empty(8, 4)
        got = compiled.ring_decode(*args, sinks=sinks, lse=lse, kept=slots)
        assert torch.equal(got, plain) and torch.equal(lse, plain_lse)


def test_kept_scores_far_above_or_below_the_window_stay_finite_and_exact(compiled):
    gen = torch.Generator().manual_seed(2)
    hist_k, hist_v = _history(2, 1, 400, 16, torch.float32, gen)
    keys, values, starts = _lay_out(hist_k, hist_v, [300], 0, torch.float32)
    q = torch.full((2, 2, 16), 3.0)
    for shift in (40.0, -40.0):  # scores some 1e3 apart: one side's weights underflow to 0
        kept = [(hist_k[:, 0, :10] + shift, hist_v[:, 0, :10], torch.ones(2, 10, dtype=torch.bool))]
        got = compiled.ring_decode(q, keys, values, starts, torch.tensor([300]), torch.tensor([300, 20]), 400, 1.0,
                                   kept=_slots(kept, torch.float32, order=[0]))
        want, _ = _reference(q, hist_k, hist_v, [300, 20], 0, kept, 1.0)
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def test_bad_kept_keys_are_an_error(compiled):
    keys, values = torch.zeros(2, 16, 4), torch.zeros(2, 16, 4)
    q = torch.zeros(2, 2, 4)
    args = (q, keys, values, torch.tensor([0, 8]), torch.tensor([8, 8]), torch.tensor([8, 8]), 3, 0.5)
    good = KeptSlots(torch.zeros(2, 6, 4), torch.zeros(2, 6, 4), torch.ones(2, 6, dtype=torch.bool),
                     torch.tensor([0, 3]), torch.tensor([3, 3]))
    compiled.ring_decode(*args, kept=good)
    compiled.ring_decode(*args, kept=good._replace(valid=good.valid.to(torch.uint8)))
    bad = {
        "kept_keys and kept_values must be": good._replace(values=torch.zeros(2, 5, 4)),
        "with the rings' B and D": good._replace(keys=torch.zeros(2, 6, 3), values=torch.zeros(2, 6, 3)),
        "must have the rings' dtype": good._replace(keys=good.keys.double(), values=good.values.double()),
        "kept_valid must be a bool or uint8": good._replace(valid=torch.ones(2, 6)),
        "kept_valid must be a bool or uint8 .B, K.": good._replace(valid=torch.ones(2, 5, dtype=torch.bool)),
        "one per KV head": good._replace(start=torch.tensor([0, 3, 6])),
        "must be int64": good._replace(count=good.count.int()),
        "must lie within kept_keys' K slots": good._replace(count=torch.tensor([3, 4])),
        "contiguous CPU tensors": good._replace(keys=torch.zeros(2, 4, 6).transpose(1, 2)),
    }
    for message, slots in bad.items():
        with pytest.raises(RuntimeError, match=message):
            compiled.ring_decode(*args, kept=slots)
    module = compiled.load()
    with pytest.raises(RuntimeError, match="come together"):
        module.ring_decode(*args[:6], 3, 0, 0.5, None, good.keys, None, None, None, None)


# ---------------------------------------------------------------------- the ring store and pack_kept
WINDOWS = (4, 4, 2, 300, 20, 2, 64, 1, 64)  # KV capacities 4, 300, 64: three ring groups


def _filled_store(batch, sinks, length, dim, gen):
    """A float32 RingStore of three ring groups holding positions 0..length-1, and that history."""
    store = RingStore(WINDOWS, 3, sinks=sinks)
    store.allocate(batch, dim, dim, torch.float32, torch.device("cpu"))
    hist_k, hist_v = _history(batch, 3, length, dim, torch.float32, gen)
    store.write(hist_k.float(), hist_v.float(), 0)
    return store, hist_k, hist_v


def _kept_groups(store, batch, dim, gen, sizes):
    """Per ring group (store order) the kept keys as KeptStore.readable gives them: (B, n, K, D)
    keys and values and a (B, n, K) flag; ``sizes`` the K of each group. Also per KV head (B, K, D)
    keys, values and (B, K) flags for the reference."""
    readable, per_head = [], [None] * 3
    for g, size in zip(store.groups, sizes):
        heads = _kept_per_head(batch, [size] * len(g.kv_heads), dim, torch.float32, gen)
        readable.append(tuple(torch.stack([h[i] for h in heads], dim=1) for i in range(3)))
        for kv, h in zip(g.kv_heads, heads):
            per_head[kv] = h
    readable = [(k.float(), v.float(), ok) for k, v, ok in readable]
    return readable, per_head


def test_pack_kept_lays_out_each_kv_head_up_to_its_last_held_key():
    store = RingStore(WINDOWS, 3)
    assert [g.kv_heads for g in store.groups] == [[0], [2], [1]]  # groups in order of capacity
    valid = [torch.zeros(2, 1, 5, dtype=torch.bool), torch.zeros(2, 1, 0, dtype=torch.bool),
             torch.zeros(2, 1, 6, dtype=torch.bool)]
    valid[0][1, 0, 3] = True  # KV head 0: its last key any row holds is entry 3
    valid[2][0, 0, [0, 5]] = True  # KV head 1: entries 0 and 5
    readable = [(torch.randn(*ok.shape, 4, dtype=F64), torch.randn(*ok.shape, 4, dtype=F64), ok) for ok in valid]
    slots = pack_kept(readable, store.groups, torch.float32)
    assert slots.start.tolist() == [0, 4, 0] and slots.count.tolist() == [4, 6, 0]
    assert slots.keys.dtype == torch.float32 and slots.keys.shape == (2, 10, 4) and slots.valid.shape == (2, 10)
    torch.testing.assert_close(slots.keys[:, 4:], readable[2][0][:, 0].float())
    assert slots.valid[:, :4].tolist() == valid[0][:, 0, :4].tolist()
    none = pack_kept([(k, v, ok & False) for k, v, ok in readable], store.groups)
    assert none.keys.shape == (2, 0, 4) and none.count.tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match="per ring group"):
        pack_kept(readable[:2], store.groups)
    with pytest.raises(ValueError, match=r"must be \(B, 1, K, D\)"):
        pack_kept(readable[:2] + [(readable[2][0], readable[2][1], readable[2][2][..., :2])], store.groups)


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("sinks", [0, 2])
def test_ring_store_decode_reads_packed_kept_keys(compiled, batch, sinks):
    """RingStore.decode with pack_kept's slots (and with the groups, packed per call) equals the
    dense reference and the masked route (RingStore.attend) with the same kept keys."""
    dim, scale = 32, 0.2
    gen = torch.Generator().manual_seed(3)
    for length in (3, 40, 320):
        store, hist_k, hist_v = _filled_store(batch, sinks, length - 1, dim, gen)
        readable, per_head = _kept_groups(store, batch, dim, gen, sizes=[30, 0, 270])
        slots = pack_kept(readable, store.groups, store.dtype)
        q = torch.randn(batch, 9, dim, generator=gen)
        new_k, new_v = _history(batch, 3, 1, dim, torch.float32, gen)
        masked = store.attend(q[:, :, None], new_k.float(), new_v.float(), length - 1, scale=scale, kept=readable)
        store.write(new_k.float(), new_v.float(), length - 1)
        got = store.decode(q, length, scale, slots)
        assert torch.equal(store.decode(q, length, scale, readable), got)
        want, _ = _reference(q, torch.cat([hist_k, new_k], 2), torch.cat([hist_v, new_v], 2), WINDOWS, sinks,
                             per_head, scale)
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got, masked[:, :, 0], atol=1e-5, rtol=1e-5)


def test_attend_and_store_takes_the_compiled_route_with_kept_slots(compiled, monkeypatch):
    dim, scale, batch = 16, 0.25, 2
    gen = torch.Generator().manual_seed(4)
    store, _, _ = _filled_store(batch, 1, 50, dim, gen)
    readable, _ = _kept_groups(store, batch, dim, gen, sizes=[7, 3, 0])
    slots = pack_kept(readable, store.groups, store.dtype)
    q = torch.randn(batch, 9, 1, dim, generator=gen)
    new_k, new_v = (t.float() for t in _history(batch, 3, 1, dim, torch.float32, gen))
    want = store.attend(q, new_k, new_v, 50, scale=scale, kept=readable)
    calls = []
    kernel = compiled.ring_decode
    monkeypatch.setattr(compiled, "ring_decode", lambda *a, **k: calls.append(k["kept"]) or kernel(*a, **k))
    with torch.no_grad():
        got = store.attend_and_store(q, new_k, new_v, 50, prefill=None, scale=scale, kept=readable, kept_slots=slots)
    assert store.route == "compiled attention" and len(calls) == 1 and calls[0] is slots
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- the whole-block step
def _llama_layer(d_model, heads, kv_heads, dim, hidden, gen):
    """The modules of a Llama-style layer (RMSNorm, q/k/v projections, SwiGLU with a gate), seeded."""
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    layer = torch.nn.ModuleDict(dict(
        norm1=torch.nn.RMSNorm(d_model, eps=1e-6), qkv=torch.nn.Linear(d_model, heads * dim),
        key=torch.nn.Linear(d_model, kv_heads * dim), value=torch.nn.Linear(d_model, kv_heads * dim),
        out=torch.nn.Linear(heads * dim, d_model, bias=False), norm2=torch.nn.RMSNorm(d_model, eps=1e-6),
        gate=torch.nn.Linear(d_model, hidden, bias=False), up=torch.nn.Linear(d_model, hidden, bias=False),
        down=torch.nn.Linear(hidden, d_model, bias=False),
    ))
    with torch.no_grad():
        for name in ("norm1", "norm2"):
            layer[name].weight.uniform_(0.5, 1.5)
    return layer


def _block_reference(layer, x, rope, position, hist_k, hist_v, windows, sinks, per_head, scale):
    """The layer in float64 PyTorch: x + out(attention(...)), then + down(silu(gate) * up); the
    attention the dense reference over the history, the new position and the kept keys. Also
    returns the new key (rotated) and value (B, H_kv, 1, D)."""
    m = copy.deepcopy(layer).double()
    batch, dim, kv_heads = x.shape[0], hist_k.shape[-1], hist_k.shape[1]
    y = x.double()
    h = m["norm1"](y)
    q = rope(m["qkv"](h).view(batch, -1, 1, dim), position)[:, :, 0]
    k = rope(m["key"](h).view(batch, kv_heads, 1, dim), position)
    v = m["value"](h).view(batch, kv_heads, 1, dim)
    attn, _ = _reference(q, torch.cat([hist_k, k], 2), torch.cat([hist_v, v], 2), windows, sinks, per_head, scale)
    y = y + m["out"](attn.reshape(batch, -1))
    h = m["norm2"](y)
    y = y + m["down"](torch.nn.functional.silu(m["gate"](h)) * m["up"](h))
    return y, k, v


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("sinks", [0, 2])
def test_block_step_reads_kept_keys(compiled, batch, sinks):
    from aah.decode.ring_decode import Block

    dim, d_model, hidden, scale = 16, 48, 40, 0.25
    gen = torch.Generator().manual_seed(5)
    layer = _llama_layer(d_model, 9, 3, dim, hidden, gen)
    block = Block.of(torch.float32, "rmsnorm", (1e-6, 1e-6), "swiglu", **layer)
    rope = RotaryEmbedding(dim, 512)
    cos, sin = rope.tables()
    for position in (5, 70, 310):
        store, hist_k, hist_v = _filled_store(batch, sinks, position, dim, gen)
        readable, per_head = _kept_groups(store, batch, dim, gen, sizes=[12, 0, 260])
        slots = pack_kept(readable, store.groups, store.dtype)
        x = torch.randn(batch, d_model, generator=gen)
        want, new_k, new_v = _block_reference(layer, x, rope, position, hist_k, hist_v, WINDOWS, sinks, per_head, scale)
        with torch.no_grad():
            got = store.decode_block(x, block, cos, sin, position, scale, kept=slots)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)
        for kv in range(3):  # the new key and value went into their rings
            ring_k, ring_v, held = store.held(kv)
            assert held[-1] == position
            torch.testing.assert_close(ring_k[:, -1].double(), new_k[:, kv, 0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ring_v[:, -1].double(), new_v[:, kv, 0], atol=1e-5, rtol=1e-5)


def test_block_step_without_valid_kept_keys_is_the_plain_step(compiled):
    from aah.decode.ring_decode import Block

    gen = torch.Generator().manual_seed(6)
    layer = _llama_layer(48, 9, 3, 16, 40, gen)
    block = Block.of(torch.float32, "rmsnorm", (1e-6, 1e-6), "swiglu", **layer)
    cos, sin = RotaryEmbedding(16, 512).tables()
    x = torch.randn(8, 48, generator=gen)
    outs = []
    for kept in (False, True):
        store, _, _ = _filled_store(8, 2, 100, 16, torch.Generator().manual_seed(7))
        readable, _ = _kept_groups(store, 8, 16, gen, sizes=[12, 5, 20])
        slots = pack_kept([(k, v, ok & False) for k, v, ok in readable], store.groups) if kept else None
        with torch.no_grad():
            outs.append(store.decode_block(x, block, cos, sin, 100, 0.25, kept=slots))
    assert torch.equal(outs[0], outs[1])
