"""The KL estimate of aah.hf.calibration.window_kl over a batch of several blocks at once.

``1/2 sum_t (g_t . d_t)^2 / N`` (docs/hf.md, "budgeted --measure kl") squares each position's
term of each block: a batch of blocks must give the mean of the blocks' own estimates, never
the square of a sum over the batch. The reference below computes each block alone by another
route (the gradient at the input of each ``o_proj``, q/k/v rebuilt from the attention's input,
and float64 attention).
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers.models.llama.modeling_llama import apply_rotary_pos_emb  # noqa: E402

from aah.controller.features import sample_query_positions  # noqa: E402
from aah.hf.calibration.window_kl import measure_window_kl  # noqa: E402

from ..conftest import reference_attention  # noqa: E402

VOCAB, T, HEADS, KV_HEADS, DIM = 300, 48, 4, 2, 8
CANDIDATES = (4, 12, 24, 48)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HEADS * DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=DIM, max_position_embeddings=128,
        attn_implementation="sdpa", eos_token_id=None, bos_token_id=None,
    )
    return transformers.LlamaForCausalLM(config).eval()


def _one_block_terms(model, block: torch.Tensor, labels: torch.Tensor, sinks: int) -> torch.Tensor:
    """(L, H, T, K): ``g_t . d_t`` of one block (1, T) at every position, for every candidate."""
    seen: dict[int, dict] = {}
    handles = []
    for layer, decoder_layer in enumerate(model.model.layers):
        attention = decoder_layer.self_attn

        def before_attention(_module, args, kwargs, layer=layer):
            hidden = args[0] if args else kwargs["hidden_states"]
            seen[layer] = {"hidden": hidden.detach(), "rope": kwargs["position_embeddings"]}

        def before_out(_module, args, layer=layer):
            args[0].retain_grad()
            seen[layer]["heads"] = args[0]  # (1, T, H * D): every head's output, side by side

        handles.append(attention.register_forward_pre_hook(before_attention, with_kwargs=True))
        handles.append(attention.o_proj.register_forward_pre_hook(before_out))
    try:
        logits = model(block, use_cache=False).logits[0, :-1]
        torch.nn.functional.cross_entropy(logits, labels[0], reduction="sum").backward()
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)

    terms = torch.zeros(len(seen), HEADS, T, len(CANDIDATES), dtype=torch.float64)
    with torch.no_grad():
        for layer, got in seen.items():
            attention = model.model.layers[layer].self_attn
            x = got["hidden"]
            q = attention.q_proj(x).view(1, T, HEADS, DIM).transpose(1, 2)
            k = attention.k_proj(x).view(1, T, KV_HEADS, DIM).transpose(1, 2)
            v = attention.v_proj(x).view(1, T, KV_HEADS, DIM).transpose(1, 2)
            q, k = apply_rotary_pos_emb(q, k, *got["rope"])
            gradient = got["heads"].grad.double().view(1, T, HEADS, DIM).transpose(1, 2)
            full = reference_attention(q, k, v, [T] * HEADS, scale=DIM ** -0.5)
            for c, window in enumerate(CANDIDATES):
                windowed = reference_attention(q, k, v, [window] * HEADS, scale=DIM ** -0.5, sink_tokens=sinks)
                terms[layer, :, :, c] = torch.einsum("bhtd,bhtd->ht", gradient, windowed - full)
    return terms


@pytest.mark.parametrize("num_queries,sinks", [(T, 0), (7, 2)])
def test_a_batch_of_blocks_estimates_the_mean_of_its_blocks(num_queries, sinks):
    model = _model()
    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, VOCAB, (2, T), generator=gen)
    labels = torch.randint(0, VOCAB, (2, T - 1), generator=gen)
    positions = sample_query_positions(T, num_queries, 0)
    weight = T / len(positions)
    tokens = 2 * (T - 1)
    per_block = [_one_block_terms(model, blocks[i:i + 1], labels[i:i + 1], sinks)[:, :, positions] for i in (0, 1)]

    # The docs' estimate: each block's terms squared, summed over positions and blocks, per predicted token.
    want = 0.5 * weight * (per_block[0].square() + per_block[1].square()).sum(2) / tokens
    got = measure_window_kl(model, [blocks], CANDIDATES, sink_tokens=sinks, num_queries=num_queries,
                            labels=[labels])
    torch.testing.assert_close(got.double(), want, atol=1e-9, rtol=1e-4)
    assert float(want.max()) > 1e-6  # the heads matter: the comparison is not of zeros

    # What squaring after summing over the batch gives is far from it: the test tells them apart.
    summed_first = 0.5 * weight * (per_block[0] + per_block[1]).square().sum(2) / tokens
    assert float((summed_first - want).abs().max()) > 100 * (1e-9 + 1e-4 * float(want.abs().max()))

    # The blocks given one at a time (two batches of one) are the same estimate.
    apart = measure_window_kl(model, [blocks[:1], blocks[1:]], CANDIDATES, sink_tokens=sinks,
                              num_queries=num_queries, labels=[labels[:1], labels[1:]])
    torch.testing.assert_close(got, apart, atol=1e-9, rtol=1e-5)
