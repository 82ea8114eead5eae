"""``compute.backend: auto`` for NVFP4 on CUDA: per call, the fused W4A16 kernel or dequant + grouped_mm,
whichever this GPU's fused-MoE tuning table measured faster for the call's size.

Legend: T tokens, K top-k, H hidden, I intermediate, N rows of the bank views.

``benchmarks/tune_fused_moe.py`` times dequant + grouped_mm (every expert of the layer dequantized, as
``DequantGroupedCompute`` does) beside the tuned fused kernels for each routed-pair bucket and stores
``faster_than_dequant`` in the bucket's entry (``kernels/fused_moe_tuning.json``). The choice depends
only on host-known shapes (T, K, H, I), so it is fixed per captured prefill graph. A GPU without an
entry of its own keeps dequant + grouped_mm (the default entries say false): the fused kernels are
not assumed faster anywhere they were not measured. Calls are counted in ``stats()["compute"]`` as
``prefill_fused_calls`` and ``prefill_dequant_calls`` (eager calls and graph replays, not captures).
"""

from __future__ import annotations

import torch


class AutoNvfp4Compute:
    """Dispatches each ``(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N)`` call to ``fused`` or
    ``dequant`` (both ``ExpertCompute``s over the same views) by the tuning table's measurement."""

    name = "auto"

    def __init__(self, fused, dequant):
        from moe_offload.kernels.fused_moe_tuning import config_for

        self.fused, self.dequant, self._config_for = fused, dequant, config_for
        self.stats = None

    def bind(self, stats) -> None:
        self.stats = stats
        self.fused.bind(stats)
        self.dequant.bind(stats)

    def pick(self, device: torch.device, T: int, K: int, H: int, I: int) -> str:
        """``"fused"`` or ``"dequant"`` for a call of T tokens, top-K, layer shape (H, I) on ``device``."""
        return "fused" if self._config_for(device, H, I, T * K).faster_than_dequant else "dequant"

    def _pick_call(self, hidden_TH, rows_TK, views) -> str:
        T, K = rows_TK.shape
        return self.pick(hidden_TH.device, T, K, hidden_TH.shape[1], views["w2_q"].shape[2] * 2)

    def account(self, hidden_TH, rows_TK, views) -> None:
        """Count one call under the path it takes (``GraphedCompute`` calls this for each replay, since a
        replayed graph never calls this object)."""
        if self.stats is not None:
            self.stats.compute[f"prefill_{self._pick_call(hidden_TH, rows_TK, views)}_calls"] += 1

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows, index_N=None):
        which = self._pick_call(hidden_TH, rows_TK, views)
        if not (hidden_TH.is_cuda and torch.cuda.is_current_stream_capturing()):  # a capture: its replays count
            self.account(hidden_TH, rows_TK, views)
        inner = self.fused if which == "fused" else self.dequant
        return inner(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N)
