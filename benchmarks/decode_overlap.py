"""Decode misses read while the resident pairs compute: how much of a layer's compute the miss copy can hide.

    python benchmarks/decode_overlap.py --out benchmarks/results [--tokens 16 64] [--misses 0 8 20 36] [--layers 8]

Writes ``decode_overlap-<git sha>-<UTC time>.{json,md}`` under ``--out`` (about a minute on an H100 / H200).
Legend: T tokens, K top-k, E experts, n distinct missing experts of a layer, S = E slots, X scratch rows.

Qwen3-30B-A3B's NVFP4 shape (H 2048, I 768, E 128, K 8), ``--layers`` layers of distinct weights (so weights come
from HBM and host memory, not L2), every layer's host rows pinned and mapped (the runtime's store). Each layer's
table makes n of its routed experts miss (the rest of the E experts sit in slots). Per layer, inside one CUDA graph
of all layers (the captured decode step's form), median of ``--reps`` replays:

- ``serial`` (the runtime today): the miss plan, the SM copy of the n misses (``decode_miss.copy_misses``), then
  ``decode_moe_nvfp4`` over all T*K pairs, on one stream;
- ``copy``: the plan and the copy alone (what SM reads of n rows cost);
- ``compute``: the plan (nothing missing) and ``decode_moe_nvfp4`` alone (what the compute costs);
- ``overlap``: the plan, then the copy on a second stream while ``decode_moe_nvfp4_split`` computes the resident
  pairs on the first; the first waits for the copy, then computes the missed pairs and sums.

``overlap`` must give the bits of ``serial`` (checked every cell). What it can save is at most
``serial - max(copy, compute)``: the SMs that run the copy also run the compute. A floor for each cell is printed
beside it: the n rows over the copy engine (a 1 GiB pinned copy's rate measured in the same run).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a script folder, not a package
from decode_kernels import capture, events_ms, floors, pool_rows  # noqa: E402
from fused_moe import SHAPES, random_banks, random_routing, versions  # noqa: E402

SHAPE = "qwen3-30b-a3b"


class Layer:
    """One layer's pinned, mapped host rows, its device pool (E slot rows + X scratch rows) and its routing."""

    def __init__(self, seed: int, T: int, device):
        from moe_offload import uva
        from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat
        from moe_offload.host_store import bank_offsets, bank_views

        H, I, E, K = SHAPES[SHAPE]
        views = random_banks(H, I, E, device, seed=seed)
        dev_rows = pool_rows(views, H, I)
        self.host_ER = dev_rows.cpu().contiguous()
        if not uva.pin_mapped(self.host_ER):
            raise RuntimeError("could not pin and map the host rows")
        self.host_dev = uva.mapped_device_view(self.host_ER, device)
        self.S, X = E, min(T * K, E)
        self.pool_NR = torch.empty(self.S + X, dev_rows.shape[1], dtype=torch.uint8, device=device)
        self.pool_NR[:E] = dev_rows
        del views, dev_rows
        specs = Nvfp4ModelOptFormat().banks(H, I)
        self.views = bank_views(specs, bank_offsets(specs), self.pool_NR)
        self.ids_TK, self.weights_TK = random_routing(T, E, K, device, seed=100 + seed)
        self.ids_TK = self.ids_TK.to(torch.int32)
        self.hidden_TH = torch.randn(T, H, device=device).bfloat16()
        self.routed = torch.unique(self.ids_TK).cpu()
        self.table_E = torch.arange(E, dtype=torch.int32, device=device)

    def set_misses(self, n: int, seed: int) -> int:
        """Make n of the routed experts miss (at most all of them); returns how many do."""
        E = self.table_E.shape[0]
        table = torch.arange(E, dtype=torch.int32)
        gen = torch.Generator().manual_seed(seed)
        missing = self.routed[torch.randperm(len(self.routed), generator=gen)[:n]]
        table[missing.long()] = -1
        self.table_E.copy_(table)
        return len(missing)

    def close(self) -> None:
        from moe_offload import uva

        uva.unpin([self.host_ER.data_ptr()])


def variants(layers, side: torch.cuda.Stream):
    from moe_offload.kernels.decode_miss import copy_misses, plan_misses
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4, decode_moe_nvfp4_split

    def plan(lay):
        return plan_misses(lay.table_E, lay.ids_TK, lay.host_dev, lay.pool_NR, lay.S)

    def serial():
        outs = []
        for lay in layers:
            p = plan(lay)
            copy_misses(p, lay.host_dev, lay.pool_NR, lay.S)
            outs.append(decode_moe_nvfp4(lay.hidden_TH, p.rows_TK, lay.weights_TK, lay.views, sum_in_down=False))
        return outs

    def copy():
        for lay in layers:
            copy_misses(plan(lay), lay.host_dev, lay.pool_NR, lay.S)

    def compute():
        return [decode_moe_nvfp4(lay.hidden_TH, plan(lay).rows_TK, lay.weights_TK, lay.views, sum_in_down=False)
                for lay in layers]

    def overlap():
        outs, main = [], torch.cuda.current_stream()
        for lay in layers:
            p = plan(lay)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                copy_misses(p, lay.host_dev, lay.pool_NR, lay.S)
            outs.append(decode_moe_nvfp4_split(lay.hidden_TH, p.rows_TK, lay.weights_TK, lay.views, lay.S,
                                               lambda: main.wait_stream(side)))
        return outs

    return {"serial": serial, "copy": copy, "compute": compute, "overlap": overlap}


