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
failed with out-of-memory errors; the same module alone held nothing (README "e31192f on an H100").

The same early raise skips the capture's epilogue on the device's default CUDA generator, which therefore stays in
capture mode: every later random op on that device outside a capture (``torch.randint``, sampling, dropout) raises
"Offset increment outside graph capture encountered unexpectedly". Found at 47c82c8 on an H100: after the GPU test
that invalidates a capture on purpose, 39 later GPU tests failed that way (README "47c82c8 on an H100").

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

import logging

import torch

from moe_offload import log


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
