"""Can a CUDA graph hand device-known routing to the copy engine? Conditional (IF) nodes measured on one GPU.

    python benchmarks/conditional_copy.py [--out benchmarks/results] [--json] [--reps 20]

Why: short prompts (issue 14) and batch 16 at low residency (issue 12) read their routed misses with SM loads
from mapped host memory, because a replayed graph cannot tell the copy engine which experts were routed; at
8-64 missing experts those reads cost 1.19-1.42 x the copy engine's time
(benchmarks/results/HISTORY.md "What bounds the routed path"). A graph can hold one IF node per expert whose body is
that expert's H2D memcpy (allowed for pinned, device-mapped host memory), its predicate set on the device from the
routing. This probe prices that before any runtime code depends on it.

Legend: E experts of one layer, R bytes of an expert row (--preset's NVFP4 shape; Qwen3-30B-A3B: 2,654,224), k experts
copied (predicates true), br parallel branches the E IF nodes are spread over (each branch a stream forked in
the capture). Every time is a CUDA-event median over --reps (device ms) of one layer:
- ``copy_engine``: k ``copy_`` calls H2D on one stream, eager (the floor's path);
- ``graph_plain``: the same k copies captured as plain memcpy nodes and replayed (what a host that knew the
  routing would replay);
- ``cond[br]``: E IF nodes (predicate kernel + conditional node each, k true), replayed; k = 0 is the pure
  cost of the nodes;
- ``condb``: the same E IF nodes as the runtime makes them (``moe_offload/graph_copy.GraphMissCopy.enqueue``, which
  needs no ``begin_capture_to_if_node``, absent from torch 2.11): ONE kernel sets all E conditions from the routed
  ids, then the E IF nodes run in parallel, each holding one H2D memcpy node; over a real one-layer ``ExpertStore``
  (pinned, mapped) into a real ``SlotPool``'s scratch rows, checked row by row (``condb_exact``);
- ``sm_read``: k rows gathered by SM loads from the mapped host rows (``index_select`` on a UVA view; a generic
  gather, slower than the runtime's tuned miss copy);
- ``miss_copy``: the same k experts through the runtime's miss server (``kernels/decode_miss.serve_misses``: the
  plan launch and the persistent SM copy of a decode step, default launch shape), i.e. what ``decode.miss_copy: uva``
  pays.
The ratio to ``copy_engine`` at each k is what a graph-replayed routed path would pay against the floor.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

from moe_offload.host_store import ExpertStore
from moe_offload.kernels.decode_miss import serve_misses
from moe_offload.slot_pool import SlotPool
from moe_offload.stats import CacheStats

TOP_K = 8  # Qwen3-30B-A3B routes each token to 8 experts


def _time(fn, reps: int, stream: torch.cuda.Stream) -> float:
    """Median device ms of ``fn()`` enqueued on ``stream`` (two warm-up calls)."""
    for _ in range(2):
        with torch.cuda.stream(stream):
            fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _capture(body, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    g = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(g, stream=stream):
        body(g)
    torch.cuda.synchronize()
    return g


def _cond_body(host_ER, dst_ER, pred_E, branches: int):
    """Capture body: E IF nodes, expert e on branch e % branches, each copying its row when pred_E[e]."""
    E = host_ER.shape[0]

    def body(g: torch.cuda.CUDAGraph) -> None:
        main = torch.cuda.current_stream()
        streams = [main] + [torch.cuda.Stream() for _ in range(branches - 1)]
        for s in streams[1:]:
            s.wait_stream(main)
        for j, s in enumerate(streams):
            with torch.cuda.stream(s):
                for e in range(j, E, branches):
                    g.begin_capture_to_if_node(pred_E[e])
                    dst_ER[e].copy_(host_ER[e], non_blocking=True)
                    g.end_capture_to_conditional_node()
        for s in streams[1:]:
            main.wait_stream(s)
    return body


def _condb_body(store, pool, ids_1E):
    """``(body, keep)``: the capture body of ``GraphMissCopy.enqueue`` over the store's one layer into the pool's
    scratch rows (no slots: every expert missing, the slot table all -1), the routed ids ``ids_1E`` (-1 pads are
    ignored) read at replay; ``keep`` holds what the captured kernel reads and writes (the copier's row map, the
    table), which must outlive every replay: at 74b55da they did not, the freed memory was reused by the probe's
    own index tensors, the copies went to wrong rows and a later index kernel asserted."""
    from moe_offload.graph_copy import GraphMissCopy

    copier = GraphMissCopy(store, pool, 0, pool.stats)
    table_E = pool.table_LE[pool.layer_pos[store.layers[0]]]
    return (lambda g: copier.enqueue(store.layers[0], table_E, ids_1E)), (copier, table_E)


def one_layer_store(preset: str) -> ExpertStore:
    """A real ExpertStore of one MoE layer of ``preset``'s NVFP4 shape, pinned and mapped, each row marked (one byte
    every 4096, never 0) so a copy's destination can be checked."""
    store = ExpertStore.for_preset(preset, 1)
    rows_ER = store.rows(store.layers[0])
    rows_ER.zero_()
    rows_ER[:, ::4096] = (torch.arange(store.num_experts) % 251 + 1).to(torch.uint8)[:, None]
    return store


