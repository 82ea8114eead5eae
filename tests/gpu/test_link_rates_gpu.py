"""On CUDA: the cache times this host's copy engine and SM reads of its pinned store and decides with them."""

import pytest
import torch

from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.host_store import ExpertStore

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def store(tiny_ckpt):
    return ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), pin=True, progress=False)


def test_a_cuda_cache_decides_with_the_rates_it_measured(store):
    cache = OffloadMoeCache(store, CacheConfig(budget=0.5), PrefillConfig(), "cuda")
    rp = cache.stats()["routed_path"]
    link = rp["link"]
    # a PCIe link of any generation moves more than 1 GB/s; neither path beats the copy engine's ~64 GB/s PCIe 5
    # ceiling by more than the timing noise of a few small rows (x 2)
    assert 1.0 < link["h2d_GBps"] < 130 and 1.0 < link["uva_GBps"] < 130
    assert rp["entry"].endswith("(link measured)") and rp["reason"] == "cost_model"
    cache.close()


def test_measure_link_false_keeps_the_table_s_rates(store):
    cache = OffloadMoeCache(store, CacheConfig(budget=0.5), PrefillConfig(measure_link=False), "cuda")
    rp = cache.stats()["routed_path"]
    assert rp["link"] == {"off": "prefill.measure_link is false"} and not rp["entry"].endswith("(link measured)")
    cache.close()
