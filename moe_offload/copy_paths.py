"""Row-copy mechanics shared by the copy paths: row copies as data (``RowCopy``), runs of consecutive
ids, pointer arrays for one batched call, ``Tensor.copy_`` per run, and sync-free index tensors.
The choice of path lives in ``hit_copy.py``.

Every function here enqueues on the stream current at the call (the cache enters its copy
stream first) and never synchronizes the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch



@dataclass(frozen=True)
class RowCopy:
    """Rows ``src_rows`` of ``src [*, row_bytes]`` -> rows ``dst_rows`` of ``dst [*, row_bytes]``."""

    dst: torch.Tensor
    src: torch.Tensor
    dst_rows: np.ndarray
    src_rows: np.ndarray


def runs(ids: np.ndarray) -> list[tuple[int, int]]:
    """Sorted ids -> maximal runs ``[start, end)`` of consecutive ids."""
    if ids.size == 0:
        return []
    breaks = np.nonzero(np.diff(ids) != 1)[0]
    starts = np.concatenate(([ids[0]], ids[breaks + 1]))
    ends = np.concatenate((ids[breaks] + 1, [ids[-1] + 1]))
    return list(zip(starts.tolist(), ends.tolist()))


def pointer_arrays(copies: list[RowCopy], coalesce: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(dst_ptrs, src_ptrs, sizes) as uint64 arrays for one batched call.

    ``coalesce``: rows whose src and dst ids both advance by one are merged into one entry
    (H2D misses: dst row e <- host row e; with ``dst_rows is src_rows`` their runs are found once, fewer array
    operations on the host between a routed fill's routing read and its copy, ``staging.py``).
    """
    dsts, srcs, sizes = [], [], []
    for c in copies:
        if c.dst_rows.size == 0:
            continue
        row = c.dst.shape[1]
        if coalesce and c.dst_rows is c.src_rows:  # row e -> row e (a fill's misses): one set of runs serves both
            first, n = _runs_of(c.dst_rows)
            off = c.dst_rows[first].astype(np.uint64) * np.uint64(row)
            dsts.append(off + np.uint64(c.dst.data_ptr()))
            srcs.append(off + np.uint64(c.src.data_ptr()))
            sizes.append(n.astype(np.uint64) * np.uint64(row))
            continue
        d, s = c.dst_rows.astype(np.uint64), c.src_rows.astype(np.uint64)
        if coalesce:
            brk = np.nonzero((np.diff(d.astype(np.int64)) != 1) | (np.diff(s.astype(np.int64)) != 1))[0]
            first = np.concatenate(([0], brk + 1))
            last = np.concatenate((brk, [d.size - 1]))
            n = (last - first + 1).astype(np.uint64)
            d, s = d[first], s[first]
        else:
            n = np.ones_like(d)
        dsts.append(np.uint64(c.dst.data_ptr()) + d * np.uint64(row))
        srcs.append(np.uint64(c.src.data_ptr()) + s * np.uint64(row))
        sizes.append(n * np.uint64(row))
    if not dsts:
        empty = np.zeros(0, dtype=np.uint64)
        return empty, empty, empty
    return np.concatenate(dsts), np.concatenate(srcs), np.concatenate(sizes)


def _runs_of(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(first index, length)`` of each maximal run of consecutive ids in sorted ``ids`` (non-empty)."""
    brk = np.flatnonzero(np.diff(ids) != 1)
    first = np.concatenate(([0], brk + 1))
    return first, np.append(brk, ids.size - 1) - first + 1


def copy_rows_torch(copies: list[RowCopy], coalesce: bool) -> None:
    """Row copies with ``Tensor.copy_`` (one call per run of consecutive rows)."""
    for c in copies:
        if c.dst_rows.size == 0:
            continue
        if coalesce:
            for a, b in runs(c.dst_rows):
                off = int(c.src_rows[np.searchsorted(c.dst_rows, a)]) - a
                c.dst[a:b].copy_(c.src[a + off:b + off], non_blocking=True)
        else:
            for d, s in zip(c.dst_rows.tolist(), c.src_rows.tolist()):
                c.dst[d].copy_(c.src[s], non_blocking=True)


def index_tensor(rows: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host index array -> int64 tensor on ``device`` without a host sync: staged through pinned
    memory (torch's host allocator keeps the block until the copy on the current stream is done);
    a pageable ``.to(cuda)`` would wait for the whole stream."""
    t = torch.from_numpy(np.ascontiguousarray(rows, dtype=np.int64))
    if device.type != "cuda":
        return t
    return t.pin_memory().to(device, non_blocking=True)


def versions() -> dict:
    cuda_rt = driver = None
    if torch.cuda.is_available():
        try:
            from moe_offload.kernels.batch_memcpy import runtime_versions

            cuda_rt, driver = runtime_versions()
        except Exception as exc:  # the binding itself may be what failed; report what we can
            cuda_rt = f"unknown ({type(exc).__name__})"
    return {"cuda_runtime": cuda_rt or torch.version.cuda, "driver": driver, "torch": torch.__version__}
