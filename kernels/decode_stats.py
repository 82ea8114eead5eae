"""One small kernel after the decode miss server: the step's counters and its routing record.

Legend: T tokens, K top-k, M = T*K routed pairs, L MoE layers.

From ``rows_TK`` (``kernels/decode_miss.py``: a pair missed iff its row >= ``scratch_base``, and the
j-th distinct missing expert got row ``scratch_base + j``, j dense from 0) one program adds to
``counts_L3[lp]``: routed pairs, missed pairs, distinct missed experts (= max j + 1); and it stores the
routed ids into ``record_LMK[lp]`` (mapped pinned host memory on CUDA: the host reads it a step later,
no D2H call). Replaces ~9 tiny torch kernels per layer; no host sync, capturable.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _stats_kernel(ids_ptr, rows_ptr, counts_ptr, record_ptr, M, scratch_base, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        mask = offs < M
        ids = tl.load(ids_ptr + offs, mask=mask, other=0)
        rows = tl.load(rows_ptr + offs, mask=mask, other=-1)
        valid = mask & (rows >= 0)
        missed = valid & (rows >= scratch_base)
        n_pairs = tl.sum(valid.to(tl.int64), 0)
        n_missed = tl.sum(missed.to(tl.int64), 0)
        distinct = tl.max(tl.where(missed, rows - scratch_base + 1, 0), 0).to(tl.int64)
        tl.store(counts_ptr, tl.load(counts_ptr) + n_pairs)
        tl.store(counts_ptr + 1, tl.load(counts_ptr + 1) + n_missed)
        tl.store(counts_ptr + 2, tl.load(counts_ptr + 2) + distinct)
        tl.store(record_ptr + offs, ids.to(tl.int32), mask=mask)


def decode_stats(ids_TK: torch.Tensor, rows_TK: torch.Tensor, counts_3: torch.Tensor, record_MK: torch.Tensor,
                 scratch_base: int) -> None:
    """Add the step's (pairs, missed pairs, distinct missed experts) to ``counts_3`` (int64 [3]) and
    store ``ids_TK`` into the first T rows of ``record_MK`` (int32 [>= T, K]); in place."""
    T, K = ids_TK.shape
    if rows_TK.shape != ids_TK.shape or counts_3.shape != (3,) or counts_3.dtype != torch.int64:
        raise ValueError(f"ids {tuple(ids_TK.shape)}, rows {tuple(rows_TK.shape)}, counts {tuple(counts_3.shape)} "
                         f"{counts_3.dtype}: expected rows like ids and int64 counts [3]")
    if record_MK.dtype != torch.int32 or record_MK.shape[0] < T or record_MK.shape[1] != K or not record_MK.is_contiguous():
        raise ValueError(f"record must be a contiguous int32 [>= {T}, {K}] tensor, got {record_MK.dtype} "
                         f"{tuple(record_MK.shape)}")
    if not ids_TK.is_cuda or triton is None:
        valid = rows_TK >= 0
        missed = valid & (rows_TK >= scratch_base)
        distinct = (rows_TK[missed].max() - scratch_base + 1) if bool(missed.any()) else 0
        counts_3 += torch.stack([valid.sum(), missed.sum(), torch.as_tensor(distinct)]).to(counts_3.device)
        record_MK[:T].copy_(ids_TK)
        return
    from moe_offload.kernels.nvfp4 import device_guard

    M = T * K
    with device_guard(ids_TK.device):
        _stats_kernel[(1,)](ids_TK.contiguous(), rows_TK.contiguous(), counts_3, record_MK, M, scratch_base,
                            BLOCK=triton.next_power_of_2(max(M, 2)), num_warps=4)
