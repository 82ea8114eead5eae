"""Decode attention on one GPU: torch's SDPA on the folded query (what ``compute.decode_attention: sdpa``
runs) against ``kernels/decode_attention.py`` (``triton``), per layer inside CUDA graphs; and the step's KV
write (transformers' ``StaticLayer.update`` against ``SharedStartLayer.update``, ``kernels/kv_write.py``).

    python benchmarks/decode_attention.py --out benchmarks/results [--reps 20] [--json]

Legend: B rows, Hkv KV heads, G query heads per KV head, S cache positions, D head dim, L layers.

Shapes of Qwen3-30B-A3B's decode (Hkv 4, G 8, D 128, bf16) at B = 1 / 4 / 16 / 64 rows, over a static
cache of S = 1152 positions holding 1100 (bool mask, as the engine's decode step passes it). Each method
runs L = 8 layers of distinct K/V (so K/V come from HBM, not L2) inside one CUDA graph; the time is per
layer (CUDA events around a replay, median of ``--reps``), next to the HBM floor of the K/V bytes the
visible positions hold (read once) at the device-to-device bandwidth measured in the same run. The two
outputs are compared (max abs difference). Writes ``decode_attention-<git sha>-<UTC time>.{json,md}``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a script folder, not a package
from decode_kernels import capture, events_ms  # noqa: E402

from moe_offload.bench.timing import measure_hbm  # noqa: E402
from moe_offload.bench.env import git_info  # noqa: E402
from moe_offload.kernels.decode_attention import DEFAULT_CONFIG, AttnConfig, decode_attention  # noqa: E402

HKV, G, D, S, VISIBLE, LAYERS = 4, 8, 128, 1152, 1100, 8
KV_WRITE_POS = 100  # + the StaticLayer replays (warmup + reps + capture's) stays below S


def _cell(B: int, reps: int, hbm_gbs: float) -> dict:
    q, ks, vs, mask = _inputs(B)
    scale = D ** -0.5

    def sdpa():
        return [F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale) for k, v in zip(ks, vs)]

    def triton():
        return [decode_attention(q, k, v, mask, scale) for k, v in zip(ks, vs)]

    out = {"rows": B}
    results = {}
    for name, fn in (("sdpa", sdpa), ("triton", triton)):
        graph, res = capture(fn)
        out[f"{name}_us_per_layer"] = round(events_ms(graph.replay, reps) * 1000 / LAYERS, 2)
        results[name] = res
    diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(results["sdpa"], results["triton"]))
    kv_bytes = 2 * B * HKV * VISIBLE * D * 2
    out.update({"max_abs_diff": diff, "kv_mb_per_layer": round(kv_bytes / 1e6, 3),
                "hbm_floor_us": round(kv_bytes / (hbm_gbs * 1e3), 2),
                "speedup": round(out["sdpa_us_per_layer"] / out["triton_us_per_layer"], 3)})
    return out


def _inputs(B: int):
    gen = torch.Generator(device="cuda").manual_seed(B)
    q = torch.randn(B, HKV, G, D, device="cuda", generator=gen).bfloat16()
    ks = [torch.randn(B, HKV, S, D, device="cuda", generator=gen).bfloat16() for _ in range(LAYERS)]
    vs = [torch.randn(B, HKV, S, D, device="cuda", generator=gen).bfloat16() for _ in range(LAYERS)]
    mask = (torch.arange(S, device="cuda") < VISIBLE)[None, None, None, :].expand(B, 1, 1, S).contiguous()
    return q, ks, vs, mask


def sweep_grid() -> list[AttnConfig]:
    """The launch choices ``--sweep`` times (kernels/decode_attention.py ``AttnConfig``)."""
    # cf9c69a's sweep (with the branch loop and targets 256-1024): the bounded loop won at 4-64 rows; 971877e's
    # (direct on/off, stages 2/3, targets 4-256): direct won at 64 rows, 3 stages never lost by more than 2 %,
    # a target of 4 always lost, and 9 two-tile splits beat 18 one-tile ones at 1 row (min_split_tiles); the combine
    # split over D (combine_block_d, same bits) is timed at 32 columns a program and at one program per (row, head)
    return [AttnConfig(block=bl, warps=w, stages=3, target_programs=tp, bound=True, direct=dr, min_split_tiles=mt,
                       combine_block_d=cb)
            for dr in (False, True) for bl in (32, 64) for w in (4, 8) for tp in (16, 64, 256) for mt in (1, 2)
            for cb in ((32,) if dr else (32, 128))]


def _sweep_cell(B: int, reps: int, hbm_gbs: float) -> dict:
    """Every ``sweep_grid`` config at B rows, L layers per graph: us per layer, and its output against the
    default config's (max abs difference)."""
    q, ks, vs, mask = _inputs(B)
    scale = D ** -0.5
    runs = []
    want = None
    for cfg in [DEFAULT_CONFIG] + sweep_grid():
        graph, res = capture(lambda cfg=cfg: [decode_attention(q, k, v, mask, scale, config=cfg) for k, v in zip(ks, vs)])
        us = round(events_ms(graph.replay, reps) * 1000 / LAYERS, 2)
        want = res if want is None else want
        diff = max((a.float() - b.float()).abs().max().item() for a, b in zip(want, res))
        runs.append({"config": asdict(cfg), "us_per_layer": us, "max_abs_diff_vs_default": diff})
        del graph
    kv_bytes = 2 * B * HKV * VISIBLE * D * 2
    best = min(runs[1:], key=lambda r: r["us_per_layer"])
    return {"rows": B, "default_us": runs[0]["us_per_layer"], "best": best,
            "hbm_floor_us": round(kv_bytes / (hbm_gbs * 1e3), 2), "runs": runs}


