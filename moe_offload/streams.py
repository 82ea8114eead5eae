"""Streams and events of one cache, and their CPU no-op.

Three streams on CUDA (more with ``decode.lookahead``, whose copies run on ``lookahead()``, and with
``decode.overlap_misses_from``, whose miss copies run on ``misses()``): ``copy`` (PCIe copies: prefill misses,
decode admissions), ``hit`` (device-side prefill hit copies: an SM gather queued on the copy stream would wait for
SMs held by the compute stream's GEMMs and hold the next layer's PCIe copy behind it) and the caller's current
stream (compute). Ordering between them is by events only; nothing here synchronizes the host except
``synchronize``. On the CPU there are no streams: every copy completes before its call returns,
events are ``None`` and every method is a no-op.
"""

from __future__ import annotations

import contextlib

import torch


class Streams:
    """The cache's streams on ``device`` (CUDA) or nothing (CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.copy = torch.cuda.Stream(device) if self.is_cuda else None
        self.hit = torch.cuda.Stream(device) if self.is_cuda else None
        self.ahead = None  # the decode lookahead's stream (``lookahead``), made on first use
        self.miss = None  # the decode misses' SM copy beside the resident pairs' compute (``misses``), made on first use

    def lookahead(self):
        """The decode lookahead's stream (``moe_offload/lookahead.py``: it copies the next layer's predicted
        misses beside the compute stream), made once; ``synchronize`` waits for it too. None on the CPU."""
        if self.is_cuda and self.ahead is None:
            self.ahead = torch.cuda.Stream(self.device)
        return self.ahead

    def misses(self):
        """The stream on which a decode layer's misses are copied by SMs while the compute stream computes the pairs
        read from slots (``decode.overlap_misses_from``, ``decode_path.DecodeResidency.plan_split``), made once;
        ``synchronize`` waits for it too. None on the CPU."""
        if self.is_cuda and self.miss is None:
            self.miss = torch.cuda.Stream(self.device)
        return self.miss

    def event(self):
        return torch.cuda.Event() if self.is_cuda else None

    def current(self):
        return torch.cuda.current_stream(self.device) if self.is_cuda else None

    def on(self, stream):
        """Context: enqueue on ``stream`` (no-op on CPU)."""
        return torch.cuda.stream(stream) if self.is_cuda else contextlib.nullcontext()

    def wait(self, stream, *events) -> None:
        """``stream`` waits for each event (recorded or not: an unrecorded event is complete)."""
        if self.is_cuda:
            for ev in events:
                stream.wait_event(ev)

    def record(self, event, stream) -> None:
        if self.is_cuda:
            event.record(stream)

    def fork(self, side) -> None:
        """``side`` waits for everything already queued on the current (compute) stream."""
        if self.is_cuda:
            side.wait_stream(self.current())

    def join(self, side) -> None:
        """The current (compute) stream waits for everything already queued on ``side``."""
        if self.is_cuda:
            self.current().wait_stream(side)

    def join_current(self) -> None:
        """Copy and hit streams wait for everything already queued on the current (compute) stream."""
        if self.is_cuda:
            cur = self.current()
            self.copy.wait_stream(cur)
            self.hit.wait_stream(cur)

    def current_joins_copies(self) -> None:
        """The current stream waits for everything queued on the copy and hit streams (no host sync):
        whatever the caller enqueues next is ordered after every copy in flight."""
        if self.is_cuda:
            cur = self.current()
            cur.wait_stream(self.copy)
            cur.wait_stream(self.hit)

    def synchronize(self) -> None:
        """HOST SYNC: wait for the copy, hit, lookahead, miss and current streams (teardown, tests, benchmarks)."""
        if self.is_cuda:
            self.copy.synchronize()
            self.hit.synchronize()
            for side in (self.ahead, self.miss):
                if side is not None:
                    side.synchronize()
            self.current().synchronize()
