"""Fused W4A16 grouped MoE for NVFP4 expert banks (Triton): dequantize inside the GEMM K loops.
This module owns the call: the input checks every NVFP4 MoE wrapper runs (``check_call``, ``call_shape``), the
driver both kernel pairs share (``run_fused``, ``kernel_calls``) and the plain-torch oracle ``moe_reference``; the
kernel pair of steps 2 and 3 lives in ``fused_moe_ab.py``, the swapped one in ``fused_moe_swap.py``.

Legend: T tokens, K top-k, M = T*K routed (token, k) pairs, N bank rows (experts or slots),
H hidden, I expert intermediate, P padded pair slots (multiple of BLOCK_M), B = P / BLOCK_M blocks.

    y[t] = sum_k w[t,k] * down_e @ (silu(gate_e @ x_t) * (up_e @ x_t)),   e = rows[t, k]

Steps, all enqueued without a host sync (the grid is sized from host-known upper bounds):
1. ``moe_align`` (``moe_align.py``): group pairs by bank row and pad each row's group to BLOCK_M (three
   small kernels: count, prefix sum, place).
2. ``_gate_up_silu_kernel`` (``fused_moe_ab.py``): per block of one row, x @ [gate; up]^T with NVFP4
   dequant in the K loop, epilogue ``silu(gate) * up`` -> ``act_MI`` (pair order, compute dtype).
3. ``_down_kernel`` (``fused_moe_ab.py``): ``act @ down^T`` with dequant in the K loop, times the routing
   weight -> ``terms_MH`` (pair order); ``moe_sum.sum_pairs`` reduces over K (k = 0..K-1 in fp32: deterministic, no
   atomics), adding the decoder layer's residual in the same launch when one is given.
   With K == 1 the kernel writes the output directly.

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

from moe_offload.kernels.fused_moe_ab import (
    _dot_setup,
    _down_kernel,
    _gate_up_silu_kernel,
    down_weighted,
    gate_up_silu,
)
from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig, config_for
from moe_offload.kernels.moe_align import MoeAlignment, max_padded_pairs, moe_align
from moe_offload.kernels.moe_sum import check_residual, no_pairs, sum_counters, sum_pairs
from moe_offload.kernels.nvfp4 import bank_shapes

# with the names others import from here: moe_align's, and fused_moe_ab.py's launchers and kernels (tests compile the
# kernels as ``fused_moe._gate_up_silu_kernel``)
__all__ = ["fused_moe_nvfp4", "call_shape", "check_call", "run_fused", "check_x_split", "given_alignment",
           "kernel_calls", "moe_reference", "config_for", "max_padded_pairs", "moe_align", "gate_up_silu",
           "down_weighted", "_gate_up_silu_kernel", "_down_kernel"]

_HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


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
