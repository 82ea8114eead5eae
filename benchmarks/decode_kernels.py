"""Decode device kernels on one GPU: UVA miss copies, the fused NVFP4 decode layer, CUDA-graph replay.

    python benchmarks/decode_kernels.py --out benchmarks/results [--reps 10] [--layers 8] [--json]

Writes ``decode_kernels-<git sha>-<UTC time>.{json,md}`` under ``--out`` (a few minutes on an H200).
Legend: T tokens, K top-k, E experts, H hidden, I intermediate, B bytes per expert row, n missing experts.

(i) UVA reads. ``serve_misses`` copying n = 1 / 8 / 16 / 32 / 64 missing Qwen3-30B-A3B NVFP4 experts (B = 2.65 MB)
    from mapped pinned host memory into scratch rows, vs the copy engine measured in the same run:
    one ``copy_(non_blocking=True)`` of a 1 GiB pinned tensor, and ``copy_`` of the same n rows.
    Rows at their exact size (4-byte aligned: 4-byte loads) and with the row stride padded to a
    multiple of 16 (16-byte vector loads); a sweep of the copy launch shape at n = 64 (both layouts) and 1 / 16 / 32
    (padded rows: a batch-1 decode layer's miss, a short prompt's misses per layer).
    CUDA events, median of ``--reps``.
(ii) Decode MoE layer time at T = 1..64 for Qwen3-30B-A3B (H 2048, I 768, E 128, K 8) and Flash-Next
    (H 2560, I 640, E 512, K 10): ``decode_moe_nvfp4`` vs ``decode_gemv_nvfp4`` (GEMVs, no tensor-core
    dot; its output must match decode_moe's within REL_TOL_VS_DECODE) vs ``fused_moe_nvfp4`` (the prefill-tuned kernel)
    vs dequant of the routed rows + ``moe_grouped`` (torch._grouped_mm), vs the HBM floor = routed
    experts' NVFP4 bytes / measured D2D bandwidth (read + write counted). Every method runs inside a
    CUDA graph over ``--layers`` layers of distinct weights (so weights come from HBM, not L2, and
    Python's launch overhead is out, as in a captured decode step); the time is per layer. The dequant
    baseline's unique/remap of routed rows is setup (not timed): it needs a host sync, so the
    baseline shown is faster than any sync-free version of it.
(iii) One decode step, ``serve_misses`` + ``decode_moe_nvfp4`` at 37% residency, captured in a
    ``torch.cuda.CUDAGraph``: replays vs eager (bitwise), again after the table changed between
    replays, replay time vs eager time, and whether ``torch.cuda.set_sync_debug_mode("error")`` saw a sync.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a script folder, not a package
from fused_moe import SHAPES, random_banks, random_routing, versions  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 32, 64)
MISSES = (1, 8, 16, 32, 64)
# launch shapes swept at these miss counts on padded rows (16-32: what a short prompt misses per layer at residency
# 0.37, where the SM reads cost ~1.3 x the copy engine's time:
# benchmarks/results/HISTORY.md "b18b0cc"), and at 64 on both layouts
SWEEP_MISSES = (1, 16, 32, 64)
RESIDENCY = 0.37
# decode_moe rounds the activation and each weighted term to bf16 (2^-9 relative each, accumulated over
# K terms and I products: ~3e-3 relative norm); decode_gemv keeps both fp32. A wrong row, scale or weight
# moves the relative norm error past 0.1.
REL_TOL_VS_DECODE = 2e-2


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def events_ms(fn: Callable[[], object], reps: int, warmup: int = 2) -> float:
    """Median device ms of ``fn()`` between two CUDA events on the current stream."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return median(times)


def capture(fn: Callable[[], object]) -> tuple[torch.cuda.CUDAGraph, object]:
    """Warm ``fn`` on a side stream (Triton compiles there), then capture one call: (graph, its output)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def nvfp4_data_bytes(H: int, I: int) -> int:
    """Bytes of one expert's NVFP4 banks (unpadded)."""
    from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat

    return sum(s.nbytes for s in Nvfp4ModelOptFormat().banks(H, I))


def nvfp4_row_bytes(H: int, I: int) -> int:
    """Bytes of one expert row as the store lays it out (``host_store.padded_row_bytes``; ``random_banks``' rows)."""
    from moe_offload.host_store import padded_row_bytes

    return padded_row_bytes(nvfp4_data_bytes(H, I))


# --- floors -------------------------------------------------------------------------------------------

