"""GPU tests of the cudaMemcpyBatchAsync binding (the probe race included) and of the SM row gather."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_offload.kernels import batch_memcpy as bm
from moe_offload.kernels import batch_memcpy_probe as bmp
from moe_offload.kernels import copy as kc

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

QWEN_NVFP4_EXPERT_BYTES = 2_654_220  # w13 + w2 packed codes and block scales + 3 fp32 global scales


@pytest.fixture(scope="module")
def copier() -> bm.BatchMemcpy:
    try:
        return bm.load_batch_memcpy()
    except bm.BatchMemcpyUnavailable as exc:
        pytest.skip(f"batch path unavailable here: {exc}")


@pytest.fixture(scope="module")
def warmed(copier):
    """A warmed-up process: allocator, stream pool and cuBLAS all initialised, as in a serving process."""
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ a
    bmp._run_probe(None, joined=True)
    torch.cuda.synchronize()
    return a


def test_unjoined_probe_reads_wrong_bytes_behind_a_busy_current_stream(warmed):
    # Regression for the probe race: a 1e7-cycle spin on the current stream delays the probe's fills
    # past the private stream's copy. Measured on the H200: 20/20 failures at 1e6..1e8 cycles; 18 of 20
    # leaves room for a rare scheduling hiccup while still proving the unjoined variant is broken.
    failures = 0
    for _ in range(20):
        torch.cuda._sleep(int(1e7))
        try:
            bmp._probe_unjoined()
        except bm.BatchMemcpyUnavailable as exc:
            failures += exc.reason == "wrong_bytes"
        torch.cuda.synchronize()
    assert failures >= 18


@pytest.mark.parametrize("backlog", [0, 1, 8, 40, 150])
def test_joined_probe_passes_behind_a_backlog_of_matmuls(warmed, backlog):
    for _ in range(10):
        for _ in range(backlog):
            warmed @ warmed
        bmp._run_probe(None, joined=True)  # the loader's probe, uncached; raises on wrong bytes
    torch.cuda.synchronize()


@pytest.mark.parametrize("cycles", [int(1e6), int(1e7), int(1e8)])
def test_joined_probe_passes_behind_a_spinning_kernel(warmed, cycles):
    for _ in range(10):
        torch.cuda._sleep(cycles)
        bmp._run_probe(None, joined=True)
    torch.cuda.synchronize()


def _bank(rows: int, row_bytes: int, seed: int, **kw) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g).to(**kw)


@pytest.mark.parametrize("row_bytes", [1_572_864, 3 * 1024 * 1024 + 7])
def test_h2d_and_d2d_batch_copies_of_mb_rows_equal_torch_copies(copier, row_bytes):
    host_SR = _bank(24, row_bytes, seed=1).pin_memory()
    slots_SR = _bank(24, row_bytes, seed=2, device="cuda")
    stage_h2d_NR = torch.zeros(16, row_bytes, dtype=torch.uint8, device="cuda")
    stage_d2d_NR = torch.zeros_like(stage_h2d_NR)
    src_rows = np.random.default_rng(3).permutation(24)[:16]
    dst_rows = np.random.default_rng(4).permutation(16)
    sizes = np.full(16, row_bytes, dtype=np.uint64)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    for dst, src in ((stage_h2d_NR, host_SR), (stage_d2d_NR, slots_SR)):
        copier.copy(bm.row_pointers(dst.data_ptr(), row_bytes, dst_rows),
                    bm.row_pointers(src.data_ptr(), row_bytes, src_rows), sizes, stream)
    stream.synchronize()
    dst_idx, src_idx = torch.from_numpy(dst_rows), torch.from_numpy(src_rows)
    want_h2d = torch.zeros_like(stage_h2d_NR)
    want_h2d[dst_idx.cuda()] = host_SR[src_idx].cuda()
    want_d2d = torch.zeros_like(stage_d2d_NR)
    want_d2d[dst_idx.cuda()] = slots_SR[src_idx.cuda()]
    assert torch.equal(stage_h2d_NR, want_h2d)
    assert torch.equal(stage_d2d_NR, want_d2d)


def _one_entry(nbytes: int = 4096):
    src = torch.arange(nbytes, device="cuda").to(torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
    ptrs = (np.array([dst.data_ptr()], np.uint64), np.array([src.data_ptr()], np.uint64))
    return dst, src, ptrs, np.array([nbytes], np.uint64)


def test_legacy_null_stream_is_refused(copier):
    stream = torch.cuda.default_stream()
    if stream.cuda_stream != 0:
        pytest.skip("this torch build's default stream is not the legacy NULL stream")
    dst, src, (dst_ptrs, src_ptrs), sizes = _one_entry()
    with pytest.raises(bm.BatchMemcpyError, match="legacy NULL stream"):
        copier.copy(dst_ptrs, src_ptrs, sizes, stream)


def test_runtime_rejection_clears_the_last_error_so_torch_launches_still_work(copier):
    # Bypass the stream check to make the runtime itself fail (cudaErrorInvalidValue on the NULL stream);
    # without cudaGetLastError() the next torch launch raised "CUDA error: invalid argument" (H200 notes).
    dst, src, (dst_ptrs, src_ptrs), sizes = _one_entry()
    with pytest.raises(bm.BatchMemcpyError) as info:
        copier._enqueue(dst_ptrs, src_ptrs, sizes, 0)
    assert (info.value.code, info.value.name) == (1, "cudaErrorInvalidValue")
    out = torch.ones(1024, device="cuda") * 3
    torch.cuda.synchronize()
    assert out.sum().item() == 3072


def test_capturing_stream_is_refused(copier):
    dst, src, (dst_ptrs, src_ptrs), sizes = _one_entry()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with pytest.raises(bm.BatchMemcpyError, match="capturing"):
        with torch.cuda.graph(graph, stream=stream):
            dst.add_(1)
            copier.copy(dst_ptrs, src_ptrs, sizes, torch.cuda.current_stream())
    torch.cuda.synchronize()


@pytest.mark.parametrize("row_bytes", [QWEN_NVFP4_EXPERT_BYTES, 1_572_864, 196_608, 12, 4099])
def test_gather_rows_on_gpu_equals_the_reference(row_bytes):
    slots_SR = _bank(48, row_bytes, seed=5, device="cuda")
    stage_NR = _bank(32, row_bytes, seed=6, device="cuda")
    g = torch.Generator().manual_seed(7)
    dst_rows = torch.randperm(32, generator=g)[:20].cuda()
    src_rows = torch.randperm(48, generator=g)[:20].cuda()
    want = stage_NR.clone()
    want.index_copy_(0, dst_rows, slots_SR.index_select(0, src_rows))
    kc.gather_rows(stage_NR, dst_rows, slots_SR, src_rows)
    assert torch.equal(stage_NR, want)


@pytest.mark.parametrize("row_bytes", [QWEN_NVFP4_EXPERT_BYTES, 196_608, 12, 4099])
def test_gather_resident_on_gpu_equals_the_reference_and_needs_no_host_to_device_copy(row_bytes):
    """The hit copy driven by the device slot table: rows with a slot get its bytes, rows with -1 keep theirs, and
    nothing goes through the copy engine (kernels/copy.py: host indices queued behind the miss copies)."""
    slots_SR = _bank(48, row_bytes, seed=5, device="cuda")
    stage_NR = _bank(32, row_bytes, seed=6, device="cuda")
    g = torch.Generator().manual_seed(8)
    table_N = torch.full((32,), -1, dtype=torch.int32)
    table_N[torch.randperm(32, generator=g)[:20]] = torch.randperm(48, generator=g)[:20].int()
    want = stage_NR.clone()
    for e, s in enumerate(table_N.tolist()):
        if s >= 0:
            want[e] = slots_SR[s]
    table_N = table_N.cuda()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        kc.gather_resident(stage_NR, slots_SR, table_N)
        torch.cuda.synchronize()
    assert torch.equal(stage_NR, want)
    assert not [e.key for e in prof.key_averages() if "Memcpy" in e.key], "the resident gather made a memcpy"
