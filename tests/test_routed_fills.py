"""Routed fills (``prefill.routed_copy``: copy_engine, moe_offload/staging.py): a prefill pass that stages, per
layer, only the missing experts its tokens routed, once the routing is known. On the CPU the copy engine is a host
copy; the piecewise graphs that run these passes on CUDA are tested in tests/gpu/test_prefill_graph_gpu.py."""

import logging

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_offload import log
from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig, load_config
from moe_offload.engine import Engine
from moe_offload.host_store import ExpertStore
from moe_offload.link_rates import SLOW_SM_READS, routed_copy
from moe_offload.link_rates import decode_path as link_decode_path
from moe_offload import link_rates as link_rates_mod


def _cache(store, budget, **prefill):
    return OffloadMoeCache(store, CacheConfig(budget=budget), PrefillConfig(**prefill), "cpu")


def test_auto_takes_the_copy_engine_only_where_this_hosts_sm_reads_were_measured_slow():
    cuda = torch.device("cuda", 0)
    slow = {"h2d_GBps": 49.6, "uva_GBps": 27.9}  # the H100 host of 9867ced
    fast = {"h2d_GBps": 54.9, "uva_GBps": 46.8}  # the one of 8bcd799
    low_h2d = {"h2d_GBps": 40.8, "uva_GBps": 29.2}  # a slow host whose copy engine read low at start-up (10cf59a)
    assert routed_copy("auto", cuda, slow)[0] == "per_prompt"  # routed_fills_pay decides each prompt
    assert routed_copy("auto", cuda, low_h2d)[0] == "per_prompt"  # 0.72 x
    assert routed_copy("auto", cuda, fast)[0] == "uva"
    edge = {"h2d_GBps": 50.0, "uva_GBps": 50.0 * SLOW_SM_READS}
    assert routed_copy("auto", cuda, edge)[0] == "uva"  # at the share itself: not slow
    assert routed_copy("auto", cuda, {"off": "tensor parallelism"}) == ("uva", "no measured link rates "
                                                                        "(prefill.measure_link)")
    assert routed_copy("auto", cuda, None)[0] == "uva"
    assert routed_copy("auto", torch.device("cpu"), slow) == ("uva", "cpu_device")
    for setting in ("uva", "copy_engine"):  # a setting is taken as it is, on any device
        assert routed_copy(setting, torch.device("cpu"), None) == (setting, "setting")


def test_decode_path_host_stages_large_batches_wherever_this_hosts_rates_were_measured():
    """decode.path: host (the default) resolves to auto wherever the start-up measurement (the same as
    prefill.routed_copy's) took both rates, and to routed where nothing was measured (link_rates.decode_path); the
    floor of auto's threshold is 16 rows on a slow-SM host and 32 on a fast one (link_rates.decode_path_floor)."""
    from moe_offload.link_rates import FAST_HOST_AUTO_MIN_TOKENS, HOST_AUTO_MIN_TOKENS, decode_path_floor

    slow = {"h2d_GBps": 49.6, "uva_GBps": 27.9}  # the H100 host of 9867ced, where auto ran batch 64 1.88 x faster
    low_h2d = {"h2d_GBps": 40.8, "uva_GBps": 29.2}  # the slow host of 10cf59a, its copy engine measured low
    fast = {"h2d_GBps": 54.9, "uva_GBps": 46.8}  # the H100 host of 8bcd799
    edge = {"h2d_GBps": 50.0, "uva_GBps": 50.0 * SLOW_SM_READS}  # exactly at the share: not slow
    assert link_decode_path("host", slow) == ("auto", "SM reads at 0.56 x the copy engine's rate")
    assert link_decode_path("host", low_h2d)[0] == "auto"
    assert link_decode_path("host", fast) == ("auto", "SM reads at 0.85 x the copy engine's rate")
    assert link_decode_path("host", edge)[0] == "auto"
    assert [decode_path_floor("host", link) for link in (slow, low_h2d, fast, edge)] == [
        HOST_AUTO_MIN_TOKENS, HOST_AUTO_MIN_TOKENS, FAST_HOST_AUTO_MIN_TOKENS, FAST_HOST_AUTO_MIN_TOKENS]
    assert (HOST_AUTO_MIN_TOKENS, FAST_HOST_AUTO_MIN_TOKENS) == (16, 32)
    assert decode_path_floor("fills", fast) == 8 and decode_path_floor("auto", slow) == 1
    assert link_decode_path("host", None) == ("routed", "no measured link rates (prefill.measure_link)")
    tp = {"off": "tensor parallelism (every rank must choose the same path)"}
    assert link_decode_path("host", tp) == ("routed", "no measured link rates: " + tp["off"])
    assert link_decode_path("host", {"declined": "unmeasurable", "detail": "noise"}) == (
        "routed", "no measured link rates: unmeasurable")
    for setting in ("routed", "auto"):  # a setting is taken as it is, whatever the host measured
        assert link_decode_path(setting, slow) == (setting, "setting")
        assert link_decode_path(setting, fast) == (setting, "setting")


