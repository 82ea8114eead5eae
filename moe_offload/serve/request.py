"""One serving request (``Request``), what its sink receives (``Output``), and the errors ``Scheduler.submit``
raises when a request cannot be queued (``Overloaded``, ``SchedulerClosed``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from moe_offload.serve.sampling import SamplingParams


class Overloaded(RuntimeError):
    """The waiting queue is full (``serve.max_queue``); retry later (HTTP 429)."""


class SchedulerClosed(RuntimeError):
    """The scheduler is stopped or its loop died; no request is accepted (HTTP 503)."""


@dataclass
class Output:
    """What a request's sink receives: new token ids, then one final Output with ``finish_reason``
    (``stop``, ``length``, ``cancelled``) or ``error``."""

    token_ids: list[int]
    finish_reason: str | None = None
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass(eq=False)
class Request:
    """One generation request. Times are ``time.perf_counter()`` seconds."""

    id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[Output], None]
    stop_ids: frozenset[int] = frozenset()
    output_ids: list[int] = field(default_factory=list)
    t_submit: float = 0.0
    t_prefill: float | None = None  # the first prefill chunk starts (t_prefill - t_submit: queue wait)
    prefill_host: float = 0.0  # seconds the loop spent in this request's prefill forwards (host enqueue)
    t_first: float | None = None
    t_done: float | None = None
    finish_reason: str | None = None
    cancelled: bool = False
    # loop-thread state
    prefilled: int = 0
    gen: torch.Generator | None = None

    def cancel(self) -> None:
        """Ask the loop to drop this request at the next step boundary (its KV and state are freed)."""
        self.cancelled = True

    @property
    def cache_len(self) -> int:
        """Tokens in this sequence's KV cache (prompt + generated tokens already fed back)."""
        return len(self.prompt_ids) + max(0, len(self.output_ids) - 1)
