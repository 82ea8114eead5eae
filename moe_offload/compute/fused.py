"""The fused W4A16 Triton grouped GEMM (kernels/fused_moe.py): NVFP4 dequantized in the K loop, no
bf16 copy of the weights, no host sync. Rows are read in place by index (a staged layer or the slot pool).

Legend: T tokens, K top-k, H hidden, N rows of the bank views.
"""

from __future__ import annotations

import torch


class FusedNvfp4Compute:
    name = "triton"

    def __init__(self, dtype: torch.dtype):
        from moe_offload.kernels.fused_moe import fused_moe_nvfp4

        self._fn, self.dtype = fused_moe_nvfp4, dtype

    def bind(self, stats) -> None:
        """Nothing to report."""

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows, index_N=None):
        if index_N is not None:  # the kernel reads bank rows by index: map the pairs' rows through it
            rows_TK = index_N[rows_TK.long()]
        return self._fn(hidden_TH, rows_TK, weights_TK, views, out_dtype=hidden_TH.dtype)
