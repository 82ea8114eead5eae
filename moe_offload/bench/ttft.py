"""``moe-offload bench ttft``: time to first token vs residency per prefill copy mode, against floors
measured in the same run and against peers (transformers + accelerate offloading the experts;
transformers fully on the GPU).

    moe-offload bench ttft                      # embedded tiny model on the CPU: the CI smoke test
    moe-offload bench ttft --config configs/qwen3-30b-a3b-nvfp4.yaml --prompt-lens 1024 --peer-layers 8
    python benchmarks/ttft.py ...               # the same main()

One run, in order (every figure lands in ``ttft-<preset>[-lN]-<sha>.json`` and ``.md`` under ``--out``):
1. pinned H2D bandwidth: one 1 GiB copy from host memory pinned the way ExpertStore pins it
   (``cudaHostRegister``), CUDA events, median of 10 (CPU device: a 64 MiB host copy, so the smoke
   test has the same fields);
2. the engine is built once (checkpoint -> pinned store happens once); every further mode gets a
   fresh ``OffloadMoeCache`` over the same store and budget, then a prefill warmup, as in serving;
3. per (prompt length, mode, residency): ``reps`` TTFTs from ``Engine.measure_ttft`` (synchronized,
   first token sampled), each after ``cache.set_residency`` (which evicts everything first). The
   resident set of layer l at residency r is the first round(r*E) experts of a seeded permutation of
   that layer, so the sets are nested across residencies. Measured hit fraction and bytes per copy
   path come from ``cache.stats()`` of the pass; host time per layer from forward hooks (no sync);
4. floors and ratios (``report.derive``): PCIe floor = missed bytes / H2D bandwidth, compute floor =
   the fastest hit-D2D mode at residency 1 (added to the sweep when absent);
5. peers (CUDA only; the engine is torn down first so they get the GPU), then issue 5's targets.

Budget: slots = the largest residency's resident experts, exactly. At a lower residency the other
slots are free and prefill admits staged experts into them after each layer (the runtime's warming
of the decode cache); that cost is inside the measured TTFT, as in serving.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from moe_offload import log
from moe_offload.bench.timing import HostTimer, measure_h2d
from moe_offload.config import FORMATS, PRESETS, OffloadConfig, load_config

#: prefill settings of each mode; "auto" is accepted too (the runtime's per-row-size choice)
MODES = {
    "batch_memcpy": {"hit_d2d": True, "hit_copy": "batch_memcpy"},
    "gather": {"hit_d2d": True, "hit_copy": "gather"},
    "auto": {"hit_d2d": True, "hit_copy": "auto"},
    "off": {"hit_d2d": False},
}
PEERS = ("accelerate", "full_gpu")
# The embedded default is the CI smoke test: it must run in seconds on a CPU, so it gets shorter
# prompts (the tiny model allows 4096 positions) and fewer repetitions than a real model.
DEFAULT_PROMPT_LENS = {"smoke": "64", "model": "128,1024,8192"}
# cache.py keeps the last two staged layers and reuses a staged layer as is: with fewer MoE layers a
# pass would start with its first layers already staged and copy nothing for them
MIN_MOE_LAYERS = 3
DEFAULT_REPS = {"smoke": 2, "model": 5}


class BenchError(ValueError):
    """A bench argument is wrong; the message names the option and what is accepted."""


@dataclass(frozen=True)
class Plan:
    prompt_lens: tuple[int, ...]
    residencies: tuple[float, ...]
    modes: tuple[str, ...]
    reps: int
    peers: tuple[str, ...]
    peer_layers: int | None
    peer_reps: int
    seed: int
    notes: tuple[str, ...]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (default: the embedded tiny model, the CI smoke test)")
    p.add_argument("--preset", choices=PRESETS, help="override model.preset")
    p.add_argument("--format", choices=FORMATS,
                   help="override model.format (the shipped configs and the embedded default use nvfp4-modelopt)")
    p.add_argument("--layers", type=int, help="truncate the preset to N layers (figures are also given per layer "
                   "and extrapolated to the preset's full depth)")
    p.add_argument("--prompt-lens", help=f"comma-separated prompt lengths (default {DEFAULT_PROMPT_LENS['model']}; "
                   f"{DEFAULT_PROMPT_LENS['smoke']} for the tiny presets, e.g. the embedded default)")
    p.add_argument("--residency", default="0,0.25,0.37,0.5,0.75,1",
                   help="comma-separated fractions of each layer's experts resident when prefill starts; "
                   "1 is always added (it is the compute floor)")
    p.add_argument("--modes", default="batch_memcpy,gather,off",
                   help=f"comma-separated prefill copy modes: {', '.join(MODES)} (off = full-layer H2D copies)")
    p.add_argument("--reps", type=int, help=f"timed repetitions per cell (default {DEFAULT_REPS['model']}; "
                   f"{DEFAULT_REPS['smoke']} for the tiny presets); one untimed pass per prompt length and mode")
    p.add_argument("--peers", default="accelerate,full_gpu",
                   help=f"comma-separated peers to run in the same run ({', '.join(PEERS)}) or 'none'; CUDA only")
    p.add_argument("--peer-layers", type=int, help="run the peers on the first N layers and extrapolate linearly "
                   "(default: as many layers as the engine)")
    p.add_argument("--peer-reps", type=int, default=3, help="timed repetitions per peer and prompt length (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and of the resident sets")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (needs moe_offload.parallel, issue 6)")
    p.add_argument("--out", default="benchmarks/results",
                   help="directory for the JSON and markdown (default %(default)s)")
    p.add_argument("--git-sha", help="record this commit when the tree has no .git (e.g. a copied checkout)")
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the markdown table")


def _csv(text: str, option: str, conv, check, accepted: str) -> tuple:
    try:
        items = tuple(conv(x.strip()) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise BenchError(f"{option} {text!r}: expected {accepted}") from None
    if not items or not all(check(x) for x in items):
        raise BenchError(f"{option} {text!r}: expected {accepted}")
    return tuple(dict.fromkeys(items))


def make_plan(a: argparse.Namespace, cfg: OffloadConfig) -> Plan:
    """The sweep from the options; a tiny preset (the embedded default) gets the smoke-test defaults."""
    smoke = cfg.model.checkpoint is None and cfg.model.preset.startswith("tiny-")
    kind = "smoke" if smoke else "model"
    notes = []
    lens = _csv(a.prompt_lens or DEFAULT_PROMPT_LENS[kind], "--prompt-lens", int, lambda n: n >= 1,
                "positive integers, e.g. 128,1024,8192")
    res = _csv(a.residency, "--residency", float, lambda r: 0.0 <= r <= 1.0, "fractions in [0, 1], e.g. 0,0.37,1")
    if 1.0 not in res:
        notes.append("residency 1 added to the sweep: it is the compute floor")
        res = (*res, 1.0)
    modes = _csv(a.modes, "--modes", str, lambda m: m in MODES, f"a comma-separated subset of {', '.join(MODES)}")
    peers = () if str(a.peers).strip().lower() == "none" else _csv(
        a.peers, "--peers", str, lambda m: m in PEERS, f"a comma-separated subset of {', '.join(PEERS)}, or none")
    reps = DEFAULT_REPS[kind] if a.reps is None else a.reps
    for name, value in (("--reps", reps), ("--peer-reps", a.peer_reps), ("--peer-layers", a.peer_layers),
                        ("--layers", a.layers), ("--tp", a.tp)):
        if value is not None and value < 1:
            raise BenchError(f"{name} must be >= 1, got {value}")
    return Plan(tuple(sorted(lens)), tuple(sorted(res)), modes, reps, peers, a.peer_layers, a.peer_reps, a.seed,
                tuple(notes))


def bench_config(a: argparse.Namespace, extra: list[str] = ()) -> OffloadConfig:
    """Config file (or embedded default) < --preset/--format/--layers < prefill.warmup=true < --set < ``extra``."""
    base = [f"model.preset={a.preset}"] if a.preset else []
    base += [f"model.format={a.format}"] if a.format else []
    base += [f"model.layers={a.layers}"] if a.layers else []
    base += [f"parallel.tp={a.tp}"] if a.tp != 1 else []
    return load_config(a.config, [*base, "prefill.warmup=true", *a.set, *extra])


def mode_config(cfg: OffloadConfig, mode: str) -> OffloadConfig:
    c = cfg.model_copy(deep=True)
    for key, value in MODES[mode].items():
        setattr(c.prefill, key, value)  # validated on assignment
    return c


# ---------------------------------------------------------------------------------------- engine
def _experts_modules(engine) -> list[torch.nn.Module]:
    from moe_offload.experts import OffloadedExperts

    return [m for m in engine.model.modules() if isinstance(m, OffloadedExperts)]


def switch_mode(engine, cfg: OffloadConfig) -> None:
    """Give ``engine`` a fresh cache with ``cfg.prefill`` over the same store (no checkpoint reload),
    then warm it up so the hit path resolves under load, as at start-up."""
    from moe_offload.cache import OffloadMoeCache

    experts = _experts_modules(engine)
    engine.cache.synchronize()
    engine.cache = None
    for m in experts:
        m.cache = None
    gc.collect()  # the old pool and staging buffers go before the new ones are allocated
    if engine.device.type == "cuda":
        torch.cuda.empty_cache()
    cache = OffloadMoeCache(engine.store, cfg.cache, cfg.prefill, engine.device)
    engine.cache, engine.cfg = cache, cfg
    for m in experts:
        m.cache = cache
    if cfg.prefill.warmup:
        engine.warmup()
    else:
        cache.resolve_hit_path()


def resident_sets(layers: tuple[int, ...], num_experts: int, counts: dict[float, int], seed: int) -> dict:
    """``{residency: {layer: experts}}``: the first ``counts[r]`` experts of a seeded per-layer permutation."""
    rng = np.random.default_rng(seed)
    perms = {layer: rng.permutation(num_experts) for layer in layers}
    return {r: {layer: sorted(perms[layer][:n].tolist()) for layer in layers} for r, n in counts.items()}


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


def run_engine(cfg: OffloadConfig, plan: Plan, prompts: dict[int, list[int]], counts: dict[float, int]) -> dict:
    """All cells of the sweep on one engine; returns ``{"cells", "modes", "store"}``. Tears the engine down."""
    from moe_offload.engine import Engine

    engine = Engine.from_config(mode_config(cfg, plan.modes[0]))
    store = engine.store
    described = store.describe()
    sets = resident_sets(store.layers, store.num_experts, counts, plan.seed)
    timer = HostTimer(engine.model, _experts_modules(engine))
    cells, modes = [], {}
    bar = tqdm(total=len(plan.modes) * len(plan.prompt_lens) * len(plan.residencies), desc="ttft cells", unit="cell")
    for i, mode in enumerate(plan.modes):
        mcfg = mode_config(cfg, mode)
        if i:
            switch_mode(engine, mcfg)
        modes[mode] = {**MODES[mode], "hit_path": engine.cache.hit_mode or "full_layer_copy",
                       "prefill": mcfg.prefill.model_dump()}
        for n in plan.prompt_lens:
            engine.cache.set_residency(sets[plan.residencies[0]])
            engine.measure_ttft(prompts[n])  # untimed: first pass of this shape (allocator, kernel caches)
            for r in plan.residencies:
                bar.set_postfix(mode=mode, tokens=n, residency=r)
                cell = measure_cell(engine, timer, prompts[n], sets[r], plan.reps)
                cells.append({"prompt_len": n, "mode": mode, "residency": r, "resident_per_layer": counts[r], **cell})
                bar.update(1)
    bar.close()
    engine.cache.synchronize()
    del engine, store, timer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"cells": cells, "modes": modes, "store": described}


# ---------------------------------------------------------------------------------------- main
def _run_tp(a: argparse.Namespace, tp: int) -> int:
    try:
        from moe_offload.parallel import run_tp_bench_ttft
    except ImportError as exc:
        raise RuntimeError(
            f"bench ttft with tensor parallelism (tp={tp}) needs moe_offload.parallel.run_tp_bench_ttft(args) "
            f"(issue 6), which this installation does not provide ({exc}); run with --tp 1") from None
    return run_tp_bench_ttft(a)


def _check_prompts(plan: Plan, cfg: OffloadConfig, reader) -> None:
    max_pos = reader.config.get("max_position_embeddings")
    too_long = [n for n in plan.prompt_lens if max_pos and n > max_pos]
    if too_long:
        raise BenchError(f"--prompt-lens {too_long}: longer than the model's max_position_embeddings={max_pos}")
    too_short = [n for n in plan.prompt_lens if n <= cfg.decode.max_tokens]
    if too_short:
        raise BenchError(f"--prompt-lens {too_short}: prompts of at most decode.max_tokens={cfg.decode.max_tokens} "
                         "tokens take the decode path, not prefill; use longer prompts")


def run(a: argparse.Namespace, plan: Plan) -> dict:
    """Everything but the report: floors, engine cells, peers. Returns the raw result dict."""
    from moe_offload.bench import peers as peer_runs
    from moe_offload.bench import report
    from moe_offload.checkpoint.reader import CheckpointReader
    from moe_offload.config import config_to_dict
    from moe_offload.engine import ensure_checkpoint, resolve_device

    probe = bench_config(a)
    device = resolve_device(probe.device)
    path = ensure_checkpoint(probe.model)
    reader = CheckpointReader(path)
    geo = reader.geometry
    _check_prompts(plan, probe, reader)
    E, L = geo.num_experts, len(geo.moe_layers)
    if L < MIN_MOE_LAYERS:
        raise BenchError(f"{path} has {L} MoE layers; the bench needs at least {MIN_MOE_LAYERS} (the cache reuses "
                         "the last two staged layers across passes, so a shallower model would copy nothing); "
                         "raise --layers")
    counts = {r: math.floor(r * E + 0.5) for r in plan.residencies}
    slots = max(max(counts.values()) * L, geo.top_k)
    notes = list(plan.notes)
    if any(s.split("=", 1)[0].strip() == "cache.budget" for s in a.set):
        notes.append(f"--set cache.budget replaced: the bench sizes the pool to the largest residency ({slots} slots)")
    cfg = bench_config(a, [f"cache.budget={slots} slots"])
    h2d = measure_h2d(device)
    gen = torch.Generator().manual_seed(plan.seed)
    prompts = {n: torch.randint(3, geo.vocab, (n,), generator=gen).tolist() for n in plan.prompt_lens}
    engine_part = run_engine(cfg, plan, prompts, counts)
    peer_part = peer_runs.run_peers(path, plan, prompts, device, notes)
    store = engine_part.pop("store")
    return {
        "schema": "moe-offload/bench-ttft/1",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        **report.environment(device, a.git_sha),
        "model": {
            "label": report.model_label(cfg), "preset": None if cfg.model.checkpoint else cfg.model.preset,
            "checkpoint": str(path), "format": store["format"], "model_type": geo.model_type,
            "layers": geo.num_layers, "moe_layers": L, "full_layers": report.full_layers(cfg, geo.num_layers),
            "experts": E, "top_k": geo.top_k, "hidden": geo.hidden, "intermediate": geo.inter,
            "bytes_per_expert": store["bytes_per_expert"], "all_expert_bytes": store["total_bytes"],
            "host_store": store,
        },
        "config": config_to_dict(cfg),
        "config_note": "prefill.hit_d2d and prefill.hit_copy are set per mode (see modes[*].prefill); "
                       "cache.budget is sized by the bench",
        "settings": {"prompt_lens": list(plan.prompt_lens), "residencies": list(plan.residencies),
                     "resident_per_layer": {str(r): n for r, n in counts.items()}, "modes": list(plan.modes),
                     "reps": plan.reps, "warmup": cfg.prefill.warmup, "budget_slots": slots, "seed": plan.seed,
                     "residency_sets": "first round(r*E) experts of a seeded per-layer permutation (nested)",
                     "peers": list(plan.peers), "peer_layers": plan.peer_layers, "peer_reps": plan.peer_reps},
        "floors": {"h2d": h2d},
        **engine_part,
        "peers": peer_part,
        "notes": notes,
    }


def main(a: argparse.Namespace) -> int:
    from moe_offload.bench import report

    cfg = bench_config(a)
    plan = make_plan(a, cfg)
    log.configure(cfg.logging.level, cfg.logging.format)
    if cfg.parallel.tp > 1:
        return _run_tp(a, cfg.parallel.tp)
    result = run(a, plan)
    report.derive(result)
    paths = report.write(result, Path(a.out))
    if a.json:
        import json

        print(json.dumps(result, indent=2, default=str))
    else:
        print(paths["markdown_text"])
    log.info_rank0("bench_ttft_written", json=str(paths["json"]), markdown=str(paths["md"]))
    return 0
