"""cache.policy: balanced (the default) keeps each MoE layer at its share of the slots; lru is one order over
every layer. Answers never depend on the policy; where the residents sit does (moe_offload/slot_pool.py)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.slot_pool import SlotPool
from moe_offload.stats import CacheStats


def make_engine(ckpt: str, *overrides: str) -> Engine:
    cfg = load_config(None, [f"model.checkpoint={ckpt}", "model.format=auto", "logging.level=WARNING",
                             "prefill.warmup_tokens=64", "decode.max_tokens=4", *overrides])
    return Engine.from_config(cfg, progress=False)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")


def per_layer(engine) -> list[int]:
    return engine.cache.pool.residency_map().sum(axis=1).tolist()


def test_shares_are_the_slots_split_evenly_over_the_layers_first_layers_one_more(ckpt):
    eng = make_engine(ckpt, "cache.budget=0.37")  # 4 layers x 16 experts: 23 slots
    pool = eng.cache.pool
    assert pool.num_slots == 23 and pool.policy.share_L.tolist() == [6, 6, 6, 5]


def test_the_warmup_prefill_fills_every_layer_to_its_share_where_lru_fills_the_first_layers(ckpt):
    # the warm-up prefill admits staged experts into free slots layer by layer: first come took every slot
    # for the first layers (their prefill then hides nothing while the empty layers are PCIe-bound)
    assert per_layer(make_engine(ckpt, "cache.budget=0.37")) == [6, 6, 6, 5]
    assert per_layer(make_engine(ckpt, "cache.budget=0.37", "cache.policy=lru")) == [16, 7, 0, 0]


def _pool(eng, num_slots: int) -> SlotPool:
    return SlotPool(eng.store, num_slots, "balanced", torch.device("cpu"), CacheStats())


def _fill(pool: SlotPool, layer_pos: int, experts: list[int]) -> list[int]:
    layer = pool.store.layers[layer_pos]
    slots = pool.reserve_for(layer, len(experts), set())
    pool.commit(layer, np.asarray(experts[:len(slots)]), slots)
    return slots


def test_a_layer_at_its_share_evicts_its_own_least_recently_used_expert(ckpt):
    eng = make_engine(ckpt, "prefill.warmup=false")
    pool = _pool(eng, 8)  # 4 layers: shares 2 each
    for lp in range(4):
        _fill(pool, lp, [0, 1])
    assert pool.count_L.tolist() == [2, 2, 2, 2] and pool.num_free() == 0
    layer0 = pool.store.layers[0]
    pool.policy.touch([int(pool.slot_of_LE[0, 0])])  # expert 0 of layer 0 used last: expert 1 is its LRU
    slot_of_1 = int(pool.slot_of_LE[0, 1])
    got = pool.reserve_for(layer0, 1, set())
    assert got == [slot_of_1] and pool.slot_of_LE[0, 1] == -1  # not another layer's older expert
    pool.commit(layer0, np.asarray([5]), got)
    assert pool.count_L.tolist() == [2, 2, 2, 2] and pool.slot_of_LE[0, 5] == slot_of_1
    # a protected slot (read by this step) is never a victim: with both protected there is none
    assert pool.reserve_for(layer0, 1, {int(pool.slot_of_LE[0, 0]), slot_of_1}) == []


def test_a_donor_gives_back_at_most_its_excess_and_the_rest_comes_from_the_layer_itself(ckpt):
    eng = make_engine(ckpt, "prefill.warmup=false")
    pool = _pool(eng, 8)  # shares 2 each
    layers = pool.store.layers
    pool.commit(layers[0], np.arange(3), pool.reserve(3))  # layer 0: one above its share
    pool.commit(layers[1], np.arange(2), pool.reserve(2))
    pool.commit(layers[2], np.arange(2), pool.reserve(2))
    pool.commit(layers[3], np.arange(1), pool.reserve(1))  # layer 3: one below, no free slot left
    assert pool.num_free() == 0 and pool.count_L.tolist() == [3, 2, 2, 1]
    got = pool.reserve_for(layers[3], 3, set())  # 1 from layer 0's excess, then 2 of its own (it holds 1)
    assert len(got) == 2 and pool.count_L.tolist() == [2, 2, 2, 0]


def test_a_layer_below_its_share_takes_free_slots_then_slots_of_layers_above_theirs(ckpt):
    eng = make_engine(ckpt, "prefill.warmup=false")
    pool = _pool(eng, 8)
    # an uneven start (set_residency places exactly what it is given): layer 0 holds 6, layer 1 holds 2
    layer0, layer1, layer2 = pool.store.layers[:3]
    s0 = pool.reserve(6)
    pool.commit(layer0, np.arange(6), s0)
    s1 = pool.reserve(2)
    pool.commit(layer1, np.arange(2), s1)
    assert pool.num_free() == 0 and pool.count_L.tolist() == [6, 2, 0, 0]
    got = pool.reserve_for(layer2, 3, set())  # layer 2 (share 2) has no free slot: layer 0 (6 > 2) gives
    assert len(got) == 2 and set(got) <= set(s0)  # back 2 of its excess: up to layer 2's share, not beyond
    pool.commit(layer2, np.asarray([7, 8]), got)
    assert pool.count_L.tolist() == [4, 2, 2, 0]
    # at its share, layer 2 only evicts its own experts (its least recently used)
    again = pool.reserve_for(layer2, 1, set())
    assert again and int(pool.owner_S[again[0]]) == -1 and again[0] in got
    pool.release(again)


def test_decode_admissions_keep_every_layer_at_its_share_and_answers_equal_lru(ckpt):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 300) for _ in range(n)] for n in (5, 40, 17, 64)]
    balanced = make_engine(ckpt, "cache.budget=0.37")
    lru = make_engine(ckpt, "cache.budget=0.37", "cache.policy=lru")
    full = make_engine(ckpt, "cache.budget=1.0")
    for p in prompts:
        want = full.generate(p, 12).token_ids
        assert balanced.generate(p, 12).token_ids == want and lru.generate(p, 12).token_ids == want
        pool = balanced.cache.pool
        # residents + admissions in flight fill the pool, no layer above its share
        assert (pool.count_L <= pool.policy.share_L).all()
    assert balanced.cache.stats()["total"]["evictions"] > 0  # decode admissions did evict


def test_a_prefill_commits_the_decode_admissions_left_in_flight_by_the_last_request(ckpt):
    eng = make_engine(ckpt, "cache.budget=0.37")
    eng.generate(list(range(5, 45)), 12)
    pool = eng.cache.pool
    in_flight = sum(len(v) for _, _, v in eng.cache.decode._pending)
    assert in_flight > 0 and pool.resident_count + in_flight == pool.num_slots
    eng.prefill(list(range(7, 80)), last_only=True)  # the next request's prefill
    assert eng.cache.decode._pending == [] and pool.resident_count == pool.num_slots


@given(st.lists(st.tuples(st.sampled_from(["touch", "free", "choose", "choose_free"]),
                          st.lists(st.integers(0, 23), max_size=12), st.integers(0, 6)), max_size=40))
@settings(max_examples=150, deadline=None)
def test_balanced_orders_slots_by_its_ticks_as_lru_orders_them_by_its_dict(ops):
    """The balanced policy keeps only clock ticks (one numpy write per touch, policy.py); its ``choose`` picks the
    slots ``LruPolicy.choose`` picks from the same history of touches, frees and choices (the ordered dict it
    no longer keeps), and touches take lists or int arrays alike."""
    from moe_offload.policy import BalancedLruPolicy, LruPolicy, PolicyError

    S = 24
    bal, lru = BalancedLruPolicy(S, 4), LruPolicy(S)
    for op, slots, n in ops:
        if op == "touch":
            bal.touch(np.asarray(slots, dtype=np.int64))
            lru.touch(slots)
        elif op == "free":
            for s in slots:
                bal.free(s)
                lru.free(s)
        else:
            outs = []
            for p in (bal, lru):
                try:
                    outs.append(p.choose_free(n) if op == "choose_free" else p.choose(n, set(slots)))
                except PolicyError:
                    outs.append("error")
            assert outs[0] == outs[1], (op, slots, n)
        assert bal.num_free == lru.num_free and bal._free == lru._free


def _layer_at_a_time(pool: SlotPool, wants: list, budget: int) -> list:
    """The decode boundary's admissions as they ran before ``reserve_for_layers`` (one table write per layer)."""
    plans, reserved = [], set()
    for layer, missed, protected in wants:
        if budget <= 0:
            break
        victims = pool.reserve_for(layer, min(int(missed.size), budget), protected | reserved)
        if victims:
            reserved.update(victims)
            plans.append((layer, missed[:len(victims)], victims))
            budget -= len(victims)
    return plans


