"""The prefill pass: each MoE layer assembled into one of two staging buffers one layer ahead of compute.

Legend: E experts per layer (staging rows), R bytes of one expert row, b a staging buffer (0 or 1).

Per buffer b three events: ``misses_done[b]`` (its PCIe copies landed, copy stream), ``hits_done[b]``
(its device-side hit copies landed, hit stream) and ``released[b]`` (every reader of it is enqueued on
the compute stream: the GEMMs and the admission gather). The ordering rule, on every path including a
pass that raised half-way: every new writer of buffer b waits for ``released[b]`` AND for every writer
of b's previous fill (the copy stream waits the old ``hits_done[b]``, the hit stream the old
``misses_done[b]``; the waits are enqueued before either event is recorded again). A pass therefore
never needs to know how the previous one ended.

Counters: hits and misses of a layer are counted when compute uses the staged layer (``wait``), not
when its copies are issued: a staged layer reused by the next pass counts again, a prefetch that
nothing used does not. Bytes are counted when issued (they crossed the bus).

Read in place (``prefill.read_in_place``, with a device hit path): a layer whose experts are ALL resident
is not copied at all. Its "fill" only records the two fill events; ``wait`` hands out the pool's views
and the layer's row of the device slot table (``SlotPool.table_LE``) as ``index_N``, and the compute
reads each expert from its slot. The slots cannot change under it: a pass never evicts (its admission
takes free slots only, on the compute stream, for experts that were missing, i.e. of other layers); the
writes outside a pass are ordered before it (a decode eviction writes -1 into the table on the compute
stream and the copy stream joins it before overwriting the slot; ``set_residency`` synchronizes the host,
and a pass begins by committing pending decode admissions). Such a fill is only valid in the pass that made it
(between passes decode admission may evict), so ``begin`` drops it; a copied fill stays reusable.
Counted per layer use in ``stats()["compute"]["prefill_in_place_layers"]``.

Mixed fills (the same setting, a layer with hits AND misses): only the misses are copied into the buffer; the
buffers are the pool's lead rows (``SlotPool.backing``: buffer 0, buffer 1, the slots, the scratch rows in one
tensor), so ``wait`` hands out views of that whole tensor and ``index_N[e] = lead + table[e]`` for a resident
expert, ``b * E + e`` for a staged one, computed on the compute stream from the device slot table (no host
index). The hits cost no copy at all (the SM gather moved ~1 GB per layer at Flash-Next's residency 0.75, on the
SMs and HBM the compute uses); the same slot-stability argument as above holds, and ``begin`` drops such fills
too. The admission (``_admit_free``) copies only misses, whose rows the buffer holds. Counted per layer use in
``stats()["compute"]["prefill_mixed_layers"]``.

Routed fills (``prefill.routed_copy``, a pass opened with ``routed_fills``): nothing is copied ahead.
``wait(layer, ids_TK)`` learns the call's routing on the host (HOST SYNC, one a layer: with ``prefill.routed_plan:
device`` the copy entries a program worked out from the ids, ``kernels/routed_plan.py``; else the ids themselves) and
copies only the routed missing experts into the buffer over the copy engine, a mixed fill whose other missing experts' rows are stale (no
routed token reads them). For short prompts on hosts whose SM reads of mapped memory are slow, where the routed
path would read its misses at that rate. Such a fill is dropped at the next ``begin`` like any mixed fill, and
its admission takes only the experts it copied. Needs mixed fills (read in place, a device hit path); elsewhere
the layer is assembled whole. Counted in ``stats()["compute"]["prefill_routed_fills"]`` and the bytes as
``prefill_routed_h2d``.
"""

from __future__ import annotations

import contextlib
import logging

import numpy as np
import torch

from moe_offload import log
from moe_offload.copy_paths import RowCopy, index_tensor
from moe_offload.fill_plan import RoutedPlanBuffers
from moe_offload.hit_copy import FULL_LAYER_COPY
from moe_offload.host_store import bank_views


#: per layer fill, the weight of older fills in ``fill_missing`` (~50 layers: about one forward of a 48-layer model)
FILL_DECAY = 0.98


