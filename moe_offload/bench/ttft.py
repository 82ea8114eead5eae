"""``moe-offload bench ttft``: time to first token vs residency per prefill copy mode and prefill path,
against floors measured in the same run and against peers (transformers + accelerate offloading the
experts; transformers fully on the GPU).

    moe-offload bench ttft                      # embedded tiny model on the CPU: the CI smoke test
    moe-offload bench ttft --config configs/qwen3-30b-a3b-nvfp4.yaml --prompt-lens 1024 --peer-layers 8
    moe-offload bench ttft --config configs/qwen3-30b-a3b-nvfp4.yaml --prompt-lens 16,64,256,1024 \
        --prefill-path staged,routed --modes gather --peers none    # both paths: the cost model's data
    python benchmarks/ttft.py ...               # the same main()

One run, in order (every figure lands in ``ttft-<preset>[-lN]-<sha>.json`` and ``.md`` under ``--out``):
1. pinned H2D bandwidth: one 1 GiB copy from host memory pinned the way ExpertStore pins it
   (``cudaHostRegister``), CUDA events, median of 10 (CPU device: a 64 MiB host copy, so the smoke
   test has the same fields);
2. the engine is built once (checkpoint -> pinned store happens once); every further (mode, budget)
   gets a fresh ``OffloadMoeCache`` over the same store, then a prefill warmup, as in serving;
3. per (prompt length, mode, prefill path, residency): ``reps`` TTFTs from ``Engine.measure_ttft``
   (synchronized, first token sampled), each after ``cache.set_residency`` (which evicts everything
   first). The resident set of layer l at residency r is the first round(r*E) experts of a seeded
   permutation of that layer, so the sets are nested across residencies. Measured hit fraction, bytes
   per copy path and the path the forward took come from ``cache.stats()`` of the pass; host time per
   layer from forward hooks (no sync); the routed experts of every layer from the untimed pass;
4. floors and ratios (``report.derive``): PCIe floor = missing bytes of every layer / H2D bandwidth
   (what staging copies), routed-bytes floor = bytes of the distinct missing experts the prompt really
   routed (every layer) / H2D bandwidth, compute floor = the fastest variant at residency 1 (added to
   the sweep when absent);
5. peers (CUDA only; the engine is torn down first so they get the GPU), then the TTFT targets (``report.targets``).
   On one device the report is rewritten after each cell with the cells so far, marked ``partial``: a run cut
   short by a call's time limit or a crash keeps what it measured (under TP rank 0 writes once, at the end).

Tensor parallelism (``--tp N`` or ``parallel.tp``): the same sweep on N ranks through
``moe_offload.launch.run_on_ranks`` (spawned, or one rank per process under torchrun); every rank
measures its own link at the same time, bytes are reported per rank, the floors are per rank (each
rank moves its 1/N slice of every expert; the slowest link sets the bandwidth) and the peers, being
single-device baselines, run only at TP=1.

Prefill path (``--prefill-path``): ``staged`` stages every layer for every prompt (decode.max_tokens
is lowered below the shortest prompt), ``routed`` reads only the routed experts of every prompt
(``prefill.routed_max_tokens`` = the longest prompt, at most 4096), ``auto`` is the runtime's own choice
per prompt length (``prefill.routed_max_tokens: auto``, moe_offload/prefill_path.py). Measuring
``staged,routed`` in one run gives the data the cost model is checked and fitted against
(``benchmarks/fit_prefill_path.py --check``).

Budget (``--budget``): ``residency`` (default) sizes the slot pool to exactly the resident experts
of each residency (at least top-k), so the pool is full when prefill starts, as in a server at steady
state with that budget. ``max`` sizes it once per mode for the largest residency: at lower residencies
the other slots are free and prefill admits staged experts into them after each layer (the runtime's
warming of the decode cache), so that cost is inside the measured TTFT.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moe_offload import log
from moe_offload.bench.env import add_result_arguments
from moe_offload.bench.sweep import MODES, PATHS, cell_config, free_memory, pool_slots, sweep
from moe_offload.bench.timing import measure_h2d
from moe_offload.config import FORMATS, PRESETS, ROUTED_MAX_TOKENS_LIMIT, OffloadConfig, load_config, seed_arg

PEERS = ("accelerate", "full_gpu")
BUDGETS = ("residency", "max")
# The embedded default is the CI smoke test: it must run in seconds on a CPU, so it gets shorter
# prompts (the tiny model allows 4096 positions) and fewer repetitions than a real model.
DEFAULT_PROMPT_LENS = {"smoke": "64", "model": "128,1024,8192"}
DEFAULT_REPS = {"smoke": 2, "model": 5}
# cache.py keeps the last two staged layers and reuses a staged layer as is: with fewer MoE layers a
# pass would start with its first layers already staged and copy nothing for them
MIN_MOE_LAYERS = 3


class BenchError(ValueError):
    """A bench argument is wrong; the message names the option and what is accepted."""


@dataclass(frozen=True)
class Plan:
    prompt_lens: tuple[int, ...]
    residencies: tuple[float, ...]
    modes: tuple[str, ...]
    reps: int
    peers: tuple[str, ...]
    peer_layers: tuple[int, ...] | None  # one depth (a second is derived) or two depths
    peer_reps: int
    seed: int
    budget: str
    notes: tuple[str, ...]
    paths: tuple[str, ...] = ("auto",)


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
    p.add_argument("--prefill-path", default="auto",
                   help=f"comma-separated prefill paths: {', '.join(PATHS)} (staged: every layer staged whole; "
                   "routed: only the routed experts read, resident ones in place; auto: the runtime's per-T choice). "
                   "Default %(default)s")
    p.add_argument("--budget", choices=BUDGETS, default="residency",
                   help="slot pool per residency (residency: exactly the resident experts, the pool is full as in "
                   "steady-state serving) or once for the largest residency (max: free slots get prefill admissions)")
    p.add_argument("--reps", type=int, help=f"timed repetitions per cell (default {DEFAULT_REPS['model']}; "
                   f"{DEFAULT_REPS['smoke']} for the tiny presets); one untimed pass per prompt length and mode")
    p.add_argument("--peers", default="accelerate,full_gpu",
                   help=f"comma-separated peers to run in the same run ({', '.join(PEERS)}) or 'none'; CUDA only")
    p.add_argument("--peer-layers", help="run the peers on fewer layers than the engine: N (N and a shallower "
                   "depth) or A,B (these two depths), scaled to the engine's depth by the per-layer slope of the two "
                   "(default: as many layers as the engine)")
    p.add_argument("--peer-reps", type=int, default=3, help="timed repetitions per peer and prompt length (default 3)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the prompts and of the resident sets")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (spawned, or one per process under "
                   "torchrun); the expert intermediate size must split into multiples of the format's block")
    add_result_arguments(p, "JSON and markdown", "markdown table")


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
    paths = _csv(a.prefill_path, "--prefill-path", str, lambda m: m in PATHS,
                 f"a comma-separated subset of {', '.join(PATHS)}")
    if "staged" in paths and min(lens) < 2:
        raise BenchError(f"--prefill-path staged needs prompts of at least 2 tokens (decode.max_tokens >= 1 keeps "
                         f"1-token forwards on the decode path); got --prompt-lens {min(lens)}")
    if "routed" in paths and max(lens) > ROUTED_MAX_TOKENS_LIMIT:
        raise BenchError(f"--prefill-path routed takes prompts of at most {ROUTED_MAX_TOKENS_LIMIT} tokens; "
                         f"got --prompt-lens {max(lens)}")
    peer_layers = None if a.peer_layers is None else _csv(
        a.peer_layers, "--peer-layers", int, lambda n: n >= 1, "N or A,B: one or two positive depths")
    if peer_layers is not None and len(peer_layers) > 2:
        raise BenchError(f"--peer-layers {a.peer_layers!r}: expected N or A,B (one or two depths)")
    reps = DEFAULT_REPS[kind] if a.reps is None else a.reps
    for name, value in (("--reps", reps), ("--peer-reps", a.peer_reps), ("--layers", a.layers), ("--tp", a.tp)):
        if value is not None and value < 1:
            raise BenchError(f"{name} must be >= 1, got {value}")
    return Plan(tuple(sorted(lens)), tuple(sorted(res)), modes, reps, peers,
                None if peer_layers is None else tuple(sorted(peer_layers)), a.peer_reps, a.seed, a.budget,
                tuple(notes), paths)


def bench_config(a: argparse.Namespace) -> OffloadConfig:
    """Config file (or embedded default) < --preset/--format/--layers < prefill.warmup=true < --set."""
    base = [f"model.preset={a.preset}"] if a.preset else []
    base += [f"model.format={a.format}"] if a.format else []
    base += [f"model.layers={a.layers}"] if a.layers else []
    base += [f"parallel.tp={a.tp}"] if a.tp != 1 else []
    return load_config(a.config, [*base, "prefill.warmup=true", *a.set])


@dataclass(frozen=True)
class Setup:
    """What the sweep needs besides the plan: the checkpoint, its geometry, the residency counts, the pool
    sizes and the prompts (seeded: identical in every process)."""

    path: Path
    geometry: object
    counts: dict[float, int]
    slots: dict[float, int]
    prompts: dict[int, list[int]]


def prepare(cfg: OffloadConfig, plan: Plan, progress: bool = True) -> Setup:
    from moe_offload.checkpoint.reader import CheckpointReader
    from moe_offload.engine import ensure_checkpoint

    path = ensure_checkpoint(cfg.model, progress)
    reader = CheckpointReader(path)
    geo = reader.geometry
    max_pos = reader.config.get("max_position_embeddings")
    too_long = [n for n in plan.prompt_lens if max_pos and n > max_pos]
    if too_long:
        raise BenchError(f"--prompt-lens {too_long}: longer than the model's max_position_embeddings={max_pos}")
    E, L = geo.num_experts, len(geo.moe_layers)
    if L < MIN_MOE_LAYERS:
        raise BenchError(f"{path} has {L} MoE layers; the bench needs at least {MIN_MOE_LAYERS} (the cache reuses "
                         "the last two staged layers across passes, so a shallower model would copy nothing); "
                         "raise --layers")
    counts = {r: math.floor(r * E + 0.5) for r in plan.residencies}
    gen = torch.Generator().manual_seed(plan.seed)
    prompts = {n: torch.randint(3, geo.vocab, (n,), generator=gen).tolist() for n in plan.prompt_lens}
    return Setup(path, geo, counts, pool_slots(plan.budget, counts, L, geo.top_k), prompts)


# ---------------------------------------------------------------------------------------- one GPU
def run_single(cfg: OffloadConfig, plan: Plan, notes: list[str], on_partial=None) -> dict:
    """The sweep on one device, then the peers; the engine's part of the result. ``on_partial(part)`` runs
    after each cell with the part so far (no peers yet), so a run cut short keeps its cells."""
    from moe_offload.bench.peers import run_peers
    from moe_offload.engine import Engine, resolve_device

    setup = prepare(cfg, plan)
    device = resolve_device(cfg.device)
    h2d = measure_h2d(device)
    engine = Engine.from_config(cell_config(cfg, plan.modes[0], setup.slots[plan.residencies[0]], plan.paths[0],
                                            plan.prompt_lens))
    store = engine.store.describe()

    def progress(so_far: dict) -> None:
        on_partial({"cells": list(so_far["cells"]), "modes": dict(so_far["modes"]),
                    "failed_cells": list(so_far["failed_cells"]), "store": store, "peers": {}, "setup": setup,
                    "h2d": h2d})

    part = sweep(engine, cfg, plan, setup.prompts, setup.counts, setup.slots,
                 on_progress=None if on_partial is None else progress)
    part["store"] = store
    engine.cache.synchronize()
    del engine  # the last reference: the pool and the pinned store go before the peers are built
    free_memory()
    part["peers"] = run_peers(setup.path, plan, setup.prompts, device, notes)
    return {**part, "setup": setup, "h2d": h2d}


# ---------------------------------------------------------------------------------------- TP
def _tp_rank(cfg: OffloadConfig, tp, plan: Plan) -> dict:
    """One TP rank: its own H2D floor (all ranks at once: their links are busy together in a TP
    prefill), then the same sweep on every rank (collectives in lockstep); rank 0's result is kept,
    with every rank's bandwidth and bytes per cell."""
    import torch.distributed as dist

    from moe_offload.engine import ensure_checkpoint
    from moe_offload.launch import build_tp_engine
    from moe_offload.parallel import per_rank_bytes

    def gathered(obj):
        out = [None] * tp.world_size
        dist.all_gather_object(out, obj, group=tp.group)
        return out

    if tp.rank == 0:  # a preset is built once, by one rank
        ensure_checkpoint(cfg.model)
    tp.barrier()
    setup = prepare(cfg, plan, progress=False)
    tp.barrier()
    h2d = gathered({"tp_rank": tp.rank, **measure_h2d(tp.device)})
    rt = build_tp_engine(cell_config(cfg, plan.modes[0], setup.slots[plan.residencies[0]], plan.paths[0],
                                     plan.prompt_lens), tp, progress=tp.rank == 0)

    def per_rank(cell: dict) -> None:
        cell["per_rank"] = [{k: r[k] for k in ("tp_rank", "h2d_bytes", "moved")}
                            for r in gathered(per_rank_bytes(rt.engine.cache))]

    part = sweep(rt.engine, cfg, plan, setup.prompts, setup.counts, setup.slots, show_bar=tp.rank == 0,
                 on_cell=per_rank)
    part["store"] = rt.engine.store.describe()
    rt.engine.cache.synchronize()
    return {**part, "setup": setup, "h2d_per_rank": h2d}


