"""``prefill.routed_plan: graph`` (moe_offload/fill_plan.py): a fill whose plan a replayed stretch already worked out
reads it instead of launching the program, stages the same rows, and a capture that cannot take the plan says so.
On the CPU ``capture_plan`` runs eagerly (no capture exists there); the capture itself and the replay against the
eager prefill: tests/gpu/test_routed_plan_gpu.py."""

import pytest
import torch

from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.host_store import ExpertStore
from moe_offload.kernels import routed_plan


def _cache(tiny_ckpt, plan: str):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    cache = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(hit_copy="gather", routed_copy="copy_engine",
                                                                           routed_plan=plan), "cpu")
    cache.set_residency({layer: [0, 3] for layer in store.layers})
    return store, cache


@pytest.fixture
def launches(monkeypatch):
    """The plan program's launches, counted (the real program runs)."""
    calls = []
    right = routed_plan.plan_routed_fill

    def counted(*args, **kw):
        calls.append(args[2].data_ptr())
        right(*args, **kw)

    monkeypatch.setattr(routed_plan, "plan_routed_fill", counted)
    return calls


def _ids(store, shift: int) -> torch.Tensor:
    K = store.geometry.top_k
    return (torch.arange(2 * K).reshape(2, K) * 3 + shift) % store.num_experts


def _check_rows(store, layer, views, index_N, ids):
    for e in ids.unique().tolist():
        for name, view in views.items():
            assert torch.equal(view[int(index_N[e])], store.views(layer)[name][e])


def test_a_fill_planned_in_the_graph_reads_that_plan_and_stages_the_same_rows(tiny_ckpt, launches):
    store, cache = _cache(tiny_ckpt, "graph")
    staging = cache.staging
    assert staging.plan_in_effect() == "graph" and cache.stats()["routed_path"]["routed_plan"] == "graph"
    with cache.prefill_pass(routed_fills=True):
        for i, layer in enumerate(store.layers):
            ids = _ids(store, i)
            assert staging.capture_plan(layer, ids)  # what the stretch before the call enqueues
            with staging.planned_in_graph(layer):
                views, index_N = cache.stage_rows(layer, ids)
            assert staging.graph_plan is None
            _check_rows(store, layer, views, index_N, ids)
            cache.done(layer)
    assert len(launches) == len(store.layers)  # one a layer, by the capture; none by the fills
    compute = cache.stats()["compute"]
    assert compute["prefill_routed_fills"] == compute["prefill_graph_planned_fills"] == len(store.layers)


def test_the_same_prefill_planned_eagerly_copies_the_same_bytes(tiny_ckpt, launches):
    """The graph plan against the device plan (one launch a fill) on the same routing: the same routed bytes."""
    by_plan = {}
    for plan in ("graph", "device"):
        store, cache = _cache(tiny_ckpt, plan)
        with cache.prefill_pass(routed_fills=True):
            for i, layer in enumerate(store.layers):
                ids = _ids(store, i)
                if plan == "graph":
                    assert cache.staging.capture_plan(layer, ids)
                    with cache.staging.planned_in_graph(layer):
                        cache.stage_rows(layer, ids)
                else:
                    assert not cache.staging.capture_plan(layer, ids)  # device: the capture takes nothing
                    cache.stage_rows(layer, ids)
                cache.done(layer)
        by_plan[plan] = cache.stats()["total"]["bytes"]["prefill_routed_h2d"]
    assert by_plan["graph"] == by_plan["device"] > 0


def test_a_capture_that_cannot_take_the_plan_takes_nothing_and_says_why(tiny_ckpt, launches):
    """Each reason a capture leaves the plan to the eager fill is counted per layer captured: words that cannot be
    mapped, a declined device plan, a cache whose fills stage whole layers (no mixed fills)."""
    store, cache = _cache(tiny_ckpt, "graph")
    staging, layer = cache.staging, store.layers[0]
    declined = cache.counters.declined
    with cache.prefill_pass(routed_fills=True):
        staging.plan.mapped_P = None  # as where pinned memory cannot be mapped (fill_plan.RoutedPlanBuffers)
        assert staging.plan_in_effect() == "device"
        assert not staging.capture_plan(layer, _ids(store, 0)) and not launches
        assert declined["routed_plan_graph:unmapped"] == 1
        staging.read_in_place = False  # fills of whole layers: nothing would read a plan
        assert not staging.capture_plan(layer, _ids(store, 0)) and declined["routed_plan_graph:no_routed_fills"] == 1
        staging.plan, staging.plan_declined = None, "check_failed"
        assert staging.plan_in_effect() == "host" and not staging.capture_plan(layer, _ids(store, 0))
        assert declined["routed_plan_graph:check_failed"] == 1 and not launches
    _, device = _cache(tiny_ckpt, "device")  # not asked for: nothing counted
    assert not device.staging.capture_plan(layer, _ids(store, 0))
    assert not any(k.startswith("routed_plan_graph") for k in device.stats()["declined"])


def test_the_start_up_check_of_the_mapped_words_names_a_plan_read_wrong(monkeypatch):
    """``RoutedPlanBuffers.check_mapped`` (run on CUDA before the words are read from mapped memory): right words
    pass; a fault injected into what the host reads (one word off) is named, and on CUDA the buffers then read
    by a D2H copy instead."""
    from moe_offload.fill_plan import RoutedPlanBuffers

    cpu = torch.device("cpu")
    buffers = RoutedPlanBuffers._buffers(128, cpu)
    assert buffers.check_mapped(128, cpu) is None
    right = routed_plan.plan_routed_fill

    def one_off(ids_N, table_E, plan_P, *args, **kw):
        right(ids_N, table_E, plan_P, *args, **kw)
        plan_P[routed_plan.HEADER + 3 * 128] += 1  # expert 0's missing flag

    monkeypatch.setattr(routed_plan, "plan_routed_fill", one_off)
    assert "mapped words 388-516 of a 128-expert plan differ" in buffers.check_mapped(128, cpu)


def test_closing_the_cache_releases_the_mapped_words(tiny_ckpt):
    """``OffloadMoeCache.close`` unregisters the plan's mapped words at once (not at garbage collection), once."""
    store, cache = _cache(tiny_ckpt, "graph")
    released = []
    plan = cache.staging.plan
    plan._unpin = lambda: released.append(True)  # stands in for the finalizer (nothing is registered off CUDA)
    cache.close()
    cache.close()
    assert released == [True] and plan.mapped_P is None
