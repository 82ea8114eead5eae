"""The KV-cache write of an attention layer in one launch: new keys and values into a static cache at
positions read from a device tensor (no host sync, graph-capturable).

Legend: B rows written, R cache rows (>= B), H key/value heads, T new tokens per row, P cache positions,
DK / DV key / value head dims.

    keys_RHPD[b, h, start_B[b] + t] = k_BHTD[b, h, t]      (same for values)

What it replaces: transformers' ``StaticLayer.update`` computes its positions on the device and copies
keys and values separately (``arange``, ``add``, ``add_`` of its own length counter, two ``index_copy_``):
five kernels per layer and step; the serving cache's per-row write was two ``scatter_``. Here one program
per (b, h, t) row copies that row's key and value. Positions outside ``[0, P)`` are not written (the
callers check lengths on the host before a step, so that only guards memory).
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

    @triton.jit
    def _kv_write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, start_ptr, stride_start, H, T, P,
                         skb, skh, skt, svb, svh, svt, sckb, sckh, sckp, scvb, scvh, scvp,
                         DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                         USE_PDL: tl.constexpr = False):
        pdl_enter(USE_PDL)
        r = tl.program_id(0).to(tl.int64)  # row (b, h, t) of the new states; int64: h * stride may pass 2^31
        t = r % T
        h = (r // T) % H
        b = r // (T * H)
        pos = tl.load(start_ptr + b * stride_start).to(tl.int64) + t
        if (pos >= 0) & (pos < P):
            ok = tl.arange(0, BLOCK_K)
            key = tl.load(k_ptr + b * skb + h * skh + t * skt + ok, mask=ok < DK)
            tl.store(kc_ptr + b * sckb + h * sckh + pos * sckp + ok, key, mask=ok < DK)
            ov = tl.arange(0, BLOCK_V)
            val = tl.load(v_ptr + b * svb + h * svh + t * svt + ov, mask=ov < DV)
            tl.store(vc_ptr + b * scvb + h * scvh + pos * scvp + ov, val, mask=ov < DV)


def _check(keys_RHPD, values_RHPD, k_BHTD, v_BHTD, start_B) -> None:
    for name, t in (("keys", keys_RHPD), ("values", values_RHPD), ("k", k_BHTD), ("v", v_BHTD)):
        if t.dim() != 4:
            raise ValueError(f"kv_write: {name} must be 4-D, got shape {tuple(t.shape)}")
    B, H, T, DK = k_BHTD.shape
    R, HC, P, DKC = keys_RHPD.shape
    if (HC, DKC) != (H, DK) or B > R or values_RHPD.shape[:3] != keys_RHPD.shape[:3]:
        raise ValueError(f"kv_write: new keys {tuple(k_BHTD.shape)} do not fit a cache of keys "
                         f"{tuple(keys_RHPD.shape)} / values {tuple(values_RHPD.shape)} (rows, heads, head dim)")
    if v_BHTD.shape[:3] != (B, H, T) or v_BHTD.shape[3] != values_RHPD.shape[3]:
        raise ValueError(f"kv_write: new values {tuple(v_BHTD.shape)} do not match keys {tuple(k_BHTD.shape)} "
                         f"and the value cache {tuple(values_RHPD.shape)}")
    if k_BHTD.dtype != keys_RHPD.dtype or v_BHTD.dtype != values_RHPD.dtype:
        raise ValueError(f"kv_write: dtypes differ (keys {k_BHTD.dtype} into {keys_RHPD.dtype}, values "
                         f"{v_BHTD.dtype} into {values_RHPD.dtype})")
    if start_B.dim() != 1 or start_B.shape[0] != B or start_B.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"kv_write: start must be an int32/int64 [B={B}] tensor, got {start_B.dtype} "
                         f"{tuple(start_B.shape)}")
    devices = {t.device for t in (keys_RHPD, values_RHPD, k_BHTD, v_BHTD, start_B)}
    if len(devices) != 1:
        raise ValueError(f"kv_write: the cache, the new states and start must be on one device, got "
                         f"{sorted(map(str, devices))}")


def kv_write_reference(keys_RHPD, values_RHPD, k_BHTD, v_BHTD, start_B) -> None:
    """The same write in torch: the CPU path and the kernel's test oracle. Positions outside ``[0, P)``
    are dropped, as in the kernel (``nonzero`` syncs: never the CUDA path)."""
    T, P = k_BHTD.shape[2], keys_RHPD.shape[2]
    pos_BT = start_B.to(torch.int64)[:, None] + torch.arange(T, device=start_B.device)
    b_N, t_N = torch.nonzero((pos_BT >= 0) & (pos_BT < P), as_tuple=True)
    p_N = pos_BT[b_N, t_N]
    keys_RHPD[b_N, :, p_N] = k_BHTD[b_N, :, t_N]
    values_RHPD[b_N, :, p_N] = v_BHTD[b_N, :, t_N]


def kv_write(keys_RHPD: torch.Tensor, values_RHPD: torch.Tensor, k_BHTD: torch.Tensor, v_BHTD: torch.Tensor,
             start_B: torch.Tensor) -> None:
    """Write ``k_BHTD`` / ``v_BHTD`` ``[B, H, T, D]`` (any strides, last dim contiguous or not) into rows
    ``0..B-1`` of ``keys_RHPD`` / ``values_RHPD`` ``[R, H, P, D]`` at positions ``start_B[b] + t``
    (``start_B``: int32/int64 ``[B]`` on the cache's device, e.g. one shared start expanded with stride 0).
    One Triton launch on CUDA (two ``scatter_`` without Triton), ``kv_write_reference`` elsewhere. Raises
    ValueError on mismatched shapes, dtypes or devices."""
    _check(keys_RHPD, values_RHPD, k_BHTD, v_BHTD, start_B)
    B, H, T, _ = k_BHTD.shape
    if k_BHTD.numel() == 0:
        return
    if keys_RHPD.device.type != "cuda":
        kv_write_reference(keys_RHPD, values_RHPD, k_BHTD, v_BHTD, start_B)
    elif triton is None:  # capturable, no sync; positions must lie in [0, P) (callers check lengths first)
        pos_BT = start_B.to(torch.int64)[:, None] + torch.arange(T, device=start_B.device)
        for cache, new in ((keys_RHPD, k_BHTD), (values_RHPD, v_BHTD)):
            cache[:B].scatter_(2, pos_BT[:, None, :, None].expand(B, H, T, new.shape[3]), new)
    else:
        launch(keys_RHPD, values_RHPD, k_BHTD, v_BHTD, start_B)


def launch(keys_RHPD, values_RHPD, k_BHTD, v_BHTD, start_B) -> None:
    """The kernel launch alone (the tests run it through the Triton interpreter on CPU tensors)."""
    from moe_offload.kernels.nvfp4 import device_guard

    B, H, T, DK = k_BHTD.shape
    DV = v_BHTD.shape[3]
    if k_BHTD.stride(3) != 1:
        k_BHTD = k_BHTD.contiguous()
    if v_BHTD.stride(3) != 1:
        v_BHTD = v_BHTD.contiguous()
    if keys_RHPD.stride(3) != 1 or values_RHPD.stride(3) != 1:
        raise ValueError("kv_write: the cache's head dim must be contiguous (stride 1)")
    with device_guard(keys_RHPD.device):
        _kv_write_kernel[(B * H * T,)](
            k_BHTD, v_BHTD, keys_RHPD, values_RHPD, start_B, start_B.stride(0), H, T, keys_RHPD.shape[2],
            *k_BHTD.stride()[:3], *v_BHTD.stride()[:3], *keys_RHPD.stride()[:3], *values_RHPD.stride()[:3],
            DK=DK, DV=DV, BLOCK_K=triton.next_power_of_2(DK), BLOCK_V=triton.next_power_of_2(DV), num_warps=1,
            **pdl.launch_kwargs())
