"""Fused NVFP4 W4A16 MoE for decode sizes (T = 1..64 tokens): the kernels of ``fused_moe.py`` behind a
one-launch alignment and decode-shaped tiles. Drop-in: same call signature as ``fused_moe_nvfp4``.

Legend: T tokens, K top-k, M = T*K routed pairs, N bank rows (slots + scratch rows of the pool),
H hidden, I expert intermediate, P padded pair slots (multiple of BLOCK_M), NB = P / BLOCK_M blocks.

Why a decode variant: at decode the layer's weight bytes are small (8 experts x 2.65 MB at T = 1 for
Qwen3-30B-A3B: ~5 us of HBM time on an H200), so the number of dependent launches, not the GEMMs,
sets the layer time. ``fused_moe_nvfp4`` enqueues 9 kernels (3 fills and 3 alignment kernels, two
GEMMs, the sum over K); this path enqueues 4:
1. ONE alignment program: up to ``SORTED_ALIGN_MAX_PAIRS`` pairs ``_align_sorted_kernel`` (a sort by (row,
   pair id) and a scan; pairs in ascending id within a row), above it ``_align_kernel`` (fills, per-row counts,
   padded prefix sum and placement by atomics). Phases are separated by ``tl.debug_barrier()`` (one CTA sees
   its own global writes after a barrier). The result is the same ``MoeAlignment`` contract as
   ``fused_moe.moe_align``: pairs grouped by row, each group padded to whole BLOCK_M blocks (results do not
   depend on the order within a row, since each pair's output row is computed independently of its position).
2. ``fused_moe.gate_up_silu`` and 3. ``fused_moe.down_weighted``, with tiles from
   ``decode_moe_tuning.json`` (keyed by GPU name, shape (H, I) and M; written by
   ``benchmarks/tune_decode_moe.py``): BLOCK_M = 16 (one expert rarely gets more than a few pairs at
   decode) and narrow N tiles, so a step with 8 routed experts still spreads over >= 132 SMs.
4. the sum over K of the weighted per-pair terms (deterministic: no atomics), which also adds the decoder
   layer's residual when given one (``moe_sum.py``).

Grids depend only on host-known shapes (T, K, N, H, I), nothing is read back to the host: the call can
be captured in a CUDA graph, and rows (e.g. from ``decode_miss.serve_misses``) are read at replay time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.fused_moe import call_shape, check_x_split, kernel_calls, run_fused
from moe_offload.kernels.moe_sum import no_pairs, sum_pairs
from moe_offload.kernels.moe_align import MoeAlignment, max_padded_pairs
from moe_offload.kernels.fused_moe_tuning import TUNING_PATH, FusedMoeConfig, device_name, load_tuning
from moe_offload.kernels.nvfp4 import device_guard

DECODE_TUNING_PATH = TUNING_PATH.with_name("decode_moe_tuning.json")
_ALIGN_BLOCK = 1024  # elements per step of the align program's loops (elementwise; not tuned)


def decode_config_for(device: torch.device, hidden: int, inter: int, pairs: int) -> FusedMoeConfig:
    """Tiles for a decode call on ``device`` with layer shape (H, I) and ``pairs`` = T*K routed pairs
    (``decode_moe_tuning.json``; same schema and lookup as ``fused_moe_tuning.json``)."""
    return load_tuning(DECODE_TUNING_PATH).lookup(device_name(device), hidden, inter, pairs)


@triton.jit
def _align_kernel(rows_ptr, counts_ptr, cursor_ptr, sorted_ids_ptr, block_row_ptr, num_padded_ptr,
                  M, N, P, NB, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program: the three kernels and three fills of ``fused_moe.moe_align`` in one launch."""
    pdl_enter(USE_PDL)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        tl.store(counts_ptr + offs, tl.zeros((BLOCK,), tl.int32), mask=offs < N)
    for p0 in range(0, P, BLOCK):
        offs = p0 + tl.arange(0, BLOCK)
        tl.store(sorted_ids_ptr + offs, tl.full((BLOCK,), 0, tl.int32) + M, mask=offs < P)
    for b0 in range(0, NB, BLOCK):
        offs = b0 + tl.arange(0, BLOCK)
        tl.store(block_row_ptr + offs, tl.full((BLOCK,), -1, tl.int32), mask=offs < NB)
    tl.debug_barrier()
    for m0 in range(0, M, BLOCK):
        offs = m0 + tl.arange(0, BLOCK)
        rows = tl.load(rows_ptr + offs, mask=offs < M, other=0)
        ok = (offs < M) & (rows >= 0) & (rows < N)
        tl.atomic_add(counts_ptr + rows, 1, mask=ok)
    tl.debug_barrier()
    total = tl.full((), 0, tl.int32)
    for n0 in range(0, N, BLOCK):
        offs = n0 + tl.arange(0, BLOCK)
        count = tl.load(counts_ptr + offs, mask=offs < N, other=0, volatile=True)
        padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        tl.store(cursor_ptr + offs, total + tl.cumsum(padded, 0) - padded, mask=offs < N)
        total += tl.sum(padded, 0)
    tl.store(num_padded_ptr, total)
    tl.debug_barrier()
    for m0 in range(0, M, BLOCK):
        offs = m0 + tl.arange(0, BLOCK)
        rows = tl.load(rows_ptr + offs, mask=offs < M, other=0)
        ok = (offs < M) & (rows >= 0) & (rows < N)
        dest = tl.atomic_add(cursor_ptr + rows, 1, mask=ok)
        tl.store(sorted_ids_ptr + dest, offs, mask=ok)
        # every block of a row holds at least one real pair, so this writes every used block's row
        tl.store(block_row_ptr + dest // BLOCK_M, rows.to(tl.int32), mask=ok)


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _align_sorted(rows_ptr, key_ptr, sorted_ids_ptr, block_row_ptr, num_padded_ptr, M, N, last_key,
                  BLOCK_M: tl.constexpr, MP: tl.constexpr, ROWS_VOLATILE: tl.constexpr):
    """The body of ``_align_sorted_kernel``; ROWS_VOLATILE: the rows were written by this program (before a
    barrier), so they are loaded past any cached copy (``decode_miss_plan._plan_align_kernel``)."""
    offs = tl.arange(0, MP)
    rows = tl.load(rows_ptr + offs, mask=offs < M, other=-1, volatile=ROWS_VOLATILE).to(tl.int64)
    ok = (offs < M) & (rows >= 0) & (rows < N)
    key = tl.sort(tl.where(ok, rows * MP + offs, last_key + offs))  # left-out pairs sort last
    tl.store(key_ptr + offs, key)
    tl.debug_barrier()
    valid = key < last_key
    row = key // MP
    prev_row = tl.load(key_ptr + offs - 1, mask=offs > 0, other=-MP) // MP
    next_key = tl.load(key_ptr + offs + 1, mask=offs + 1 < MP, other=last_key)
    first = valid & (row != prev_row)
    last = valid & ((next_key >= last_key) | (next_key // MP != row))
    group_start = tl.associative_scan(tl.where(first, offs, 0), 0, _max_combine)
    pad = tl.where(last, (BLOCK_M - (offs - group_start + 1) % BLOCK_M) % BLOCK_M, 0)
    dest = offs + tl.cumsum(pad, 0) - pad
    total = tl.sum(valid.to(tl.int32), 0) + tl.sum(pad, 0)
    for p0 in range(0, total, MP):  # the sentinel everywhere below total, then the pairs over it
        tl.store(sorted_ids_ptr + p0 + offs, tl.full((MP,), 0, tl.int32) + M, mask=p0 + offs < total)
    tl.debug_barrier()
    tl.store(sorted_ids_ptr + dest, (key % MP).to(tl.int32), mask=valid)
    tl.store(block_row_ptr + dest // BLOCK_M, row.to(tl.int32), mask=valid)
    tl.store(num_padded_ptr, total)


@triton.jit
def _align_sorted_kernel(rows_ptr, key_ptr, sorted_ids_ptr, block_row_ptr, num_padded_ptr, M, N, last_key,
                         BLOCK_M: tl.constexpr, MP: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program, every pair in registers (M <= MP): sort the pairs by (row, pair id), then each pair's
    padded position is its sorted position plus the padding of the groups before it. Loops over nothing
    of size N or P; writes only the used slots [0, num_padded) (the GEMM programs of blocks at or past
    ``num_padded`` exit before reading). ``key_ptr[MP]`` int64 is a workspace (the neighbour of a sorted
    element is read back through it); ``last_key`` = N * MP, above every valid key (row * MP + pair id)."""
    pdl_enter(USE_PDL)
    _align_sorted(rows_ptr, key_ptr, sorted_ids_ptr, block_row_ptr, num_padded_ptr, M, N, last_key, BLOCK_M, MP, False)


#: largest pair count the sorted alignment runs at; above it the looped ``_align_kernel`` does. 512 pairs (a batch-64
#: decode step at top-8) is the largest that has run on a GPU (8505610, an H100 with Triton 3.6); 1,024 and 2,048
#: (routed prefills of 128-256 tokens) compile for sm_90 with 8 warps but wait for a GPU run before they are used
SORTED_ALIGN_MAX_PAIRS = 512


def decode_align(rows_TK: torch.Tensor, num_rows: int, block_m: int,
                 sorted_max_pairs: int = SORTED_ALIGN_MAX_PAIRS) -> MoeAlignment:
    """``fused_moe.moe_align`` in one launch (one program: meant for decode-sized T*K, up to a few
    thousand pairs). Rows outside [0, num_rows) are left out, as there.

    Up to ``sorted_max_pairs`` pairs (0: never; benchmarks/decode_moe_split.py times both) ``_align_sorted_kernel`` runs: its work does not grow with the
    pool's rows (the looped kernel zeroes and scans all ``num_rows`` counters, and fills all P slots), and
    pairs come out in ascending pair id within a row (deterministic). Only ``[0, num_padded)`` of
    ``sorted_ids_P`` and the blocks below it are written then; nothing reads past them."""
    rows_M = rows_TK.reshape(-1)
    if not rows_M.is_contiguous():
        rows_M = rows_M.contiguous()
    M = rows_M.numel()
    dev = rows_M.device
    alignment = alignment_buffers(M, num_rows, block_m, dev)
    sorted_ids_P, block_row_B, num_padded_1 = alignment.sorted_ids_P, alignment.block_row_B, alignment.num_padded_1
    P = sorted_ids_P.numel()
    with device_guard(dev):
        if 0 < M <= min(sorted_max_pairs, SORTED_ALIGN_MAX_PAIRS):
            key_MP, MP, warps = sorted_align_launch(M, dev)
            _align_sorted_kernel[(1,)](rows_M, key_MP, sorted_ids_P, block_row_B, num_padded_1, M, num_rows,
                                       num_rows * MP, BLOCK_M=block_m, MP=MP, num_warps=warps, **pdl.launch_kwargs())
        else:
            work_2N = torch.empty((2, max(num_rows, 1)), dtype=torch.int32, device=dev)  # counts, cursor
            _align_kernel[(1,)](rows_M, work_2N[0], work_2N[1], sorted_ids_P, block_row_B, num_padded_1,
                                M, num_rows, P, P // block_m, BLOCK_M=block_m, BLOCK=_ALIGN_BLOCK, num_warps=4,
                                **pdl.launch_kwargs())
    return alignment


def alignment_buffers(M: int, num_rows: int, block_m: int, dev) -> MoeAlignment:
    """The (unwritten) outputs of an alignment of M pairs over ``num_rows`` rows: ``sorted_ids_P`` and ``block_row_B``
    at their host-known bound P (``moe_align.max_padded_pairs``), ``num_padded_1``."""
    P = max_padded_pairs(M, num_rows, block_m)
    return MoeAlignment(torch.empty((max(P, 1),), dtype=torch.int32, device=dev)[:P],
                        torch.empty((max(P // block_m, 1),), dtype=torch.int32, device=dev)[:P // block_m],
                        torch.empty(1, dtype=torch.int32, device=dev), block_m)


def sorted_align_launch(M: int, dev) -> tuple[torch.Tensor, int, int]:
    """``(key workspace [MP] int64, MP, num_warps)`` of the sorted alignment of M pairs (M <= SORTED_ALIGN_MAX_PAIRS
    on a GPU)."""
    MP = max(16, triton.next_power_of_2(M))
    return torch.empty(MP, dtype=torch.int64, device=dev), MP, 4 if MP <= 512 else 8


def decode_moe_nvfp4(
    hidden_TH: torch.Tensor,
    rows_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    views: dict,
    out_dtype: torch.dtype | None = None,
    config: FusedMoeConfig | None = None,
    residual_TH: torch.Tensor | None = None,
    alignment: MoeAlignment | None = None,
    x_split: torch.Tensor | None = None,
    sum_in_down: bool = True,
    x_split_block_k: int | None = None,
) -> torch.Tensor:
    """SwiGLU MoE over NVFP4 bank rows for decode-sized batches; no host sync, no bf16 weight copy.

    Args (as ``fused_moe.fused_moe_nvfp4``):
        hidden_TH: ``[T, H]`` bf16/fp16/fp32 activations.
        rows_TK: ``[T, K]`` int32/int64 bank row of each routed pair, in [0, N); pairs outside are left
            out (their tokens' outputs are then undefined). Not range-checked (that would sync).
        weights_TK: ``[T, K]`` float routing weights (used in fp32).
        views: NVFP4 bank views ``w13_q [N, 2I, H/2] u8``, ``w13_s [N, 2I, H/16] e4m3``,
            ``w2_q [N, H, I/2] u8``, ``w2_s [N, H, I/16] e4m3``, ``gs [N, 3] f32``; rows contiguous.
        out_dtype: output dtype (default ``hidden_TH.dtype``).
        config: tiles; default ``decode_config_for(device, H, I, T*K)``.
        residual_TH: ``[T, H]`` in ``out_dtype`` (optional): returns ``residual_TH + y`` with the decoder layer's
            roundings, added by the sum over K (``moe_sum.py``; no launch of its own).
        alignment: ``rows_TK`` already grouped in blocks of ``config.block_m`` over the N rows (e.g. by the miss
            plan's launch, ``decode_miss.serve_misses_plan``); default: ``decode_align`` here.
        x_split: with swapped tiles (``config.swap_ab``), ``hidden_TH`` already in their split layout
            (``fused_moe_swap.split_columns(hidden_TH, x_split_block_k)``, e.g. written by the norm kernel before
            the MoE); ``x_split_block_k`` must be ``config.gate_up.block_k``. Default: that copy here. Ignored by the
            other tiles.
        sum_in_down: with swapped tiles and K > 1 the down launch also sums each token's K terms (the program
            storing a token's last term of a column tile sums them), the same bits as the sum launch False keeps;
            on Triton < 3.5 the sum launch runs (one ``fused_moe_sum_unavailable`` event).

    Returns:
        ``[T, H]`` in ``out_dtype``. Memory: ``act [T*K, I]`` and ``terms [T*K, H]``.
    """
    return run_fused(hidden_TH, rows_TK, weights_TK, views, out_dtype, config, decode_config_for, decode_align,
                     residual_TH, alignment, x_split, sum_in_down, x_split_block_k)


def decode_moe_nvfp4_split(
    hidden_TH: torch.Tensor,
    rows_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    views: dict,
    scratch_base: int,
    join,
    out_dtype: torch.dtype | None = None,
    config: FusedMoeConfig | None = None,
    residual_TH: torch.Tensor | None = None,
    x_split: torch.Tensor | None = None,
    x_split_block_k: int | None = None,
) -> torch.Tensor:
    """``decode_moe_nvfp4`` in two passes over one buffer of per-pair terms, so that the pairs read from slots can run
    while the misses are still being copied into scratch rows (``decode_miss.copy_misses`` on another stream):

    1. the pairs with ``rows_TK < scratch_base`` (read from slots): their alignment, gate_up and down launches write
       their terms;
    2. ``join()`` (e.g. the compute stream waits for the copy's stream);
    3. the pairs with ``rows_TK >= scratch_base``: the same three launches write the other terms;
    4. one fixed-order sum over K (with the residual).

    Each pair's term is computed alone (a pair's output row does not depend on the other pairs of its block), with
    the tiles of ``decode_config_for(.., T*K)`` in both passes, and the sum is the same launch: the result has the
    bits of ``decode_moe_nvfp4(.., sum_in_down=False)`` for the same rows (``tests/test_decode_moe.py``). Pairs
    with a row outside the pool (-1) are left out of both passes, as there. Costs 3 launches more than one pass
    (an alignment and the two GEMMs) and two elementwise masks. ``x_split`` / ``x_split_block_k``: as for
    ``decode_moe_nvfp4`` (the swapped tiles' split activations, made by the norm before the MoE)."""
    N, H, I, T, K, out_dtype, residual_TH = call_shape(hidden_TH, rows_TK, weights_TK, views, out_dtype, residual_TH)
    M, dev = T * K, hidden_TH.device
    if M == 0:
        join()
        return no_pairs(T, H, out_dtype, dev, residual_TH)
    if config is None:
        config = decode_config_for(dev, H, I, M)
    if hidden_TH.stride(1) != 1:
        hidden_TH = hidden_TH.contiguous()
    check_x_split(config, x_split, x_split_block_k)
    weights_M = weights_TK.reshape(-1).contiguous()
    terms_MH = torch.empty((M, H), dtype=out_dtype, device=dev)
    out_TH = torch.empty((T, H), dtype=out_dtype, device=dev)

    def one_pass(rows_M: torch.Tensor) -> None:  # the terms of the pairs whose rows are in the pool (others: -1)
        gate_up, down = kernel_calls(hidden_TH, views, decode_align(rows_M, N, config.block_m), weights_M, terms_MH,
                                     K, config, x_split)
        gate_up()
        down()

    rows_M = rows_TK.reshape(-1)
    missed = rows_M >= scratch_base
    one_pass(rows_M.masked_fill(missed, -1))
    join()
    one_pass(rows_M.masked_fill(~missed, -1))
    if K == 1 and residual_TH is None:
        return terms_MH
    return sum_pairs(terms_MH, K, out_TH, residual_TH)
