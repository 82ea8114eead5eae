"""Measure the prefill copy paths on one GPU and write JSON + a markdown table (about a minute on an H200).

    python benchmarks/copy_paths.py [--out benchmarks/results] [--json] [--reps 5]

What it measures, with CUDA events (device ms) and perf_counter (host ms), medians over --reps:
- floors: H2D bandwidth (pinned, one 1 GiB copy) and D2D bandwidth, the denominators of every ratio;
- per model shape (Qwen3-30B-A3B NVFP4, Flash-Next-like NVFP4, Qwen3-30B-A3B bf16), a full layer of hits
  slot -> staging: one batched cudaMemcpyBatchAsync call for all banks, the SM gather (one launch per
  bank), a per-row ``copy_`` loop, and the full-layer H2D copy the runtime falls back to;
- H2D misses (half the experts, random): per-row vs coalesced runs, as ``copy_`` loops and batch calls;
- mixed small (< 256 KiB) + large entries vs large only: host time of the batch call, and whether the
  host blocks (the call is made behind a ~5 ms spin kernel; an asynchronous call returns long before);
- the hit copies again while a bf16 GEMM runs on another stream (the prefill pipeline's situation):
  added wall time over the GEMM alone, per model shape and per bank row size. The per-row-size winner
  becomes ``hit_copy_choice`` (the schema of a device entry of kernels/hit_copy_table.json);
- host time of one 512-entry batch call (64 KiB entries, D2D and H2D).
Legend: E experts, S slots (2E), R row bytes; banks are uint8 [rows, R].
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from moe_offload.kernels import batch_memcpy as bm
from moe_offload.kernels import batch_memcpy_probe as bmp
from moe_offload.kernels.copy import gather_rows

SMALL_ENTRY = 256 << 10  # entries below this are "small" in the mixed-size measurement
GEMM_N, GEMM_COUNT = 8192, 6  # concurrent work: 6 x 8192^3 bf16 matmuls (~10 ms on an H200)
SWEEP_ROWS = 128  # rows gathered per row size in the sweep (from a 256-slot pool)


def nvfp4_banks(h: int, i: int) -> list[tuple[str, int]]:
    """Per-expert NVFP4 banks: packed E2M1 codes (2 per byte), E4M3 scales (1 per 16), 3 fp32 globals."""
    return [("w13_packed", 2 * i * h // 2), ("w13_scales", 2 * i * h // 16), ("w2_packed", h * i // 2),
            ("w2_scales", h * i // 16), ("globals", 12)]


MODELS = {
    "qwen3-30b-a3b-nvfp4": {"experts": 128, "banks": nvfp4_banks(2048, 768)},
    "flash-next-nvfp4": {"experts": 512, "banks": nvfp4_banks(2560, 640)},
    "qwen3-30b-a3b-bf16": {"experts": 128, "banks": [("w13", 2 * 768 * 2048 * 2), ("w2", 2048 * 768 * 2)]},
}


def timed(stream: torch.cuda.Stream, fn: Callable[[torch.cuda.Stream], None], reps: int) -> dict[str, float]:
    """Median device ms (events around the work on ``stream``) and host ms of ``fn(stream)``."""
    dev, host = [], []
    for rep in range(reps + 1):  # rep 0 warms up
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            t0 = time.perf_counter()
            fn(stream)
            t1 = time.perf_counter()
            end.record(stream)
        end.synchronize()
        if rep:
            dev.append(start.elapsed_time(end))
            host.append((t1 - t0) * 1e3)
    return {"device_ms": statistics.median(dev), "host_ms": statistics.median(host)}


def blocking(stream: torch.cuda.Stream, fn: Callable, idle: dict[str, float], spin_cycles: int,
             spin_ms: float) -> dict[str, Any]:
    """Whether the batch call makes the host wait for the copy, not just spend CPU time on it.

    ``idle`` is :func:`timed` of ``fn`` on an idle stream. The call is repeated behind a spin kernel of
    ``spin_ms``: host time that collapses behind the spin was waiting on the copy (the stream was idle),
    host time that grows by the spin waited on the stream; host time that stays put is CPU cost.
    """
    host = []
    for _ in range(3):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(spin_cycles)
            t0 = time.perf_counter()
            fn(stream)
            host.append((time.perf_counter() - t0) * 1e3)
        stream.synchronize()
    behind = statistics.median(host)
    return {"host_ms_behind_spin": behind, "spin_ms": spin_ms,
            "host_waits_when_stream_idle": idle["host_ms"] > 0.5 * idle["device_ms"] and idle["host_ms"] > 2 * behind,
            "host_waits_behind_busy_stream": behind - idle["host_ms"] > 0.5 * spin_ms}


class Gemm:
    """bf16 matmuls on their own stream: the compute the copies must hide behind."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)
        self.a = torch.randn(GEMM_N, GEMM_N, device=device, dtype=torch.bfloat16)
        self.c = torch.empty_like(self.a)
        self.stream.wait_stream(torch.cuda.current_stream(device))  # randn ran on the current stream

    def enqueue(self) -> None:
        with torch.cuda.stream(self.stream):
            for _ in range(GEMM_COUNT):
                torch.matmul(self.a, self.a, out=self.c)

    def compare(self, copy_stream: torch.cuda.Stream, fns: dict[str, Callable], reps: int) -> dict[str, Any]:
        """Median wall ms from a common start until the GEMMs and the copies of ``fns[k]`` are done.

        The GEMMs alone run interleaved with the variants, rep by rep, so clock drift under sustained
        load (power, temperature) hits baseline and variants alike; ``added_ms`` is over that baseline.
        """
        variants: dict[str, Callable | None] = {"gemm_alone": None, **fns}
        wall: dict[str, list[float]] = {k: [] for k in variants}
        copy: dict[str, list[float]] = {k: [] for k in variants}
        for rep in range(reps + 1):
            for k, fn in variants.items():
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
                ev[0].record(self.stream)
                copy_stream.wait_event(ev[0])
                self.enqueue()
                if fn is not None:
                    with torch.cuda.stream(copy_stream):
                        ev[1].record(copy_stream)
                        fn(copy_stream)
                        ev[2].record(copy_stream)
                    self.stream.wait_event(ev[2])
                ev[3].record(self.stream)
                ev[3].synchronize()
                if rep:
                    wall[k].append(ev[0].elapsed_time(ev[3]))
                    copy[k].append(ev[1].elapsed_time(ev[2]) if fn is not None else 0.0)
        alone = statistics.median(wall["gemm_alone"])
        out: dict[str, Any] = {"gemm_alone_ms": alone, "gemm_alone_spread_ms": max(wall["gemm_alone"]) -
                               min(wall["gemm_alone"])}
        for k in fns:
            out[k] = {"wall_ms": statistics.median(wall[k]), "copy_ms": statistics.median(copy[k]),
                      "added_ms": statistics.median(wall[k]) - alone}
        return out


