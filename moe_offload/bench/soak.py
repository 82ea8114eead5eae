"""``moe-offload bench soak``: a long randomized run of one engine at each residency, every answer
checked against the all-resident engine, memory sampled in the background.

    moe-offload bench soak --minutes 0.05                       # the embedded tiny model on the CPU: seconds
    moe-offload bench soak --config configs/qwen3-30b-a3b-nvfp4.yaml --minutes 4.5

One run, in order (every figure lands in ``soak-<label>-<sha>.{json,md,png}`` under ``--out``):
1. the workloads: ``--workloads`` seeded batches of B equal-length prompts of random ids, the length
   drawn log-uniform from ``--prompt-lens``, B uniform from 1..min(``--max-batch``,
   ``--max-batch-tokens`` // length); the engine gets ``decode.max_tokens`` >= ``--max-batch`` (every
   decode step takes the decode path), ``decode.max_cache_len`` = the longest prompt + ``--new-tokens``
   + 1 (every request fits the static KV cache), greedy sampling and no stop ids (every request decodes
   exactly ``--new-tokens`` tokens);
2. per residency, on one engine (one pinned store): a cache over the store whose pool is exactly the
   resident experts (``sweep.pool_slots``, ``sweep.use_cache``) resolves ``prefill.routed_max_tokens``
   (``auto``: from its resident fraction, ``prefill_path.py``); the references are the answers of a cache
   whose pool holds every expert (L x E slots, all made resident by ``cache.set_residency``) with that
   threshold fixed, so that every forward takes the same path (routed or staged, other kernels) as in
   the soak; they are computed once per distinct threshold;
3. the soak cache is filled by ``set_residency`` (``sweep.resident_sets``: nested, seeded), counters
   zeroed; then requests for ``--minutes``: two passes over the workloads in
   shuffled order (the first makes every decoder and compiles every kernel, the second captures the
   CUDA graphs, which are made on a shape's second call), then workloads drawn at random until the time
   is up (extended when the warm passes took more than ``WARMUP_FRACTION`` of it, so that four fifths of
   ``--minutes`` follow them). Nothing is reset between requests: admissions and evictions run as in a server. Tokens are
   compared with the reference exactly: the offloaded engine reads the same expert bytes (from a slot,
   a scratch row or a staging buffer) through the same kernels for the same batch composition, so any
   difference is a wrong expert (tests/test_soak.py checks bitwise equality on the CPU, and
   tests/gpu/test_offload_gpu.py greedy ids in bf16 on CUDA).

While requests run, a sampler thread (``soak_sampler.py``) records memory every ``--sample-s``
seconds; the request loop hands it the cache counters and the device memory allocated between
requests. Warmup, growth and verdicts: ``soak_report.py``.

This module owns the run (references, the request loop per residency) and the result it assembles. The options
and the ``Plan`` they make are soak_options.py's; the workloads and the comparison of answers soak_workloads.py's.
Their public names stay importable from here.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moe_offload import log
from moe_offload.bench.soak_options import DEFAULTS, Plan, add_arguments, bench_config, make_plan
from moe_offload.bench.soak_sampler import Sampler, WarningCounter
from moe_offload.bench.soak_workloads import Workload, answer, first_difference, make_workloads
from moe_offload.bench.sweep import cell_config, pool_slots, resident_sets, use_cache
from moe_offload.bench.ttft import BenchError
from moe_offload.config import OffloadConfig

__all__ = ["CHECKPOINT_S", "DEFAULTS", "MISMATCHES_KEPT", "Plan", "WARM_PASSES", "WARMUP_FRACTION", "Workload",
           "add_arguments", "answer", "assemble", "bench_config", "first_difference", "main", "make_plan",
           "make_workloads", "references", "run", "soak_residency"]

WARM_PASSES = 2  # passes over the workloads before the warmup may end (at least compute.graph_after: module doc)
WARMUP_FRACTION = 0.2  # and at least this fraction of the residency's run
MISMATCHES_KEPT = 20  # mismatches described in the JSON (all are counted)
#: a partial report (the same files, ``"partial"`` set) is written this often while a residency runs, so a run cut
#: short (a command's time limit, a machine taken back) still leaves its samples and verdicts so far
CHECKPOINT_S = 60.0


# ---------------------------------------------------------------------------------------- the soak
def _counters(stats: dict) -> dict:
    return {"hit_d2d_fallbacks": dict(stats["hit_d2d_fallbacks"]), "declined": dict(stats["declined"])}


def soak_residency(engine, r: float, workloads: list[Workload], reference: list, plan: Plan, warm_passes: int,
                   seed: int, progress=None) -> dict:
    """Requests at residency ``r`` for ``plan.minutes``, the first ``warm_passes`` passes over every workload
    in shuffled order (see the module docstring); the raw figures. ``progress(record)`` gets the figures so
    far every ``CHECKPOINT_S`` seconds."""
    rng = random.Random(seed)
    cache, dev = engine.cache, engine.device
    duration = plan.minutes * 60
    queue = []
    for _ in range(warm_passes):
        queue += rng.sample(range(len(workloads)), len(workloads))
    requests, mismatches, counters = [], [], []
    warm_end_s = None
    handler = WarningCounter()
    log._logger.addHandler(handler)
    bar = tqdm(total=round(duration), desc=f"soak residency {r:g}", unit="s")
    t0 = time.perf_counter()
    last_checkpoint = 0.0
    sampler = Sampler(engine, plan.sample_s, t0)
    sampler.start()
    try:
        # at least (1 - WARMUP_FRACTION) of --minutes follow the warm passes, however long they took
        while queue or time.perf_counter() - t0 < max(duration, warm_end_s + (1 - WARMUP_FRACTION) * duration):
            i = queue.pop(0) if queue else rng.randrange(len(workloads))
            w = workloads[i]
            start = time.perf_counter() - t0
            got = answer(engine, w, plan.new_tokens)
            end = time.perf_counter() - t0
            diff = first_difference(got, reference[i])
            stats = cache.stats()  # HOST SYNC between requests (reads the decode step's device counters)
            n = len(requests) + 1
            if diff is not None:
                mismatches.append({"request": n, "t_s": end, "workload": i, **diff})
            if warm_end_s is None and not queue:
                warm_end_s = end
            c = _counters(stats)
            counters.append(c)
            sampler.publish({
                "device_allocated_idle": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else None,
                "requests": n, "hit_rate": stats["hit_rate"], "prefill_hit_rate": stats["prefill_hit_rate"],
                "fallbacks": sum(c["hit_d2d_fallbacks"].values()), "declined": sum(c["declined"].values())})
            requests.append({"t_start_s": start, "t_end_s": end, "workload": i, "prompt_len": w.prompt_len,
                             "batch": w.batch, "ok": diff is None})
            bar.n = min(round(end), bar.total)
            bar.set_postfix(requests=n, mismatches=len(mismatches))
            if progress is not None and end - last_checkpoint >= CHECKPOINT_S:
                last_checkpoint = end
                progress(_record(r, end, warm_end_s, requests, mismatches, counters, handler, stats,
                                 list(sampler.samples)))
    finally:
        sampler.stop()
        bar.close()
        log._logger.removeHandler(handler)
    return _record(r, sampler.samples[-1]["t_s"], warm_end_s, requests, mismatches, counters, handler, cache.stats(),
                   sampler.samples)


def _record(r, seconds, warm_end_s, requests, mismatches, counters, handler, stats, samples) -> dict:
    """One residency's raw figures (copies: a partial record is derived while the run goes on)."""
    return {"residency": r, "seconds": seconds, "warm_passes_end_s": warm_end_s,
            "requests": list(requests), "mismatch_count": len(mismatches), "mismatches": mismatches[:MISMATCHES_KEPT],
            "counters_per_request": list(counters), "warning_events": dict(handler.events),
            "stats": {k: v for k, v in stats.items() if k != "per_layer"}, "samples": samples}


