"""RMSNorm in one Triton kernel, with the exact rounding steps of the transformers modules it replaces.

Legend: N rows (tokens), H hidden (the normalized dim).

Two flavours, as the model families define them:
- ``scale="weight"`` (Qwen3-MoE, Mixtral): ``w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``;
- ``scale="one_plus_weight"`` (Qwen3-Next): ``(x * rsqrt(mean(x^2) + eps) * (1 + w)).to(x.dtype)``;
statistics in fp32. In a decode step the module form is ~6 kernels per norm (cast, pow, mean, add+rsqrt,
mul, cast, mul) and a Qwen3-MoE layer has four norms; this is one. The fp32 sum runs in another order
than torch's mean, so outputs may differ from the module in the last bit of the stored dtype.

``add_rms_norm``: a decoder layer's ``h = residual + x`` (rounded to the dtype, as the layer's add) and the norm
of ``h`` in one launch, both written (``h`` stays the residual stream): one launch instead of two per use.
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

SCALES = ("weight", "one_plus_weight")
#: compile options of every launch here: FP fusion off, as in kernels/rotary.py, so that kernels/qk_norm_rope.py
#: (which must be compiled without it) reproduces the statistic bit for bit; 4 warps up to 4096 columns
LAUNCH_OPTIONS = {"enable_fp_fusion": False}

if triton is not None:

    @triton.jit
    def inverse_rms(xf, H, eps):
        """``1 / sqrt(mean(x^2) + eps)`` of an fp32 row vector (``H`` the real length; masked lanes hold 0). Every
        kernel that must match this file's norms bit for bit computes it here, over the same vector layout
        (``next_power_of_2(H)`` lanes, the same warps)."""
        return 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / H + eps)

    @triton.jit
    def normalized(xf, inv, w, ONE_PLUS: tl.constexpr, dt: tl.constexpr):
        """The normalized row in ``dt`` with the modules' roundings (module docstring), from fp32 ``xf``."""
        if ONE_PLUS:
            return (xf * inv * (1.0 + w.to(tl.float32))).to(dt)
        return (w.to(tl.float32) * (xf * inv).to(dt).to(tl.float32)).to(dt)

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, x_stride, inner_n, inner_stride, out_stride, eps,
                         ONE_PLUS: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
        pdl_enter(USE_PDL)
        row = tl.program_id(0)  # input row (row // inner_n, row % inner_n) of x viewed as [R, inner_n, H]
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x_row = x_ptr + (row // inner_n).to(tl.int64) * x_stride + (row % inner_n).to(tl.int64) * inner_stride
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        y = normalized(x, inverse_rms(x, H, eps), tl.load(w_ptr + offs, mask=mask, other=0.0), ONE_PLUS,
                        out_ptr.dtype.element_ty)
        tl.store(out_ptr + row.to(tl.int64) * out_stride + offs, y, mask=mask)


    @triton.jit
    def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, h_ptr, out_ptr, split_ptr, H, x_stride, r_stride, eps,
                             ONE_PLUS: tl.constexpr, BLOCK: tl.constexpr, SPLIT_K: tl.constexpr,
                             USE_PDL: tl.constexpr = False):
        """SPLIT_K > 0: the normalized row is also stored at ``split_ptr`` in ``fused_moe_swap.split_columns``'
        layout for chunks of SPLIT_K columns (H a multiple of SPLIT_K): each chunk's even columns, then its odd."""
        pdl_enter(USE_PDL)
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        mask = offs < H
        x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
        r = tl.load(r_ptr + row * r_stride + offs, mask=mask, other=0.0)
        h = (r.to(tl.float32) + x.to(tl.float32)).to(h_ptr.dtype.element_ty)  # the layer's ``residual + x``
        tl.store(h_ptr + row * H + offs, h, mask=mask)
        hf = h.to(tl.float32)
        y = normalized(hf, inverse_rms(hf, H, eps), tl.load(w_ptr + offs, mask=mask, other=0.0), ONE_PLUS,
                        out_ptr.dtype.element_ty)
        tl.store(out_ptr + row * H + offs, y, mask=mask)
        if SPLIT_K > 0:
            j = offs % SPLIT_K
            tl.store(split_ptr + row * H + offs - j + (j % 2) * (SPLIT_K // 2) + j // 2, y, mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, scale: str) -> int:
    """H of a valid norm call, or a ValueError naming what is wrong."""
    if scale not in SCALES:
        raise ValueError(f"scale={scale!r}; accepted: {SCALES}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() < 1:
        raise ValueError(f"x must be a floating tensor [..., H], got {getattr(x, 'dtype', type(x).__name__)}")
    H = x.shape[-1]
    if weight.dim() != 1 or weight.shape[0] != H:
        raise ValueError(f"weight must be [H={H}], got {tuple(weight.shape)}")
    if weight.device != x.device:
        raise ValueError(f"weight on {weight.device}, x on {x.device}")
    if H > 65536:
        raise ValueError(f"H={H} exceeds one program's row (65536); use the module's forward")
    return H


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 scale: str = "weight") -> tuple[torch.Tensor, torch.Tensor]:
    """``(h, rms_norm(h))`` with ``h = residual + x`` rounded to ``x.dtype``, in one launch: a decoder layer's
    residual add and the next norm (``h`` is the new residual stream). Same bits as the add followed by
    ``rms_norm``. ``x`` and ``residual``: the same shape ``[..., H]`` and dtype."""
    h, out, _ = add_rms_norm_split(x, residual, weight, eps, scale)
    return h, out


def add_rms_norm_split(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                       scale: str = "weight", split_k: int | None = None):
    """``(h, normed, normed_split)``: ``add_rms_norm``, and with ``split_k`` (H a multiple of it) the normed rows also
    in ``fused_moe_swap.split_columns(normed_rows, split_k)``'s layout (``[rows, H]``; the swapped MoE kernels'
    activations), written by the same launch, bit for bit what that copy gives; else ``normed_split`` is None."""
    H = _check(x, weight, scale)
    if split_k is not None and (split_k < 2 or split_k & (split_k - 1) or H % split_k):
        raise ValueError(f"split_k={split_k}: must be a power of two >= 2 that divides H={H}")
    if residual.shape != x.shape or residual.dtype != x.dtype or residual.device != x.device:
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} on {residual.device} must match x "
                         f"{tuple(x.shape)} {x.dtype} on {x.device}")
    h = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    split = None if split_k is None else torch.empty((x.numel() // max(H, 1), H), dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return h, out, split
    x2, r2 = (_rows(t, H) for t in (x, residual))
    from moe_offload.kernels.nvfp4 import device_guard

    block = triton.next_power_of_2(H)
    with device_guard(x.device):
        _add_rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, h, out, out if split is None else split, H, x2.stride(0),
                                             r2.stride(0), float(eps), ONE_PLUS=scale == "one_plus_weight",
                                             BLOCK=block, SPLIT_K=split_k or 0, num_warps=num_warps(block),
                                             **LAUNCH_OPTIONS, **pdl.launch_kwargs())
    return h, out, split


def num_warps(block: int) -> int:
    """Warps of a norm program over ``block`` lanes (part of the statistic's reduction order)."""
    return 4 if block <= 4096 else 8


def _rows(t: torch.Tensor, H: int) -> torch.Tensor:
    """``t`` as ``[rows, H]`` with a unit column stride (a view where one exists, else a copy)."""
    t3 = _rows_view(t, 1, H)
    return t.reshape(-1, H).contiguous() if t3 is None else t3[:, 0]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: str = "weight") -> torch.Tensor:
    """``x [..., H]`` normalized over H -> same shape and dtype as ``x`` (see the module docstring).

    ``weight`` ``[H]``; its dtype is the model's (the product with the weight is rounded to ``x.dtype``,
    as the modules do when weight and activations share a dtype)."""
    H = _check(x, weight, scale)
    # rows read in place through two strides where x views as [R, n, H] with contiguous H: e.g. the heads of a
    # q or k slice of a fused q/k/v GEMM output (fused_qkv), which ``reshape(-1, H)`` would copy (one more launch)
    if x.numel() == 0:
        return torch.empty_like(x)
    n = x.shape[-2] if x.dim() >= 2 else 1
    x3 = _rows_view(x, n, H)
    if x3 is None:
        n, x3 = 1, x.reshape(-1, 1, H).contiguous()
    rows = x3.shape[0] * n
    out = torch.empty((rows, H), dtype=x.dtype, device=x.device)
    from moe_offload.kernels.nvfp4 import device_guard

    block = triton.next_power_of_2(H)
    with device_guard(x.device):
        _rms_norm_kernel[(rows,)](x3, weight, out, H, x3.stride(0), n, x3.stride(1), out.stride(0), float(eps),
                                  ONE_PLUS=scale == "one_plus_weight", BLOCK=block,
                                  num_warps=num_warps(block), **LAUNCH_OPTIONS, **pdl.launch_kwargs())
    return out.view(x.shape)


def _rows_view(x: torch.Tensor, n: int, H: int) -> torch.Tensor | None:
    """``x`` as ``[R, n, H]`` without a copy, with a contiguous last dim; None where no such view exists."""
    try:
        x3 = x.view(-1, n, H)
    except RuntimeError:  # leading dims that do not merge: the caller copies
        return None
    return x3 if x3.stride(-1) == 1 or H == 1 else None


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float, scale: str = "weight") -> torch.Tensor:
    """The transformers modules' arithmetic, in torch."""
    xf = x.to(torch.float32)
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if scale == "one_plus_weight":
        return (normed * (1.0 + weight.float())).to(x.dtype)
    return weight * normed.to(x.dtype)