def bandwidth_floors(device: torch.device, reps: int) -> dict[str, float]:
    nbytes = 1 << 30
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    s = torch.cuda.Stream(device)
    h2d = timed(s, lambda _: a.copy_(host, non_blocking=True), reps)["device_ms"]
    d2d = timed(s, lambda _: b.copy_(a), reps)["device_ms"]
    return {"h2d_GBps": nbytes / h2d / 1e6, "d2d_GBps_read_plus_write": 2 * nbytes / d2d / 1e6}


def runs_of(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(start, length) of each run of consecutive ids in the sorted ``ids``."""
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts = ids[np.r_[0, breaks]]
    return starts, np.diff(np.r_[0, breaks, len(ids)])


def entries(banks: list[tuple[torch.Tensor, torch.Tensor]], dst_rows: np.ndarray, src_rows: np.ndarray,
            lengths: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Batch entries over all (dst_XR, src_XR) banks: row i copies ``lengths[i]`` rows (default 1)."""
    dst, src, size = [], [], []
    n = np.ones(len(dst_rows), np.uint64) if lengths is None else lengths.astype(np.uint64)
    for d, s in banks:
        r = d.shape[1]
        dst.append(bm.row_pointers(d.data_ptr(), r, dst_rows))
        src.append(bm.row_pointers(s.data_ptr(), r, src_rows))
        size.append(n * np.uint64(r))
    return np.concatenate(dst), np.concatenate(src), np.concatenate(size)


def bench_model(spec: dict, device: torch.device, copier: bm.BatchMemcpy | None, gemm: Gemm, floors: dict,
                spin: tuple[int, float], reps: int) -> dict[str, Any]:
    e = spec["experts"]
    rng = np.random.default_rng(0)
    slots = [torch.randint(0, 256, (2 * e, r), dtype=torch.uint8, device=device) for _, r in spec["banks"]]
    stage = [torch.zeros(e, r, dtype=torch.uint8, device=device) for _, r in spec["banks"]]
    host = [torch.empty(e, r, dtype=torch.uint8, pin_memory=True) for _, r in spec["banks"]]
    for h, s in zip(host, slots):
        h.copy_(s[:e])
    layer_bytes = sum(r for _, r in spec["banks"]) * e
    slot_of = rng.permutation(2 * e)[:e]  # every expert resident (a full layer of hits)
    slot_of_t = torch.from_numpy(slot_of).to(device)
    expert_t = torch.arange(e, device=device)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))  # the fills above ran on the current stream
    out: dict[str, Any] = {"experts": e, "banks": dict(spec["banks"]), "layer_bytes": layer_bytes}

    def gather(_s):
        for st, sl in zip(stage, slots):
            gather_rows(st, expert_t, sl, slot_of_t)

    def per_row(_s):
        for st, sl in zip(stage, slots):
            for dst_row, src_row in enumerate(slot_of.tolist()):
                st[dst_row].copy_(sl[src_row])

    def full_h2d(_s):
        for st, h in zip(stage, host):
            st.copy_(h, non_blocking=True)

    hit = entries(list(zip(stage, slots)), np.arange(e), slot_of)
    paths: dict[str, Callable] = {"gather": gather, "per_row_copy": per_row, "full_layer_h2d": full_h2d}
    if copier is not None:
        paths["batch_memcpy"] = lambda s: copier.copy(*hit, s)
    out["hits_isolated"] = {k: timed(stream, fn, reps) for k, fn in paths.items()}
    out["hits_isolated"]["full_layer_h2d"]["h2d_floor_ms"] = layer_bytes / floors["h2d_GBps"] / 1e6
    want = [sl.index_select(0, slot_of_t) for sl in slots]
    for k in ("gather", "batch_memcpy"):
        if k in paths:
            for st in stage:
                st.zero_()
            stream.wait_stream(torch.cuda.current_stream(device))
            paths[k](stream)
            stream.synchronize()
            out["hits_isolated"][k]["verified"] = all(torch.equal(st, w) for st, w in zip(stage, want))
    out["hits_under_gemm"] = gemm.compare(stream, {k: paths[k] for k in ("gather", "batch_memcpy") if k in paths},
                                          reps)

    miss = np.sort(rng.permutation(e)[: e // 2])  # half the layer missing, random ids
    starts, lengths = runs_of(miss)
    miss_bytes = sum(r for _, r in spec["banks"]) * len(miss)
    hbanks = list(zip(stage, host))
    h2d: dict[str, Callable] = {
        "per_row_copy": lambda s: [st[m].copy_(h[m], non_blocking=True) for st, h in hbanks for m in miss.tolist()],
        "runs_copy": lambda s: [st[a:a + n].copy_(h[a:a + n], non_blocking=True) for st, h in hbanks
                                for a, n in zip(starts.tolist(), lengths.tolist())],
    }
    if copier is not None:
        rows_e, runs_e = entries(hbanks, miss, miss), entries(hbanks, starts, starts, lengths)
        h2d["batch_per_row"] = lambda s: copier.copy(*rows_e, s)
        h2d["batch_runs"] = lambda s: copier.copy(*runs_e, s)
    out["misses_h2d"] = {"missed": len(miss), "runs": len(starts), "bytes": miss_bytes,
                         "h2d_floor_ms": miss_bytes / floors["h2d_GBps"] / 1e6}
    for k, fn in h2d.items():
        out["misses_h2d"][k] = res = timed(stream, fn, reps)
        res["GBps"] = miss_bytes / res["device_ms"] / 1e6

    small = [i for i, (_, r) in enumerate(spec["banks"]) if r < SMALL_ENTRY]
    if copier is not None and small:
        large = [i for i in range(len(spec["banks"])) if i not in small]
        out["mixed_vs_large"] = {}
        for kind, pairs, dst_rows, src_rows in (("h2d", hbanks, miss, miss), ("d2d", list(zip(stage, slots)),
                                                                             np.arange(e), slot_of)):
            for label, idx in (("mixed", range(len(pairs))), ("large_only", large)):
                ent = entries([pairs[i] for i in idx], dst_rows, src_rows)
                fn = (lambda ent_: lambda s: copier.copy(*ent_, s))(ent)
                res = timed(stream, fn, reps)
                res.update(blocking(stream, fn, res, *spin), entries=len(ent[0]))
                out["mixed_vs_large"][f"{kind}_{label}"] = res
    return out


def sweep_row_sizes(device: torch.device, copier: bm.BatchMemcpy | None, gemm: Gemm,
                    reps: int) -> list[dict[str, Any]]:
    sizes = sorted({65536} | {r for spec in MODELS.values() for _, r in spec["banks"]})
    stream, rows = torch.cuda.Stream(device), []
    slot_of = np.random.default_rng(1).permutation(2 * SWEEP_ROWS)[:SWEEP_ROWS]
    slot_t, dst_t = torch.from_numpy(slot_of).to(device), torch.arange(SWEEP_ROWS, device=device)
    for r in sizes:
        pool = torch.randint(0, 256, (2 * SWEEP_ROWS, r), dtype=torch.uint8, device=device)
        stage = torch.zeros(SWEEP_ROWS, r, dtype=torch.uint8, device=device)
        stream.wait_stream(torch.cuda.current_stream(device))
        paths = {"gather": lambda s: gather_rows(stage, dst_t, pool, slot_t)}
        if copier is not None:
            ent = entries([(stage, pool)], np.arange(SWEEP_ROWS), slot_of)
            paths["batch_memcpy"] = (lambda ent_: lambda s: copier.copy(*ent_, s))(ent)
        under = gemm.compare(stream, paths, reps)
        row: dict[str, Any] = {"row_bytes": r, "gemm_alone_ms": under["gemm_alone_ms"],
                               "gemm_alone_spread_ms": under["gemm_alone_spread_ms"]}
        for k, fn in paths.items():
            iso = timed(stream, fn, reps)
            row[k] = {"isolated_device_ms": iso["device_ms"], "isolated_host_ms": iso["host_ms"],
                      "added_under_gemm_ms": under[k]["added_ms"], "copy_ms_under_gemm": under[k]["copy_ms"]}
        rows.append(row)
    return rows


def hit_copy_choice(sweep: list[dict], gpu: str, source: str) -> dict[str, Any]:
    """Per row size, the path that adds less wall time under the GEMM; a tie goes to the isolated winner.

    A tie is a difference within the spread of the GEMM-alone baseline measured alongside (>= 0.05 ms).
    """
    rules = []
    for row in sweep:
        tie_ms = max(0.05, row["gemm_alone_spread_ms"])
        if "batch_memcpy" not in row:
            choice = "gather"
        else:
            g, b = row["gather"], row["batch_memcpy"]
            diff = b["added_under_gemm_ms"] - g["added_under_gemm_ms"]
            if abs(diff) > tie_ms:
                choice = "batch_memcpy" if diff < 0 else "gather"
            else:
                choice = "batch_memcpy" if b["isolated_device_ms"] < g["isolated_device_ms"] else "gather"
        rules.append({"min_row_bytes": row["row_bytes"], "choice": choice, "measured_at_row_bytes": row["row_bytes"]})
    rules[0]["min_row_bytes"] = 0
    return {gpu: {"source": source, "rules": rules}}


def git_sha() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                             cwd=Path(__file__).resolve().parent).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                               cwd=Path(__file__).resolve().parent).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(res: dict[str, Any]) -> str:
    env = res["env"]
    lines = [f"# copy paths on {env['gpu']} ({env['timestamp']})", "",
             f"git {env['git_sha']}, torch {env['torch']}, CUDA {env['torch_cuda']}, runtime "
             f"{env['probe'].get('runtime_version')}, driver {env['probe'].get('driver_version')}; batch path: "
             f"{'ok' if env['probe']['ok'] else env['probe']['reason']}", "",
             f"Floors: H2D {res['floors']['h2d_GBps']:.1f} GB/s, D2D {res['floors']['d2d_GBps_read_plus_write']:.0f}"
             f" GB/s (r+w). GEMM alone: {res['gemm_alone_ms']:.2f} ms. Host time of one 512 x 64 KiB "
             f"call: {res['host_ms_512']}", "",
             "| model | path | hits device ms | hits host ms | added under GEMM ms |",
             "| --- | --- | --- | --- | --- |"]
    for name, m in res["models"].items():
        for k, v in m["hits_isolated"].items():
            added = m["hits_under_gemm"].get(k, {}).get("added_ms")
            lines.append(f"| {name} | {k} | {v['device_ms']:.3f} | {v['host_ms']:.3f} | "
                         f"{'' if added is None else f'{added:.3f}'} |")
    lines += ["", "| model | H2D misses path | device ms | GB/s | floor ms |", "| --- | --- | --- | --- | --- |"]
    for name, m in res["models"].items():
        mh = m["misses_h2d"]
        for k in ("per_row_copy", "runs_copy", "batch_per_row", "batch_runs"):
            if k in mh:
                lines.append(f"| {name} | {k} | {mh[k]['device_ms']:.3f} | {mh[k]['GBps']:.1f} | "
                             f"{mh['h2d_floor_ms']:.3f} |")
    lines += ["", "| model | batch entries | host ms (idle stream) | device ms | host ms behind spin | "
              "host waits (idle / busy stream) |", "| --- | --- | --- | --- | --- | --- |"]
    for name, m in res["models"].items():
        for k, v in m.get("mixed_vs_large", {}).items():
            lines.append(f"| {name} | {k} ({v['entries']}) | {v['host_ms']:.3f} | {v['device_ms']:.3f} | "
                         f"{v['host_ms_behind_spin']:.3f} | {v['host_waits_when_stream_idle']} / "
                         f"{v['host_waits_behind_busy_stream']} |")
    lines += ["", "| row bytes | gather ms | batch ms | gather added under GEMM | batch added under GEMM | choice |",
              "| --- | --- | --- | --- | --- | --- |"]
    rules = {r["measured_at_row_bytes"]: r["choice"] for g in res["hit_copy_choice"].values() for r in g["rules"]}
    for row in res["row_size_sweep"]:
        g, b = row["gather"], row.get("batch_memcpy")
        bs = (f"{b['isolated_device_ms']:.3f}", f"{b['added_under_gemm_ms']:.3f}") if b else ("", "")
        lines.append(f"| {row['row_bytes']} | {g['isolated_device_ms']:.3f} | {bs[0]} | "
                     f"{g['added_under_gemm_ms']:.3f} | {bs[1]} | {rules[row['row_bytes']]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    ap.add_argument("--json", action="store_true", help="print the JSON result instead of the markdown table")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions per measurement (median)")
    ap.add_argument("--git-sha", default=None, help="record this SHA (for a tree copied without .git)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("copy_paths: needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    torch.cuda.init()
    gpu = torch.cuda.get_device_name(device)
    probe = bmp.probe(device)
    copier = bm.load_batch_memcpy(device) if probe["ok"] else None
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    stem = f"copy_paths_{stamp}"
    floors = bandwidth_floors(device, args.reps)
    stream = torch.cuda.Stream(device)
    spin_cycles = int(1e7)
    spin_ms = timed(stream, lambda _: torch.cuda._sleep(spin_cycles), 3)["device_ms"]
    spin_cycles = int(spin_cycles * 5.0 / spin_ms)  # ~5 ms
    spin_ms = timed(stream, lambda _: torch.cuda._sleep(spin_cycles), 3)["device_ms"]
    gemm = Gemm(device)
    gemm_alone_ms = gemm.compare(stream, {}, args.reps)["gemm_alone_ms"]  # also warms the clocks up
    host_512 = None
    if copier is not None:
        n, r = 512, 64 << 10
        a = torch.empty(n, r, dtype=torch.uint8, device=device)
        b = torch.empty_like(a)
        h = torch.empty(n, r, dtype=torch.uint8, pin_memory=True)
        rows = np.arange(n)
        d2d, h2d = entries([(b, a)], rows, rows[::-1].copy()), entries([(b, h)], rows, rows)
        host_512 = {"d2d_host_ms": timed(stream, lambda s: copier.copy(*d2d, s), args.reps)["host_ms"],
                    "h2d_host_ms": timed(stream, lambda s: copier.copy(*h2d, s), args.reps)["host_ms"]}
    models = {name: bench_model(spec, device, copier, gemm, floors, (spin_cycles, spin_ms), args.reps)
              for name, spec in MODELS.items()}
    sweep = sweep_row_sizes(device, copier, gemm, args.reps)
    res = {
        "env": {"git_sha": args.git_sha or git_sha(), "timestamp": stamp, "gpu": gpu, "torch": torch.__version__,
                "torch_cuda": torch.version.cuda, "probe": probe, "reps": args.reps,
                "gemm": f"{GEMM_COUNT} x {GEMM_N}^3 bf16 on another stream", "sweep_rows": SWEEP_ROWS},
        "floors": floors, "gemm_alone_ms": gemm_alone_ms, "host_ms_512": host_512, "models": models,
        "row_size_sweep": sweep,
        "hit_copy_choice": hit_copy_choice(sweep, gpu, f"{stem}.json (benchmarks/copy_paths.py)"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps(res, indent=2) + "\n")
    md = markdown(res)
    (args.out / f"{stem}.md").write_text(md)
    print(json.dumps(res, indent=2) if args.json else md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
