"""Plain-torch oracles of the decode miss server (``decode_miss.py``): the same rows, the same scratch contents, the
same counts, computed with ordinary tensor ops (they sync the host). The tests compare the kernels against them, and
they are the miss server of the CPU path (``decode_path.py``, ``lookahead.py``, ``link_rates.py``), which imports them
through ``decode_miss`` so that a patched oracle there is the one that runs.

Legend as in ``decode_miss.py``: T tokens, K top-k, E experts of the layer, C counters.
"""

from __future__ import annotations

import torch


def count_step_reference(ids_TK: torch.Tensor, slot_of_E: torch.Tensor, pf_row_E: torch.Tensor | None,
                         counts_C: torch.Tensor, record_MK: torch.Tensor) -> None:
    """Plain-torch oracle of the plan kernel's counting (the CPU path uses it): adds (routed pairs, missed pairs,
    distinct missed experts copied in the step[, distinct routed experts[, distinct missing experts read from a
    lookahead row]]) to ``counts_C`` (as many as it holds, 3 to 5) and stores the ids into ``record_MK[:T]``."""
    E, T = slot_of_E.shape[0], ids_TK.shape[0]
    ids = ids_TK.long().reshape(-1)
    valid = (ids >= 0) & (ids < E)
    safe = ids.clamp(0, max(E - 1, 0))
    missed = valid & (slot_of_E.long()[safe] < 0)
    from_pf = missed & (pf_row_E.long()[safe] >= 0) if pf_row_E is not None else torch.zeros_like(missed)
    got = [int(valid.sum()), int(missed.sum()), torch.unique(ids[missed & ~from_pf]).numel(),
           torch.unique(ids[valid]).numel(), torch.unique(ids[from_pf]).numel()]
    n = min(counts_C.shape[0], 5)
    counts_C[:n] += torch.tensor(got[:n], dtype=torch.int64, device=counts_C.device)
    record_MK[:T].copy_(ids_TK)


def prefetch_misses_reference(slot_of_E: torch.Tensor, predicted_ids_TK: torch.Tensor, host_rows_ER: torch.Tensor,
                              pool_rows_NR: torch.Tensor, base: int, row_of_E: torch.Tensor) -> int:
    """Plain-torch oracle of :func:`prefetch_misses` (syncs; tests and the CPU path): same rows, same map;
    returns how many experts it copied."""
    E = host_rows_ER.shape[0]
    ids = predicted_ids_TK.long().reshape(-1)
    ids = ids[(ids >= 0) & (ids < E)]
    missing = torch.unique(ids[slot_of_E.long()[ids] < 0])
    row_of_E.fill_(-1)
    for j, e in enumerate(missing.tolist()):
        pool_rows_NR[base + j].copy_(host_rows_ER[e])
        row_of_E[e] = base + j
    return int(missing.numel())


def serve_misses_reference(slot_of_E: torch.Tensor, topk_ids_TK: torch.Tensor, host_rows_ER: torch.Tensor,
                           pool_rows_NR: torch.Tensor, scratch_base: int, pf_row_E: torch.Tensor | None = None,
                           ) -> torch.Tensor:
    """Plain-torch oracle of :func:`serve_misses` (syncs; tests and the CPU path): same rows, same scratch
    contents."""
    E = host_rows_ER.shape[0]
    ids = topk_ids_TK.long()
    valid = (ids >= 0) & (ids < E)
    safe = ids.clamp(0, max(E - 1, 0))
    slot = torch.where(valid, slot_of_E.long()[safe], torch.zeros_like(ids))
    pf = pf_row_E.long()[safe] if pf_row_E is not None else torch.full_like(ids, -1)
    copy = valid & (slot < 0) & (pf < 0)
    missing = torch.unique(ids[copy])  # sorted ascending
    pos = torch.searchsorted(missing, safe)
    rows = torch.where(slot >= 0, slot, torch.where(pf >= 0, pf, scratch_base + pos))
    for j, e in enumerate(missing.tolist()):
        pool_rows_NR[scratch_base + j].copy_(host_rows_ER[e])
    return torch.where(valid, rows, -1).to(torch.int32)
