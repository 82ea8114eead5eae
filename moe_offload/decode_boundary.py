"""Admission into slots between decode steps, off the critical path: the step boundary of ``DecodeResidency``
(``decode_path.py``, which owns the step itself, its routing record and its counts).

Legend: L MoE layers (``lp`` = position in ``store.layers``), E experts per layer, T tokens of a step, K top-k.

Between steps (``boundary``, host; the engine calls it before each step and the first MoE layer of
an eager forward calls it too), deterministic so TP ranks stay in agreement:
1. admissions enqueued at the previous boundary are committed (their copy event is waited: issued a
   whole step earlier, it is done);
2. the previous step's routing record is read (its event waited: the step's sampled token was already
   read by then) and the policy admits up to ``decode.admit_per_step`` missed experts: victims leave
   the device table first (written on the compute stream, so steps enqueued later serve them from
   host memory), the copy stream waits for the compute and hit streams (no queued step still reads a
   victim), copies host -> victim slots, and records an event. The new owners enter the map and the
   table at the next boundary.

Read late (``set_late``; ``OffloadMoeCache.read_late`` turns it on while greedy decoding runs ahead,
``decode.run_ahead``, ``run_ahead.py``): the boundary before step N+1 runs while step N is still queued or running,
and reading step N's record (2.) would make the host wait for step N. Instead the boundary enqueues a copy of the
in-flight step's record into a pinned snapshot behind that step (compute stream) and admits from the snapshot the
boundary before took: step N-1's routing, done by then. Commits (1.) still wait for the admission copies enqueued at
the last boundary, which run beside step N (at most their own copy time, not the step's).
Admissions come one step later; what a step computes does not change (a routed expert without a slot is read from
host memory either way). Measured at e31192f with commits two boundaries on (no wait at all), misses rose by half at
batch 1 and tok/s fell; in this form (47c82c8) misses rose 27 % at batch 1 and tok/s rose 4.4 % at residency 0.37
(benchmarks/results/HISTORY.md "47c82c8 on an H100").
"""

from __future__ import annotations

import numpy as np
import torch

from moe_offload.copy_paths import RowCopy