def _state(pool: SlotPool):
    p = pool.policy
    order = p._tick.tolist() if hasattr(p, "_tick") else list(p._order)  # balanced: clock ticks; lru: its dict
    return (pool.slot_of_LE.tolist(), pool.owner_S.tolist(), pool.count_L.tolist(), pool.table_LE.tolist(),
            p._free, order, {lp: c.evictions for lp, c in pool.stats.layers.items()})


@pytest.fixture(scope="module")
def store(ckpt):
    return make_engine(ckpt, "prefill.warmup=false").store


def _lookup(pool: SlotPool, routed_L: list[list[int]]):
    """``routed_lookup``'s arrays for a step that routed ``routed_L[lp]`` in layer lp."""
    E = pool.E
    routed_LE = np.zeros((len(routed_L), E), dtype=bool)
    for lp, experts in enumerate(routed_L):
        routed_LE[lp, experts] = True
    slots_LE = pool.slot_of_LE.copy()
    return np.arange(len(routed_L)), slots_LE, routed_LE & (slots_LE >= 0), routed_LE & (slots_LE < 0)


def _admit_both(one: SlotPool, many: SlotPool, routed_L, protected: set[int], budget: int) -> list:
    """The same boundary on two equal pools: ``reserve_decode`` on ``many``, layer at a time on ``one``; both
    committed (``commit_many`` / ``commit`` per layer). Returns ``many``'s plans."""
    lps, slots_LE, hit_LE, miss_LE = _lookup(many, routed_L)
    got = many.reserve_decode(lps, slots_LE, hit_LE, miss_LE, set(protected), budget)
    lps, slots_LE, hit_LE, miss_LE = _lookup(one, routed_L)
    wants = [(one.store.layers[lp], np.flatnonzero(miss_LE[lp]), set(slots_LE[lp][hit_LE[lp]].tolist()) | protected)
             for lp in range(len(routed_L)) if miss_LE[lp].any()]
    want = _layer_at_a_time(one, wants, budget)
    assert [(la, e.tolist(), v) for la, e, v in got] == [(la, e.tolist(), v) for la, e, v in want]
    assert _state(many) == _state(one)
    many.commit_many(got)
    for layer, experts, victims in want:
        one.commit(layer, experts, victims)
    assert _state(many) == _state(one)
    assert np.array_equal(many.table_LE.numpy(), many.slot_of_LE)
    return got