def bench(T: int, misses: list[int], n_layers: int, device, reps: int, h2d_GBps: float) -> list[dict]:
    layers = [Layer(seed, T, device) for seed in range(n_layers)]
    side = torch.cuda.Stream()
    rows = []
    try:
        row_bytes = layers[0].pool_NR.shape[1]
        for n in misses:
            got = [lay.set_misses(n, seed=n) for lay in layers]
            cell = {"T": T, "misses_per_layer": sum(got) / len(got),
                    "routed_experts_per_layer": sum(len(lay.routed) for lay in layers) / len(layers),
                    "copy_engine_floor_ms": sum(got) / len(got) * row_bytes / h2d_GBps / 1e6}
            fns = variants(layers, side)
            graphs = {}
            for name, fn in fns.items():
                if name == "compute":
                    saved = [lay.table_E.clone() for lay in layers]
                    for lay in layers:
                        lay.table_E.copy_(torch.arange(lay.table_E.shape[0], dtype=torch.int32, device=device))
                    graph, _ = capture(fn)
                    cell["compute_ms"] = events_ms(graph.replay, reps) / n_layers
                    for lay, t in zip(layers, saved):
                        lay.table_E.copy_(t)
                    continue
                graph, out = capture(fn)
                cell[f"{name}_ms"] = events_ms(graph.replay, reps) / n_layers
                graphs[name] = (graph, out)
            graphs["serial"][0].replay()
            graphs["overlap"][0].replay()
            torch.cuda.synchronize()
            cell["overlap_equals_serial"] = all(torch.equal(a, b) for a, b in zip(graphs["serial"][1],
                                                                                    graphs["overlap"][1]))
            eager = fns["overlap"]()
            torch.cuda.synchronize()
            cell["eager_overlap_equals_serial"] = all(torch.equal(a, b) for a, b in zip(graphs["serial"][1], eager))
            cell["saved_ms"] = cell["serial_ms"] - cell["overlap_ms"]
            cell["bound_ms"] = max(cell["copy_ms"], cell["compute_ms"])
            cell["overlap_x_serial"] = cell["overlap_ms"] / cell["serial_ms"]
            rows.append(cell)
            print(json.dumps(cell), flush=True)
            del graphs
    finally:
        for lay in layers:
            lay.close()
    return rows


def markdown(report: dict) -> str:
    v, f = report["versions"], report["floors"]
    lines = ["# Decode misses read while the resident pairs compute", "",
             f"git {v['git_sha'][:12]}, {v.get('gpu')}, torch {v.get('torch')}, triton {v.get('triton')}; "
             f"copy engine {f['h2d_GBps']:.1f} GB/s (1 GiB pinned), per layer, median of {report['args']['reps']} "
             f"replays of a {report['args']['layers']}-layer graph", "",
             "| T | missing / routed experts | copy-engine floor ms | serial | copy | compute | overlap | "
             "overlap / serial | bits equal |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in report["cells"]:
        lines.append(f"| {c['T']} | {c['misses_per_layer']:.0f} / {c['routed_experts_per_layer']:.0f} | "
                     f"{c['copy_engine_floor_ms']:.3f} | {c['serial_ms']:.3f} | {c['copy_ms']:.3f} | "
                     f"{c['compute_ms']:.3f} | {c['overlap_ms']:.3f} | {c['overlap_x_serial']:.3f} | "
                     f"{c['overlap_equals_serial'] and c['eager_overlap_equals_serial']} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--tokens", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--misses", nargs="+", type=int, default=[0, 8, 20, 36])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--git-sha")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/decode_overlap.py needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    report = {"versions": versions(device, args.git_sha), "args": {k: str(v) for k, v in vars(args).items()},
              "floors": floors(device, 5), "cells": []}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"decode_overlap-{report['versions']['git_sha'][:12]}-{dt.datetime.now(dt.timezone.utc).strftime('%Y%m%d-%H%M')}"
    for T in args.tokens:
        report["cells"] += bench(T, args.misses, args.layers, device, args.reps, report["floors"]["h2d_GBps"])
        (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / f"{stem}.md").write_text(markdown(report))
        torch.cuda.empty_cache()
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