def measure(preset: str, counts: list[int], branches: list[int], reps: int) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    store = one_layer_store(preset)
    experts, row_bytes = store.num_experts, store.bytes_per_expert
    host_ER = store.rows(store.layers[0])
    view_ER = store.device_rows(store.layers[0], dev)  # raises uva.UvaError where the device cannot map it
    # no slots, one scratch row per expert: GraphMissCopy's fixed row of expert e is scratch row e
    pool = SlotPool(store, 0, "lru", dev, CacheStats(), scratch_rows=experts)
    dst_ER = pool.rows_NR
    pred_E = torch.zeros(experts, dtype=torch.bool, device=dev)
    stream = torch.cuda.Stream()
    gen = torch.Generator().manual_seed(0)
    rows: list[dict] = []
    graphs = {}
    for br in branches:
        try:
            graphs[br] = _capture(_cond_body(host_ER, dst_ER, pred_E, br), stream)
        except Exception as exc:  # a driver without conditional memcpy bodies: report it, keep the rest
            graphs[br] = f"{type(exc).__name__}: {exc}"
    ids_1E = torch.full((1, experts), -1, dtype=torch.int64, device=dev)
    keep = None
    try:
        body, keep = _condb_body(store, pool, ids_1E)
        graphs["b"] = _capture(body, stream)
    except Exception as exc:  # the runtime, NVRTC or the capture: report it, keep the rest
        graphs["b"] = f"{type(exc).__name__}: {exc}"
    for k in counts:
        chosen = torch.randperm(experts, generator=gen)[:k].sort().values.tolist()
        idx = torch.tensor(chosen, dtype=torch.long, device=dev)
        pred_E.zero_()
        ids_1E.fill_(-1)
        if k:
            pred_E[idx] = True
            ids_1E[0, :k] = idx
        torch.cuda.synchronize()

        def copies():
            for e in chosen:
                dst_ER[e].copy_(host_ER[e], non_blocking=True)

        row = {"k": k, "bytes": k * row_bytes}
        if k:
            row["copy_engine_ms"] = _time(copies, reps, stream)
            plain = _capture(lambda g: copies(), stream)
            row["graph_plain_ms"] = _time(plain.replay, reps, stream)
            out = torch.empty((k, row_bytes), dtype=torch.uint8, device=dev)
            row["sm_read_ms"] = _time(lambda: torch.index_select(view_ER, 0, idx, out=out), reps, stream)
            slot_E = torch.full((experts,), -1, dtype=torch.int32, device=dev)
            # routed as a decode step routes them: T tokens x top-8 (ids past k are -1, which the plan skips); at
            # 10cf59a one token of k = 16 ids tripped a device assert, outside the plan's top-k range
            K = min(k, TOP_K)
            ids_TK = torch.full((-(-k // K) * K,), -1, dtype=torch.long, device=dev)
            ids_TK[:k] = idx
            ids_TK = ids_TK.view(-1, K)
            row["miss_copy_ms"] = _time(lambda: serve_misses(slot_E, ids_TK, view_ER, dst_ER, 0), reps, stream)
        for br, g in graphs.items():
            if isinstance(g, str):
                row[f"cond{br}_ms"] = None
                continue
            dst_ER.zero_()
            torch.cuda.synchronize()
            row[f"cond{br}_ms"] = _time(g.replay, reps, stream)
            if k:  # the copies landed (each row's marks), and only those (every other row still 0)
                marks = dst_ER[:, ::4096]
                got = torch.equal(marks[idx], host_ER[chosen, ::4096].to(dev))
                others = marks.ne(0).any(dim=1).sum().item()
                row[f"cond{br}_exact"] = got and others == k
        for key in list(row):
            if key.endswith("_ms") and row[key] and k:
                row[key.replace("_ms", "_gbps")] = round(k * row_bytes / row[key] / 1e6, 1)
        if k:
            ce = row["copy_engine_ms"]
            for key in list(row):
                if key.endswith("_ms") and key != "copy_engine_ms" and row[key]:
                    row[key.replace("_ms", "_x_ce")] = round(row[key] / ce, 3)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr)
    del keep  # the condb graph is not replayed after this
    return {"experts": experts, "row_bytes": row_bytes, "rows": rows,
            "capture_errors": {br: g for br, g in graphs.items() if isinstance(g, str)}}


def _markdown(res: dict) -> str:
    keys = ["copy_engine", "graph_plain", "sm_read", "miss_copy"] + [f"cond{br}" for br in res["branches"]] + ["condb"]
    lines = [f"# Conditional-node copies vs the copy engine ({res['gpu']}, {res['git_sha']}, torch {res['torch']})",
             "", f"E = {res['experts']} IF nodes, R = {res['row_bytes']} bytes a row, {res['reps']} reps, median "
             "device ms (x copy_engine).", "",
             "| k | " + " | ".join(keys) + " |", "| --- |" + " --- |" * len(keys)]
    for r in res["rows"]:
        cells = []
        for key in keys:
            ms = r.get(f"{key}_ms")
            x = r.get(f"{key}_x_ce")
            cells.append("-" if ms is None else f"{ms:.3f}" + (f" ({x:.2f})" if x else ""))
        lines.append(f"| {r['k']} | " + " | ".join(cells) + " |")
    if res["capture_errors"]:
        lines += ["", "Capture errors: " + json.dumps(res["capture_errors"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--preset", default="qwen3-30b-a3b", help="the MoE shape of the one layer (moe_offload/presets.py)")
    p.add_argument("--counts", default="0,1,8,16,32,64,128")
    p.add_argument("--branches", default="1,4,16")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tag", default="")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("conditional_copy: needs a CUDA GPU", file=sys.stderr)
        return 2
    sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    branches = [int(x) for x in a.branches.split(",")]
    res = {"git_sha": sha or "unknown", "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name(), "date": datetime.datetime.now(datetime.UTC).isoformat(),
           "preset": a.preset, "reps": a.reps, "branches": branches}
    res.update(measure(a.preset, [int(x) for x in a.counts.split(",")], branches, a.reps))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"conditional_copy-{res['git_sha']}{a.tag}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    stem.with_suffix(".md").write_text(_markdown(res))
    print(json.dumps(res) if a.json else _markdown(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