@given(st.lists(st.tuples(st.lists(st.lists(st.integers(0, 15), max_size=6), min_size=4, max_size=4),
                          st.lists(st.integers(0, 23), max_size=4), st.integers(0, 10)), min_size=1, max_size=12),
       st.sampled_from(["balanced", "lru"]))
@settings(max_examples=60, deadline=None)
def test_a_boundary_admitting_all_layers_in_one_write_picks_the_slots_one_layer_at_a_time_did(store, steps, policy):
    """``SlotPool.reserve_decode`` (every layer's victims at once where the policy can, every eviction in one table
    write) and ``commit_many`` leave the map, the owners, the device table, the policy and the eviction counts
    exactly as ``reserve_for`` / ``commit`` layer by layer did, under random routing, protected slots and budgets,
    from an empty pool (free slots, layers below their shares) on."""
    one, many = (SlotPool(store, 24, policy, torch.device("cpu"), CacheStats()) for _ in range(2))
    for routed_L, protected, budget in steps:
        _admit_both(one, many, [sorted(set(r)) for r in routed_L], set(protected), budget)


def test_at_their_shares_every_layers_victims_are_picked_at_once_and_equal_one_layer_at_a_time(store, monkeypatch):
    """The steady state below residency 1 (every layer at its share, no free slot) takes the policy's at-once pick
    (``BalancedLruPolicy.own_victims``); its picks and ticks equal the layer-at-a-time ones over 80 random steps."""
    one, many = (SlotPool(store, 24, "balanced", torch.device("cpu"), CacheStats()) for _ in range(2))
    for pool in (one, many):
        for lp, layer in enumerate(store.layers):
            pool.commit(layer, np.arange(6), pool.reserve_for(layer, 6, set()))
    assert many.num_free() == 0 and (many.count_L == many.policy.share_L).all()
    at_once = []
    real = many.policy.own_victims
    monkeypatch.setattr(many.policy, "own_victims", lambda *a: at_once.append(r := real(*a)) or r)
    rng = random.Random(3)
    for _ in range(80):
        routed_L = [sorted(rng.sample(range(16), rng.randint(0, 6))) for _ in store.layers]
        protected = set(rng.sample(range(24), rng.randint(0, 3)))
        _admit_both(one, many, routed_L, protected, rng.randint(0, 10))
    assert sum(r is not None for r in at_once) >= 60  # the at-once pick served the boundaries
    assert many.stats.layer(store.layers[0]).evictions > 0


