"""A Qwen3-MoE attention layer's q/k RMSNorms, rotary embedding and KV-cache write in one launch.

Legend: B batch rows, T new tokens per row, Hq / Hk query / key-value heads, D head dim, N = (Hq + 2 Hk) D the
fused q/k/v GEMM's width (``integrations/fused_qkv.py``), R cache rows (>= B), P cache positions.

From the fused q/k/v output ``y [B, T, N]`` (q heads, then k heads, then v heads):

    q[b, h, t]                  = rope(rms_norm(y[b, t, q head h], q_norm.weight), cos[b, t], sin[b, t])
    keys[b, h, start[b] + t]    = rope(rms_norm(y[b, t, k head h], k_norm.weight), cos[b, t], sin[b, t])
    values[b, h, start[b] + t]  = y[b, t, v head h]

with the arithmetic of ``kernels/rmsnorm.py`` (its statistic over the same vector layout, so the same fp32 sum)
and of ``kernels/rotary.py`` (every product and the sum rounded to the activation dtype), and the write of
``kernels/kv_write.py`` (positions outside [0, P) are not written). Same bits as those three kernels run one
after the other (the tests check it), in one launch instead of four (q norm, k norm, rotary, KV write): in the
H200's batch-16 decode profile those were ~7 us of kernels per layer plus their graph gaps
(``profile-decode-l8-r1.0-b16-82e04c3.json``).

One program per (b, head, t) row of q, then of k (which also copies its v row), with the RMSNorm kernel's warps
for its statistic; compiled without FP fusion, as the rotary kernel must be (``rotary.LAUNCH_OPTIONS``) and as the
RMSNorm kernels are (``rmsnorm.LAUNCH_OPTIONS``), so the three agree.
Grids depend on host-known shapes only (graph-capturable); ``start`` is read at replay time.
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

if triton is not None:
    from moe_offload.kernels.rmsnorm import inverse_rms, normalized
    from moe_offload.kernels.rotary import rotate_store

    @triton.jit
    def _norm_rope_row(src, w_ptr, cb, sb, dst, eps, Dr, D: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                       HALF_BLOCK: tl.constexpr):
        """One head row: rms_norm's statistic over the whole row (its vector layout; ``Dr`` = D as a runtime value,
        as rms_norm divides by it), then the norm (``rmsnorm.normalized``) and the rotation (``rotary.rotate_store``)
        of the two halves in registers: both kernels' own arithmetic."""
        full = tl.arange(0, BLOCK)
        inv = inverse_rms(tl.load(src + full, mask=full < D, other=0.0).to(tl.float32), Dr, eps)
        offs = tl.arange(0, HALF_BLOCK)
        mask = offs < HALF
        dt = dst.dtype.element_ty
        n1 = normalized(tl.load(src + offs, mask=mask, other=0.0).to(tl.float32), inv,
                        tl.load(w_ptr + offs, mask=mask, other=0.0), False, dt)
        n2 = normalized(tl.load(src + HALF + offs, mask=mask, other=0.0).to(tl.float32), inv,
                        tl.load(w_ptr + HALF + offs, mask=mask, other=0.0), False, dt)
        rotate_store(n1, n2, cb, sb, dst, offs, mask, HALF)

    @triton.jit
    def _qk_norm_rope_kernel(y_ptr, syb, syt, qw_ptr, kw_ptr, eps, cos_ptr, sin_ptr, scb, sct, q_ptr,
                             kc_ptr, vc_ptr, skb, skh, skp, svb, svh, svp, start_ptr, stride_start, P, Hq, Hk, T, Dr,
                             D: tl.constexpr, BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr,
                             USE_PDL: tl.constexpr = False):
        pdl_enter(USE_PDL)
        r = tl.program_id(0).to(tl.int64)  # rows (b, h, t) of q (contiguous [B, Hq, T, D]), then of k
        rows_q = tl.num_programs(0).to(tl.int64) // (Hq + Hk) * Hq  # B * T * Hq
        is_q = r < rows_q
        rr = tl.where(is_q, r, r - rows_q)
        H = tl.where(is_q, Hq, Hk)
        t = rr % T
        h = (rr // T) % H
        b = rr // (T * H)
        y_row = y_ptr + b * syb + t * syt
        cb = b * scb + t * sct
        if is_q:
            _norm_rope_row(y_row + h * D, qw_ptr, cos_ptr + cb, sin_ptr + cb, q_ptr + rr * D, eps, Dr, D, D // 2,
                           BLOCK, HALF_BLOCK)
        else:
            pos = tl.load(start_ptr + b * stride_start).to(tl.int64) + t
            if (pos >= 0) & (pos < P):
                _norm_rope_row(y_row + (Hq + h) * D, kw_ptr, cos_ptr + cb, sin_ptr + cb,
                               kc_ptr + b * skb + h * skh + pos * skp, eps, Dr, D, D // 2, BLOCK, HALF_BLOCK)
                offs = tl.arange(0, BLOCK)
                val = tl.load(y_row + (Hq + Hk + h) * D + offs, mask=offs < D)
                tl.store(vc_ptr + b * svb + h * svh + pos * svp + offs, val, mask=offs < D)


def qk_norm_rope_write(y_BTN: torch.Tensor, heads: tuple[int, int], q_weight: torch.Tensor, k_weight: torch.Tensor,
                       eps: float, cos_BTD: torch.Tensor, sin_BTD: torch.Tensor, keys_RHPD: torch.Tensor,
                       values_RHPD: torch.Tensor, start_B: torch.Tensor) -> torch.Tensor:
    """``q [B, Hq, T, D]`` (new, contiguous) from the fused q/k/v output ``y_BTN``, with the keys and values of the
    same tokens written into the cache (see the module docstring). ``heads = (Hq, Hk)``; ``cos_BTD`` /
    ``sin_BTD`` ``[B or 1, T, D]``; ``start_B`` int ``[B]`` (a shared start expanded with stride 0 is fine).
    Raises ValueError on mismatched shapes, dtypes or devices."""
    Hq, Hk = heads
    if y_BTN.dim() != 3:
        raise ValueError(f"y must be [B, T, (Hq + 2 Hk) D], got {tuple(y_BTN.shape)}")
    B, T, N = y_BTN.shape
    R, HC, P, D = keys_RHPD.shape
    if N != (Hq + 2 * Hk) * D or HC != Hk or values_RHPD.shape != keys_RHPD.shape or B > R or D % 2:
        raise ValueError(f"y {tuple(y_BTN.shape)} with (Hq, Hk) = {heads} does not fit caches "
                         f"{tuple(keys_RHPD.shape)} / {tuple(values_RHPD.shape)} (N = (Hq + 2 Hk) D, B <= rows, "
                         f"even D)")
    if q_weight.shape != (D,) or k_weight.shape != (D,):
        raise ValueError(f"q/k norm weights must be [D={D}], got {tuple(q_weight.shape)} / {tuple(k_weight.shape)}")
    if {y_BTN.dtype, keys_RHPD.dtype, values_RHPD.dtype} != {y_BTN.dtype}:
        raise ValueError(f"dtypes differ: y {y_BTN.dtype}, keys {keys_RHPD.dtype}, values {values_RHPD.dtype}")
    if cos_BTD.shape[-2:] != (T, D) or cos_BTD.shape[0] not in (1, B) or sin_BTD.shape != cos_BTD.shape:
        raise ValueError(f"cos/sin must be [B={B} or 1, T={T}, D={D}], got {tuple(cos_BTD.shape)} / "
                         f"{tuple(sin_BTD.shape)}")
    if start_B.shape != (B,) or start_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"start must be an int32/int64 [B={B}] tensor, got {start_B.dtype} {tuple(start_B.shape)}")
    devices = {t.device for t in (y_BTN, q_weight, k_weight, cos_BTD, sin_BTD, keys_RHPD, values_RHPD, start_B)}
    if len(devices) != 1:
        raise ValueError(f"every tensor must be on one device, got {sorted(map(str, devices))}")
    if keys_RHPD.stride(3) != 1 or values_RHPD.stride(3) != 1:
        raise ValueError("the cache's head dim must be contiguous (stride 1)")
    q = torch.empty((B, Hq, T, D), dtype=y_BTN.dtype, device=y_BTN.device)
    if B * T * (Hq + Hk) == 0:
        return q
    y = y_BTN if y_BTN.stride(2) == 1 else y_BTN.contiguous()
    cos, sin = cos_BTD.expand(B, T, D), sin_BTD.expand(B, T, D)
    if cos.stride(-1) != 1 or cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    from moe_offload.kernels.nvfp4 import device_guard
    from moe_offload.kernels.rmsnorm import LAUNCH_OPTIONS, num_warps

    block = triton.next_power_of_2(D)
    with device_guard(y.device):
        _qk_norm_rope_kernel[(B * T * (Hq + Hk),)](
            y, y.stride(0), y.stride(1), q_weight, k_weight, float(eps), cos, sin, cos.stride(0), cos.stride(1), q,
            keys_RHPD, values_RHPD, *keys_RHPD.stride()[:3], *values_RHPD.stride()[:3], start_B, start_B.stride(0),
            P, Hq, Hk, T, D, D=D, BLOCK=block, HALF_BLOCK=triton.next_power_of_2(D // 2), num_warps=num_warps(block),
            **LAUNCH_OPTIONS, **pdl.launch_kwargs())
    return q
