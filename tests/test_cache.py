"""OffloadMoeCache: invariants under random routing, budgets, and the logged hit-path fallback."""

import io
import json
import random

import numpy as np
import pytest
import torch

from moe_offload import log
from moe_offload.cache import BudgetError, OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig, load_config
from moe_offload.hit_copy import HitPathUnavailable
from moe_offload.engine import Engine
from moe_offload.host_store import ExpertStore


def _store(tiny_ckpt, fmt="nvfp4-modelopt"):
    return ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", fmt), progress=False)


def _cache(store, budget, **prefill):
    return OffloadMoeCache(store, CacheConfig(budget=budget), PrefillConfig(**prefill), "cpu")


def _check_invariants(cache):
    pool = cache.pool
    owners = pool.owner_S[pool.owner_S >= 0]
    assert len(set(owners.tolist())) == owners.size  # a slot has at most one owner, an expert one slot
    lp, e = np.nonzero(pool.slot_of_LE >= 0)
    for l_, e_ in zip(lp.tolist(), e.tolist()):
        assert pool.owner_S[pool.slot_of_LE[l_, e_]] == l_ * cache.E + e_  # map and owners agree
    assert (pool.slot_of_LE >= 0).sum() == owners.size
    assert np.array_equal(pool.table_LE.cpu().numpy(), pool.slot_of_LE)  # device table == host map


def _decode_step(cache, ids_by_layer, check=None):
    """One decode step through the cache's decode path: boundary, every layer's rows, step end.
    ``check(layer, rows_TK)`` runs right after the layer's rows, as its compute would (scratch rows
    are reused by the next layer)."""
    cache.step_boundary()
    rows = {}
    for layer, ids in ids_by_layer.items():
        rows[layer] = cache.decode_rows(layer, ids)
        if check is not None:
            check(layer, rows[layer])
    cache.decode_step_enqueued()
    return rows


def test_decode_rows_hold_the_routed_experts_bytes_under_random_routing(tiny_ckpt):
    """Every routed pair's row (slot or scratch) holds its expert's host bytes, whatever the residency;
    admissions between steps keep the map, the owners and the device table in agreement."""
    store = _store(tiny_ckpt)
    cache = _cache(store, "24 slots")  # 24 of 64 experts: hits, misses and evictions all happen
    rng = random.Random(0)
    K = store.geometry.top_k
    for step in range(200):
        T = rng.choice([1, 2, 3])
        ids = {layer: torch.tensor([rng.sample(range(store.num_experts), K) for _ in range(T)])
               for layer in store.layers}
        def check(layer, rows_TK):
            for e, r in zip(ids[layer].flatten().tolist(), rows_TK.flatten().tolist()):
                assert torch.equal(cache.pool.rows_NR[r], store.rows(layer)[e])
                slot = cache.resident(layer)[e]
                assert r == slot if slot >= 0 else r >= cache.num_slots  # resident: read in place

        _decode_step(cache, ids, check)
        _check_invariants(cache)
    st = cache.stats()["total"]
    assert st["misses"] >= 24 and st["hits"] > 0  # the pool is smaller than the routed set
    # a miss read from host memory once per step per distinct expert, however many pairs route it
    assert 0 < st["bytes"]["decode_uva"] <= st["misses"] * store.bytes_per_expert
    assert st["bytes"]["decode_h2d"] > 0 and st["evictions"] > 0  # admissions replaced residents
    assert cache.stats()["decode_steps"] == 200


def test_a_missed_expert_is_admitted_at_the_second_boundary_after_its_step(tiny_ckpt):
    store = _store(tiny_ckpt)
    cache = _cache(store, "1.0")
    layer = store.layers[0]
    ids = torch.tensor([[1, 5, 9, 13]])
    _decode_step(cache, {layer: ids})
    assert (cache.resident(layer)[[1, 5, 9, 13]] < 0).all()  # served from host memory this step
    cache.step_boundary()  # reads the step's routing, enqueues the admission copies
    assert (cache.resident(layer)[[1, 5, 9, 13]] < 0).all()  # not claimed before the copy is done
    cache.step_boundary()
    slots = cache.resident(layer)[[1, 5, 9, 13]]
    assert (slots >= 0).all()
    rows = _decode_step(cache, {layer: ids})[layer]
    assert rows.flatten().tolist() == slots.tolist()  # now read in place from the slots
    _check_invariants(cache)