def test_a_boundary_whose_one_table_write_cannot_be_allocated_leaves_the_map_and_the_free_slots_as_they_were(
        ckpt, monkeypatch):
    """An OOM allocating the write of several layers' evictions: the host map is put back (owners, counts),
    the slots that were free are free again, nothing is counted as evicted, and it raises."""
    import moe_offload.slot_pool as slot_pool_mod

    eng = make_engine(ckpt, "prefill.warmup=false")
    pool = _pool(eng, 8)
    for lp in range(3):
        _fill(pool, lp, [0, 1])  # layers 0-2 at their shares (2), layer 3 empty, 2 slots free
    layers = pool.store.layers
    before = _state(pool)[:5]
    evictions = {lp: c.evictions for lp, c in pool.stats.layers.items()}

    def oom(*a, **k):  # fault injection: the device allocation of the table write
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(slot_pool_mod, "index_tensor", oom)
    wants = [(layers[0], np.asarray([5]), set()), (layers[1], np.asarray([6, 7]), set()),
             (layers[3], np.asarray([2, 3]), set())]  # evictions in layers 0 and 1, free slots for layer 3
    with pytest.raises(torch.OutOfMemoryError, match="injected"):
        pool.reserve_for_layers(iter(wants), 8)
    assert _state(pool)[:4] == before[:4] and sorted(pool.policy._free) == sorted(before[4])
    assert {lp: c.evictions for lp, c in pool.stats.layers.items()} == evictions
    monkeypatch.undo()
    got = pool.reserve_for_layers(iter(wants), 8)  # the same admissions go through afterwards
    assert [len(v) for _, _, v in got] == [1, 2, 2]
    pool.commit_many(got)
    assert np.array_equal(pool.table_LE.numpy(), pool.slot_of_LE) and pool.count_L.tolist() == [2, 2, 2, 2]


