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
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from moe_offload import log
from moe_offload.bench.env import add_git_sha_argument
from moe_offload.bench.soak_sampler import Sampler, WarningCounter
from moe_offload.bench.sweep import cell_config, pool_slots, resident_sets, use_cache
from moe_offload.bench.ttft import BenchError, _csv
from moe_offload.config import OffloadConfig, load_config, seed_arg
from moe_offload.serve.consistency import first_difference as first_index

# The embedded default is the CI smoke test: seconds on a CPU, so short prompts, small batches.
DEFAULTS = {"smoke": {"prompt_lens": "16..256", "max_batch": 3, "max_batch_tokens": 1024, "new_tokens": 8,
                      "workloads": 6, "minutes": 0.1},
            "model": {"prompt_lens": "16..8192", "max_batch": 4, "max_batch_tokens": 16384, "new_tokens": 32,
                      "workloads": 8, "minutes": 5.0}}
WARM_PASSES = 2  # passes over the workloads before the warmup may end (at least compute.graph_after: module doc)
WARMUP_FRACTION = 0.2  # and at least this fraction of the residency's run
MISMATCHES_KEPT = 20  # mismatches described in the JSON (all are counted)
#: a partial report (the same files, ``"partial"`` set) is written this often while a residency runs, so a run cut
#: short (a command's time limit, a machine taken back) still leaves its samples and verdicts so far
CHECKPOINT_S = 60.0


@dataclass(frozen=True)
class Plan:
    residencies: tuple[float, ...]
    minutes: float
    prompt_lens: tuple[int, int]  # inclusive range, drawn log-uniform
    max_batch: int
    max_batch_tokens: int
    new_tokens: int
    workloads: int
    sample_s: float
    seed: int


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, s = DEFAULTS["model"], DEFAULTS["smoke"]

    def both(key: str) -> str:
        return f"(default {d[key]}; {s[key]} for the tiny presets)"

    p.add_argument("--config", help="YAML config (default: the embedded tiny model, the CI smoke test)")
    p.add_argument("--residencies", default="0.1,0.5",
                   help="comma-separated fractions of each layer's experts resident, soaked in turn (default %(default)s)")
    p.add_argument("--minutes", type=float, help=f"minutes of requests per residency {both('minutes')}; when the "
                   "warm passes over the workloads take longer than a fifth of it, the run is extended so that four "
                   "fifths of it follow them")
    p.add_argument("--prompt-lens", help=f"LO..HI prompt tokens, drawn log-uniform {both('prompt_lens')}")
    p.add_argument("--max-batch", type=int, help=f"largest batch of a workload {both('max_batch')}")
    p.add_argument("--max-batch-tokens", type=int, help="largest batch x prompt tokens of a workload (long prompts "
                   f"come in smaller batches) {both('max_batch_tokens')}")
    p.add_argument("--new-tokens", type=int, help=f"greedy tokens decoded per request {both('new_tokens')}")
    p.add_argument("--workloads", type=int, help=f"seeded workloads with reference answers {both('workloads')}")
    p.add_argument("--sample-s", type=float, default=2.0, help="seconds between memory samples (default %(default)s)")
    p.add_argument("--seed", type=seed_arg, default=0, help="seed of the workloads, their order and the resident sets")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    p.add_argument("--out", default="benchmarks/results", help="directory for the JSON, markdown and PNG "
                   "(default %(default)s)")
    add_git_sha_argument(p)
    p.add_argument("--json", action="store_true", help="print the JSON result instead of the markdown report")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="run nothing: write one report (JSON, markdown, PNG) "
                   "from the runs of earlier soak results of the same model and settings, e.g. one residency per "
                   "command where a command's length is limited")


def _range(text: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in str(text).split(".."))
    except ValueError:
        raise BenchError(f"--prompt-lens {text!r}: expected LO..HI, e.g. 16..8192") from None
    if not 1 <= lo <= hi:
        raise BenchError(f"--prompt-lens {text!r}: expected 1 <= LO <= HI, e.g. 16..8192")
    return lo, hi


def make_plan(a: argparse.Namespace, cfg: OffloadConfig) -> Plan:
    """The soak from the options; a tiny preset (the embedded default) gets the smoke-test defaults."""
    d = DEFAULTS["smoke" if cfg.model.checkpoint is None and cfg.model.preset.startswith("tiny-") else "model"]

    def pick(name: str):
        value = getattr(a, name)
        return d[name] if value is None else value

    res = _csv(a.residencies, "--residencies", float, lambda r: 0.0 <= r < 1.0,
               "fractions in [0, 1), e.g. 0.1,0.5 (1 is the reference itself)")
    plan = Plan(res, float(pick("minutes")), _range(pick("prompt_lens")), pick("max_batch"), pick("max_batch_tokens"),
                pick("new_tokens"), pick("workloads"), a.sample_s, a.seed)
    for name, value in (("--max-batch", plan.max_batch), ("--new-tokens", plan.new_tokens),
                        ("--workloads", plan.workloads)):
        if value < 1:
            raise BenchError(f"{name} must be >= 1, got {value}")
    if plan.max_batch_tokens < plan.prompt_lens[1]:
        raise BenchError(f"--max-batch-tokens {plan.max_batch_tokens} is below the longest prompt "
                         f"({plan.prompt_lens[1]}): a workload of one such prompt would not fit; raise it")
    if not plan.minutes > 0 or not plan.sample_s > 0:
        raise BenchError(f"--minutes and --sample-s must be > 0, got {plan.minutes} and {plan.sample_s}")
    return plan


def bench_config(a: argparse.Namespace) -> tuple[OffloadConfig, Plan, list[str]]:
    """Config file (or embedded default) < --set; then what the soak needs whatever --set says (module doc)."""
    cfg = load_config(a.config, a.set)
    plan = make_plan(a, cfg)
    if cfg.parallel.tp > 1:
        raise BenchError("bench soak runs at parallel.tp=1 (a TP soak is not written yet)")
    forced = {"decode.max_tokens": max(cfg.decode.max_tokens, plan.max_batch),
              "decode.max_cache_len": max(plan.prompt_lens[1] + plan.new_tokens + 1, 16),
              "decode.temperature": 0.0, "decode.stop_token_ids": []}
    notes = [f"--set {key} is replaced: the soak sets it itself"
             for key in sorted({s.split("=", 1)[0].strip() for s in a.set} & {*forced, "cache.budget"})]
    for key, value in forced.items():
        setattr(cfg.decode, key.split(".")[1], value)  # validated on assignment
    return cfg, plan, notes


# ---------------------------------------------------------------------------------------- workloads
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