def test_a_cache_logs_and_reports_what_decode_path_host_resolved_to(tiny_ckpt, caplog):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        cache = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(), "cpu", decode_path="host")
    chosen = [r.event_fields for r in caplog.records
              if getattr(r, "event_fields", {}).get("event") == "decode_path_chosen"]
    assert len(chosen) == 1 and chosen[0]["setting"] == "host" and chosen[0]["change_with"] == "decode.path"
    assert chosen[0]["path"] == "routed"  # a CPU measures no link: routed, so every decode step stays routed
    rp = cache.stats()["routed_path"]
    assert rp["decode_path"] == "routed" and rp["decode_path_reason"].startswith("no measured link rates")
    assert cache.routed_max_tokens >= 16  # the decode floor holds (decode.max_tokens), as with routed


@pytest.mark.parametrize("host", ["slow", "fast"])
@pytest.mark.parametrize("residency", ["0.37", "0.5"])
def test_decode_path_host_lowers_a_cache_s_routed_threshold_to_16_rows_on_a_slow_host_and_32_on_a_fast_one(
        qwen3_layer_store, monkeypatch, host, residency):
    """A real-size MoE layer (128 Qwen3-30B-A3B NVFP4 rows) and a cache sized for decode steps of 64 rows, as bench
    decode builds it; the start-up measurement replaced by a slow and a fast host's measured rates
    (benchmarks/results/HISTORY.md). host resolves to auto on both, and the cost model's threshold, floored at 16
    rows on the slow host and 32 on the fast one, stages batch 64 on both and batch 32 only on the slow one."""
    from moe_offload import forward_paths as forward_paths_mod
    from moe_offload.link_rates import LinkRates, measured_link_model
    from moe_offload.prefill_path import cost_model

    store = qwen3_layer_store(pin=False)
    h2d, uva = {"slow": (49.6, 27.9), "fast": (54.9, 46.8)}[host]
    rates = LinkRates(h2d_GBps=h2d, uva_GBps=uva, rows=32, row_bytes=store.bytes_per_expert, reps=5, layer=0)
    monkeypatch.setattr(link_rates_mod, "measure_link", lambda store, device: rates)
    table = cost_model("NVIDIA H100 80GB HBM3", store.num_experts, store.geometry.top_k, store.bytes_per_expert)
    measured = measured_link_model(store, torch.device("cpu"), table)
    monkeypatch.setattr(forward_paths_mod, "link_model", lambda *args: measured)
    cache = OffloadMoeCache(store, CacheConfig(budget=residency), PrefillConfig(), "cpu", decode_max_tokens=64,
                            decode_path="host")
    rp = cache.stats()["routed_path"]
    assert rp["decode_path"] == "auto" and rp["reason"] == "cost_model"
    assert rp["model_tokens"] <= cache.routed_max_tokens  # the floor, where the model asked for less
    if host == "slow":
        assert 16 <= cache.routed_max_tokens < 32  # batch 32 and 64 stage
    else:
        assert cache.routed_max_tokens == 32  # batch 32 stays routed, batch 64 stages
    all_resident = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(), "cpu", decode_max_tokens=64,
                                   decode_path="host")
    assert all_resident.routed_max_tokens >= 64  # nothing to copy: every step of up to 64 rows stays routed


