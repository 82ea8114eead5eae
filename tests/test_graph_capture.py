"""``graph_capture.end_failed_capture`` on any build: it ends the allocator's routing to the failed capture's pool
through torch's binding, and a torch whose allocator has nothing to end (it raised: not recording to that pool) or
that lacks the binding is left alone. The real effect on the allocator is checked on CUDA
(tests/gpu/test_graph_capture_gpu.py)."""

import logging

import pytest
import torch

from moe_offload import log
from moe_offload.graph_capture import end_failed_capture


def test_it_ends_the_pool_on_the_devices_index_and_logs_once(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: calls.append((index, pool)),
                        raising=False)
    log.reset_once_keys()
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        assert end_failed_capture(torch.device("cuda", 3), (0, 7))
        assert end_failed_capture(torch.device("cuda", 3), (0, 8))
    assert calls == [(3, (0, 7)), (3, (0, 8))]
    assert sum("cuda_graph_capture_ended_for_allocator" in r.getMessage() for r in caplog.records) == 1


def test_nothing_to_end_is_not_an_error(monkeypatch):
    def not_recording(index, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", not_recording, raising=False)
    assert not end_failed_capture(torch.device("cuda", 0), (0, 7))


def test_without_the_binding_or_a_pool_it_does_nothing(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_endAllocateToPool", raising=False)
    assert not end_failed_capture(torch.device("cuda", 0), (0, 7))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda *a: pytest.fail("called without a pool"),
                        raising=False)
    assert not end_failed_capture(torch.device("cuda", 0), None)
