"""NVFP4 W4A16 MoE for few tokens per expert (decode): GEMV kernels with no tensor-core dot, meant to run
near the HBM floor. Drop-in for ``decode_moe.decode_moe_nvfp4`` (same signature and output contract).

Legend: T tokens, K top-k (KP = next power of two), M = T*K routed pairs, N bank rows (slots + scratch),
H hidden, I expert intermediate, BM pairs per program of kernel 1 (1 = one pair, no alignment).

    y[t] = sum_k w[t,k] * down_r @ (silu(gate_r @ x_t) * (up_r @ x_t)),   r = rows[t, k]

Why: at decode one expert serves ~1 token, so a 16-row tensor-core tile is mostly padding and the
layer time is set by launches and by how many weight bytes are in flight, not by FLOPs.
Launches (nothing is read back to the host; grids come from T, K, N, H, I only: graph-capturable):
0. only when BM > 1: ``decode_moe.decode_align`` (one program) groups the pairs by row into blocks
   of BM, so an expert's weight tile is read once for all its tokens (loop over them in registers).
0b. only with ``split_x``: x's even and odd columns copied into two contiguous rows per token (torch), so
   kernel 1 loads them in the weight tile's layout (compiled for sm_90 at 4 x 512 tiles its interleaved
   x loads go through shared memory with 4 barriers per K step for one pair a program, 8 for grouped
   pairs; these need none). Which is faster is data.
1. ``_gate_up_kernel``, program = (BM pairs of one row, BLOCK_N of the I outputs): loads
   ``[BLOCK_N, BLOCK_K/2]`` bytes of gate and of up (contiguous along K: 16-byte loads), splits
   nibbles into even/odd K columns, scales them (one load per block scale, broadcast in registers),
   multiplies by x's even/odd columns into an fp32 ``[BLOCK_N, BLOCK_K/2]`` accumulator (BM = 1; else
   ``[BM, BLOCK_N, BLOCK_K/2]``), reduces over K once at the end; ``act [M, I]`` fp32 =
   silu(gate * g0) * (up * g1).
2. ``_down_sum_kernel``, program = (token, BLOCK_N of the H outputs): all KP pairs of the token at
   once, a ``[KP * BLOCK_N, BLOCK_K/2]`` tile per K step; y = sum over the pairs (a fixed-order
   reduction inside the program: deterministic, no atomics, no separate sum kernel) of w * g2 * down @ act.
   Its activation loads are per tile row: KP * BLOCK_N rows of fp32 pairs per weight byte pair.
2b. with ``down_per_pair`` instead: kernel 1 stores each pair's activations split (even columns, then odd);
   ``_down_pair_kernel``, program = (pair, BLOCK_N of the H outputs), loads them contiguously as tiles of the
   weight tile's shape (compiled for sm_90: 16-byte loads, no shared-memory conversion in the K loop where a
   thread holds 8 weight bytes, e.g. 8 x 256 tiles with 4 warps; with 16 it converts once), writing fp32 partials ``[M, H]``; then ``moe_sum.sum_pairs`` adds each token's K partials
   in the order k = 0..K-1 (deterministic).
With ``residual_TH`` the output is ``residual + y`` with the decoder layer's roundings (``moe_sum.py``), in the
launch that writes y (the down kernel or the pair sum): the layer's residual add needs no launch of its own.
   KP times the programs of kernel 2 and one more launch; which is faster is data (the tuning table).
Pairs whose row is outside [0, N) (e.g. -1) contribute nothing (masked loads, weight 0).

Numerics: ``code * block_scale`` is exact in fp32; products and sums in fp32; the intermediate
activation stays fp32; one rounding to ``out_dtype`` at the end.
Tiles come from ``decode_gemv_tuning.json`` (read by ``decode_gemv_tuning.py``; keyed by GPU name, shape (H, I)
and T*K), as does the largest T*K for which ``compute/decode.py``'s "auto" picks this kernel over ``decode_moe``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.decode_gemv_tuning import GemvConfig, gemv_config_for
from moe_offload.kernels.decode_moe import decode_align
from moe_offload.kernels.fused_moe import call_shape, given_alignment
from moe_offload.kernels.moe_align import MoeAlignment
from moe_offload.kernels.moe_sum import (
    no_pairs,
    store_out,
    sum_args,
    sum_counters,
    sum_pairs,
    zero_counters,
    zeroing_args,
)
from moe_offload.kernels.nvfp4 import (
    BYTES_PER_SCALE,
    device_guard,
    e2m1_halves_bf16,
    e2m1_halves_f32,
    ptx_conversion,
    unshift,
)


# ---------------------------------------------------------------------------------------------
# Kernels


@triton.jit
def _nvfp4_halves(q_ptrs, s_ptrs, mask, s_mask, PTX: tl.constexpr):
    """Even/odd K columns (fp32, ``code * block_scale``, times 2^-14 with PTX; exact) of the ``[R, BK/2]`` bytes at
    ``q_ptrs``; ``s_ptrs`` address the ``[R, BK/16]`` block scales, one per 8 bytes, broadcast here (one load per
    scale rather than one per byte). PTX (CUDA sm_80+): ``nvfp4.e2m1_halves_bf16`` on 32-bit registers (~2.25
    instructions a weight) and a bf16 -> fp32 widening, in place of ``e2m1_to_f32``'s per-code integer ops,
    fp16 -> fp32 conversion and fp32 multiply; its values carry 2^-14, which the callers' final multiply by
    ``unshift(PTX)`` removes (powers of two: the sums and the result keep the same bits)."""
    packed = tl.load(q_ptrs, mask=mask, other=0)
    scale = tl.load(s_ptrs, mask=s_mask, other=0.0)
    if PTX:
        lo_bf16, hi_bf16 = e2m1_halves_bf16(packed, scale)
        lo = lo_bf16.to(tl.float32)
        hi = hi_bf16.to(tl.float32)
    else:
        lo, hi = e2m1_halves_f32(packed, scale)
    return lo, hi


@triton.jit
def _fma2(acc, x_even, lo, x_odd, hi):
    """``acc + x_even * lo + x_odd * hi`` as two dependent multiply-adds (two FFMA per weight pair on the GPU,
    where ``acc + (x_even * lo + x_odd * hi)`` compiled to a multiply, a multiply-add and an add)."""
    acc = acc + x_even * lo
    return acc + x_odd * hi


@triton.jit
def _k_columns_left(offs_kb, k_left, EVEN_K: tl.constexpr):
    """Mask of the bytes of one K step (``k_left`` K columns remain). With EVEN_K the mask is all true
    and constant along K, which keeps the weight loads 16-byte vectors."""
    if EVEN_K:
        return offs_kb >= 0
    return offs_kb < k_left // 2


@triton.jit
def _gate_up_one_pair(xe_ptr, xo_ptr, q_ptrs, s_ptrs, up_q, up_s, offs_n, offs_kb, offs_sb, H, I,
                      BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, SPLIT_X: tl.constexpr, PTX: tl.constexpr):
    """(gate, up) ``[1, BN]`` sums over K (before the globals) for one token's x row.

    Interleaved x (``xe_ptr`` the row, ``xo_ptr`` unused): x's even and odd columns are ``[BK/2]`` vectors
    broadcast along the rows, which compiled for sm_90 reach the weight tile's layout through shared memory
    (barriers) in scalar loads. ``SPLIT_X``: the even and odd columns in two contiguous rows (``xe_ptr``,
    ``xo_ptr``) loaded as ``[BN, BK/2]`` tiles of the weight tile's shape (rows repeat one address), which
    Triton gives the weight tile's layout: no layout conversion per K step, 16-byte loads."""
    acc_g = tl.zeros((offs_n.shape[0], BLOCK_K // 2), dtype=tl.float32)
    acc_u = tl.zeros((offs_n.shape[0], BLOCK_K // 2), dtype=tl.float32)
    x_offs = offs_n[:, None] * 0 + offs_kb[None, :]
    for k0 in range(0, H, BLOCK_K):
        k_ok = _k_columns_left(offs_kb, H - k0, EVEN_K)
        w_mask = (offs_n[:, None] < I) & k_ok[None, :]
        s_mask = (offs_n[:, None] < I) & _k_columns_left(offs_sb * BYTES_PER_SCALE, H - k0, EVEN_K)[None, :]
        if SPLIT_X:
            x_even = tl.load(xe_ptr + k0 // 2 + x_offs, mask=k_ok[None, :], other=0.0).to(tl.float32)
            x_odd = tl.load(xo_ptr + k0 // 2 + x_offs, mask=k_ok[None, :], other=0.0).to(tl.float32)
        else:
            x_even = tl.load(xe_ptr + k0 + 2 * offs_kb, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            x_odd = tl.load(xe_ptr + k0 + 1 + 2 * offs_kb, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        g_lo, g_hi = _nvfp4_halves(q_ptrs, s_ptrs, w_mask, s_mask, PTX)
        u_lo, u_hi = _nvfp4_halves(q_ptrs + up_q, s_ptrs + up_s, w_mask, s_mask, PTX)
        acc_g = _fma2(acc_g, x_even, g_lo, x_odd, g_hi)
        acc_u = _fma2(acc_u, x_even, u_lo, x_odd, u_hi)
        q_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 2 // BYTES_PER_SCALE
    return tl.sum(acc_g, axis=1)[None, :], tl.sum(acc_u, axis=1)[None, :]


@triton.jit
def _gate_up_kernel(
    x_ptr, stride_xt,  # hidden [T, H]
    q_ptr, stride_qn, stride_qr,  # w13_q [N, 2I, H/2] u8
    s_ptr, stride_sn, stride_sr,  # w13_s [N, 2I, H/16] e4m3
    g_ptr, stride_gn,  # gs [N, 3] f32: gate, up, down globals
    rows_ptr,  # [M] bank row of each pair (BLOCK_M == 1)
    sorted_ids_ptr, block_row_ptr, num_padded_ptr,  # decode_align output (BLOCK_M > 1)
    act_ptr,  # [M, I] f32
    M, N, H, I, TOPK,
    x_odd_off,  # SPLIT_X: x is [2, T, H/2] (even columns, then odd), stride_xt = H/2; this is T * H/2
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    SPLIT_X: tl.constexpr, SPLIT_ACT: tl.constexpr, PTX: tl.constexpr,
    cnt_ptr=None, n_cnt=0, ZERO_BLOCK: tl.constexpr = 0, USE_PDL: tl.constexpr = False
):
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    if ZERO_BLOCK:  # the per-pair down launch's (token, column tile) counters start each call at 0 (SUM_K)
        zero_counters(cnt_ptr, n_cnt, pid_m * tl.num_programs(0) + pid_n, ZERO_BLOCK)
    if BLOCK_M == 1:
        row = tl.load(rows_ptr + pid_m)
        if (row < 0) | (row >= N):
            return
        pair = pid_m + tl.arange(0, 1)
    else:
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return
        row = tl.load(block_row_ptr + pid_m)
        pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row = row.to(tl.int64)
    valid_m = pair < M
    token = (pair // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_kb = tl.arange(0, BLOCK_K // 2)  # byte b holds K columns 2b (low nibble) and 2b+1

    # [BN, BK/2] weight tiles (gate rows n, up rows I + n), [BM, 1, BK/2] activations
    q_ptrs = q_ptr + row * stride_qn + offs_n[:, None] * stride_qr + offs_kb[None, :]
    offs_sb = tl.arange(0, BLOCK_K // 2 // BYTES_PER_SCALE)  # [BN, BK/16] scales
    s_ptrs = s_ptr + row * stride_sn + offs_n[:, None] * stride_sr + offs_sb[None, :]
    if SPLIT_X:  # [BM, BN, BK/2] tiles of the contiguous even columns (rows repeat): the weight tiles' layout
        x_ptrs = x_ptr + token[:, None, None] * stride_xt + offs_kb[None, None, :] + offs_n[None, :, None] * 0
        x_step, x_odd = BLOCK_K // 2, x_odd_off
    else:
        x_ptrs = x_ptr + token[:, None, None] * stride_xt + 2 * offs_kb[None, None, :]
        x_step, x_odd = BLOCK_K, 1
    up_q, up_s = I * stride_qr, I * stride_sr

    if BLOCK_M == 1:  # [BN, BK/2] accumulators: x broadcast along rows, no 3-D layout conversions
        xe_ptr = x_ptr + (pid_m // TOPK).to(tl.int64) * stride_xt
        gate, up = _gate_up_one_pair(xe_ptr, xe_ptr + x_odd_off, q_ptrs, s_ptrs, up_q, up_s,
                                     offs_n, offs_kb, offs_sb, H, I, BLOCK_K, EVEN_K, SPLIT_X, PTX)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            k_ok = _k_columns_left(offs_kb, H - k0, EVEN_K)
            w_mask = (offs_n[:, None] < I) & k_ok[None, :]
            s_mask = (offs_n[:, None] < I) & _k_columns_left(offs_sb * BYTES_PER_SCALE, H - k0, EVEN_K)[None, :]
            x_mask = valid_m[:, None, None] & k_ok[None, None, :]
            if SPLIT_X:  # the pointers' full tile shape
                x_mask = x_mask & (offs_n[None, :, None] >= 0)
            x_even = tl.load(x_ptrs, mask=x_mask, other=0.0).to(tl.float32)
            x_odd_cols = tl.load(x_ptrs + x_odd, mask=x_mask, other=0.0).to(tl.float32)
            g_lo, g_hi = _nvfp4_halves(q_ptrs, s_ptrs, w_mask, s_mask, PTX)
            u_lo, u_hi = _nvfp4_halves(q_ptrs + up_q, s_ptrs + up_s, w_mask, s_mask, PTX)
            acc_g = _fma2(acc_g, x_even, g_lo[None, :, :], x_odd_cols, g_hi[None, :, :])
            acc_u = _fma2(acc_u, x_even, u_lo[None, :, :], x_odd_cols, u_hi[None, :, :])
            q_ptrs += BLOCK_K // 2
            s_ptrs += BLOCK_K // 2 // BYTES_PER_SCALE
            x_ptrs += x_step
        gate, up = tl.sum(acc_g, axis=2), tl.sum(acc_u, axis=2)
    gate = gate * (tl.load(g_ptr + row * stride_gn) * unshift(PTX))
    up = up * (tl.load(g_ptr + row * stride_gn + 1) * unshift(PTX))
    act = gate / (1.0 + tl.exp(-gate)) * up
    if SPLIT_ACT:  # [M, 2, I/2]: even columns, then odd (what _down_pair_kernel loads contiguously)
        act_ptrs = act_ptr + pair.to(tl.int64)[:, None] * I + ((offs_n % 2) * (I // 2) + offs_n // 2)[None, :]
    else:
        act_ptrs = act_ptr + pair.to(tl.int64)[:, None] * I + offs_n[None, :]
    tl.store(act_ptrs, act, mask=valid_m[:, None] & (offs_n[None, :] < I))


@triton.jit
def _down_sum_kernel(
    act_ptr,  # [M, I] f32
    q_ptr, stride_qn, stride_qr,  # w2_q [N, H, I/2] u8
    s_ptr, stride_sn, stride_sr,  # w2_s [N, H, I/16] e4m3
    g_ptr, stride_gn,  # gs [N, 3] f32
    rows_ptr, w_ptr,  # [M] bank rows, [M] routing weights (any float dtype; used in fp32)
    out_ptr, stride_ot,  # [T, H]
    res_ptr, stride_rt,  # [T, H] residual added to the output (RESIDUAL only)
    N, H, I, TOPK,
    KP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, RESIDUAL: tl.constexpr,
    PTX: tl.constexpr, USE_PDL: tl.constexpr = False
):
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    t = tl.program_id(1).to(tl.int64)
    # R = KP * BLOCK_N tile rows: row r is output n = r % BLOCK_N of the token's pair k = r // BLOCK_N
    offs_r = tl.arange(0, KP * BLOCK_N)
    k = offs_r // BLOCK_N
    offs_n = pid_n * BLOCK_N + offs_r % BLOCK_N
    pair = t * TOPK + k
    row = tl.load(rows_ptr + pair, mask=k < TOPK, other=-1).to(tl.int64)
    ok = (k < TOPK) & (row >= 0) & (row < N)
    row = tl.where(ok, row, 0)
    rows_ok = ok & (offs_n < H)
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_sb = tl.arange(0, BLOCK_K // 2 // BYTES_PER_SCALE)

    # [R, BK/2] weight bytes, [R, BK/16] scales, [R, BK/2] even activations (repeated over n: L1)
    q_ptrs = q_ptr + (row * stride_qn + offs_n * stride_qr)[:, None] + offs_kb[None, :]
    s_ptrs = s_ptr + (row * stride_sn + offs_n * stride_sr)[:, None] + offs_sb[None, :]
    a_ptrs = act_ptr + (pair * I)[:, None] + 2 * offs_kb[None, :]

    acc = tl.zeros((KP * BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = _k_columns_left(offs_kb, I - k0, EVEN_K)[None, :]
        s_ok = _k_columns_left(offs_sb * BYTES_PER_SCALE, I - k0, EVEN_K)[None, :]
        a_even = tl.load(a_ptrs, mask=ok[:, None] & k_ok, other=0.0)
        a_odd = tl.load(a_ptrs + 1, mask=ok[:, None] & k_ok, other=0.0)
        lo, hi = _nvfp4_halves(q_ptrs, s_ptrs, rows_ok[:, None] & k_ok, rows_ok[:, None] & s_ok, PTX)
        acc = _fma2(acc, a_even, lo, a_odd, hi)
        q_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 2 // BYTES_PER_SCALE
        a_ptrs += BLOCK_K

    route_w = tl.load(w_ptr + pair, mask=ok, other=0.0).to(tl.float32)  # the router's dtype, exact in fp32
    scale = tl.load(g_ptr + row * stride_gn + 2, mask=ok, other=0.0) * route_w * unshift(PTX)
    y = tl.sum(tl.reshape(tl.sum(acc, axis=1) * scale, (KP, BLOCK_N)), axis=0)  # fixed-order sum over pairs
    offs_y = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    store_out(out_ptr, stride_ot, res_ptr, stride_rt, t, offs_y, offs_y < H, y, RESIDUAL)


@triton.jit
def _down_pair_kernel(
    act_ptr,  # [M, 2, I/2] f32: each pair's even activation columns, then its odd ones
    q_ptr, stride_qn, stride_qr,  # w2_q [N, H, I/2] u8
    s_ptr, stride_sn, stride_sr,  # w2_s [N, H, I/16] e4m3
    g_ptr, stride_gn,  # gs [N, 3] f32
    rows_ptr, w_ptr,  # [M] bank rows, [M] routing weights (any float dtype; used in fp32)
    part_ptr,  # [M, H] f32: each pair's weighted down projection
    N, H, I,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PTX: tl.constexpr,
    cnt_ptr=None, final_ptr=None, stride_ft=0, res_ptr=None, stride_rt=0, TOPK=1,
    SUM_K: tl.constexpr = False, RESIDUAL: tl.constexpr = False, USE_PDL: tl.constexpr = False
):
    pdl_enter(USE_PDL)
    pid_n = tl.program_id(0)
    m = tl.program_id(1).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    part_ptrs = part_ptr + m * H + offs_n
    row = tl.load(rows_ptr + m).to(tl.int64)
    if (row < 0) | (row >= N):  # a pair left out: its partial is 0 for the sum
        tl.store(part_ptrs, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=offs_n < H)
        if SUM_K:
            _sum_if_last(part_ptr, H, cnt_ptr, final_ptr, stride_ft, res_ptr, stride_rt, m, offs_n, pid_n,
                         tl.num_programs(0), TOPK, BLOCK_N, RESIDUAL)
        return
    offs_kb = tl.arange(0, BLOCK_K // 2)
    offs_sb = tl.arange(0, BLOCK_K // 2 // BYTES_PER_SCALE)
    # [BN, BK/2] weight bytes and [BN, BK/16] scales of one row; the pair's even and odd activations are
    # loaded as [BN, BK/2] tiles whose rows repeat one contiguous address range (the activations are stored
    # split), which Triton gives the weight tile's layout: no shared-memory conversion per K step
    q_ptrs = q_ptr + row * stride_qn + offs_n[:, None] * stride_qr + offs_kb[None, :]
    s_ptrs = s_ptr + row * stride_sn + offs_n[:, None] * stride_sr + offs_sb[None, :]
    a_ptr = act_ptr + m * I
    a_offs = offs_n[:, None] * 0 + offs_kb[None, :]
    acc = tl.zeros((BLOCK_N, BLOCK_K // 2), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        k_ok = _k_columns_left(offs_kb, I - k0, EVEN_K)
        w_mask = (offs_n[:, None] < H) & k_ok[None, :]
        s_mask = (offs_n[:, None] < H) & _k_columns_left(offs_sb * BYTES_PER_SCALE, I - k0, EVEN_K)[None, :]
        a_even = tl.load(a_ptr + k0 // 2 + a_offs, mask=k_ok[None, :], other=0.0)
        a_odd = tl.load(a_ptr + I // 2 + k0 // 2 + a_offs, mask=k_ok[None, :], other=0.0)
        lo, hi = _nvfp4_halves(q_ptrs, s_ptrs, w_mask, s_mask, PTX)
        acc = _fma2(acc, a_even, lo, a_odd, hi)
        q_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // 2 // BYTES_PER_SCALE
    scale = tl.load(g_ptr + row * stride_gn + 2) * tl.load(w_ptr + m).to(tl.float32) * unshift(PTX)
    tl.store(part_ptrs, tl.sum(acc, axis=1) * scale, mask=offs_n < H)
    if SUM_K:
        _sum_if_last(part_ptr, H, cnt_ptr, final_ptr, stride_ft, res_ptr, stride_rt, m, offs_n, pid_n,
                     tl.num_programs(0), TOPK, BLOCK_N, RESIDUAL)


@triton.jit
def _sum_if_last(part_ptr, H, cnt_ptr, final_ptr, stride_ft, res_ptr, stride_rt, m, offs_n, pid_n, NT, TOPK,
                 BLOCK_N: tl.constexpr, RESIDUAL: tl.constexpr):
    """``moe_sum._sum_pairs_kernel``'s work for token ``m // TOPK``'s column tile ``pid_n``, by the last of its TOPK
    pair programs to store its partial (a counter per (token, column tile), zeroed by the gate_up launch of the same
    call; every pair program counts, a left-out one too): the partials summed in k order in fp32 and rounded as
    ``moe_sum.store_out``, the same bits. Its store, a barrier, then a scalar acq_rel atomic (one thread; its result
    reaches every thread on every Triton version); the partials of the other programs read past L1 (volatile)."""
    tl.debug_barrier()
    t = m // TOPK
    done = tl.atomic_add(cnt_ptr + t * NT + pid_n, 1, sem="acq_rel", scope="gpu")
    if done == TOPK - 1:
        mask = offs_n < H
        y = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k in range(0, TOPK):
            y += tl.load(part_ptr + (t * TOPK + k) * H + offs_n, mask=mask, other=0.0, volatile=True)
        store_out(final_ptr, stride_ft, res_ptr, stride_rt, t, offs_n, mask, y, RESIDUAL)




# ---------------------------------------------------------------------------------------------
# Host side


def decode_gemv_nvfp4(
    hidden_TH: torch.Tensor,
    rows_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    views: dict,
    out_dtype: torch.dtype | None = None,
    config: GemvConfig | None = None,
    residual_TH: torch.Tensor | None = None,
    ptx: bool | None = None,
    alignment: MoeAlignment | None = None,
    sum_in_down: bool = True,
) -> torch.Tensor:
    """SwiGLU MoE over NVFP4 bank rows for few tokens per expert; no host sync, no bf16 weight copy.

    Args (as ``decode_moe.decode_moe_nvfp4``):
        hidden_TH: ``[T, H]`` bf16/fp16/fp32 activations.
        rows_TK: ``[T, K]`` int32/int64 bank row of each routed pair; pairs outside [0, N) (e.g. -1)
            are left out (they contribute nothing). Not range-checked on the host (that would sync).
        weights_TK: ``[T, K]`` float routing weights (used in fp32).
        views: NVFP4 bank views ``w13_q [N, 2I, H/2] u8``, ``w13_s [N, 2I, H/16] e4m3``,
            ``w2_q [N, H, I/2] u8``, ``w2_s [N, H, I/16] e4m3``, ``gs [N, 3] f32``; rows contiguous.
        out_dtype: output dtype (default ``hidden_TH.dtype``).
        config: tiles; default ``gemv_config_for(device, H, I, T*K)``.
        residual_TH: ``[T, H]`` in ``out_dtype`` (optional): returns ``residual_TH + y`` rounded as the decoder
            layer's add (``moe_sum.py``), in the same launches.
        ptx: convert the weights with ``nvfp4.e2m1_halves_bf16`` (same bits, fewer instructions); default
            ``nvfp4.ptx_conversion(device)`` (CUDA sm_80+). False keeps the portable conversion (the GPU tests
            compare the two).
        alignment: with ``config.block_m`` > 1, ``rows_TK`` already grouped in such blocks (as
            ``decode_moe.decode_moe_nvfp4``); unused at block_m 1.
        sum_in_down: with ``config.down_per_pair`` and K > 1 the per-pair down launch also sums each token's K
            partials (the last of a token's pair programs per column tile sums them), the same bits as the sum
            launch False keeps.

    Returns:
        ``[T, H]`` in ``out_dtype``. Memory: ``act [T*K, I]`` fp32 (+ the alignment when block_m > 1,
        + ``part [T*K, H]`` fp32 with ``down_per_pair``).
    """
    N, H, I, T, K, out_dtype, residual_TH = call_shape(hidden_TH, rows_TK, weights_TK, views, out_dtype, residual_TH)
    M, dev = T * K, hidden_TH.device
    if M == 0:
        return no_pairs(T, H, out_dtype, dev, residual_TH)
    if T > 65535:
        raise ValueError(f"T={T} tokens: the grid's second axis holds at most 65535 (this kernel is for decode)")
    config = gemv_config_for(dev, H, I, M) if config is None else config
    supported = ptx_conversion(dev)
    ptx = supported if ptx is None else bool(ptx)
    if ptx and not supported:
        raise ValueError(f"ptx=True needs a CUDA device of compute capability 8.0 or newer, got {dev}")
    if (config.block_m == 1 or config.down_per_pair) and M > 65535:
        raise ValueError(f"T*K={M} pairs: with block_m=1 or down_per_pair the grid holds at most 65535; use "
                         "block_m > 1 and the all-pairs down kernel")
    if hidden_TH.stride(1) != 1:
        hidden_TH = hidden_TH.contiguous()
    rows_M = rows_TK.reshape(-1).contiguous()
    weights_M = weights_TK.reshape(-1).contiguous()  # read in its own dtype, fp32 in the kernel: no cast launch
    act_MI = torch.empty((M, I), dtype=torch.float32, device=dev)
    out_TH = torch.empty((T, H), dtype=out_dtype, device=dev)
    q1, s1, q2, s2, gs = (views[k] for k in ("w13_q", "w13_s", "w2_q", "w2_s", "gs"))
    gu, dn = config.gate_up, config.down
    if config.block_m == 1:
        align_args, num_blocks = (rows_M, rows_M, rows_M), M  # unused by the kernel when BLOCK_M == 1
    else:
        align = given_alignment(alignment, config.block_m, "the GEMV's tiles") or decode_align(rows_TK, N, config.block_m)
        align_args = (align.sorted_ids_P, align.block_row_B, align.num_padded_1)
        num_blocks = align.sorted_ids_P.numel() // config.block_m
    x, x_odd_off = hidden_TH, 0
    if config.split_x:  # [2, T, H/2]: even columns, then odd (one small copy launch)
        x = hidden_TH.unflatten(1, (H // 2, 2)).permute(2, 0, 1).contiguous()
        x_odd_off = T * (H // 2)
    grid_gu = (triton.cdiv(I, gu.block_n), num_blocks)
    summed, zero = {}, {}
    if config.down_per_pair and sum_in_down and K > 1:  # the per-pair down launch sums over K: no sum launch
        counters = sum_counters(T, H, dn.block_n, dev)
        summed = sum_args(counters, out_TH, residual_TH, K)
        zero = zeroing_args(counters, grid_gu[0] * grid_gu[1])
    with device_guard(dev):
        _gate_up_kernel[grid_gu](
            x, x.stride(-2),
            q1, q1.stride(0), q1.stride(1),
            s1, s1.stride(0), s1.stride(1),
            gs, gs.stride(0),
            rows_M, *align_args, act_MI,
            M, N, H, I, K, x_odd_off,
            BLOCK_M=config.block_m, BLOCK_N=gu.block_n, BLOCK_K=gu.block_k, EVEN_K=H % gu.block_k == 0,
            SPLIT_X=config.split_x, SPLIT_ACT=config.down_per_pair, PTX=ptx, num_warps=gu.num_warps, **zero,
            **pdl.launch_kwargs()
        )
        if config.down_per_pair:
            part_MH = torch.empty((M, H), dtype=torch.float32, device=dev)
            _down_pair_kernel[(triton.cdiv(H, dn.block_n), M)](
                act_MI,
                q2, q2.stride(0), q2.stride(1),
                s2, s2.stride(0), s2.stride(1),
                gs, gs.stride(0),
                rows_M, weights_M, part_MH,
                N, H, I,
                BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, EVEN_K=I % dn.block_k == 0, PTX=ptx,
                num_warps=dn.num_warps, **summed, **pdl.launch_kwargs()
            )
            return out_TH if summed else sum_pairs(part_MH, K, out_TH, residual_TH)
        _down_sum_kernel[(triton.cdiv(H, dn.block_n), T)](
            act_MI,
            q2, q2.stride(0), q2.stride(1),
            s2, s2.stride(0), s2.stride(1),
            gs, gs.stride(0),
            rows_M, weights_M,
            out_TH, out_TH.stride(0),
            *((out_TH, 0) if residual_TH is None else (residual_TH, residual_TH.stride(0))),
            N, H, I, K,
            KP=triton.next_power_of_2(K), BLOCK_N=dn.block_n, BLOCK_K=dn.block_k, EVEN_K=I % dn.block_k == 0,
            RESIDUAL=residual_TH is not None, PTX=ptx, num_warps=dn.num_warps, **pdl.launch_kwargs()
        )
    return out_TH
