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
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from pydantic import ValidationError
from tqdm.auto import tqdm

from moe_offload import log
from moe_offload.bench.env import add_git_sha_argument
from moe_offload.bench.sweep import (RoutingRecorder, cell_config, failed_cell, free_memory, oom_line, pool_slots,
                                     resident_sets, use_cache)
from moe_offload.bench.timing import measure_h2d, measure_hbm, measure_uva
from moe_offload.bench.ttft import BUDGETS, BenchError, _csv
from moe_offload.config import FORMATS, PRESETS, OffloadConfig, load_config, seed_arg
from moe_offload.experts import offloaded_experts

PEERS = ("eager", "compiled")
# The embedded default is the CI smoke test: seconds on a CPU, so shorter prompts and fewer steps.
DEFAULTS = {"smoke": {"batches": "1,2", "prompt_len": 32, "steps": 4, "reps": 1},
            "model": {"batches": "1,4,16,64", "prompt_len": 1024, "steps": 64, "reps": 3}}


@dataclass(frozen=True)
class Plan:
    residencies: tuple[float, ...]  # largest first: the engine is built with the largest pool
    batches: tuple[int, ...]
    prompt_len: int
    steps: int
    reps: int
    peers: tuple[str, ...]
    peer_batches: tuple[int, ...]
    compiled_batches: tuple[int, ...]
    peer_layers: int | None
    peer_reps: int
    seed: int
    budget: str


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, s = DEFAULTS["model"], DEFAULTS["smoke"]
    p.add_argument("--config", help="YAML config (default: the embedded tiny model, the CI smoke test)")
    p.add_argument("--preset", choices=PRESETS, help="override model.preset")
    p.add_argument("--format", choices=FORMATS, help="override model.format")
    p.add_argument("--layers", type=int, help="truncate the preset to N layers (the tok/s targets are then "
                   "checked on figures scaled to the preset's full depth)")
    p.add_argument("--residency", default="0,0.37,0.5,1",
                   help="comma-separated fractions of each layer's experts resident (default %(default)s)")
    p.add_argument("--batch", help=f"comma-separated batch sizes, sequences decoded together (default "
                   f"{d['batches']}; {s['batches']} for the tiny presets)")
    p.add_argument("--prompt-len", type=int, help=f"prompt tokens per sequence, prefilled before decoding "
                   f"(default {d['prompt_len']}; {s['prompt_len']} for the tiny presets)")
    p.add_argument("--steps", type=int, help=f"timed decode steps per run (default {d['steps']}; "
                   f"{s['steps']} for the tiny presets)")
    p.add_argument("--reps", type=int, help=f"timed runs per cell (default {d['reps']}; {s['reps']} for the tiny "
                   "presets); one untimed run per cell first")
    p.add_argument("--budget", choices=BUDGETS, default="residency",
                   help="slot pool per residency (residency: exactly the resident experts) or once for the largest "
                   "(max: prefill fills the free slots, so low residencies warm up)")
    p.add_argument("--peers", default="eager,compiled", help=f"comma-separated transformers bf16 full-GPU peers "
                   f"({', '.join(PEERS)}: DynamicCache eager; StaticCache + torch.compile reduce-overhead) or "
                   "'none'; CUDA only")
    p.add_argument("--peer-batches", help="batch sizes of the eager peer (default: --batch; those that do not fit "
                   "are reported as not measured)")
    p.add_argument("--compiled-batches", default="1", help="batch sizes of the compiled peer (default %(default)s: "
                   "every batch size is its own compile, minutes at 48 layers)")
    p.add_argument("--peer-layers", type=int, help="run the peers on the first N layers and scale ms/step linearly "
                   "(default: as many layers as the engine)")
    p.add_argument("--peer-reps", type=int, default=2, help="timed runs per peer and batch (default %(default)s)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the prompts and of the resident sets")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON, markdown and PNG "
                   "(default %(default)s)")
    add_git_sha_argument(p)
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the markdown table")


def _ints(text: str, option: str) -> tuple[int, ...]:
    return tuple(sorted(_csv(text, option, int, lambda n: n >= 1, "positive integers, e.g. 1,4,16")))