def _full_layer(store, admit_filter, resident):
    """A cache of exactly ``len(resident)`` slots per layer, the first layer holding ``resident``."""
    slots = len(resident) * len(store.layers)
    cache = OffloadMoeCache(store, CacheConfig(budget=f"{slots} slots", admit_filter=admit_filter), PrefillConfig(),
                            "cpu")
    cache.set_residency({layer: list(resident) for layer in store.layers})
    return cache


def test_the_frequency_filter_admits_an_expert_routed_as_often_as_its_victim_not_one_routed_once(tiny_ckpt):
    """cache.admit_filter frequency: with the layer full, an expert missed once does not evict a resident routed at
    every step; one routed at every step does, and evicts the resident decode never routes."""
    store = _store(tiny_ckpt)
    layer = store.layers[0]
    cache = _full_layer(store, "frequency", [0, 1, 2, 3])  # 3 is never routed below
    steps = [[0, 1, 2, 9], [0, 1, 2, 9], [0, 1, 2, 5], [0, 1, 2, 9]]  # 9 at every step but one; 5 once
    for ids in steps:
        _decode_step(cache, {layer: torch.tensor([ids])})
    cache.step_boundary()
    cache.step_boundary()
    resident = cache.resident(layer)
    assert (resident[[0, 1, 2, 9]] >= 0).all()  # 9 replaced 3, the resident never routed
    assert resident[3] < 0 and resident[5] < 0  # 5, routed once, evicted nothing
    _check_invariants(cache)


def test_the_frequency_filter_admits_every_miss_into_free_slots_and_in_place_of_unrouted_residents(tiny_ckpt):
    """After a prompt decode routes elsewhere: the residents it never routes count nothing, so every miss is admitted
    at the first boundary, as without the filter."""
    store = _store(tiny_ckpt)
    layer = store.layers[0]
    for admit_filter in ("frequency", "none"):
        cache = _full_layer(store, admit_filter, [0, 1, 2, 3])
        _decode_step(cache, {layer: torch.tensor([[4, 5, 6, 7]])})
        cache.step_boundary()
        cache.step_boundary()
        assert (cache.resident(layer)[[4, 5, 6, 7]] >= 0).all(), admit_filter
    cache = _cache(store, "1.0")  # free slots: admitted whatever the counts
    _decode_step(cache, {layer: torch.tensor([[1, 5, 9, 13]])})
    cache.step_boundary()
    cache.step_boundary()
    assert (cache.resident(layer)[[1, 5, 9, 13]] >= 0).all()


def test_without_the_filter_an_expert_routed_once_evicts_one_routed_at_every_step(tiny_ckpt):
    """The churn the frequency filter prevents: the same routing, every miss admitted."""
    store = _store(tiny_ckpt)
    layer = store.layers[0]
    cache = _full_layer(store, "none", [0, 1, 2, 3])
    for ids in ([0, 1, 2, 9], [0, 1, 2, 9], [0, 1, 2, 5]):
        _decode_step(cache, {layer: torch.tensor([ids])})
    cache.step_boundary()
    cache.step_boundary()
    resident = cache.resident(layer)
    assert resident[5] >= 0 and resident[9] < 0 and resident[3] < 0


