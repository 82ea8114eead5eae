"""The engine side of ``bench ttft``: one engine (one pinned store), a fresh cache per (mode, prefill
path, pool size), deterministic residency before every repetition, and the figures of each cell.

A cell is (prompt length, variant, residency); a variant is a hit-copy mode and a prefill path
(``staged``, ``routed`` or ``auto``: ``PATHS``). Per repetition: ``cache.set_residency`` (evicts
everything, then makes the cell's experts resident), ``cache.reset``, ``Engine.measure_ttft``
(synchronized, first token sampled); the hit fraction, bytes per copy path and the path the forward
took come from ``cache.stats()`` of that pass, host times from forward hooks. The experts each layer
routed come from the untimed pass of the variant and prompt (``RoutingRecorder``: forward pre-hooks
that keep the ids tensors, read back after the pass), so nothing syncs inside a timed pass; they give
each cell its routed missing experts (routed and not in the cell's resident set).
"""

from __future__ import annotations

import gc
import logging
import statistics
from typing import Callable

import numpy as np
import torch
from tqdm.auto import tqdm

from moe_offload import log
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


#: how each prefill path is forced (``prefill.routed_max_tokens``; ``path_settings``)
PATHS = ("staged", "routed", "auto")


def path_settings(path: str, cfg: OffloadConfig, prompt_lens) -> dict:
    """``{section: {key: value}}`` that make every prompt of ``prompt_lens`` take ``path``: ``staged`` lowers
    decode.max_tokens below the shortest prompt, ``routed`` raises the threshold to the longest, ``auto``
    is the runtime's own choice (prefill_path.py)."""
    if path == "staged":
        return {"prefill": {"routed_max_tokens": 0},
                "decode": {"max_tokens": max(1, min(cfg.decode.max_tokens, min(prompt_lens) - 1))}}
    if path == "routed":
        return {"prefill": {"routed_max_tokens": max(prompt_lens)}}
    return {"prefill": {"routed_max_tokens": "auto"}}


def cell_config(cfg: OffloadConfig, mode: str, slots: int, path: str | None = None,
                prompt_lens: tuple[int, ...] = ()) -> OffloadConfig:
    """``cfg`` with the prefill settings of ``mode`` (and of prefill ``path`` for ``prompt_lens``) and a
    pool of ``slots`` slots."""
    c = cfg.model_copy(deep=True)
    for key, value in MODES[mode].items():
        setattr(c.prefill, key, value)  # validated on assignment
    if path is not None:
        for section, values in path_settings(path, cfg, prompt_lens).items():
            for key, value in values.items():
                setattr(getattr(c, section), key, value)
    c.cache.budget = f"{slots} slots"
    return c


def variant_label(mode: str, path: str, paths: tuple[str, ...]) -> str:
    """Column name of a (mode, path): the mode alone when one path is measured."""
    return mode if len(paths) == 1 else f"{mode}/{path}"