def make_plan(a: argparse.Namespace, cfg: OffloadConfig) -> Plan:
    """The sweep from the options; a tiny preset (the embedded default) gets the smoke-test defaults."""
    d = DEFAULTS["smoke" if cfg.model.checkpoint is None and cfg.model.preset.startswith("tiny-") else "model"]
    res = _csv(a.residency, "--residency", float, lambda r: 0.0 <= r <= 1.0, "fractions in [0, 1], e.g. 0,0.37,1")
    batches = _ints(a.batch or d["batches"], "--batch")
    peers = () if str(a.peers).strip().lower() == "none" else _csv(
        a.peers, "--peers", str, lambda m: m in PEERS, f"a comma-separated subset of {', '.join(PEERS)}, or none")
    prompt_len = d["prompt_len"] if a.prompt_len is None else a.prompt_len  # 0 is an error below, not "the default"
    steps = d["steps"] if a.steps is None else a.steps
    reps = d["reps"] if a.reps is None else a.reps
    for name, value in (("--prompt-len", prompt_len), ("--steps", steps), ("--reps", reps),
                        ("--peer-reps", a.peer_reps), ("--peer-layers", a.peer_layers), ("--layers", a.layers)):
        if value is not None and value < 1:
            raise BenchError(f"{name} must be >= 1, got {value}")
    return Plan(tuple(sorted(res, reverse=True)), batches, prompt_len, steps, reps, peers,
                _ints(a.peer_batches, "--peer-batches") if a.peer_batches else batches,
                _ints(a.compiled_batches, "--compiled-batches"), a.peer_layers, a.peer_reps, a.seed, a.budget)


def bench_config(a: argparse.Namespace) -> tuple[OffloadConfig, Plan, list[str]]:
    """Config file (or embedded default) < --preset/--format/--layers < --set; then what the bench
    needs whatever --set says: decode.max_tokens = the largest batch, decode.max_cache_len = prompt +
    steps + 1, greedy with no stop ids (every run decodes exactly --steps steps)."""
    base = [f"model.preset={a.preset}"] if a.preset else []
    base += [f"model.format={a.format}"] if a.format else []
    base += [f"model.layers={a.layers}"] if a.layers else []
    cfg = load_config(a.config, [*base, *a.set])
    plan = make_plan(a, cfg)
    if cfg.parallel.tp > 1:
        raise BenchError("bench decode runs at parallel.tp=1 (the TP decode step is not benchmarked yet)")
    notes = []
    forced = {"decode.max_tokens": max(plan.batches), "decode.max_cache_len": max(plan.prompt_len + plan.steps + 1, 16),
              "decode.temperature": 0.0, "decode.stop_token_ids": []}
    overridden = {s.split("=", 1)[0].strip() for s in a.set} & {*forced, "cache.budget"}
    for key in sorted(overridden):
        notes.append(f"--set {key} is replaced: the bench sets it itself")
    for key, value in forced.items():
        try:
            setattr(cfg.decode, key.split(".")[1], value)  # validated on assignment
        except ValidationError as exc:
            detail = exc.errors()[0]
            raise BenchError(f"{key}={value} (what --batch / --prompt-len / --steps ask for) is out of range: "
                             f"{detail['msg']}; use smaller values") from None
    return cfg, plan, notes


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


def _run(engine, prompts: list[list[int]], steps: int) -> tuple[float, list[float], dict]:
    """One ``generate_batch`` of ``steps`` decode steps -> (decode s, per-step s, cache stats)."""
    stamps = []

    def on_token(b: int, _tok: int) -> None:
        if b == 0:
            stamps.append(time.perf_counter())

    res = engine.generate_batch(prompts, steps + 1, on_token=on_token)
    per_step = [t1 - t0 for t0, t1 in zip(stamps, stamps[1:])]
    if len(per_step) != steps or not res[0].decode_tok_s:
        raise RuntimeError(f"a bench run decoded {len(per_step)} steps, expected {steps}")
    return steps / res[0].decode_tok_s, per_step, res[0].stats


