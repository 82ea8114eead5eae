"""What ``bench serve`` measures on the engine alone before the server starts, to compare serving with in
the same run: ``Engine.measure_ttft`` per prompt length (what ``bench ttft`` times) and, with
``--decode-reference``, ``bench decode``'s cell at each level's full batch (``bench/decode.py``)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moe_offload import log


def engine_ttft(engine, prompts: list[list[int]], reps: int = 3) -> dict[str, float]:
    """``Engine.measure_ttft`` per prompt (one warm-up, then the median of ``reps``), in ms, keyed by length."""
    out = {}
    for prompt in prompts:
        engine.measure_ttft(list(prompt))
        times = sorted(engine.measure_ttft(list(prompt)) for _ in range(reps))
        out[str(len(prompt))] = round(times[reps // 2] * 1000, 3)
    return out


def decode_reference(engine, rows: list[int], prompt_len: int, new_tokens: int, vocab: int, seed: int) -> dict:
    """``bench decode``'s cell (``bench/decode.py`` ``measure_cell``: one untimed run, then one timed) on this
    engine for each batch in ``rows``: seeded prompts of ``prompt_len`` tokens, ``new_tokens`` tokens (so prompt
    + output fit a static cache sized for the served requests), the residency this cache's slots buy as
    ``bench decode`` sets it (the first slots-per-layer experts of a seeded permutation). The serving run then
    starts from that residency."""
    from moe_offload.bench.decode import measure_cell
    from moe_offload.bench.sweep import resident_sets

    store, cache = engine.store, engine.cache
    per_layer = min(store.num_experts, cache.num_slots // len(store.layers))
    resident = resident_sets(store.layers, store.num_experts, {0: per_layer}, seed)[0]
    steps = max(1, new_tokens - 1)
    prompts = torch.randint(3, vocab, (max(rows), prompt_len), generator=torch.Generator().manual_seed(seed)).tolist()
    cells = {}
    for B in rows:
        c = measure_cell(engine, prompts[:B], resident, SimpleNamespace(reps=1, steps=steps))
        cells[str(B)] = {"tok_s": round(c["tok_s"]["median"], 2), "ms_per_step_median": round(c["ms_per_step"]["median"], 3),
                         "ms_per_step_p90": round(c["ms_per_step"]["p90"], 3), "hit_rate": c["hit_rate"],
                         "path": c["path"], "graph": c["graph"]}
        log.info_rank0("bench_serve_decode_reference", rows=B, **{k: v for k, v in cells[str(B)].items() if k != "graph"})
    engine.cache.reset()
    engine.drop_decoders()  # their static KV caches would sit beside the server's rows
    return {"method": "bench decode's measure_cell on the serving engine before it served", "prompt_len": prompt_len,
            "steps": steps, "resident_per_layer": per_layer, "cells": cells}


def attach_decode_reference(levels: list[dict], reference: dict) -> None:
    """Each level's ``decode_reference``: the reference cell of its full batch and its full-batch decode over it
    (None where the level ran no full batch or the reference has no cell of that many rows)."""
    for level in levels:
        full = level.get("decode_full_batch")
        ref = reference["cells"].get(str(full["rows"])) if full else None
        level["decode_reference"] = ref and {"rows": full["rows"], "tok_s": ref["tok_s"],
                                             "ratio": round(full["tok_s"] / ref["tok_s"], 3) if ref["tok_s"] else None}