class DecodeBoundary:
    """The between-steps half of ``DecodeResidency`` (see the module docstring). It reads what the step half made in
    ``DecodeResidency.__init__``: the store, pool, streams and counters, ``admit_per_step`` and ``admission`` (the
    policy), ``lookahead``, ``h2d`` and the routing record (``_record_host``, ``_record_pinned``, ``_record_dev``,
    ``_record_T``, ``_record_event``, ``_record_ready``); its own state is made by ``_init_boundary``."""

    def _init_boundary(self, streams, L: int, max_tokens: int, K: int) -> None:
        """The admissions in flight and the read-late snapshot (``[L, max_tokens, K]``, pinned where the record is)."""
        self._pending: list[tuple[int, np.ndarray, list[int]]] = []  # (layer, experts, slots) being copied
        self._pending_event = streams.event()
        self._just_committed: set[int] = set()
        # read late (module docstring): the snapshot of the record of the step that was in flight at the last boundary
        self.late = False
        self._snap_host = torch.zeros((L, max_tokens, K), dtype=torch.int32, pin_memory=self._record_pinned)
        self._snap_T: dict[int, int] | None = None
        self._snap_event = streams.event()

    def set_late(self, on: bool) -> None:
        """Read late from now on (module docstring), or not. Turning it off drops an unread snapshot: the next
        boundary admits from the last step's record."""
        self.late = on
        if not on:
            self._snap_T = None

    def boundary(self) -> None:
        """Commit last boundary's admissions, then admit from the last step's routing (host; read late: the step
        before last's). Slots just committed are not victims of this boundary: they serve at least one step (at a pool
        much smaller than a step's routed set every admission was otherwise evicted before its first use)."""
        self.commit_pending()
        if self.lookahead is not None:
            self.lookahead.reset()
        try:
            if self.late:
                self._boundary_late()
                return
            if not self._record_ready:
                return
            self._record_ready = False
            if self.pool.holds_every_expert():
                # nothing can miss, so there is nothing to admit: the record is not read and the host does not
                # wait for the step (the engine may have the next step queued behind it: decode.run_ahead)
                return
            if self.streams.is_cuda:
                self._record_event.synchronize()  # HOST SYNC, between steps: see the module docstring
            self._admit(self._record_host.numpy(), dict(self._record_T))
        finally:
            # cleared after this boundary's admissions, not before: slots a prefill pass committed (its
            # ``_begin``) are protected through the next boundary like those committed here
            self._just_committed = set()

    def _boundary_late(self) -> None:
        """Admit from the snapshot of the step before last, then snapshot the record of the step in flight."""
        tokens, self._snap_T = self._snap_T, None
        ready, self._record_ready = self._record_ready, False
        if self.pool.holds_every_expert():
            return
        if tokens:
            if self.streams.is_cuda:
                self._snap_event.synchronize()  # HOST SYNC on a copy behind the step before last: done already
            self._admit(self._snap_host.numpy(), tokens)
        if ready:  # enqueued after this boundary's table writes, before the next step overwrites the record
            self._snap_host.copy_(self._record_dev, non_blocking=self.streams.is_cuda)
            self.streams.record(self._snap_event, self.streams.current())
            self._snap_T = dict(self._record_T)

    def _admit(self, record_LTK: np.ndarray, tokens: dict[int, int]) -> None:
        """Touch the routed resident slots and admit missed experts, layers in order. The
        lookups run for all layers at once (``routed_lookup``: one numpy pass, not ~10 small ops per layer:
        at 48 layers the per-layer form cost ~0.5 ms of host time per step, during which the GPU waited)."""
        budget = self.admit_per_step
        if budget == 0 or self.pool.num_slots == 0 or not tokens:
            return
        lps, slots_LE, hit_LE, miss_LE = routed_lookup(record_LTK, tokens, self.pool.slot_of_LE)
        self.pool.policy.touch(slots_LE[hit_LE])  # layer order, expert order within a layer (an int array)
        if self.admission is not None:
            miss_LE = self.admission.admit(lps, slots_LE, hit_LE, miss_LE, self.pool.policy, self.pool.count_L)
        # victims leave the map and the device table now (one write for every layer); the policy may give fewer
        # than asked; raises with the map unchanged
        plans = self.pool.reserve_decode(lps, slots_LE, hit_LE, miss_LE, self._just_committed, budget)
        if not plans:
            return
        s = self.streams
        s.join_current()  # the table write above, and every queued step that may read a victim
        if s.is_cuda:
            s.copy.wait_stream(s.hit)  # a prefill hit gather may still read a victim
        R = self.store.bytes_per_expert
        try:
            with s.on(s.copy):  # every layer's rows in one call (one batched copy where the hit path has it)
                self.h2d.copy([RowCopy(self.pool.rows_SR, self.store.rows(layer), np.asarray(victims, dtype=np.int64),
                                       experts) for layer, experts, victims in plans], coalesce=False)
                s.record(self._pending_event, s.copy)
        except BaseException:
            for _, _, victims in plans:
                self.pool.release(victims)
            raise
        for layer, experts, _ in plans:
            self.counters.layer(layer).bytes["decode_h2d"] += int(experts.size) * R
        self._pending = plans

    def commit_pending(self) -> None:
        """Admissions whose copies were enqueued at the last boundary enter the map and the table (one write)."""
        if not self._pending:
            return
        if self.streams.is_cuda:
            self._pending_event.synchronize()  # HOST SYNC, between steps: issued a step ago, done
        pending, self._pending = self._pending, []  # taken off first: a failed commit is not retried
        try:
            self.pool.commit_many(pending)  # raises with the map unchanged (device OOM)
        except BaseException:
            for _, _, victims in pending:
                self.pool.release(victims)
            raise
        for _, _, victims in pending:
            self._just_committed.update(victims)

    def drop_pending(self) -> None:
        """Forget admissions in flight (the caller synchronized and clears the pool)."""
        for _, _, victims in self._pending:
            self.pool.release(victims)
        self._pending = []
        self._record_ready = False
        self._snap_T = None


def routed_lookup(record_LTK: np.ndarray, tokens: dict[int, int], slot_of_LE: np.ndarray):
    """A step's routing record against the slot map, for every layer at once: ``(lps, slots_LE, hit_LE,
    miss_LE)``, ``lps`` the layer positions of ``tokens`` ascending, ``slots_LE`` their rows of ``slot_of_LE``
    (a copy), ``hit_LE`` / ``miss_LE`` the experts that layer routed with / without a slot. ``record_LTK
    [L, T, K]`` holds expert ids; layer ``lp`` routed its first ``tokens[lp]`` rows. The routed experts are
    marked in an [L, E] mask, whose row-major order is the layer order with experts ascending, as a sorted
    unique per row gives them (that form took ~2 x longer at 16-64 tokens)."""
    lps = np.array(sorted(tokens), dtype=np.int64)
    T = max(tokens.values())
    ids_LM = record_LTK[lps, :T].reshape(len(lps), -1)  # [L, T*K] expert ids (a copy)
    if min(tokens.values()) != T:
        for i, lp in enumerate(lps.tolist()):  # a layer last run by a shorter forward: pad with its own first id
            ids_LM[i, tokens[lp] * record_LTK.shape[2]:] = ids_LM[i, 0]
    slots_LE = slot_of_LE[lps]
    routed_LE = np.zeros(slots_LE.shape, dtype=bool)
    routed_LE[np.arange(len(lps))[:, None], ids_LM] = True
    return lps, slots_LE, routed_LE & (slots_LE >= 0), routed_LE & (slots_LE < 0)
