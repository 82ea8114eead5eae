"""Where a prefill's time goes: host (Python enqueue) vs device, per op, at chosen residencies.

Runs the real engine on a preset checkpoint (built into ``model.cache_dir`` on first use), makes a
residency deterministic as ``bench ttft`` does, then for each residency:
  * TTFT (synchronized, median of ``--reps``) and the host time of the forward (no sync);
  * cProfile of one prefill's host side: top Python functions by own time;
  * torch.profiler of one prefill: top ops by self CPU time and by device time.
Writes ``profile-<preset>-l<layers>.txt`` and a JSON summary under ``--out``.

    python benchmarks/profile_prefill.py --config configs/qwen3-30b-a3b-nvfp4.yaml --layers 12 \
        --residency 1,0.5 --tokens 1024 --out /tmp/res

With ``--trace`` the report adds where the whole device idles waiting for the host (``device_idle``: per MoE layer,
by the kernels either side). E.g. a routed fill's fixed cost (one routing read a layer, ``prefill.routed_copy``):
``--tokens 16 --residency 0.37 --set prefill.routed_copy=copy_engine --trace``, against ``=uva``.

With ``--host-splits`` each routed fill's host side is timed in three parts (``host_splits`` in the JSON): the
routing read's return to the copy call (``pre_copy_us``: numpy on the ids, the residency lookup, the stream switch,
the pointer arrays; with ``prefill.routed_plan: device`` the plan's launch and read instead; it includes one extra read of the already-read ids, ``reread_us`` measured alone), the copy call
itself (``copy_call_us``, of which ``batch_call_us`` is the ``cudaMemcpyBatchAsync`` call) and the rest of the fill
(``post_copy_us``); plus ``cpu_ref_us``, a fixed numpy/Python workload, to compare this host's CPU with another's.
With the device plan ``pre_copy_us`` is split further: ``plan_pre_us`` (from the routing's return to the program's
launch), ``plan_launch_us`` (the launcher's call) and ``plan_read_us`` (the words' copy, the wait and their parse, to
the copy call); and ``stage_us`` is the host time from the experts call's ``stage_rows`` to the fill (buffer choice,
stream waits), before the extra read. ``benchmarks/plan_latency.py`` times the same steps without a model.
"""

from __future__ import annotations

import argparse
import cProfile
import gzip
import io
import json
import pstats
import statistics
import time
from pathlib import Path

import numpy as np

import torch

