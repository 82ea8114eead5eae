"""Where a decode step's time goes: kernels per step and GPU time per kernel (torch profiler over eager
steps), and the GPU time of one graph replay against the wall time per step.

    python benchmarks/profile_decode.py --config configs/qwen3-30b-a3b-nvfp4.yaml --layers 48 [--batch 1,16,64] --out DIR

Writes ``profile-decode-<label>.json`` and ``.txt`` (the profiler's table) under ``--out``, one per batch size;
the JSON's ``graph_kernels`` is the graph replay's GPU time per kernel name per step (what a captured step
spends where), beside ``graph_busy_ms`` (kernel time summed) and the replay's own GPU time (the gap between
them is launch latency and bubbles between dependent kernels).

That gap is split by ``boundary_gaps``: the idle time between consecutive kernels inside a replay (below
``HOST_GAP_US``, per kernel-to-kernel transition: what programmatic dependent launch can shorten) and the longer
idle stretches while the host works between steps (the loop's argmax and token read, the token copy, the graph
launch). At bb13400 on an H100, batch 16, 8 layers: 0.52 us a boundary, 144 boundaries a step (75 us against
1.71 ms of kernels, 4 %); the rest of the event-timed step's 2.30 ms is the host's, which a 48-layer step
amortizes over six times the kernels.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from moe_offload.bench.sweep import resident_sets
from moe_offload.config import load_config
from moe_offload.decode_graph import StaticDecoder
from moe_offload.engine import Engine


#: a gap between two consecutive GPU events at least this long is the host's (the next step's token), not a
#: kernel-to-kernel boundary inside a replay (those measured 0.2-5 us on an H100, the host's 20-140 us)
HOST_GAP_US = 10.0


def boundary_gaps(trace: list[dict], steps: int, host_gap_us: float = HOST_GAP_US, top: int = 24) -> dict:
    """Idle GPU time between consecutive events of ``trace`` (``name``, ``start_us``, ``us``; start order) over
    ``steps`` steps: the sum of gaps shorter than ``host_gap_us`` (inside a replay) and of the longer ones (the
    host's), per step, and the short ones per transition (``from`` -> ``to``), largest total first."""
    inside: dict[tuple[str, str], list[float]] = {}
    host = 0.0
    for prev, nxt in zip(trace, trace[1:]):
        gap = max(0.0, nxt["start_us"] - (prev["start_us"] + prev["us"]))
        if gap >= host_gap_us:
            host += gap
        else:
            inside.setdefault((prev["name"], nxt["name"]), []).append(gap)
    count = sum(len(v) for v in inside.values())
    total = sum(sum(v) for v in inside.values())
    rows = sorted(inside.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"host_gap_us": host_gap_us, "inside_us_per_step": total / steps, "host_us_per_step": host / steps,
            "boundaries_per_step": count / steps, "inside_us_per_boundary": total / count if count else 0.0,
            "by_transition": [{"from": a, "to": b, "count_per_step": len(v) / steps, "mean_us": sum(v) / len(v),
                               "us_per_step": sum(v) / steps} for (a, b), v in rows]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--residency", type=float, default=1.0)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--batch", default="1", help="comma-separated batch sizes (sequences per step)")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    sets = [f"model.layers={a.layers}"] if a.layers else []
    budget = f"cache.budget={max(a.residency, 0.01)}"  # the pool holds exactly the resident experts
    cfg = load_config(a.config, [*sets, budget, f"decode.max_cache_len={a.prompt_len + 4 * a.steps + 8}", *a.set])
    eng = Engine.from_config(cfg, progress=False)
    E = eng.store.num_experts
    n = round(a.residency * E)
    eng.cache.set_residency(resident_sets(eng.store.layers, E, {a.residency: n}, 0)[a.residency])
    for batch in [int(b) for b in a.batch.split(",")]:
        profile_batch(eng, cfg, a, batch)
    eng.close()
    return 0


def profile_batch(eng: Engine, cfg, a, batch: int) -> None:
    """Profile eager and graph-replayed decode steps of ``batch`` sequences; write the JSON and table."""
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(3, eng.reader.geometry.vocab, (batch, a.prompt_len), generator=gen)
    out: dict = {"layers": len(eng.store.layers), "residency": a.residency, "prompt_len": a.prompt_len, "batch": batch}

    def run(dec: StaticDecoder, steps: int, timed: bool = False, profiler=None):
        dec.reset()
        logits = dec.prefill(prompt.to(eng.device))
        torch.cuda.synchronize()
        if profiler is not None:
            profiler.start()  # the decode steps only, not the prefill
        walls, gpus = [], []
        for _ in range(steps):
            tok = logits.argmax(-1)
            t0 = time.perf_counter()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            logits = dec.step(tok)
            end.record()
            int(logits.argmax(-1)[0])  # the token reaches the host, as in generation
            walls.append(time.perf_counter() - t0)
            gpus.append(start.elapsed_time(end) / 1e3)
        if profiler is not None:
            torch.cuda.synchronize()
            profiler.stop()
        return walls, gpus

    def trace(prof) -> list[dict]:
        """The GPU kernels and copies of the profiled steps, in start order (a step's sequence)."""
        evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        evs.sort(key=lambda e: e.time_range.start)
        return [{"name": e.name[:80], "start_us": e.time_range.start, "us": e.time_range.end - e.time_range.start}
                for e in evs]

    eager = StaticDecoder(eng, batch, cfg.decode.max_cache_len, graphs=False)
    run(eager, 3)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    prof = torch.profiler.profile(activities=acts)
    run(eager, 4, profiler=prof)
    out["eager_trace"] = trace(prof)
    events = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = sorted(events, key=lambda e: -e.device_time_total)
    launches = sum(e.count for e in kernels)
    out["eager"] = {"kernels_per_step": launches / 4,
                    "gpu_ms_per_step": sum(e.device_time_total for e in kernels) / 4 / 1e3,
                    "top": [{"name": e.key[:90], "count_per_step": e.count / 4,
                             "gpu_us_per_step": e.device_time_total / 4} for e in kernels[:25]]}
    graphed = StaticDecoder(eng, batch, cfg.decode.max_cache_len, graphs=True)
    run(graphed, 4)
    walls, gpus = run(graphed, a.steps)
    gprof = torch.profiler.profile(activities=acts)
    run(graphed, 2, profiler=gprof)
    out["graph_trace"] = trace(gprof)  # kernels of graph replays, where the profiler sees them
    per_name: dict[str, list[float]] = {}
    for ev in out["graph_trace"]:
        per_name.setdefault(ev["name"], []).append(ev["us"])
    out["graph_kernels"] = sorted(({"name": k, "count_per_step": len(v) / 2, "gpu_us_per_step": sum(v) / 2}
                                   for k, v in per_name.items()), key=lambda d: -d["gpu_us_per_step"])
    out["graph_busy_ms"] = sum(ev["us"] for ev in out["graph_trace"]) / 2 / 1e3
    out["graph_gaps"] = boundary_gaps(out["graph_trace"], 2)
    out["graph"] = {"wall_ms_median": statistics.median(walls) * 1e3, "gpu_ms_median": statistics.median(gpus) * 1e3,
                    "tok_s": 1 / statistics.median(walls), "declined": eng.cache.stats()["declined"]}
    dest = Path(a.out)
    dest.mkdir(parents=True, exist_ok=True)
    label = f"l{out['layers']}-r{a.residency}-b{batch}"
    (dest / f"profile-decode-{label}.json").write_text(json.dumps(out, indent=2))
    (dest / f"profile-decode-{label}.txt").write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
    gaps = out["graph_gaps"]
    print(json.dumps({k: v for k, v in out.items()
                      if k not in ("eager", "eager_trace", "graph_trace", "graph_kernels", "graph_gaps")}
                     | {"eager_kernels_per_step": launches / 4, "graph_kernels": out["graph_kernels"][:12],
                        "graph_gaps": {k: v for k, v in gaps.items() if k != "by_transition"}
                        | {"by_transition": gaps["by_transition"][:6]}}), flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