class RoutingRecorder:
    """The routed ids of every experts call of one forward, from forward pre-hooks that keep references
    (no sync); ``distinct()`` reads them back after the forward (HOST SYNC: call it outside timing).
    ``rows``: keep only calls of exactly that many rows (a decode step of a batch of ``rows`` sequences; the
    prompt's long forwards would hold device memory for nothing). ``residency``: ``layer -> [E] bool`` host array,
    taken at each kept call (what was resident when it started; ``calls``)."""

    def __init__(self, experts: list[torch.nn.Module], rows: int | None = None, residency=None):
        self._ids: dict[int, list[torch.Tensor]] = {}
        self._resident: dict[int, list[np.ndarray]] = {}
        self._rows, self._residency = rows, residency
        self._handles = [m.register_forward_pre_hook(self._pre, with_kwargs=True) for m in experts]

    def _pre(self, module, args, kwargs) -> None:
        ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
        if self._rows is not None and ids.shape[0] != self._rows:
            return
        self._ids.setdefault(module.layer_idx, []).append(ids)
        if self._residency is not None:
            self._resident.setdefault(module.layer_idx, []).append(self._residency(module.layer_idx))

    def distinct(self) -> dict[int, np.ndarray]:
        """``{layer: sorted distinct expert ids}`` routed since the recorder was made."""
        return {layer: np.unique(torch.cat([t.reshape(-1) for t in ts]).cpu().numpy())
                for layer, ts in self._ids.items()}

    def calls(self) -> dict[int, list[tuple[np.ndarray, np.ndarray | None]]]:
        """``{layer: [(sorted distinct expert ids, the residency taken at the call or None) of each kept call, in
        call order]}`` (HOST SYNC)."""
        out = {}
        for layer, ts in self._ids.items():
            taken = self._resident.get(layer, [None] * len(ts))
            out[layer] = [(np.unique(t.cpu().numpy()), res) for t, res in zip(ts, taken)]
        return out

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def routed_missing(routed: dict[int, np.ndarray], resident: dict[int, list[int]]) -> tuple[int, int]:
    """(distinct routed experts, those not resident), summed over layers."""
    total = missing = 0
    for layer, ids in routed.items():
        total += int(ids.size)
        missing += int(np.setdiff1d(ids, np.asarray(resident.get(layer, []), dtype=ids.dtype)).size)
    return total, missing


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
    from moe_offload.engine import make_cache

    # the old decoders' graphs, static KV caches and the old pool and staging go before the new ones are allocated
    # (on an 80 GB H100 at 8505610 the decode sweep's batch-64 cell at residency 0.37 ran out of memory; the decoders
    # of the previous residency, alive until replace_cache, were one avoidable share of it)
    engine.drop_decoders()
    engine.cache.close()
    free_memory()
    engine.replace_cache(make_cache(engine.store, cfg, engine.device, cfg.compute.backend != "torch"))
    engine.cfg = cfg
    if cfg.prefill.warmup:
        engine.warmup()
    else:
        engine.cache.resolve_hit_path()


def oom_line(exc: BaseException) -> str | None:
    """The first line of ``exc`` when it says the device ran out of memory (``budget.is_device_oom``), else None: a
    bench reports such a cell in its place and runs the others; any other error stops the run."""
    from moe_offload.budget import error_line, is_device_oom

    return error_line(exc) if is_device_oom(exc) else None


def failed_cell(engine, first: str, fix: str, **where) -> str:
    """A cell that ran out of device memory (``first``: the error's first line; call it after the ``except`` block,
    whose traceback still holds the cell's objects): drop the engine's batch decoders (graphs, static KV caches),
    reset the cache and return cached device memory, log one ``bench_cell_failed`` event with ``where`` (the
    cell's coordinates) and return the error a report prints for the cell, ending with ``fix``."""
    engine.drop_decoders()
    engine.cache.reset()
    free_memory()
    log.event("bench_cell_failed", logging.WARNING, **where, reason="out_of_memory", detail=first)
    return f"out of device memory ({first}); {fix}"


