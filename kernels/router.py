"""MoE router tail in one Triton kernel: softmax over the experts, top-k, optional renormalization.

Legend: T tokens, E experts, K top-k (EP = next power of two of E).

    probs_TE = softmax(logits_TE.float())          # fp32 statistics
    w_TK, ids_TK = topk(probs_TE, K)               # largest first
    w_TK /= w_TK.sum(-1)                           # when ``renorm``
    w_TK = w_TK.to(out_dtype)

In module form (transformers' Qwen3-MoE / Qwen3-Next / Mixtral routers) this is ~7 kernels per layer
(cast, softmax, top-k radix select, a sort of the k values, sum, divide, cast), ~15 us of a decode
step's layer on an H200; here one program per token does it in registers (K passes of max + argmax).
Ties pick the lowest expert index (torch.topk leaves their order unspecified); the k values come out
largest first, as ``torch.topk(sorted=True)`` gives them. The fp32 sums run in another order than
torch's, so a weight may differ from the module's in the last bit of ``out_dtype``.
"""

from __future__ import annotations

import torch

try:  # importing triton touches no CUDA
    import triton
    import triton.language as tl
    from moe_offload.kernels import pdl
    from moe_offload.kernels.pdl import pdl_enter
except ImportError:
    triton = None

MAX_EXPERTS = 4096

if triton is not None:

    @triton.jit
    def topk_row(logits_ptr, stride_t, w_ptr, ids_ptr, t, E, K, RENORM: tl.constexpr, EP: tl.constexpr,
                 KP: tl.constexpr):
        """Row ``t`` (int64) of ``_router_topk_kernel``: its K weights and ids (also the first phase of
        ``decode_route._route_plan_kernel``)."""
        offs = tl.arange(0, EP)
        x = tl.load(logits_ptr + t * stride_t + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        p = e / tl.sum(e, axis=0)
        p = tl.where(offs < E, p, -1.0)  # padding never wins
        offs_k = tl.arange(0, KP)
        vals = tl.zeros((KP,), dtype=tl.float32)
        idx = tl.zeros((KP,), dtype=tl.int64)
        for k in range(0, K):
            m = tl.max(p, axis=0)
            i = tl.min(tl.where(p == m, offs, EP), axis=0)  # lowest index among equal maxima
            vals = tl.where(offs_k == k, m, vals)
            idx = tl.where(offs_k == k, i.to(tl.int64), idx)
            p = tl.where(offs == i, -2.0, p)
        if RENORM:
            vals = vals / tl.sum(tl.where(offs_k < K, vals, 0.0), axis=0)
        tl.store(w_ptr + t * K + offs_k, vals.to(w_ptr.dtype.element_ty), mask=offs_k < K)
        tl.store(ids_ptr + t * K + offs_k, idx, mask=offs_k < K)

    @triton.jit
    def _router_topk_kernel(logits_ptr, stride_t, w_ptr, ids_ptr, E, K,
                            RENORM: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_enter(USE_PDL)
        topk_row(logits_ptr, stride_t, w_ptr, ids_ptr, tl.program_id(0).to(tl.int64), E, K, RENORM, EP, KP)


def router_topk(logits_TE: torch.Tensor, k: int, renorm: bool, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits_TE [T, E]`` -> (weights ``[T, K]`` in ``out_dtype``, expert ids ``[T, K]`` int64); see
    the module docstring."""
    logits_TE, w_TK, ids_TK = router_outputs(logits_TE, k, out_dtype)
    T, E = logits_TE.shape
    if T == 0:
        return w_TK, ids_TK
    from moe_offload.kernels.nvfp4 import device_guard

    with device_guard(logits_TE.device):
        _router_topk_kernel[(T,)](logits_TE, logits_TE.stride(0), w_TK, ids_TK, E, k, RENORM=renorm,
                                  **topk_launch(E, k), **pdl.launch_kwargs())
    return w_TK, ids_TK


def router_outputs(logits_TE: torch.Tensor, k: int, out_dtype: torch.dtype):
    """``(logits_TE with contiguous rows, w_TK, ids_TK)``: the checked input and the empty outputs of ``router_topk``."""
    if triton is None:
        raise RuntimeError("router_topk needs triton (pip install triton)")
    if logits_TE.dim() != 2 or not logits_TE.is_floating_point():
        raise ValueError(f"logits must be a floating [T, E] tensor, got {tuple(logits_TE.shape)} {logits_TE.dtype}")
    T, E = logits_TE.shape
    if not 1 <= k <= E or E > MAX_EXPERTS:
        raise ValueError(f"top-k={k} of E={E} experts: need 1 <= k <= E <= {MAX_EXPERTS}")
    if logits_TE.stride(1) != 1:
        logits_TE = logits_TE.contiguous()
    return (logits_TE, torch.empty((T, k), dtype=out_dtype, device=logits_TE.device),
            torch.empty((T, k), dtype=torch.int64, device=logits_TE.device))


def topk_launch(E: int, k: int) -> dict:
    """The constexprs and warps of a launch of ``topk_row`` (the warps set the order of the fp32 sums, so every kernel
    that runs it uses these)."""
    EP = triton.next_power_of_2(E)
    return {"EP": EP, "KP": triton.next_power_of_2(k), "num_warps": 1 if EP <= 256 else 4}


def router_topk_reference(logits_TE: torch.Tensor, k: int, renorm: bool, out_dtype: torch.dtype):
    """The transformers routers' arithmetic, in torch."""
    probs = torch.softmax(logits_TE.float(), dim=-1)
    w, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        w = w / w.sum(dim=-1, keepdim=True)
    return w.to(out_dtype), ids
