"""decode.miss_copy copy_engine on CUDA (moe_offload/graph_copy.py): the start-up probe passes; graph-replayed decode
steps whose routed misses the copy engine copies inside the graph give the bits of the same steps read over UVA, while
residency changes between replays; the bytes are booked as decode_graph_h2d. Passed on an H100 at 10cf59a, torch
2.11+cu130 (which has no CUDAGraph.begin_capture_to_if_node, so graph_copy.py drives the runtime)."""

import pytest
import torch

from test_decode_gpu import _engine, _run

from moe_offload.decode_graph import StaticDecoder
from moe_offload.graph_copy import routed_miss_rows_reference

pytestmark = pytest.mark.gpu


def test_the_start_up_probe_passes_and_a_captured_layer_writes_the_reference_row_map(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "cache.budget=0.25", "decode.miss_copy=copy_engine")
    cache = eng.cache
    g = cache.decode.graph_copy
    assert g is not None and cache.decode.miss_copy_declined is None
    layer, lp = cache.store.layers[1], 1
    ids = torch.randint(0, cache.E, (3, cache.store.geometry.top_k), device="cuda")
    table = cache.pool.table_LE[lp]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pf = g.enqueue(layer, table, ids)
    cache.pool.rows_NR[g.base:g.base + cache.E].zero_()
    graph.replay()
    torch.cuda.synchronize()
    want = routed_miss_rows_reference(ids.cpu(), table.cpu(), g.base)
    assert torch.equal(pf.cpu(), want)
    host = cache.store.rows(layer)
    for e in range(cache.E):
        row = cache.pool.rows_NR[g.base + e].cpu()
        assert torch.equal(row, host[e]) if want[e] >= 0 else not row.any(), f"expert {e}"


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "bf16"])
def test_graph_replayed_decode_with_copy_engine_misses_gives_the_bits_of_uva(tiny_ckpt, fmt):
    path = tiny_ckpt("tiny-qwen3-moe", fmt)
    prompts = [list(range(10, 42)), list(range(50, 82))]
    want = _run(StaticDecoder(_engine(path, "cache.budget=8 slots"), 2, 64, graphs=True), prompts, 10)
    eng = _engine(path, "cache.budget=8 slots", "decode.miss_copy=copy_engine")
    eng.cache.reset()
    got = _run(StaticDecoder(eng, 2, 64, graphs=True), prompts, 10)
    st = eng.cache.stats()
    assert st["compute"].get("decode_graph_captures") == 1 and st["declined"] == {}
    assert st["compute"].get("decode_graph_copy_layers", 0) > 0
    assert st["total"]["evictions"] > 0  # residency changed between replays
    assert st["total"]["bytes"]["decode_graph_h2d"] > 0
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.equal(a, b), f"step {i} differs"