def free_memory() -> None:
    """Collect what was dropped (an engine's device pools, its pinned store) and return cached device
    memory, so that what runs next (the peers) gets it."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "reps": values}


def measure_cell(engine, timer: HostTimer, ids: list[int], resident: dict, reps: int) -> dict:
    """``reps`` TTFTs of ``ids`` with exactly ``resident`` experts resident at the start of each. With observed
    routing (``prefill.routed_adaptive_max_tokens``) two untimed passes of ``ids`` come first, so every timed
    rep is decided by this length's own observed spread, as in a server that has seen such prompts. Untimed
    passes also run and capture the length's prefill graph where one applies (``prefill.cuda_graphs``: its
    first padded forward eager, the second captured), so the timed reps replay it, as a server does for a
    length it has seen: 2 passes, 4 with observed routing (a length it routes is eligible from its 3rd
    forward on; measured at da1eb4a on the H200: with 2, the 3 timed reps were eager, capture, replay)."""
    ttft, host_fwd, host_layer, paths = [], [], [], []
    stats = {}
    if engine.cache.observed is not None:
        engine.cache.forget_observations()  # other lengths of the same power-of-two bucket must not count
    for _ in range(4 if engine.cache.observed is not None else 2):
        engine.cache.set_residency(resident)
        engine.measure_ttft(ids)
    for _ in range(reps):
        engine.cache.set_residency(resident)
        engine.cache.reset()
        timer.reset()
        ttft.append(engine.measure_ttft(ids))
        stats = engine.cache.stats()
        paths.append(taken_path(stats))
        host_fwd.append(timer.forward_s)
        host_layer.append(timer.experts_s / max(timer.experts_calls, 1))
    tot = stats["total"]
    b = tot["bytes"]
    looked = tot["prefill_hits"] + tot["prefill_misses"]
    return {
        "hit_fraction": tot["prefill_hits"] / looked if looked else None,
        "ttft_s": _summary(ttft),
        "path": paths[0] if len(set(paths)) == 1 else "mixed",  # mixed: reps (or a pass's chunks) differ
        "routed_max_tokens": stats["routed_path"]["max_tokens"],
        "routed_plan": stats["routed_path"]["routed_plan"],  # how a routed fill finds its copies (prefill.routed_plan)
        "miss_copy": stats["routed_path"]["miss_copy"],  # how routed forwards copied their misses (decode.miss_copy)
        # the last rep's routed fills, those whose plan a prefill graph ran (routed_plan graph), and why captures
        # declined to take it: a cell labelled graph whose fills planned eagerly shows it here
        "fills": {"routed": stats["compute"].get("prefill_routed_fills", 0),
                  "planned_in_graph": stats["compute"].get("prefill_graph_planned_fills", 0),
                  "plan_declined": {k: v for k, v in stats["declined"].items() if k.startswith("routed_plan")}},
        # the link rates this cell's cache measured at start-up (or why not), which its path choices used: a cell
        # whose rates stand apart from the others' was decided on a disturbed measurement (HISTORY.md "04e15c0")
        "link": stats["routed_path"]["link"],
        "routed_pair_hit_rate": stats["hit_rate"],
        "hit_path": stats["hit_path"],
        "hit_d2d_fallbacks": stats["hit_d2d_fallbacks"],
        "prefills": stats["prefills"],
        "bytes": {"h2d": b["prefill_full_h2d"] + b["prefill_miss_h2d"] + b["prefill_routed_h2d"],
                  "d2d": b["prefill_hit_d2d"] + b["prefill_hit_gather"], "uva": b["decode_uva"],
                  **{k: v for k, v in b.items() if k.startswith("prefill_")}},
        "host": {"forward_s": statistics.median(host_fwd), "experts_per_layer_s": statistics.median(host_layer)},
    }


def taken_path(stats: dict) -> str:
    """``staged`` (every forward of the pass staged its layers), ``routed`` (every forward read only its
    routed experts: the decode path), ``routed_fills`` (staged passes that copied only the routed misses,
    ``prefill.routed_copy``) or ``mixed`` (a chunked prompt whose chunks went both ways)."""
    staged, routed = stats["prefills"] > 0, stats["decode_steps"] > 0
    if staged and not routed and stats["compute"].get("prefill_routed_fills", 0):
        return "routed_fills"
    return "mixed" if staged and routed else "staged" if staged else "routed"


def sweep(engine, cfg: OffloadConfig, plan, prompts: dict[int, list[int]], counts: dict[float, int],
          slots: dict[float, int], show_bar: bool = True, on_cell: Callable[[dict], None] | None = None,
          on_progress: Callable[[dict], None] | None = None) -> dict:
    """Every cell of ``plan`` on ``engine`` (built for ``plan.modes[0]`` and ``plan.paths[0]`` at the first
    residency's pool); returns ``{"cells", "modes", "failed_cells"}`` (``modes`` keyed by variant label).
    ``on_cell(cell)`` runs after each cell (TP: per-rank figures). Without ``on_cell`` a cell that runs out of
    device memory goes to ``failed_cells`` (its coordinates and the error) instead of stopping the sweep; the
    report lists it, its targets read "needs ...", and ``bench ttft`` exits 1. ``on_progress(part)`` runs after
    each cell, measured or failed, with the part so far (the partial report)."""
    first = plan.residencies[0]
    E, R = engine.store.num_experts, engine.store.bytes_per_expert
    sets = resident_sets(engine.store.layers, E, counts, plan.seed)
    experts = offloaded_experts(engine.model)
    timer = HostTimer(engine.model, experts)
    cells, modes, failed = [], {}, []
    part = {"cells": cells, "modes": modes, "failed_cells": failed}
    current = (plan.modes[0], plan.paths[0], slots[first])
    bar = tqdm(total=len(plan.modes) * len(plan.paths) * len(plan.prompt_lens) * len(plan.residencies),
               desc="ttft cells", unit="cell", disable=not show_bar)
    for mode in plan.modes:
        for path in plan.paths:
            label = variant_label(mode, path, plan.paths)
            routed: dict[int, dict] = {}
            for r in plan.residencies:
                ccfg = cell_config(cfg, mode, slots[r], path, plan.prompt_lens)
                if (mode, path, slots[r]) != current:
                    use_cache(engine, ccfg)
                    current = (mode, path, slots[r])
                modes.setdefault(label, {**MODES[mode], "mode": mode, "prefill_path": path,
                                         "hit_path": engine.cache.hit_path, "prefill": ccfg.prefill.model_dump(),
                                         "decode_max_tokens": ccfg.decode.max_tokens,
                                         "routed_path": engine.cache.routed_path.to_dict()})
                for n in plan.prompt_lens:
                    bar.set_postfix(variant=label, tokens=n, residency=r)
                    where = {"prompt_len": n, "mode": mode, "prefill_path": path, "variant": label, "residency": r,
                             "resident_per_layer": counts[r], "resident_fraction": counts[r] / E,
                             "slots": engine.cache.num_slots}
                    failure = None
                    try:
                        if r == first:  # untimed: first pass of this shape and variant (allocator, kernel caches)
                            engine.cache.set_residency(sets[r])
                            recorder = RoutingRecorder(experts)
                            try:  # eager and unpadded: every experts call runs (no graph replay) on the prompt alone
                                engine.prefill(prompts[n], last_only=True)
                            finally:
                                recorder.remove()
                            routed[n] = recorder.distinct()
                        if n not in routed:  # its first pass ran out of memory: no routing to price it by
                            failure = f"the untimed first pass at residency {first:g} failed"
                        else:
                            total, missing = routed_missing(routed[n], sets[r])
                            cell = {**where, "routed_experts": total, "routed_missing_experts": missing,
                                    "routed_missing_bytes": missing * R,
                                    **measure_cell(engine, timer, prompts[n], sets[r], plan.reps)}
                    except Exception as exc:  # noqa: BLE001 - only running out of device memory is a reported cell
                        # under TP the ranks run collectives in lockstep: one rank skipping a cell would hang them
                        if on_cell is not None or (failure := oom_line(exc)) is None:
                            raise
                    if failure is not None:  # outside the except: its traceback no longer holds the cell's tensors
                        failed.append({**where, "error": failed_cell(
                            engine, failure, "this prompt does not fit beside the slot pool: run it with a smaller "
                            "--prompt-lens or prefill.chunk_tokens, or on a larger GPU",
                            prompt_len=n, variant=label, residency=r)})
                    else:
                        if on_cell is not None:
                            on_cell(cell)
                        cells.append(cell)
                    bar.update(1)
                    if on_progress is not None:
                        on_progress(part)
    bar.close()
    timer.remove()
    return part
