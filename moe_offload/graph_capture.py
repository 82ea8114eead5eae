"""Leaving a failed CUDA graph capture without breaking torch's caching allocator.

torch 2.11's ``CUDAGraph.capture_end`` raises on ``cudaStreamEndCapture``'s error before it tells the caching
allocator that the capture ended (pytorch/pytorch#180395, fixed after 2.11). A capture invalidated by an op that
cannot be captured (a host sync, say; every capture in this package declines to eager on it) therefore leaves the
allocator believing, for the rest of the process, that a capture into the graph's pool is underway. While it
believes that, ``torch.cuda.empty_cache()`` releases none of the default pool's cached blocks, and an allocation
that finds no cached block is not retried after releasing them: memory freed on one stream can no longer serve
another, and a long-running server drifts into out-of-memory errors after one declined capture.

Found at e31192f on an H100: after the GPU test files whose captures fail on purpose, the faults module's first
device-memory hog left 78 GiB reserved and unallocated that ``empty_cache`` did not release, and 17 later tests
failed with out-of-memory errors; the same module alone held nothing
(benchmarks/results/HISTORY.md "e31192f on an H100").

The same early raise skips the capture's epilogue on the device's default CUDA generator, which therefore stays in
capture mode: every later random op on that device outside a capture (``torch.randint``, sampling, dropout) raises
"Offset increment outside graph capture encountered unexpectedly". Found at 47c82c8 on an H100: after the GPU test
that invalidates a capture on purpose, 39 later GPU tests failed that way
(benchmarks/results/HISTORY.md "47c82c8 on an H100").

Two more things the same raise leaves, measured at a21f336 on an H100 (``benchmarks/failed_capture_probe.py``, output
in ``benchmarks/results/failed-capture-probe-a21f336-h100.txt``):

- ``torch.cuda.graph.__exit__`` calls ``capture_end`` before it leaves its stream context, so when ``capture_end``
  raises, the capture's side stream stays the thread's current stream: later eager work runs on it, not on the
  stream the caller had. ``capture`` (below) makes the caller's stream current again.
- The failed capture's pool cannot be captured into again: ``capture_begin`` into it raises "beginAllocateToPool:
  already recording to mempool_id" even after ``end_failed_capture`` (the allocator then reports nothing recording
  to it), on any stream; a new pool captures and replays. Every capture site here therefore stops capturing into a
  pool after a failure (decode and serving graphs decline to eager; a decode capture takes a new pool each time).

``end_failed_capture`` ends the allocator's routing to the pool itself, through the binding
``torch.cuda.use_mem_pool`` is built on. On a torch that already ended it the allocator finds no such capture and
raises, which is the expected case there and ignored. The pool's own blocks stay reserved until its graphs go (the
pool is shared with the graphs captured before, so it is not released here).

When the allocator still counted the capture (so the epilogue was skipped as well), it also gives the default
generator a copy of its own state (``clone_state``: same seed and offset, not in capture mode) through
``graphsafe_set_state``. The random stream goes on where it was: a failed capture consumes no offset. Graphs captured
before keep the state they registered with (their replays advance that one), as they would after any
``graphsafe_set_state``. Only then, because a generator in good order would lose its graphs' offset bookkeeping.
"""

from __future__ import annotations

import contextlib
import logging

import torch

from moe_offload import log


@contextlib.contextmanager
def capture(graph: torch.cuda.CUDAGraph, pool, stream: torch.cuda.Stream):
    """``torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local")``. When the capture
    fails (at its start, in the body or at its end): the stream current before it is made current again, the
    capture is ended for the allocator and the generator (``end_failed_capture``), and the error is raised. Do not
    capture into ``pool`` again after a failure (module docstring)."""
    previous = torch.cuda.current_stream(stream.device)
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            yield
    except BaseException:
        torch.cuda.set_stream(previous)
        end_failed_capture(stream.device, pool)
        raise


def end_failed_capture(device: torch.device, pool) -> bool:
    """After a capture into ``pool`` (a ``torch.cuda.graph_pool_handle()``) raised: make sure the caching allocator
    no longer counts it as underway. True when it still did (this torch skipped it, see the module docstring)."""
    end = getattr(torch._C, "_cuda_endAllocateToPool", None)
    if end is None or pool is None:
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        end(index, pool)
    except RuntimeError:  # "not currently recording to mempool_id": capture_end already ended it
        return False
    generator = end_generator_capture(index)
    log.log_once("cuda_graph_capture_ended_for_allocator", "cuda_graph_capture_ended_for_allocator", logging.INFO,
                 torch=torch.__version__, generator_reset=generator,
                 detail="a failed capture left the caching allocator routing to its pool and the default CUDA "
                 "generator in capture mode; both ended explicitly (moe_offload/graph_capture.py)")
    return True


def end_generator_capture(index: int) -> bool:
    """Give device ``index``'s default CUDA generator a copy of its state that is not in capture mode (see the module
    docstring; ``end_failed_capture`` calls it when the capture's tail was skipped). False where this torch has no
    such generator or API."""
    generators = getattr(torch.cuda, "default_generators", ())
    if index >= len(generators):
        return False
    generator = generators[index]
    clone = getattr(generator, "clone_state", None)
    set_state = getattr(generator, "graphsafe_set_state", None)
    if clone is None or set_state is None:
        return False
    set_state(clone())
    return True
