"""Eviction policies: pure logic over slot ids (no tensors, no copies). The cache owns memory.

A policy answers one question: which slots should receive new experts, given the slots that must
not be touched now (read by this step or written by a copy in flight).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class PolicyError(RuntimeError):
    pass


class LruPolicy:
    """Least recently used: free slots first, then the slot touched longest ago."""

    name = "lru"

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(num_slots))
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() yields slot 0 first

    def touch(self, slots: Iterable[int]) -> None:
        for s in slots:
            self._order.move_to_end(s)

    def free(self, slot: int) -> None:
        """Mark ``slot`` empty (its expert was dropped)."""
        self._free.append(slot)
        self._order.move_to_end(slot, last=False)

    def choose(self, n: int, protected: set[int]) -> list[int]:
        """``n`` slots to (re)fill, never one in ``protected``; most-recent use order is updated."""
        picked: list[int] = []
        while self._free and len(picked) < n:
            s = self._free.pop()
            if s in protected:
                continue
            picked.append(s)
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
        self._free = [s for s in self._free if s not in set(picked)]
        self.touch(picked)
        return picked


def make_policy(name: str, num_slots: int):
    if name == "lru":
        return LruPolicy(num_slots)
    raise PolicyError(f"unknown cache.policy {name!r}; accepted: lru")