class PrefillStaging:
    """Two ``[E, R]`` staging buffers and the pass that fills them (owned by ``OffloadMoeCache``)."""

    def __init__(self, store, pool, streams, stats, on_hit_failure):
        self.store, self.pool, self.streams, self.stats = store, pool, streams, stats
        self.on_hit_failure = on_hit_failure  # called with the exception; returns the new hit path
        E = store.num_experts
        # the buffers are the pool's lead rows (one tensor with the slots): a fill may then be read as one bank
        # with its layer's resident experts, through an index (``wait``)
        if pool.lead_rows != 2 * E:
            raise ValueError(f"the slot pool must hold the two staging buffers in front of its slots (lead_rows=2*E="
                             f"{2 * E}), got lead_rows={pool.lead_rows}")
        self.rows = [pool.backing[b * E:(b + 1) * E] for b in range(2)]
        self._arange_E = torch.arange(E, dtype=torch.int32, device=pool.device)
        self.misses_done = [streams.event(), streams.event()]
        self.hits_done = [streams.event(), streams.event()]
        self.released = [streams.event(), streams.event()]
        self.staged: list[int | None] = [None, None]  # the layer a buffer holds (its fill is enqueued)
        self.in_place: list[torch.Tensor | None] = [None, None]  # slot table row of a fill read in place
        self.mixed = [False, False]  # a fill holding only its layer's misses (hits read in place from their slots)
        self.copied: list[np.ndarray | None] = [None, None]  # a routed fill's copied experts (its only valid rows)
        self.routed_fills = False  # the pass stages each layer's routed misses when its ids are known (``wait``)
        # routed fills' missing experts per layer, by the call's row count: decayed (sum, weight) over ~50 layers
        self.fill_missing: dict[int, tuple[float, float]] = {}
        self.read_in_place = True  # prefill.read_in_place (set by the cache)
        self.used = [(0, 0), (0, 0)]  # (hits, misses) of the fill a buffer holds
        self.computing: int | None = None  # the buffer the layer being computed reads
        self.last_filled = 1
        self.hit = None  # the HitCopy (set by the cache after resolution)
        self.plan: RoutedPlanBuffers | None = None  # prefill.routed_plan: device / graph (set by the cache)
        self.plan_declined: str | None = None  # why the cache declined the device plan at start-up
        self.plan_in_graph = False  # prefill.routed_plan: graph (set by the cache; ``capture_plan``)
        self.graph_plan: int | None = None  # the layer whose plan the stretch just replayed computed
        self.h2d = None  # the H2DRows of the misses

    def buffer_for(self, layer: int) -> int | None:
        for b in (0, 1):
            if self.staged[b] == layer:
                return b
        return None

    def begin(self) -> None:
        """A new pass: nothing is being computed; copies wait for the compute already queued. A fill read
        in place is dropped (the residency may have changed since)."""
        self.computing = None
        for b in (0, 1):
            if self.in_place[b] is not None or self.mixed[b]:
                self.staged[b], self.in_place[b], self.mixed[b] = None, None, False
        self.streams.join_current()

    def forget(self) -> None:
        """Drop what the buffers hold (the next pass assembles every layer anew)."""
        self.staged = [None, None]
        self.in_place = [None, None]
        self.mixed = [False, False]

    def prefetch(self, layer: int, into: int | None = None, ids_TK: torch.Tensor | None = None) -> int:
        """Enqueue the assembly of ``layer`` into buffer ``into`` (default: the buffer not being computed);
        a buffer that already holds ``layer`` is reused as is. Returns the buffer. ``ids_TK``: a routed fill of
        those routed ids instead of the whole layer's misses (module docstring)."""
        b = self.buffer_for(layer)
        if b is not None:
            return b
        b = into if into is not None else 1 - (self.computing if self.computing is not None else self.last_filled)
        self.staged[b] = None
        s = self.streams
        # Waits first, before either event of b is recorded again (see the module docstring).
        s.wait(s.hit, self.released[b], self.misses_done[b])
        s.wait(s.copy, self.released[b], self.hits_done[b])
        if ids_TK is None:
            self._assemble(layer, b)
        else:
            self._assemble_routed(layer, b, ids_TK)
        self.staged[b] = layer
        self.last_filled = b
        return b

    def _assemble(self, layer: int, b: int) -> None:
        s, counters, R = self.streams, self.stats.layer(layer), self.store.bytes_per_expert
        staging_ER = self.rows[b]
        resident_E = self.pool.resident(layer)  # host snapshot: no device sync
        hit_e = np.flatnonzero(resident_E >= 0)
        miss_e = np.flatnonzero(resident_E < 0)
        self.used[b] = (int(hit_e.size), int(miss_e.size))
        self.in_place[b], self.mixed[b], self.copied[b] = None, False, None
        if self.hit.name == FULL_LAYER_COPY or hit_e.size == 0:
            self._copy_full(layer, b)
            return
        if miss_e.size == 0 and self.read_in_place:  # every expert resident: nothing to copy
            self.in_place[b] = self.pool.table_LE[self.pool.layer_pos[layer]]
            s.record(self.misses_done[b], s.copy)
            s.record(self.hits_done[b], s.hit)
            return
        # Misses first: the DMA starts as soon as the buffer is released. An SM gather queued ahead
        # of it waits for SMs held by the previous layer's GEMMs and holds the PCIe copy back.
        with s.on(s.copy):
            self.h2d.copy([RowCopy(staging_ER, self.store.rows(layer), miss_e, miss_e)], coalesce=True)
            s.record(self.misses_done[b], s.copy)
        counters.bytes["prefill_miss_h2d"] += int(miss_e.size) * R
        if self.read_in_place:
            # hits are read in place from their slots (``wait``): nothing to copy for them
            self.mixed[b] = True
            s.record(self.hits_done[b], s.hit)
            return
        try:
            with s.on(s.hit):
                self.hit.copy(staging_ER, hit_e, self.pool.rows_SR, resident_E[hit_e].astype(np.int64), s.hit,
                              self.pool.table_LE[self.pool.layer_pos[layer]])
                s.record(self.hits_done[b], s.hit)
        except Exception as exc:  # a failed hit copy mid-run: full-layer copies from now on
            self.hit = self.on_hit_failure(exc)
            if s.is_cuda:
                s.copy.wait_stream(s.hit)  # whatever part of the hit copy was enqueued lands first
            self._copy_full(layer, b)
            return
        counters.bytes[self.hit.bytes_key] += int(hit_e.size) * R

    def _copy_full(self, layer: int, b: int) -> None:
        s = self.streams
        with s.on(s.copy):
            self.rows[b].copy_(self.store.rows(layer), non_blocking=True)
            s.record(self.misses_done[b], s.copy)
        self.stats.layer(layer).bytes["prefill_full_h2d"] += self.rows[b].numel()

    def _assemble_routed(self, layer: int, b: int, ids_TK: torch.Tensor) -> None:
        """A routed fill of ``layer`` into buffer ``b`` (module docstring)."""
        s, R = self.streams, self.store.bytes_per_expert
        rows_ER, host_ER = self.rows[b], self.store.rows(layer)
        declined = self._plan_declined()
        if declined is None:
            miss_e, routed = self._planned_copy(layer, rows_ER, host_ER, ids_TK)
        else:
            if declined:  # prefill.routed_plan: device, but its entries cannot be copied here
                level = logging.INFO if declined == "small_rows" else logging.WARNING  # small rows: by design
                log.log_once(f"routed_plan_declined:{declined}", "routed_plan_declined", level,
                             reason=declined, fallback="host", setting="prefill.routed_plan")
                self.stats.declined[f"routed_plan:{declined}"] += 1
            # HOST SYNC: the layer's routing. Between this read and the copy below the whole device waits for the
            # host (235 us a layer on an H100 at 80a81c2, HISTORY.md): array operations kept few
            routed_E = self._routed_experts(layer, ids_TK.reshape(-1).cpu().numpy())
            miss_e = np.flatnonzero(routed_E & (self.pool.resident(layer) < 0))
            routed = int(np.count_nonzero(routed_E))
            with s.on(s.copy):
                if miss_e.size:
                    self.h2d.copy([RowCopy(rows_ER, host_ER, miss_e, miss_e)], coalesce=True)
        s.record(self.misses_done[b], s.copy)
        s.record(self.hits_done[b], s.hit)
        self.stats.layer(layer).bytes["prefill_routed_h2d"] += int(miss_e.size) * R
        total, weight = self.fill_missing.get(ids_TK.shape[0], (0.0, 0.0))
        self.fill_missing[ids_TK.shape[0]] = (FILL_DECAY * total + miss_e.size, FILL_DECAY * weight + 1.0)
        self.stats.compute["prefill_routed_fills"] += 1
        self.used[b] = (routed - int(miss_e.size), int(miss_e.size))
        self.in_place[b], self.mixed[b], self.copied[b] = None, True, miss_e

    def _plan_declined(self) -> str | None:
        """None where a routed fill takes the device plan now (``prefill.routed_plan: device`` and entries this copier
        can copy), else why not: the start-up or copier's reason, "" under ``prefill.routed_plan: host``."""
        if self.plan is None:
            return self.plan_declined or ""
        rows = self.rows[0]
        return self.h2d.entries_unavailable(rows.shape[1], rows.device)

    def plan_in_effect(self) -> str:
        """``graph``, ``device`` or ``host``: the plan a routed fill would take now, what its fixed cost is priced at
        (``link_rates.routed_fill_fixed_s``); ``graph`` where a routed-fill prefill graph may capture it."""
        if self._plan_declined() is not None:
            return "host"
        return "graph" if self.plan_in_graph and self.plan.mapped_P is not None else "device"

    def _routed_experts(self, layer: int, ids: np.ndarray) -> np.ndarray:
        """``[E]`` bool: the experts ``ids`` route to; a ValueError naming the layer for ids outside the layer."""
        try:
            routed_E = np.bincount(ids, minlength=self.store.num_experts) > 0
        except ValueError:  # a negative id: bincount's own message names nothing (checked only when it fails)
            raise ValueError(f"layer {layer}: routed expert ids include {int(ids.min())}; the router's top-k must "
                             "index the checkpoint's experts (0 and up)") from None
        if routed_E.size != self.store.num_experts:
            raise ValueError(f"layer {layer}: routed expert ids reach {routed_E.size - 1}, the layer has "
                             f"{self.store.num_experts} experts (the router's top-k must index the checkpoint's experts)")
        return routed_E

    def _planned_copy(self, layer: int, rows_ER: torch.Tensor, host_ER: torch.Tensor, ids_TK: torch.Tensor
                      ) -> tuple[np.ndarray, int]:
        """``prefill.routed_plan: device``: the fill's copy entries planned on the compute stream
        (``kernels/routed_plan.py``), read back in one host read, and handed to the copy engine as they are; returns
        the missing experts it copies and the number routed. The host's numpy work moves after the copy call."""
        from moe_offload.kernels.routed_plan import HEADER

        E, plan = self.store.num_experts, self.plan
        if host_ER.shape[1] != rows_ER.shape[1]:
            raise ValueError(f"layer {layer}: host rows of {host_ER.shape[1]} bytes, staging rows of {rows_ER.shape[1]}")
        if self.graph_plan == layer:  # the stretch just replayed ran it (``planned_in_graph``)
            self.stats.compute["prefill_graph_planned_fills"] += 1
        else:
            plan.launch(ids_TK.reshape(-1), self.pool.table_LE[self.pool.layer_pos[layer]], rows_ER.shape[1],
                        host_ER.data_ptr())
        self.graph_plan = None
        words = plan.wait(self.streams.current())  # HOST SYNC: the plan, the fill's one read of the device
        runs, routed, _, bad = words[:HEADER].tolist()
        if bad:  # the error path reads the ids themselves, for the message
            self._routed_experts(layer, ids_TK.reshape(-1).cpu().numpy())
            raise RuntimeError(f"layer {layer}: the routed plan counted {bad} ids outside the layer, the ids read back "
                               "none: the plan program is wrong on this device; set prefill.routed_plan=host")
        at = words.view(np.uint64)
        flags = words[HEADER + 3 * E:HEADER + 4 * E]

        def fallback() -> list[RowCopy]:  # a failed batched call only
            miss_e = np.flatnonzero(flags)
            return [RowCopy(rows_ER, host_ER, miss_e, miss_e)]

        if runs:  # the plan's destinations are offsets into the staging rows
            with self.streams.on(self.streams.copy):
                self.h2d.copy_entries(at[HEADER:HEADER + runs] + np.uint64(rows_ER.data_ptr()),
                                      at[HEADER + E:HEADER + E + runs], at[HEADER + 2 * E:HEADER + 2 * E + runs],
                                      fallback, rows_ER.device)
        return np.flatnonzero(flags), routed

    def capture_plan(self, layer: int, ids_TK: torch.Tensor) -> bool:
        """``prefill.routed_plan: graph``, under a routed-fill prefill capture (``prefill_graph.Segments``), at the end
        of the stretch before ``layer``'s experts call: enqueue the layer's plan from its routed ``ids_TK`` (pad rows
        mapped as the call maps them) into the mapped words. True when captured: each replay of the stretch then
        works the plan out on the device, and the fill under ``planned_in_graph(layer)`` only waits for it
        (``fill_plan.py``). False (nothing enqueued) where a fill would not take the device plan, or the words are
        not mapped (each counted per layer of a capture as ``routed_plan_graph:<reason>`` in ``stats()["declined"]``)."""
        if not self.plan_in_graph:
            return False
        from moe_offload.kernels.routed_plan import triton

        why = self._plan_declined()
        if why is None and not (self.read_in_place and self.hit is not None and self.hit.name != FULL_LAYER_COPY):
            why = "no_routed_fills"  # the fill would stage the whole layer (``wait``): no plan to read
        if why is None and self.plan.mapped_P is None:  # its routed_plan_unmapped event came with the buffers
            why = "unmapped"
        if why is None and triton is None:  # the plain-torch plan would sync the host inside the capture
            why = "no_triton"
        if why is not None:
            log.log_once(f"routed_plan_graph_declined:{why}", "routed_plan_graph_declined", logging.INFO,
                         reason=why, fallback="the eager fill plans as its plan in effect", setting="prefill.routed_plan")
            self.stats.declined[f"routed_plan_graph:{why}"] += 1
            return False
        self.plan.launch(ids_TK.reshape(-1), self.pool.table_LE[self.pool.layer_pos[layer]], self.rows[0].shape[1],
                         self.store.rows(layer).data_ptr())
        return True

    @contextlib.contextmanager
    def planned_in_graph(self, layer: int):
        """Around the eager experts call of ``layer`` that follows a replayed stretch whose capture took
        ``capture_plan(layer, ...)``: its routed fill reads that plan instead of launching the program."""
        self.graph_plan = layer
        try:
            yield
        finally:
            self.graph_plan = None

    def missing_seen(self, rows: int) -> float | None:
        """The routed misses a layer's fill of ``rows`` rows found, averaged over earlier fills (decayed), or None."""
        seen = self.fill_missing.get(rows)
        return None if seen is None else seen[0] / seen[1]

    def wait(self, layer: int, ids_TK: torch.Tensor | None = None
             ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """``(views, index_N)`` of ``layer`` for compute; the compute stream waits until it is whole. A staged
        layer: typed views ``[E, ...]`` of its buffer and None; one read in place: the pool's views and the
        layer's slot table row ``[E]`` (row e of the bank is pool row ``index_N[e]``). ``ids_TK``: the call's
        routed ids; in a routed-fill pass (with mixed fills possible) only the routed misses are staged, now."""
        b = self.buffer_for(layer)
        if b is None:
            self.streams.join_current()
            routed = self.routed_fills and self.read_in_place and self.hit.name != FULL_LAYER_COPY
            b = self.prefetch(layer, ids_TK=ids_TK if routed else None)
        self.computing = b
        s = self.streams
        s.wait(s.current(), self.misses_done[b], self.hits_done[b])
        counters = self.stats.layer(layer)
        counters.prefill_hits += self.used[b][0]
        counters.prefill_misses += self.used[b][1]
        if self.in_place[b] is not None:
            self.stats.compute["prefill_in_place_layers"] += 1
            return self.pool.views(), self.in_place[b]
        if self.mixed[b]:  # one bank, staging rows and slots: expert e is slot row table[e], else staging row e
            self.stats.compute["prefill_mixed_layers"] += 1
            table_E = self.pool.table_LE[self.pool.layer_pos[layer]]
            index_N = torch.where(table_E >= 0, table_E + self.pool.lead_rows, self._arange_E + b * self.pool.E)
            return self.pool.backing_views(), index_N
        return bank_views(self.store.specs, self.store.offsets, self.rows[b]), None

    def done(self, layer: int, refill: int | None = None) -> None:
        """The GEMMs reading ``layer``'s staging are enqueued: warm the slot pool from it (free slots
        only, compute stream), then let the buffer be refilled after both. ``refill``: the layer to
        assemble into that buffer now (two layers ahead: see ``OffloadMoeCache.done``)."""
        b = self.buffer_for(layer)
        if b is None:
            return
        self._admit_free(layer, b)
        self.streams.record(self.released[b], self.streams.current())
        self.computing = None
        if refill is not None:
            self.prefetch(refill, into=b)

    def _admit_free(self, layer: int, b: int) -> None:
        """Copy staged experts that are not resident into FREE slots (no eviction). SM work on the
        compute stream: on the copy stream it would hold the next layer's PCIe copy behind the GEMMs."""
        if self.pool.num_free() == 0 or self.in_place[b] is not None:  # an in-place fill holds no rows of its own
            return
        new_e = np.flatnonzero(self.pool.resident(layer) < 0)
        if self.copied[b] is not None:  # a routed fill: its other missing experts' rows are stale
            new_e = np.intersect1d(new_e, self.copied[b])
        if new_e.size == 0:
            return
        from moe_offload.kernels.copy import gather_rows

        dev = self.pool.device

        def copy(slots: list[int]) -> None:
            gather_rows(self.pool.rows_SR, index_tensor(np.asarray(slots), dev), self.rows[b],
                        index_tensor(new_e[:len(slots)], dev))

        self.pool.admit(layer, new_e, copy, free_only=True, within_share=True)
