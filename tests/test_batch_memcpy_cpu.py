"""CPU tests of the batch-copy binding's logic and of the SM row gather (Triton under its interpreter)."""

from __future__ import annotations

import ctypes
import json

import numpy as np
import pytest
import torch

from moe_offload.kernels import batch_memcpy as bm
from moe_offload.kernels import batch_memcpy_probe as bmp
from moe_offload import hit_copy as hc
from moe_offload.kernels import copy as kc

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


@cpu_only
def test_loader_raises_no_cuda_on_cpu_only_torch():
    with pytest.raises(bm.BatchMemcpyUnavailable) as info:
        bm.load_batch_memcpy()
    assert info.value.reason == "no_cuda"


@cpu_only
def test_probe_reports_no_cuda_as_a_json_able_dict():
    result = bmp.probe()
    assert (result["ok"], result["reason"]) == (False, "no_cuda")
    assert json.loads(json.dumps(result)) == result


def test_legacy_null_stream_is_refused():
    with pytest.raises(bm.BatchMemcpyError, match="legacy NULL stream"):
        bm._check_stream(0, capturing=False)


def test_cuda_stream_legacy_handle_is_refused():
    with pytest.raises(bm.BatchMemcpyError, match="legacy NULL stream"):
        bm._check_stream(1, capturing=False)


def test_capturing_stream_is_refused():
    with pytest.raises(bm.BatchMemcpyError, match="capturing"):
        bm._check_stream(0x7F00_0000_1000, capturing=True)


def test_created_stream_that_is_not_capturing_is_accepted():
    bm._check_stream(0x7F00_0000_1000, capturing=False)


@pytest.mark.parametrize("version, signature", [(12080, "12.8"), (12090, "12.8"), (13000, "13"), (13030, "13")])
def test_signature_follows_the_runtime_version(version, signature):
    assert bm.signature_for(version) == signature


@pytest.mark.parametrize("version", [11080, 12060, 12079])
def test_runtime_before_12_8_is_too_old(version):
    with pytest.raises(bm.BatchMemcpyUnavailable) as info:
        bm.signature_for(version)
    assert info.value.reason == "runtime_too_old"


def test_runtime_with_an_unknown_major_is_declined_not_guessed():
    with pytest.raises(bm.BatchMemcpyUnavailable) as info:
        bm.signature_for(14000)
    assert info.value.reason == "runtime_unsupported"


def test_attribute_struct_matches_the_driver_types_header_layout():
    attrs = bm._MemcpyAttributes
    offsets = [attrs.srcAccessOrder.offset, attrs.srcLocHint.offset, attrs.dstLocHint.offset, attrs.flags.offset]
    assert (ctypes.sizeof(attrs), ctypes.alignment(attrs), offsets) == (24, 4, [0, 4, 12, 20])


def test_row_pointers_are_base_plus_row_times_stride():
    rows = np.array([0, 3, 1, 200_000], dtype=np.int64)
    base, row_bytes = 0x7F12_3456_0000, 2_654_220
    got = bm.row_pointers(base, row_bytes, rows)
    assert got.dtype == np.uint64
    assert got.tolist() == [base + r * row_bytes for r in rows.tolist()]


def test_row_pointers_reject_negative_rows():
    with pytest.raises(ValueError, match="negative"):
        bm.row_pointers(4096, 16, np.array([2, -1]))


class _FakeRuntime:
    """Stands in for the ctypes entry points; records calls, fails the batch call with ``batch_error``."""

    def __init__(self, signature: str, batch_error: int = 0):
        self.signature, self.batch_error = signature, batch_error
        self.batch_calls: list[tuple] = []
        self.last_error_cleared = 0

    def runtime(self) -> bm._CudaRuntime:
        return bm._CudaRuntime("libcudart.so.fake", 13000 if self.signature == "13" else 12080, 13000,
                               self.signature, self._batch, lambda handle, status: 0, self._clear,
                               lambda err: b"cudaErrorInvalidValue" if err == 1 else None)

    def _batch(self, *args):
        self.batch_calls.append(args)
        return self.batch_error

    def _clear(self):
        self.last_error_cleared += 1
        return 0


def _entries(n: int):
    ptrs = np.arange(1, n + 1, dtype=np.uint64) << np.uint64(20)
    return ptrs, ptrs + np.uint64(1 << 40), np.full(n, 4096, dtype=np.uint64)


@pytest.mark.parametrize("signature, nargs", [("12.8", 9), ("13", 8)])
def test_call_passes_array_buffers_and_the_signature_arity(signature, nargs):
    fake = _FakeRuntime(signature)
    dst, src, sizes = _entries(3)
    bm.BatchMemcpy(fake.runtime()).copy(dst, src, sizes, 0x1000)
    (args,) = fake.batch_calls
    assert len(args) == nargs
    assert args[:4] == (dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, 3)
    assert (args[6], args[-1]) == (1, 0x1000)  # one attribute for all entries; the stream last