def test_read_late_a_boundary_admits_from_the_step_before_the_one_in_flight(tiny_ckpt):
    """decode.run_ahead's boundaries (``set_late``): the boundary before step 3 runs while step 2 may be in flight, so
    it admits step 1's misses, not step 2's; they are committed at the next boundary, as always."""
    store = _store(tiny_ckpt)
    cache = _cache(store, "1.0")
    cache.decode.set_late(True)
    layer = store.layers[0]
    first, second = [1, 5, 9, 13], [2, 6, 10, 14]
    _decode_step(cache, {layer: torch.tensor([first])})  # step 1
    _decode_step(cache, {layer: torch.tensor([second])})  # step 2: its boundary snapshots step 1's record
    assert cache.stats()["total"]["bytes"]["decode_h2d"] == 0 and cache.decode._pending == []
    _decode_step(cache, {layer: torch.tensor([[3, 7, 11, 15]])})  # step 3: its boundary admits step 1's misses
    assert [(lay, e.tolist()) for lay, e, _ in cache.decode._pending] == [(layer, first)]
    assert (cache.resident(layer)[first + second] < 0).all()
    _decode_step(cache, {layer: torch.tensor([first])})  # step 4: commits step 1's, admits step 2's
    assert (cache.resident(layer)[first] >= 0).all() and (cache.resident(layer)[second] < 0).all()
    assert [(lay, e.tolist()) for lay, e, _ in cache.decode._pending] == [(layer, second)]
    _check_invariants(cache)
    cache.decode.set_late(False)
    cache.step_boundary()  # not late: step 2's admissions committed, step 4's record read as usual (all hits)
    assert (cache.resident(layer)[first + second] >= 0).all() and cache.decode._pending == []
    _check_invariants(cache)


def test_read_late_decoding_keeps_the_map_true_and_admits_under_random_routing(tiny_ckpt):
    """Read late at a budget with hits, misses and evictions: every routed row holds its expert's bytes and the map,
    the owners and the device table agree after every step; admissions and evictions happen."""
    store = _store(tiny_ckpt)
    cache = _cache(store, "24 slots")
    cache.decode.set_late(True)
    rng = random.Random(1)
    K = store.geometry.top_k
    for _ in range(120):
        ids = {layer: torch.tensor([rng.sample(range(10), K) for _ in range(rng.choice([1, 2]))])
               for layer in store.layers}

        def check(layer, rows_TK):
            for e, r in zip(ids[layer].flatten().tolist(), rows_TK.flatten().tolist()):
                assert torch.equal(cache.pool.rows_NR[r], store.rows(layer)[e])

        _decode_step(cache, ids, check)
        _check_invariants(cache)
        assert (cache.pool.count_L <= cache.pool.policy.share_L).all()
    st = cache.stats()["total"]
    assert st["bytes"]["decode_h2d"] > 0 and st["evictions"] > 0 and st["hits"] > 0


def test_run_ahead_engine_admits_from_the_snapshot_not_the_record_of_the_step_in_flight(tiny_ckpt, monkeypatch):
    """decode.run_ahead turns the boundaries late for the greedy loop only (the prefill after it reads as before); the
    late ones admit from the snapshot, never from the record the step in flight writes; tokens equal run-ahead off."""
    from moe_offload.decode_path import DecodeResidency

    ckpt = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    base = [f"model.checkpoint={ckpt}", "model.format=auto", "logging.level=WARNING", "prefill.warmup_tokens=64",
            "decode.max_tokens=4", "cache.budget=0.37"]
    on = Engine.from_config(load_config(None, base + ["decode.run_ahead=true"]), progress=False)
    off = Engine.from_config(load_config(None, base + ["decode.run_ahead=false"]), progress=False)
    reads = []
    real = DecodeResidency._admit

    def admit(self, record_LTK, tokens):
        reads.append((self.late, np.shares_memory(record_LTK, self._record_host.numpy())))
        return real(self, record_LTK, tokens)

    monkeypatch.setattr(DecodeResidency, "_admit", admit)
    for p in (list(range(5, 45)), [7] * 13, list(range(100, 164))):
        assert on.generate(p, 16).token_ids == off.generate(p, 16).token_ids
    late = [from_record for is_late, from_record in reads if is_late]
    assert len(late) > 10 and not any(late)
    assert any(from_record for is_late, from_record in reads if not is_late)  # the other engine reads the record
    assert on.cache.stats()["total"]["bytes"]["decode_h2d"] > 0 and not on.cache.decode.late