def staged_step_counts(calls: dict, steps: int, layers) -> tuple[list[int], list[int]]:
    """``(missed, routed)``: per decode step, the distinct routed experts that were not resident when the step's
    experts call began, and all distinct routed experts, summed over ``layers`` (``calls``: ``RoutingRecorder.calls``
    with residency, of the batch's row count; the last ``steps`` calls of each layer are the decode steps, which
    run after the prompt). What a staged step must read at least (it copies whole missing layers): the bytes of its
    PCIe floor and the experts of its HBM floor."""
    if sorted(calls) != sorted(layers):
        raise RuntimeError(f"decode calls recorded at layers {sorted(calls)}, expected {sorted(layers)}")
    missed, routed = [0] * steps, [0] * steps
    for layer, recorded in calls.items():
        if len(recorded) < steps:
            raise RuntimeError(f"layer {layer} saw {len(recorded)} decode calls, expected {steps}")
        for i, (ids, resident_E) in enumerate(recorded[-steps:]):
            routed[i] += int(ids.size)
            missed[i] += int((~resident_E[ids]).sum())
    return missed, routed


def measure_cell(engine, prompts: list[list[int]], resident: dict, plan: Plan) -> dict:
    """One (residency, batch) cell: an untimed run, then ``plan.reps`` timed runs from ``resident``. Where the
    batch takes the staged path (``decode.path`` auto or host, above the routed threshold) the untimed run also
    records each step's routing (forward pre-hooks, read after the run), which prices the staged steps' floor."""
    B = len(prompts)
    engine.cache.set_residency(resident)
    recorder = None
    if B > engine.cache.routed_max_tokens:  # staged steps: their routing and what was resident at each
        recorder = RoutingRecorder(offloaded_experts(engine.model), rows=B,
                                   residency=lambda layer: engine.cache.resident(layer) >= 0)
    try:
        _run(engine, prompts, plan.steps)
    finally:
        if recorder is not None:
            recorder.remove()
    staged_missed = staged_routed = None
    if recorder is not None:
        staged_missed, staged_routed = staged_step_counts(recorder.calls(), plan.steps, engine.cache.layers)
    tok_s, per_step, reps_steps, reps_missed = [], [], [], []
    hits = misses = routed = uva = h2d = staged = staged_h2d = ahead = graph = 0
    boundary_s, boundary_steps = 0.0, 0
    la = {"copied": 0, "used": 0, "missed_experts": 0} if engine.cache.decode.lookahead is not None else None
    per_layer: dict = {}
    # distinct missing experts a step read: column 2 of the step counts; with decode.miss_copy copy_engine the
    # graph's copies are column 4, the row map's (graph_copy.py)
    cols = [2, 4] if engine.cache.decode.graph_copy is not None else [2]
    engine.cache.decode.record_step_counts(True)  # which steps miss what (a device copy a step, read after the run)
    for _ in range(plan.reps):
        engine.cache.set_residency(resident)
        engine.cache.reset()
        decode_s, steps_s, stats = _run(engine, prompts, plan.steps)
        # distinct missing experts each decode step read (the last ``steps`` entries: a routed prefill counts too)
        reps_missed.append(staged_missed if staged_missed is not None else
                           engine.cache.decode.step_counts()[-plan.steps:, :, cols].sum(axis=(1, 2)).tolist())
        tok_s.append(B * plan.steps / decode_s)
        per_step += steps_s
        reps_steps.append([round(x * 1e3, 3) for x in steps_s])
        t = stats["total"]
        hits, misses, routed = hits + t["hits"], misses + t["misses"], routed + t["routed_experts"]
        uva, h2d = uva + t["bytes"]["decode_uva"], h2d + t["bytes"]["decode_h2d"]
        boundary_s, boundary_steps = boundary_s + stats["decode_boundary_s"], boundary_steps + stats["decode_steps"]
        ahead += t["bytes"].get("decode_lookahead", 0)
        graph += t["bytes"].get("decode_graph_h2d", 0)  # decode.miss_copy copy_engine (graph_copy.py)
        if la is not None:
            for k in la:
                la[k] += stats["lookahead"][k]
        # decode.path auto: steps above the routed threshold are staged forwards like the prompt's prefill;
        # with the pool full every staged forward copies the same missing experts, so a step's share is exact
        # decode.path fills: a staged step of routed fills copies only its routed misses (prefill_routed_h2d: the
        # prompt is no fill), and the whole-layer forwards are the others
        fill_forwards = stats["compute"].get("prefill_routed_fills", 0) // len(engine.cache.layers)
        staged += fill_forwards
        staged_h2d += t["bytes"].get("prefill_routed_h2d", 0) if fill_forwards else 0
        forwards = stats["prefills"] - fill_forwards
        if forwards > 1:
            staged += forwards - 1
            copied = t["bytes"]["prefill_miss_h2d"] + t["bytes"]["prefill_full_h2d"]
            staged_h2d += copied * (forwards - 1) / forwards
        for layer, c in stats["per_layer"].items():
            per_layer[str(layer)] = per_layer.get(str(layer), 0) + c["hits"] + c["misses"]
    engine.cache.decode.record_step_counts(False)
    n = plan.reps * plan.steps
    q = sorted(per_step)
    used = la["used"] * engine.store.bytes_per_expert if la is not None else 0  # missed bytes read from its rows
    if la is not None:  # decode.lookahead: how well the next layer's router predicted the misses (lookahead.py)
        la = {"recall": la["used"] / la["missed_experts"] if la["missed_experts"] else None,
              "precision": la["used"] / la["copied"] if la["copied"] else None,
              "copied_experts_per_step": la["copied"] / n, "used_experts_per_step": la["used"] / n,
              "missed_experts_per_step": la["missed_experts"] / n}
    return {
        "tok_s": {"median": statistics.median(tok_s), "reps": tok_s},
        "ms_per_step": {"median": statistics.median(q) * 1e3, "p90": q[min(len(q) - 1, math.ceil(0.9 * len(q)) - 1)]
                        * 1e3, "mean": statistics.fmean(q) * 1e3},
        # every timed step in order, per rep (host stamps of sequence 0's tokens): where a tail of slow steps sits
        "step_ms_reps": reps_steps,
        "step_missed_experts_reps": reps_missed,  # distinct missing experts read by each of those steps
        # host time between steps spent committing and scheduling admissions (the GPU waits for it)
        "boundary_ms_per_step": boundary_s * 1e3 / boundary_steps if boundary_steps else None,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        # distinct experts routed per step (summed over layers): what the step must read; pairs read each once
        # per routed token (the HBM floor counts the distinct ones)
        "routed_experts_per_step": statistics.fmean(staged_routed) if staged_routed is not None else routed / n,
        "routed_pairs_per_step": (hits + misses) / n,
        "missed_pairs_per_step": misses / n,
        "routed_per_layer_per_step": {k: v / n for k, v in per_layer.items()},
        "pcie_bytes_per_step": {"total": (uva + ahead + graph + h2d + staged_h2d) / n, "decode_uva": uva / n,
                                "decode_graph_h2d": graph / n,
                                "decode_lookahead": ahead / n, "decode_h2d": h2d / n, "staged_h2d": staged_h2d / n,
                                # the distinct missing experts the steps read, wherever from: the PCIe floor's bytes
                                "missed": (uva + used + graph) / n,
                                # staged steps (decode.path auto / host): their routed missing experts, from the
                                # untimed run's routing (staged_step_counts), the floor's bytes for such a cell
                                "staged_missed": (statistics.fmean(staged_missed) * engine.store.bytes_per_expert
                                                  if staged_missed is not None else None)},
        "lookahead": la,
        "path": "staged" if staged == n else "routed" if staged == 0 else "mixed",
        # decode.path as this cell's cache resolved it (host: by the link it measured) and its routed threshold
        "decode_path": engine.cache.routed_path.decode_path, "routed_max_tokens": engine.cache.routed_max_tokens,
        "graph": {"captures": stats["compute"].get("decode_graph_captures", 0),
                  "replays": stats["compute"].get("decode_graph_replays", 0), "declined": stats["declined"]},
    }


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
        "notes": notes,
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