def test_the_single_attribute_orders_sources_by_stream():
    copier = bm.BatchMemcpy(_FakeRuntime("13").runtime())
    attrs = bm._MemcpyAttributes.from_address(copier._attrs_addr)
    idx = (ctypes.c_size_t * 1).from_address(copier._attrs_idx_addr)
    assert (attrs.srcAccessOrder, attrs.flags, attrs.srcLocHint.type, idx[0]) == (1, 0, 0, 0)


def test_failed_call_clears_the_last_error_and_names_it():
    fake = _FakeRuntime("13", batch_error=1)
    with pytest.raises(bm.BatchMemcpyError) as info:
        bm.BatchMemcpy(fake.runtime()).copy(*_entries(2), 0x1000)
    assert (info.value.code, info.value.name, fake.last_error_cleared) == (1, "cudaErrorInvalidValue", 1)


def test_legacy_stream_is_refused_before_any_runtime_call():
    fake = _FakeRuntime("13")
    with pytest.raises(bm.BatchMemcpyError):
        bm.BatchMemcpy(fake.runtime()).copy(*_entries(2), 0)
    assert fake.batch_calls == []


def test_empty_batch_makes_no_call():
    fake = _FakeRuntime("13")
    bm.BatchMemcpy(fake.runtime()).copy(*_entries(0), 0x1000)
    assert fake.batch_calls == []


@pytest.mark.parametrize("bad", ["int64", "list", "length", "zero_size", "strided"])
def test_malformed_entries_are_refused(bad):
    dst, src, sizes = _entries(4)
    if bad == "int64":
        dst = dst.astype(np.int64)
    elif bad == "list":
        dst = dst.tolist()
    elif bad == "length":
        src = src[:3]
    elif bad == "zero_size":
        sizes[2] = 0
    else:
        dst = np.repeat(dst, 2)[::2]
    fake = _FakeRuntime("13")
    with pytest.raises(ValueError):
        bm.BatchMemcpy(fake.runtime()).copy(dst, src, sizes, 0x1000)
    assert fake.batch_calls == []


# --- gather_rows --------------------------------------------------------------------------------------

def _reference(dst_NR, dst_rows_M, src_SR, src_rows_M):
    out = dst_NR.clone()
    for d, s in zip(dst_rows_M.tolist(), src_rows_M.tolist()):
        out[d] = src_SR[s]
    return out


