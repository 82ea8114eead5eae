"""The fused W4A16 Triton grouped GEMM (kernels/fused_moe.py): NVFP4 dequantized in the K loop, no
bf16 copy of the weights, no host sync. Rows are read in place by index (a staged layer or the slot pool).

Legend: T tokens, K top-k, H hidden, N rows of the bank views.
"""

from __future__ import annotations

import torch


class FusedNvfp4Compute:
    name = "triton"

    def __init__(self, dtype: torch.dtype):
        from moe_offload.kernels.fused_moe import fused_moe_nvfp4, run_fused
        from moe_offload.kernels.fused_moe_tuning import config_for
        from moe_offload.kernels.moe_align import moe_align

        self._fn, self.dtype = fused_moe_nvfp4, dtype
        self._run_fused, self._config_for, self._moe_align = run_fused, config_for, moe_align

    def bind(self, stats) -> None:
        """Nothing to report."""

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows, index_N=None):
        if index_N is None:
            return self._fn(hidden_TH, rows_TK, weights_TK, views, out_dtype=hidden_TH.dtype)
        # read in place: the pairs are grouped by their num_rows expert ids (not by the pool's thousands of
        # slots, which would size the alignment's padding and grid by the pool), then each block's bank row
        # is mapped through index_N to the slot the kernels read
        def align(rows, _pool_rows, block_m):
            a = self._moe_align(rows, num_rows, block_m)
            used = a.block_row_B >= 0
            a.block_row_B = torch.where(used, index_N.to(torch.int32)[a.block_row_B.clamp(min=0).long()],
                                        a.block_row_B)
            return a

        return self._run_fused(hidden_TH, rows_TK, weights_TK, views, hidden_TH.dtype, None, self._config_for, align)
