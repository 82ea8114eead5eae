"""Alignment for the fused MoE kernels (Triton): routed pairs grouped by bank row, each row's group padded
to whole BLOCK_M blocks, in three small kernels (count, prefix sum, place) and no host sync.

Legend: T tokens, K top-k, M = T*K routed pairs, N bank rows, P padded pair slots (multiple of BLOCK_M),
B = P / BLOCK_M blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.nvfp4 import device_guard


def max_padded_pairs(pairs: int, num_rows: int, block_m: int) -> int:
    """Upper bound of the padded length P (a multiple of ``block_m``), known without device reads:
    each non-empty row adds at most ``block_m - 1`` padding, and at most min(N, M) rows are non-empty."""
    bound = pairs + min(num_rows, pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@dataclass
class MoeAlignment:
    """Routed pairs grouped by bank row, padded to whole blocks (all device tensors, no host sync).

    ``sorted_ids_P`` int32: pair ids (t*K + k) grouped by row (rows in ascending order), each group
    padded to ``block_m`` with the sentinel M; ``block_row_B`` int32: the bank row of each block (-1 past the end
    from ``moe_align``; ``decode_moe.decode_align`` writes only the used blocks); ``num_padded_1`` int32: the real
    padded length (the kernels' blocks at or past it exit before reading anything else)."""

    sorted_ids_P: torch.Tensor
    block_row_B: torch.Tensor
    num_padded_1: torch.Tensor
    block_m: int


@triton.jit
def _count_rows_kernel(rows_ptr, counts_ptr, M, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + offs, mask=offs < M, other=0)
    ok = (offs < M) & (rows >= 0) & (rows < N)
    tl.atomic_add(counts_ptr + rows, 1, mask=ok)


@triton.jit
def _row_starts_kernel(counts_ptr, cursor_ptr, num_padded_ptr, N, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    """One program: padded group starts (exclusive prefix sum of counts rounded up to BLOCK_M)."""
    pdl_enter(USE_PDL)
    total = tl.full((), 0, tl.int32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        count = tl.load(counts_ptr + offs, mask=offs < N, other=0)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(cursor_ptr + offs, total + tl.cumsum(padded, 0) - padded, mask=offs < N)
        total += tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)


@triton.jit
def _place_pairs_kernel(rows_ptr, cursor_ptr, sorted_ids_ptr, block_row_ptr, M, N, BLOCK_M: tl.constexpr,
                        BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    rows = tl.load(rows_ptr + offs, mask=offs < M, other=0)
    ok = (offs < M) & (rows >= 0) & (rows < N)
    dest = tl.atomic_add(cursor_ptr + rows, 1, mask=ok)
    tl.store(sorted_ids_ptr + dest, offs, mask=ok)
    # every block of a row holds at least one real pair, so this writes every used block's row
    tl.store(block_row_ptr + dest // BLOCK_M, rows.to(tl.int32), mask=ok)


_ALIGN_BLOCK = 1024  # pairs per program of the count/place kernels (elementwise; not tuned)


def moe_align(rows_TK: torch.Tensor, num_rows: int, block_m: int) -> MoeAlignment:
    """Group the T*K routed pairs by bank row (``rows_TK`` int, values in [0, num_rows)), padding each
    row's group to whole ``block_m`` blocks; three small Triton kernels, no host sync.

    Within a row the order of pairs follows atomics (it varies run to run); results do not, since
    every pair's output row is computed independently of its position in the block.
    Row ids are not range-checked (that needs a host sync): pairs outside [0, num_rows) are left
    out, so their tokens' outputs are undefined, but nothing is written out of bounds."""
    rows_M = rows_TK.reshape(-1)
    M = rows_M.numel()
    dev = rows_M.device
    P = max_padded_pairs(M, num_rows, block_m)
    counts_N = torch.zeros(num_rows, dtype=torch.int32, device=dev)
    cursor_N = torch.empty(num_rows, dtype=torch.int32, device=dev)
    num_padded_1 = torch.empty(1, dtype=torch.int32, device=dev)
    sorted_ids_P = torch.full((P,), M, dtype=torch.int32, device=dev)
    block_row_B = torch.full((P // block_m,), -1, dtype=torch.int32, device=dev)
    grid = (triton.cdiv(M, _ALIGN_BLOCK),)
    with device_guard(dev):
        _count_rows_kernel[grid](rows_M, counts_N, M, num_rows, BLOCK=_ALIGN_BLOCK, **pdl.launch_kwargs())
        _row_starts_kernel[(1,)](
            counts_N, cursor_N, num_padded_1, num_rows, BLOCK_M=block_m,
            BLOCK=min(1024, triton.next_power_of_2(num_rows)), **pdl.launch_kwargs()
        )
        _place_pairs_kernel[grid](rows_M, cursor_N, sorted_ids_P, block_row_B, M, num_rows, BLOCK_M=block_m,
                                  BLOCK=_ALIGN_BLOCK, **pdl.launch_kwargs())
    return MoeAlignment(sorted_ids_P, block_row_B, num_padded_1, block_m)


# ---------------------------------------------------------------------------------------------
# Kernels


