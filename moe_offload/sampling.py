"""Token sampling from logits: greedy, or temperature with top-k then top-p and a seeded multinomial.

Legend: B rows, V vocab. Used by ``Engine.generate`` (one parameter set for the batch) and by the
serving scheduler (one row at a time, each request with its own parameters and generator).
"""

from __future__ import annotations

import torch


def sample_tokens(logits_BV: torch.Tensor, temperature: float, top_k: int, top_p: float,
                  gen: torch.Generator | None) -> torch.Tensor:
    """Next ids ``[B]`` on the logits' device. ``temperature`` 0 = argmax (no sync); otherwise the
    draw runs on the host with ``gen`` (seeded, reproducible across devices)."""
    if temperature == 0:
        return logits_BV.argmax(-1)
    scores = logits_BV.float() / temperature
    if top_k:
        kth = torch.topk(scores, min(top_k, scores.shape[-1])).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_s, idx = torch.sort(scores, descending=True)
        cum = sorted_s.softmax(-1).cumsum(-1)
        drop = cum - sorted_s.softmax(-1) > top_p
        scores = scores.scatter(-1, idx, sorted_s.masked_fill(drop, float("-inf")))
    probs = scores.softmax(-1)
    return torch.multinomial(probs.cpu(), 1, generator=gen).squeeze(-1).to(logits_BV.device)
