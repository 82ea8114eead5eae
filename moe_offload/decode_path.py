"""The decode step without host syncs: the pool row each routed pair reads, its routing record and its counts.

Legend: L MoE layers (``lp`` = position in ``store.layers``), E experts per layer, T tokens of a step,
K top-k, S slots, X scratch rows (``min(max_tokens * K, E)``, max_tokens the cache's routed-path threshold:
``prefill_path.py``), R bytes of one expert row.

In the step (every tensor op on the compute stream, nothing read back; capturable in a CUDA graph):
- ``rows(layer, ids_TK)``: the device table ``table_LE[lp]`` gives each routed expert's slot; a
  missing expert is copied by SMs straight from mapped pinned host memory (UVA) into one of X scratch
  rows (``kernels/decode_miss.py``), so the compute reads every routed expert in place from the pool
  (rows 0..S-1 slots, S..S+X-1 scratch). On the CPU the same rows come from the torch reference.
- with ``decode.lookahead`` (``lookahead.py``), the next layer's predicted misses are copied a layer ahead on a
  side stream, and ``rows`` reads those from their lookahead rows instead of copying them;
- device counters per layer (routed pairs, missed pairs, distinct missed experts, distinct routed experts;
  with the lookahead also the distinct missed experts read from a lookahead row and the experts it copied)
  and one record of the routed ids, written into mapped pinned host memory by the miss server's plan
  kernel (a device-side write, capturable, no D2H call).

Between steps (``boundary``, host), admissions into slots off the critical path, read late or not:
``decode_boundary.py`` (``DecodeBoundary``, the base of ``DecodeResidency``; ``routed_lookup``).
"""

from __future__ import annotations

import logging
import weakref

import numpy as np
import torch

from moe_offload import log
from moe_offload.decode_boundary import DecodeBoundary, routed_lookup
from moe_offload.policy import make_admission
from moe_offload.uva import mapped_device_view, page_aligned, pin_mapped, unpin_quietly

__all__ = ["DecodeResidency", "MAX_STEP_COUNTS", "routed_lookup"]

#: ``record_step_counts`` keeps at most this many steps (a benchmark's runs are 64-256 steps)
MAX_STEP_COUNTS = 4096


