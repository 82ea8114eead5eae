"""Rotary position embedding of q and k in one Triton kernel, with the rounding steps of transformers'
``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, each product and the sum rounded to the
activation dtype).

Legend: B batch, Hq/Hk query/key heads, T tokens, D head dim (even; rotate_half swaps its halves).

In module form the two tensors take ~10 kernels (neg, cat, two muls and an add each); this is one
launch over every (b, head, t) row of q and of k. Outputs are new contiguous ``[B, H, T, D]`` tensors.

Compiled with ``enable_fp_fusion=False``: with it on, Triton turns the rounded products into bf16 and fuses the
first product with the sum into one ``fma.rn.bf16``, skipping that product's rounding; on the H200 this
flipped the last bit of some outputs against the module (sm_90 PTX: ``fma.rn.bf16`` with fusion,
``mul.rn.bf16`` + ``add.rn.bf16``/``sub.rn.bf16`` without; the bf16 add of two bf16 products rounds as the
module's fp32 add then bf16 cast does).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
    from moe_offload.kernels import pdl
    from moe_offload.kernels.pdl import pdl_enter
except ImportError:
    triton = None

#: the launch's compile options (see the module docstring for why fusion is off)
LAUNCH_OPTIONS = {"num_warps": 1, "enable_fp_fusion": False}

if triton is not None:

    @triton.jit
    def rotate_store(x1, x2, cb, sb, ob, offs, mask, HALF: tl.constexpr):
        """Store ``x * cos + rotate_half(x) * sin`` of a row's halves ``x1``/``x2`` (lanes ``offs``, in the output's
        dtype) at ``ob``, with the module's roundings; ``cb``/``sb``: the row's cos and sin."""
        c1 = tl.load(cb + offs, mask=mask, other=0.0)
        c2 = tl.load(cb + HALF + offs, mask=mask, other=0.0)
        s1 = tl.load(sb + offs, mask=mask, other=0.0)
        s2 = tl.load(sb + HALF + offs, mask=mask, other=0.0)
        dt = ob.dtype.element_ty
        f = tl.float32
        o1 = ((x1.to(f) * c1.to(f)).to(dt).to(f) + (-x2.to(f) * s1.to(f)).to(dt).to(f)).to(dt)
        o2 = ((x2.to(f) * c2.to(f)).to(dt).to(f) + (x1.to(f) * s2.to(f)).to(dt).to(f)).to(dt)
        tl.store(ob + offs, o1, mask=mask)
        tl.store(ob + HALF + offs, o2, mask=mask)

    @triton.jit
    def _rotate_row(xb, cb, sb, ob, HALF: tl.constexpr, BLOCK: tl.constexpr):
        """One row of D = 2 * HALF: ``x * cos + rotate_half(x) * sin`` with the module's roundings."""
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        rotate_store(tl.load(xb + offs, mask=mask, other=0.0), tl.load(xb + HALF + offs, mask=mask, other=0.0),
                     cb, sb, ob, offs, mask, HALF)

    @triton.jit
    def _rotary_kernel(q_ptr, k_ptr, cos_ptr, sin_ptr, qo_ptr, ko_ptr, Hq, Hk, T,
                       sqb, sqh, sqt, skb, skh, skt, scb, sct,
                       HALF: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_enter(USE_PDL)
        r = tl.program_id(0).to(tl.int64)  # rows (b, h, t) of q's output (contiguous [B, Hq, T, D]), then of k's
        rows_q = tl.num_programs(0).to(tl.int64) // (Hq + Hk) * Hq  # B * T * Hq
        is_q = r < rows_q
        rr = tl.where(is_q, r, r - rows_q)  # the row within its own tensor
        H = tl.where(is_q, Hq, Hk)
        t = rr % T
        h = (rr // T) % H
        b = rr // (T * H)
        cb = b * scb + t * sct
        if is_q:
            _rotate_row(q_ptr + b * sqb + h * sqh + t * sqt, cos_ptr + cb, sin_ptr + cb, qo_ptr + rr * (2 * HALF),
                        HALF, BLOCK)
        else:
            _rotate_row(k_ptr + b * skb + h * skh + t * skt, cos_ptr + cb, sin_ptr + cb, ko_ptr + rr * (2 * HALF),
                        HALF, BLOCK)


def apply_rotary(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor):
    """``(q_embed, k_embed)`` as transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (unsqueeze_dim 1):
    one launch for both."""
    for name, t in (("q", q_BHTD), ("k", k_BHTD)):
        if t.dim() != 4 or t.shape[-1] % 2:
            raise ValueError(f"{name} must be [B, H, T, D] with an even D, got {tuple(t.shape)}")
    B, Hq, T, D = q_BHTD.shape
    if k_BHTD.shape[0] != B or k_BHTD.shape[2] != T or k_BHTD.shape[3] != D:
        raise ValueError(f"k {tuple(k_BHTD.shape)} does not match q {tuple(q_BHTD.shape)} in B, T, D")
    Hk = k_BHTD.shape[1]
    if cos_BTD.shape != (B, T, D) or sin_BTD.shape != (B, T, D):
        if cos_BTD.dim() == 3 and cos_BTD.shape[0] == 1 and cos_BTD.shape[1:] == (T, D):
            cos_BTD, sin_BTD = cos_BTD.expand(B, T, D), sin_BTD.expand(B, T, D)
        else:
            raise ValueError(f"cos/sin must be [B={B}, T={T}, D={D}], got {tuple(cos_BTD.shape)}")
    if cos_BTD.stride(-1) != 1 or cos_BTD.stride() != sin_BTD.stride():
        cos_BTD, sin_BTD = cos_BTD.contiguous(), sin_BTD.contiguous()
    q, k = (t if t.stride(-1) == 1 else t.contiguous() for t in (q_BHTD, k_BHTD))
    q_out = torch.empty((B, Hq, T, D), dtype=q.dtype, device=q.device)
    k_out = torch.empty((B, Hk, T, D), dtype=k.dtype, device=k.device)
    if B * T * (Hq + Hk) == 0:
        return q_out, k_out
    from moe_offload.kernels.nvfp4 import device_guard

    half = D // 2
    with device_guard(q.device):
        _rotary_kernel[(B * T * (Hq + Hk),)](q, k, cos_BTD, sin_BTD, q_out, k_out, Hq, Hk, T,
                                             q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1),
                                             k.stride(2), cos_BTD.stride(0), cos_BTD.stride(1),
                                             HALF=half, BLOCK=triton.next_power_of_2(half), **LAUNCH_OPTIONS,
                                             **pdl.launch_kwargs())
    return q_out, k_out


def apply_rotary_reference(q, k, cos, sin):
    """transformers' arithmetic (unsqueeze_dim 1), in torch."""
    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rot(q) * sin), (k * cos) + (rot(k) * sin)
