"""A routed fill's device plan (``prefill.routed_plan: device`` / ``graph``): where the plan program's words land, how
a fill launches the program and reads them, and the plan captured in a prefill graph.

Legend: E experts per layer, R bytes of one expert row, P the plan's int64 words (``kernels/routed_plan.py``).

The program (``kernels/routed_plan.py``) writes a routed fill's batched-copy entries from the routed ids and the
device slot table. Its destination entries are offsets into a staging buffer (a base of 0): the host adds the base
of the buffer the fill takes, so one plan serves either buffer and can be worked out before the buffer is chosen.

Where the host reads them (``RoutedPlanBuffers``):
- ``graph``, on CUDA where pinned host memory can be mapped (``moe_offload/uva.py``) and a start-up check of the
  words so read passes: the program itself writes them into mapped pinned host memory (``mapped_P``), and the host
  records one event behind it and waits, with no D2H copy to launch;
- ``device`` (and ``graph`` where the words cannot be mapped), on CUDA: a D2H copy into pinned memory after the
  program, then the event (the form timed on H100s at 65790fb and 2758f41);
- off CUDA, the plain-torch plan in host memory.

``prefill.routed_plan: graph`` (with the mapped words): in a routed-fill prefill graph (``prefill_graph.Segments``)
the program is captured at the end of the stretch before each experts call (after the layer's router and the copies
of the call's inputs), so a replay runs it on the device while the host is still on its way to the fill; the fill then only waits for the words
(``PrefillStaging.planned_in_graph``). What it saves: the program's launch and the read's launch, and the wait for
them, on the critical path of each layer (a fill's fixed cost, benchmarks/results/HISTORY.md "2758f41").
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from moe_offload import log


@dataclass
class RoutedPlanBuffers:
    """Where a routed fill's device plan lands: ``dev_P`` on the device (with the program's scratch), read back into
    pinned ``host_P`` (the same tensor off CUDA), ``words`` its numpy view, ``read`` the event the host waits on,
    ``mapped_P`` a device view of ``host_P`` the program writes itself (None: a D2H copy reads it back; off CUDA
    ``dev_P`` itself)."""

    dev_P: torch.Tensor
    host_P: torch.Tensor
    words: np.ndarray
    read: object
    mapped_P: torch.Tensor | None = None
    _unpin: object = field(default=None, repr=False)

    @classmethod
    def make(cls, num_experts: int, device: torch.device, mapped: bool = False
             ) -> "tuple[RoutedPlanBuffers | None, str | None]":
        """``(buffers, None)``, or ``(None, reason)`` where the program's start-up check on this device failed
        (``kernels/routed_plan.check_program``; one ``routed_plan_declined`` event). ``mapped``: the words in mapped
        pinned host memory where this device allows it (``prefill.routed_plan: graph``), else read by a D2H copy."""
        from moe_offload.kernels.routed_plan import check_program

        if device.type == "cuda":
            try:
                wrong = check_program(device, num_experts)
            except Exception as exc:  # e.g. the program does not compile for this GPU: the host plan serves
                wrong = f"{type(exc).__name__}: {exc}"
            if wrong is not None:
                log.log_once("routed_plan_declined:check_failed", "routed_plan_declined", logging.WARNING,
                             reason="check_failed", detail=wrong, fallback="host", setting="prefill.routed_plan")
                return None, "check_failed"
        return cls._buffers(num_experts, device, mapped), None

    @classmethod
    def _buffers(cls, num_experts: int, device: torch.device, mapped: bool = False) -> "RoutedPlanBuffers":
        from moe_offload.kernels.routed_plan import plan_words

        dev_P = torch.zeros(plan_words(num_experts), dtype=torch.int64, device=device)
        if device.type != "cuda":  # host memory is the device's: the program's words are the host's
            return cls(dev_P, dev_P, dev_P.numpy(), None, dev_P)
        if mapped:
            buffers = cls._mapped(dev_P, num_experts, device)
            if buffers is not None:
                return buffers
        # prefill.routed_plan: device (as timed at 65790fb / 2758f41), or words that cannot be mapped: a D2H copy
        host_P = torch.zeros(dev_P.shape, dtype=torch.int64, pin_memory=True)
        return cls(dev_P, host_P, host_P.numpy(), torch.cuda.Event())

    @classmethod
    def _mapped(cls, dev_P: torch.Tensor, num_experts: int, device: torch.device) -> "RoutedPlanBuffers | None":
        """Buffers whose words the program writes into mapped pinned host memory (pages of their own), or None (one
        ``routed_plan_unmapped`` event) where they cannot be mapped or the start-up check reads them wrong."""
        from moe_offload.uva import UvaError, mapped_device_view, page_aligned, pin_mapped, unpin_quietly

        host_P, buffers, pinned = page_aligned(tuple(dev_P.shape), torch.int64), None, False
        try:
            pinned = pin_mapped(host_P)
            buffers = cls(dev_P, host_P, host_P.numpy(), torch.cuda.Event(), mapped_device_view(host_P, device))
        except UvaError as exc:
            wrong = str(exc)
        if buffers is not None:
            buffers._unpin = weakref.finalize(buffers, unpin_quietly, host_P, "routed_plan_unpin_failed")
            wrong = buffers.check_mapped(num_experts, device)
            if wrong is None:
                return buffers
            buffers.close()
        elif pinned:
            unpin_quietly(host_P, "routed_plan_unpin_failed")
        log.log_once("routed_plan_unmapped", "routed_plan_unmapped", logging.WARNING, detail=wrong,
                     fallback="d2h_copy", consequence="prefill.routed_plan graph runs as device")
        return None

    def check_mapped(self, num_experts: int, device: torch.device) -> str | None:
        """A start-up check of the mapped words (it synchronizes): the program's words as the host reads them after
        one event, against the plain-torch plan on seeded ids; None when they agree, else what differs."""
        from moe_offload.kernels.routed_plan import HEADER, out_words, plan_reference

        E = num_experts
        gen = torch.Generator().manual_seed(E + 1)
        ids = torch.randint(0, E, (8 * 16,), generator=gen)
        table = torch.where(torch.rand(E, generator=gen) < 0.37, 1, -1).to(torch.int32)
        want = plan_reference(ids, table, 4096, 0, 1 << 41).numpy()
        self.host_P.fill_(-5)
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                self.launch(ids.to(device), table.to(device), 4096, 1 << 41)
                words = self.wait(torch.cuda.current_stream() if device.type == "cuda" else None)
        except Exception as exc:  # noqa: BLE001 - any failure here declines the mapped words, never the cache
            return f"{type(exc).__name__}: {exc}"
        runs = int(want[0])
        spans = [(0, HEADER), (HEADER + 3 * E, out_words(E))] + [(HEADER + k * E, HEADER + k * E + runs)
                                                                   for k in range(3)]
        for lo, hi in spans:
            if not np.array_equal(words[lo:hi], want[lo:hi]):
                return f"mapped words {lo}-{hi} of a {E}-expert plan differ from the reference"
        return None

    def close(self) -> None:
        """Unregister the mapped words now (a closed cache replays nothing that writes them); idempotent."""
        if self._unpin is not None:
            self.mapped_P = None
            self._unpin()

    def launch(self, ids_N: torch.Tensor, table_E: torch.Tensor, row_bytes: int, src_base: int) -> None:
        """Enqueue the program on the current stream (destination offsets from 0) and, where it does not write the
        words itself, their D2H copy; capturable where ``mapped_P`` is set."""
        from moe_offload.kernels import routed_plan

        routed_plan.plan_routed_fill(ids_N, table_E, self.dev_P, row_bytes, 0, src_base, out_P=self.mapped_P)
        if self.mapped_P is None:
            self.host_P.copy_(self.dev_P, non_blocking=True)

    def wait(self, stream) -> np.ndarray:
        """HOST SYNC: the words of the plan enqueued last on ``stream``, the current one (``launch``, or a replayed
        capture of it), once they are on the host (off CUDA they already are)."""
        if self.read is not None:
            self.read.record(stream)
            self.read.synchronize()
        return self.words