def test_a_boundary_admitting_into_every_layer_makes_one_table_write_and_one_copy_call(tiny_ckpt, monkeypatch):
    """Between decode steps the GPU waits for the host: a boundary's evictions of every layer go into one device
    table write, its copies into one ``h2d.copy`` call, and the next boundary's commits into one write (each
    admitted layer took an upload, an ``index_copy_`` and a copy call of its own before: ~16 layers a step at
    residency 0.37 on Qwen3-30B-A3B)."""
    import moe_offload.slot_pool as slot_pool_mod

    store = _store(tiny_ckpt)
    cache = _cache(store, "8 slots")
    cache.set_residency({layer: [0, 1] for layer in store.layers})  # 2 a layer (their shares), none free
    _decode_step(cache, {layer: torch.tensor([[0, 7, 8, 9]]) for layer in store.layers})  # 3 misses a layer
    calls = {"write": 0, "copy": 0}
    real_write, real_copy = slot_pool_mod.index_tensor, cache.decode.h2d.copy

    def counted(name, real):  # counts the calls, runs the real one
        def run(*a, **k):
            calls[name] += 1
            return real(*a, **k)
        return run

    monkeypatch.setattr(slot_pool_mod, "index_tensor", counted("write", real_write))
    monkeypatch.setattr(cache.decode.h2d, "copy", counted("copy", real_copy))
    cache.step_boundary()  # evicts in all 4 layers, enqueues the copies
    assert calls == {"write": 1, "copy": 1}
    assert cache.stats()["total"]["evictions"] == 4 * 1  # each layer at its share gives up its unrouted expert
    assert len(cache.decode._pending) == 4
    cache.step_boundary()  # commits all 4 layers' admissions
    assert calls == {"write": 2, "copy": 1}
    _check_invariants(cache)
    for layer in store.layers:
        for e in (0, 7, 8, 9):
            s = cache.resident(layer)[e]
            assert s < 0 or torch.equal(cache.pool.rows_SR[s], store.rows(layer)[e])


def test_a_failing_admission_copy_leaves_the_map_true_and_the_next_step_correct(tiny_ckpt, monkeypatch):
    store = _store(tiny_ckpt)
    cache = _cache(store, "6 slots")
    layer = store.layers[0]
    cache.set_residency({layer: [0, 1, 2, 3, 4, 5]})
    before = cache.resident(layer).copy()
    _decode_step(cache, {layer: torch.tensor([[7, 8, 9, 10]])})

    def broken(*a, **k):  # fault injection: the admission's host -> slot copy raises
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(cache.decode.h2d, "copy", broken)
    with pytest.raises(RuntimeError, match="injected"):
        cache.step_boundary()
    _check_invariants(cache)
    for e in range(store.num_experts):  # every expert the map calls resident is in its slot
        s = cache.resident(layer)[e]
        if s >= 0:
            assert torch.equal(cache.pool.rows_SR[s], store.rows(layer)[e]) and before[e] == s
    monkeypatch.undo()
    rows = _decode_step(cache, {layer: torch.tensor([[0, 7, 8, 9]])})[layer]
    for e, r in zip([0, 7, 8, 9], rows.flatten().tolist()):
        assert torch.equal(cache.pool.rows_NR[r], store.rows(layer)[e])


def test_a_failing_prefill_admission_leaves_the_map_true(tiny_ckpt, monkeypatch):
    import moe_offload.kernels.copy as copy_mod

    store = _store(tiny_ckpt)
    cache = _cache(store, "1.0", hit_copy="gather")
    layer = store.layers[0]

    def broken(*a, **k):
        raise RuntimeError("injected gather failure")

    with pytest.raises(RuntimeError, match="injected"):
        with cache.prefill_pass():
            cache.stage(layer)
            monkeypatch.setattr(copy_mod, "gather_rows", broken)
            cache.done(layer)
    monkeypatch.undo()
    assert (cache.resident(layer) < 0).all() and cache.pool.num_free() == cache.num_slots
    _check_invariants(cache)


def test_close_releases_the_backing_of_slots_and_staging(tiny_ckpt):
    """The staging buffers and the slots are views of one tensor (SlotPool.backing): close() must drop it too."""
    store = _store(tiny_ckpt)
    cache = _cache(store, "1.0")
    assert cache.staging.rows[0].data_ptr() == cache.pool.backing.data_ptr()
    cache.close()
    assert cache.pool.backing.numel() == 0 and cache.pool.rows_NR.numel() == 0


