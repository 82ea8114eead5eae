"""On CUDA: a capture invalidated by a host sync, made through ``graph_capture.capture``, leaves torch's caching
allocator able to release memory again, the default generator out of capture mode with its random stream where it
was, and the caller's stream current (on torch 2.11 the failed ``capture_end`` left the first two as if the capture
were underway, and ``torch.cuda.graph`` left its side stream current; moe_offload/graph_capture.py)."""

import pytest
import torch

from moe_offload.graph_capture import capture, end_failed_capture

from conftest import assert_allocator_releases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_an_invalidated_capture_leaves_the_stream_empty_cache_and_random_ops_working():
    torch.cuda.manual_seed(7)
    expected = torch.rand(4, device="cuda")  # the stream a failed capture must not move or break
    after = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(7)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    x = torch.ones(1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    caller = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(caller)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception):
        with capture(graph, pool, side):
            y = x * torch.rand_like(x)  # a random op in the capture, as sampling in a decode step
            y.sum().item()  # a host read: invalidates the capture
    assert torch.cuda.current_stream() == caller
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.equal(torch.rand(4, device="cuda"), after)
    assert_allocator_releases()
    assert not end_failed_capture(torch.device("cuda"), pool)  # nothing left to end: a no-op
    # a capture with a random op after it, into a new pool (the failed one is never captured into again: torch
    # 2.11 refuses it), captures and replays: the generator registers with the new graph
    again = torch.cuda.CUDAGraph()
    with capture(again, torch.cuda.graph_pool_handle(), side):
        z = torch.rand(4, device="cuda")
    assert torch.cuda.current_stream() == caller
    again.replay()
    torch.cuda.synchronize()
    assert bool((z >= 0).all() and (z < 1).all())
