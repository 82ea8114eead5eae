"""NVFP4 W4A16 MoE for few tokens per expert (decode): GEMV kernels with no tensor-core dot, meant to run
near the HBM floor. Drop-in for ``decode_moe.decode_moe_nvfp4`` (same signature and output contract).
This module is the host side (``decode_gemv_nvfp4``: checks, tiles, buffers, launches); the kernels named below
live in ``decode_gemv_kernels.py``.

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

from moe_offload.kernels import pdl
from moe_offload.kernels.decode_gemv_kernels import _down_pair_kernel, _down_sum_kernel, _gate_up_kernel
from moe_offload.kernels.decode_gemv_tuning import GemvConfig, gemv_config_for
from moe_offload.kernels.decode_moe import decode_align
from moe_offload.kernels.fused_moe import call_shape, given_alignment
from moe_offload.kernels.moe_align import MoeAlignment
from moe_offload.kernels.moe_sum import no_pairs, sum_args, sum_counters, sum_pairs, zeroing_args
from moe_offload.kernels.nvfp4 import device_guard, ptx_conversion


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
