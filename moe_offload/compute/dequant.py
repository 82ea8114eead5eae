"""Dequantize + grouped GEMM: chunks of bank rows dequantized to the compute dtype (Triton kernel on
CUDA for NVFP4, the format's torch reference elsewhere), then ``torch._grouped_mm`` (kernels/moe_gemm.py).

Legend: T tokens, K top-k, H hidden, N rows of the bank views.
"""

from __future__ import annotations

import torch

from moe_offload.kernels.moe_gemm import moe_grouped


class DequantGroupedCompute:
    """Sync-free chunked dequant + grouped_mm (bf16 on CUDA; other dtypes take a per-group loop)."""

    name = "torch"

    def __init__(self, fmt, dtype: torch.dtype, chunk_rows: int, use_triton_dequant: bool, declined: str | None = None):
        """``declined``: the ``stats()["declined"]`` key each call counts when this compute stands in for the NVFP4
        kernels (``compute.nvfp4_kernels_usable``)."""
        self.fmt, self.dtype, self.chunk_rows = fmt, dtype, chunk_rows
        self._dequant = fmt.dequantize
        self._triton = use_triton_dequant and fmt.is_quantized
        self._declined, self._stats = declined, None
        if self._triton:
            from moe_offload.kernels.nvfp4 import dequant_banks

            self._dequant = dequant_banks

    def bind(self, stats) -> None:
        """Counts the calls made in place of the NVFP4 kernels (``declined``), nothing else."""
        self._stats = stats

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows, index_N=None):
        if self._declined is not None and self._stats is not None:
            self._stats.declined[self._declined] += 1
        def dequant_rows(r0: int, r1: int):
            if index_N is None:
                return self._dequant({k: v[r0:r1] for k, v in views.items()}, self.dtype)
            if self._triton:  # the kernel reads each row where it is (no gathered copy)
                return self._dequant(views, self.dtype, index_N=index_N[r0:r1])
            idx = index_N[r0:r1].long()
            return self._dequant({k: v.index_select(0, idx) for k, v in views.items()}, self.dtype)

        return moe_grouped(hidden_TH, rows_TK, weights_TK, num_rows, dequant_rows, self.chunk_rows, self.dtype)