def test_budget_below_minimum_states_the_minimum(tiny_ckpt):
    store = _store(tiny_ckpt)
    with pytest.raises(BudgetError) as e:
        _cache(store, "2 slots")
    msg = str(e.value)
    scratch = min(16 * store.geometry.top_k, store.num_experts)  # decode.max_tokens (16) x K, at most E
    min_bytes = (2 * store.num_experts + scratch + store.geometry.top_k) * store.bytes_per_expert
    assert str(min_bytes) in msg and "fraction of experts" in msg


def test_byte_budget_counts_the_staging_buffers(tiny_ckpt):
    store = _store(tiny_ckpt)
    B = store.bytes_per_expert
    scratch = min(16 * store.geometry.top_k, store.num_experts)
    cache = _cache(store, str((2 * store.num_experts + scratch) * B + 7 * B) + "b")
    assert cache.num_slots == 7


@pytest.mark.parametrize("in_place", [True, False], ids=["hits-read-in-place", "hits-gathered"])
def test_prefill_bytes_by_path_add_up(tiny_ckpt, in_place):
    """Half the experts resident: the misses cross PCIe; the hits are read from their slots through one bank
    with the staged misses (prefill.read_in_place, no bytes moved) or gathered into staging."""
    store = _store(tiny_ckpt)
    cache = _cache(store, "1.0", hit_copy="gather", read_in_place=in_place)
    cache.set_residency({layer: list(range(0, store.num_experts, 2)) for layer in store.layers})
    with cache.prefill_pass():
        for layer in store.layers:
            views = cache.stage(layer)
            for name, view in store.views(layer).items():
                assert torch.equal(views[name], view)  # every bank of every expert staged intact
            cache.done(layer)
    st = cache.stats()["total"]
    half = store.num_experts // 2 * len(store.layers)
    assert st["prefill_hits"] == half and st["prefill_misses"] == half
    assert st["bytes"]["prefill_miss_h2d"] == half * store.bytes_per_expert
    assert st["bytes"]["prefill_hit_gather"] == (0 if in_place else half * store.bytes_per_expert)
    assert st["bytes"]["prefill_full_h2d"] == 0
    assert cache.stats()["compute"].get("prefill_mixed_layers", 0) == (len(store.layers) if in_place else 0)


# --- fallback: structured event, counters, fault injection, error mode -----------------------------
# every forward of more than one token takes the staged path (on CUDA the cost model would route the
# tiny model's short prompts: tests/gpu run these tests on a GPU too)
_STAGED = ("prefill.routed_max_tokens=1", "decode.max_tokens=1")


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "cache.budget=0.5",
                             "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


def _capture_json():
    buf = io.StringIO()
    log.configure("INFO", "json", stream=buf)
    return buf


def _events(buf, name):
    return [r for r in map(json.loads, buf.getvalue().splitlines()) if r["event"] == name]


def test_auto_hit_copy_on_cpu_is_the_gather_without_a_warning(tiny_ckpt):
    buf = _capture_json()
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "prefill.hit_copy=auto")
    eng.prefill(torch.arange(3, 43)[None])
    assert _events(buf, "prefill_hit_d2d_unavailable") == []
    st = eng.cache.stats()
    assert st["hit_path"] == "gather" and st["hit_d2d_fallbacks"] == {}


def test_batch_memcpy_on_cpu_falls_back_with_exactly_one_event_and_a_counter(tiny_ckpt):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    buf = _capture_json()
    eng = _engine(path, "prefill.hit_copy=batch_memcpy")
    ids = torch.randint(3, 300, (1, 40), generator=torch.Generator().manual_seed(0))
    a, _ = eng.prefill(ids)
    eng.prefill(ids)
    ev = _events(buf, "prefill_hit_d2d_unavailable")
    assert len(ev) == 1
    e = ev[0]
    assert e["level"] == "WARNING" and e["reason"] == "cpu_device" and e["fallback"] == "full_layer_copy"
    assert e["setting"] == "prefill.hit_copy"
    for key in ("rank", "world_size", "cuda_runtime", "driver", "torch"):
        assert key in e
    stats = eng.cache.stats()
    assert stats["hit_d2d_fallbacks"] == {"cpu_device": 2} and stats["hit_path"] == "full_layer_copy"
    assert stats["total"]["bytes"]["prefill_full_h2d"] > 0
    b, _ = _engine(path, "prefill.hit_copy=gather").prefill(ids)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)  # same math, different copy path


