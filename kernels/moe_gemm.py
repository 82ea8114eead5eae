"""Grouped expert GEMM over bank rows, without host syncs: dequantize a chunk of rows, run
``grouped_mm`` (torch's CPU and CUDA kernels) on the tokens routed to that chunk, scatter back.

Legend: T tokens, K top-k, P = T*K routed pairs, N bank rows (experts in staging, or compact
slots in decode), C rows per chunk, H hidden, I intermediate (per rank), F = 2I.

Peak extra memory of one call: C dequantized experts (C * (F*H + H*I) * 2 bytes in bf16) plus the
activations of all pairs: P * (H + F + I + H) elements, plus two fp32 [P, H] buffers for the
deterministic combine (no float atomics: the same input gives the same bits on every run). The engine sizes C from
``prefill.dequant_chunk_bytes`` (default 2 GiB): a whole Qwen3-30B-A3B layer (128 x 9.4 MB = 1.2 GB)
in one chunk, a Flash-Next layer (512 x 9.8 MB) in three; at T = 1024 the activations add ~56 MB.

Chunking without a sync: ``grouped_mm`` only computes rows below ``offs[-1]``. For chunk c the
sorted pairs are rotated on device so the chunk's first pair is row 0; rows past the chunk's
pair count are masked out of the scatter (their contents are undefined).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def has_grouped_mm() -> bool:
    return _grouped_mm is not None


def swiglu(gate_up_PF: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up_PF.chunk(2, dim=-1)
    return F.silu(gate) * up


def _grouped(x_PH: torch.Tensor, w_CNK: torch.Tensor, offs_C: torch.Tensor) -> torch.Tensor:
    """x [P, K] @ w[g].T for the groups given by cumulative ends ``offs_C``."""
    if _grouped_mm is not None and (x_PH.device.type == "cpu" or x_PH.dtype == torch.bfloat16):
        return _grouped_mm(x_PH, w_CNK.transpose(-2, -1), offs=offs_C)
    # CUDA grouped_mm is bf16-only; fp32/fp16 on CUDA (a debugging configuration) and very old
    # torch take a per-group loop, which reads the offsets on the host (one sync per call).
    out = x_PH.new_zeros(x_PH.shape[0], w_CNK.shape[1])
    start = 0
    for g, end in enumerate(offs_C.tolist()):
        if end > start:
            out[start:end] = x_PH[start:end] @ w_CNK[g].T
        start = end
    return out


def moe_grouped(
    hidden_TH: torch.Tensor,
    rows_TK: torch.Tensor,
    weights_TK: torch.Tensor,
    num_rows: int,
    dequant_rows: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]],
    chunk_rows: int,
    compute_dtype: torch.dtype,
) -> torch.Tensor:
    """SwiGLU MoE: ``out[t] = sum_k w[t,k] * down_r (silu(gate_r x_t) * up_r x_t)`` with r = rows[t,k].

    ``dequant_rows(r0, r1)`` returns ``(gate_up [r1-r0, F, H], down [r1-r0, H, I])`` in
    ``compute_dtype``. No host sync: the number of chunks is ``ceil(num_rows / chunk_rows)``.
    """
    T, K = rows_TK.shape
    P = T * K
    if P == 0:
        return torch.zeros_like(hidden_TH)
    flat_P = rows_TK.reshape(-1).long()
    sorted_rows_P, order_P = torch.sort(flat_P, stable=True)
    tok_P = order_P // K
    w_P = weights_TK.reshape(-1)[order_P].float()
    x_PH = hidden_TH.to(compute_dtype)[tok_P]
    # scatter_add, not bincount: CUDA bincount reads the max id on the host (a device sync)
    counts_N = torch.zeros(num_rows, dtype=torch.long, device=flat_P.device).scatter_add_(
        0, sorted_rows_P, torch.ones_like(sorted_rows_P))
    ends_N = torch.cumsum(counts_N, 0)
    if chunk_rows >= num_rows:  # one chunk: every pair is in it, no rotation and no mask
        w13, w2 = dequant_rows(0, num_rows)
        offs_N = ends_N.to(torch.int32)
        h_PF = _grouped(x_PH, w13, offs_N)
        y_PH = _grouped(swiglu(h_PF), w2, offs_N).float() * w_P[:, None]
        return _combine(y_PH, order_P, T, K, hidden_TH.dtype)
    arange_P = torch.arange(P, device=hidden_TH.device)
    ysorted_PH = torch.zeros(P, hidden_TH.shape[1], dtype=torch.float32, device=hidden_TH.device)
    for r0 in range(0, num_rows, chunk_rows):
        r1 = min(r0 + chunk_rows, num_rows)
        start = ends_N[r0 - 1] if r0 > 0 else ends_N.new_zeros(())
        offs_C = (ends_N[r0:r1] - start).to(torch.int32)
        if r0 == 0:
            idx_P = arange_P
        else:
            idx_P = (arange_P + start) % P
        w13, w2 = dequant_rows(r0, r1)
        h_PF = _grouped(x_PH[idx_P] if r0 else x_PH, w13, offs_C)
        y_PH = _grouped(swiglu(h_PF), w2, offs_C).float()
        valid_P = arange_P < offs_C[-1]
        # chunk rows hold sorted pairs idx_P; rows past the chunk's pairs keep what is there
        prev_PH = ysorted_PH[idx_P]
        ysorted_PH[idx_P] = torch.where(valid_P[:, None], y_PH * w_P[idx_P][:, None], prev_PH)
    return _combine(ysorted_PH, order_P, T, K, hidden_TH.dtype)


def _combine(ysorted_PH: torch.Tensor, order_P: torch.Tensor, T: int, K: int, dtype: torch.dtype) -> torch.Tensor:
    """Weighted pair outputs in sorted order -> ``out[t] = sum_k y[t, k]``, deterministically: each
    pair goes back to its (token, k) row (a permutation: no atomics), then a fixed-order sum over K.
    (``index_add_`` with float atomics made logits differ run to run in the last bf16 bit.)"""
    y_PH = torch.empty_like(ysorted_PH)
    y_PH[order_P] = ysorted_PH
    return y_PH.view(T, K, -1).sum(1).to(dtype)