@given(st.lists(st.integers(0, 23), unique=True, max_size=24), st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_dropping_owners_by_loop_or_by_vector_calls_leaves_the_same_map(store, slots, seed):
    """``SlotPool._drop_owners`` takes a plain loop up to ``_FEW`` slots and numpy's vector calls above: the same map,
    counts and keys either way, and ``_restore_owners`` puts it back."""
    import moe_offload.slot_pool as slot_pool_mod

    def filled() -> SlotPool:  # the same random residency each call
        rng = np.random.default_rng(seed)
        pool = SlotPool(store, 24, "balanced", torch.device("cpu"), CacheStats())
        for layer in store.layers:
            n = int(rng.integers(0, 7))
            pool.commit(layer, np.sort(rng.choice(16, n, replace=False)), pool.reserve(n))
        return pool

    after = []
    for few in (0, 64):  # every call by numpy's vector calls / every call by the loop
        pool = filled()
        before = [pool.slot_of_LE.copy(), pool.owner_S.copy(), pool.count_L.copy()]
        orig, slot_pool_mod._FEW = slot_pool_mod._FEW, few
        try:
            keys = pool._drop_owners(slots)
        finally:
            slot_pool_mod._FEW = orig
        after.append([pool.slot_of_LE.copy(), pool.owner_S.copy(), pool.count_L.copy(), keys])
        pool._restore_owners(slots, keys)
        assert all(np.array_equal(x, y) for x, y in zip(before, [pool.slot_of_LE, pool.owner_S, pool.count_L]))
    assert all(np.array_equal(x, y) for x, y in zip(*after))


def _commit_reference(pool: SlotPool, fills) -> None:
    """``SlotPool.commit`` as a loop over pairs, fill by fill (its form before ``commit_many``'s array operations)."""
    for layer, experts, slots in fills:
        lp = pool.layer_pos[layer]
        pairs = list(zip(np.asarray(experts).tolist(), slots))
        keep: dict[int, int] = {}
        for e, s in pairs:
            if pool.slot_of_LE[lp, e] < 0:
                keep.setdefault(e, s)
        kept = set(keep.values())
        for e, s in pairs:
            if s not in kept and pool.slot_of_LE[lp, e] != s:
                pool.policy.free(s)
        for e, s in keep.items():
            pool.slot_of_LE[lp, e] = s
            pool.owner_S[s] = lp * pool.E + e
        pool.count_L[lp] += len(keep)
        pool.table_LE[lp, list(keep)] = torch.tensor(list(keep.values()), dtype=torch.int32)


@given(st.integers(0, 2**32 - 1), st.integers(1, 4))
@settings(max_examples=80, deadline=None)
def test_commit_many_leaves_the_map_and_free_list_of_committing_pair_by_pair(store, seed, n_fills):
    """Fills of reserved slots where an expert may repeat within a fill (its first slot keeps it, the others are
    free again), may already be resident (every slot of it is free again) or may be committed twice (its slot is
    kept): ``commit_many`` (array operations, one table write) against the loop it replaced."""
    pools = []
    for commit in ("many", "reference"):
        rng = np.random.default_rng(seed)
        pool = SlotPool(store, 24, "balanced", torch.device("cpu"), CacheStats())
        for layer in store.layers:  # some residents already
            n = int(rng.integers(0, 4))
            pool.commit(layer, np.sort(rng.choice(16, n, replace=False)), pool.reserve(n))
        fills = []
        for layer in rng.choice(store.layers, n_fills, replace=False).tolist():
            n = int(rng.integers(0, min(5, pool.num_free()) + 1))
            slots = pool.reserve(n, free_only=True)
            experts = rng.integers(0, 16, n)  # repeats and residents included
            if n and rng.random() < 0.3:  # commit a pair that already holds its expert
                held = np.flatnonzero(pool.slot_of_LE[pool.layer_pos[layer]] >= 0)
                if held.size:
                    e = int(held[0])
                    experts = np.append(experts, e)
                    slots = slots + [int(pool.slot_of_LE[pool.layer_pos[layer], e])]
            fills.append((layer, experts, slots))
        if commit == "many":
            pool.commit_many(fills)
        else:
            _commit_reference(pool, fills)
        pools.append(pool)
    a, b = pools
    assert np.array_equal(a.slot_of_LE, b.slot_of_LE) and np.array_equal(a.owner_S, b.owner_S)
    assert np.array_equal(a.count_L, b.count_L) and a.policy._free == b.policy._free
    assert np.array_equal(a.table_LE.numpy(), b.table_LE.numpy()) and np.array_equal(a.table_LE.numpy(), a.slot_of_LE)