def references(engine, cfg: OffloadConfig, workloads: list[Workload], plan: Plan) -> tuple[list, dict]:
    """Every workload's answer from a cache whose pool holds every expert (made resident), built from
    ``cfg`` (whose ``prefill.routed_max_tokens`` is fixed: see ``run``)."""
    L, E = len(engine.store.layers), engine.store.num_experts
    use_cache(engine, cell_config(cfg, cfg.prefill.hit_copy, L * E))
    engine.cache.set_residency({layer: list(range(E)) for layer in engine.store.layers})
    engine.cache.reset()
    t0 = time.perf_counter()
    answers = [answer(engine, w, plan.new_tokens) for w in tqdm(workloads, desc="references (all resident)")]
    st = engine.cache.stats()
    return answers, {"seconds": time.perf_counter() - t0, "slots": engine.cache.num_slots,
                     "routed_max_tokens": engine.cache.routed_max_tokens, "hit_rate": st["hit_rate"], **_counters(st)}


def _graph_note(engine, cfg: OffloadConfig, workloads: list[Workload]) -> str | None:
    staged = {w.batch * w.prompt_len for w in workloads if w.batch * w.prompt_len > engine.cache.routed_max_tokens}
    if engine.device.type != "cuda" or not cfg.compute.cuda_graphs or 2 * len(staged) <= cfg.compute.max_graphs:
        return None
    return (f"{len(staged)} staged prefill token counts x 2 staging buffers = {2 * len(staged)} prefill graph keys > "
            f"compute.max_graphs={cfg.compute.max_graphs}: graphs are dropped and captured again (LRU), so device "
            "memory between requests depends on which are kept; lower --workloads or raise compute.max_graphs")


