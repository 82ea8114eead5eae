"""Greedy tokens read back in one copy a step; with ``decode.run_ahead`` one step late, so the GPU does not wait for
the host between steps.

Without it a decode step's tokens reach the host (a sync) before the next step is enqueued: the GPU idles for the
host's work between steps: on an H100 under the profiler ~0.47 ms between steps of ~4.1 ms at batch 1 and ~1.0 ms
between steps of ~10.3 ms at batch 16 (benchmarks/results/HISTORY.md, bb13400 / 3ce9df3, "graph_gaps"). With it, each
step's argmax and a finiteness flag are computed on the device and copied into one of two pinned buffers behind an
event; the sampled ids stay on the device as the next step's input, and the host reads a step's tokens while the step
after it runs.

Why it keeps answers: the next step's input is the same argmax, read from the device instead of the host. What it
costs: a step enqueued after the last sequence stopped is discarded (the caller never reads it), and non-finite
logits are reported one step later, naming the same token. The step boundary (``decode_path.DecodeResidency``) reads
late meanwhile (the engine turns it on around this loop): it admits from the routing of the step before the one in
flight, so it does not wait for the running step; with every expert resident it does no admission work at all.

Legend: B sequences, V vocabulary.
"""

from __future__ import annotations

from typing import Callable

import torch


class TokenReadback:
    """Greedy ids and a finiteness flag of a step's logits, on the device and, later, on the host."""

    def __init__(self, batch: int, device: torch.device):
        cuda = device.type == "cuda"
        self.cuda = cuda
        # [B ids, flag] per buffer; two in turn: the host reads one while the other is being filled
        self.host = [torch.empty(batch + 1, dtype=torch.int64, pin_memory=cuda) for _ in range(2)]
        self.events = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.next = 0

    def enqueue(self, logits_BV: torch.Tensor) -> tuple[torch.Tensor, int]:
        """``(tok_B, slot)``: the argmax ids on the logits' device (the next step's input) and the buffer that
        ``read(slot)`` reads them from, after they arrive. Nothing waits here. Read each slot before the
        enqueue after next (two buffers)."""
        tok_B = logits_BV.argmax(-1)
        ok_1 = torch.isfinite(logits_BV).all().view(1).to(torch.int64)
        slot, self.next = self.next, self.next ^ 1
        self.host[slot].copy_(torch.cat([tok_B, ok_1]), non_blocking=self.cuda)
        if self.cuda:
            self.events[slot].record()
        return tok_B, slot

    def read(self, slot: int) -> tuple[list[int], bool]:
        """``(ids, finite)`` of the step enqueued into ``slot`` (waits for that step only)."""
        if self.cuda:
            self.events[slot].synchronize()
        v = self.host[slot].tolist()
        return v[:-1], bool(v[-1])



def decode_greedy(step, tok_B: torch.Tensor, max_new: int, done: list[bool], take: Callable[[list[int]], None],
                  nonfinite: Callable[[], None], ahead: bool, device: torch.device) -> int:
    """Greedy decode steps (``step(tok_B) -> logits_BV``) after the first token, each step's ids and finiteness flag
    read back in one copy; ``take(ids)`` appends a step's tokens and updates ``done``; ``nonfinite()`` raises for a
    step whose logits were not finite. ``ahead`` (``decode.run_ahead``): a step's tokens are read while the next step
    runs, else before it is enqueued. Returns the steps enqueued: ahead, when every sequence stopped, the last one
    was discarded unread."""
    rb = TokenReadback(len(done), device)

    def read(slot: int) -> None:
        toks, finite = rb.read(slot)
        if not finite:
            nonfinite()
        take(toks)

    steps, unread = 0, []
    while steps + 1 < max_new and not all(done):
        tok_B, slot = rb.enqueue(step(tok_B))  # the next step's input stays on the device
        steps += 1
        unread.append(slot)
        if len(unread) > ahead:  # at most one step left unread while the next one runs
            read(unread.pop(0))
    if unread and not all(done):
        read(unread.pop())
    return steps
