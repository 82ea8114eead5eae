"""On CUDA: a capture invalidated by a host sync, then ended through ``graph_capture.end_failed_capture``, leaves
torch's caching allocator able to release memory again (on torch 2.11 the failed ``capture_end`` left the capture
counted as underway and ``empty_cache`` released nothing: moe_offload/graph_capture.py)."""

import pytest
import torch

from moe_offload.graph_capture import end_failed_capture

from conftest import assert_allocator_releases

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_an_invalidated_capture_ended_for_the_allocator_leaves_empty_cache_working():
    x = torch.ones(1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(Exception):
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            y = x * 2
            y.sum().item()  # a host read: invalidates the capture
    end_failed_capture(torch.device("cuda"), pool)
    assert not torch.cuda.is_current_stream_capturing()
    assert_allocator_releases()
    assert not end_failed_capture(torch.device("cuda"), pool)  # nothing left to end: a no-op
