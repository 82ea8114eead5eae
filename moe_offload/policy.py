"""Eviction policies: pure logic over slot ids (no tensors, no copies). The cache owns memory.

A policy answers one question: which slots should receive new experts, given the slots that must
not be touched now (read by this step or written by a copy in flight).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

import numpy as np


class PolicyError(RuntimeError):
    pass


class LruPolicy:
    """Least recently used: free slots first, then the slot touched longest ago."""

    name = "lru"

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() yields slot 0 first
        self._free_set: set[int] = set(self._free)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def touch(self, slots: Iterable[int]) -> None:
        for s in slots:
            self._order.move_to_end(s)

    def free(self, slot: int) -> None:
        """Mark ``slot`` empty (its expert was dropped); freeing a free slot changes nothing."""
        if slot in self._free_set:
            return
        self._free_set.add(slot)
        self._free.append(slot)
        self._order.move_to_end(slot, last=False)

    def choose_free(self, n: int) -> list[int]:
        """``n`` free slots (the caller checked there are that many); raises ``PolicyError`` otherwise."""
        if n > len(self._free):
            raise PolicyError(f"need {n} free slots but {len(self._free)} are free")
        picked = [self._free.pop() for _ in range(n)]
        self._free_set.difference_update(picked)
        self.touch(picked)
        return picked

    def choose(self, n: int, protected: set[int]) -> list[int]:
        """``n`` slots to (re)fill, never one in ``protected``; most-recent use order is updated."""
        picked = [s for s in reversed(self._free) if s not in protected][:n]
        if len(picked) < n:
            chosen = set(picked)
            for s in self._order:
                if len(picked) == n:
                    break
                if s not in protected and s not in chosen:
                    picked.append(s)
        if len(picked) < n:
            raise PolicyError(
                f"need {n} slots but only {len(picked)} are not in use by this step; raise cache.budget"
            )
        chosen = set(picked)
        self._free = [s for s in self._free if s not in chosen]
        self._free_set.difference_update(chosen)
        self.touch(picked)
        return picked


class BalancedLruPolicy(LruPolicy):
    """LRU order within equal per-layer shares of the slots; the shares themselves are kept by the slot pool,
    which knows each slot's layer (``slot_pool.SlotPool.reserve_for``). Each touch also stamps the slot with
    a clock tick, so the least recently used among a layer's few candidates is one numpy argsort (a scan of
    the global order for them cost up to ~70 ms per decode boundary at 48 layers x 2,270 slots)."""

    name = "balanced"

    def __init__(self, num_slots: int):
        super().__init__(num_slots)
        self._tick = np.zeros(num_slots, dtype=np.int64)
        self._clock = 0

    def touch(self, slots: Iterable[int]) -> None:
        slots = list(slots)
        super().touch(slots)
        if slots:
            self._tick[slots] = np.arange(self._clock + 1, self._clock + 1 + len(slots))
            self._clock += len(slots)

    def choose_lru(self, candidates: np.ndarray, n: int) -> list[int]:
        """The ``n`` least recently used of ``candidates`` (filled slots; fewer when there are fewer);
        most-recent use order is updated."""
        n = min(n, int(candidates.size))
        if n <= 0:
            return []
        picked = candidates[np.argsort(self._tick[candidates], kind="stable")[:n]].tolist()
        self.touch(picked)
        return picked


def make_policy(name: str, num_slots: int):
    if name == "lru":
        return LruPolicy(num_slots)
    if name == "balanced":
        return BalancedLruPolicy(num_slots)
    raise PolicyError(f"unknown cache.policy {name!r}; accepted: balanced, lru")
