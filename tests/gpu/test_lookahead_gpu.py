"""decode.lookahead on CUDA: the prefetch runs on its own stream (a fork and a join per layer, graph edges when
captured); eager and graph-replayed steps with it give the bits of the same steps without it while residency
changes between replays; a steady-state step with it makes no host sync."""

import pytest
import torch

from test_decode_gpu import _eager_step_without_sync, _engine, _run

from moe_offload.decode_graph import StaticDecoder
from moe_offload.kernels.decode_miss import prefetch_misses, prefetch_misses_reference

pytestmark = pytest.mark.gpu


def test_the_prefetch_from_mapped_host_memory_equals_its_reference(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "cache.budget=0.25", "decode.lookahead=true")
    cache, layer = eng.cache, eng.cache.store.layers[1]
    la, lp = cache.decode.lookahead, 1
    E = cache.E
    ids = torch.randint(0, E, (4, cache.store.geometry.top_k), device="cuda")
    row = torch.empty(E, dtype=torch.int32, device="cuda")
    copied = torch.zeros(1, dtype=torch.int64, device="cuda")
    prefetch_misses(cache.pool.table_LE[lp], ids, cache.store.device_rows(layer, cache.device), cache.pool.rows_NR,
                    la.base, row, copied)
    got_rows = cache.pool.rows_NR[la.base:la.base + la.rows].clone()
    pool_cpu = cache.pool.rows_NR.cpu()
    row_ref = torch.empty(E, dtype=torch.int32)
    n = prefetch_misses_reference(cache.pool.table_LE[lp].cpu(), ids.cpu(), cache.store.rows(layer), pool_cpu,
                                  la.base, row_ref)
    assert int(copied) == n and torch.equal(row.cpu(), row_ref)
    assert torch.equal(got_rows[:n].cpu(), pool_cpu[la.base:la.base + n])


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "bf16"])
def test_graph_replayed_decode_with_the_lookahead_gives_the_bits_without_it(tiny_ckpt, fmt):
    path = tiny_ckpt("tiny-qwen3-moe", fmt)
    prompts = [list(range(10, 42)), list(range(50, 82))]
    want = _run(StaticDecoder(_engine(path, "cache.budget=8 slots"), 2, 64, graphs=False), prompts, 10)
    for graphs in (False, True):
        eng = _engine(path, "cache.budget=8 slots", "decode.lookahead=true")
        eng.cache.reset()
        got = _run(StaticDecoder(eng, 2, 64, graphs=graphs), prompts, 10)
        st = eng.cache.stats()
        if graphs:
            assert st["compute"].get("decode_graph_captures") == 1 and st["declined"] == {}
        assert st["total"]["evictions"] > 0  # residency changed between replays
        assert st["lookahead"]["used"] > 0 and st["total"]["bytes"]["decode_lookahead"] > 0
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"graphs={graphs}: step {i} differs"


def test_a_steady_state_step_with_the_lookahead_makes_no_host_sync(tiny_ckpt):
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-ct"), "cache.budget=0.37", "decode.lookahead=true")
    _eager_step_without_sync(eng, [list(range(5, 30))])
    assert eng.cache.stats()["lookahead"]["copied"] > 0


def test_a_slow_prefetch_is_still_waited_for(tiny_ckpt, monkeypatch):
    """Each prefetch starts with ~1 ms of GPU sleep on the lookahead stream: a missing join (the next layer's
    miss server reading its rows before the copy lands) would read stale rows and change the logits."""
    from moe_offload import lookahead as la_module

    real = la_module.prefetch_misses

    def slow(*args, **kwargs):
        torch.cuda._sleep(2_000_000)  # cycles, on the current (lookahead) stream
        return real(*args, **kwargs)

    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompts = [list(range(10, 42))]
    want = _run(StaticDecoder(_engine(path, "cache.budget=8 slots"), 1, 64, graphs=False), prompts, 6)
    monkeypatch.setattr(la_module, "prefetch_misses", slow)
    for graphs in (False, True):
        eng = _engine(path, "cache.budget=8 slots", "decode.lookahead=true")
        got = _run(StaticDecoder(eng, 1, 64, graphs=graphs), prompts, 6)
        assert eng.cache.stats()["lookahead"]["used"] > 0
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"graphs={graphs}: step {i} differs"
