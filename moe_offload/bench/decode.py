"""``moe-offload bench decode``: decode throughput vs residency and batch size, against HBM and PCIe
floors measured in the same run and against transformers fully on the GPU.

    moe-offload bench decode                    # embedded tiny model on the CPU: the CI smoke test
    moe-offload bench decode --config configs/qwen3-30b-a3b-nvfp4.yaml
    python benchmarks/decode.py ...             # the same main()

One run, in order (every figure lands in ``decode-<label>-<sha>.{json,md,png}`` under ``--out``):
1. bandwidths: pinned H2D (``timing.measure_h2d``: 1 GiB, CUDA events, median of 10) and HBM
   (``timing.measure_hbm``: a 1 GiB device-to-device copy, median of 10, counted as read + write: 2 x bytes /
   time); on a CPU both are host memcpys of 64 MiB, so the smoke test has the same fields; after the engine is
   built, the rate of the decode path's own miss copy from its pinned store (``timing.measure_uva``);
2. one engine (one pinned store) with ``decode.max_tokens`` = the largest batch and
   ``decode.max_cache_len`` = prompt + steps + 1, greedy, no stop ids (every sequence runs every step);
3. per residency (largest first) and batch: the resident set (``sweep.resident_sets``: nested, seeded)
   is made resident, then one untimed ``Engine.generate_batch(prompts, steps + 1)`` (new shapes; on
   CUDA the step graph is captured on its 2nd step), then ``--reps`` timed ones, each after
   ``set_residency`` + ``reset``: a prefill of ``--prompt-len`` seeded random ids per sequence, then
   ``--steps`` decode steps. Per-step times are the gaps between ``on_token(0, id)`` calls (each fires
   once the step's tokens are on the host); hits, misses and bytes come from ``cache.stats()``. A batch that
   takes the staged path (``decode.path`` auto, or host on a slow-SM host, above the routed threshold) has its
   routing recorded in the untimed run (forward pre-hooks): its PCIe floor is priced by the routed experts its
   steps missed (``staged_step_counts``), as a routed step's is. After
   each cell the report is rewritten with the cells so far, marked ``partial`` (no PNG): a run cut short by
   a call's time limit or a crash keeps what it measured;
4. peers (CUDA only; the engine is closed first): ``decode_peers.py``; then the floors, ratios and
   the decode targets (``decode_report.py``).

Budget (``--budget``): ``residency`` (default) sizes the slot pool to exactly the resident experts of
each residency (``sweep.pool_slots``; a fresh cache per residency through ``sweep.use_cache``), so the
pool is full when prefill starts and the residency is the budget, as in a server at steady state.
``max`` keeps one pool sized for the largest residency: prefill then admits staged experts into the
free slots, so after a long prompt a low residency is no longer low (the measured hit rate says so).

This module owns the run (bandwidths, engine, sweep, peers) and the result it assembles. The options and the
``Plan`` they make are decode_options.py's; measuring one cell is decode_cell.py's. Their public names stay
importable from here.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moe_offload import log
from moe_offload.bench.decode_cell import measure_cell, staged_step_counts
from moe_offload.bench.decode_options import DEFAULTS, PEERS, Plan, add_arguments, bench_config, make_plan
from moe_offload.bench.sweep import (cell_config, failed_cell, free_memory, oom_line, pool_slots, resident_sets,
                                     use_cache)
from moe_offload.bench.timing import measure_h2d, measure_hbm, measure_uva
from moe_offload.bench.ttft import BenchError
from moe_offload.config import OffloadConfig

__all__ = ["DEFAULTS", "PEERS", "Plan", "add_arguments", "assemble", "bench_config", "main", "make_plan",
           "measure_cell", "model_bytes", "run", "staged_step_counts", "sweep_decode"]


# ---------------------------------------------------------------------------------------- floors
def model_bytes(engine) -> dict:
    """What every decode step reads besides the experts: the non-expert weights (the input embedding
    only for B rows, so it is left out unless tied to the LM head) and the KV bytes per position."""
    model = engine.model
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    embed_bytes = 0 if embed.data_ptr() == head.data_ptr() else embed.numel() * embed.element_size()
    c = model.config
    types = getattr(c, "layer_types", None)
    attn_layers = sum(t == "full_attention" for t in types) if isinstance(types, list) else c.num_hidden_layers
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv = attn_layers * 2 * c.num_key_value_heads * head_dim * torch.empty((), dtype=engine.dtype).element_size()
    return {"non_expert_bytes": params - embed_bytes, "embedding_bytes_left_out": embed_bytes,
            "kv_bytes_per_position": kv, "attention_layers": attn_layers}


# ---------------------------------------------------------------------------------------- cells
def _prompts(vocab: int, plan: Plan) -> list[list[int]]:
    """Seeded random ids ``[max batch][prompt_len]``; batch B takes the first B rows."""
    gen = torch.Generator().manual_seed(plan.seed)
    return torch.randint(3, vocab, (max(plan.batches), plan.prompt_len), generator=gen).tolist()



def sweep_decode(engine, cfg: OffloadConfig, plan: Plan, counts: dict, slots: dict, cells: list[dict],
                 on_progress=None) -> list[dict]:
    """Every cell, residency-major (largest pool first, so the engine's first pool is used first), appended
    to ``cells``; ``on_progress()`` runs after each one (the partial report)."""
    prompts = _prompts(engine.reader.geometry.vocab, plan)
    sets = resident_sets(engine.store.layers, engine.store.num_experts, counts, plan.seed)
    bar = tqdm(total=len(plan.residencies) * len(plan.batches), desc="decode cells", unit="cell")
    for r in plan.residencies:
        if slots[r] != engine.cache.num_slots:
            use_cache(engine, cell_config(cfg, cfg.prefill.hit_copy, slots[r]))
        for B in plan.batches:
            bar.set_postfix(residency=r, batch=B)
            cell = {"residency": r, "batch": B, "resident_per_layer": counts[r], "slots": engine.cache.num_slots}
            failure = None
            try:
                cell.update(measure_cell(engine, prompts[:B], sets[r], plan))
            except Exception as exc:  # noqa: BLE001 - only running out of device memory is a reported cell
                if (failure := oom_line(exc)) is None:
                    raise
            if failure is not None:  # outside the except: its traceback no longer holds the cell's decoder
                cell["error"] = failed_cell(engine, failure, "this batch's prefill and decode do not fit beside the "
                                            "slot pool: run it with a smaller --prompt-len or --batch, or on a larger "
                                            "GPU", residency=r, batch=B)
            cells.append(cell)
            bar.update(1)
            if on_progress is not None:
                on_progress()
    bar.close()
    return cells


# ---------------------------------------------------------------------------------------- main
def run(cfg: OffloadConfig, plan: Plan, notes: list[str], on_partial=None) -> dict:
    """Measure every cell, then the peers. ``on_partial(part)`` runs after each cell with what is measured so
    far (cells done, no peers yet), so a run cut short (a call's time limit, a crash) keeps its cells."""
    from moe_offload.bench.decode_peers import run_peers
    from moe_offload.checkpoint.reader import CheckpointReader
    from moe_offload.engine import Engine, ensure_checkpoint, resolve_device

    path = ensure_checkpoint(cfg.model)
    reader = CheckpointReader(path)
    geo, max_pos = reader.geometry, reader.config.get("max_position_embeddings")
    if max_pos and plan.prompt_len + plan.steps + 1 > max_pos:
        raise BenchError(f"--prompt-len + --steps + 1 = {plan.prompt_len + plan.steps + 1} exceeds the model's "
                         f"max_position_embeddings={max_pos}")
    counts = {r: math.floor(r * geo.num_experts + 0.5) for r in plan.residencies}
    slots = pool_slots(plan.budget, counts, len(geo.moe_layers), geo.top_k)
    device = resolve_device(cfg.device)
    floors = {"h2d": measure_h2d(device), "hbm": measure_hbm(device)}
    engine = Engine.from_config(cell_config(cfg, cfg.prefill.hit_copy, slots[plan.residencies[0]]))
    floors["uva"] = measure_uva(engine, device)
    part = {"path": path, "geometry": geo, "store": engine.store.describe(), "bytes": model_bytes(engine),
            "counts": counts, "slots": slots, "floors": floors, "cells": [], "peers": {}}
    sweep_decode(engine, cfg, plan, counts, slots, part["cells"],
                 None if on_partial is None else lambda: on_partial(part))
    engine.close()  # the decoders' graphs and static KV caches go with it, before the peers
    del engine
    free_memory()
    part["peers"] = run_peers(path, plan, _prompts(geo.vocab, plan), device, notes)
    return part


def assemble(a: argparse.Namespace, cfg: OffloadConfig, plan: Plan, part: dict, notes: list[str],
             started: str) -> dict:
    from moe_offload.bench import env
    from moe_offload.config import config_to_dict
    from moe_offload.engine import resolve_device

    geo, store = part["geometry"], part["store"]
    return {
        "schema": "moe-offload/bench-decode/1",
        "created": started,
        **env.environment(resolve_device(cfg.device), a.git_sha),
        "model": {**env.model_section(cfg, part["path"], geo, store), **part["bytes"]},
        "config": config_to_dict(cfg),
        "config_note": "cache.budget is set per residency (see settings.slots)",
        "settings": {"residencies": sorted(plan.residencies), "batches": list(plan.batches),
                     "prompt_len": plan.prompt_len, "steps": plan.steps, "reps": plan.reps, "seed": plan.seed,
                     "budget": plan.budget, "resident_per_layer": {str(r): n for r, n in part["counts"].items()},
                     "slots": {str(r): n for r, n in part["slots"].items()},
                     "residency_sets": "first round(r*E) experts of a seeded per-layer permutation (nested)",
                     "prompts": "seeded random ids, equal length; batch B takes the first B of the largest batch",
                     "cuda_graphs": cfg.decode.cuda_graphs, "lookahead": cfg.decode.lookahead,
                     "decode_attention": cfg.compute.decode_attention, "pdl_max_tokens": cfg.compute.pdl_max_tokens,
                     "run_ahead": cfg.decode.run_ahead,
                     "peers": list(plan.peers),
                     "peer_batches": list(plan.peer_batches), "compiled_batches": list(plan.compiled_batches),
                     "peer_layers": plan.peer_layers, "peer_reps": plan.peer_reps},
        "floors": part["floors"],
        "cells": part["cells"],
        "peers": part["peers"],
        "notes": notes + env.link_notes(part["cells"]),
    }


def main(a: argparse.Namespace) -> int:
    from moe_offload.bench import decode_report, env
    from moe_offload.engine import resolve_device

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    env.check_out_dir(a.out)
    cfg, plan, notes = bench_config(a)
    log.configure(cfg.logging.level, cfg.logging.format)
    planned = len(plan.residencies) * len(plan.batches)

    def partial(part: dict) -> None:  # rewritten after every cell; the complete report replaces it
        def write() -> None:
            result = assemble(a, cfg, plan, part, list(notes), started)
            result["partial"] = env.partial_mark(len(part["cells"]), planned, plan.peers, resolve_device(cfg.device))
            decode_report.derive(result)
            decode_report.write(result, Path(a.out), png=False)

        env.write_partial("decode", write)

    part = run(cfg, plan, notes, partial)
    result = assemble(a, cfg, plan, part, notes, started)
    decode_report.derive(result)
    paths = decode_report.write(result, Path(a.out))
    print(json.dumps(result, indent=2, default=str) if a.json else paths["markdown_text"])
    log.info_rank0("bench_decode_written", json=str(paths["json"]), markdown=str(paths["md"]),
                   png=str(paths["png"]) if paths["png"] else None)
    failed = [c for c in result["cells"] if c.get("error")]
    if failed:  # written with the failures marked; the exit status says the sweep is incomplete
        cells = ", ".join(f"residency {c['residency']:g} batch {c['batch']}" for c in failed)
        print(f"bench decode: {len(failed)} cell(s) failed ({cells}): {failed[0]['error']}", file=sys.stderr)
        return 1
    return 0