def test_overlap_off_is_a_logged_reason(tiny_ckpt):
    buf = _capture_json()
    _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"), "prefill.overlap=false", "prefill.hit_copy=gather")
    assert [e["reason"] for e in _events(buf, "prefill_hit_d2d_unavailable")] == ["overlap_off"]


def test_a_copy_failing_mid_run_switches_to_full_layer_copies_without_wrong_output(tiny_ckpt, monkeypatch):
    path = tiny_ckpt("tiny-qwen3-next", "nvfp4-ct")
    ids = torch.randint(3, 300, (1, 64), generator=torch.Generator().manual_seed(1))
    # hits copied into staging (not read in place), so there is a hit copy to fail
    want, _ = _engine(path, "prefill.hit_copy=gather", "prefill.read_in_place=false").prefill(ids)
    eng = _engine(path, "prefill.hit_copy=gather", "prefill.read_in_place=false")
    import moe_offload.kernels.copy as copy_mod

    calls = {"n": 0}
    real = copy_mod.gather_resident  # the hit copy the staging makes (from the device slot table)

    def flaky(*args, **kw):  # fault injection: the second hit copy of the run (layer 1 of the first pass) fails
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected copy failure")
        return real(*args, **kw)

    monkeypatch.setattr(copy_mod, "gather_resident", flaky)
    buf = _capture_json()
    got, _ = eng.prefill(ids)
    again, _ = eng.prefill(ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    torch.testing.assert_close(again, want, atol=1e-5, rtol=0)
    ev = _events(buf, "prefill_hit_d2d_unavailable")
    assert [e["reason"] for e in ev] == ["call_failed"] and "injected" in ev[0]["detail"]
    assert eng.cache.stats()["hit_d2d_fallbacks"] == {"call_failed": 2}
    assert eng.cache.hit_path == "full_layer_copy"


def test_error_mode_fails_start_up_with_the_reason(tiny_ckpt):
    with pytest.raises(HitPathUnavailable, match="reason=cpu_device"):
        _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"), "prefill.hit_copy=batch_memcpy", "prefill.hit_copy_on_unavailable=error")


def test_hit_copy_off_logs_nothing_and_copies_whole_layers(tiny_ckpt):
    buf = _capture_json()
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "bf16"), "prefill.hit_copy=off")
    eng.prefill(torch.arange(3, 60)[None])
    assert _events(buf, "prefill_hit_d2d_unavailable") == []
    st = eng.cache.stats()
    assert st["total"]["bytes"]["prefill_full_h2d"] > 0 and st["hit_d2d_fallbacks"] == {}


@pytest.mark.parametrize("in_place", [True, False], ids=["read-in-place", "gathered"])
def test_chunked_prefill_does_not_restream_experts_already_on_the_device(tiny_ckpt, in_place):
    """Chunk 1 admits staged experts into free slots; chunk 2 reads them from their slots (every expert of
    each layer is resident) or, with prefill.read_in_place off, copies them device-side only."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    eng = _engine(path, "cache.budget=1.0", "prefill.hit_copy=gather", "prefill.chunk_tokens=64", "prefill.warmup=false",
                  f"prefill.read_in_place={str(in_place).lower()}", *_STAGED)
    ids = torch.randint(3, 300, (1, 128), generator=torch.Generator().manual_seed(3))
    logits, _ = eng.prefill(ids)
    stats = eng.cache.stats()
    per_layer, total = stats["per_layer"], stats["total"]["bytes"]
    E, B, L = eng.store.num_experts, eng.store.bytes_per_expert, len(eng.store.layers)
    # every expert crossed PCIe once (chunk 1: nothing resident yet, so whole layers)
    assert total["prefill_miss_h2d"] + total["prefill_full_h2d"] == E * B * L
    # chunk 2: nothing copied on the device (read in place), or every expert gathered into staging
    assert total["prefill_hit_gather"] == (0 if in_place else E * B * L)
    assert stats["compute"].get("prefill_in_place_layers", 0) == (L if in_place else 0)
    assert all(c["prefill_hits"] == E for c in per_layer.values())
    want, _ = _engine(path, "cache.budget=1.0", "prefill.chunk_tokens=8192").prefill(ids)
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=0)  # fp32 noise across chunking


def test_prefill_last_only_returns_the_last_positions_logits_of_a_chunked_prompt(tiny_ckpt):
    """TTFT and generate run the LM head on the last position only; it must equal the full logits' last row."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    ids = torch.randint(3, 300, (1, 100), generator=torch.Generator().manual_seed(5))
    full, _ = _engine(path, "prefill.chunk_tokens=64").prefill(ids)
    last, _ = _engine(path, "prefill.chunk_tokens=64").prefill(ids, last_only=True)
    assert last.shape == (1, 1, full.shape[-1])
    torch.testing.assert_close(last[:, -1], full[:, -1], atol=1e-5, rtol=0)


