"""The decode step's expert compute: routed experts read in place from the slot pool by row index.

Legend: T tokens, K top-k, H hidden, N rows of the pool views (slots + scratch rows).

NVFP4 on CUDA: the fused W4A16 decode kernel (``kernels/decode_moe.py``: codes, block scales and
global scales read straight from the pool rows, fp32 accumulation, no bf16 copy of any weight). Other
formats and devices: the T*K routed rows are gathered (one ``index_select`` per bank, no host sync) and
the configured compute runs on them. Either way nothing is read back to the host.
"""

from __future__ import annotations

import torch


class DecodeCompute:
    """``(hidden_TH, rows_TK, weights_TK, pool_views, num_rows) -> out_TH`` for decode-sized T."""

    def __init__(self, fmt, inner, device: torch.device, fused: bool):
        self.inner = inner
        self.fused = fused and fmt.is_quantized and device.type == "cuda"
        self.name = "triton_decode" if self.fused else f"{inner.name}+row_gather"
        if self.fused:
            from moe_offload.kernels.decode_moe import decode_moe_nvfp4

            self._fn = decode_moe_nvfp4

    def bind(self, stats) -> None:
        self.inner.bind(stats)

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows):
        if self.fused:
            return self._fn(hidden_TH, rows_TK, weights_TK, views, out_dtype=hidden_TH.dtype)
        T, K = rows_TK.shape
        flat_M = rows_TK.reshape(-1).long()
        routed = {name: v.index_select(0, flat_M) for name, v in views.items()}
        pair_rows_TK = torch.arange(T * K, device=rows_TK.device).view(T, K)
        return self.inner(hidden_TH, pair_rows_TK, weights_TK, routed, T * K)
