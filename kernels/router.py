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
                 KP: tl.constexpr, VOLATILE: tl.constexpr = False):
        """Row ``t`` (int64) of ``_router_topk_kernel``: its K weights and ids (also the first phase of
        ``decode_route._route_plan_kernel``, and ``_router_gemm_topk_kernel``'s last phase, which reads logits other
        programs stored: ``VOLATILE`` loads past L1)."""
        offs = tl.arange(0, EP)
        x = tl.load(logits_ptr + t * stride_t + offs, mask=offs < E, other=float("-inf"),
                    volatile=VOLATILE).to(tl.float32)
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

    @triton.jit
    def _router_gemm_topk_kernel(x_ptr, stride_xt, r_ptr, stride_re, logits_ptr, stride_lt, w_ptr, ids_ptr, cnt_ptr,
                                 T, H, E, K, RENORM: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr,
                                 INPUT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr = False):
        """Program (e, t): the logits of tokens [t*BLOCK_T, +BLOCK_T) for experts [e*BLOCK_E, +BLOCK_E) (fp32 sums
        over H, stored in the logits' dtype as ``F.linear`` stores them); then the program that stores its token
        block's last expert block (an acq_rel counter per token block, as ``fused_moe_swap._sum_finished_tokens``
        counts) runs ``topk_row`` on those rows and sets the counter back to 0 for the next launch or replay."""
        pdl_enter(USE_PDL)
        pid_e = tl.program_id(0)
        pid_t = tl.program_id(1)
        offs_t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
        offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        offs_h = tl.arange(0, BLOCK_H)
        valid_t = offs_t < T
        valid_e = offs_e < E
        x_ptrs = x_ptr + offs_t.to(tl.int64)[:, None] * stride_xt + offs_h[None, :]
        r_ptrs = r_ptr + offs_e.to(tl.int64)[:, None] * stride_re + offs_h[None, :]
        acc = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
        for h0 in range(0, H, BLOCK_H):
            in_h = (h0 + offs_h) < H
            x = tl.load(x_ptrs + h0, mask=valid_t[:, None] & in_h[None, :], other=0.0)
            r = tl.load(r_ptrs + h0, mask=valid_e[:, None] & in_h[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(r), acc, input_precision=INPUT_PRECISION)
        out = logits_ptr + offs_t.to(tl.int64)[:, None] * stride_lt + offs_e[None, :]
        tl.store(out, acc.to(logits_ptr.dtype.element_ty), mask=valid_t[:, None] & valid_e[None, :])
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + pid_t, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            for i in range(0, BLOCK_T):
                t = pid_t * BLOCK_T + i
                if t < T:
                    topk_row(logits_ptr, stride_lt, w_ptr, ids_ptr, t.to(tl.int64), E, K, RENORM, EP, KP, True)
            tl.store(cnt_ptr + pid_t, 0)


#: ``router_gemm_topk``'s tiles: tokens and experts per program (``tl.dot`` needs >= 16 of each), hidden columns per
#: step of the sum; not tuned per GPU yet (``compute.router_gemm_max_tokens`` is off by default until timed)
GEMM_BLOCK_T, GEMM_BLOCK_E, GEMM_BLOCK_H = 16, 16, 256


def router_counters(max_tokens: int, device) -> torch.Tensor:
    """The zeroed int32 counters a ``router_gemm_topk`` launch of up to ``max_tokens`` tokens counts with (one per
    token block); each launch leaves them at 0 again, so one buffer serves every launch and graph replay."""
    return torch.zeros(max(1, -(-max_tokens // GEMM_BLOCK_T)), dtype=torch.int32, device=device)


def router_gemm_topk(x_TH: torch.Tensor, weight_EH: torch.Tensor, k: int, renorm: bool, out_dtype: torch.dtype,
                     counters: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits_TE, w_TK, ids_TK)`` of a router in one launch: ``logits = x @ weight.T`` (fp32 sums, stored in
    ``x``'s dtype, as ``F.linear`` gives them), then ``router_topk``'s softmax, top-k and renormalisation of those
    logits. The sums run in another order than torch's GEMM, so a logit may differ from ``F.linear``'s in its last
    bit (and a near tie then pick the other expert). ``counters``: ``router_counters`` of at least this many tokens."""
    if triton is None:
        raise RuntimeError("router_gemm_topk needs triton (pip install triton)")
    if x_TH.dim() != 2 or weight_EH.dim() != 2 or x_TH.shape[1] != weight_EH.shape[1]:
        raise ValueError(f"router_gemm_topk needs x [T, H] and weight [E, H], got {tuple(x_TH.shape)} and "
                         f"{tuple(weight_EH.shape)}")
    if x_TH.dtype != weight_EH.dtype or not x_TH.is_floating_point():
        raise ValueError(f"x and weight must share one float dtype, got {x_TH.dtype} and {weight_EH.dtype}")
    for name, t in (("x", x_TH), ("weight", weight_EH)):
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"{name} rows must be contiguous (stride(1) == 1), got strides {tuple(t.stride())}")
    T, H = x_TH.shape
    E = weight_EH.shape[0]
    blocks = -(-T // GEMM_BLOCK_T)
    if counters.dtype != torch.int32 or counters.numel() < blocks or counters.device != x_TH.device:
        raise ValueError(f"counters must be router_counters of >= {T} tokens on {x_TH.device} (int32, >= {blocks}), "
                         f"got {counters.dtype} [{counters.numel()}] on {counters.device}")
    logits_TE = torch.empty((T, E), dtype=x_TH.dtype, device=x_TH.device)
    _, w_TK, ids_TK = router_outputs(logits_TE, k, out_dtype)
    if T == 0:
        return logits_TE, w_TK, ids_TK
    from moe_offload.kernels.nvfp4 import device_guard

    launch = topk_launch(E, k)
    with device_guard(x_TH.device):
        _router_gemm_topk_kernel[(triton.cdiv(E, GEMM_BLOCK_E), blocks)](
            x_TH, x_TH.stride(0), weight_EH, weight_EH.stride(0), logits_TE, logits_TE.stride(0), w_TK, ids_TK,
            counters, T, H, E, k, RENORM=renorm, EP=launch["EP"], KP=launch["KP"], BLOCK_T=GEMM_BLOCK_T,
            BLOCK_E=GEMM_BLOCK_E, BLOCK_H=GEMM_BLOCK_H,
            INPUT_PRECISION="ieee" if x_TH.dtype == torch.float32 else "tf32", num_warps=launch["num_warps"],
            **pdl.launch_kwargs())
    return logits_TE, w_TK, ids_TK


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
