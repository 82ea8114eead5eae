"""SM gather for slot -> staging copies, and the measured choice between it and the batch copy path.

Legend: S source rows (the slot pool), N destination rows (a staging buffer, one row per expert),
M rows copied, R bytes per row. Banks are uint8 ``[rows, R]`` tensors whose rows are contiguous.

:func:`gather_rows` is one Triton kernel on CUDA (rows copied by index, 16-byte vector loads where the
rows allow it), and ``index_select`` + ``index_copy_`` on other devices. Which path copies prefill hits on a device is
decided in ``moe_offload/hit_copy.py`` (the per-GPU table is data next to that resolver).
"""

from __future__ import annotations

from typing import Any

import torch

from moe_offload.log import log_once

try:  # importing triton touches no CUDA
    import triton
    import triton.language as tl
except ImportError:  # the torch path serves every device then (logged once on CUDA)
    triton = None

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))  # (bytes, dtype)
_BLOCK_BYTES = 16384  # bytes per program: 4 warps x 32 threads x 8 vectors of 16 B at 8-byte words
_MAX_GRID_Y = 65535  # CUDA limit on grid dimension y (the chunks of one row)

if triton is not None:

    @triton.jit
    def _gather_rows_kernel(dst_ptr, dst_rows_ptr, src_ptr, src_rows_ptr, row_elems, dst_stride, src_stride,
                            BLOCK: tl.constexpr, EVEN: tl.constexpr):
        """Program (m, c) copies elements [c*BLOCK, (c+1)*BLOCK) of row src_rows[m] to row dst_rows[m]."""
        m = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        src_row = tl.load(src_rows_ptr + m)  # int64: row * stride cannot overflow
        dst_row = tl.load(dst_rows_ptr + m)
        src = src_ptr + src_row * src_stride + offs
        dst = dst_ptr + dst_row * dst_stride + offs
        if EVEN:
            tl.store(dst, tl.load(src))
        else:
            mask = offs < row_elems
            tl.store(dst, tl.load(src, mask=mask), mask=mask)

    @triton.jit
    def _gather_resident_kernel(dst_ptr, src_ptr, slot_ptr, row_elems, dst_stride, src_stride,
                                BLOCK: tl.constexpr, EVEN: tl.constexpr):
        """Program (e, c) copies elements [c*BLOCK, (c+1)*BLOCK) of row slot[e] to row e, where slot[e] >= 0."""
        e = tl.program_id(0)
        slot = tl.load(slot_ptr + e).to(tl.int64)
        if slot < 0:
            return
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        src = src_ptr + slot * src_stride + offs
        dst = dst_ptr + e.to(tl.int64) * dst_stride + offs
        if EVEN:
            tl.store(dst, tl.load(src))
        else:
            mask = offs < row_elems
            tl.store(dst, tl.load(src, mask=mask), mask=mask)

else:
    _gather_rows_kernel = None
    _gather_resident_kernel = None


def gather_rows(dst_NR: torch.Tensor, dst_rows_M: torch.Tensor, src_SR: torch.Tensor,
                src_rows_M: torch.Tensor) -> None:
    """``dst_NR[dst_rows_M[i]] = src_SR[src_rows_M[i]]`` for every i, in place, on the current stream.

    dst_NR, src_SR: uint8 [rows, R] with contiguous rows, same device; dst_rows_M, src_rows_M: int64 [M]
    on that device. Indices are not range-checked (that would sync the device); out-of-range rows are
    undefined behaviour on CUDA. With repeated destination rows, which source wins is unspecified.
    """
    _check_gather_args(dst_NR, dst_rows_M, src_SR, src_rows_M)
    if dst_rows_M.numel() == 0 or dst_NR.shape[1] == 0:
        return
    if dst_NR.is_cuda and _gather_rows_kernel is not None:
        _launch_gather(_gather_rows_kernel, dst_NR, dst_rows_M, src_SR, src_rows_M)
        return
    if dst_NR.is_cuda:
        log_once("gather_rows.no_triton", "gather_rows_fallback", path="index_select+index_copy_",
                 reason="triton is not installed", fix="pip install 'moe-offload[triton]'")
    dst_NR.index_copy_(0, dst_rows_M, src_SR.index_select(0, src_rows_M))


