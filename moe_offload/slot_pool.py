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
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from moe_offload.copy_paths import index_tensor
from moe_offload.host_store import bank_views
from moe_offload.policy import make_policy
from moe_offload.stats import CacheStats


class SlotPool:
    """``num_slots`` device rows of ``store.bytes_per_expert`` bytes and the residency map over them."""

    def __init__(self, store, num_slots: int, policy: str, device: torch.device, stats: CacheStats,
                 scratch_rows: int = 0):
        self.store, self.device, self.stats = store, device, stats
        self.num_slots = num_slots
        self.E = store.num_experts
        self.layer_pos = {layer: i for i, layer in enumerate(store.layers)}
        # rows 0..S-1 are slots, S..S+X-1 decode scratch rows (misses of one decode step, never resident)
        self.rows_NR = torch.empty((num_slots + scratch_rows, store.bytes_per_expert), dtype=torch.uint8, device=device)
        self.rows_SR = self.rows_NR[:num_slots]
        self.slot_of_LE = np.full((len(store.layers), self.E), -1, dtype=np.int32)
        self.table_LE = torch.full((len(store.layers), self.E), -1, dtype=torch.int32, device=device)
        self.owner_S = np.full(num_slots, -1, dtype=np.int64)
        self.policy = make_policy(policy, num_slots)

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

    def views(self) -> dict[str, torch.Tensor]:
        """Typed per-bank views ``[S + X, ...]`` of the pool, scratch rows included (rows read in place)."""
        return bank_views(self.store.specs, self.store.offsets, self.rows_NR)

    # ---------------------------------------------------------------- changing the map
    def _write_table(self, lp: int, experts: np.ndarray, values: np.ndarray) -> None:
        if experts.size == 0:
            return
        idx = index_tensor(experts, self.device)
        vals = index_tensor(values, self.device).to(torch.int32)
        self.table_LE[lp].index_copy_(0, idx, vals)

    def _evict(self, slots: list[int]) -> None:
        """Drop the owners of ``slots`` from both maps (device table on the current stream)."""
        by_layer: dict[int, list[int]] = {}
        for s in slots:
            key = int(self.owner_S[s])
            if key >= 0:
                lp, e = divmod(key, self.E)
                self.slot_of_LE[lp, e] = -1
                by_layer.setdefault(lp, []).append(e)
                self.stats.layer(self.store.layers[lp]).evictions += 1
            self.owner_S[s] = -1
        for lp, es in by_layer.items():
            e_arr = np.asarray(es, dtype=np.int64)
            self._write_table(lp, e_arr, np.full(e_arr.size, -1, dtype=np.int64))

    def reserve(self, n: int, protected: set[int] = frozenset(), free_only: bool = False) -> list[int]:
        """``n`` slots to fill, taken out of the map now (their old experts are no longer resident);
        never a slot in ``protected``. Fill them, then ``commit`` (or ``release`` on failure)."""
        if n == 0:
            return []
        slots = self.policy.choose_free(n) if free_only else self.policy.choose(n, set(protected))
        self._evict(slots)
        return slots

    def release(self, slots: list[int]) -> None:
        """Reserved slots whose fill failed or was dropped: free again (the map never claimed them)."""
        for s in slots:
            self.policy.free(s)

    def commit(self, layer: int, experts: np.ndarray, slots: list[int]) -> None:
        """``slots`` now hold ``experts`` of ``layer`` (their copies are enqueued ahead of every reader the
        caller enqueues next). An expert that became resident elsewhere meanwhile keeps its slot and the
        reserved one is released."""
        lp = self.layer_pos[layer]
        keep_e, keep_s = [], []
        for e, s in zip(np.asarray(experts).tolist(), slots):
            if self.slot_of_LE[lp, e] >= 0:
                self.policy.free(s)
                continue
            self.slot_of_LE[lp, e] = s
            self.owner_S[s] = lp * self.E + e
            keep_e.append(e)
            keep_s.append(s)
        self._write_table(lp, np.asarray(keep_e, dtype=np.int64), np.asarray(keep_s, dtype=np.int64))

    def admit(self, layer: int, experts: np.ndarray, copy: Callable[[list[int]], None],
              protected: set[int] = frozenset(), free_only: bool = False) -> list[int]:
        """Give ``experts`` (of ``layer``, not resident) slots and fill them with ``copy(slots)``.

        Victims come from the policy, never from ``protected``; ``free_only`` takes free slots only
        (at most as many as there are; the rest of ``experts`` stay out). Returns the slots, in the
        order of the admitted experts (the first ``len(slots)`` of ``experts``)."""
        n = min(int(experts.size), self.num_free()) if free_only else int(experts.size)
        experts = np.asarray(experts[:n], dtype=np.int64)
        slots = self.reserve(n, protected, free_only)
        if not slots:
            return []
        try:
            copy(slots)
        except BaseException:
            self.release(slots)
            raise
        self.commit(layer, experts, slots)
        return slots

    def clear(self) -> None:
        """Forget every resident expert (the caller has joined every reader of the pool)."""
        self._evict(list(range(self.num_slots)))
        for s in range(self.num_slots):
            self.policy.free(s)
