"""Rotary position embedding of q and k in one Triton kernel, with the rounding steps of transformers'
``apply_rotary_pos_emb`` (``q * cos + rotate_half(q) * sin``, each product and the sum rounded to the
activation dtype).

Legend: B batch, Hq/Hk query/key heads, T tokens, D head dim (even; rotate_half swaps its halves).

In module form the two tensors take ~10 kernels (neg, cat, two muls and an add each); this is one
launch over every (b, head, t) row of q and one of k. Outputs are new contiguous ``[B, H, T, D]`` tensors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, H, T, sxb, sxh, sxt, scb, sct,
                       HALF: tl.constexpr, BLOCK: tl.constexpr):
        r = tl.program_id(0)  # row (b, h, t) of the output, contiguous [B, H, T, D]
        t = r % T
        h = (r // T) % H
        b = r // (T * H)
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        xb = x_ptr + b * sxb + h * sxh + t * sxt
        cb = b * scb + t * sct
        x1 = tl.load(xb + offs, mask=mask, other=0.0)
        x2 = tl.load(xb + HALF + offs, mask=mask, other=0.0)
        c1 = tl.load(cos_ptr + cb + offs, mask=mask, other=0.0)
        c2 = tl.load(cos_ptr + cb + HALF + offs, mask=mask, other=0.0)
        s1 = tl.load(sin_ptr + cb + offs, mask=mask, other=0.0)
        s2 = tl.load(sin_ptr + cb + HALF + offs, mask=mask, other=0.0)
        dt = out_ptr.dtype.element_ty
        f = tl.float32
        o1 = ((x1.to(f) * c1.to(f)).to(dt).to(f) + (-x2.to(f) * s1.to(f)).to(dt).to(f)).to(dt)
        o2 = ((x2.to(f) * c2.to(f)).to(dt).to(f) + (x1.to(f) * s2.to(f)).to(dt).to(f)).to(dt)
        ob = out_ptr + r * (2 * HALF)
        tl.store(ob + offs, o1, mask=mask)
        tl.store(ob + HALF + offs, o2, mask=mask)


def _rotate(x_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor) -> torch.Tensor:
    B, H, T, D = x_BHTD.shape
    out = torch.empty((B, H, T, D), dtype=x_BHTD.dtype, device=x_BHTD.device)
    if out.numel() == 0:
        return out
    if x_BHTD.stride(-1) != 1:
        x_BHTD = x_BHTD.contiguous()
    half = D // 2
    _rotary_kernel[(B * H * T,)](x_BHTD, cos_BTD, sin_BTD, out, H, T, x_BHTD.stride(0), x_BHTD.stride(1),
                                 x_BHTD.stride(2), cos_BTD.stride(0), cos_BTD.stride(1),
                                 HALF=half, BLOCK=triton.next_power_of_2(half), num_warps=1)
    return out


def apply_rotary(q_BHTD: torch.Tensor, k_BHTD: torch.Tensor, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor):
    """``(q_embed, k_embed)`` as transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (unsqueeze_dim 1)."""
    for name, t in (("q", q_BHTD), ("k", k_BHTD)):
        if t.dim() != 4 or t.shape[-1] % 2:
            raise ValueError(f"{name} must be [B, H, T, D] with an even D, got {tuple(t.shape)}")
    B, _, T, D = q_BHTD.shape
    if cos_BTD.shape != (B, T, D) or sin_BTD.shape != (B, T, D):
        if cos_BTD.dim() == 3 and cos_BTD.shape[0] == 1 and cos_BTD.shape[1:] == (T, D):
            cos_BTD, sin_BTD = cos_BTD.expand(B, T, D), sin_BTD.expand(B, T, D)
        else:
            raise ValueError(f"cos/sin must be [B={B}, T={T}, D={D}], got {tuple(cos_BTD.shape)}")
    if cos_BTD.stride(-1) != 1 or cos_BTD.stride() != sin_BTD.stride():
        cos_BTD, sin_BTD = cos_BTD.contiguous(), sin_BTD.contiguous()
    from moe_offload.kernels.nvfp4 import device_guard

    with device_guard(q_BHTD.device):
        return _rotate(q_BHTD, cos_BTD, sin_BTD), _rotate(k_BHTD, cos_BTD, sin_BTD)


def apply_rotary_reference(q, k, cos, sin):
    """transformers' arithmetic (unsqueeze_dim 1), in torch."""
    def rot(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (q * cos) + (rot(q) * sin), (k * cos) + (rot(k) * sin)
