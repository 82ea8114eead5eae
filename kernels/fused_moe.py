"""Fused W4A16 grouped MoE for NVFP4 expert banks (Triton): dequantize inside the GEMM K loops.

Legend: T tokens, K top-k, M = T*K routed (token, k) pairs, N bank rows (experts or slots),
H hidden, I expert intermediate, P padded pair slots (multiple of BLOCK_M), B = P / BLOCK_M blocks.

    y[t] = sum_k w[t,k] * down_e @ (silu(gate_e @ x_t) * (up_e @ x_t)),   e = rows[t, k]

Steps, all enqueued without a host sync (the grid is sized from host-known upper bounds):
1. ``moe_align`` (``moe_align.py``): group pairs by bank row and pad each row's group to BLOCK_M (three
   small kernels: count, prefix sum, place).
2. ``_gate_up_silu_kernel``: per block of one row, x @ [gate; up]^T with NVFP4 dequant in the K loop,
   epilogue ``silu(gate) * up`` -> ``act_MI`` (pair order, compute dtype).
3. ``_down_kernel``: ``act @ down^T`` with dequant in the K loop, times the routing weight ->
   ``terms_MH`` (pair order); ``moe_sum.sum_pairs`` reduces over K (k = 0..K-1 in fp32: deterministic, no
   atomics), adding the decoder layer's residual in the same launch when one is given.
   With K == 1 the kernel writes the output directly.

Weight tiles are loaded transposed, ``[BLOCK_K/2 bytes, BLOCK_N rows]`` (contiguous along K), and
split by nibble into even and odd K columns; the activations are loaded as even and odd columns to
match, so each K step is two dots of depth BLOCK_K/2 and no register interleave is needed.

Numerics: ``code * block_scale`` is exact in bf16/fp16 (<= 6 significant bits, exponents within range),
so the tensor-core operands are the exact NVFP4 values; the per-matrix global multiplies the fp32
accumulator. fp32 activations use IEEE fp32 dots (no TF32). Rounding happens where a bf16 model
rounds anyway: the intermediate activation and the per-pair terms are stored in the compute/output dtype.

Tile sizes come from ``fused_moe_tuning.json`` through ``fused_moe_tuning.py`` (written by
``benchmarks/tune_fused_moe.py``), keyed by device name, shape (H, I) and the number of routed pairs.
A config with ``swap_ab`` runs the kernel pair of ``fused_moe_swap.py`` instead (the weight tile as the
dot's left operand; what the H200 tables choose at every tuned size), through the same ``run_fused``.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig, config_for
from moe_offload.kernels.moe_align import MoeAlignment, max_padded_pairs, moe_align  # noqa: F401 (re-exported)
from moe_offload.kernels.moe_sum import check_residual, no_pairs, sum_counters, sum_pairs
from moe_offload.kernels.nvfp4 import (
    BYTES_PER_SCALE,
    E2M1_F16_SHIFT,
    SCALE_BLOCK,
    bank_shapes,
    device_guard,
    e2m1_to_f32,
)

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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


def _check_inputs(hidden_TH, rows_TK, weights_TK, views) -> tuple[int, int, int]:
    N, H, I = bank_shapes(views)
    if hidden_TH.dim() != 2 or hidden_TH.dtype not in _HIDDEN_DTYPES:
        raise ValueError(f"hidden_TH must be a 2-D {_HIDDEN_DTYPES} tensor [T, H], got {hidden_TH.dtype} {tuple(hidden_TH.shape)}")
    if hidden_TH.shape[1] != H:
        raise ValueError(f"hidden_TH has H={hidden_TH.shape[1]} but the banks have H={H} (views['w13_q'] is [N, 2I, H/2])")
    T = hidden_TH.shape[0]
    if rows_TK.dim() != 2 or rows_TK.shape[0] != T or rows_TK.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"rows_TK must be int32/int64 [T={T}, K], got {rows_TK.dtype} {tuple(rows_TK.shape)}")
    if tuple(weights_TK.shape) != tuple(rows_TK.shape) or not weights_TK.is_floating_point():
        raise ValueError(f"weights_TK must be a float tensor of rows_TK's shape {tuple(rows_TK.shape)}, got {weights_TK.dtype} {tuple(weights_TK.shape)}")
    for name, t in (("hidden_TH", hidden_TH), ("rows_TK", rows_TK), ("weights_TK", weights_TK)):
        if t.device != views["w13_q"].device:
            raise ValueError(f"{name} is on {t.device} but the banks are on {views['w13_q'].device}")
    if views["gs"].stride(1) != 1:
        raise ValueError(f"views['gs'] must have contiguous columns, got strides {tuple(views['gs'].stride())}")
    return N, H, I


def fused_moe_nvfp4(
    hidden_TH: torch.Tensor,
    rows_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    views: dict,
    out_dtype: torch.dtype | None = None,
    config: FusedMoeConfig | None = None,
) -> torch.Tensor:
    """SwiGLU MoE over NVFP4 expert banks, W4A16, with no bf16 copy of the weights and no host sync.

    Args:
        hidden_TH: ``[T, H]`` bf16/fp16/fp32 activations.
        rows_TK: ``[T, K]`` int32/int64 bank row (expert or slot) of each routed pair, in [0, N)
            (not range-checked: see ``moe_align``). Duplicate rows within a token are allowed.
        weights_TK: ``[T, K]`` float routing weights (used in fp32).
        views: NVFP4 bank views ``w13_q [N, 2I, H/2] u8``, ``w13_s [N, 2I, H/16] e4m3``,
            ``w2_q [N, H, I/2] u8``, ``w2_s [N, H, I/16] e4m3``, ``gs [N, 3] f32``; rows contiguous,
            any dim-0 stride.
        out_dtype: output dtype (default: ``hidden_TH.dtype``).
        config: tiles; default: ``config_for(device, H, I, T*K)`` from the tuning table.

    Returns:
        ``[T, H]`` in ``out_dtype``. Memory: ``act [T*K, I]`` in the compute dtype, plus
        ``terms [T*K, H]`` in ``out_dtype`` when K > 1.
    """
    return run_fused(hidden_TH, rows_TK, weights_TK, views, out_dtype, config, config_for, moe_align)


def call_shape(hidden_TH, rows_TK, weights_TK, views, out_dtype, residual_TH):
    """``(N, H, I, T, K, out_dtype, residual_TH)`` of a valid fused-MoE call: ``check_call``, and the residual
    checked against its shape (``moe_sum.check_residual``)."""
    N, H, I, out_dtype = check_call(hidden_TH, rows_TK, weights_TK, views, out_dtype)
    T, K = rows_TK.shape
    return N, H, I, T, K, out_dtype, check_residual(residual_TH, T, H, out_dtype, hidden_TH.device)


def check_call(hidden_TH, rows_TK, weights_TK, views, out_dtype) -> tuple[int, int, int, torch.dtype]:
    """``(N, H, I, out_dtype)`` of a valid fused-MoE call (every NVFP4 MoE kernel's wrapper runs it)."""
    N, H, I = _check_inputs(hidden_TH, rows_TK, weights_TK, views)
    out_dtype = hidden_TH.dtype if out_dtype is None else out_dtype
    if out_dtype not in _HIDDEN_DTYPES:
        raise ValueError(f"out_dtype must be one of {_HIDDEN_DTYPES}, got {out_dtype}")
    if N == 0 and rows_TK.numel():
        raise ValueError("views have N=0 bank rows but rows_TK routes pairs to them")
    return N, H, I, out_dtype


def run_fused(hidden_TH, rows_TK, weights_TK, views, out_dtype, config, default_config, align,
              residual_TH=None, alignment: MoeAlignment | None = None, x_split=None,
              sum_in_down: bool = False, x_split_block_k: int | None = None) -> torch.Tensor:
    """The body shared by ``fused_moe_nvfp4`` and ``decode_moe.decode_moe_nvfp4``: input checks, the
    alignment (``align(rows_TK, N, block_m)``, or ``alignment`` when the caller made it already), the gate_up
    and down kernels, the fixed-order sum over K (``moe_sum.sum_pairs``; with ``residual_TH`` it also adds the
    residual, the decoder layer's roundings). ``default_config(device, H, I, pairs)`` gives the tiles when
    ``config`` is None. ``x_split``: ``hidden_TH`` already in the swapped kernels' split layout for chunks of
    ``x_split_block_k`` columns (see ``kernel_calls``). ``sum_in_down``: with the swapped kernels and K > 1 the down
    launch also sums over K (``fused_moe_swap.down_weighted_swap``'s ``sum_into``, the same bits): no sum launch;
    on a Triton that cannot (``fused_moe_swap.sum_in_down_supported``) the sum launch runs, with one
    ``fused_moe_sum_unavailable`` event."""
    N, H, I, T, K, out_dtype, residual_TH = call_shape(hidden_TH, rows_TK, weights_TK, views, out_dtype, residual_TH)
    M, dev = T * K, hidden_TH.device
    if M == 0:
        return no_pairs(T, H, out_dtype, dev, residual_TH)
    if config is None:
        config = default_config(dev, H, I, M)
    if hidden_TH.stride(1) != 1:
        hidden_TH = hidden_TH.contiguous()
    alignment = given_alignment(alignment, config.block_m, "the tiles") or align(rows_TK, N, config.block_m)
    weights_M = weights_TK.reshape(-1).contiguous()  # read in its own dtype, fp32 in the kernel: no cast launch
    # K == 1: pair id == token id, so the down kernel writes the output rows directly.
    terms_MH = torch.empty((M, H), dtype=out_dtype, device=dev)
    out_TH = torch.empty((T, H), dtype=out_dtype, device=dev)
    sum_into = (out_TH, residual_TH, K) if sum_in_down and config.swap_ab and K > 1 and _sum_ok() else None
    check_x_split(config, x_split, x_split_block_k)
    gate_up, down = kernel_calls(hidden_TH, views, alignment, weights_M, terms_MH, K, config, x_split, sum_into)
    gate_up()
    down()
    if sum_into is not None:
        return out_TH
    if K == 1 and residual_TH is None:
        return terms_MH
    return sum_pairs(terms_MH, K, out_TH, residual_TH)


def _sum_ok() -> bool:
    """``fused_moe_swap.sum_in_down_supported``, with one ``fused_moe_sum_unavailable`` event where not."""
    from moe_offload.kernels import fused_moe_swap as swap  # it imports this module: imported at call time

    ok, why = swap.sum_in_down_supported()
    if not ok:
        from moe_offload import log

        log.log_once("fused_moe_sum_unavailable", "fused_moe_sum_unavailable", logging.WARNING, reason=why,
                     fallback="the separate sum launch (kernels/moe_sum.py)", setting="compute.fused_moe_launches")
    return ok


def check_x_split(config: FusedMoeConfig, x_split, x_split_block_k: int | None) -> None:
    """A caller's ``x_split`` must be split in the chunks the swapped gate_up kernel reads (other tiles ignore it)."""
    if x_split is not None and config.swap_ab and x_split_block_k != config.gate_up.block_k:
        raise ValueError(f"x_split was split in chunks of {x_split_block_k} columns, the swapped gate_up kernel reads "
                         f"chunks of {config.gate_up.block_k} (split_columns(hidden_TH, config.gate_up.block_k))")


def given_alignment(alignment: MoeAlignment | None, block_m: int, who: str) -> MoeAlignment | None:
    """``alignment`` (a caller's, e.g. ``decode_miss.serve_misses_plan``'s), checked to be in blocks of the
    ``block_m`` pairs ``who`` run on; None when not given."""
    if alignment is not None and alignment.block_m != block_m:
        raise ValueError(f"the given alignment groups pairs in blocks of {alignment.block_m}, but {who} run blocks of "
                         f"{block_m}; align with the kernel's config.block_m")
    return alignment


def kernel_calls(hidden_TH, views, alignment: MoeAlignment, weights_M, terms_MH, topk: int, config: FusedMoeConfig,
                 x_split=None, sum_into=None):
    """``(gate_up, down)``: the two kernel launches of a fused-MoE call as closures over their intermediate
    buffer (``run_fused`` calls both in order; the tuners time each alone). ``config.swap_ab`` picks the
    kernels of ``fused_moe_swap.py`` (gate_up then also reorders the hidden states into its split layout, one copy,
    unless ``x_split`` holds them so already: ``fused_moe_swap.split_columns(hidden_TH, config.gate_up.block_k)``'s
    values, e.g. written by the norm before the MoE, ``kernels/rmsnorm.py`` ``add_rms_norm_split``). ``sum_into``
    (swapped kernels only): ``(out_TH, residual_TH, K)``, the down launch sums over K into ``out_TH``
    (``fused_moe_swap.down_weighted_swap``), with counters made here."""
    M, H = terms_MH.shape
    I = views["w2_q"].shape[2] * 2
    dev = hidden_TH.device
    if not config.swap_ab:
        act_MI = torch.empty((M, I), dtype=hidden_TH.dtype, device=dev)
        return (lambda: gate_up_silu(hidden_TH, views, alignment, act_MI, topk, config),
                lambda: down_weighted(act_MI, views, weights_M, alignment, terms_MH, config))
    from moe_offload.kernels import fused_moe_swap as swap  # it imports this module: imported at call time

    dot = _dot_setup(hidden_TH.dtype, dev)
    act_split = swap.act_buffer(M, I, hidden_TH.dtype, dev, config.down.block_k)

    if x_split is not None:
        want = (hidden_TH.shape[0], swap.padded_cols(H, config.gate_up.block_k))
        if tuple(x_split.shape) != want or x_split.stride(1) != 1 or x_split.dtype != hidden_TH.dtype:
            raise ValueError(f"x_split is {tuple(x_split.shape)} {x_split.dtype}; the swapped gate_up kernel reads "
                             f"{want} {hidden_TH.dtype} rows (split_columns(hidden_TH, {config.gate_up.block_k}))")

    counters = None
    if sum_into is not None:
        counters = sum_counters(hidden_TH.shape[0], H, config.down.block_n, dev)
        sum_into = (counters, *sum_into)

    def gate_up():
        xs = swap.split_columns(hidden_TH, config.gate_up.block_k) if x_split is None else x_split
        swap.gate_up_silu_swap(xs, views, alignment, act_split, topk, M, H, I, config, dot, counters)

    return gate_up, lambda: swap.down_weighted_swap(act_split, views, weights_M, alignment, terms_MH, I, config, dot,
                                                    sum_into)


def gate_up_silu(hidden_TH, views, align: MoeAlignment, act_MI, topk: int, config: FusedMoeConfig) -> None:
    """Kernel 1 (enqueue only): ``act_MI[pair] = silu(gate @ x) * (up @ x)`` for every routed pair,
    ``x = hidden_TH[pair // topk]``. Inputs as validated by ``fused_moe_nvfp4``; ``act_MI [T*K, I]``."""
    q, s, gs = views["w13_q"], views["w13_s"], views["gs"]
    M, I = act_MI.shape
    H = hidden_TH.shape[1]
    tiles = config.gate_up
    num_blocks_m = align.sorted_ids_P.numel() // config.block_m
    dot_dtype, precision = _dot_setup(hidden_TH.dtype, hidden_TH.device)
    grid = (num_blocks_m * triton.cdiv(I, tiles.block_n),)
    with device_guard(hidden_TH.device):
        _gate_up_silu_kernel[grid](
            hidden_TH, hidden_TH.stride(0),
            q, q.stride(0), q.stride(1),
            s, s.stride(0), s.stride(1),
            gs, gs.stride(0),
            act_MI, act_MI.stride(0),
            align.sorted_ids_P, align.block_row_B, align.num_padded_1,
            M, H, I, topk, num_blocks_m,
            BLOCK_M=config.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
            EVEN_K=H % tiles.block_k == 0, DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
            **tiles.launch_options(), **pdl.launch_kwargs()
        )


def down_weighted(act_MI, views, weights_M, align: MoeAlignment, terms_MH, config: FusedMoeConfig) -> None:
    """Kernel 2 (enqueue only): ``terms_MH[pair] = weights_M[pair] * (down @ act_MI[pair])``,
    ``weights_M [T*K]`` fp32, ``terms_MH [T*K, H]``."""
    q, s, gs = views["w2_q"], views["w2_s"], views["gs"]
    M, I = act_MI.shape
    H = terms_MH.shape[1]
    tiles = config.down
    num_blocks_m = align.sorted_ids_P.numel() // config.block_m
    dot_dtype, precision = _dot_setup(act_MI.dtype, act_MI.device)
    grid = (num_blocks_m * triton.cdiv(H, tiles.block_n),)
    with device_guard(act_MI.device):
        _down_kernel[grid](
            act_MI, act_MI.stride(0),
            q, q.stride(0), q.stride(1),
            s, s.stride(0), s.stride(1),
            gs, gs.stride(0),
            weights_M,
            terms_MH, terms_MH.stride(0),
            align.sorted_ids_P, align.block_row_B, align.num_padded_1,
            M, H, I, num_blocks_m,
            BLOCK_M=config.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GROUP_M=tiles.group_m,
            EVEN_K=I % tiles.block_k == 0, DOT_DTYPE=dot_dtype, INPUT_PRECISION=precision,
            **tiles.launch_options(), **pdl.launch_kwargs()
        )


def moe_reference(
    hidden_TH: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor, w13_NFH: torch.Tensor, w2_NHI: torch.Tensor
) -> torch.Tensor:
    """Plain-torch SwiGLU MoE (the tests' oracle), one bank row at a time, computed in fp32.

    ``w13_NFH [N, 2I, H]`` (gate rows, then up), ``w2_NHI [N, H, I]`` dense weights (e.g. from
    ``dequantize``); returns ``[T, H]`` in ``hidden_TH.dtype``. Not for hot paths (it syncs)."""
    T, K = rows_TK.shape
    I = w2_NHI.shape[2]
    x_TH = hidden_TH.float()
    out_TH = torch.zeros_like(x_TH)
    rows_M = rows_TK.reshape(-1)
    weights_M = weights_TK.reshape(-1).float()
    for row in torch.unique(rows_M).tolist():
        pairs = (rows_M == row).nonzero().flatten()
        tokens = pairs // K
        h = x_TH[tokens] @ w13_NFH[row].float().T
        act = F.silu(h[:, :I]) * h[:, I:]
        y = act @ w2_NHI[row].float().T
        out_TH.index_add_(0, tokens, y * weights_M[pairs, None])
    return out_TH.to(hidden_TH.dtype)
