"""decode.miss_copy tma on CUDA (kernels/miss_copy_tma.py): the start-up check passes on mapped host rows, a real-size
layer's rows copied through tensor descriptors are exact, and graph-replayed decode steps whose misses it copies give
the bits of the plain-load copy while residency changes between replays. Not yet run on a GPU (README "GPU runs still
owed" 7)."""

import pytest
import torch

from test_decode_gpu import _engine, _replayed_like_plain_loads

from moe_offload.host_store import ExpertStore
from moe_offload.kernels.miss_copy_tma import copy_misses_tma

pytestmark = pytest.mark.gpu


def test_the_start_up_check_passes_and_the_cache_says_it_reads_through_the_tma(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "cache.budget=0.25", "decode.miss_copy=tma")
    st = eng.cache.stats()
    assert eng.cache.decode.copy_config is not None and eng.cache.decode.miss_copy_declined is None
    assert st["routed_path"]["miss_copy"] == "tma" and st["declined"] == {}


@pytest.mark.parametrize("box_lines", [1, 16, 64])
def test_the_counted_experts_of_a_real_size_layer_are_copied_exactly_from_mapped_memory(box_lines):
    store = ExpertStore.for_preset("qwen3-30b-a3b", 1, pin=True)
    layer, dev = store.layers[0], torch.device("cuda")
    rows = store.rows(layer)  # fresh pinned pages are zeros: random bytes make a copy of nothing fail
    rows.copy_(torch.randint(0, 256, rows.shape, dtype=torch.uint8))
    host = store.device_rows(layer, dev)
    E, R = host.shape
    pool = torch.full((E + 3, R), 0xA5, dtype=torch.uint8, device=dev)
    ids = torch.randperm(E, device=dev).to(torch.int32)
    n = E - 5  # the count, not the list's length, says how many are copied
    copy_misses_tma(ids, torch.tensor([n], dtype=torch.int32, device=dev), host, pool, 3, box_lines, 4, 4)
    torch.cuda.synchronize()
    assert torch.equal(pool[3:3 + n].cpu(), rows[ids[:n].cpu().long()])
    assert (pool[:3] == 0xA5).all() and (pool[3 + n:] == 0xA5).all()


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "bf16"])
def test_graph_replayed_decode_with_tma_misses_gives_the_bits_of_plain_loads(tiny_ckpt, fmt):
    st = _replayed_like_plain_loads(tiny_ckpt("tiny-qwen3-moe", fmt), "decode.miss_copy=tma")
    assert st["routed_path"]["miss_copy"] == "tma"