def test_engine_begins_each_prefill_pass_once_before_the_forward(tiny_ckpt, monkeypatch):
    """The engine starts the pass (and layer 0's copy) before the model's forward; the first experts
    call must not start it again, and a direct model call still begins its own pass."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    eng = _engine(path, "cache.budget=0.37", "prefill.chunk_tokens=64", "prefill.warmup=false")
    calls = []
    begin, pass_ = eng.cache._begin, eng.cache.prefill_pass
    monkeypatch.setattr(eng.cache, "_begin", lambda: (calls.append("begin"), begin()))
    monkeypatch.setattr(eng.cache, "prefill_pass", lambda: (calls.append("pass"), pass_())[1])
    eng.prefill(torch.arange(3, 131)[None])  # two chunks of 64
    assert calls == ["pass", "begin", "pass", "begin"] and eng.cache.stats()["prefills"] == 2
    with torch.inference_mode():
        eng.model(input_ids=torch.arange(3, 40)[None])
    assert calls[4:] == ["begin"] and eng.cache.stats()["prefills"] == 3


def test_prefill_queues_the_pcie_misses_before_the_device_side_hit_copy(tiny_ckpt, monkeypatch):
    """On the copy stream an SM gather queued first waits for SMs held by the previous layer's GEMMs
    and holds the DMA of the misses behind it (seen on the H200 at fca575a); misses go first."""
    import moe_offload.hit_copy as hit_mod
    import moe_offload.kernels.copy as copy_mod

    store = _store(tiny_ckpt)
    cache = _cache(store, "1.0", hit_copy="gather", read_in_place=False)  # hits copied: there is a hit copy
    cache.set_residency({layer: list(range(0, store.num_experts, 2)) for layer in store.layers})
    cache.resolve_hit_path()
    order = []
    real_rows, real_gather = hit_mod.copy_rows_torch, copy_mod.gather_rows
    monkeypatch.setattr(hit_mod, "copy_rows_torch", lambda *a, **k: (order.append("h2d"), real_rows(*a, **k)))
    monkeypatch.setattr(copy_mod, "gather_rows", lambda *a, **k: (order.append("gather"), real_gather(*a, **k)))
    real_resident = copy_mod.gather_resident  # the hit copy reads the device slot table (no host indices)
    monkeypatch.setattr(copy_mod, "gather_resident", lambda *a, **k: (order.append("gather"), real_resident(*a, **k)))
    cache.staging.prefetch(store.layers[0])
    assert order == ["h2d", "gather"]


def test_admission_into_free_slots_happens_at_release_not_on_the_copy_stream(tiny_ckpt):
    store = _store(tiny_ckpt)
    cache = _cache(store, "1.0", hit_copy="gather")
    layer = store.layers[0]
    with cache.prefill_pass():
        assert (cache.resident(layer) >= 0).sum() == 0  # staged, not yet admitted
        cache.stage(layer)
        cache.done(layer)
    assert (cache.resident(layer) >= 0).all()
    e, s = 3, cache.resident(layer)[3]
    assert torch.equal(cache.pool.rows_SR[s], store.rows(layer)[e])
    _check_invariants(cache)


def test_a_fully_resident_layer_read_in_place_gives_the_gathered_logits_and_is_dropped_when_residency_changes(
        tiny_ckpt):
    """prefill.read_in_place: every expert of each layer resident -> no staging copy, the compute reads the
    slots through the device slot table; the logits are the gathered path's, bit for bit. A later pass after
    the residency changed (half the experts evicted, the rest in other slots) must not reuse that fill."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    ids = torch.randint(3, 300, (1, 48), generator=torch.Generator().manual_seed(11))
    engines = {v: _engine(path, "cache.budget=1.0", "prefill.hit_copy=gather", "prefill.warmup=false",
                          f"prefill.read_in_place={v}", *_STAGED) for v in ("true", "false")}
    E = engines["true"].store.num_experts
    out = {}
    for v, eng in engines.items():
        layers = eng.store.layers
        eng.cache.set_residency({layer: list(range(E)) for layer in layers})
        full, _ = eng.prefill(ids)
        eng.cache.set_residency({layer: list(range(1, E, 2)) for layer in layers})
        half, _ = eng.prefill(ids)
        out[v] = (full, half, eng.cache.stats())
    assert torch.equal(out["true"][0], out["false"][0]) and torch.equal(out["true"][1], out["false"][1])
    L = len(engines["true"].store.layers)
    assert out["true"][2]["compute"]["prefill_in_place_layers"] == L  # the first pass only
    assert out["false"][2]["compute"].get("prefill_in_place_layers", 0) == 0
    assert out["true"][2]["total"]["bytes"]["prefill_hit_gather"] < out["false"][2]["total"]["bytes"]["prefill_hit_gather"]


