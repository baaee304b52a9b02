"""The reference backends against an independent float64 attention."""

import pytest
import torch

import aah
from aah.backends import backend_names, executed_coverage, get_backend


def _qkv(b, h, h_kv, t, d, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, t, d, generator=g, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h_kv, t, d, generator=g, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h_kv, t, d, generator=g, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("h_kv", [4, 2, 1])
@pytest.mark.parametrize("windows", [[1, 1, 1, 1], [13, 13, 13, 13], [40, 40, 40, 40], [1, 3, 13, 50]])
def test_dense_forward_and_backward_match_reference(ref_attention, h_kv, windows):
    q, k, v = _qkv(2, 4, h_kv, 13, 8)
    out = aah.attend(q, k, v, torch.tensor(windows), backend="dense")
    ref = ref_attention(q, k, v, windows)
    torch.testing.assert_close(out, ref)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b)


def test_window_one_returns_own_value(ref_attention):
    q, k, v = _qkv(1, 2, 2, 5, 4)
    out = aah.attend(q, k, v, [1, 1])
    torch.testing.assert_close(out, v)


def test_sdpa_is_full_causal_and_rejects_local_windows(ref_attention):
    q, k, v = _qkv(1, 4, 2, 9, 8, dtype=torch.float32)
    out = aah.attend(q, k, v, [9, 9, 20, 9], backend="sdpa")
    torch.testing.assert_close(out.double(), ref_attention(q, k, v, [9] * 4), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="full causal"):
        aah.attend(q, k, v, [4, 9, 9, 9], backend="sdpa")


def test_custom_scale_is_used(ref_attention):
    q, k, v = _qkv(1, 2, 2, 6, 4)
    out = aah.attend(q, k, v, [3, 6], scale=0.1)
    torch.testing.assert_close(out, ref_attention(q, k, v, [3, 6], scale=0.1))


def test_unknown_backend_lists_registered_names():
    q, k, v = _qkv(1, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="registered backends: .*dense"):
        aah.attend(q, k, v, [2, 2], backend="nope")
    assert {"dense", "sdpa"} <= set(backend_names())


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((1, 3, 4, 4), (1, 2, 4, 4), (1, 2, 4, 4)), "divisible"),
        (((1, 2, 4, 4), (1, 2, 5, 4), (1, 2, 5, 4)), "does not match"),
        (((2, 4, 4), (2, 4, 4), (2, 4, 4)), r"\(B, H, T, D\)"),
    ],
)
def test_bad_shapes_are_rejected(shapes, match):
    q, k, v = (torch.randn(*s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        aah.attend(q, k, v, [2] * q.shape[1] if q.dim() == 4 else [2])


def test_wrong_number_of_windows_is_rejected():
    q, k, v = _qkv(1, 2, 2, 4, 4)
    with pytest.raises(ValueError, match="2 heads"):
        aah.attend(q, k, v, [2, 2, 2])


def test_executed_coverage_of_reference_backends():
    assert executed_coverage("dense", [2, 2], 7) == pytest.approx(49 / 28)
    assert executed_coverage("sdpa", [7, 7], 7) == 1.0
    assert get_backend("dense").name == "dense"
