"""OffloadedExperts: a drop-in for transformers' experts modules backed by the OffloadMoeCache.

Call: ``(hidden_TH [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``.
Path by token count: ``T <= decode.max_tokens`` (and the routed experts fit in the slot pool) runs
the decode path (experts made resident, compute reads slots); otherwise the prefill path (the layer
assembled in a staging buffer, the next layer's assembly overlapping this layer's compute).

Legend: T tokens, K top-k, H hidden, N rows of the bank views the compute reads.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from moe_offload.cache import OffloadMoeCache
from moe_offload.copy_paths import index_tensor
from moe_offload.formats import ExpertFormat
from moe_offload.host_store import bank_views
from moe_offload.kernels.moe_gemm import moe_grouped


class TorchGroupedCompute:
    """Dequantize chunks of rows (Triton kernel on CUDA, torch reference on CPU) + grouped_mm."""

    name = "torch"

    def __init__(self, fmt: ExpertFormat, dtype: torch.dtype, chunk_rows: int, use_triton_dequant: bool):
        self.fmt, self.dtype, self.chunk_rows = fmt, dtype, chunk_rows
        self._dequant = self.fmt.dequantize
        if use_triton_dequant and fmt.name != "bf16":
            from moe_offload.kernels.nvfp4 import dequant_banks

            self._dequant = dequant_banks

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows):
        def dequant_rows(r0: int, r1: int):
            return self._dequant({k: v[r0:r1] for k, v in views.items()}, self.dtype)

        return moe_grouped(hidden_TH, rows_TK, weights_TK, num_rows, dequant_rows, self.chunk_rows, self.dtype)


class FusedNvfp4Compute:
    """Fused W4A16 Triton grouped GEMM: NVFP4 dequantized in the K loop, no bf16 copy, no host sync."""

    name = "triton"

    def __init__(self, dtype: torch.dtype):
        from moe_offload.kernels.fused_moe import fused_moe_nvfp4

        self._fn, self.dtype = fused_moe_nvfp4, dtype

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows):
        return self._fn(hidden_TH, rows_TK, weights_TK, views, out_dtype=hidden_TH.dtype)


class OffloadedExperts(nn.Module):
    """Experts of one MoE layer, computed from the cache. ``reduce``: TP all-reduce (or None);
    ``prefill_compute``: the prefill path's compute when it differs (a ``GraphedCompute``)."""

    def __init__(self, layer_idx: int, cache: OffloadMoeCache, compute: Callable, decode_max_tokens: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, prefill_compute: Callable | None = None):
        super().__init__()
        self.prefill_compute = prefill_compute
        self.layer_idx = layer_idx
        self.cache = cache
        self.compute = compute
        self.decode_max_tokens = decode_max_tokens
        self.reduce = reduce
        self.top_k = cache.store.geometry.top_k

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, experts={self.cache.E}, compute={getattr(self.compute, 'name', '?')}"

    def uses_decode_path(self, num_tokens: int) -> bool:
        routed_max = min(num_tokens * self.top_k, self.cache.E)
        return num_tokens <= self.decode_max_tokens and routed_max <= self.cache.num_slots

    def forward(self, hidden_TH: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        T = hidden_TH.shape[0]
        if self.uses_decode_path(T):
            out = self._decode(hidden_TH, top_k_index, top_k_weights)
        else:
            out = self._prefill(hidden_TH, top_k_index, top_k_weights)
        return self.reduce(out) if self.reduce is not None else out

    def _decode(self, hidden_TH, topk_ids_TK, topk_w_TK):
        cache = self.cache
        if self.layer_idx == cache.store.layers[0]:
            cache.stats_.decode_steps += 1
        experts, slots, ids_TK = cache.ensure(self.layer_idx, topk_ids_TK)
        dev = hidden_TH.device
        rows_TK = index_tensor(np.searchsorted(experts, ids_TK), dev)
        # the routed experts' rows, compacted: one gather of whole rows, then typed bank views
        rows_NB = cache.pool_rows.index_select(0, index_tensor(slots, dev))
        views = bank_views(cache.store.specs, cache.store.offsets, rows_NB)
        return self.compute(hidden_TH, rows_TK, topk_w_TK, views, int(experts.size))

    def _prefill(self, hidden_TH, topk_ids_TK, topk_w_TK):
        cache = self.cache
        if self.layer_idx == cache.store.layers[0]:
            if cache.begun_early:
                cache.begun_early = False
            else:
                cache.begin_prefill(self.layer_idx)
        views = cache.wait_layer(self.layer_idx)
        if cache.prefill_cfg.overlap:
            nxt = cache.next_layer(self.layer_idx)
            if nxt is not None:
                cache.prefetch_layer(nxt)
        if self.prefill_compute is not None:
            out = self.prefill_compute(hidden_TH, topk_ids_TK, topk_w_TK, views, cache.E, stats=cache.stats_)
        else:
            out = self.compute(hidden_TH, topk_ids_TK, topk_w_TK, views, cache.E)
        cache.release_layer(self.layer_idx)
        return out