def gather_resident(dst_NR: torch.Tensor, src_SR: torch.Tensor, slot_N: torch.Tensor) -> None:
    """``dst_NR[e] = src_SR[slot_N[e]]`` for every e with ``slot_N[e] >= 0`` (rows with -1 are left as they are), in
    place, on the current stream, with no host index: ``slot_N`` is a device slot table row (int32/int64 ``[N]``).

    Why: host indices reach the device by H2D copies, and on the H200 a small H2D copy on the hit stream waited
    behind the copy stream's large miss copies for a whole layer (Flash-Next, 512 experts: README "Decisions",
    prefill hits without host indices); reading the table costs no copy-engine work at all."""
    if slot_N.dim() != 1 or slot_N.shape[0] != dst_NR.shape[0] or slot_N.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_N must be an int32/int64 [N={dst_NR.shape[0]}] slot table row, got "
                         f"{slot_N.dtype} {tuple(slot_N.shape)}")
    if slot_N.device != dst_NR.device:
        raise ValueError(f"slot_N on {slot_N.device} but the rows are on {dst_NR.device}")
    if slot_N.numel() == 0 or dst_NR.shape[1] == 0:
        return
    if dst_NR.is_cuda and _gather_resident_kernel is not None:
        _launch_rows(_gather_resident_kernel, dst_NR, src_SR, slot_N.numel(), lambda d, s: (d, s, slot_N))
        return
    rows = (slot_N >= 0).nonzero().flatten()  # CPU and triton-less devices (syncs: not a hot path there)
    dst_NR.index_copy_(0, rows, src_SR.index_select(0, slot_N[rows].long()))


def _check_gather_args(dst_NR: Any, dst_rows_M: Any, src_SR: Any, src_rows_M: Any) -> None:
    for name, t in (("dst_NR", dst_NR), ("src_SR", src_SR)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
            raise ValueError(f"{name} must be a 2-D uint8 tensor [rows, row_bytes], got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous (stride(1) == 1), got strides {t.stride()}")
    if dst_NR.shape[1] != src_SR.shape[1]:
        raise ValueError(f"row bytes differ: dst_NR {tuple(dst_NR.shape)} vs src_SR {tuple(src_SR.shape)}")
    if dst_NR.device != src_SR.device:
        raise ValueError(f"dst_NR on {dst_NR.device} but src_SR on {src_SR.device}")
    for name, t in (("dst_rows_M", dst_rows_M), ("src_rows_M", src_rows_M)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.dim() != 1:
            raise ValueError(f"{name} must be a 1-D int64 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        if t.device != dst_NR.device:
            raise ValueError(f"{name} on {t.device} but the rows are on {dst_NR.device}")
    if dst_rows_M.shape != src_rows_M.shape:
        raise ValueError(f"index counts differ: dst_rows_M {tuple(dst_rows_M.shape)}, "
                         f"src_rows_M {tuple(src_rows_M.shape)}")


def _word_view(t_XR: torch.Tensor, word: int) -> bool:
    """Whether ``t_XR`` can be viewed as ``word``-byte elements (row size, row stride and start aligned)."""
    return (t_XR.shape[1] % word == 0 and t_XR.stride(0) % word == 0 and t_XR.storage_offset() % word == 0
            and t_XR.data_ptr() % word == 0)


def _launch_gather(kernel: Any, dst_NR: torch.Tensor, dst_rows_M: torch.Tensor, src_SR: torch.Tensor,
                   src_rows_M: torch.Tensor) -> None:
    """Launch ``kernel`` (the jitted kernel, or an interpreted one in tests) on checked arguments."""
    _launch_rows(kernel, dst_NR, src_SR, dst_rows_M.numel(), lambda d, s: (d, dst_rows_M, s, src_rows_M))


def _launch_rows(kernel: Any, dst_NR: torch.Tensor, src_SR: torch.Tensor, rows: int, pointer_args) -> None:
    """Launch ``kernel(*pointer_args(dst, src), row_elems, dst_stride, src_stride)`` over ``rows`` x row chunks
    (``dst``, ``src``: the banks viewed as the widest word both rows allow)."""
    word, dtype = next((w, d) for w, d in _WORDS if _word_view(dst_NR, w) and _word_view(src_SR, w))
    dst_w, src_w = dst_NR.view(dtype), src_SR.view(dtype)
    row_elems = dst_NR.shape[1] // word
    block = min(_BLOCK_BYTES // word, triton.next_power_of_2(row_elems))
    chunks = triton.cdiv(row_elems, block)
    if chunks > _MAX_GRID_Y:
        raise ValueError(f"rows of {dst_NR.shape[1]} bytes exceed the gather kernel's limit "
                         f"({_MAX_GRID_Y * _BLOCK_BYTES} bytes at {word}-byte alignment)")
    kernel[(rows, chunks)](
        *pointer_args(dst_w, src_w), row_elems, dst_w.stride(0), src_w.stride(0),
        BLOCK=block, EVEN=row_elems % block == 0, num_warps=4 if block * word >= 4096 else 1,
    )
