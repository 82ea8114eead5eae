"""On CUDA: a prefill pass that raises half-way leaves no unordered copy behind (real streams, events).

The hazard (found in review of 5255331): the pass enqueues layer L+1's assembly before computing L.
If compute(L) raises, L+1's hit gather may still be in flight on the hit stream when the next request
writes the same staging rows (a new prefill's misses, copy stream) or overwrites the slots it reads
(a decode admission, copy stream). ``torch.cuda._sleep`` on the hit stream holds the stale gather
back long enough that any missing wait shows as wrong bytes, deterministically.
"""

import numpy as np
import pytest
import torch

from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.hit_copy import GatherHitCopy
from moe_offload.host_store import ExpertStore, bank_views

pytestmark = pytest.mark.gpu

_SPIN = 300_000_000  # cycles (~0.15 s on an H200): far longer than the host needs to enqueue the next request


class _DelayedGather(GatherHitCopy):
    """The real gather, queued behind a spin kernel on the hit stream while ``armed``."""

    armed = False

    def copy(self, staging_ER, hit_e_M, pool_SR, hit_slots_M, stream) -> None:
        if self.armed:
            torch.cuda._sleep(_SPIN)
        super().copy(staging_ER, hit_e_M, pool_SR, hit_slots_M, stream)


def _setup(tiny_ckpt, read_in_place=False):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    E = store.num_experts
    L0, L1, L2 = store.layers[:3]
    hits2 = list(range(0, E, 2))  # the rows layer 2's gather writes ...
    rest0 = [e for e in range(E) if e not in hits2]  # ... are exactly layer 0's misses
    # exactly E slots, all taken: no admission into free slots changes residency mid-test; layer 2's
    # slots first, so they are the least recently used (the decode admission's victims). read_in_place off: the
    # hits are gathered into the staging rows (the path whose hazard these tests hold back); on, they are read
    # from their slots and only misses are staged (no gather to hold back)
    cache = OffloadMoeCache(store, CacheConfig(budget=f"{E} slots"),
                            PrefillConfig(hit_copy="gather", read_in_place=read_in_place), "cuda")
    cache.set_residency({L2: hits2, L0: rest0})
    cache.resolve_hit_path()
    gather = _DelayedGather()
    cache.staging.hit = gather
    return store, cache, gather, (L0, L1, L2), hits2


def _abort_after_prefetching_layer_2(cache, layers, gather):
    L0, L1, _ = layers
    with pytest.raises(RuntimeError, match="injected"):
        with cache.prefill_pass():
            cache.stage(L0)
            cache.done(L0)
            gather.armed = True  # the gather of layer 2, enqueued by stage(L1), waits behind a spin
            cache.stage(L1)
            gather.armed = False
            raise RuntimeError("injected compute failure in layer 1")


@pytest.mark.parametrize("read_in_place", [False, True])
def test_a_prefill_after_an_aborted_pass_stages_every_layer_bitwise(tiny_ckpt, read_in_place):
    store, cache, gather, layers, _ = _setup(tiny_ckpt, read_in_place)
    _abort_after_prefetching_layer_2(cache, layers, gather)
    staged = {}
    with cache.prefill_pass():
        for layer in store.layers:
            # on the compute stream: what compute reads (a mixed layer through its index, gathered here)
            staged[layer] = {k: v.clone() for k, v in cache.stage(layer).items()}
            cache.done(layer)
    torch.cuda.synchronize()
    if read_in_place:  # layers 0 and 2 hold hits and misses: compute reads them through the index
        assert cache.stats()["compute"]["prefill_mixed_layers"] > 0
    for layer, views in staged.items():
        want = bank_views(store.specs, store.offsets, store.rows(layer))
        for k, v in views.items():
            assert torch.equal(v.cpu().view(torch.uint8), want[k].view(torch.uint8)), f"layer {layer} {k}: wrong bytes"


def test_a_decode_admission_after_an_aborted_pass_does_not_overwrite_slots_a_stale_gather_reads(tiny_ckpt):
    store, cache, gather, layers, hits2 = _setup(tiny_ckpt)
    L0, _, L2 = layers
    _abort_after_prefetching_layer_2(cache, layers, gather)
    b2 = cache.staging.buffer_for(L2)
    K = store.geometry.top_k
    ids = torch.tensor([hits2[:K]], device="cuda")  # misses in layer 0: admitted into layer 2's slots
    cache.step_boundary()
    cache.decode_rows(L0, ids)
    cache.decode_step_enqueued()
    cache.step_boundary()  # admission: victims are layer 2's least recently used slots
    torch.cuda.synchronize()
    assert any(int(s) >= 0 for s in cache.decode._pending[0][2]) and cache.decode._pending[0][0] == L0
    assert cache.staging.buffer_for(L2) == b2
    assert torch.equal(cache.staging.rows[b2].cpu(), store.rows(L2)), "the stale gather read overwritten slots"
    cache.step_boundary()
    assert np.array_equal(cache.pool.table_LE.cpu().numpy(), cache.pool.slot_of_LE)  # device table == host map