def run(cfg: OffloadConfig, plan: Plan, notes: list[str], on_progress=None) -> dict:
    """References and soaks on one engine (one pinned store). ``prefill.routed_max_tokens: auto`` is resolved
    per cache from its resident fraction (``prefill_path.py``), and a forward on the routed path computes
    with other kernels than on the staged path: so each residency's threshold is resolved on its own pool,
    then fixed for its reference cache, and the references are computed once per distinct threshold.
    ``on_progress(part)`` gets the result so far (``part`` as returned, the running residency last) every
    ``CHECKPOINT_S`` seconds."""
    from moe_offload.checkpoint.reader import CheckpointReader
    from moe_offload.engine import Engine, ensure_checkpoint

    path = ensure_checkpoint(cfg.model)
    reader = CheckpointReader(path)
    geo, max_pos = reader.geometry, reader.config.get("max_position_embeddings")
    if max_pos and cfg.decode.max_cache_len > max_pos:
        raise BenchError(f"the longest prompt + --new-tokens + 1 = {cfg.decode.max_cache_len} exceeds the model's "
                         f"max_position_embeddings={max_pos}; lower --prompt-lens or --new-tokens")
    E, L = geo.num_experts, len(geo.moe_layers)
    counts = {r: math.floor(r * E + 0.5) for r in plan.residencies}
    slots = pool_slots("residency", counts, L, geo.top_k)
    hit = cfg.prefill.hit_copy
    engine = Engine.from_config(cell_config(cfg, hit, slots[plan.residencies[0]]))
    workloads = make_workloads(plan, geo.vocab)
    warm_passes = max(WARM_PASSES, cfg.compute.graph_after)
    sets = resident_sets(engine.store.layers, E, counts, plan.seed)
    refs: dict[int, tuple[list, dict]] = {}
    runs = []
    store = engine.store.describe()

    def part_of(runs_so_far: list[dict]) -> dict:
        return {"path": path, "geometry": geo, "store": store, "workloads": workloads,
                "references": [info for _, info in refs.values()], "warm_passes": warm_passes, "runs": runs_so_far}

    for k, r in enumerate(plan.residencies):
        if k:
            use_cache(engine, cell_config(cfg, hit, slots[r]))
        threshold = engine.cache.routed_max_tokens
        rcfg = cfg.model_copy(deep=True)
        rcfg.prefill.routed_max_tokens = threshold  # validated on assignment
        if threshold not in refs:
            refs[threshold] = references(engine, rcfg, workloads, plan)
            use_cache(engine, cell_config(rcfg, hit, slots[r]))
        note = _graph_note(engine, cfg, workloads)
        if note and note not in notes:
            notes.append(note)
        engine.cache.set_residency(sets[r])
        engine.cache.reset()
        head = {"resident_per_layer": counts[r], "slots": engine.cache.num_slots, "routed_max_tokens": threshold}

        def progress(record, head=head):
            # copies: deriving a report pops keys from its runs, and the finished ones are still this run's
            on_progress(part_of(copy.deepcopy(runs) + [{**head, **record}]))

        runs.append({**head, **soak_residency(engine, r, workloads, refs[threshold][0], plan, warm_passes,
                                              plan.seed + 1 + k, progress if on_progress else None)})
    part = part_of(runs)
    engine.close()
    return part


