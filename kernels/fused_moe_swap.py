"""Fused W4A16 NVFP4 MoE with swapped dot operands (Triton): the dequantized weight tile is the LEFT operand.

Legend: T tokens, K top-k, M = T*K routed pairs, N bank rows (experts or slots), H hidden, I expert
intermediate, C a GEMM's K dim (H for gate_up, I for down), Cp C rounded up to whole BLOCK_K chunks.

Same math and contract as ``fused_moe.gate_up_silu`` / ``fused_moe.down_weighted`` (``run_fused`` picks
these kernels when the tiles say ``swap_ab``); each block computes the transposed tile

    out^T [BLOCK_N weight rows, BLOCK_M pairs] = W [BLOCK_N, BLOCK_K] @ x^T [BLOCK_K, BLOCK_M]

Why swap: the weight tile is made in registers (codes * block scales); on Hopper a wgmma takes its left
operand from registers but its right one from shared memory, so as the left operand the dequantized
tile needs no shared-memory round trip, and the pairs (1..64 per expert at decode and short prefill)
become the dot's N dim. The block scales are loaded once per 16 columns (``[BLOCK_N, BLOCK_K/16]``,
broadcast in registers) rather than once per byte as in ``fused_moe.py``.

Activations are read in a K-split layout (``split_columns``): within each BLOCK_K chunk the even
columns come first, then the odd ones, so the two activation tiles that match a byte's low and high
nibble are contiguous loads. The hidden states are reordered by one torch copy per call; the gate_up
kernel writes the intermediate activations straight into the down kernel's split layout.

Numerics as ``fused_moe.py``: exact NVFP4 values as tensor-core operands, fp32 accumulation, globals on
the fp32 accumulator, roundings only where a bf16 model rounds (the activation, each per-pair term).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.fused_moe_ab import _block_coords, _block_pairs, align_args, bank_args, tile_kwargs
from moe_offload.kernels.moe_align import MoeAlignment
from moe_offload.kernels.moe_sum import store_out, sum_args, zero_counters, zeroing_args
from moe_offload.kernels.nvfp4 import (
    SCALE_BLOCK,
    device_guard,
    e2m1_halves_bf16,
    e2m1_halves_f32,
    per_byte,
    unshift,
)


@triton.jit
def _weight_rows_tile(q_ptrs, s_ptrs, w_mask, s_mask, DOT_DTYPE: tl.constexpr):
    """``(lo, hi)``, each ``[BLOCK_N, BLOCK_K/2]`` = ``code * block_scale`` (exact) of the bytes at ``q_ptrs``
    (``[BLOCK_N rows, BLOCK_K/2 bytes]``, contiguous along dim 1): lo holds the even K columns, hi the odd
    ones. ``s_ptrs`` address ``[BLOCK_N, BLOCK_K/16]`` scales, one per 8 bytes, broadcast here.

    bf16 and fp16 dots get ``code * scale * 2^-14`` (``nvfp4.unshift`` undoes it on the accumulator): an E2M1
    value (<= 2 significant bits, lowest 2^-1) times an E4M3 scale (<= 4 bits, lowest 2^-9) times 2^-14 has
    <= 6 significant bits, is a multiple of 2^-24 (fp16's subnormal step) and is below 6 * 448 * 2^-14, so
    both formats hold it exactly. bf16 (CUDA only): ``nvfp4.e2m1_halves_bf16``, 2.25 instructions per
    weight on 32-bit registers; fp16: 16-bit integer ops and one fp16 multiply per weight. fp32 dots (the
    CPU interpreter, fp32 models): ``nvfp4.e2m1_halves_f32``."""
    packed = tl.load(q_ptrs, mask=w_mask, other=0)
    scale = tl.load(s_ptrs, mask=s_mask, other=0.0)
    if DOT_DTYPE == tl.float32:
        lo, hi = e2m1_halves_f32(packed, scale)
    elif DOT_DTYPE == tl.bfloat16:
        lo, hi = e2m1_halves_bf16(packed, scale)
    else:
        scale = per_byte(scale.to(tl.float16))
        packed = packed.to(tl.int16)
        lo = (((packed & 8) << 12) | ((packed & 7) << 9)).to(tl.float16, bitcast=True) * scale
        hi = (((packed & 0x80) << 8) | ((packed & 0x70) << 5)).to(tl.float16, bitcast=True) * scale
    return lo.to(DOT_DTYPE), hi.to(DOT_DTYPE)


@triton.jit
def _swap_masks(valid_m, valid_n, offs_kb, offs_ks, k_left, EVEN_K: tl.constexpr):
    """Masks of one K step: activations ``[BK/2, BM]``, weight bytes ``[BN, BK/2]``, scales ``[BN, BK/16]``
    (``k_left`` K columns remain; C is a multiple of 16, so a byte's two columns are both in or both out)."""
    if EVEN_K:
        x_mask = valid_m[None, :]
        w_mask = valid_n[:, None]
        s_mask = valid_n[:, None]
    else:
        x_mask = valid_m[None, :] & (offs_kb[:, None] < k_left // 2)
        w_mask = valid_n[:, None] & (offs_kb[None, :] < k_left // 2)
        s_mask = valid_n[:, None] & (offs_ks[None, :] < k_left // SCALE_BLOCK)
    return x_mask, w_mask, s_mask


@triton.jit
def _dot_rows(acc, x_even, x_odd, q_ptrs, s_ptrs, w_mask, s_mask, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc [BN, BM] += W @ x^T`` for one NVFP4 weight tile, as two dots over its even and odd K columns."""
    lo, hi = _weight_rows_tile(q_ptrs, s_ptrs, w_mask, s_mask, DOT_DTYPE)
    acc = tl.dot(lo, x_even, acc, input_precision=INPUT_PRECISION)
    return tl.dot(hi, x_odd, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _gate_up_swap_kernel(
    x_ptr, stride_xt,  # hidden in split layout [T, Hp]
    q_ptr, stride_qn, stride_qr,  # w13_q [N, 2I, H/2] u8
    s_ptr, stride_sn, stride_sr,  # w13_s [N, 2I, H/16] e4m3
    g_ptr, stride_gn,  # gs [N, 3] f32 (column stride 1)
    act_ptr, stride_am,  # act in the down kernel's split layout [M, Ip]
    sorted_ids_ptr, block_row_ptr, num_padded_ptr,
    M, H, I, TOPK, num_blocks_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ACT_BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    cnt_ptr=None, n_cnt=0, ZERO_BLOCK: tl.constexpr = 0, USE_PDL: tl.constexpr = False
):
    pdl_enter(USE_PDL)
    if ZERO_BLOCK:  # the down kernel's per-(token, column tile) counters start each call at 0 (SUM_K)
        zero_counters(cnt_ptr, n_cnt, tl.program_id(0), ZERO_BLOCK)
    pid_m, pid_n = _block_coords(tl.program_id(0), num_blocks_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    row, pair, valid_m = _block_pairs(pid_m, block_row_ptr, sorted_ids_ptr, M, BLOCK_M)
    token = (pair // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < I
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // SCALE_BLOCK)

    x_ptrs = x_ptr + token[None, :] * stride_xt + offs_kb[:, None]  # [BK/2, BM]: the chunk's even columns
    q_ptrs = q_ptr + row * stride_qn + offs_n[:, None] * stride_qr + offs_kb[None, :]  # gate rows [BN, BK/2]
    s_ptrs = s_ptr + row * stride_sn + offs_n[:, None] * stride_sr + offs_ks[None, :]  # [BN, BK/16]
    up_q = I * stride_qr
    up_s = I * stride_sr

    acc_gate = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        x_mask, w_mask, s_mask = _swap_masks(valid_m, valid_n, offs_kb, offs_ks, H - k0, EVEN_K)
        x_even = tl.load(x_ptrs, mask=x_mask, other=0.0).to(DOT_DTYPE)
        x_odd = tl.load(x_ptrs + BLOCK_K // 2, mask=x_mask, other=0.0).to(DOT_DTYPE)
        acc_gate = _dot_rows(acc_gate, x_even, x_odd, q_ptrs, s_ptrs, w_mask, s_mask, DOT_DTYPE, INPUT_PRECISION)
        acc_up = _dot_rows(acc_up, x_even, x_odd, q_ptrs + up_q, s_ptrs + up_s, w_mask, s_mask, DOT_DTYPE,
                           INPUT_PRECISION)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // SCALE_BLOCK

    gate = acc_gate * tl.load(g_ptr + row * stride_gn) * unshift(DOT_DTYPE != tl.float32)
    up = acc_up * tl.load(g_ptr + row * stride_gn + 1) * unshift(DOT_DTYPE != tl.float32)
    act = gate / (1.0 + tl.exp(-gate)) * up
    # column n of the activation goes where the down kernel's split layout reads it
    j = offs_n % ACT_BLOCK_K
    pos = offs_n - j + (j % 2) * (ACT_BLOCK_K // 2) + j // 2
    act_ptrs = act_ptr + pair.to(tl.int64)[None, :] * stride_am + pos[:, None]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid_n[:, None] & valid_m[None, :])


@triton.jit
def _down_swap_kernel(
    act_ptr, stride_am,  # act in split layout [M, Ip]
    q_ptr, stride_qn, stride_qr,  # w2_q [N, H, I/2] u8
    s_ptr, stride_sn, stride_sr,  # w2_s [N, H, I/16] e4m3
    g_ptr, stride_gn,  # gs [N, 3] f32 (column stride 1)
    w_ptr,  # routing weights [M] (any float dtype; used in fp32)
    out_ptr, stride_om,  # terms [M, H] (or the output [T, H] when K == 1)
    sorted_ids_ptr, block_row_ptr, num_padded_ptr,
    M, H, I, num_blocks_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr,
    cnt_ptr=None, final_ptr=None, stride_ft=0, res_ptr=None, stride_rt=0, TOPK=1,
    SUM_K: tl.constexpr = False, RESIDUAL: tl.constexpr = False, USE_PDL: tl.constexpr = False
):
    pdl_enter(USE_PDL)
    pid_m, pid_n = _block_coords(tl.program_id(0), num_blocks_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    row, pair, valid_m = _block_pairs(pid_m, block_row_ptr, sorted_ids_ptr, M, BLOCK_M)
    pair64 = pair.to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < H
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_ks = tl.arange(0, BLOCK_K // SCALE_BLOCK)

    a_ptrs = act_ptr + pair64[None, :] * stride_am + offs_kb[:, None]  # [BK/2, BM] even columns
    q_ptrs = q_ptr + row * stride_qn + offs_n[:, None] * stride_qr + offs_kb[None, :]
    s_ptrs = s_ptr + row * stride_sn + offs_n[:, None] * stride_sr + offs_ks[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a_mask, w_mask, s_mask = _swap_masks(valid_m, valid_n, offs_kb, offs_ks, I - k0, EVEN_K)
        a_even = tl.load(a_ptrs, mask=a_mask, other=0.0).to(DOT_DTYPE)
        a_odd = tl.load(a_ptrs + BLOCK_K // 2, mask=a_mask, other=0.0).to(DOT_DTYPE)
        acc = _dot_rows(acc, a_even, a_odd, q_ptrs, s_ptrs, w_mask, s_mask, DOT_DTYPE, INPUT_PRECISION)
        a_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // SCALE_BLOCK

    route_w = tl.load(w_ptr + pair64, mask=valid_m, other=0.0).to(tl.float32)
    out = acc * tl.load(g_ptr + row * stride_gn + 2) * unshift(DOT_DTYPE != tl.float32) * route_w[None, :]
    out_ptrs = out_ptr + pair64[None, :] * stride_om + offs_n[:, None]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid_n[:, None] & valid_m[None, :])
    if SUM_K:
        _sum_finished_tokens(out_ptr, stride_om, cnt_ptr, final_ptr, stride_ft, res_ptr, stride_rt, pair64, valid_m,
                             offs_n, valid_n, pid_n, tl.cdiv(H, BLOCK_N), TOPK, BLOCK_N, BLOCK_M, RESIDUAL)


@triton.jit
def _sum_finished_tokens(terms_ptr, stride_tm, cnt_ptr, final_ptr, stride_ft, res_ptr, stride_rt, pair64, valid_m,
                         offs_n, valid_n, pid_n, NT, TOPK, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                         RESIDUAL: tl.constexpr):
    """``moe_sum._sum_pairs_kernel``'s work for the tokens whose K terms of this column tile are now all stored: the
    program that stores a token's last term (a counter per (token, column tile) at ``cnt_ptr``, zeroed by the
    gate_up launch of the same call) sums its K terms in k order in fp32 and stores them with ``moe_sum.store_out``, the
    same bits. Its terms' stores, a barrier, then acq_rel counter atomics (release: stores before them are visible
    to whoever acquires); after them a barrier, and the K terms read past L1 (volatile)."""
    tl.debug_barrier()
    token = pair64 // TOPK
    done = tl.atomic_add(cnt_ptr + token * NT + pid_n, 1, mask=valid_m, sem="acq_rel", scope="gpu")
    last = valid_m & (done == TOPK - 1)
    tl.debug_barrier()
    mask = valid_n[:, None] & last[None, :]
    y = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(0, TOPK):
        y += tl.load(terms_ptr + (token * TOPK + k)[None, :] * stride_tm + offs_n[:, None], mask=mask, other=0.0,
                     volatile=True).to(tl.float32)
    store_out(final_ptr, stride_ft, res_ptr, stride_rt, token[None, :], offs_n[:, None], mask, y, RESIDUAL)


# ---------------------------------------------------------------------------------------------
# Host side


def padded_cols(cols: int, block_k: int) -> int:
    """Cp: ``cols`` rounded up to whole ``block_k`` chunks (the split layout's row length)."""
    return triton.cdiv(cols, block_k) * block_k


def split_columns(x_TC: torch.Tensor, block_k: int) -> torch.Tensor:
    """``[T, Cp]``: ``x_TC`` zero-padded to whole ``block_k`` chunks, each chunk's even columns first,
    then its odd ones (one copy; no host sync)."""
    T, C = x_TC.shape
    Cp = padded_cols(C, block_k)
    if Cp != C:
        x_TC = F.pad(x_TC, (0, Cp - C))
    return x_TC.reshape(T, Cp // block_k, block_k // 2, 2).transpose(2, 3).reshape(T, Cp)


def act_buffer(M: int, I: int, dtype: torch.dtype, device, down_block_k: int) -> torch.Tensor:
    """The intermediate activations ``[M, Ip]`` in the down kernel's split layout (columns past I are
    never written and never read: the down kernel masks them)."""
    return torch.empty((M, padded_cols(I, down_block_k)), dtype=dtype, device=device)


def gate_up_silu_swap(x_split, views, align: MoeAlignment, act_split, topk: int, M: int, H: int, I: int,
                      config, dot_setup, counters=None) -> None:
    """Kernel 1 (enqueue only): ``act[pair] = silu(gate @ x) * (up @ x)`` for every routed pair, written
    in the down kernel's split layout; ``x_split = split_columns(hidden_TH, config.gate_up.block_k)``.
    ``counters``: int32 the down kernel sums over K with (``down_weighted_swap``'s ``sum_into``), zeroed here."""
    tiles = config.gate_up
    num_blocks_m = align.sorted_ids_P.numel() // config.block_m
    grid = (num_blocks_m * triton.cdiv(I, tiles.block_n),)
    zero = {} if counters is None else zeroing_args(counters, grid[0])
    with device_guard(x_split.device):
        _gate_up_swap_kernel[grid](
            x_split, x_split.stride(0), *bank_args(views, "w13"), act_split, act_split.stride(0), *align_args(align),
            M, H, I, topk, num_blocks_m,
            ACT_BLOCK_K=config.down.block_k, **zero, **tile_kwargs(config, tiles, H, dot_setup), **pdl.launch_kwargs()
        )


#: the first Triton whose tensor atomics hand every thread of a value the atomic's result (triton-lang/triton#7460,
#: in 3.5): before it only the thread that ran the atomic saw it, and ``_sum_finished_tokens`` would lose tokens
SUM_K_MIN_TRITON = (3, 5)


def sum_in_down_supported() -> tuple[bool, str]:
    """``(ok, why_not)``: whether this Triton compiles the down launch's sum over K correctly (``SUM_K_MIN_TRITON``)."""
    version = tuple(int(p) for p in triton.__version__.split("+")[0].split(".")[:2] if p.isdigit())
    if version >= SUM_K_MIN_TRITON:
        return True, ""
    need = ".".join(map(str, SUM_K_MIN_TRITON))
    return False, (f"Triton {triton.__version__} gives a tensor atomic's result to one thread per value only; the sum "
                   f"over K in the down launch needs Triton >= {need} (pip install -U triton)")


def down_weighted_swap(act_split, views, weights_M, align: MoeAlignment, terms_MH, I: int, config, dot_setup,
                       sum_into=None) -> None:
    """Kernel 2 (enqueue only): ``terms_MH[pair] = weights_M[pair] * (down @ act[pair])``. ``sum_into``:
    ``(counters, out_TH, residual_TH or None, K)``: the program that stores a token's last term of a column tile
    also writes that tile of ``out_TH`` as ``moe_sum.sum_pairs(terms_MH, K, out_TH, residual_TH)`` would (same bits;
    ``counters`` from ``moe_sum.sum_counters``, zeroed by this call's gate_up launch), so no sum launch follows."""
    M, H = terms_MH.shape
    tiles = config.down
    num_blocks_m = align.sorted_ids_P.numel() // config.block_m
    grid = (num_blocks_m * triton.cdiv(H, tiles.block_n),)
    summed = {} if sum_into is None else sum_args(*sum_into)
    with device_guard(act_split.device):
        _down_swap_kernel[grid](
            act_split, act_split.stride(0), *bank_args(views, "w2"), weights_M, terms_MH, terms_MH.stride(0),
            *align_args(align), M, H, I, num_blocks_m,
            **summed, **tile_kwargs(config, tiles, I, dot_setup), **pdl.launch_kwargs()
        )
