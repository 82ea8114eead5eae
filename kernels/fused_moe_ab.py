"""The fused NVFP4 MoE's unswapped kernel pair (``swap_ab`` False, the tuners' ``ab`` layout: the activations are
the dot's left operand): its Triton kernels, their launchers ``gate_up_silu`` and ``down_weighted`` (enqueue only,
inputs as validated by ``fused_moe.run_fused``) and the dots' dtype (``_dot_setup``, shared with the swapped pair of
``fused_moe_swap.py``). ``fused_moe.py`` owns the call: the checks, the alignment, the choice of kernel pair and the
sum over K.

Legend: T tokens, K top-k, M = T*K routed (token, k) pairs, N bank rows (experts or slots),
H hidden, I expert intermediate, P padded pair slots (multiple of BLOCK_M), B = P / BLOCK_M blocks.

Weight tiles are loaded transposed, ``[BLOCK_K/2 bytes, BLOCK_N rows]`` (contiguous along K), and
split by nibble into even and odd K columns; the activations are loaded as even and odd columns to
match, so each K step is two dots of depth BLOCK_K/2 and no register interleave is needed.

A @triton.jit function resolves the names it uses (other jit functions, constants) in its own module, so
everything these kernels reference is imported here (``fused_moe_swap.py``'s kernels also call ``_block_coords``
and ``_block_pairs``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig
from moe_offload.kernels.moe_align import MoeAlignment
from moe_offload.kernels.nvfp4 import (
    BYTES_PER_SCALE,
    E2M1_F16_SHIFT,
    SCALE_BLOCK,
    device_guard,
    e2m1_to_f32,
)


@triton.jit
def _block_coords(pid, num_blocks_m, num_blocks_n, GROUP_M: tl.constexpr):
    """Grouped program order (as in Triton's matmul tutorial): GROUP_M consecutive M blocks sweep
    the N tiles together so their weight tiles stay in L2."""
    per_group = GROUP_M * num_blocks_n
    group = pid // per_group
    first_m = group * GROUP_M
    group_size = tl.minimum(num_blocks_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_size
    pid_n = (pid % per_group) // group_size
    return pid_m, pid_n


@triton.jit
def _block_pairs(pid_m, block_row_ptr, sorted_ids_ptr, M, BLOCK_M: tl.constexpr):
    """``(row, pair, valid_m)`` of block ``pid_m`` of a ``MoeAlignment``: its bank row (int64), its BLOCK_M pair
    ids (padding holds the sentinel M) and which of them are real."""
    row = tl.load(block_row_ptr + pid_m).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    return row, pair, pair < M


@triton.jit
def _nvfp4_tile_t(q_ptrs, s_ptrs, mask, DOT_DTYPE: tl.constexpr):
    """One transposed weight tile, split by nibble: ``q_ptrs`` address ``[BLOCK_K/2 bytes, BLOCK_N rows]``
    (contiguous along dim 0, so loads vectorize), ``s_ptrs`` the scale of each byte (8 consecutive
    bytes share one: repeated addresses, served by L1). Returns ``(lo, hi)``, each ``[BLOCK_K/2,
    BLOCK_N]`` = ``code * block_scale`` (exact in DOT_DTYPE): lo holds even K columns, hi odd ones.
    Splitting K into even/odd halves (and the activations likewise) avoids interleaving registers,
    which Triton 3.6 miscompiled for bf16 dots on small tiles."""
    packed = tl.load(q_ptrs, mask=mask, other=0).to(tl.int32)
    scale = tl.load(s_ptrs, mask=mask, other=0.0).to(tl.float32) * E2M1_F16_SHIFT
    lo = (e2m1_to_f32(packed & 15) * scale).to(DOT_DTYPE)
    hi = (e2m1_to_f32(packed >> 4) * scale).to(DOT_DTYPE)
    return lo, hi


@triton.jit
def _k_tile_masks(valid_m, valid_n, offs_kb, k_left, EVEN_K: tl.constexpr):
    """Masks of one K step: activations ``[BM, BK/2]`` and weight tiles ``[BK/2, BN]`` (``k_left``
    K columns remain; with EVEN_K every step is full)."""
    if EVEN_K:
        a_mask = valid_m[:, None]
        w_mask = valid_n[None, :]
    else:
        a_mask = valid_m[:, None] & (offs_kb[None, :] < k_left // 2)
        w_mask = valid_n[None, :] & (offs_kb[:, None] < k_left // 2)
    return a_mask, w_mask


@triton.jit
def _load_even_odd(a_ptrs, a_mask, DOT_DTYPE: tl.constexpr):
    """The even and odd K columns of an activation tile (``a_ptrs`` address the even ones)."""
    even = tl.load(a_ptrs, mask=a_mask, other=0.0).to(DOT_DTYPE)
    odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0).to(DOT_DTYPE)
    return even, odd


@triton.jit
def _dot_nvfp4(acc, a_even, a_odd, q_ptrs, s_ptrs, w_mask, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr):
    """``acc += a @ W`` for one NVFP4 weight tile, as two dots over the even and odd K columns."""
    lo, hi = _nvfp4_tile_t(q_ptrs, s_ptrs, w_mask, DOT_DTYPE)
    acc = tl.dot(a_even, lo, acc, input_precision=INPUT_PRECISION)
    return tl.dot(a_odd, hi, acc, input_precision=INPUT_PRECISION)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr, stride_xt,  # hidden [T, H]
    q_ptr, stride_qn, stride_qr,  # w13_q [N, 2I, H/2] u8
    s_ptr, stride_sn, stride_sr,  # w13_s [N, 2I, H/16] e4m3
    g_ptr, stride_gn,  # gs [N, 3] f32 (column stride 1)
    act_ptr, stride_am,  # act [M, I]
    sorted_ids_ptr, block_row_ptr, num_padded_ptr,
    M, H, I, TOPK, num_blocks_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False
):
    pdl_enter(USE_PDL)
    pid_m, pid_n = _block_coords(tl.program_id(0), num_blocks_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
        return
    row, pair, valid_m = _block_pairs(pid_m, block_row_ptr, sorted_ids_ptr, M, BLOCK_M)
    token = (pair // TOPK).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    valid_n = offs_n < I
    offs_kb = tl.arange(0, BLOCK_K // 2)  # byte b of the tile holds K columns 2b and 2b+1

    x_ptrs = x_ptr + token[:, None] * stride_xt + 2 * offs_kb[None, :]  # even columns [BM, BK/2]
    # transposed weight tiles [BK/2 bytes, BN rows]: gate rows n, up rows I + n
    qg_ptrs = q_ptr + row * stride_qn + offs_n[None, :] * stride_qr + offs_kb[:, None]
    sg_ptrs = s_ptr + row * stride_sn + offs_n[None, :] * stride_sr + (offs_kb // BYTES_PER_SCALE)[:, None]
    up_q = I * stride_qr
    up_s = I * stride_sr

    acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        x_mask, w_mask = _k_tile_masks(valid_m, valid_n, offs_kb, H - k0, EVEN_K)
        x_even, x_odd = _load_even_odd(x_ptrs, x_mask, DOT_DTYPE)
        acc_gate = _dot_nvfp4(acc_gate, x_even, x_odd, qg_ptrs, sg_ptrs, w_mask, DOT_DTYPE, INPUT_PRECISION)
        acc_up = _dot_nvfp4(acc_up, x_even, x_odd, qg_ptrs + up_q, sg_ptrs + up_s, w_mask, DOT_DTYPE, INPUT_PRECISION)
        x_ptrs += BLOCK_K
        qg_ptrs += BLOCK_K // 2
        sg_ptrs += BLOCK_K // SCALE_BLOCK

    gate = acc_gate * tl.load(g_ptr + row * stride_gn)
    up = acc_up * tl.load(g_ptr + row * stride_gn + 1)
    act = gate / (1.0 + tl.exp(-gate)) * up
    act_ptrs = act_ptr + pair.to(tl.int64)[:, None] * stride_am + offs_n[None, :]
    tl.store(act_ptrs, act.to(act_ptr.dtype.element_ty), mask=valid_m[:, None] & valid_n[None, :])


@triton.jit
def _down_kernel(
    act_ptr, stride_am,  # act [M, I]
    q_ptr, stride_qn, stride_qr,  # w2_q [N, H, I/2] u8
    s_ptr, stride_sn, stride_sr,  # w2_s [N, H, I/16] e4m3
    g_ptr, stride_gn,  # gs [N, 3] f32 (column stride 1)
    w_ptr,  # routing weights [M] (any float dtype; used in fp32)
    out_ptr, stride_om,  # terms [M, H] (or the output [T, H] when K == 1)
    sorted_ids_ptr, block_row_ptr, num_padded_ptr,
    M, H, I, num_blocks_m,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, DOT_DTYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False
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

    a_ptrs = act_ptr + pair64[:, None] * stride_am + 2 * offs_kb[None, :]  # even columns [BM, BK/2]
    q_ptrs = q_ptr + row * stride_qn + offs_n[None, :] * stride_qr + offs_kb[:, None]
    s_ptrs = s_ptr + row * stride_sn + offs_n[None, :] * stride_sr + (offs_kb // BYTES_PER_SCALE)[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        a_mask, w_mask = _k_tile_masks(valid_m, valid_n, offs_kb, I - k0, EVEN_K)
        a_even, a_odd = _load_even_odd(a_ptrs, a_mask, DOT_DTYPE)
        acc = _dot_nvfp4(acc, a_even, a_odd, q_ptrs, s_ptrs, w_mask, DOT_DTYPE, INPUT_PRECISION)
        a_ptrs += BLOCK_K
        q_ptrs += BLOCK_K // 2
        s_ptrs += BLOCK_K // SCALE_BLOCK

    route_w = tl.load(w_ptr + pair64, mask=valid_m, other=0.0).to(tl.float32)
    out = acc * tl.load(g_ptr + row * stride_gn + 2) * route_w[:, None]
    out_ptrs = out_ptr + pair64[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=valid_m[:, None] & valid_n[None, :])


# ---------------------------------------------------------------------------------------------
# Host side


def _dot_setup(hidden_dtype: torch.dtype, device: torch.device):
    """(DOT_DTYPE, INPUT_PRECISION). fp32 activations use IEEE dots (TF32 would round them to 10
    mantissa bits). On CPU (the Triton interpreter) dots run in fp32 because the interpreter
    multiplies bf16 operands as raw uint16; products of bf16/fp16 values are exact in fp32, so this
    matches a tensor-core dot with fp32 accumulation up to summation order."""
    if hidden_dtype == torch.float32 or device.type == "cpu":
        return tl.float32, "ieee"
    return (tl.bfloat16 if hidden_dtype == torch.bfloat16 else tl.float16), "tf32"


def bank_args(views, prefix: str) -> tuple:
    """The launch arguments of one weight bank (``prefix`` "w13" or "w2"), as every fused MoE kernel takes them:
    the packed codes and the block scales, each with its expert and row strides, then the global scales with theirs."""
    q, s, gs = views[f"{prefix}_q"], views[f"{prefix}_s"], views["gs"]
    return q, q.stride(0), q.stride(1), s, s.stride(0), s.stride(1), gs, gs.stride(0)


def align_args(align: MoeAlignment) -> tuple:
    """The alignment's launch arguments: sorted pair ids, each block's bank row, the padded pair count."""
    return align.sorted_ids_P, align.block_row_B, align.num_padded_1


def tile_kwargs(config: FusedMoeConfig, tiles, k: int, dot_setup) -> dict:
    """The constexprs and launch options of one fused MoE kernel with ``tiles`` (``config.gate_up`` or ``.down``)
    over a reduction of ``k`` columns, ``dot_setup`` from ``_dot_setup``. Not the PDL switch: every launch passes
    ``**pdl.launch_kwargs()`` itself, where tests/test_pdl.py sees it."""
    dot_dtype, precision = dot_setup
    return dict(BLOCK_M=config.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
                EVEN_K=k % tiles.block_k == 0, DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
                **tiles.launch_options())


def gate_up_silu(hidden_TH, views, align: MoeAlignment, act_MI, topk: int, config: FusedMoeConfig) -> None:
    """Kernel 1 (enqueue only): ``act_MI[pair] = silu(gate @ x) * (up @ x)`` for every routed pair,
    ``x = hidden_TH[pair // topk]``. Inputs as validated by ``fused_moe_nvfp4``; ``act_MI [T*K, I]``."""
    M, I = act_MI.shape
    H = hidden_TH.shape[1]
    tiles = config.gate_up
    num_blocks_m = align.sorted_ids_P.numel() // config.block_m
    grid = (num_blocks_m * triton.cdiv(I, tiles.block_n),)
    with device_guard(hidden_TH.device):
        _gate_up_silu_kernel[grid](
            hidden_TH, hidden_TH.stride(0), *bank_args(views, "w13"), act_MI, act_MI.stride(0), *align_args(align),
            M, H, I, topk, num_blocks_m,
            **tile_kwargs(config, tiles, H, _dot_setup(hidden_TH.dtype, hidden_TH.device)), **pdl.launch_kwargs()
        )


def down_weighted(act_MI, views, weights_M, align: MoeAlignment, terms_MH, config: FusedMoeConfig) -> None:
    """Kernel 2 (enqueue only): ``terms_MH[pair] = weights_M[pair] * (down @ act_MI[pair])``,
    ``weights_M [T*K]`` fp32, ``terms_MH [T*K, H]``."""
    M, I = act_MI.shape
    H = terms_MH.shape[1]
    tiles = config.down
    num_blocks_m = align.sorted_ids_P.numel() // config.block_m
    grid = (num_blocks_m * triton.cdiv(H, tiles.block_n),)
    with device_guard(act_MI.device):
        _down_kernel[grid](
            act_MI, act_MI.stride(0), *bank_args(views, "w2"), weights_M, terms_MH, terms_MH.stride(0),
            *align_args(align), M, H, I, num_blocks_m,
            **tile_kwargs(config, tiles, I, _dot_setup(act_MI.dtype, act_MI.device)), **pdl.launch_kwargs()
        )
