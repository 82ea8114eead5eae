"""One (residency, batch) cell of ``bench decode``: an untimed ``generate_batch``, then the timed ones, and
what the cell reports from them (tok/s, ms per step and their tail, hits and misses, PCIe bytes per step by path,
lookahead, the decode path taken, graph replays). A batch on the staged path has its routing recorded in the
untimed run (``staged_step_counts``), which prices its floor. The sweep over cells is ``decode.py``'s; ``bench
serve`` measures its decode reference with ``measure_cell`` too (``serve/bench_reference.py``)."""

from __future__ import annotations

import math
import statistics
import time

from moe_offload.bench.decode_options import Plan
from moe_offload.bench.sweep import RoutingRecorder
from moe_offload.experts import offloaded_experts


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
        # the link rates that resolution used (or why none were measured): a disturbed start-up measurement shows here
        "link": engine.cache.routed_path.link,
        "miss_copy": stats["routed_path"]["miss_copy"],  # how routed steps copied their misses (decode.miss_copy)
        "graph": {"captures": stats["compute"].get("decode_graph_captures", 0),
                  "replays": stats["compute"].get("decode_graph_replays", 0), "declined": stats["declined"]},
    }
