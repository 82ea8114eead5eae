"""What ``bench soak`` requests and how an answer is checked: ``--workloads`` seeded batches of equal-length
random prompts (lengths log-uniform, batch sizes uniform), the greedy answer of an engine to one, and where two
answers first differ. Which engine answers (the soak's cache or the all-resident reference) is ``soak.py``'s."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from moe_offload.bench.soak_options import Plan
from moe_offload.serve.consistency import first_difference as first_index


@dataclass(frozen=True)
class Workload:
    """``batch`` prompts of ``prompt_len`` seeded random ids, decoded together."""

    index: int
    prompts: list[list[int]]

    @property
    def batch(self) -> int:
        return len(self.prompts)

    @property
    def prompt_len(self) -> int:
        return len(self.prompts[0])


def make_workloads(plan: Plan, vocab: int) -> list[Workload]:
    """``plan.workloads`` seeded workloads (log-uniform prompt lengths, uniform batch sizes)."""
    rng = random.Random(plan.seed)
    lo, hi = plan.prompt_lens
    out = []
    for i in range(plan.workloads):
        n = min(hi, max(lo, round(math.exp(rng.uniform(math.log(lo), math.log(hi))))))
        batch = rng.randint(1, max(1, min(plan.max_batch, plan.max_batch_tokens // n)))
        out.append(Workload(i, [[rng.randrange(3, vocab) for _ in range(n)] for _ in range(batch)]))
    return out


def answer(engine, w: Workload, new_tokens: int) -> list[list[int]]:
    """The greedy tokens of every sequence of ``w``."""
    return [r.token_ids for r in engine.generate_batch(w.prompts, new_tokens)]


def first_difference(got: list[list[int]], want: list[list[int]]) -> dict | None:
    """Where two answers first differ (sequence, position, tokens), or None when equal."""
    for b, (g, r) in enumerate(zip(got, want)):
        pos = first_index(g, r)
        if pos is not None:
            return {"sequence": b, "position": pos, "got": g[pos] if pos < len(g) else None,
                    "want": r[pos] if pos < len(r) else None}
    if len(got) != len(want):
        return {"sequence": min(len(got), len(want)), "position": 0, "got": None, "want": None}
    return None
