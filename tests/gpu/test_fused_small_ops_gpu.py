"""kernels/rmsnorm.py and kernels/rotary.py on CUDA, in the layout a decode step hands them: q and k heads as
column slices of the fused q/k/v GEMM output (RMSNorm reads them in place), then q and k rotated in one
launch; bf16 against the transformers arithmetic (``*_reference``), and a captured call replays bitwise
equal to eager.

Legend: B batch, T tokens, Hq/Hk query/key heads, D head dim.
"""

import pytest
import torch

from moe_offload.kernels.rmsnorm import rms_norm, rms_norm_reference
from moe_offload.kernels.rotary import apply_rotary, apply_rotary_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

B, T, HQ, HK, D = 16, 1, 32, 4, 128  # Qwen3-30B-A3B's attention at a batch-16 decode step


def _norms(y, w_q, w_k):
    q = rms_norm(y[..., :HQ * D].view(B, T, HQ, D), w_q, 1e-6).transpose(1, 2)
    k = rms_norm(y[..., HQ * D:(HQ + HK) * D].view(B, T, HK, D), w_k, 1e-6).transpose(1, 2)
    return q, k


def _step(y, w_q, w_k, cos, sin):
    return apply_rotary(*_norms(y, w_q, w_k), cos, sin)


def _inputs():
    gen = torch.Generator(device="cuda").manual_seed(0)
    y = torch.randn(B, T, (HQ + 2 * HK) * D, device="cuda", generator=gen).bfloat16()
    w_q, w_k = (torch.randn(D, device="cuda", generator=gen).bfloat16() for _ in range(2))
    ang = torch.randn(B, T, D, device="cuda", generator=gen)
    return y, w_q, w_k, ang.cos().bfloat16(), ang.sin().bfloat16()


def test_the_decode_layout_matches_the_reference():
    y, w_q, w_k, cos, sin = _inputs()
    q, k = _norms(y, w_q, w_k)
    want_q = rms_norm_reference(y[..., :HQ * D].reshape(B, T, HQ, D), w_q, 1e-6).transpose(1, 2)
    want_k = rms_norm_reference(y[..., HQ * D:(HQ + HK) * D].reshape(B, T, HK, D), w_k, 1e-6).transpose(1, 2)
    # the norm's fp32 sum runs in another order than torch's mean; a flipped rounding before the weight's
    # product can become two bf16 ulps after it
    torch.testing.assert_close(q, want_q, atol=1e-5, rtol=2 ** -6)
    torch.testing.assert_close(k, want_k, atol=1e-5, rtol=2 ** -6)
    # rotary: the module's roundings, so the same bits as its torch arithmetic on the same inputs
    got_q, got_k = apply_rotary(q, k, cos, sin)
    ref_q, ref_k = apply_rotary_reference(q, k, cos, sin)
    assert torch.equal(got_q, ref_q) and torch.equal(got_k, ref_k)


def test_a_captured_step_replays_bitwise():
    y, w_q, w_k, cos, sin = _inputs()
    eager = _step(y, w_q, w_k, cos, sin)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _step(y, w_q, w_k, cos, sin)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _step(y, w_q, w_k, cos, sin)
    y.add_(0.5)  # new inputs, read at replay (a scale would not do: RMSNorm is scale-invariant)
    graph.replay()
    torch.cuda.synchronize()
    again = _step(y, w_q, w_k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(out, again))
    assert not all(torch.equal(a, b) for a, b in zip(out, eager))
