"""On CUDA: the cache times this host's copy engine and SM reads of its pinned store and decides with them."""

import pytest
import torch

from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.host_store import ExpertStore
from moe_offload.link_rates import measure_link

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def store(qwen3_layer_store):
    s = qwen3_layer_store(pin=True)  # 340 MB of real pinned rows: the decode path's SM reads need them mapped
    yield s
    s.close()


def test_a_cuda_cache_decides_with_the_rates_it_measured(store):
    cache = OffloadMoeCache(store, CacheConfig(budget=0.5), PrefillConfig(), "cuda")
    rp = cache.stats()["routed_path"]
    link = rp["link"]
    # any PCIe link moves more than 1 GB/s; none moves more than PCIe 6 x16's ~128 GB/s
    assert 1.0 < link["h2d_GBps"] < 130 and 1.0 < link["uva_GBps"] < 130, link
    assert rp["entry"].endswith("(link measured)") and rp["reason"] == "cost_model"
    assert not cache.stats()["declined"]
    cache.close()


def test_measure_link_false_keeps_the_table_s_rates(store):
    cache = OffloadMoeCache(store, CacheConfig(budget=0.5), PrefillConfig(measure_link=False), "cuda")
    rp = cache.stats()["routed_path"]
    assert rp["link"] == {"off": "prefill.measure_link is false"} and not rp["entry"].endswith("(link measured)")
    cache.close()


def test_a_tiny_store_is_not_timed(tiny_ckpt):
    tiny = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    cache = OffloadMoeCache(tiny, CacheConfig(budget=0.5), PrefillConfig(), "cuda")
    assert "too small to time a rate" in cache.stats()["routed_path"]["link"]["off"]
    cache.close()


def test_copies_queued_before_the_measurement_do_not_share_its_link(store):
    """Another cache's copies still in flight when a cache is built (admissions queued at its last boundary) must not
    halve the measured copy-engine rate: the measurement waits for queued work first."""
    alone = measure_link(store, torch.device("cuda"))
    src = torch.empty(256 << 20, dtype=torch.uint8).pin_memory()
    dst = torch.empty(src.shape, dtype=torch.uint8, device="cuda")
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # ~8 GB over the copy engine, ~150 ms at 55 GB/s: longer than the measurement
        for _ in range(32):
            dst.copy_(src, non_blocking=True)
    busy = measure_link(store, torch.device("cuda"))
    assert side.query(), "the measurement returned before the queued copies had landed"
    assert busy.h2d_GBps > 0.8 * alone.h2d_GBps, (alone, busy)