def run_tp(cfg: OffloadConfig, plan: Plan, notes: list[str]) -> dict | None:
    """The sweep on ``parallel.tp`` ranks (spawned, or this process is one rank under torchrun);
    None on ranks other than 0. Floors are per rank: each rank moves its 1/tp slice over its own link,
    and the slowest link sets the bandwidth."""
    from moe_offload.launch import run_on_ranks

    part = run_on_ranks(cfg, _tp_rank, plan)
    if part is None:
        return None
    ranks = part.pop("h2d_per_rank")
    slowest = min(ranks, key=lambda r: r["GBps"])
    h2d = {**slowest, "per_rank": ranks, "method": slowest["method"] + "; every rank at once, the slowest rank's"}
    if plan.peers:
        notes.append("peers run only with --tp 1 (they are single-device baselines)")
    return {**part, "h2d": h2d, "peers": {}}


# ---------------------------------------------------------------------------------------- main
def assemble(a: argparse.Namespace, cfg: OffloadConfig, plan: Plan, part: dict, notes: list[str],
             started: str) -> dict:
    """The result dict (before ``report.derive``). Under TP the expert bytes are per rank."""
    from moe_offload.bench import env
    from moe_offload.config import config_to_dict
    from moe_offload.engine import resolve_device

    setup, store = part.pop("setup"), part.pop("store")
    geo = setup.geometry
    return {
        "schema": "moe-offload/bench-ttft/1",
        "created": started,
        **env.environment(resolve_device(cfg.device), a.git_sha),
        "model": {**env.model_section(cfg, setup.path, geo, store), "tp": cfg.parallel.tp, "host_store": store},
        "config": config_to_dict(cfg),
        "config_note": "prefill.hit_copy and prefill.routed_max_tokens are set per variant (see modes[*].prefill; "
                       "the staged path also lowers decode.max_tokens: modes[*].decode_max_tokens); "
                       "cache.budget per residency (see settings.slots); under TP, expert bytes are per rank",
        "settings": {"prompt_lens": list(plan.prompt_lens), "residencies": list(plan.residencies),
                     "resident_per_layer": {str(r): n for r, n in setup.counts.items()}, "modes": list(plan.modes),
                     "prefill_paths": list(plan.paths), "variants": list(part["modes"]),
                     "reps": plan.reps, "warmup": cfg.prefill.warmup, "budget": plan.budget,
                     "slots": {str(r): n for r, n in setup.slots.items()}, "seed": plan.seed,
                     "residency_sets": "first round(r*E) experts of a seeded per-layer permutation (nested)",
                     "peers": list(plan.peers), "peer_layers": plan.peer_layers, "peer_reps": plan.peer_reps},
        "floors": {"h2d": part.pop("h2d")},
        **part,
        "notes": notes + env.link_notes(part.get("cells", [])),
    }


