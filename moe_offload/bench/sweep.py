"""The engine side of ``bench ttft``: one engine (one pinned store), a fresh cache per (mode, pool
size), deterministic residency before every repetition, and the figures of each cell.

A cell is (prompt length, mode, residency). Per repetition: ``cache.set_residency`` (evicts
everything, then makes the cell's experts resident), ``cache.reset``, ``Engine.measure_ttft``
(synchronized, first token sampled); the hit fraction and bytes per copy path come from
``cache.stats()`` of that pass, host times from forward hooks.
"""

from __future__ import annotations

import gc
import statistics
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from moe_offload.bench.timing import HostTimer
from moe_offload.config import OffloadConfig
from moe_offload.experts import offloaded_experts

#: prefill settings of each mode; "auto" is accepted too (the runtime's per-row-size choice)
MODES = {
    "batch_memcpy": {"hit_copy": "batch_memcpy"},
    "gather": {"hit_copy": "gather"},
    "auto": {"hit_copy": "auto"},
    "off": {"hit_copy": "off"},
}


def cell_config(cfg: OffloadConfig, mode: str, slots: int) -> OffloadConfig:
    """``cfg`` with the prefill settings of ``mode`` and a pool of ``slots`` slots."""
    c = cfg.model_copy(deep=True)
    for key, value in MODES[mode].items():
        setattr(c.prefill, key, value)  # validated on assignment
    c.cache.budget = f"{slots} slots"
    return c


def pool_slots(budget: str, counts: dict[float, int], moe_layers: int, top_k: int) -> dict[float, int]:
    """Slots of the pool at each residency: exactly the resident experts (``budget="residency"``) or
    the largest residency's (``"max"``); never below top-k (one token's experts must fit in decode)."""
    largest = max(counts.values())
    return {r: max((n if budget == "residency" else largest) * moe_layers, top_k) for r, n in counts.items()}


def resident_sets(layers: tuple[int, ...], num_experts: int, counts: dict[float, int], seed: int) -> dict:
    """``{residency: {layer: experts}}``: the first ``counts[r]`` experts of a seeded per-layer
    permutation, so a higher residency holds every expert of a lower one."""
    rng = np.random.default_rng(seed)
    perms = {layer: rng.permutation(num_experts) for layer in layers}
    return {r: {layer: sorted(perms[layer][:n].tolist()) for layer in layers} for r, n in counts.items()}


def use_cache(engine, cfg: OffloadConfig) -> None:
    """Give ``engine`` a fresh cache built from ``cfg.cache`` and ``cfg.prefill`` over the same store (no
    checkpoint reload), then warm it up so the hit path resolves under load, as at start-up."""
    from moe_offload.cache import OffloadMoeCache

    engine.cache.close()  # the old pool and staging go before the new ones are allocated
    free_memory()
    engine.replace_cache(OffloadMoeCache(engine.store, cfg.cache, cfg.prefill, engine.device, cfg.decode.max_tokens))
    engine.cfg = cfg
    if cfg.prefill.warmup:
        engine.warmup()
    else:
        engine.cache.resolve_hit_path()


def free_memory() -> None:
    """Collect what was dropped (an engine's device pools, its pinned store) and return cached device
    memory, so that what runs next (the peers) gets it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "reps": values}


def measure_cell(engine, timer: HostTimer, ids: list[int], resident: dict, reps: int) -> dict:
    """``reps`` TTFTs of ``ids`` with exactly ``resident`` experts resident at the start of each."""
    ttft, host_fwd, host_layer = [], [], []
    stats = {}
    for _ in range(reps):
        engine.cache.set_residency(resident)
        engine.cache.reset()
        timer.reset()
        ttft.append(engine.measure_ttft(ids))
        stats = engine.cache.stats()
        host_fwd.append(timer.forward_s)
        host_layer.append(timer.experts_s / max(timer.experts_calls, 1))
    tot = stats["total"]
    b = tot["bytes"]
    looked = tot["prefill_hits"] + tot["prefill_misses"]
    return {
        "hit_fraction": tot["prefill_hits"] / looked if looked else None,
        "ttft_s": _summary(ttft),
        "hit_path": stats["hit_path"],
        "hit_d2d_fallbacks": stats["hit_d2d_fallbacks"],
        "prefills": stats["prefills"],
        "bytes": {"h2d": b["prefill_full_h2d"] + b["prefill_miss_h2d"],
                  "d2d": b["prefill_hit_d2d"] + b["prefill_hit_gather"],
                  **{k: v for k, v in b.items() if k.startswith("prefill_")}},
        "host": {"forward_s": statistics.median(host_fwd), "experts_per_layer_s": statistics.median(host_layer)},
    }


def sweep(engine, cfg: OffloadConfig, plan, prompts: dict[int, list[int]], counts: dict[float, int],
          slots: dict[float, int], show_bar: bool = True, on_cell: Callable[[dict], None] | None = None) -> dict:
    """Every cell of ``plan`` on ``engine`` (built for ``plan.modes[0]`` at the first residency's pool);
    returns ``{"cells", "modes"}``. ``on_cell(cell)`` runs after each cell (TP: per-rank figures)."""
    first = plan.residencies[0]
    sets = resident_sets(engine.store.layers, engine.store.num_experts, counts, plan.seed)
    timer = HostTimer(engine.model, offloaded_experts(engine.model))
    cells, modes = [], {}
    current = (plan.modes[0], slots[first])
    bar = tqdm(total=len(plan.modes) * len(plan.prompt_lens) * len(plan.residencies), desc="ttft cells",
               unit="cell", disable=not show_bar)
    for mode in plan.modes:
        for r in plan.residencies:
            ccfg = cell_config(cfg, mode, slots[r])
            if (mode, slots[r]) != current:
                use_cache(engine, ccfg)
                current = (mode, slots[r])
            modes.setdefault(mode, {**MODES[mode], "hit_path": engine.cache.hit_path,
                                    "prefill": ccfg.prefill.model_dump()})
            for n in plan.prompt_lens:
                bar.set_postfix(mode=mode, tokens=n, residency=r)
                if r == first:  # untimed: first pass of this shape in this mode (allocator, kernel caches)
                    engine.cache.set_residency(sets[r])
                    engine.measure_ttft(prompts[n])
                cell = {"prompt_len": n, "mode": mode, "residency": r, "resident_per_layer": counts[r],
                        "slots": engine.cache.num_slots,
                        **measure_cell(engine, timer, prompts[n], sets[r], plan.reps)}
                if on_cell is not None:
                    on_cell(cell)
                cells.append(cell)
                bar.update(1)
    bar.close()
    timer.remove()
    return {"cells": cells, "modes": modes}
