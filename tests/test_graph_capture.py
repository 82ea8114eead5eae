"""``graph_capture.end_failed_capture`` on any build: it ends the allocator's routing to the failed capture's pool
through torch's binding and gives that device's default generator a copy of its state out of capture mode; a torch
whose allocator has nothing to end (it raised: not recording to that pool) or that lacks the binding is left alone.
``graph_capture.capture`` makes the caller's stream current again after torch's failing ``capture_end`` (injected
here). The real effect on the allocator, the generator and the stream is checked on CUDA
(tests/gpu/test_graph_capture_gpu.py)."""

import logging

import pytest
import torch

from moe_offload import log
from moe_offload.graph_capture import end_failed_capture


class _RecordingGenerator:
    """Stands in for a CUDA default generator (a CPU generator has no ``graphsafe_set_state``): records the state it
    is given. The real effect (random ops work again, the stream goes on) is checked on CUDA."""

    def __init__(self, name):
        self.name, self.states = name, []

    def clone_state(self):
        return f"clone of {self.name}"

    def graphsafe_set_state(self, state):
        self.states.append(state)


def test_it_ends_the_pool_on_the_devices_index_resets_that_devices_generator_and_logs_once(monkeypatch, caplog):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: calls.append((index, pool)),
                        raising=False)
    generators = tuple(_RecordingGenerator(f"gen{i}") for i in range(4))
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    log.reset_once_keys()
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        assert end_failed_capture(torch.device("cuda", 3), (0, 7))
        assert end_failed_capture(torch.device("cuda", 3), (0, 8))
    assert calls == [(3, (0, 7)), (3, (0, 8))]
    assert generators[3].states == ["clone of gen3", "clone of gen3"]
    assert all(not g.states for g in generators[:3])
    assert sum("cuda_graph_capture_ended_for_allocator" in r.getMessage() for r in caplog.records) == 1


def test_a_generator_is_left_alone_when_the_allocator_had_nothing_to_end(monkeypatch):
    def not_recording(index, pool):
        raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", not_recording, raising=False)
    generators = (_RecordingGenerator("gen0"),)
    monkeypatch.setattr(torch.cuda, "default_generators", generators)
    assert not end_failed_capture(torch.device("cuda", 0), (0, 7))
    assert generators[0].states == []


def test_a_device_without_a_default_generator_still_has_its_pool_ended(monkeypatch):
    calls = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: calls.append(index), raising=False)
    monkeypatch.setattr(torch.cuda, "default_generators", ())
    assert end_failed_capture(torch.device("cuda", 1), (0, 7))
    assert calls == [1]


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


class _Torch211Graph:
    """Injects torch 2.11's failing ``torch.cuda.graph``: entering makes the side stream current; an exit after an
    error in the body raises (capture_end) before it restores the stream, as ``graph.__exit__`` does there."""

    def __init__(self, current):
        self.current = current

    def __call__(self, graph, pool=None, stream=None, capture_error_mode="global"):
        self.pool, self.stream = pool, stream
        return self

    def __enter__(self):
        self.previous, self.current[0] = self.current[0], self.stream

    def __exit__(self, *exc):
        if exc[0] is not None:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")
        self.current[0] = self.previous


def test_a_failed_capture_makes_the_callers_stream_current_again_and_ends_the_pool(monkeypatch):
    from moe_offload.graph_capture import capture

    current = ["caller"]
    monkeypatch.setattr(torch.cuda, "graph", _Torch211Graph(current))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: current.__setitem__(0, stream))
    ended = []
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", lambda index, pool: ended.append((index, pool)),
                        raising=False)
    monkeypatch.setattr(torch.cuda, "default_generators", (_RecordingGenerator("gen0"),))
    side = type("Side", (), {"device": torch.device("cuda", 0)})()
    with pytest.raises(RuntimeError, match="previous error during capture"):
        with capture(object(), (0, 5), side):
            assert current[0] is side
            raise RuntimeError("a host read under capture")
    assert current[0] == "caller" and ended == [(0, (0, 5))]
    with capture(object(), (0, 6), side):  # a capture that succeeds leaves the pool alone
        pass
    assert current[0] == "caller" and ended == [(0, (0, 5))]
