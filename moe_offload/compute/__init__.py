"""Expert compute behind one protocol (``base.ExpertCompute``): dequant + grouped_mm, the fused NVFP4
Triton kernel, and the CUDA-graph wrapper around either."""

from __future__ import annotations

import logging

import torch

from moe_offload import log
from moe_offload.compute.auto import AutoNvfp4Compute
from moe_offload.compute.base import ExpertCompute
from moe_offload.compute.dequant import DequantGroupedCompute
from moe_offload.compute.fused import FusedNvfp4Compute
from moe_offload.compute.graphed import GraphedCompute
from moe_offload.config import OffloadConfig, parse_bytes

__all__ = ["AutoNvfp4Compute", "ExpertCompute", "DequantGroupedCompute", "FusedNvfp4Compute", "GraphedCompute", "make_compute",
           "dequant_chunk_rows", "nvfp4_kernels_usable"]


def nvfp4_kernels_usable(fmt, device: torch.device) -> bool:
    """Whether the NVFP4 Triton kernels serve ``fmt`` on ``device``: an NVFP4 checkpoint on a CUDA GPU they compile
    for (``kernels/nvfp4.py`` ``nvfp4_kernels_supported``). On an older GPU (an A100) logs
    ``nvfp4_kernels_unavailable`` once: the format's torch dequantization + grouped_mm run instead (counted per
    call in ``stats()["declined"]`` as ``nvfp4_kernels:capability``)."""
    if not (fmt.is_quantized and device.type == "cuda"):
        return False
    from moe_offload.kernels.nvfp4 import nvfp4_kernels_supported

    ok, why = nvfp4_kernels_supported(device)
    if not ok:
        log.log_once(f"nvfp4_kernels_unavailable:{device}", "nvfp4_kernels_unavailable", logging.WARNING,
                     device=str(device), reason=why, fallback="torch dequantize + grouped_mm")
    return ok


def make_compute(cfg: OffloadConfig, fmt, store, device: torch.device, dtype: torch.dtype) -> ExpertCompute:
    """The configured compute (``compute.backend``) for ``fmt`` on ``device``: triton = the fused kernels,
    torch = dequant + grouped_mm, auto = per call the faster of the two as measured on this GPU for NVFP4 on
    CUDA (``compute/auto.py``), else dequant + grouped_mm (the format's torch dequantization where the NVFP4
    kernels do not compile for the GPU: ``nvfp4_kernels_usable``)."""
    kernels = nvfp4_kernels_usable(fmt, device)
    if cfg.compute.backend == "triton":
        if not (fmt.is_quantized and device.type == "cuda"):
            raise RuntimeError("compute.backend=triton needs an NVFP4 checkpoint on a CUDA device; use auto or torch")
        if not kernels:
            from moe_offload.kernels.nvfp4 import nvfp4_kernels_supported

            raise RuntimeError(f"compute.backend=triton on {device}: {nvfp4_kernels_supported(device)[1]}; set "
                               "compute.backend to auto or torch (dequantize + grouped_mm)")
        return FusedNvfp4Compute(dtype)
    declined = fmt.is_quantized and device.type == "cuda" and not kernels
    dequant = DequantGroupedCompute(fmt, dtype, dequant_chunk_rows(cfg, store, dtype), kernels,
                                    declined="nvfp4_kernels:capability" if declined else None)
    if cfg.compute.backend == "auto" and kernels:
        return AutoNvfp4Compute(FusedNvfp4Compute(dtype), dequant)
    return dequant


def prefill_compute(cfg: OffloadConfig, compute: ExpertCompute, device: torch.device, dtype: torch.dtype):
    """The prefill path's compute: ``compute`` replayed as CUDA graphs when configured (CUDA only)."""
    if not (cfg.compute.cuda_graphs and device.type == "cuda"):
        return compute
    graphed = GraphedCompute(compute, device, cfg.compute.graph_after, cfg.compute.max_graphs)
    if dtype != torch.bfloat16 and compute.name != "triton":
        # CUDA grouped_mm is bf16-only: other dtypes take a per-group loop that reads offsets on the host
        graphed.disable("compute_syncs", f"dtype {dtype} runs the per-group GEMM loop (a host sync)")
    return graphed


def dequant_chunk_rows(cfg: OffloadConfig, store, dtype: torch.dtype) -> int:
    """Experts dequantized per chunk: ``prefill.dequant_chunk_experts``, else as many as fit in
    ``prefill.dequant_chunk_bytes`` (2 GiB: a whole Qwen3-30B-A3B layer, 128 x 9.4 MB, in one chunk;
    fewer chunks mean fewer kernel launches per layer on the host)."""
    if cfg.prefill.dequant_chunk_experts is not None:
        return cfg.prefill.dequant_chunk_experts
    H, I = store.geometry.hidden, store.inter
    dense_bytes = 3 * H * I * torch.empty((), dtype=dtype).element_size()
    return max(1, parse_bytes(cfg.prefill.dequant_chunk_bytes) // dense_bytes)
