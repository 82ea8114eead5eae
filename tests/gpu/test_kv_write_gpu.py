"""The one-launch KV write (kernels/kv_write.py) compiled for this GPU: the same bits as its torch reference,
eager and replayed in a CUDA graph with the start changed between replays (read at replay time).

Legend: R cache rows, B rows written, H heads, T new tokens, P positions, D head dim.
"""

import pytest
import torch

from moe_offload.kernels.kv_write import kv_write, kv_write_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("B, T", [(1, 1), (16, 1), (2, 300)])
def test_kv_write_on_the_gpu_gives_the_reference_bits_eager_and_replayed(B, T):
    R, H, P, D = B + 2, 4, 1152, 128
    gen = torch.Generator(device="cuda").manual_seed(B + T)
    keys = torch.randn(R, H, P, D, device="cuda", generator=gen).bfloat16()
    values = torch.randn(R, H, P, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16().transpose(1, 2)  # as attention hands it
    v = torch.randn(B, T, H, D, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    start = torch.randint(0, P - T, (B,), device="cuda", generator=gen)
    want_k, want_v = keys.clone(), values.clone()
    kv_write_reference(want_k, want_v, k, v, start)
    got_k, got_v = keys.clone(), values.clone()
    kv_write(got_k, got_v, k, v, start)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)  # copies: bitwise

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kv_write(got_k, got_v, k, v, start)
    start.copy_(torch.randint(0, P - T, (B,), device="cuda", generator=gen))  # a new position per row
    kv_write_reference(want_k, want_v, k, v, start)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
