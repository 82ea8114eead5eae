"""Host time of a decode step boundary (``OffloadMoeCache.step_boundary``: commit the last boundary's admissions, read
the step's routing, pick victims, write the device table, enqueue the copies) on the real cache, on the CPU.

    python benchmarks/boundary_host.py [--residency 0.37] [--batch 1,4,16] [--steps 300] [--budget 64]
        [--skew 2.0] [--out benchmarks/results] [--json]

Why on the CPU: the boundary is host work that the GPU waits for between decode steps (0.59-3.2 ms a step at
residency 0.37 on an H200 at c7b7054, benchmarks/results/HISTORY.md), and most of it is Python and numpy over the
residency map, which this measures without a GPU. The cache has Qwen3-30B-A3B's routing shape (48 MoE layers x 128
experts, top-8) with small expert rows (hidden 64, intermediate 32: the map, the policy and the table do not depend on
the row size), so a CPU run leaves out what CUDA calls cost on a GPU host (uploads, copy calls), and the rows copied
are small. Routing: each layer draws its top-k without replacement from a Zipf law over a seeded per-layer permutation
of its experts (``--skew``: 2.0 gives ~94 % hits at batch 1 with the pool warm; the H200 measured 95.8 %); the cache
starts with every layer's share of its most popular experts resident. Each step routes every layer through
``decode_rows`` (the CPU reference of the miss copy and of the routing record), then the boundary is timed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from moe_offload.bench.env import add_git_sha_argument, environment, short_sha
from moe_offload.cache import OffloadMoeCache
from moe_offload.checkpoint.families import geometry_from_config
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.formats.registry import get_format
from moe_offload.host_store import ExpertStore
from moe_offload.presets import get_preset, preset_config


def store_of_the_routing_shape() -> ExpertStore:
    config = {**preset_config("qwen3-30b-a3b"), "model_type": get_preset("qwen3-30b-a3b").model_type,
              "hidden_size": 64, "moe_intermediate_size": 32}
    return ExpertStore(geometry_from_config(config), get_format("nvfp4-modelopt"), pin=False)


def run_batch(store: ExpertStore, residency: float, batch: int, steps: int, budget: int, skew: float,
              admit_filter: str = "none", placement: str = "popular") -> dict:
    E, K = store.num_experts, store.geometry.top_k
    cache = OffloadMoeCache(store, CacheConfig(budget=str(residency), admit_per_step=budget,
                                               admit_filter=admit_filter), PrefillConfig(), "cpu",
                            decode_max_tokens=max(batch, 1))
    rng = np.random.default_rng(0)
    perm_LE = np.stack([rng.permutation(E) for _ in store.layers])  # popularity rank -> expert, per layer
    p_E = 1.0 / np.arange(1, E + 1) ** skew
    p_E /= p_E.sum()
    share = cache.num_slots // len(store.layers)
    # popular: each layer's most popular experts resident (the steady state); random: experts drawn independently of
    # the popularity (a prompt whose prefill left experts resident that decode rarely routes to)
    start_LE = perm_LE if placement == "popular" else np.stack([rng.permutation(E) for _ in store.layers])
    cache.set_residency({layer: start_LE[lp, :share].tolist() for lp, layer in enumerate(store.layers)})
    times, admitted, hits_at = [], [], []
    for step in range(steps + 20):  # the first 20 steps settle the admissions; not timed
        for lp, layer in enumerate(store.layers):
            ids_TK = np.stack([perm_LE[lp, rng.choice(E, K, replace=False, p=p_E)] for _ in range(batch)])
            cache.decode_rows(layer, torch.from_numpy(ids_TK))
        cache.decode_step_enqueued()
        t0 = time.perf_counter()
        cache.step_boundary()
        if step >= 20:
            times.append(time.perf_counter() - t0)
            admitted.append(len(cache.decode._pending))
        if step in (19, steps + 19):
            st = cache.stats()["total"]
            hits_at.append((st["hits"], st["misses"]))
    (h20, m20), (hits, misses) = hits_at
    return {"residency": residency, "batch": batch, "steps": steps, "admit_per_step": budget,
            "admit_filter": admit_filter, "placement": placement,
            "boundary_us": {"median": float(np.median(times) * 1e6), "p90": float(np.percentile(times, 90) * 1e6)},
            "admitted_layers_per_step": float(np.mean(admitted)), "hit_rate": hits / max(1, hits + misses),
            "hit_rate_first_20": h20 / max(1, h20 + m20),
            "hit_rate_timed": (hits - h20) / max(1, hits - h20 + misses - m20)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--residency", type=float, default=0.37)
    p.add_argument("--batch", default="1,4,16")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--budget", type=int, default=CacheConfig().admit_per_step, help="cache.admit_per_step")
    p.add_argument("--skew", type=float, default=2.0, help="Zipf exponent of each layer's expert popularity")
    p.add_argument("--filter", default=CacheConfig().admit_filter,
                   help="cache.admit_filter, comma-separated values (a cell each): none, frequency")
    p.add_argument("--placement", default="popular", help="popular, random or both: the experts resident at the start")
    p.add_argument("--out", type=Path, help="write boundary_host-<sha>.json / .md here")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    add_git_sha_argument(p)
    a = p.parse_args(argv)
    store = store_of_the_routing_shape()
    placements = ("popular", "random") if a.placement == "both" else (a.placement,)
    cells = [run_batch(store, a.residency, int(b), a.steps, a.budget, a.skew, f, pl)
             for pl in placements for f in a.filter.split(",") for b in a.batch.split(",")]
    result = {**environment(torch.device("cpu"), a.git_sha), "what": "decode step boundary host time, CPU",
              "shape": {"layers": len(store.layers), "experts": store.num_experts, "top_k": store.geometry.top_k},
              "skew": a.skew, "cells": cells}
    lines = [f"# Decode boundary host time, CPU ({result['device']['name']}), git {short_sha(result['git'])}", "",
             f"{len(store.layers)} layers x {store.num_experts} experts, top-{store.geometry.top_k}, Zipf skew "
             f"{a.skew}, cache.admit_per_step {a.budget}, {a.steps} timed steps", "",
             "Start: popular = each layer's most popular experts resident; random = resident experts drawn "
             "independently of the popularity. Hit % over the 20 untimed steps, then over the timed ones.", "",
             "| start | admit filter | residency | batch | boundary us, median | p90 | admitted layers a step | "
             "hit %, steps 1-20 | hit %, timed |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {c['placement']} | {c['admit_filter']} | {c['residency']} | {c['batch']} | "
              f"{c['boundary_us']['median']:.0f} | {c['boundary_us']['p90']:.0f} | "
              f"{c['admitted_layers_per_step']:.1f} | {100 * c['hit_rate_first_20']:.1f} | "
              f"{100 * c['hit_rate_timed']:.1f} |" for c in cells]
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = f"boundary_host-{short_sha(result['git'])}"  # a label may hold dots (e.g. <sha>-skew0.7): no with_suffix
        (a.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
        (a.out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(result, indent=1) if a.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