def floors(device, reps: int) -> dict:
    """Copy-engine H2D (1 GiB pinned, non_blocking) and D2D (1 GiB, read + write counted) bandwidths."""
    n = 1 << 30
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev_a = torch.empty(n, dtype=torch.uint8, device=device)
    dev_b = torch.empty_like(dev_a)
    h2d_ms = events_ms(lambda: dev_a.copy_(host, non_blocking=True), reps)
    d2d_ms = events_ms(lambda: dev_b.copy_(dev_a), reps)
    del host, dev_a, dev_b
    torch.cuda.empty_cache()
    return {"h2d_GBps": n / h2d_ms / 1e6, "d2d_rw_GBps": 2 * n / d2d_ms / 1e6, "bytes": n}


# --- (i) UVA ------------------------------------------------------------------------------------------

def bench_uva(device, reps: int, h2d_GBps: float) -> list[dict]:
    from moe_offload import uva
    from moe_offload.kernels.decode_miss import MissCopyConfig, serve_misses

    H, I, E, _ = SHAPES["qwen3-30b-a3b"]
    B = nvfp4_data_bytes(H, I)
    B16 = (B + 15) // 16 * 16
    buf = torch.empty(E * B16, dtype=torch.uint8)
    buf.view(torch.int32)[:] = torch.arange(buf.numel() // 4, dtype=torch.int32)  # distinct rows
    if not uva.pin_mapped(buf):
        raise RuntimeError("could not pin the host buffer")
    results = []
    try:
        layouts = {f"exact rows (B mod 16 = {B % 16})": (buf[: E * B].view(E, B), B),
                   "rows padded to 16 B": (buf.view(E, B16), B16)}
        for layout, (host_ER, row) in layouts.items():
            host_dev = uva.mapped_device_view(host_ER, device)
            slot_of_E = torch.full((E,), -1, dtype=torch.int32, device=device)
            for n in MISSES:
                pool = torch.empty(n, row, dtype=torch.uint8, device=device)
                ids = torch.randperm(E, device=device)[:n].view(n, 1)
                configs = [MissCopyConfig()]
                if n == max(MISSES) or (n in SWEEP_MISSES and row == B16):
                    configs += [MissCopyConfig(chunk_bytes=c, ctas_per_sm=k)
                                for c in (1024, 4096, 8192, 16384, 32768, 65536) for k in (1, 2, 4, 8)
                                if (c, k) != (16384, 4)]  # the default, timed above
                for cfg in configs:
                    ms = events_ms(lambda: serve_misses(slot_of_E, ids, host_dev, pool, 0, cfg), reps)
                    results.append({"layout": layout, "row_bytes": row, "missing": n, "path": "serve_misses (UVA)",
                                    "config": dataclasses.asdict(cfg), "ms": ms, "GBps": n * row / ms / 1e6,
                                    "x_copy_engine_floor": ms / (n * row / h2d_GBps / 1e6)})
                # correctness of the copies (outside the timing): scratch row j holds the j-th missing id
                rows = serve_misses(slot_of_E, ids, host_dev, pool, 0)
                order = torch.sort(ids.view(-1)).values
                ok = all(torch.equal(pool[j].cpu(), host_ER[int(order[j])]) for j in {0, n - 1})
                results[-1]["bytes_equal"] = ok and bool((rows.view(-1) >= 0).all())
                dst = torch.empty(n, row, dtype=torch.uint8, device=device)
                ms = events_ms(lambda: dst.copy_(host_ER[:n], non_blocking=True), reps)
                results.append({"layout": layout, "row_bytes": row, "missing": n, "path": "copy engine (copy_ of n rows)",
                                "ms": ms, "GBps": n * row / ms / 1e6})
                del pool, dst
            del host_dev
    finally:
        uva.unpin([buf.data_ptr()])
    return results


# --- (ii) decode layer --------------------------------------------------------------------------------

def pool_rows(views: dict, H: int, I: int) -> torch.Tensor:
    """The ``[E, B]`` byte pool behind ``random_banks`` views (w13_q is its first bank, at offset 0)."""
    w13_q = views["w13_q"]
    return w13_q.as_strided((w13_q.shape[0], nvfp4_row_bytes(H, I)), (w13_q.stride(0), 1))


def make_layers(name: str, L: int, device):
    """L layers of distinct random weights: ``([(pool_ER, views)], bank specs)``."""
    from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat

    H, I, E, K = SHAPES[name]
    layers = []
    for seed in range(L):
        views = random_banks(H, I, E, device, seed=seed)
        layers.append((pool_rows(views, H, I), views))
    return layers, Nvfp4ModelOptFormat().banks(H, I)


def bench_layer(name: str, layers, specs, T: int, device, d2d_GBps: float, reps: int) -> list[dict]:
    from moe_offload.host_store import bank_offsets, bank_views
    from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4
    from moe_offload.kernels.decode_gemv_tuning import gemv_config_for
    from moe_offload.kernels.decode_moe import decode_config_for, decode_moe_nvfp4
    from moe_offload.kernels.fused_moe import config_for, fused_moe_nvfp4
    from moe_offload.kernels.moe_gemm import has_grouped_mm, moe_grouped
    from moe_offload.kernels.nvfp4 import dequant_banks

    H, I, E, K = SHAPES[name]
    L = len(layers)
    rows_TK, weights_TK = random_routing(T, E, K, device, seed=T)
    hidden_TH = torch.randn(T, H, device=device).bfloat16()
    unique_U, remap = torch.unique(rows_TK, return_inverse=True)  # setup: syncs, outside the timing
    U = int(unique_U.numel())
    row_bytes = nvfp4_row_bytes(H, I)
    floor_ms = U * row_bytes / d2d_GBps / 1e6
    offsets = bank_offsets(specs)

    def dequant_grouped(pool_ER):
        sub_UB = pool_ER.index_select(0, unique_U)
        sub_views = bank_views(specs, offsets, sub_UB)

        def dequant_rows(r0, r1):
            return dequant_banks({k: v[r0:r1] for k, v in sub_views.items()}, torch.bfloat16)

        return moe_grouped(hidden_TH, remap, weights_TK, U, dequant_rows, U, torch.bfloat16)

    methods = {
        "decode_moe_nvfp4": lambda views, pool: decode_moe_nvfp4(hidden_TH, rows_TK, weights_TK, views),
        "decode_gemv_nvfp4": lambda views, pool: decode_gemv_nvfp4(hidden_TH, rows_TK, weights_TK, views),
        "fused_moe_nvfp4 (prefill-tuned)": lambda views, pool: fused_moe_nvfp4(hidden_TH, rows_TK, weights_TK, views),
    }
    if has_grouped_mm():
        methods["dequant routed rows + moe_grouped"] = lambda views, pool: dequant_grouped(pool)
    common = {"shape": name, "H": H, "I": I, "E": E, "K": K, "T": T, "routed_experts": U,
              "hbm_floor_ms": floor_ms, "layers_in_graph": L}
    out, ref = [], None
    for method, fn in methods.items():
        def all_layers(fn=fn):
            return [fn(views, pool) for pool, views in layers]
        try:
            eager_ms = events_ms(all_layers, reps) / L
            eager_out = fn(layers[0][1], layers[0][0])
        except Exception as exc:  # noqa: BLE001 - reported in the table, not hidden
            out.append({**common, "method": method, "skipped": f"{type(exc).__name__}: {str(exc).splitlines()[0]}"})
            continue
        try:
            graph, outs = capture(all_layers)
            graph_ms = events_ms(graph.replay, reps) / L
        except Exception as exc:  # noqa: BLE001 - reported in the table, not hidden
            out.append({**common, "method": method, "eager_ms": eager_ms,
                        "skipped": f"capture: {type(exc).__name__}: {str(exc).splitlines()[0]}"})
            continue
        row = {**common, "method": method, "graph_ms": graph_ms, "eager_ms": eager_ms,
               "x_hbm_floor": graph_ms / floor_ms, "graph_equal_eager": torch.equal(outs[0], eager_out)}
        if method == "decode_moe_nvfp4":
            ref = outs[0].float()
            row["config"] = decode_config_for(device, H, I, T * K).to_dict()
        elif method == "decode_gemv_nvfp4":
            row["config"] = gemv_config_for(device, H, I, T * K).to_dict()
        elif method.startswith("fused_moe"):
            row["config"] = config_for(device, H, I, T * K).to_dict()
        if ref is not None and method != "decode_moe_nvfp4":
            row["rel_err_vs_decode"] = ((outs[0].float() - ref).norm() / ref.norm()).item()
            row["close_to_decode"] = row["rel_err_vs_decode"] <= REL_TOL_VS_DECODE
        out.append(row)
        del graph, outs
    base = next((r.get("graph_ms") for r in out if r["method"] == "decode_moe_nvfp4"), None)
    for r in out:
        if "graph_ms" in r and base:
            r["x_decode_moe"] = r["graph_ms"] / base
    return out


# --- (iii) captured step --------------------------------------------------------------------------------

def bench_step(name: str, T: int, device, reps: int) -> dict:
    from moe_offload import uva
    from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat
    from moe_offload.host_store import bank_offsets, bank_views
    from moe_offload.kernels.decode_miss import serve_misses
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4

    H, I, E, K = SHAPES[name]
    B = nvfp4_row_bytes(H, I)
    host_ER = pool_rows(random_banks(H, I, E, device), H, I).cpu()
    if not uva.pin_mapped(host_ER):
        raise RuntimeError("could not pin the host rows")
    try:
        host_dev = uva.mapped_device_view(host_ER, device)
        S, X = int(E * RESIDENCY), min(T * K, E)
        gen = torch.Generator().manual_seed(0)
        resident = torch.randperm(E, generator=gen)[:S]
        slot_of_E = torch.full((E,), -1, dtype=torch.int32)
        slot_of_E[resident] = torch.arange(S, dtype=torch.int32)
        slot_of_E = slot_of_E.to(device)
        pool_NR = torch.empty(S + X, B, dtype=torch.uint8, device=device)
        pool_NR[:S] = host_dev[resident.to(device)]
        specs = Nvfp4ModelOptFormat().banks(H, I)
        views = bank_views(specs, bank_offsets(specs), pool_NR)
        ids_TK, weights_TK = random_routing(T, E, K, device, seed=3)
        hidden_TH = torch.randn(T, H, device=device).bfloat16()

        def step():
            rows_TK = serve_misses(slot_of_E, ids_TK, host_dev, pool_NR, S)
            return decode_moe_nvfp4(hidden_TH, rows_TK, weights_TK, views), rows_TK

        eager_out, eager_rows = step()
        graph, (graph_out, graph_rows) = capture(step)
        graph.replay()
        equal_first = torch.equal(graph_out, eager_out) and torch.equal(graph_rows, eager_rows)
        misses = int((eager_rows >= S).sum())
        # change the table between replays: evict the first routed resident expert, admit a missed one
        routed = ids_TK.view(-1).tolist()
        hit = next((e for e in routed if int(slot_of_E[e]) >= 0), None)
        miss = next((e for e in routed if int(slot_of_E[e]) < 0), None)
        if hit is not None and miss is not None:
            s = int(slot_of_E[hit])
            slot_of_E[hit] = -1
            pool_NR[s] = host_dev[miss]
            slot_of_E[miss] = s
        graph.replay()
        eager_out2, eager_rows2 = step()
        equal_after_change = torch.equal(graph_out, eager_out2) and torch.equal(graph_rows, eager_rows2)
        torch.cuda.synchronize()
        sync_error = None
        torch.cuda.set_sync_debug_mode("error")
        try:
            step()
        except RuntimeError as exc:
            sync_error = str(exc).splitlines()[0]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        replay_ms = events_ms(graph.replay, reps)
        eager_ms = events_ms(step, reps)
        return {"shape": name, "T": T, "K": K, "E": E, "residency": RESIDENCY, "missed_pairs_first_step": misses,
                "replay_equal_eager": equal_first, "replay_equal_eager_after_table_change": equal_after_change,
                "table_changed": hit is not None and miss is not None, "sync_debug_error": sync_error,
                "graph_ms": replay_ms, "eager_ms": eager_ms}
    finally:
        uva.unpin([host_ER.data_ptr()])


# --- report ----------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    v, f = report["versions"], report["floors"]
    lines = [
        "# Decode kernels", "",
        f"GPU {v['gpu']}, torch {v['torch']}, triton {v['triton']}, CUDA {v['cuda']}, git {v['git_sha'][:12]}"
        f"{' (dirty)' if v['git_dirty'] else ''}, {v['date']}.",
        f"Copy engine H2D {f['h2d_GBps']:.1f} GB/s (1 GiB pinned, non_blocking); D2D {f['d2d_rw_GBps']:.0f} GB/s "
        "(read + write counted; the HBM floor's denominator).", "",
        *[f"Error: {e}" for e in report.get("errors", [])],
        "## (i) Missing experts read over UVA by serve_misses vs the copy engine", "",
        "| layout | n missing | path | launch | ms | GB/s | x copy-engine floor |", "|---|---:|---|---|---:|---:|---:|",
    ]
    for r in report["uva"]:
        cfg = r.get("config")
        launch = f"{cfg['chunk_bytes'] // 1024} KiB x {cfg['ctas_per_sm']}/SM" if cfg else "-"
        x = f"{r['x_copy_engine_floor']:.2f}" if "x_copy_engine_floor" in r else "-"
        lines.append(f"| {r['layout']} | {r['missing']} | {r['path']} | {launch} | {r['ms']:.3f} | {r['GBps']:.1f} | {x} |")
    lines += ["", "## (ii) Decode MoE layer (per layer, CUDA graph over distinct layers; eager for reference)", "",
              "| shape | T | routed | method | graph us | eager us | x HBM floor | x decode_moe | graph == eager "
              f"| rel err vs decode_moe (ok <= {REL_TOL_VS_DECODE}) |", "|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for r in report["layer"]:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['T']} | {r['routed_experts']} | {r['method']} | skipped: {r['skipped']} | | | | | |")
            continue
        xd = f"{r['x_decode_moe']:.2f}" if r.get("x_decode_moe") else "-"
        err = f"{r['rel_err_vs_decode']:.1e} ({'ok' if r['close_to_decode'] else 'FAIL'})" if "rel_err_vs_decode" in r else "-"
        lines.append(f"| {r['shape']} | {r['T']} | {r['routed_experts']} | {r['method']} | {r['graph_ms'] * 1e3:.1f} | "
                     f"{r['eager_ms'] * 1e3:.1f} | {r['x_hbm_floor']:.2f} | {xd} | {r['graph_equal_eager']} | {err} |")
    lines += ["", "HBM floor per row: routed experts x NVFP4 row bytes / D2D bandwidth.", "",
              f"## (iii) serve_misses + decode_moe_nvfp4 captured (residency {RESIDENCY})", "",
              "| shape | T | missed pairs | replay == eager | == eager after table change | sync seen | graph ms | eager ms |",
              "|---|---:|---:|---|---|---|---:|---:|"]
    for r in report["step"]:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['T']} | skipped: {r['skipped']} | | | | | |")
            continue
        lines.append(f"| {r['shape']} | {r['T']} | {r['missed_pairs_first_step']} | {r['replay_equal_eager']} | "
                     f"{r['replay_equal_eager_after_table_change']} | {r['sync_debug_error'] or 'none'} | "
                     f"{r['graph_ms']:.3f} | {r['eager_ms']:.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for JSON + markdown")
    ap.add_argument("--reps", type=int, default=10, help="timed repetitions per cell (median)")
    ap.add_argument("--layers", type=int, default=8, help="distinct layers of weights per captured graph")
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS)
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--json", action="store_true", help="print the JSON report to stdout")
    ap.add_argument("--uva-only", action="store_true", help="section (i) only")
    ap.add_argument("--git-sha", help="record this commit (default: `git rev-parse HEAD`)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_kernels.py needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    report = {"versions": versions(device, args.git_sha), "args": {k: str(v) for k, v in vars(args).items()}}
    report["floors"] = floors(device, args.reps)
    report["uva"], report["layer"], report["step"], report["errors"] = [], [], [], []
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"decode_kernels-{report['versions']['git_sha'][:12]}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M')}"

    def save() -> None:  # after every section: a run cut short by a timeout keeps what it measured
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / f"{stem}.md").write_text(markdown(report))

    print(f"floors: {report['floors']}", flush=True)
    try:
        report["uva"] = bench_uva(device, args.reps, report["floors"]["h2d_GBps"])
    except Exception as exc:  # noqa: BLE001 - reported, and the other sections still run
        report["errors"].append(f"uva: {type(exc).__name__}: {exc}")
    save()
    print("uva done", flush=True)
    for name in ([] if args.uva_only else args.shapes):
        layers, specs = make_layers(name, args.layers, device)
        for T in args.tokens:
            report["layer"] += bench_layer(name, layers, specs, T, device, report["floors"]["d2d_rw_GBps"], args.reps)
            print(f"{name} T={T} done", flush=True)
        save()
        del layers
        torch.cuda.empty_cache()
        for T in (1, 16, 64):
            try:
                report["step"].append(bench_step(name, T, device, args.reps))
            except Exception as exc:  # noqa: BLE001 - reported in the table, not hidden
                report["step"].append({"shape": name, "T": T, "skipped": f"{type(exc).__name__}: {exc}"})
        save()
    print(json.dumps(report, indent=2) if args.json else markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