def _kv_write_cell(B: int, reps: int) -> dict:
    """One decode step's KV write per layer: transformers' ``StaticLayer.update`` (positions from its own
    counter, two ``index_copy_``) against ``SharedStartLayer.update`` (``kernels/kv_write.py``), L layers per
    graph. Each StaticLayer replay advances its counter by one (from position ``KV_WRITE_POS``, far below S);
    afterwards both write new states once more at that position and must hold them there."""
    from transformers.cache_utils import StaticLayer

    from moe_offload.decode_graph import SharedStartLayer

    if KV_WRITE_POS + reps + 8 > S:
        raise ValueError(f"--reps {reps}: the StaticLayer replays would write past its {S} positions "
                         f"(at most {S - KV_WRITE_POS - 8} reps)")
    gen = torch.Generator(device="cuda").manual_seed(B)
    k = torch.randn(B, 1, HKV, D, device="cuda", generator=gen).bfloat16().transpose(1, 2)  # as attention hands it
    v = torch.randn(B, 1, HKV, D, device="cuda", generator=gen).bfloat16().transpose(1, 2)
    start_0 = torch.full((), KV_WRITE_POS, dtype=torch.long, device="cuda")
    theirs, ours = [StaticLayer(S) for _ in range(LAYERS)], [SharedStartLayer(S, start_0) for _ in range(LAYERS)]
    for layer in theirs + ours:
        layer.lazy_initialization(k, v)
    for layer in theirs:
        layer.cumulative_length.fill_(KV_WRITE_POS)
    out = {"rows": B}
    for name, layers in (("static_layer", theirs), ("shared_start", ours)):
        graph, _ = capture(lambda layers=layers: [layer.update(k, v) for layer in layers])
        out[f"{name}_us_per_layer"] = round(events_ms(graph.replay, reps) * 1000 / LAYERS, 2)
    for layer in theirs:
        layer.cumulative_length.fill_(KV_WRITE_POS)
    k2, v2 = k + 1, v + 1  # states no replay wrote: the final write must land
    for layer in theirs + ours:
        layer.update(k2, v2)
    at = KV_WRITE_POS
    out["same_bits"] = all(torch.equal(x.keys[:, :, at], k2[:, :, 0]) and torch.equal(x.values[:, :, at], v2[:, :, 0])
                           for x in theirs + ours)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--rows", default="1,4,16,64")
    p.add_argument("--git-sha", default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument("--sweep", action="store_true", help="time every launch config of sweep_grid() per row count "
                   "instead (writes decode_attention_sweep-*.{json,md})")
    a = p.parse_args()
    if not torch.cuda.is_available():
        print("decode_attention benchmark: needs CUDA", file=sys.stderr)
        return 2
    hbm = measure_hbm(torch.device("cuda"))["GBps"]  # bench decode's HBM floor measurement
    if a.sweep:
        return _sweep_main(a, hbm)
    cells = [_cell(int(b), a.reps, hbm) for b in a.rows.split(",")]
    writes = [_kv_write_cell(int(b), a.reps) for b in a.rows.split(",")]
    res = {**_report_head(a, hbm), "cells": cells, "kv_write": writes}
    lines = [f"# Decode attention, {res['gpu']}, git {res['git']['sha'][:12]}, torch {res['torch']}", "",
             f"Hkv {HKV}, G {G}, D {D}, bf16, static cache {S} positions, {VISIBLE} visible (bool mask); {LAYERS} "
             f"layers of distinct K/V per CUDA graph; D2D {res['d2d_gbs']} GB/s (read + write) in the same run.", "",
             "| rows | SDPA us/layer | triton us/layer | speedup | HBM floor us | max abs diff |",
             "| --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {c['rows']} | {c['sdpa_us_per_layer']} | {c['triton_us_per_layer']} | {c['speedup']} | "
              f"{c['hbm_floor_us']} | {c['max_abs_diff']:.3g} |" for c in cells]
    lines += ["", "KV write of one decode step per layer (`StaticLayer.update` against `SharedStartLayer.update`, "
              "kernels/kv_write.py):", "", "| rows | StaticLayer us/layer | SharedStartLayer us/layer | same bits |",
              "| --- | --- | --- | --- |"]
    lines += [f"| {w['rows']} | {w['static_layer_us_per_layer']} | {w['shared_start_us_per_layer']} | "
              f"{w['same_bits']} |" for w in writes]
    text = "\n".join(lines) + "\n"
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = a.out / f"decode_attention-{res['git']['sha'][:12]}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}"
        stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
        stem.with_suffix(".md").write_text(text)
    print(json.dumps(res, indent=2) if a.json else text)
    return 0


def _report_head(a, hbm: float) -> dict:
    """What every report of this script starts with: git, GPU, torch, the shape, the measured bandwidth."""
    return {"git": git_info(a.git_sha), "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "shape": {"Hkv": HKV, "G": G, "D": D, "S": S, "visible": VISIBLE, "layers": LAYERS, "dtype": "bfloat16"},
            "d2d_gbs": round(hbm, 1)}


def _sweep_main(a, hbm: float) -> int:
    cells = []
    res = {**_report_head(a, hbm), "cells": cells}
    stem = None
    if a.out is not None:
        a.out.mkdir(parents=True, exist_ok=True)
        stem = a.out / f"decode_attention_sweep-{res['git']['sha'][:12]}-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M}"
    lines = [f"# Decode attention launch sweep, {res['gpu']}, git {res['git']['sha'][:12]}, torch {res['torch']}", "",
             f"Hkv {HKV}, G {G}, D {D}, bf16, static cache {S} positions, {VISIBLE} visible; {LAYERS} layers per "
             f"CUDA graph; {len(sweep_grid())} configs per row count.", "",
             "| rows | default us/layer | best us/layer | best config | HBM floor us | max abs diff |",
             "| --- | --- | --- | --- | --- | --- |"]
    for b in a.rows.split(","):
        c = _sweep_cell(int(b), a.reps, hbm)
        cells.append(c)
        best = c["best"]
        lines.append(f"| {c['rows']} | {c['default_us']} | {best['us_per_layer']} | "
                     f"{' '.join(f'{k}={v}' for k, v in best['config'].items())} | {c['hbm_floor_us']} | "
                     f"{best['max_abs_diff_vs_default']:.3g} |")
        if stem is not None:  # after every row count: a run cut short keeps what it measured
            stem.with_suffix(".json").write_text(json.dumps(res, indent=2))
            stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
        print(lines[-1], flush=True)
    print(json.dumps(res, indent=2) if a.json else "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