from moe_offload.bench.sweep import cell_config, resident_sets, use_cache
from moe_offload.experts import offloaded_experts
from moe_offload.bench.timing import HostTimer
from moe_offload.config import load_config
from moe_offload.engine import Engine


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=None)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--residency", default="1,0.5")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--mode", default="gather", choices=["gather", "batch_memcpy", "off"])
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--trace", action="store_true", help="also write the profiled prefill's chrome trace (gzip) and "
                   "its timeline summary: per-stream busy time, gaps between H2D copies, host calls that blocked")
    p.add_argument("--host-splits", action="store_true", help="time each routed fill's host side in parts "
                   "(module docstring)")
    a = p.parse_args()
    overrides = [f"model.layers={a.layers}"] if a.layers else []
    cfg = load_config(a.config, [*overrides, "prefill.warmup=true", *a.set])
    residencies = [float(r) for r in a.residency.split(",")]
    engine = Engine.from_config(cell_config(cfg, a.mode, 64))  # any pool: use_cache rebuilds it per residency
    E, n_layers = engine.store.num_experts, len(engine.store.layers)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report, summary = io.StringIO(), {"tokens": a.tokens, "mode": a.mode, "cells": []}
    for r in residencies:
        n_res = int(round(r * E))
        slots = max(n_res * n_layers, engine.store.geometry.top_k)
        use_cache(engine, cell_config(cfg, a.mode, slots))
        sets = resident_sets(engine.store.layers, E, {r: n_res}, 0)[r]
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(3, engine.reader.geometry.vocab, (a.tokens,), generator=gen).tolist()
        splits = HostSplits(engine.cache.staging) if a.host_splits else None
        timer = HostTimer(engine.model, offloaded_experts(engine.model))
        ttft, host_fwd, host_exp = [], [], []
        for rep in range(a.reps + 1):
            engine.cache.set_residency(sets)
            engine.cache.reset()
            timer.reset()
            t = engine.measure_ttft(ids)
            if rep:
                ttft.append(t)
                host_fwd.append(timer.forward_s)
                host_exp.append(timer.experts_s)
        timer.remove()
        if splits is not None:
            splits.remove()
        # host-only view: cProfile of one prefill
        engine.cache.set_residency(sets)
        prof = cProfile.Profile()
        engine.cache.synchronize()
        prof.enable()
        engine.measure_ttft(ids)
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(35)
        # op view: torch.profiler of one prefill
        engine.cache.set_residency(sets)
        engine.cache.synchronize()
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts) as tp:
            engine.measure_ttft(ids)
        idle = None
        if a.trace:
            trace = out_dir / f"trace-{cfg.model.preset}-l{n_layers}-r{r}.json"
            tp.export_chrome_trace(str(trace))
            tl = timeline(trace, n_layers)
            idle = tl.get("device_idle")
            report.write("\n## timeline (chrome trace)\n" + json.dumps(tl, indent=1) + "\n")
            with open(trace, "rb") as f_in, gzip.open(str(trace) + ".gz", "wb") as f_out:
                f_out.write(f_in.read())
            trace.unlink()
        ka = tp.key_averages()
        cpu_tab = ka.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=60)
        dev_tab = ka.table(sort_by="self_device_time_total", row_limit=30, max_name_column_width=60)
        dev_total = sum(e.self_device_time_total for e in ka) / 1e3
        cell = {"residency": r, "ttft_ms": statistics.median(ttft) * 1e3, "ttft_reps_ms": [x * 1e3 for x in ttft],
                "host_forward_ms": statistics.median(host_fwd) * 1e3, "host_experts_ms": statistics.median(host_exp) * 1e3,
                "device_self_total_ms": dev_total, "layers": n_layers, "device_idle": idle,
                "host_splits": splits.summary() if splits is not None else None,
                "stats": engine.cache.stats()["total"]}
        summary["cells"].append(cell)
        headline = json.dumps({k: v for k, v in cell.items() if k != "stats"})
        print(headline, flush=True)
        report.write(f"\n\n######## residency {r}: {headline}\n")
        report.write("\n## cProfile (host, one prefill, tottime)\n" + s.getvalue())
        report.write("\n## torch.profiler by self CPU\n" + cpu_tab)
        report.write("\n## torch.profiler by self device time\n" + dev_tab)
    name = f"profile-{cfg.model.preset}-l{n_layers}-{a.tokens}"
    (out_dir / f"{name}.txt").write_text(report.getvalue())
    (out_dir / f"{name}.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"wrote {out_dir / name}.txt", flush=True)
    return 0


class HostSplits:
    """Host time of each routed fill in parts (``--host-splits``), by wrapping the staging's instance methods: the
    routing is read once more up front (a sync that waits for the router, excluded), so ``pre_copy_us`` starts when
    the routing is on the host. The wrappers go with ``remove``."""

    def __init__(self, staging):
        self.staging, self.rows = staging, []
        self._orig = staging._assemble_routed
        h2d = staging.h2d
        self._h2d_copy, self._batch = h2d.copy, h2d.batch
        self._t: dict[str, float] = {}

        def assemble(layer, b, ids_TK):
            stage = time.perf_counter() - self._t.pop("stage0", time.perf_counter())
            ids_TK.cpu()  # the wait for the router, outside the split
            t0 = time.perf_counter()
            self._t.clear()
            self._orig(layer, b, ids_TK)
            t1 = time.perf_counter()
            c0, c1 = self._t.get("copy0", t1), self._t.get("copy1", t1)
            row = {"pre_copy_us": (c0 - t0) * 1e6, "copy_call_us": (c1 - c0) * 1e6,
                   "batch_call_us": self._t.get("batch", 0.0) * 1e6, "post_copy_us": (t1 - c1) * 1e6,
                   "stage_us": stage * 1e6}
            if "plan0" in self._t:
                p0, p1 = self._t["plan0"], self._t["plan1"]
                row.update(plan_pre_us=(p0 - t0) * 1e6, plan_launch_us=(p1 - p0) * 1e6, plan_read_us=(c0 - p1) * 1e6)
            self.rows.append(row)

        import moe_offload.kernels.routed_plan as plan_mod

        self._plan_mod, self._plan_fn = plan_mod, plan_mod.plan_routed_fill

        def plan_fill(*args, **kw):
            self._t["plan0"] = time.perf_counter()
            self._plan_fn(*args, **kw)
            self._t["plan1"] = time.perf_counter()

        plan_mod.plan_routed_fill = plan_fill
        self._stage_rows = stage_rows = staging.wait

        def timed_stage(*args, **kw):
            self._t["stage0"] = time.perf_counter()
            return stage_rows(*args, **kw)

        staging.wait = timed_stage

        def h2d_copy(copies, coalesce):
            self._t["copy0"] = time.perf_counter()
            self._h2d_copy(copies, coalesce)
            self._t["copy1"] = time.perf_counter()

        def h2d_entries(*args):  # prefill.routed_plan: device
            self._t["copy0"] = time.perf_counter()
            self._h2d_entries(*args)
            self._t["copy1"] = time.perf_counter()

        self._h2d_entries = h2d.copy_entries
        staging._assemble_routed, h2d.copy, h2d.copy_entries = assemble, h2d_copy, h2d_entries
        if self._batch is not None:
            batch_copy = self._batch.copy

            def timed_batch(*args):
                t = time.perf_counter()
                batch_copy(*args)
                self._t["batch"] = self._t.get("batch", 0.0) + time.perf_counter() - t

            self._batch_copy = batch_copy
            self._batch.copy = timed_batch

    def remove(self) -> None:
        del self.staging._assemble_routed, self.staging.h2d.copy, self.staging.h2d.copy_entries, self.staging.wait
        self._plan_mod.plan_routed_fill = self._plan_fn
        if self._batch is not None:
            del self._batch.copy

    def summary(self) -> dict:
        out = {"fills": len(self.rows), "reread_us": reread_us(), "cpu_ref_us": cpu_ref_us()}
        for k in ("pre_copy_us", "copy_call_us", "batch_call_us", "post_copy_us", "stage_us", "plan_pre_us",
                  "plan_launch_us", "plan_read_us"):
            v = [r[k] for r in self.rows if k in r]
            out[k] = {"median": round(statistics.median(v), 1), "p90": round(sorted(v)[int(0.9 * (len(v) - 1))], 1)} \
                if v else None
        return out


def reread_us(n: int = 200) -> float:
    """Median host time of reading a small, already computed index tensor back (the extra read in ``HostSplits``)."""
    if not torch.cuda.is_available():
        return 0.0
    x = torch.zeros(16, 8, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        x.cpu()
        t.append(time.perf_counter() - t0)
    return round(statistics.median(t) * 1e6, 1)


def cpu_ref_us(n: int = 200) -> float:
    """Median time of a fixed host workload shaped like a routed fill's (numpy on 128 routed ids of 128 experts,
    a few Python calls): the same on two hosts says how their CPUs compare."""
    gen = np.random.default_rng(0)
    ids, resident = gen.integers(0, 128, 128), gen.integers(-1, 2, 128)
    t = []
    for _ in range(n):
        t0 = time.perf_counter()
        miss = np.flatnonzero((np.bincount(ids, minlength=128) > 0) & (resident < 0))
        brk = np.flatnonzero(np.diff(miss) != 1)
        first = np.concatenate(([0], brk + 1))
        off = miss[first].astype(np.uint64) * np.uint64(2 << 20)
        _ = [off + np.uint64(1), off + np.uint64(2), np.append(brk, miss.size - 1) - first + 1]
        t.append(time.perf_counter() - t0)
    return round(statistics.median(t) * 1e6, 1)


def timeline(trace: Path, layers: int) -> dict:
    """Summary of a chrome trace: per GPU stream its busy ms, first start and last end (ms from the first GPU
    event); the H2D copies' gaps (idle ms between consecutive copies on their stream, the largest 10); the host
    runtime calls that took over 0.5 ms (synchronizations, pageable copies) with their time; the stretches in which
    the whole device idles (``device_idle``), per MoE layer of the ``layers``."""
    events = json.loads(trace.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        return {}
    t0 = min(e["ts"] for e in gpu)
    streams: dict = {}
    for e in gpu:
        sid = e.get("args", {}).get("stream", e.get("tid"))
        st = streams.setdefault(str(sid), {"busy_ms": 0.0, "first_ms": 1e18, "last_ms": 0.0, "n": 0, "h2d": []})
        st["busy_ms"] += e["dur"] / 1e3
        st["first_ms"] = min(st["first_ms"], (e["ts"] - t0) / 1e3)
        st["last_ms"] = max(st["last_ms"], (e["ts"] + e["dur"] - t0) / 1e3)
        st["n"] += 1
        if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", ""):
            st["h2d"].append(((e["ts"] - t0) / 1e3, e["dur"] / 1e3))
    for st in streams.values():
        h = sorted(st.pop("h2d"))
        gaps = [round(b[0] - (a[0] + a[1]), 3) for a, b in zip(h, h[1:])]
        if h:
            st["h2d"] = {"copies": len(h), "ms": round(sum(d for _, d in h), 3), "gaps_ms_top": sorted(gaps)[-10:],
                         "gap_total_ms": round(sum(g for g in gaps if g > 0), 3),
                         "starts_ms": [round(x, 2) for x, _ in h[:64]]}
    slow = [{"name": e["name"], "at_ms": round((e["ts"] - t0) / 1e3, 3), "ms": round(e["dur"] / 1e3, 3)}
            for e in events if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and e.get("dur", 0) > 500]
    return {"streams": streams, "host_calls_over_0.5ms": slow[:60], "device_idle": device_idle(gpu, layers)}


#: an idle stretch of the whole device at least this long waits for the host (kernel-to-kernel boundaries inside a
#: graph replay measured 0.2-5 us on an H100, benchmarks/profile_decode.py)
HOST_GAP_US = 10.0


def device_idle(gpu_events: list[dict], layers: int, host_gap_us: float = HOST_GAP_US, top: int = 12) -> dict:
    """Stretches in which NO stream of the device runs anything (kernels, copies, memsets of a chrome trace: ``ts``,
    ``dur`` in us, ``name``), at least ``host_gap_us`` long: the device waiting for the host (a routed fill's
    routing read, eager launches after it). Total ms, us per MoE layer (``layers``), and the largest totals by the
    transition (the last event to end before the stretch -> the first one after it), truncated names."""
    ev = sorted(gpu_events, key=lambda e: e["ts"])
    gaps: dict[tuple[str, str], list[float]] = {}
    end, last = None, None
    for e in ev:
        if end is not None and e["ts"] - end >= host_gap_us:
            gaps.setdefault((last[:60], e["name"][:60]), []).append(e["ts"] - end)
        if end is None or e["ts"] + e["dur"] >= end:
            end, last = e["ts"] + e["dur"], e["name"]
    total = sum(sum(v) for v in gaps.values())
    rows = sorted(gaps.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {"host_gap_us": host_gap_us, "idle_ms": round(total / 1e3, 3), "stretches": sum(len(v) for v in gaps.values()),
            "idle_us_per_layer": round(total / max(layers, 1), 1),
            "by_transition": [{"after": a, "before": b, "count": len(v), "total_us": round(sum(v), 1),
                               "mean_us": round(sum(v) / len(v), 1)} for (a, b), v in rows]}


if __name__ == "__main__":
    raise SystemExit(main())
