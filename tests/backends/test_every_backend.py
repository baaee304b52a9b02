"""Every registered backend against the float64 reference masked by :func:`aah.windows.visible`.

The other files test each backend at many shapes; this one makes sure that no registered backend
goes without its forward and its backward pass checked on this machine. A backend that cannot run
here, or has no backward pass here, is skipped with the reason.
"""

from __future__ import annotations

import pytest
import torch

import aah
from aah.backends import backend_names, get_backend

from .test_banded_and_flex import _check, _qkv

CPU = torch.device("cpu")
# (batch, heads, kv heads, length, head dim), windows, dtype: window 1, short ones, W = T and W > T
# (sdpa takes full windows only); flex on the shape of its own tests, so a suite compiles it once.
SMALL = ((1, 4, 2, 24, 8), [1, 5, 24, 40], torch.float64)
CASES = {
    "sdpa": ((1, 4, 2, 24, 8), [24, 24, 40, 24], torch.float64),
    "flex": ((2, 8, 4, 300, 16), [1, 5, 300, 64, 129, 128, 127, 400], torch.float32),
}


def _checked(name, ref_attention, sinks, backward):
    backend = get_backend(name)
    reason = backend.unavailable_reason(CPU)
    if reason is not None:
        pytest.skip(reason)
    if backward and not backend.supports_backward(CPU):
        pytest.skip(f"backend {name!r} has no backward pass on cpu (only its forward is checked here)")
    shape, windows, dtype = CASES.get(name, SMALL)
    tol = 2e-5 if dtype == torch.float32 else 1e-10
    q, k, v = _qkv(*shape, dtype=dtype)
    with torch.set_grad_enabled(backward):
        out = aah.attend(q, k, v, windows, backend=name, sink_tokens=sinks)
    _check(out, q, k, v, windows, ref_attention, atol=tol, rtol=tol, backward=backward, sink_tokens=sinks)


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("name", backend_names())
def test_forward_matches_the_reference(name, sinks, ref_attention):
    _checked(name, ref_attention, sinks, backward=False)


@pytest.mark.parametrize("sinks", [0, 3])
@pytest.mark.parametrize("name", backend_names())
def test_backward_matches_the_reference(name, sinks, ref_attention):
    _checked(name, ref_attention, sinks, backward=True)
