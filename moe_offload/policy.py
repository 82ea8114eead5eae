"""Eviction policies: pure logic over slot ids (no tensors, no copies). The cache owns memory.

A policy answers one question: which slots should receive new experts, given the slots that must
not be touched now (read by this step or written by a copy in flight). ``FrequencyAdmission`` answers the one
before it at a decode boundary: which missed experts are worth a slot at all (``cache.admit_filter``).
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
        for s in (slots.tolist() if isinstance(slots, np.ndarray) else slots):
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

    def room(self, lp: int, count_L: np.ndarray) -> int | None:
        """How many more experts layer ``lp`` may take into free slots (None: no limit)."""
        return None

    def victims_for(self, lp: int, n: int, protected: set[int], count_L: np.ndarray,
                    slot_of_LE: np.ndarray) -> list[int]:
        """Up to ``n`` slots for new experts of layer ``lp``, never one in ``protected``: free slots first,
        then the least recently used of any layer. ``count_L`` [L] residents per layer, ``slot_of_LE``
        [L, E] the map (-1 = not resident), both read only."""
        n = max(0, min(n, self.num_slots - len(protected)))
        return self.choose(n, protected) if n else []

    def choose(self, n: int, protected: set[int]) -> list[int]:
        """``n`` slots to (re)fill, never one in ``protected``; most-recent use order is updated."""
        picked = [s for s in reversed(self._free) if s not in protected][:n]
        if len(picked) < n:
            picked += self._least_recent_filled(n - len(picked), set(protected) | set(picked))
        if len(picked) < n:
            raise PolicyError(
                f"need {n} slots but only {len(picked)} are not in use by this step; raise cache.budget"
            )
        chosen = set(picked)
        self._free = [s for s in self._free if s not in chosen]
        self._free_set.difference_update(chosen)
        self.touch(picked)
        return picked

    def _least_recent_filled(self, n: int, excluded: set[int]) -> list[int]:
        """Up to ``n`` slots not in ``excluded``, least recently used first (``choose``'s second pick; every free
        slot that is not excluded was taken by its first)."""
        picked = []
        for s in self._order:
            if len(picked) == n:
                break
            if s not in excluded:
                picked.append(s)
        return picked


class BalancedLruPolicy(LruPolicy):
    """LRU within equal per-layer shares of the slots (S // L, the first S % L layers one more): a layer takes
    free slots up to its share; below it with none free, the least recently used experts of layers above
    their share (each down to its share at most); the rest from its own least recently used experts. Why
    shares: ``slot_pool.py``'s module docstring. Each touch also stamps the slot with a clock tick, so the
    least recently used among a layer's few candidates is one numpy argsort (a scan of the global order
    for them cost up to ~70 ms per decode boundary at 48 layers x 2,270 slots)."""

    name = "balanced"

    def __init__(self, num_slots: int, num_layers: int):
        super().__init__(num_slots)
        self.share_L = np.full(num_layers, num_slots // num_layers, dtype=np.int64)
        self.share_L[:num_slots % num_layers] += 1
        self._tick = np.zeros(num_slots, dtype=np.int64)
        self._clock = 0

    def touch(self, slots: Iterable[int]) -> None:
        """Stamp ``slots`` (a list or an int array; later ones more recent) with the next clock ticks: one numpy
        assignment. Only the ticks order this policy's choices (``_least_recent``, ``_least_recent_filled``), so
        the base class's ordered dict is not kept: its per-slot moves cost ~0.8 ms of host time per decode
        boundary at batch 16 (48 layers x ~82 routed experts touched), while the GPU waited for the next step."""
        idx = np.asarray(slots if isinstance(slots, np.ndarray) else list(slots), dtype=np.int64)
        if idx.size:
            self._tick[idx] = np.arange(self._clock + 1, self._clock + 1 + idx.size)
            self._clock += int(idx.size)

    def _least_recent_filled(self, n: int, excluded: set[int]) -> list[int]:
        """``LruPolicy._least_recent_filled`` by the ticks (free slots left out: ``choose`` took them first)."""
        mask = np.ones(self.num_slots, dtype=bool)
        mask[list(excluded | self._free_set)] = False
        rest = np.flatnonzero(mask)
        return rest[np.argsort(self._tick[rest], kind="stable")[:n]].tolist()

    def room(self, lp: int, count_L: np.ndarray) -> int | None:
        return int(self.share_L[lp] - count_L[lp])

    def victims_for(self, lp, n, protected, count_L, slot_of_LE) -> list[int]:
        room = self.room(lp, count_L)
        n_free = min(n, max(0, room), self.num_free)
        slots = self.choose_free(n_free) if n_free else []
        want = n - n_free
        lend = min(want, max(0, room - n_free))  # still below its share: other layers give back their excess
        if lend > 0:
            excess = count_L - self.share_L
            for donor in np.argsort(-excess, kind="stable").tolist():
                if lend == 0 or excess[donor] <= 0:
                    break
                got = self._least_recent(_held(slot_of_LE[donor], protected), min(lend, int(excess[donor])))
                slots += got
                lend -= len(got)
                want -= len(got)
        if want > 0:
            slots += self._least_recent(_held(slot_of_LE[lp], protected), want)
        return slots

    def own_victims(self, lps: np.ndarray, slots_LE: np.ndarray, usable_LE: np.ndarray, want_L: np.ndarray,
                    count_L: np.ndarray, budget: int) -> list[list[int]] | None:
        """``victims_for`` of layers ``lps`` in turn, all at once, where it reduces to each layer's own least recently
        used slots: every one of them at or above its share (then no free slot or loan is taken, and one layer's
        evictions change no other layer's pick). Row i: layer ``lps[i]``'s map row ``slots_LE[i]``, the slots it may
        give up ``usable_LE[i]``, and how many it wants, ``want_L[i]``; at most ``budget`` in all, the earlier rows
        first. Returns each row's victims, least recently used first, touched row after row as ``victims_for``
        touches them (the same ticks); None where a layer is below its share."""
        if (count_L[lps] < self.share_L[lps]).any():
            return None
        can_L = np.minimum(want_L, usable_LE.sum(axis=1))
        take_L = np.clip(budget - (np.cumsum(can_L) - can_L), 0, can_L)  # the budget runs out row by row
        live = np.flatnonzero(take_L)  # only these rows are sorted (with a budget of 64 ~13 of 48 at 0.37)
        picks: list[list[int]] = [[] for _ in range(len(take_L))]
        if live.size:
            s_LE = slots_LE[live]
            ticks_LE = np.where(usable_LE[live], self._tick[np.maximum(s_LE, 0)], np.iinfo(np.int64).max)
            order_LE = np.argsort(ticks_LE, axis=1, kind="stable")  # ties (never-touched slots) in expert order
            for j, (i, k) in enumerate(zip(live.tolist(), take_L[live].tolist())):
                picks[i] = s_LE[j, order_LE[j, :k]].tolist()
            self.touch([s for p in picks for s in p])
        return picks

    def _least_recent(self, candidates: np.ndarray, n: int) -> list[int]:
        """The ``n`` least recently used of ``candidates`` (filled slots; fewer when there are fewer)."""
        n = min(n, int(candidates.size))
        if n <= 0:
            return []
        picked = candidates[np.argsort(self._tick[candidates], kind="stable")[:n]].tolist()
        self.touch(picked)
        return picked


def _held(slots_E: np.ndarray, protected: set[int]) -> np.ndarray:
    """The slots of one layer's map row that hold an expert and are not in ``protected``."""
    held = slots_E[slots_E >= 0]
    if protected:
        held = np.fromiter((s for s in held.tolist() if s not in protected), dtype=np.int64)
    return held


#: ``cache.admit_filter: frequency``: the weight of a routing after each later boundary (a routing counts half after ~23
#: boundaries). On the routing model of benchmarks/boundary_host.py 0.97 kept 0.1-0.3 points more hits than 0.9.
FREQUENCY_DECAY = 0.97


class FrequencyAdmission:
    """TinyLFU's admission test for decode boundaries: a missed expert is admitted only when it was routed, before
    this boundary, at least as often (counts decayed by FREQUENCY_DECAY a boundary) as the least routed resident its
    layer could give up (resident, not routed now), or when its layer may take a free slot. An expert missed once in
    a while is read from host memory and evicts nothing; one routed often replaces a resident routed less. A prompt's
    residents that decode never routes count 0, so after a prefill every miss is admitted at once (README
    Decisions)."""

    def __init__(self, num_layers: int, num_experts: int):
        self.freq_LE = np.zeros((num_layers, num_experts), dtype=np.float32)

    def admit(self, lps: np.ndarray, slots_LE: np.ndarray, hit_LE: np.ndarray, miss_LE: np.ndarray, policy,
              count_L: np.ndarray) -> np.ndarray:
        """The misses of layers ``lps`` (rows of ``decode_boundary.routed_lookup``) worth a slot under ``policy``; then
        the counts take this boundary's routing."""
        f_LE = self.freq_LE[lps] * FREQUENCY_DECAY
        free_L = np.zeros(len(lps), dtype=bool)
        if policy.num_free > 0:
            rooms = [policy.room(int(lp), count_L) for lp in lps.tolist()]
            free_L[:] = [r is None or r > 0 for r in rooms]
        bar_L = np.where((slots_LE >= 0) & ~hit_LE, f_LE, np.inf).min(axis=1)
        bar_L[free_L] = -np.inf
        keep_LE = miss_LE & (f_LE >= bar_L[:, None])
        f_LE += hit_LE | miss_LE
        self.freq_LE[lps] = f_LE
        return keep_LE


def make_admission(name: str, num_layers: int, num_experts: int) -> FrequencyAdmission | None:
    """``cache.admit_filter``: None for "none" (every miss may be admitted)."""
    if name == "none":
        return None
    if name == "frequency":
        return FrequencyAdmission(num_layers, num_experts)
    raise ValueError(f"admit_filter {name!r}: none or frequency")


def make_policy(name: str, num_slots: int, num_layers: int):
    if name == "lru":
        return LruPolicy(num_slots)
    if name == "balanced":
        return BalancedLruPolicy(num_slots, num_layers)
    raise PolicyError(f"unknown cache.policy {name!r}; accepted: balanced, lru")