@pytest.mark.parametrize("in_place", [True, False], ids=["read-in-place", "gathered"])
def test_a_new_pass_drops_fills_read_in_place_and_keeps_copied_ones(tiny_ckpt, in_place):
    """A fill read in place names slots, valid only while the residency holds: the next pass must assemble
    that layer anew (decode admissions may have evicted in between). A copied fill holds its own rows and
    may be reused."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    eng = _engine(path, "cache.budget=1.0", "prefill.hit_copy=gather", "prefill.warmup=false",
                  f"prefill.read_in_place={str(in_place).lower()}", *_STAGED)
    eng.cache.set_residency({layer: list(range(eng.store.num_experts)) for layer in eng.store.layers})
    eng.prefill(torch.randint(3, 300, (1, 24), generator=torch.Generator().manual_seed(2)))
    staging = eng.cache.staging
    held = [layer for layer in staging.staged if layer is not None]
    assert held and (all(t is not None for t in staging.in_place) if in_place else staging.in_place == [None, None])
    staging.begin()
    assert staging.staged == ([None, None] if in_place else held)


def test_step_counts_give_what_each_decode_step_added_and_sum_to_the_counts(tiny_ckpt):
    """``record_step_counts`` (benchmarks: which steps miss what): one row a step, each the counts that step added;
    the rows sum to the running counts, start again at ``reset_counts``, and are None once off."""
    store = _store(tiny_ckpt)
    cache = _cache(store, "8 slots")
    dec = cache.decode
    assert dec.step_counts() is None
    rng = np.random.default_rng(0)
    steps = [{layer: torch.tensor(rng.integers(0, store.num_experts, (2, store.geometry.top_k))) for layer in store.layers}
             for _ in range(5)]
    _decode_step(cache, steps[0])  # before recording: in the counts, not in the rows
    dec.record_step_counts(True)
    assert dec.step_counts().shape == (0, len(store.layers), 6)
    for ids in steps[1:4]:
        _decode_step(cache, ids)
    rows = dec.step_counts()
    assert rows.shape == (3, len(store.layers), 6)
    before = dec.counts_LC.numpy() - rows.sum(axis=0)
    assert (rows[:, :, 0] == 2 * store.geometry.top_k).all()  # each step routed 2 tokens x top-k in every layer
    assert (before[:, 0] == 2 * store.geometry.top_k).all()  # the step before recording
    cache.reset()  # reset_counts: the rows start again
    _decode_step(cache, steps[4])
    assert dec.step_counts().shape[0] == 1 and (dec.step_counts().sum(axis=0) == dec.counts_LC.numpy()).all()
    dec.record_step_counts(False)
    assert dec.step_counts() is None