def test_the_setting_is_validated_and_the_choice_logged_once_and_reported_in_stats(tiny_ckpt, caplog):
    with pytest.raises(Exception, match="routed_copy"):
        load_config(None, ["prefill.routed_copy=dma"])
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    with caplog.at_level(logging.INFO, logger=log.LOGGER_NAME):
        cache = _cache(store, "1.0", routed_copy="copy_engine")
    chosen = [r.event_fields for r in caplog.records
              if getattr(r, "event_fields", {}).get("event") == "prefill_routed_copy_chosen"]
    assert len(chosen) == 1 and chosen[0]["copy"] == "copy_engine" and chosen[0]["change_with"] == "prefill.routed_copy"
    cache.set_residency({layer: [0] for layer in store.layers})
    assert cache.routed_fills_for(8) and cache.stats()["routed_path"]["routed_copy"] == "copy_engine"
    cache.set_residency({layer: list(range(store.num_experts)) for layer in store.layers})
    assert not cache.routed_fills_for(8)  # every expert resident: nothing to copy, the routed graph reads in place


@pytest.mark.parametrize("plan", ["host", "device"])
@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "bf16"])
def test_a_routed_fill_stages_only_the_routed_misses_and_admits_only_what_it_copied(tiny_ckpt, fmt, plan):
    """Residency: every other expert. Each layer's call routes a random subset of experts: every routed expert's
    rows (hit or miss) read through (views, index_N) equal the store's bytes; only routed misses cross (counted as
    prefill_routed_h2d), nothing is copied ahead, and the free slots take only experts a fill copied. ``plan``:
    prefill.routed_plan (device: kernels/routed_plan.py's plan, its entries copied as they are)."""
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", fmt), progress=False)
    E, K, R = store.num_experts, store.geometry.top_k, store.bytes_per_expert
    cache = _cache(store, "1.0", hit_copy="gather", routed_copy="copy_engine", routed_plan=plan)
    assert (cache.staging.plan is not None) == (plan == "device")
    assert cache.stats()["routed_path"]["routed_plan"] == plan  # what a fill takes, in stats and bench cells
    cache.set_residency({layer: list(range(0, E, 4)) for layer in store.layers})  # a quarter: free slots remain
    before = cache.pool.slot_of_LE.copy()
    rng = np.random.default_rng(0)
    routed_misses, routed_hits = {}, {}
    with cache.prefill_pass(routed_fills=True):
        assert not cache.takes_routed_path(1)  # every experts call of the pass is staged (by its routed misses)
        for layer in store.layers:
            ids_TK = torch.from_numpy(rng.choice(E // 2, size=(3, K), replace=True)).long()  # experts 0..E/2-1 only
            routed = np.unique(ids_TK.numpy())
            lp = cache.pool.layer_pos[layer]
            routed_misses[layer] = routed[before[lp, routed] < 0]
            routed_hits[layer] = routed[before[lp, routed] >= 0]
            views, index_N = cache.stage_rows(layer, ids_TK)
            assert index_N is not None  # one bank: slots for hits, the buffer's rows for the copied misses
            want = store.views(layer)
            for e in routed.tolist():
                for name, view in views.items():
                    assert torch.equal(view[int(index_N[e])], want[name][e]), (layer, e, name)
            cache.done(layer)
    assert cache.takes_routed_path(1)  # after the pass, decode steps route again
    st = cache.stats()
    copied = sum(m.size for m in routed_misses.values())
    assert copied > 0
    assert st["total"]["bytes"]["prefill_routed_h2d"] == copied * R
    assert st["total"]["bytes"].get("prefill_miss_h2d", 0) == 0 and st["total"]["bytes"].get("prefill_full_h2d", 0) == 0
    assert st["total"]["prefill_misses"] == copied
    assert st["total"]["prefill_hits"] == sum(h.size for h in routed_hits.values())
    assert st["compute"]["prefill_routed_fills"] == len(store.layers)
    for layer in store.layers:  # admitted: a subset of what was copied, never an expert the fill left stale
        lp = cache.pool.layer_pos[layer]
        new_e = np.flatnonzero((before[lp] < 0) & (cache.pool.slot_of_LE[lp] >= 0))
        assert set(new_e.tolist()) <= set(routed_misses[layer].tolist())
        assert new_e.size == routed_misses[layer].size  # free slots were plenty
        slots = cache.pool.slot_of_LE[lp, new_e]
        for e, slot in zip(new_e.tolist(), slots.tolist()):  # the admitted slot holds the expert's bytes
            assert torch.equal(cache.pool.rows_SR[slot], store.rows(layer)[e])
    assert np.array_equal(cache.pool.table_LE.cpu().numpy(), cache.pool.slot_of_LE)
    assert not st["declined"]


def test_a_routed_fill_forward_gives_the_same_logits_as_the_staged_one(tiny_ckpt):
    """The whole model, one prefill forward at residency 0.25: staging every missing expert vs only the routed
    ones gives the same logits, bit for bit (the same compute reads the same bytes for every routed expert)."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    outs = []
    for fills, plan in ((False, "host"), (True, "host"), (True, "device")):
        cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "cache.budget=1.0",
                                 "prefill.hit_copy=gather", "prefill.routed_max_tokens=1", "decode.max_tokens=1",
                                 "logging.level=WARNING", f"prefill.routed_copy={'copy_engine' if fills else 'uva'}",
                                 f"prefill.routed_plan={plan}"])
        eng = Engine.from_config(cfg, progress=False)
        E = eng.cache.E
        eng.cache.set_residency({layer: list(range(0, E, 4)) for layer in eng.cache.layers})
        ids = torch.tensor([list(range(5, 29))])
        with torch.no_grad(), eng.cache.prefill_pass(routed_fills=fills):
            outs.append(eng.model(input_ids=ids).logits)
        st = eng.cache.stats()
        assert (st["compute"].get("prefill_routed_fills", 0) == len(eng.cache.layers)) == fills
        assert (st["total"]["bytes"].get("prefill_routed_h2d", 0) > 0) == fills
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_per_prompt_routed_fills_pay_where_the_slow_reads_cost_more_than_the_fixed_cost_of_a_fill():
    """At the slow H100 host's rates (27.9 GB/s SM reads, 49.6 GB/s copy engine) and Qwen3's 2.65 MB rows: a fill
    costs ROUTED_FILL_FIXED_S more per layer, and saves (1/27.9 - 1/49.6) s per GB: it pays from ~7 missing experts a
    layer (a short prompt at residency 0.37), not for 1-2; at a fast host's rates it does not pay at any count."""
    from moe_offload.link_rates import ROUTED_FILL_FIXED_S, routed_fills_pay

    R = 2658304
    slow, fast = {"h2d_GBps": 49.6, "uva_GBps": 27.9}, {"h2d_GBps": 45.1, "uva_GBps": 48.5}
    even = ROUTED_FILL_FIXED_S / (R / 27.9e9 - R / 49.6e9)  # missing experts at which both cost the same
    assert 6 < even < 8
    assert routed_fills_pay(slow, 10, R) and routed_fills_pay(slow, 128, R)
    assert not routed_fills_pay(slow, 2, R) and not routed_fills_pay(slow, 0, R)
    assert not any(routed_fills_pay(fast, n, R) for n in (1, 10, 128))


def test_the_device_plans_lower_fixed_cost_lets_fills_pay_from_fewer_misses(qwen3_layer_store):
    """``prefill.routed_plan: device`` measured 0.14-0.16 ms a layer of fixed cost against the host plan's 0.22-0.30
    (65790fb): at the slow host's rates a fill then pays from ~4 missing experts a layer instead of ~7; the cache's
    per-prompt choice and the fills-weighing threshold take the constant of the cache's plan."""
    from moe_offload.link_rates import (ROUTED_FILL_FIXED_S, ROUTED_FILL_FIXED_S_DEVICE_PLAN, routed_fill_fixed_s,
                                        routed_fills_pay)

    R, slow = 2658304, {"h2d_GBps": 49.6, "uva_GBps": 27.9}
    assert routed_fill_fixed_s("host") == ROUTED_FILL_FIXED_S and routed_fill_fixed_s("device") < ROUTED_FILL_FIXED_S
    even = ROUTED_FILL_FIXED_S_DEVICE_PLAN / (R / 27.9e9 - R / 49.6e9)
    assert 3 < even < 4
    assert routed_fills_pay(slow, 5, R, routed_fill_fixed_s("device"))
    assert not routed_fills_pay(slow, 5, R, routed_fill_fixed_s("host"))
    from dataclasses import replace

    store = qwen3_layer_store(pin=False)
    layer, K = store.layers[0], store.geometry.top_k
    for plan, declined, pays in (("host", False, False), ("device", False, True), ("device", True, False)):
        # a cache learns 5 missing experts a layer from a fill; a device plan this copier declines (a fault injected:
        # as on CUDA without the batched call) is priced as the host plan it falls back to
        cache = _cache(store, "8 slots", hit_copy="gather", routed_plan=plan)
        cache.routed_path = replace(cache.routed_path, routed_copy="per_prompt", link=slow)
        ids = torch.tensor([100 + i % 5 for i in range(16 * K)]).view(16, K)
        with cache.prefill_pass(routed_fills=True):
            cache.stage_rows(layer, ids)
            cache.done(layer)
        if declined:  # after the pass: resolving the hit path (its first) sets the copier
            cache.staging.h2d.entries_unavailable = lambda row_bytes, device: "batch_memcpy_unavailable"
        assert cache.staging.plan_in_effect() == ("device" if plan == "device" and not declined else "host")
        assert cache.routed_fills_for(16, 16) == pays, plan


def test_a_cache_on_a_slow_host_takes_routed_fills_per_prompt_at_real_row_sizes(qwen3_layer_store):
    """One Qwen3-30B-A3B layer (128 x 2.65 MB rows), a cache of 8 slots (its minimum). With the slow H100 host's
    measured rates resolved as ``per_prompt`` (what ``auto`` resolves to there on CUDA), a 16-token prompt (~82
    distinct experts, ~77 of them missing) takes routed fills; with a fast host's rates it does not. (The rates are
    given: this CPU has no mapped-memory reads to measure.)"""
    from dataclasses import replace

    store = qwen3_layer_store(pin=False)
    slow, fast = {"h2d_GBps": 49.6, "uva_GBps": 27.9}, {"h2d_GBps": 45.1, "uva_GBps": 48.5}
    cache = _cache(store, "8 slots")
    assert cache.routed_path.routed_copy == "uva"  # auto on a CPU
    cache.routed_path = replace(cache.routed_path, routed_copy=routed_copy("auto", torch.device("cuda", 0), slow)[0],
                                link=slow)
    assert cache.routed_path.routed_copy == "per_prompt"
    assert cache.routed_fills_for(16)
    cache.routed_path = replace(cache.routed_path, link=fast)
    assert not cache.routed_fills_for(16)


def test_per_prompt_choice_follows_the_misses_earlier_fills_of_as_many_rows_found(qwen3_layer_store):
    """Uniform routing overestimates a skewed router's misses: a first choice of routed fills is corrected by what
    the fills saw. 12 missing experts a layer pay at the slow host's rates, 2 do not; each row count keeps its own."""
    from dataclasses import replace

    store = qwen3_layer_store(pin=False)
    cache = _cache(store, "8 slots", hit_copy="gather")
    cache.routed_path = replace(cache.routed_path, routed_copy="per_prompt", link={"h2d_GBps": 49.6, "uva_GBps": 27.9})
    layer, E, K = store.layers[0], store.num_experts, store.geometry.top_k
    assert cache.routed_fills_for(16, 16)  # nothing seen yet: uniform routing, ~77 missing
    for rows, experts in ((16, range(100, 102)), (32, range(100, 112))):  # skewed: 2 / 12 experts, none resident
        ids = torch.tensor([[e for e in experts][i % len(experts)] for i in range(rows * K)]).view(rows, K)
        with cache.prefill_pass(routed_fills=True):
            cache.stage_rows(layer, ids)
            cache.done(layer)
        assert cache.stats()["compute"]["prefill_routed_fills"] >= 1
    assert not cache.routed_fills_for(16, 16)  # 2 missing a layer: SM reads are cheaper than the fill's fixed cost
    assert cache.routed_fills_for(24, 32)  # 12 missing a layer: the fill pays
    assert cache.routed_fills_for(8, 8)  # a row count never filled: still the uniform estimate


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 300).flatmap(lambda E: st.tuples(st.just(E), st.sets(st.integers(0, E - 1), min_size=1))))
def test_a_fills_shared_rows_give_the_pointer_arrays_of_two_row_lists(case):
    """A fill's misses copy row e to row e (``RowCopy`` with ``dst_rows is src_rows``): the runs found once give the
    entries the general path gives for two equal lists, coalesced."""
    from moe_offload.copy_paths import RowCopy, pointer_arrays

    E, ids = case
    rows = np.array(sorted(ids), dtype=np.int64)
    dst, src = torch.empty(E, 24, dtype=torch.uint8), torch.empty(E, 24, dtype=torch.uint8)
    once = pointer_arrays([RowCopy(dst, src, rows, rows)], coalesce=True)
    two = pointer_arrays([RowCopy(dst, src, rows, rows.copy())], coalesce=True)
    for a, b in zip(once, two):
        assert a.dtype == np.uint64 and np.array_equal(a, b)


