"""decode.miss_copy copy_engine (moe_offload/graph_copy.py): a captured step's routed misses copied by the copy engine
into one fixed row per expert, which the miss plan reads through its row map.

CPU: the row map the kernel writes equals its reference (ids out of range, repeats); with the rows the graph's copies
fill, the miss plan reads every routed pair's own expert bytes, copies nothing itself and counts the experts as row-map
reads (what ``DecodeResidency.account`` books as ``decode_graph_h2d``); the setting is declined on a CPU with one event
and a count, and decoding gives the ids of ``uva``. tests/gpu/test_graph_copy_gpu.py runs the graph itself."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from test_decode_static import _engine, _static_greedy

from moe_offload.graph_copy import CHUNK, _ConditionalParams, _Handles, _NodeParams, kernel_source, \
    routed_miss_rows_reference
from moe_offload.kernels.decode_miss import count_step_reference, serve_misses, serve_misses_reference


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_the_row_map_marks_exactly_the_routed_missing_experts(data):
    E = data.draw(st.integers(1, 40))
    table = torch.tensor(data.draw(st.lists(st.integers(-1, 5), min_size=E, max_size=E)), dtype=torch.int32)
    ids = data.draw(st.lists(st.integers(-2, E + 2), min_size=1, max_size=30))
    base = data.draw(st.integers(0, 50))
    pf = routed_miss_rows_reference(torch.tensor(ids).reshape(1, -1), table, base)
    want = [base + e if (e in ids and table[e] < 0) else -1 for e in range(E)]
    assert pf.dtype == torch.int32 and pf.tolist() == want


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_with_the_graph_rows_filled_the_plan_reads_every_pair_from_them_and_copies_nothing(seed):
    g = torch.Generator().manual_seed(seed)
    E, R, S, T, K = 24, 44, 6, 4, 6
    host = torch.randint(0, 256, (E, R), dtype=torch.uint8, generator=g)
    slot = torch.full((E,), -1, dtype=torch.int32)
    resident = torch.randperm(E, generator=g)[:S]
    slot[resident] = torch.arange(S, dtype=torch.int32)
    pool = torch.zeros((S + E, R), dtype=torch.uint8)  # X = E scratch rows: one per expert
    pool[:S] = host[resident]
    routed = torch.randint(0, E, (T, K), generator=g)
    routed[0, 0] = -1  # a pad id: row -1, nothing copied
    pf = routed_miss_rows_reference(routed, slot, S)
    for e in (pf >= 0).nonzero().flatten().tolist():  # what the IF nodes' memcpys do at replay
        pool[S + e] = host[e]
    before = pool.clone()
    counts = torch.zeros(5, dtype=torch.int64)
    record = torch.zeros((T, K), dtype=torch.int32)
    rows = serve_misses(slot, routed, host, pool, S, stats=(counts, record), pf_row_E=pf)
    assert torch.equal(pool, before)  # the SM copy copied nothing
    assert torch.equal(rows, serve_misses_reference(slot, routed, host, pool.clone(), S, pf))
    for (t, k), e in zip(torch.cartesian_prod(torch.arange(T), torch.arange(K)).tolist(), routed.flatten().tolist()):
        if e < 0:
            assert rows[t, k] == -1
        else:
            assert torch.equal(pool[rows[t, k]], host[e])
            if slot[e] < 0:
                assert rows[t, k] == S + e  # the expert's own fixed row
    valid = [e for e in routed.flatten().tolist() if e >= 0]
    missed = [e for e in valid if slot[e] < 0]
    assert counts.tolist() == [len(valid), len(missed), 0, len(set(valid)), len(set(missed))]
    ref = torch.zeros(6, dtype=torch.int64)
    count_step_reference(routed, slot, pf, ref, torch.zeros((T, K), dtype=torch.int32))
    assert ref[:5].tolist() == counts.tolist()


def test_a_copy_engine_miss_copy_on_a_cpu_is_declined_once_counted_and_decodes_like_uva(tiny_ckpt, events):
    """decode.miss_copy copy_engine (graph_copy.py) off CUDA: the plain copy."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompt = list(range(10, 26))
    want = _static_greedy(_engine(path, "cache.budget=0.3"), prompt, 6)
    eng = _engine(path, "cache.budget=0.3", "decode.miss_copy=copy_engine")
    got = _static_greedy(eng, prompt, 6)
    assert eng.cache.decode.graph_copy is None
    declined = [e for e in events() if e["event"] == "decode_miss_copy_declined"]
    assert len(declined) == 1 and declined[0]["reason"] == "not_cuda" and "miss_copy=uva" in declined[0]["change_with"]
    st = eng.cache.stats()
    assert st["declined"]["decode_miss_copy:not_cuda"] == 1 and st["routed_path"]["miss_copy"] == "uva"
    eng.cache.reset()
    assert eng.cache.stats()["declined"]["decode_miss_copy:not_cuda"] == 1  # booked again after a reset
    assert got == want


def test_the_runtime_structs_have_the_cuda_layout_and_the_kernel_source_is_filled_in():
    """cudaGraphNodeParams is 256 bytes with its union at byte 16; cudaConditionalNodeParams starts with the handle
    (8), type (4), size (4), then phGraph_out (8). The handles ride in the kernel parameters (<= 4 KiB in all)."""
    import ctypes

    assert ctypes.sizeof(_NodeParams) == 256 and _NodeParams.conditional.offset == 16
    assert [getattr(_ConditionalParams, f).offset for f in ("handle", "type", "size", "phGraph_out")] == [0, 8, 12, 16]
    assert ctypes.sizeof(_Handles) == 8 * CHUNK and ctypes.sizeof(_Handles) + 64 <= 4096
    for dtype, idt in ((torch.int32, "int"), (torch.int64, "long long")):
        src, name = kernel_source(dtype)
        assert "IDT" not in src and "CHUNK" not in src and f"h[{CHUNK}]" in src
        assert f'extern "C" __global__ void {name}(const {idt}* ids' in src