# (N destination rows, S source rows, M copied, R row bytes): one row, odd and tiny rows, no rows,
# rows that fill several kernel blocks unevenly, and 8-byte-aligned rows that take the int64 view.
GATHER_SHAPES = [(1, 1, 1, 16), (4, 7, 3, 1), (5, 9, 4, 12), (6, 6, 6, 33), (8, 3, 0, 64),
                 (3, 5, 2, 40_000), (16, 32, 16, 196_608 // 64), (2, 2, 2, 0)]


def _case(n, s, m, r, seed=0):
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(0, 256, (s, r), dtype=torch.uint8, generator=g)
    dst = torch.randint(0, 256, (n, r), dtype=torch.uint8, generator=g)
    dst_rows = torch.randperm(n, generator=g)[:m]
    src_rows = torch.randint(0, s, (m,), generator=g)
    return dst, dst_rows, src, src_rows


@pytest.mark.parametrize("shape", GATHER_SHAPES)
def test_gather_rows_on_cpu_matches_the_reference(shape):
    dst, dst_rows, src, src_rows = _case(*shape)
    want = _reference(dst, dst_rows, src, src_rows)
    kc.gather_rows(dst, dst_rows, src, src_rows)
    assert torch.equal(dst, want)


@pytest.fixture
def interpreted_kernel(monkeypatch):
    """The Triton kernel run by Triton's CPU interpreter.

    TRITON_INTERPRET is set for this test only: set at module level it would also turn the kernels of
    GPU tests collected later in the same process into interpreted ones.
    """
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = kc._gather_rows_kernel
    return kernel if isinstance(kernel, InterpretedFunction) else InterpretedFunction(kernel.fn)


@pytest.mark.parametrize("shape", [s for s in GATHER_SHAPES if s[2] and s[3]])
def test_triton_gather_kernel_matches_the_reference(shape, interpreted_kernel):
    dst, dst_rows, src, src_rows = _case(*shape, seed=1)
    want = _reference(dst, dst_rows, src, src_rows)
    kc._launch_gather(interpreted_kernel, dst, dst_rows, src, src_rows)
    assert torch.equal(dst, want)


def test_triton_gather_kernel_handles_strided_rows(interpreted_kernel):
    # Rows of 24 bytes inside 40-byte rows of a larger bank: the row stride is not the row size.
    base_src = torch.randint(0, 256, (6, 40), dtype=torch.uint8)
    base_dst = torch.zeros(5, 40, dtype=torch.uint8)
    src, dst = base_src[:, 8:32], base_dst[:, 16:40]
    dst_rows, src_rows = torch.tensor([4, 0, 2]), torch.tensor([1, 5, 3])
    want = _reference(dst, dst_rows, src, src_rows)
    kc._launch_gather(interpreted_kernel, dst, dst_rows, src, src_rows)
    assert torch.equal(dst, want)
    assert not base_dst[:, :16].any()  # nothing written outside the rows' 24 bytes


@pytest.mark.parametrize("bad", ["dtype", "row_bytes", "index_dtype", "index_count", "dims"])
def test_gather_rows_refuses_malformed_arguments(bad):
    dst, dst_rows, src, src_rows = _case(4, 4, 2, 8)
    if bad == "dtype":
        dst = dst.view(torch.int8)
    elif bad == "row_bytes":
        src = torch.zeros(4, 9, dtype=torch.uint8)
    elif bad == "index_dtype":
        dst_rows = dst_rows.to(torch.int32)
    elif bad == "index_count":
        src_rows = src_rows[:1]
    else:
        dst = dst.flatten()
    with pytest.raises(ValueError):
        kc.gather_rows(dst, dst_rows, src, src_rows)


# --- hit copy table -------------------------------------------------------------------------------------

@pytest.mark.parametrize("row_bytes", [12, 65_536, 2_654_220, 9_437_184, 1 << 30])
def test_h200_default_is_gather_at_every_row_size(row_bytes):
    assert hc.choose_hit_copy("NVIDIA H200", row_bytes) == "gather"


def test_unknown_device_falls_back_to_gather():
    assert hc.choose_hit_copy("Some Future GPU", 2_654_220) == "gather"


def test_largest_threshold_below_the_row_size_wins(monkeypatch):
    table = {"unknown_device": {"choice": "gather"}, "devices": {"X": {"rules": [
        {"min_row_bytes": 0, "choice": "gather"}, {"min_row_bytes": 1 << 20, "choice": "batch_memcpy"}]}}}
    monkeypatch.setattr(hc, "_hit_copy_table", lambda: table)
    assert [hc.choose_hit_copy("X", b) for b in (4096, 1 << 20, 1 << 24)] == ["gather", "batch_memcpy",
                                                                              "batch_memcpy"]


def test_runtime_versions_are_reported_as_major_dot_minor(monkeypatch):
    """The benchmarks' header reads them (it printed 'CUDA runtime unknown (ImportError)' when this was missing)."""
    fake = bm._CudaRuntime("libcudart.so.13", 13000, 13020, "13.x", None, None, None, None)
    monkeypatch.setattr(bm, "_resolve_runtime", lambda: fake)
    assert bm.runtime_versions() == ("13.0", "13.2")


@pytest.mark.parametrize("row_bytes", [4096, 36, 7])  # 8-, 4- and 1-byte words; one whole block, partial ones
def test_the_resident_gather_copies_exactly_the_rows_whose_slot_is_set(monkeypatch, row_bytes):
    """``gather_resident``: rows with a slot (>= 0) get that slot's bytes, rows with -1 keep theirs; the kernel
    (Triton's interpreter) and the torch path agree with the reference, for whole and partial row blocks."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    kernel = kc._gather_resident_kernel
    kernel = kernel if isinstance(kernel, InterpretedFunction) else InterpretedFunction(kernel.fn)
    g = torch.Generator().manual_seed(3)
    src = torch.randint(0, 256, (9, row_bytes), dtype=torch.uint8, generator=g)
    dst0 = torch.randint(0, 256, (6, row_bytes), dtype=torch.uint8, generator=g)
    slots = torch.tensor([4, -1, 0, 8, -1, 2], dtype=torch.int32)
    want = dst0.clone()
    for e, s in enumerate(slots.tolist()):
        if s >= 0:
            want[e] = src[s]
    via_kernel, via_torch = dst0.clone(), dst0.clone()
    kc._launch_rows(kernel, via_kernel, src, slots.numel(), lambda d, s: (d, s, slots))
    kc.gather_resident(via_torch, src, slots)
    assert torch.equal(via_kernel, want) and torch.equal(via_torch, want)
    with pytest.raises(ValueError, match="slot table row"):
        kc.gather_resident(via_torch, src, slots[:4])
