"""The expert-compute seam: every variant takes the same arguments and returns the same thing.

Legend: T tokens, K top-k, H hidden, N rows of the bank views (experts of a staged layer, or slots).

    compute(hidden_TH [T, H], rows_TK [T, K] int (row of ``views`` per routed pair), weights_TK [T, K],
            views {bank: [N, ...]}, num_rows N, index_N=None) -> out_TH [T, H]

``index_N`` (optional, int ``[N]`` on the device): row r of the bank is ``views`` row ``index_N[r]``, so
``views`` may be a larger bank (the slot pool) read in place; without it row r is ``views`` row r.

    y[t] = sum_k weights[t, k] * down_r @ (silu(gate_r @ x_t) * (up_r @ x_t)),   r = rows[t, k]

``bind(stats)`` hands a variant the cache counters it reports into (graph replays, declines); the
engine calls it again when it replaces its cache.
"""

from __future__ import annotations

from typing import Protocol

import torch


class ExpertCompute(Protocol):
    name: str

    def __call__(self, hidden_TH: torch.Tensor, rows_TK: torch.Tensor, weights_TK: torch.Tensor,
                 views: dict[str, torch.Tensor], num_rows: int, index_N: torch.Tensor | None = None) -> torch.Tensor: ...

    def bind(self, stats) -> None: ...
