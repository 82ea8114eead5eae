"""Expert compute behind one protocol (``base.ExpertCompute``): dequant + grouped_mm, the fused NVFP4
Triton kernel, and the CUDA-graph wrapper around either."""

from __future__ import annotations

import torch

from moe_offload.compute.auto import AutoNvfp4Compute
from moe_offload.compute.base import ExpertCompute
from moe_offload.compute.dequant import DequantGroupedCompute
from moe_offload.compute.fused import FusedNvfp4Compute
from moe_offload.compute.graphed import GraphedCompute
from moe_offload.config import OffloadConfig, parse_bytes

__all__ = ["AutoNvfp4Compute", "ExpertCompute", "DequantGroupedCompute", "FusedNvfp4Compute", "GraphedCompute", "make_compute",
           "dequant_chunk_rows"]


def make_compute(cfg: OffloadConfig, fmt, store, device: torch.device, dtype: torch.dtype) -> ExpertCompute:
    """The configured compute (``compute.backend``) for ``fmt`` on ``device``: triton = the fused kernels,
    torch = dequant + grouped_mm, auto = per call the faster of the two as measured on this GPU for NVFP4 on
    CUDA (``compute/auto.py``), else dequant + grouped_mm."""
    if cfg.compute.backend == "triton":
        if not (fmt.is_quantized and device.type == "cuda"):
            raise RuntimeError("compute.backend=triton needs an NVFP4 checkpoint on a CUDA device; use auto or torch")
        return FusedNvfp4Compute(dtype)
    use_triton_dequant = device.type == "cuda" and fmt.is_quantized
    dequant = DequantGroupedCompute(fmt, dtype, dequant_chunk_rows(cfg, store, dtype), use_triton_dequant)
    if cfg.compute.backend == "auto" and use_triton_dequant:
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
