"""The retrieval repair pass (aah.hf.calibration.repair) and calibrate's retrieval_reserve."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from aah.hf.calibration import repair as retrieval_repair  # noqa: E402
from aah.hf.calibration.answer_loss import RetrievalSequence, measure_answer_loss  # noqa: E402
from aah.hf.calibration.policies import budgeted_windows, calibrate  # noqa: E402
from aah.hf.calibration.repair import RepairRound, joint_answer_gain, repair_windows  # noqa: E402
from aah.windows import causal_coverage, causal_pairs  # noqa: E402

VOCAB = 64


def _llama(layers: int = 2, heads: int = 4, kv_heads: int = 2) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=512,
        attn_implementation="sdpa", eos_token_id=None, bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _sequences(count: int = 2, length: int = 120) -> list[RetrievalSequence]:
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(count):
        ids = torch.randint(0, VOCAB, (length,), generator=g).tolist()
        out.append(RetrievalSequence(tuple(ids[:-12]), tuple(ids[-12:-4]), tuple(ids[-4:])))
    return out


def _reference_nll(masked_logits, model, seq: RetrievalSequence, context_windows, answer_windows,
                   sinks: int) -> float:
    """Answer NLL per answer token of a float64 forward without cache: rows before the answer
    positions see ``context_windows`` (L, H), the answer positions ``answer_windows``."""
    ids = torch.tensor([seq.context + seq.question + seq.answer])
    read = ids.shape[1] - len(seq.answer) - 1

    def allowed(layer, heads, t):
        i, j = torch.arange(t)[:, None], torch.arange(t)[None, :]
        keep = torch.empty(heads, t, t, dtype=torch.bool)
        for h in range(heads):
            for rows, table in ((slice(0, read), context_windows), (slice(read, t), answer_windows)):
                w = int(table[layer][h])
                keep[h, rows] = ((j <= i) & ((i - j < w) | (j < sinks)))[rows]
        return keep

    logits = masked_logits(model, ids, allowed)[0, read:-1]
    nll = torch.nn.functional.cross_entropy(logits, ids[0, read + 1:], reduction="sum")
    return float(nll) / len(seq.answer)


def test_joint_gain_equals_reference_forwards_with_every_layer_windowed(masked_logits):
    model = _llama().double()
    seqs = _sequences(2)
    windows = torch.tensor([[8, 8, 24, 24], [16, 16, 8, 8]])
    widen = [(0, [0, 1]), (0, [2, 3]), (1, [0, 1]), (1, [2, 3]), (1, [2])]
    gain, nll = joint_answer_gain(model, seqs, windows, widen, 120, sink_tokens=2, chunk=2)
    want_nll = sum(_reference_nll(masked_logits, model, s, windows, windows, 2) * len(s.answer) for s in seqs)
    want_gain = torch.zeros(len(widen), dtype=torch.float64)
    for v, (layer, heads) in enumerate(widen):
        wider = windows.clone()
        wider[layer, heads] = 120
        for s in seqs:
            want_gain[v] += (_reference_nll(masked_logits, model, s, windows, windows, 2)
                             - _reference_nll(masked_logits, model, s, windows, wider, 2)) * len(s.answer)
    answer_tokens = sum(len(s.answer) for s in seqs)
    assert nll == pytest.approx(want_nll / answer_tokens, rel=1e-6)
    torch.testing.assert_close(gain, want_gain / answer_tokens, rtol=1e-5, atol=1e-9)
    assert float(gain.abs().max()) > 1e-4  # the widenings change the answer


def _fake_gains(monkeypatch, rounds_of_gains, nlls):
    """Replace the measurement: round r returns ``rounds_of_gains[r][(layer, first head)]``."""
    calls = []

    def fake(model, sequences, windows, widen, widen_to, *, sink_tokens, progress=False):
        r = len(calls)
        calls.append([(layer, heads[0]) for layer, heads in widen])
        gains = torch.tensor([rounds_of_gains[r].get((layer, heads[0]), 0.0) for layer, heads in widen],
                             dtype=torch.float64)
        return gains, nlls[r]

    monkeypatch.setattr(retrieval_repair, "joint_answer_gain", fake)
    return calls


T = 64
CANDS = (8, 16, 32, 64)
ITEMS = [[0, 1], [2, 3]]


def _pairs(w: int) -> int:
    return causal_pairs(w, T, sink_tokens=0)


def _repair(windows, budget, rounds=3, full_nll=None):
    costs = [[_pairs(c) for c in CANDS]] * windows.shape[0]
    return repair_windows(None, [], windows, budget=budget, seq_len=T, candidates=CANDS, head_costs=costs,
                          items=ITEMS, sink_tokens=0, rounds=rounds, full_nll=full_nll)


def test_repair_takes_gain_per_pair_within_each_rounds_share(monkeypatch):
    windows = torch.full((3, 4), 8)
    base = causal_coverage(windows, T)
    one = 2 * (_pairs(64) - _pairs(8)) / (12 * T * (T + 1) / 2)  # coverage of widening one item
    budget = base + 2.5 * one  # room for two widenings, not three
    # Round 1 of 2 may spend half the room (1.25 items): the best gain per pair, (2, item 1).
    # Round 2 spends the rest: (0, item 0) gains more than (1, item 0); item (1, 1) never gains.
    calls = _fake_gains(monkeypatch, [{(0, 0): 0.3, (2, 2): 0.5, (1, 0): 0.2, (1, 2): -0.1},
                                      {(0, 0): 0.4, (1, 0): 0.1, (1, 2): 0.0}], [1.0, 0.7])
    got, log = _repair(windows, budget, rounds=2)
    want = windows.clone()
    want[2, 2:] = 64
    want[0, :2] = 64
    assert torch.equal(got, want)
    assert len(calls) == 2 and len(calls[0]) == 6 and (2, 2) not in calls[1]
    assert [r.widened for r in log] == [((2, 1),), ((0, 0),)]
    assert [r.answer_nll for r in log] == [1.0, 0.7]
    assert log[-1].causal_coverage == pytest.approx(causal_coverage(got, T)) and causal_coverage(got, T) <= budget


def test_repair_spends_the_room_whatever_full_attentions_answer_loss_and_stops_without_gains(monkeypatch):
    windows = torch.full((2, 4), 16)
    budget = 0.9
    # The windowed answer loss already below full attention's does not stop the repair.
    _fake_gains(monkeypatch, [{(0, 0): 0.3}, {(1, 0): 0.3}, {}], [0.05, 0.04, 0.03])
    got, log = _repair(windows, budget, full_nll=0.1)
    assert [r.widened for r in log] == [((0, 0),), ((1, 0),), ()]
    assert (got[:, :2] == 64).all() and (got[:, 2:] == 16).all()
    _fake_gains(monkeypatch, [{}], [0.5])
    got, log = _repair(windows, budget)
    assert torch.equal(got, windows) and log == [RepairRound(0.5, (), causal_coverage(windows, T))]


def test_repair_rejects_windows_outside_the_candidates():
    with pytest.raises(ValueError, match=r"windows \[12\] are not among the candidates"):
        _repair(torch.full((1, 4), 12), 0.9)
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        _repair(torch.full((1, 4), 8), 0.9, rounds=0)


def test_calibrate_with_a_reserve_repairs_the_smaller_knapsack(monkeypatch):
    import aah.hf.calibration.policies as calibration

    model = _llama()
    seqs = _sequences(2, 160)
    batches = [torch.randint(0, VOCAB, (1, 160), generator=torch.Generator().manual_seed(i)) for i in range(2)]
    cands = (20, 40, 80, 160)
    seen = {}

    def spy(model, sequences, windows, **kwargs):
        seen.update(kwargs, windows=windows.clone(), sequences=sequences)
        return repair(model, sequences, windows, **kwargs)

    repair = calibration.repair_windows
    monkeypatch.setattr(calibration, "repair_windows", spy)
    got = calibrate(model, batches, policy="budgeted", budget=0.6, sink_tokens=2, scope="model",
                    measure="kl_retrieval", retrieval=seqs, candidates=cands, retrieval_reserve=0.2, repair_rounds=2)
    from aah.hf.calibration.window_kl import measure_window_kl

    full = []
    lost = measure_window_kl(model, batches, cands, sink_tokens=2, seed=0) + measure_answer_loss(
        model, seqs, cands, sink_tokens=2, items=ITEMS, full_nll=full)
    knapsack = budgeted_windows(lost, cands, 0.4, 160, sink_tokens=2, num_kv_heads=2, scope="model")
    assert torch.equal(seen["windows"], knapsack)
    assert seen["budget"] == 0.6 and seen["rounds"] == 2 and seen["sequences"] is seqs
    assert seen["full_nll"] == pytest.approx(sum(full) / sum(len(s.answer) for s in seqs))  # per answer token
    assert causal_coverage(got, 160, sink_tokens=2) <= 0.6
    assert ((got == knapsack) | (got == 160)).all()  # the repair only widens, to the largest candidate


@pytest.mark.parametrize("kwargs,message", [
    (dict(measure="kl"), "retrieval_reserve needs measure 'kl_retrieval'"),
    (dict(retrieval_reserve=0.6), "must be below the budget"),
    (dict(retrieval_reserve=0.55), "leaves the knapsack"),
    (dict(repair_rounds=0), "repair_rounds must be >= 1"),
    (dict(policy="uniform"), "needs policy 'budgeted'"),
])
def test_calibrate_reserve_errors(kwargs, message):
    args = dict(policy="budgeted", budget=0.6, sink_tokens=2, measure="kl_retrieval", retrieval=_sequences(1, 160),
                candidates=(20, 40, 80, 160), retrieval_reserve=0.2)
    args.update(kwargs)
    batches = [torch.zeros(1, 160, dtype=torch.int64)]
    with pytest.raises(ValueError, match=message):
        calibrate(_llama(), batches, **args)


def test_repair_takes_a_free_widening_first(monkeypatch):
    # Layer 1 runs its own sliding window of 16: every candidate above it costs what 16 costs,
    # so widening its items is free and ranks first whatever its gain.
    windows = torch.full((2, 4), 16)
    capped = [_pairs(min(c, 16)) for c in CANDS]
    costs = [[_pairs(c) for c in CANDS], capped]
    _fake_gains(monkeypatch, [{(0, 0): 5.0, (1, 2): 0.01}], [1.0])
    budget = causal_coverage(windows, T) + 1e-3  # no room for any paid widening
    got, log = repair_windows(None, [], windows, budget=budget, seq_len=T, candidates=CANDS, head_costs=costs,
                              items=ITEMS, sink_tokens=0, rounds=1)
    assert log[0].widened == ((1, 1),)
    assert (got[1, 2:] == 64).all() and (got[0] == 16).all() and (got[1, :2] == 16).all()