def assemble(a: argparse.Namespace, cfg: OffloadConfig, plan: Plan, part: dict, notes: list[str],
             started: str) -> dict:
    from moe_offload.bench import env
    from moe_offload.config import config_to_dict
    from moe_offload.engine import resolve_device

    geo, store = part["geometry"], part["store"]
    return {
        "schema": "moe-offload/bench-soak/1",
        "created": started,
        **env.environment(resolve_device(cfg.device), a.git_sha),
        "model": env.model_section(cfg, part["path"], geo, store),
        "config": config_to_dict(cfg),
        "config_note": "cache.budget is set per residency (see runs[*].slots), prefill.routed_max_tokens is fixed "
                       "per residency to what auto resolves on its pool (runs[*].routed_max_tokens) and the same in "
                       "its reference, whose pool holds every expert",
        "settings": {"residencies": list(plan.residencies), "minutes": plan.minutes,
                     "prompt_lens": list(plan.prompt_lens), "prompt_len_draw": "log-uniform, rounded",
                     "max_batch": plan.max_batch, "max_batch_tokens": plan.max_batch_tokens,
                     "new_tokens": plan.new_tokens, "workloads": plan.workloads, "sample_s": plan.sample_s,
                     "seed": plan.seed, "warm_passes": part["warm_passes"], "warmup_fraction": WARMUP_FRACTION,
                     "residency_sets": "first round(r*E) experts of a seeded per-layer permutation (nested)",
                     "comparison": "greedy token ids, exact"},
        "workloads": [{"index": w.index, "prompt_len": w.prompt_len, "batch": w.batch} for w in part["workloads"]],
        "references": part["references"],
        "runs": part["runs"],
        "notes": notes,
    }


def main(a: argparse.Namespace) -> int:
    from moe_offload.bench import soak_report
    from moe_offload.bench.env import check_out_dir

    check_out_dir(a.out)
    if a.merge:
        log.configure()
        docs = []
        for p in a.merge:
            try:
                docs.append(json.loads(Path(p).read_text()))
            except (OSError, ValueError) as exc:
                raise ValueError(f"--merge {p}: cannot read it as JSON ({exc}); pass the JSON files bench soak wrote") \
                    from None
        result = soak_report.merge(docs, a.merge)
    else:
        started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        cfg, plan, notes = bench_config(a)
        log.configure(cfg.logging.level, cfg.logging.format)

        def write_partial(part: dict) -> None:
            soak_report.write_partial(assemble(a, cfg, plan, part, list(notes), started), Path(a.out))

        soak_report.load_plotting()
        part = run(cfg, plan, notes, write_partial)
        result = assemble(a, cfg, plan, part, notes, started)
        soak_report.derive(result)
    paths = soak_report.write(result, Path(a.out))
    print(json.dumps(result, indent=2, default=str) if a.json else paths["markdown_text"])
    log.info_rank0("bench_soak_written", json=str(paths["json"]), markdown=str(paths["md"]),
                   png=str(paths["png"]) if paths["png"] else None, passed=result["passed"])
    return 0 if result["passed"] else 1
