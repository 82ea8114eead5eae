"""benchmarks/profile_prefill.py's ``device_idle``: the stretches in which no stream of the device runs anything,
from a chrome trace's GPU events (CPU: synthetic traces)."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_prefill", ROOT / "benchmarks" / "profile_prefill.py")
profile_prefill = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_prefill)
device_idle = profile_prefill.device_idle


def _ev(name, ts, dur):
    return {"name": name, "ts": ts, "dur": dur}


def test_only_stretches_where_every_stream_idles_count_and_short_boundaries_do_not():
    # a (0-10); a copy on another stream (5-40) covers a's gap to b (30-35); nothing runs from 40 to 100 (60 us,
    # after the copy); c (100-110), d (112-120): a 2 us boundary, not counted; nothing from 120 to 150 (30 us)
    ev = [_ev("a", 0, 10), _ev("Memcpy HtoD", 5, 35), _ev("b", 30, 5), _ev("c", 100, 10), _ev("d", 112, 8),
          _ev("e", 150, 10)]
    g = device_idle(ev, layers=2)
    assert g["stretches"] == 2 and g["idle_ms"] == pytest.approx(0.09)
    assert g["idle_us_per_layer"] == pytest.approx(45.0)
    first, second = g["by_transition"]
    assert (first["after"], first["before"], first["total_us"]) == ("Memcpy HtoD", "c", 60.0)
    assert (second["after"], second["before"], second["total_us"]) == ("d", "e", 30.0)


def test_events_out_of_order_and_nested_ones_give_no_negative_idle():
    ev = [_ev("b", 20, 5), _ev("a", 0, 50), _ev("c", 70, 1)]  # b inside a: the stretch begins at a's end
    g = device_idle(ev, layers=1)
    assert g["stretches"] == 1 and g["by_transition"][0]["after"] == "a" and g["idle_ms"] == pytest.approx(0.02)
    assert device_idle([], layers=4)["idle_ms"] == 0.0


def test_host_splits_time_each_part_of_a_device_planned_fill_and_remove_their_wrappers(tiny_ckpt):
    """``HostSplits`` around real routed fills (the CPU's device plan): one row a fill with the plan's launch and read
    split out and the staging's time before it; ``remove`` leaves the staging, the copier and the program as found."""
    import torch

    from moe_offload.cache import OffloadMoeCache
    from moe_offload.config import CacheConfig, PrefillConfig
    from moe_offload.host_store import ExpertStore
    from moe_offload.kernels import routed_plan

    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    cache = OffloadMoeCache(store, CacheConfig(budget="1.0"), PrefillConfig(hit_copy="gather", routed_copy="copy_engine",
                                                                           routed_plan="device"), "cpu")
    cache.set_residency({layer: [0] for layer in store.layers})
    cache.resolve_hit_path()  # the copier HostSplits wraps (resolution replaces the cache's first one)
    program = routed_plan.plan_routed_fill
    splits = profile_prefill.HostSplits(cache.staging)
    K = store.geometry.top_k
    with cache.prefill_pass(routed_fills=True):
        for layer in store.layers:
            cache.stage_rows(layer, torch.arange(2 * K).reshape(2, K) % store.num_experts)
            cache.done(layer)
    out = splits.summary()
    splits.remove()
    assert out["fills"] == len(store.layers)
    for key in ("pre_copy_us", "copy_call_us", "post_copy_us", "stage_us", "plan_pre_us", "plan_launch_us",
                "plan_read_us"):
        assert out[key] is not None and out[key]["median"] >= 0, key
    assert routed_plan.plan_routed_fill is program
    assert not {"wait", "_assemble_routed"} & set(vars(cache.staging)) and "copy" not in vars(cache.staging.h2d)