def main(a: argparse.Namespace) -> int:
    from moe_offload.bench import env, report
    from moe_offload.engine import resolve_device

    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    env.check_out_dir(a.out)
    cfg = bench_config(a)
    plan = make_plan(a, cfg)
    log.configure(cfg.logging.level, cfg.logging.format)
    notes = list(plan.notes)
    if any(s.split("=", 1)[0].strip() == "cache.budget" for s in a.set):
        notes.append(f"--set cache.budget is replaced: the bench sizes the pool itself (--budget {plan.budget})")
    if any(s.split("=", 1)[0].strip() == "prefill.routed_max_tokens" for s in a.set):
        notes.append("--set prefill.routed_max_tokens is replaced: --prefill-path sets it per variant")
    if cfg.parallel.tp > 1:  # before a rank is spawned or a weight is read
        from moe_offload.prompts import check_tp, model_facts

        check_tp(model_facts(cfg), cfg.parallel.tp, "--tp")
    planned = len(plan.modes) * len(plan.paths) * len(plan.prompt_lens) * len(plan.residencies)

    def partial(part: dict) -> None:  # rewritten after every cell; the complete report replaces it
        def write() -> None:
            result = assemble(a, cfg, plan, part, list(notes), started)
            done = len(part["cells"]) + len(part["failed_cells"])
            result["partial"] = env.partial_mark(done, planned, plan.peers, resolve_device(cfg.device))
            report.derive(result)
            report.write(result, Path(a.out))

        env.write_partial("ttft", write)

    part = run_tp(cfg, plan, notes) if cfg.parallel.tp > 1 else run_single(cfg, plan, notes, partial)
    if part is None:  # a torchrun rank other than 0: rank 0 reports
        return 0
    result = assemble(a, cfg, plan, part, notes, started)
    report.derive(result)
    paths = report.write(result, Path(a.out))
    print(json.dumps(result, indent=2, default=str) if a.json else paths["markdown_text"])
    log.info_rank0("bench_ttft_written", json=str(paths["json"]), markdown=str(paths["md"]))
    failed = result.get("failed_cells") or []
    if failed:  # written with the failures listed; the exit status says the sweep is incomplete
        cells = ", ".join(f"{c['prompt_len']} tokens {c['variant']} residency {c['residency']:g}" for c in failed)
        print(f"bench ttft: {len(failed)} cell(s) failed ({cells}): {failed[0]['error']}", file=sys.stderr)
        return 1
    return 0
