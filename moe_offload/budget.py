"""The slot plan: how many expert slots a ``cache.budget`` buys on a device.

Legend: L MoE layers, E experts per layer, K top-k, R bytes of one expert row (all banks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_offload.config import Budget, parse_bytes


class BudgetError(ValueError):
    pass


@dataclass(frozen=True)
class BudgetPlan:
    num_slots: int
    slot_bytes: int
    staging_bytes: int  # the two prefill staging layers plus the decode scratch rows
    min_bytes: int
    min_fraction: float
    scratch_rows: int = 0

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes + self.staging_bytes


def plan_budget(store, budget: Budget, device: torch.device, auto_reserve: str = "8GiB",
                scratch_rows: int = 0) -> BudgetPlan:
    """Turn a budget into a slot count; raises ``BudgetError`` stating the minimum.

    A fraction or slot-count budget sizes the pool; the two prefill staging layers and the
    ``scratch_rows`` decode scratch rows (misses served from host memory) come on top. A byte
    budget (and ``auto``) includes them."""
    R, E, L, K = store.bytes_per_expert, store.num_experts, len(store.layers), store.geometry.top_k
    all_experts = L * E
    staging = (2 * E + scratch_rows) * R
    min_slots = K
    min_bytes = staging + min_slots * R
    min_fraction = min_slots / all_experts
    if budget.kind == "fraction":
        slots = math.floor(budget.value * all_experts)
    elif budget.kind == "slots":
        slots = int(budget.value)
    elif budget.kind == "bytes":
        slots = (int(budget.value) - staging) // R
    else:  # auto
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            avail = free - parse_bytes(auto_reserve)
        else:
            avail = staging + all_experts * R  # host memory is the device: hold everything
        slots = min(all_experts, max(0, (avail - staging) // R))
    slots = min(slots, all_experts)
    if slots < min_slots:
        raise BudgetError(
            f"cache.budget {budget.kind}={budget.value:g} gives {max(slots, 0)} slots, below the minimum of {min_slots} "
            f"(one layer's routed experts, top-k) plus two staging layers and {scratch_rows} decode scratch rows: at least {min_bytes} bytes "
            f"({min_bytes / 2**30:.3f} GiB) or a fraction of experts of {min_fraction:.4f}; raise cache.budget"
        )
    return BudgetPlan(slots, slots * R, staging, min_bytes, min_fraction, scratch_rows)


def is_device_oom(exc: BaseException) -> bool:
    """torch's allocator OOM, or CUDA's ``cudaErrorMemoryAllocation`` raised as an ``AcceleratorError`` by a
    kernel launch: with lazy module loading a kernel's first launch loads its module into device memory, so at
    cache build with the pool taking what was free the first fill of the residency table fails this way
    (measured on the H200 at edd2da4: ``torch.full`` in ``SlotPool``, "CUDA error: out of memory")."""
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def error_line(exc: BaseException, limit: int | None = None) -> str:
    """The first line of ``exc``'s message (at most ``limit`` characters), or its type's name when it has none."""
    text = str(exc).strip()
    return text.splitlines()[0][:limit] if text else type(exc).__name__


def oom_message(budget, plan: BudgetPlan, row_bytes: int, device: torch.device, exc: Exception) -> str:
    setting = "auto" if budget.kind == "auto" else f"{budget.kind}={budget.value:g}"
    first = error_line(exc, 300)
    return (f"cache.budget {setting}: allocating the expert cache on {device} ({plan.num_slots} slots of {row_bytes} "
            f"bytes + {plan.staging_bytes} bytes of staging and decode scratch = {plan.total_bytes} bytes) ran out of "
            f"device memory ({first}); lower cache.budget, or set cache.budget=auto (sizes the pool from free "
            "memory, leaving cache.auto_reserve)")
