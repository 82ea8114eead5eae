"""The Triton kernels of the NVFP4 decode GEMV; ``decode_gemv.py`` owns the host side (its docstring gives the
launches, the layouts and the numerics; ``decode_gemv_nvfp4`` checks the call, picks the tiles and launches these).

Legend: T tokens, K top-k (KP = next power of two), M = T*K routed pairs, N bank rows (slots + scratch),
H hidden, I expert intermediate, BM pairs per program of ``_gate_up_kernel`` (1 = one pair, no alignment).

- ``_gate_up_kernel``: ``act [M, I]`` fp32 = silu(gate * g0) * (up * g1), program = (BM pairs of one row,
  BLOCK_N of the I outputs); at BM 1 through ``_gate_up_one_pair``.
- ``_down_sum_kernel``: ``y [T, H]`` = the sum over each token's KP pairs of w * g2 * down @ act, program =
  (token, BLOCK_N of the H outputs).
- ``_down_pair_kernel``: each pair's ``w * g2 * down @ act`` into ``part [M, H]`` fp32, program = (pair, BLOCK_N
  of the H outputs); with SUM_K the last of a token's pair programs also sums them (``_sum_if_last``).
- helpers: ``_nvfp4_halves`` (a weight tile's even/odd K columns), ``_fma2``, ``_k_columns_left`` (K masks).

A @triton.jit function resolves the names it uses (other jit functions, constants) in its own module, so
everything these kernels reference is imported here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.moe_sum import store_out, zero_counters
from moe_offload.kernels.nvfp4 import BYTES_PER_SCALE, e2m1_halves_bf16, e2m1_halves_f32, unshift


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