class DecodeResidency(DecodeBoundary):
    """The decode path of one cache (see the module docstring); between steps: ``DecodeBoundary``."""

    def __init__(self, store, pool, streams, counters, max_tokens: int, admit_per_step: int,
                 lookahead_tokens: int = 0, admit_filter: str = "none", miss_copy: str = "uva",
                 overlap_from: int = 0):
        """``lookahead_tokens`` > 0: steps of at most that many tokens prefetch the next layer's predicted
        misses (``lookahead.py``) into the pool's last ``2 * min(lookahead_tokens * K, E)`` rows.
        ``admit_filter`` "frequency": a missed expert is admitted only when it was routed at least as often as the
        resident it would evict (``cache.admit_filter``, ``policy.FrequencyAdmission``). ``miss_copy`` "copy_engine":
        captured steps copy their routed misses with the copy engine (``graph_copy.py``; declined with one event
        where it does not apply). ``overlap_from`` (``decode.overlap_misses_from``) > 0: steps of at least that many
        tokens copy their misses on the miss stream while the compute stream computes the pairs read from slots
        (``plan_split``; declined with one event where it does not apply)."""
        self.store, self.pool, self.streams, self.counters = store, pool, streams, counters
        self.device = pool.device
        K, L = store.geometry.top_k, len(store.layers)
        self.max_tokens, self.admit_per_step = max_tokens, admit_per_step
        self.admission = make_admission(admit_filter, L, store.num_experts)
        self.scratch_base = pool.num_slots
        # per layer (kernels/decode_miss.py plan kernel): routed pairs, missed pairs, distinct missed experts read in
        # the step, distinct routed experts, distinct missed experts read from a lookahead row, experts the
        # lookahead copied (lookahead.py)
        self.counts_LC = torch.zeros((L, 6), dtype=torch.int64, device=self.device)
        # ``record_step_counts``: device copies of counts_LC after each step (benchmarks), and the counts before the
        # first of them
        self._step_counts: list[torch.Tensor] | None = None
        self._step_base: torch.Tensor | None = None
        self.lookahead = None
        if lookahead_tokens > 0:
            from moe_offload.lookahead import Lookahead, lookahead_rows

            rows = lookahead_rows(lookahead_tokens, store)
            self.lookahead = Lookahead(store, pool, streams, pool.rows_NR.shape[0] - rows, rows // 2, lookahead_tokens)
        from moe_offload.graph_copy import graph_miss_copy

        # a declined setting stays counted in stats() across counter resets (reset_counts)
        self.graph_copy, self.miss_copy_declined = graph_miss_copy(miss_copy, store, pool, self.scratch_base,
                                                                   counters, self.lookahead is not None)
        self.overlap_from, self.overlap_declined = _overlap(overlap_from, self.device, self.lookahead is not None,
                                                            self.graph_copy is not None)
        if self.overlap_declined:
            log.event("decode_miss_overlap_declined", logging.WARNING, reason=self.overlap_declined,
                      fallback="the misses are copied before the layer's compute, on the compute stream",
                      setting="decode.overlap_misses_from", change_with="decode.overlap_misses_from=0")
            counters.declined[f"decode_miss_overlap:{self.overlap_declined}"] += 1
        self._record_host = page_aligned((L, max_tokens, K), torch.int32)
        self._record_pinned = self.device.type == "cuda" and pin_mapped(self._record_host)
        self._record_dev = mapped_device_view(self._record_host, self.device) if self._record_pinned else self._record_host
        # a cache dropped without close() must not leave its pages registered: a later allocation at the
        # same address could not be registered again (cudaErrorHostMemoryAlreadyRegistered)
        self._unpin = (weakref.finalize(self, unpin_quietly, self._record_host, "decode_record_unpin_failed")
                       if self._record_pinned else None)
        self._record_T: dict[int, int] = {}  # lp -> tokens recorded by the step in flight
        self._record_event = streams.event()
        self._record_ready = False
        self._init_boundary(streams, L, max_tokens, K)  # admissions in flight, the read-late snapshot
        self.h2d = None  # the cache's H2DRows (set after hit-path resolution)
        # one counter per layer for route()'s one-launch top-k + plan (kernels/decode_miss.py; 0 between launches)
        self._route_done_L = torch.zeros(L, dtype=torch.int32, device=self.device)

    def miss_copy_in_effect(self) -> str:
        """``copy_engine`` or ``uva``: how a captured routed step's misses are copied (``decode.miss_copy`` after any
        decline)."""
        return "copy_engine" if self.graph_copy is not None else "uva"

    # ------------------------------------------------------------------ in the step
    def host_rows(self, layer: int) -> torch.Tensor:
        return self.store.device_rows(layer, self.device)

    def rows(self, layer: int, ids_TK: torch.Tensor, hidden_TH: torch.Tensor | None = None) -> torch.Tensor:
        """``rows_TK`` int32: the pool row each routed pair reads (slot, a lookahead row, or scratch after a UVA
        copy). ``hidden_TH``: the layer's MoE input; with lookahead on, the next MoE layer's routing is
        predicted from it and its misses prefetched (after this layer's own prefetch is joined and its own
        misses are enqueued)."""
        return self.plan(layer, ids_TK, hidden_TH)[0]

    def plan(self, layer: int, ids_TK: torch.Tensor, hidden_TH: torch.Tensor | None = None,
             align_block_m: int | None = None):
        """``(rows_TK, alignment)``: as ``rows``; with ``align_block_m`` (CUDA) ``alignment`` groups the rows in blocks
        of that many pairs for the tile kernels, made in the miss plan's own launch where it can be
        (``decode_miss.plan_misses``), else None."""
        T = self._check_ids(layer, ids_TK)
        lp = self.pool.layer_pos[layer]
        table_E = self.pool.table_LE[lp]
        pf_E = self.lookahead.take(lp) if self.lookahead is not None else None
        if self.graph_copy is not None and torch.cuda.is_current_stream_capturing():
            pf_E = self.graph_copy.enqueue(layer, table_E, ids_TK)  # the copy engine fills the rows (graph_copy.py)
        if self.device.type == "cuda":
            from moe_offload.kernels.decode_miss import serve_misses_plan

            # the plan kernel also counts the step and records its ids (no launch of its own)
            plan = serve_misses_plan(table_E, ids_TK, self.host_rows(layer), self.pool.rows_NR, self.scratch_base,
                                     stats=(self.counts_LC[lp], self._record_dev[lp]), pf_row_E=pf_E,
                                     align_block_m=align_block_m)
            rows_TK, alignment = plan.rows_TK, plan.alignment
        else:
            from moe_offload.kernels.decode_miss import count_step_reference, serve_misses_reference

            rows_TK = serve_misses_reference(table_E, ids_TK, self.host_rows(layer), self.pool.rows_NR,
                                             self.scratch_base, pf_E)
            count_step_reference(ids_TK, table_E, pf_E, self.counts_LC[lp], self._record_dev[lp])
            alignment = None
        if self.lookahead is not None and hidden_TH is not None and lp + 1 < len(self.store.layers):
            # after this layer's own misses are enqueued: its copy, on the critical path, goes first; the
            # prefetch overlaps this layer's expert compute and the next layer's attention
            self.lookahead.issue(lp + 1, hidden_TH, self.counts_LC[lp + 1, 5:])
        self._record_T[lp] = T
        return rows_TK, alignment

    def _check_ids(self, layer: int, ids_TK: torch.Tensor) -> int:
        """``T`` of a plan's routed ids, after the checks that cost no device work: the layer is the store's, the ids
        are an integer ``[T, K]`` tensor (a float or 1-D one was truncated or broadcast into the record before) of
        at most ``max_tokens`` rows. Their values are not read here (a host sync on the sync-free path); the router
        (``route``) gives ids in [0, E) from finite logits, and the logits guard names non-finite ones."""
        self.pool.check_layer(layer, "decode plan")
        if ids_TK.dim() != 2 or ids_TK.dtype.is_floating_point or ids_TK.dtype in (torch.bool, torch.uint8):
            raise ValueError(f"routed expert ids of layer {layer}: an integer [T, K] tensor, got {ids_TK.dtype} of "
                             f"shape {tuple(ids_TK.shape)}")
        self._check_tokens(ids_TK.shape[0])
        return ids_TK.shape[0]

    def _check_tokens(self, T: int) -> None:
        if T > self.max_tokens:
            raise ValueError(f"a forward of {T} tokens on the routed path exceeds the {self.max_tokens} tokens this "
                             "cache was sized for (decode.max_tokens, prefill.routed_max_tokens)")

    def splits(self, T: int) -> bool:
        """Whether a step of T tokens may take ``plan_split`` (``decode.overlap_misses_from``, where not declined)."""
        return 0 < self.overlap_from <= T

    def plan_split(self, layer: int, ids_TK: torch.Tensor):
        """``(rows_TK, scratch_base, join)``: ``plan``'s rows (``rows_TK >= scratch_base`` marks the missed pairs), the
        plan enqueued on the compute stream and the misses' copy forked onto the miss stream (``Streams.misses``)
        after everything the compute stream holds (the previous layer's reads of the scratch rows included), so the
        compute stream can compute the pairs read from slots meanwhile (``DecodeCompute.split``). ``join()`` makes the
        compute stream wait for the copy; call it before the missed pairs are read, and in any case before the layer
        ends (again is harmless): the plan's buffers, allocated on the compute stream, are held until then. No
        host sync; capturable (the fork and the join are graph edges). Where ``splits`` (CUDA; the CPU tests run it in
        the Triton interpreter, where the copy is done when it returns)."""
        from moe_offload.kernels.decode_miss import copy_misses, plan_misses

        T = self._check_ids(layer, ids_TK)
        lp = self.pool.layer_pos[layer]
        host_rows, rows_NR = self.host_rows(layer), self.pool.rows_NR
        plan = plan_misses(self.pool.table_LE[lp], ids_TK, host_rows, rows_NR, self.scratch_base,
                           stats=(self.counts_LC[lp], self._record_dev[lp]))
        s = self.streams
        side = s.misses()
        s.fork(side)
        try:
            with s.on(side):
                copy_misses(plan, host_rows, rows_NR, self.scratch_base)
        except BaseException:
            s.join(side)  # whatever was enqueued there stays ordered before the compute stream's next work
            raise
        # the copy reads the plan's buffers on the side stream, but the caching allocator orders their reuse only on
        # the compute stream that allocated them: held until the join, after which the compute stream is behind the
        # copy (bench decode at 80a81c2, which let them go at once, read reused memory: an illegal address)
        held = [plan]

        def join() -> None:
            if held:
                s.join(side)
                held.clear()

        self._record_T[lp] = T
        return plan.rows_TK, self.scratch_base, join

    def routes(self, T: int, K: int, E: int) -> bool:
        """Whether ``route`` serves a step of T tokens at top-K over E router outputs (CUDA, the layer's own experts,
        no lookahead, up to ``decode_route.ROUTE_PLAN_MAX_PAIRS`` pairs)."""
        from moe_offload.kernels.decode_route import route_plan_applies

        return (self.device.type == "cuda" and T <= self.max_tokens and E == self.store.num_experts
                and self.graph_copy is None and route_plan_applies(T, K, self.lookahead is not None))

    def route(self, layer: int, logits_TE: torch.Tensor, top_k: int, renorm: bool, w_dtype: torch.dtype,
              align_block_m: int | None = None):
        """``(w_TK, ids_TK, rows_TK, alignment)``: the router's top-k (``kernels/router.py``'s arithmetic) and ``plan`` of
        its ids in one launch (``decode_route.route_and_serve``), where ``routes`` says so."""
        from moe_offload.kernels.decode_route import route_and_serve

        self.pool.check_layer(layer, "route")
        if logits_TE.dim() != 2:
            raise ValueError(f"route: router logits [T, E], got shape {tuple(logits_TE.shape)}")
        self._check_tokens(logits_TE.shape[0])
        lp = self.pool.layer_pos[layer]
        w_TK, ids_TK, plan = route_and_serve(logits_TE, top_k, renorm, w_dtype, self.pool.table_LE[lp],
                                             self.host_rows(layer), self.pool.rows_NR, self.scratch_base,
                                             self._route_done_L[lp:lp + 1],
                                             stats=(self.counts_LC[lp], self._record_dev[lp]),
                                             align_block_m=align_block_m)
        self._record_T[lp] = logits_TE.shape[0]
        return w_TK, ids_TK, plan.rows_TK, plan.alignment

    def step_enqueued(self, tokens: int | None = None) -> None:
        """The step's last layer is enqueued: its routing record is complete once this event is.
        ``tokens``: the step's token count, from a graph replayer (a replay runs no host code in the
        layers, so the count recorded by ``rows`` is the last eager or captured step's, maybe another
        bucket's)."""
        if tokens is not None:
            self._record_T = {lp: tokens for lp in range(len(self.store.layers))}
        self.counters.decode_steps += 1
        if self._step_counts is not None and len(self._step_counts) < MAX_STEP_COUNTS:
            self._step_counts.append(self.counts_LC.clone())  # a device copy behind the step: no host sync
        self.streams.record(self._record_event, self.streams.current())
        self._record_ready = True

    # ------------------------------------------------------------------ stats and teardown
    def counts(self) -> dict[int, tuple[int, ...]]:
        """HOST SYNC (stats only): per MoE layer (routed pairs, missed pairs, distinct missed experts read in the
        step, distinct routed experts, distinct missed experts read from a lookahead row, experts the lookahead
        copied), summed over steps."""
        c = self.counts_LC.cpu().numpy()
        return {self.store.layers[lp]: tuple(int(v) for v in c[lp]) for lp in range(c.shape[0])}

    def account(self) -> dict | None:
        """HOST SYNC (stats only): the device counts into the per-layer counters (hits, misses, bytes read in
        the step and copied by the lookahead); returns the lookahead's summary (None when it is off)."""
        R = self.store.bytes_per_expert
        la = {"copied": 0, "used": 0, "missed_experts": 0}
        first = self.store.layers[0]  # never predicted: its misses stay out of the lookahead's recall
        for layer, (pairs, missed, distinct, routed, used, copied) in self.counts().items():
            c = self.counters.layer(layer)
            c.hits, c.misses, c.bytes["decode_uva"] = pairs - missed, missed, distinct * R
            c.routed_experts = routed
            c.bytes["decode_lookahead"] = copied * R
            if self.graph_copy is not None:  # its rows are the row map's: column 4 counts them (graph_copy.py)
                c.bytes["decode_graph_h2d"] = used * R
            la["copied"] += copied
            la["used"] += used
            la["missed_experts"] += (distinct + used) if layer != first else 0
        if self.lookahead is None:
            return None
        la["recall"] = la["used"] / la["missed_experts"] if la["missed_experts"] else None
        la["precision"] = la["used"] / la["copied"] if la["copied"] else None
        la["used_bytes"] = la["used"] * R
        return la

    def reset_counts(self) -> None:
        self.counts_LC.zero_()
        if self.miss_copy_declined:
            self.counters.declined[f"decode_miss_copy:{self.miss_copy_declined}"] = 1
        if self.overlap_declined:
            self.counters.declined[f"decode_miss_overlap:{self.overlap_declined}"] = 1
        if self._step_counts is not None:
            self.record_step_counts(True)

    def record_step_counts(self, on: bool) -> None:
        """From now on keep the counts after every decode step (``step_counts``), or stop and drop them. For
        benchmarks: which steps miss what (one small device copy a step, no host sync; at most MAX_STEP_COUNTS
        steps kept)."""
        self._step_counts = [] if on else None
        self._step_base = self.counts_LC.clone() if on else None

    def step_counts(self) -> np.ndarray | None:
        """HOST SYNC (benchmarks): what each step recorded since ``record_step_counts(True)`` (or the last
        ``reset_counts``) added to the counts, ``[steps, L, 6]`` (the columns of ``counts``); None when not
        recording."""
        if self._step_counts is None:
            return None
        if not self._step_counts:
            return np.zeros((0, *self.counts_LC.shape), dtype=np.int64)
        c = torch.stack([self._step_base, *self._step_counts]).cpu().numpy()
        return np.diff(c, axis=0)

    @property
    def pinned_bytes(self) -> int:
        """Host bytes registered for the routing record (0 on CPU or after ``close``)."""
        return self._record_host.numel() * self._record_host.element_size() if self._record_pinned else 0

    def close(self) -> None:
        if self._record_pinned:
            self._record_dev = self._record_host
            self._unpin()
            self._record_pinned = False


def _overlap(overlap_from: int, device: torch.device, lookahead: bool, graph_copy: bool) -> tuple[int, str | None]:
    """``(threshold, declined reason or None)`` of ``decode.overlap_misses_from`` on this cache: 0 (off) where it does
    not apply. The lookahead's rows sit above the scratch rows (the split would count them as misses and wait for a
    copy they do not need) and copy-engine misses (``graph_copy``) are copied inside the graph by conditional nodes,
    not by the kernel the split forks."""
    if overlap_from <= 0:
        return 0, None
    why = ("not_cuda" if device.type != "cuda" else "lookahead" if lookahead
           else "copy_engine_misses" if graph_copy else None)
    return (0, why) if why else (overlap_from, None)