def _slow_model():
    """The H100 entry of the path table at Qwen3-30B-A3B's shape with the slow-SM host's rates of 80a81c2."""
    from dataclasses import replace

    from moe_offload.prefill_path import cost_model

    model, entry = cost_model("NVIDIA H100 80GB HBM3", 128, 8, 2658304)
    return replace(model, h2d_GBps=47.0, uva_GBps=27.0), entry


def test_a_decode_steps_routed_fill_is_weighed_against_whole_missing_layers():
    """``CostModel.fill_s``: at residency 0.5 a 16-row step routes ~82 of 128 experts, so its fill copies ~41 rows
    where staging copies 64: the fill pays; a 64-row step routes nearly all of them and the fill's fixed cost loses.
    With fills weighed (``decode.path: fills``) the routed threshold is lower than ``auto``'s."""
    from moe_offload.link_rates import ROUTED_FILL_FIXED_S

    model, _ = _slow_model()
    E, K, R = 128, 8, 2658304
    assert model.fill_s(16, E, K, R, 0.5, ROUTED_FILL_FIXED_S) < model.staged_s(16, E, K, R, 0.5)
    assert model.fill_s(64, E, K, R, 0.5, ROUTED_FILL_FIXED_S) > model.staged_s(64, E, K, R, 0.5)
    assert model.fill_s(16, E, K, R, 0.5, ROUTED_FILL_FIXED_S, missing=0) < model.fill_s(
        16, E, K, R, 0.5, ROUTED_FILL_FIXED_S, missing=20)  # learned misses replace uniform routing's
    weighed = model.threshold(E, K, R, 0.5, 64, ROUTED_FILL_FIXED_S)
    assert weighed <= model.threshold(E, K, R, 0.5, 64)


