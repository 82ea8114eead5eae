"""The last step of an MoE layer in one launch: each token's K weighted expert outputs summed in a fixed order,
rounded to the output dtype, and (optionally) added to the decoder layer's residual stream.

Legend: T tokens, K top-k, M = T*K routed pairs (token-major: pair t*K + k), H hidden.

    out[t] = round(sum_{k=0..K-1} part[t*K + k])                       (no residual)
    out[t] = round(residual[t] + round(sum_{k=0..K-1} part[t*K + k]))  (with one)

The second line is what a transformers decoder layer computes as ``residual + mlp(x)`` in the activations'
dtype (the MoE output rounded, then the add rounded), so fusing the add changes no bit; it saves the add's
launch (~1.4 us of kernel and a graph gap per decode layer on the H200) and replaces torch's reduction over
K (``reduce_kernel``, ~4.8 us per layer at batch 16 in the H200 graph profile
``profile-decode-l8-r1.0-b16-retuned-b18b0cc.json``). Sums in fp32, k = 0..K-1: deterministic, no atomics.
Grids depend on host-known shapes only (graph-capturable). ``store_out`` is the same rounding for kernels that
sum over K themselves (``decode_gemv.py``'s down kernels, ``fused_moe_swap.py``'s down kernel with SUM_K: the program
that stores a token's last term sums its K terms in this order).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moe_offload.kernels import pdl
from moe_offload.kernels.pdl import pdl_enter
from moe_offload.kernels.nvfp4 import device_guard

SUM_BLOCK = 1024  # outputs per program (H = 2048: 2 programs a token)


@triton.jit
def store_out(out_ptr, stride_ot, res_ptr, stride_rt, t, offs, mask, y, RESIDUAL: tl.constexpr):
    """Store fp32 ``y`` (outputs ``offs`` of token ``t``) rounded to the output dtype; with RESIDUAL, the rounded
    value added to the residual's row and rounded again (the decoder layer's ``residual + mlp_out``)."""
    out = y.to(out_ptr.dtype.element_ty)
    if RESIDUAL:
        res = tl.load(res_ptr + t * stride_rt + offs, mask=mask, other=0.0)
        out = (res.to(tl.float32) + out.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_ot + offs, out, mask=mask)


@triton.jit
def _sum_pairs_kernel(part_ptr, stride_pm, res_ptr, stride_rt, out_ptr, stride_ot, H, TOPK,
                      RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_enter(USE_PDL)
    t = tl.program_id(0).to(tl.int64)  # tokens on the first grid axis (up to 2^31 - 1 of them)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < H
    y = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, TOPK):
        y += tl.load(part_ptr + (t * TOPK + k) * stride_pm + offs, mask=mask, other=0.0).to(tl.float32)
    store_out(out_ptr, stride_ot, res_ptr, stride_rt, t, offs, mask, y, RESIDUAL)


@triton.jit
def zero_counters(cnt_ptr, n_cnt, program, ZERO_BLOCK: tl.constexpr):
    """Program ``program``'s share (ZERO_BLOCK of them) of the ``n_cnt`` int32 counters a down launch that sums over K
    itself counts with (``zeroing_args``): the launch before it in the same call zeroes them."""
    offs = program * ZERO_BLOCK + tl.arange(0, ZERO_BLOCK)
    tl.store(cnt_ptr + offs, tl.zeros((ZERO_BLOCK,), tl.int32), mask=offs < n_cnt)


def sum_counters(T: int, H: int, block_n: int, device) -> torch.Tensor:
    """The int32 counters of a down launch that sums over K itself: one per (token, column tile of ``block_n``); any
    contents (the gate_up launch of the same call zeroes them, ``zero_counters``)."""
    return torch.empty(max(T * triton.cdiv(H, block_n), 1), dtype=torch.int32, device=device)


def sum_args(counters: torch.Tensor, out_TH: torch.Tensor, residual_TH: torch.Tensor | None, K: int) -> dict:
    """The launch arguments of a down kernel that sums over K itself into ``out_TH`` (its ``cnt_ptr``, ``final_ptr``,
    ``stride_ft``, ``res_ptr``, ``stride_rt``, ``TOPK``, ``SUM_K``, ``RESIDUAL``), as ``sum_pairs(terms, K, out_TH,
    residual_TH)`` would write it; ``counters`` from ``sum_counters``."""
    res = out_TH if residual_TH is None else residual_TH  # never read without RESIDUAL
    return {"cnt_ptr": counters, "final_ptr": out_TH, "stride_ft": out_TH.stride(0), "res_ptr": res,
            "stride_rt": res.stride(0), "TOPK": K, "SUM_K": True, "RESIDUAL": residual_TH is not None}


def zeroing_args(counters: torch.Tensor, programs: int) -> dict:
    """The launch arguments of ``zero_counters`` for a kernel of ``programs`` programs that zeroes ``counters``."""
    return {"cnt_ptr": counters, "n_cnt": counters.numel(),
            "ZERO_BLOCK": max(16, triton.next_power_of_2(triton.cdiv(counters.numel(), programs)))}


def check_residual(residual_TH: torch.Tensor | None, T: int, H: int, out_dtype: torch.dtype,
                   device: torch.device) -> torch.Tensor | None:
    """``residual_TH`` as the kernels read it (rows with a unit column stride), or a ValueError naming what is
    wrong; None stays None."""
    if residual_TH is None:
        return None
    if not isinstance(residual_TH, torch.Tensor) or residual_TH.shape != (T, H):
        raise ValueError(f"residual_TH must be [T={T}, H={H}], got {tuple(getattr(residual_TH, 'shape', ()))}")
    if residual_TH.dtype != out_dtype or residual_TH.device != device:
        raise ValueError(f"residual_TH is {residual_TH.dtype} on {residual_TH.device}; the output is {out_dtype} "
                         f"on {device} (the residual add runs in the output's dtype)")
    return residual_TH if residual_TH.stride(1) == 1 else residual_TH.contiguous()


def no_pairs(T: int, H: int, out_dtype: torch.dtype, device, residual_TH: torch.Tensor | None) -> torch.Tensor:
    """The result of an MoE call that routed no pair: zeros, or the residual plus zeros (a new tensor)."""
    zeros = torch.zeros((T, H), dtype=out_dtype, device=device)
    return zeros if residual_TH is None else residual_TH + zeros


def sum_pairs(part_MH: torch.Tensor, topk: int, out_TH: torch.Tensor, residual_TH: torch.Tensor | None = None
              ) -> torch.Tensor:
    """``out_TH[t] = [residual[t] +] sum_k part_MH[t*K + k]`` with the module docstring's roundings (enqueue
    only); ``part_MH`` any float dtype, rows with a unit column stride; ``residual_TH`` as ``check_residual``
    returns it. Returns ``out_TH``."""
    T, H = out_TH.shape
    if T == 0 or H == 0:
        return out_TH
    res = out_TH if residual_TH is None else residual_TH  # never read without RESIDUAL
    with device_guard(out_TH.device):
        _sum_pairs_kernel[(T, triton.cdiv(H, SUM_BLOCK))](part_MH, part_MH.stride(0), res, res.stride(0),
                                                          out_TH, out_TH.stride(0), H, topk,
                                                          RESIDUAL=residual_TH is not None, BLOCK=SUM_BLOCK,
                                                          num_warps=4, **pdl.launch_kwargs())
    return out_TH
