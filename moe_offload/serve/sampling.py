"""Per-request sampling parameters and the sampler (``moe_offload.sampling``, one row at a time so every
request keeps its own parameters and seeded generator).

Legend: B rows in the decode batch, V vocab.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from moe_offload.sampling import sample_tokens


class RequestError(ValueError):
    """A request the scheduler cannot serve as given (bad parameter, prompt too long); maps to HTTP 400.
    ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """``temperature`` 0 = greedy; ``top_k`` 0 = off; ``stop_token_ids`` end the sequence (the stop id is
    emitted); ``ignore_eos`` keeps going past the tokenizer's EOS id."""

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        checks = (
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", math.isfinite(self.temperature) and 0.0 <= self.temperature <= 100.0, "in [0, 100]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "an integer >= 0 (0 = off)"),
            ("top_p", 0.0 < self.top_p <= 1.0, "in (0, 1]"),
        )
        for name, ok, accepted in checks:
            if not ok:
                raise RequestError(f"{name}={getattr(self, name)!r} is out of range; it must be {accepted}", name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample_row(logits_1V: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> torch.Tensor:
    """One sampled id ``[1]`` (on the host) from ``logits_1V [1, V]`` (top-k, then top-p, then a seeded multinomial)."""
    return sample_tokens(logits_1V, p.temperature, p.top_k, p.top_p, gen).cpu()


def sample(logits_BV: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    """Next token id per row: greedy rows by one argmax over the batch, the others row by row."""
    # one device->host copy per step: the scheduler needs the ids on the host to stream and stop
    out = logits_BV.argmax(-1).tolist()
    for b, (p, g) in enumerate(zip(params, gens)):
        if not p.greedy:
            out[b] = int(sample_row(logits_BV[b:b + 1], p, g)[0])
    return out