@pytest.mark.parametrize("path", ["fills", "auto"])
def test_under_decode_path_fills_staged_steps_of_few_rows_take_routed_fills(qwen3_layer_store, path):
    """One Qwen3 layer at residency ~0.5 with the slow host's model: ``fills`` keeps steps below
    ``FILLS_MIN_TOKENS`` routed, stages the steps above its threshold, and stages a 16-row step's routed misses only
    (a fill) but a 64-row step's whole missing layer; ``auto`` never fills."""
    from moe_offload.link_rates import FILLS_MIN_TOKENS

    store = qwen3_layer_store(pin=False)
    cache = OffloadMoeCache(store, CacheConfig(budget="64 slots"), PrefillConfig(), "cpu", decode_max_tokens=64,
                            decode_path=path, cost_model=_slow_model())
    rp = cache.stats()["routed_path"]
    assert rp["decode_path"] == path and rp["reason"] == "cost_model"
    if path == "fills":
        assert FILLS_MIN_TOKENS <= cache.routed_max_tokens < 16
        assert cache.decode_fills_for(16) and not cache.decode_fills_for(64)
    else:
        assert not cache.decode_fills_for(16) and not cache.decode_fills_for(64)


def test_a_staged_decode_step_of_routed_fills_gives_the_whole_layer_steps_logits(tiny_ckpt):
    """``Engine.run_model``: a decode step above the routed threshold stages only its routed misses where
    ``cache.decode_fills_for`` says so (here: a model is given that says so), with the logits of staging whole
    missing layers, bit for bit, and every layer a fill."""
    from moe_offload.decode_graph import StaticDecoder

    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    runs, fills = [], []
    for fill in (True, False):
        eng = Engine.from_config(load_config(None, [f"model.checkpoint={path}", "model.format=auto",
                                                    "logging.level=WARNING", "cache.budget=0.3", "decode.max_tokens=1",
                                                    "prefill.routed_max_tokens=1", "decode.path=auto",
                                                    "prefill.routed_copy=copy_engine"]), progress=False)
        eng.cache.decode_fills_for = lambda tokens, fill=fill: fill
        dec = StaticDecoder(eng, 3, 48, graphs=False)
        logits = dec.prefill(torch.tensor([list(range(10, 18)), list(range(20, 28)), list(range(30, 38))]))
        eng.cache.reset()
        seen = [logits.clone()]
        for _ in range(3):
            logits = dec.step(logits.argmax(-1))
            seen.append(logits.clone())
        runs.append(seen)
        fills.append(eng.cache.stats()["compute"].get("prefill_routed_fills", 0))
    assert fills[0] == 3 * len(eng.cache.layers) and fills[1] == 0
    for i, (a, b) in enumerate(zip(*runs)):
        assert torch.equal(a, b), f"step {i} differs"
