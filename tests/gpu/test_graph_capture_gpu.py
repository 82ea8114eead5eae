"""On CUDA: a capture invalidated by a host sync, then ended through ``graph_capture.end_failed_capture``, leaves
torch's caching allocator able to release memory again and the default generator out of capture mode, its random
stream where it was (on torch 2.11 the failed ``capture_end`` left both as if the capture were underway:
``empty_cache`` released nothing and every random op raised; moe_offload/graph_capture.py)."""

import pytest
import torch

from moe_offload.graph_capture import end_failed_capture

from conftest import assert_allocator_releases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_an_invalidated_capture_ended_for_the_allocator_leaves_empty_cache_and_random_ops_working():
    torch.cuda.manual_seed(7)
    expected = torch.rand(4, device="cuda")  # the stream a failed capture must not move or break
    after = torch.rand(4, device="cuda")
    torch.cuda.manual_seed(7)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    x = torch.ones(1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception):
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            y = x * torch.rand_like(x)  # a random op in the capture, as sampling in a decode step
            y.sum().item()  # a host read: invalidates the capture
    end_failed_capture(torch.device("cuda"), pool)
    assert not torch.cuda.is_current_stream_capturing()
    assert torch.equal(torch.rand(4, device="cuda"), after)
    assert_allocator_releases()
    assert not end_failed_capture(torch.device("cuda"), pool)  # nothing left to end: a no-op
    # a capture with a random op after it captures and replays (the generator registers with the new graph)
    again = torch.cuda.CUDAGraph()
    with torch.cuda.graph(again, pool=pool, stream=side):
        z = torch.rand(4, device="cuda")
    again.replay()
    torch.cuda.synchronize()
    assert bool((z >= 0).all() and (z < 1).all())
