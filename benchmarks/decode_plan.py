"""The decode step's routing launches timed alone: the router's top-k, the miss plan (workspace or register kernel),
the tile kernels' alignment, and their fused forms (kernels/decode_route.py, decode_miss.py's plan + alignment).

    python benchmarks/decode_plan.py --out DIR [--tokens 1 4 16 64] [--experts 128] [--top-k 8] [--json]
        [--git-sha SHA]

Legend: T tokens, K top-k, E experts, M = T*K routed pairs.
Each variant is captured in a CUDA graph ``--repeat`` times over one step's logits (all experts resident, so the miss
copy launch copies nothing) and the graph's median replay is divided by ``--repeat``: us per step and layer,
launch gaps inside a graph included. Why: an H100 profile at 3ad5d89 put the fused top-k + plan + alignment launch at
48.8 us for 128 pairs, against ~10 us for the three separate launches at 10cd002; the register plan's chunk loop is
the suspect (``decode_miss.register_plan_fits``); this bench times every form in one run.
CPU: no timing (``--smoke`` checks that every variant runs and gives the separate launches' rows).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a script folder, not a package
from fused_moe import versions  # noqa: E402
from tune_decode_moe import graph_ms  # noqa: E402

BLOCK_M = 16  # the swapped tiles' block of pairs (decode_moe_tuning's entries for 4-64 tokens)


def variants(T: int, K: int, E: int, device) -> dict:
    """name -> (fn() running one step's routing launches, rows it leaves) for T tokens."""
    from moe_offload.kernels.decode_miss import copy_misses, plan_misses
    from moe_offload.kernels.decode_route import route_and_serve, route_plan_applies
    from moe_offload.kernels.router import router_topk

    gen = torch.Generator().manual_seed(T)
    logits = torch.randn(T, E, generator=gen).to(device=device, dtype=torch.bfloat16)
    slot_of_E = torch.arange(E, dtype=torch.int32, device=device)  # all resident
    R = 64  # row bytes: nothing is copied, the rows only have to exist
    host = torch.zeros(E, R, dtype=torch.uint8, device=device)
    pool = torch.zeros(E + min(T * K, E), R, dtype=torch.uint8, device=device)
    done = torch.zeros(1, dtype=torch.int32, device=device)
    out: dict = {}

    def separate(registers: bool | None, align: bool):
        def fn():
            _, ids = router_topk(logits, K, True, torch.bfloat16)
            plan = plan_misses(slot_of_E, ids, host, pool, E, registers=registers)
            copy_misses(plan, host, pool, E)
            if align:
                from moe_offload.kernels.decode_moe import decode_align

                decode_align(plan.rows_TK, pool.shape[0], BLOCK_M)
            return plan.rows_TK
        return fn

    out["topk, plan (workspace), copy"] = separate(False, False)
    out["topk, plan (registers, forced), copy"] = separate(True, False)
    out["topk, plan (default), copy"] = separate(None, False)
    out["topk, plan (workspace), copy, align"] = separate(False, True)

    def plan_align():
        _, ids = router_topk(logits, K, True, torch.bfloat16)
        plan = plan_misses(slot_of_E, ids, host, pool, E, align_block_m=BLOCK_M)
        copy_misses(plan, host, pool, E)
        return plan.rows_TK
    out["topk, plan+align (default), copy"] = plan_align
    if route_plan_applies(T, K, False):
        for align in (False, True):
            def route(align=align):
                return route_and_serve(logits, K, True, torch.bfloat16, slot_of_E, host, pool, E, done,
                                       align_block_m=BLOCK_M if align else None)[2].rows_TK
            out["topk+plan+align (route), copy" if align else "topk+plan (route), copy"] = route
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for JSON + markdown")
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64])
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=20, help="steps per captured graph")
    ap.add_argument("--reps", type=int, default=20, help="graph replays (median)")
    ap.add_argument("--smoke", action="store_true", help="CPU: run every variant once and compare rows, no timing")
    ap.add_argument("--json", action="store_true", help="print the JSON report to stdout")
    ap.add_argument("--git-sha", help="record this commit (default: `git rev-parse HEAD`)")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type != "cuda" and not args.smoke:
        print("decode_plan: no CUDA device; pass --smoke for the CPU check", file=sys.stderr)
        return 2
    vers = versions(device, args.git_sha) if device.type == "cuda" else {"git_sha": args.git_sha or "smoke", "gpu": "cpu"}
    report = {"versions": vers, "experts": args.experts, "top_k": args.top_k,
              "repeat": args.repeat, "rows": []}
    for T in args.tokens:
        fns = variants(T, args.top_k, args.experts, device)
        rows = {name: fn().clone() for name, fn in fns.items()}
        first = next(iter(rows.values()))
        for name, r in rows.items():
            if not torch.equal(r, first):
                raise SystemExit(f"decode_plan: {name} gives other rows than {next(iter(rows))} at T={T}")
        for name, fn in fns.items():
            us = None
            if device.type == "cuda":
                ms = graph_ms(lambda fn=fn: [fn() for _ in range(args.repeat)], args.reps)
                us = None if ms is None else ms * 1000 / args.repeat
            report["rows"].append({"tokens": T, "pairs": T * args.top_k, "variant": name, "us": us})
            print(f"T={T:3d} M={T * args.top_k:4d} {name:40s} {us if us is None else round(us, 2)}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    sha = report["versions"].get("git_sha", "unknown")[:12]
    stem = args.out / f"decode_plan-{sha}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1))
    lines = [f"# Decode routing launches, E = {args.experts}, top-{args.top_k} "
             f"({report['versions'].get('gpu', device.type)})", "",
             "us per step and layer (CUDA graph of --repeat steps, median replay / repeat; all experts resident)", "",
             "| tokens | pairs | variant | us |", "| --- | --- | --- | --- |"]
    for r in report["rows"]:
        us = "–" if r["us"] is None else f"{r['us']:.2f}"
        lines.append(f"| {r['tokens']} | {r['pairs']} | {r['variant']} | {us} |")
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    if args.json:
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
