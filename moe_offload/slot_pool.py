"""Residency: the device slot pool, which expert each slot holds, and admission with eviction.

Legend: L MoE layers (``lp`` = a layer's position in ``store.layers``), E experts per layer, S slots,
R bytes of one expert row (all banks side by side), N rows.

Two copies of the map, kept equal: ``slot_of_LE`` on the host (prefill reads it without a device
sync) and ``table_LE`` on the device (the decode step reads it without the host). A slot knows its
owner (``lp * E + e``). Which slot to evict is the policy's answer (``policy.py``); this module owns
the memory and the map.

The map never lies: ``admit`` takes victims out of the map first (they are about to be overwritten),
enqueues the copy, and only then records the new owners; when the copy raises, the victims are
returned to the policy as free and the map still says exactly what the slots hold. Device-table writes
go to the current stream; the caller orders them after the copy they describe.

Shares (``cache.policy: balanced``, the default; the choice is ``policy.BalancedLruPolicy``'s): layer ``lp``
may hold ``share_L[lp]`` experts (S // L, the first S % L layers one more). A prefill admission into free
slots stops at the share (``admit(..., within_share=True)``); a decode admission (``reserve_decode``) takes
free slots up to the share, then evicts the least recently used expert of its own layer when the layer is
at its share, else of a layer above its share. Why: prefill copies layer l+1's misses while layer l computes, so per layer it costs about
max(compute, misses x row bytes / PCIe bandwidth). First-come admission filled the slots in layer order: at
``cache.budget=0.37`` on Qwen3-30B-A3B the warm-up left layers 0-17 fully resident and 18-47 empty, and
18 x 1.9 ms + 30 x 6.1 ms = 217 ms predicts the 220.5 ms ``Engine.measure_ttft`` the H200 measured on the
serving engine (benchmarks/results/serve-qwen3-30b-a3b-r0.37-032db7c87464.json), against 190.0 ms with
the same number of residents spread evenly (``bench ttft``, c6e05d5). ``set_residency`` places exactly
the experts it is given (no share applies); later admissions move the layers back to their shares.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np
import torch

from moe_offload.copy_paths import index_tensor
from moe_offload.host_store import bank_views
from moe_offload.policy import make_policy
from moe_offload.stats import CacheStats


_FEW = 16  # up to this many slots a plain loop beats numpy's vector calls (~1 us against ~15 us on a CPU of CI's kind)


class SlotPool:
    """``num_slots`` device rows of ``store.bytes_per_expert`` bytes and the residency map over them."""

    def __init__(self, store, num_slots: int, policy: str, device: torch.device, stats: CacheStats,
                 scratch_rows: int = 0, lead_rows: int = 0):
        """``lead_rows``: rows allocated in front of the slots in the same tensor (``backing``): the prefill
        staging buffers, so that one bank (``backing_views``) holds staged rows and slots alike."""
        self.store, self.device, self.stats = store, device, stats
        self.num_slots = num_slots
        self.E = store.num_experts
        self.layer_pos = {layer: i for i, layer in enumerate(store.layers)}
        # rows 0..S-1 are slots, S..S+X-1 decode scratch rows (misses of one decode step, never resident)
        self.lead_rows = lead_rows
        self.backing = torch.empty((lead_rows + num_slots + scratch_rows, store.bytes_per_expert), dtype=torch.uint8,
                                   device=device)
        self.rows_NR = self.backing[lead_rows:]
        self.rows_SR = self.rows_NR[:num_slots]
        self.slot_of_LE = np.full((len(store.layers), self.E), -1, dtype=np.int32)
        self.table_LE = torch.full((len(store.layers), self.E), -1, dtype=torch.int32, device=device)
        self.owner_S = np.full(num_slots, -1, dtype=np.int64)
        self.policy = make_policy(policy, num_slots, len(store.layers))
        self.count_L = np.zeros(len(store.layers), dtype=np.int64)  # residents per layer (``owner_S`` summarized)

    # ---------------------------------------------------------------- checking callers' ids (no device work)
    def check_layer(self, layer, what: str) -> None:
        """A ``ValueError`` naming ``what`` unless ``layer`` is one of the store's MoE layers."""
        if layer not in self.layer_pos:
            raise ValueError(f"{what}: layer {layer!r} is not a MoE layer of this cache's store "
                             f"({sorted(self.layer_pos)[:8]}...)")

    def check_experts(self, layer, experts, what: str) -> None:
        """A ``ValueError`` naming ``what`` unless ``layer`` is a MoE layer and ``experts`` (a host sequence) are
        distinct integer ids of it."""
        self.check_layer(layer, what)
        ids = list(experts)
        bad = [e for e in ids if isinstance(e, (bool, np.bool_)) or not isinstance(e, (int, np.integer))
               or not 0 <= e < self.E]
        if bad:
            raise ValueError(f"{what}: layer {layer}: expert ids {bad[:8]} are not integers in 0..{self.E - 1}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what}: layer {layer}: expert ids listed twice "
                             f"{sorted(e for e in set(ids) if ids.count(e) > 1)[:8]}; list each once")

    # ---------------------------------------------------------------- reading the map
    def resident(self, layer: int) -> np.ndarray:
        """Slot of each expert of ``layer`` (-1 = not resident), a host array [E] (a view: do not keep)."""
        return self.slot_of_LE[self.layer_pos[layer]]

    def residency_map(self) -> np.ndarray:
        """``[L, E]`` bool: which experts are resident (a copy)."""
        return self.slot_of_LE >= 0

    def num_free(self) -> int:
        """Slots holding nothing and not reserved by a fill in flight."""
        return self.policy.num_free

    @property
    def resident_count(self) -> int:
        return int((self.owner_S >= 0).sum())

    def holds_every_expert(self) -> bool:
        """Every expert of every layer has a slot (no step can miss)."""
        return int(self.count_L.sum()) == self.slot_of_LE.size

    def views(self) -> dict[str, torch.Tensor]:
        """Typed per-bank views ``[S + X, ...]`` of the pool, scratch rows included (rows read in place)."""
        return bank_views(self.store.specs, self.store.offsets, self.rows_NR)

    def backing_views(self) -> dict[str, torch.Tensor]:
        """Typed per-bank views of the whole backing tensor: the lead rows, then the slots (slot s is row
        ``lead_rows + s``), then the scratch rows."""
        return bank_views(self.store.specs, self.store.offsets, self.backing)

    # ---------------------------------------------------------------- changing the map
    def _table_write(self, entries_F: np.ndarray, values_F: np.ndarray):
        """The device tensors of a table write: ``table_LE.view(-1)[entries_F] = values_F`` (flat entries
        ``lp * E + e``). They are allocated BEFORE either map changes: an allocation that fails (device OOM) must
        leave both maps as they were. A table entry left pointing at a slot the host map had already given up
        was refilled with another expert later, and the decode step read the wrong expert (a wrong answer,
        reproduced on the CPU with an injected OOM: tests/test_faults.py). One upload carries both: the int64
        entries, then the int32 values packed into the words after them: one pinned copy and one ``index_copy_``
        where two uploads, a cast and an ``index_copy_`` were launched between decode steps before."""
        n = int(entries_F.size)
        if n == 0:
            return None
        buf = np.empty(n + (n + 1) // 2, dtype=np.int64)
        buf[:n] = entries_F
        buf[n:].view(np.int32)[:n] = values_F
        t = index_tensor(buf, self.device)
        return t[:n], t[n:].view(torch.int32)[:n]

    def _apply(self, writes: list) -> None:
        table_F = self.table_LE.view(-1)
        for w in writes:
            if w is not None:
                table_F.index_copy_(0, *w)

    def _evict(self, slots: list[int]) -> None:
        """Drop the owners of ``slots`` from both maps (device table on the current stream); raises
        with both maps unchanged when the table write cannot be allocated."""
        keys = self.owner_S[slots]
        keys = keys[keys >= 0]  # an owner's key is its flat table entry, lp * E + e
        write = self._table_write(keys, np.full(keys.size, -1))  # may raise: nothing changed
        self._drop_owners(slots)
        self._count_evictions(keys)
        self._apply([write])

    def _drop_owners(self, slots) -> np.ndarray:
        """The host map forgets the owners of ``slots``; returns their keys (-1 where a slot held nothing)."""
        keys = self.owner_S[slots]  # a copy (integer indexing)
        if len(slots) <= _FEW:  # a decode admission's few victims of one layer: numpy's per-call cost dominates
            for key in keys.tolist():
                if key >= 0:
                    lp, e = divmod(key, self.E)
                    self.slot_of_LE[lp, e] = -1
                    self.count_L[lp] -= 1
        else:
            owned = keys >= 0
            lp_K, e_K = np.divmod(keys[owned], self.E)
            self.slot_of_LE[lp_K, e_K] = -1
            np.subtract.at(self.count_L, lp_K, 1)
        self.owner_S[slots] = -1
        return keys

    def _restore_owners(self, slots, keys: np.ndarray) -> None:
        """Undo ``_drop_owners(slots)`` (which returned ``keys``)."""
        slots = np.asarray(slots, dtype=np.int64)
        owned = keys >= 0
        lp_K, e_K = np.divmod(keys[owned], self.E)
        self.slot_of_LE[lp_K, e_K] = slots[owned]
        np.add.at(self.count_L, lp_K, 1)
        self.owner_S[slots] = keys

    def _count_evictions(self, keys: np.ndarray) -> None:
        lps, n = np.unique(keys[keys >= 0] // self.E, return_counts=True)
        for lp, k in zip(lps.tolist(), n.tolist()):
            self.stats.layer(self.store.layers[lp]).evictions += k

    def reserve(self, n: int, protected: set[int] = frozenset(), free_only: bool = False) -> list[int]:
        """``n`` slots to fill, taken out of the map now (their old experts are no longer resident);
        never a slot in ``protected``. Fill them, then ``commit`` (or ``release`` on failure). Raises
        with the map unchanged (empty slots free again) when the eviction cannot be written."""
        if n == 0:
            return []
        return self._take(self.policy.choose_free(n) if free_only else self.policy.choose(n, set(protected)))

    def reserve_for(self, layer: int, n: int, protected: set[int]) -> list[int]:
        """Up to ``n`` slots for experts of ``layer`` (one layer's decode admission; a boundary takes every layer's
        through ``reserve_decode``), never one in ``protected``, as the policy chooses them (``policy.victims_for``);
        taken out of the map like ``reserve``."""
        slots = self.policy.victims_for(self.layer_pos[layer], n, protected, self.count_L, self.slot_of_LE)
        return self._take(slots) if slots else []

    def reserve_for_layers(self, wants: Iterable[tuple[int, np.ndarray, set[int]]], budget: int) -> list[tuple]:
        """A decode boundary's admissions: for each ``(layer, missed experts, protected slots)`` in order, slots as
        ``reserve_for`` chooses them (never one an earlier entry took), until ``budget`` slots are taken. Returns
        ``[(layer, experts, slots)]``, the entries that got slots (``experts`` the first ``len(slots)`` missed).
        Every layer's evictions go into ONE table write (a layer at a time took an upload and an index_copy_ per
        admitted layer, ~16 layers a step at residency 0.37). The policy picks layer by layer on the host map as
        each earlier layer left it, as ``reserve_for`` would; when the write cannot be allocated (device OOM)
        the host map is put back, the slots that were empty are free again, and it raises."""
        plans, taken, keys = [], [], []
        try:
            for layer, missed, protected in wants:
                if budget <= 0:
                    break
                n = min(int(missed.size), budget)
                slots = self.policy.victims_for(self.layer_pos[layer], n, protected | set(taken), self.count_L,
                                                self.slot_of_LE) if n else []
                if not slots:
                    continue
                keys.append(self._drop_owners(slots))  # the next layer's pick sees this layer's evictions
                taken += slots
                plans.append((layer, missed[:len(slots)], slots))
                budget -= len(slots)
        except BaseException:  # the policy raised: the map as it was
            if keys:
                self._undo_drop(taken, np.concatenate(keys))
            raise
        if keys:
            self._write_evictions(taken, np.concatenate(keys))
        return plans

    def reserve_decode(self, lps: np.ndarray, slots_LE: np.ndarray, hit_LE: np.ndarray, miss_LE: np.ndarray,
                       protected: set[int], budget: int) -> list[tuple]:
        """``reserve_for_layers`` over a decode step's routing lookup (``decode_boundary.routed_lookup``: layer positions
        ``lps``, their map rows, the experts routed with / without a slot): every layer with misses, in order,
        protects the slots its step routed and ``protected``. Where the policy picks every layer's victims at once
        (``own_victims``: the balanced policy with each of those layers at or above its share, its steady state
        below residency 1) the picks are the same in a few array operations (~100 us a layer of Python on a
        CI-class CPU before: benchmarks/results/HISTORY.md "c7b7054 on an H200"); else layer by layer."""
        rows = np.flatnonzero(miss_LE.any(axis=1))
        if budget <= 0 or rows.size == 0:
            return []
        at_once = getattr(self.policy, "own_victims", None)
        if at_once is not None:
            protected_S = np.zeros(self.num_slots, dtype=bool)
            protected_S[list(protected)] = True
            s_LE = slots_LE[rows]
            usable_LE = (s_LE >= 0) & ~hit_LE[rows] & ~protected_S[np.maximum(s_LE, 0)]
            picks = at_once(lps[rows], s_LE, usable_LE, miss_LE[rows].sum(axis=1), self.count_L, budget)
            if picks is not None:
                plans = [(self.store.layers[int(lps[i])], np.flatnonzero(miss_LE[i])[:len(p)], p)
                         for i, p in zip(rows.tolist(), picks) if p]
                taken = [s for _, _, p in plans for s in p]
                if taken:
                    self._write_evictions(taken, self._drop_owners(taken))
                return plans
        wants = ((self.store.layers[int(lps[i])], np.flatnonzero(miss_LE[i]),
                  set(slots_LE[i][hit_LE[i]].tolist()) | protected)
                 for i in rows.tolist())  # lazily: the budget may end it early
        return self.reserve_for_layers(wants, budget)

    def _write_evictions(self, taken: list[int], evicted: np.ndarray) -> None:
        """The one table write of the evictions ``_drop_owners(taken)`` made on the host map (it returned
        ``evicted``). When it cannot be allocated (device OOM) the host map is put back, the slots that were empty
        are free again, and it raises."""
        gone = evicted[evicted >= 0]
        try:
            write = self._table_write(gone, np.full(gone.size, -1))
        except BaseException:
            self._undo_drop(taken, evicted)
            raise
        self._count_evictions(gone)
        self._apply([write])

    def _undo_drop(self, taken: list[int], evicted: np.ndarray) -> None:
        self._restore_owners(taken, evicted)
        self.release([s for s, k in zip(taken, evicted.tolist()) if k < 0])

    def _take(self, slots: list[int]) -> list[int]:
        """Take the policy's ``slots`` out of the map; when the eviction cannot be written the map is
        unchanged and the empty ones are free again (owned ones stay resident), and it raises."""
        self._write_evictions(slots, self._drop_owners(slots))
        return slots

    def release(self, slots: list[int]) -> None:
        """Reserved slots whose fill failed or was dropped: free again (the map never claimed them)."""
        for s in slots:
            self.policy.free(s)

    def commit(self, layer: int, experts: np.ndarray, slots: list[int]) -> None:
        """``slots`` now hold ``experts`` of ``layer`` (their copies are enqueued ahead of every reader the
        caller enqueues next). An expert that became resident elsewhere meanwhile keeps its slot and the
        reserved one is released."""
        self.commit_many([(layer, experts, slots)])

    def commit_many(self, fills: list[tuple[int, np.ndarray, list[int]]]) -> None:
        """``commit`` of each ``(layer, experts, slots)`` in ``fills``, in ONE table write; raises with the map
        unchanged (nothing committed, nothing released) when the write cannot be allocated. Array operations over
        every pair (a loop over pairs cost ~2 us a pair of host time between decode steps on a CI-class CPU)."""
        if not fills:
            return
        for layer, _, _ in fills:
            self.check_layer(layer, "commit (nothing committed)")
        e_P = np.concatenate([np.asarray(experts, dtype=np.int64) for _, experts, _ in fills])
        slot_P = np.concatenate([np.asarray(slots, dtype=np.int64) for _, _, slots in fills])
        # one check over the joined arrays (a boundary's host time is the GPU's wait): a key outside its layer would
        # name another layer's expert, a slot outside the pool a row that is not there
        if e_P.size and (e_P.min() < 0 or e_P.max() >= self.E or slot_P.min() < 0 or slot_P.max() >= self.num_slots):
            raise ValueError(f"commit of experts {e_P[(e_P < 0) | (e_P >= self.E)][:8].tolist()} / slots "
                             f"{slot_P[(slot_P < 0) | (slot_P >= self.num_slots)][:8].tolist()} outside 0..{self.E - 1} "
                             f"/ 0..{self.num_slots - 1}; nothing committed")
        key_P = np.concatenate([np.full(len(experts), self.layer_pos[layer] * self.E, dtype=np.int64)
                                for layer, experts, _ in fills]) + e_P
        lp_P, e_P = np.divmod(key_P, self.E)
        # an expert not resident yet keeps the first slot filled with it; the map as it was before this call decides
        fresh_P = np.flatnonzero(self.slot_of_LE[lp_P, e_P] < 0)
        _, first = np.unique(key_P[fresh_P], return_index=True)
        keep_P = fresh_P[first]  # key order: the keys are distinct, so the order changes nothing
        write = self._table_write(key_P[keep_P], slot_P[keep_P])  # may raise: nothing changed
        self._apply([write])  # the device table first: if it raises, the host map is as it was
        kept_P = np.zeros(slot_P.size, dtype=bool)
        kept_P[keep_P] = True
        # a slot left unkept is free again, unless it already holds its expert (committing twice keeps the slot)
        for s in slot_P[~kept_P & (self.owner_S[slot_P] != key_P)].tolist():  # in the pairs' order (the free list)
            self.policy.free(s)
        self.slot_of_LE[lp_P[keep_P], e_P[keep_P]] = slot_P[keep_P]
        self.owner_S[slot_P[keep_P]] = key_P[keep_P]
        np.add.at(self.count_L, lp_P[keep_P], 1)

    def admit(self, layer: int, experts: np.ndarray, copy: Callable[[list[int]], None],
              protected: set[int] = frozenset(), free_only: bool = False, within_share: bool = False) -> list[int]:
        """Give ``experts`` (of ``layer``, not resident) slots and fill them with ``copy(slots)``.

        Victims come from the policy, never from ``protected``; ``free_only`` takes free slots only
        (at most as many as there are; the rest of ``experts`` stay out); ``within_share`` (with
        ``cache.policy: balanced``) at most up to the layer's share. Returns the slots, in the order of
        the admitted experts (the first ``len(slots)`` of ``experts``)."""
        n = min(int(experts.size), self.num_free()) if free_only else int(experts.size)
        room = self.policy.room(self.layer_pos[layer], self.count_L) if within_share else None
        if room is not None:
            n = min(n, max(0, room))
        experts = np.asarray(experts[:n], dtype=np.int64)
        slots = self.reserve(n, protected, free_only)
        if not slots:
            return []
        try:
            copy(slots)
            self.commit(layer, experts, slots)  # raises with the map unchanged
        except BaseException:
            self.release(slots)
            raise
        return slots

    def clear(self) -> None:
        """Forget every resident expert (the caller has joined every reader of the pool)."""
        self._evict(list(range(self.num_slots)))
        for s in range(self.num_slots):
            self.policy.free(s)
