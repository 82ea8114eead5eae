"""Benchmark one NVFP4 MoE layer on CUDA: bf16 grouped GEMM vs dequant + grouped GEMM vs the fused kernel.

Legend: T tokens, K top-k, M = T*K routed pairs, E experts, H hidden, I intermediate.

Methods (same routing, same weights):
- ``bf16_grouped_mm``: weights already dense bf16 (the all-resident bf16 compute floor);
  ``torch._grouped_mm`` for gate_up and down.
- ``dequant_grouped_mm``: ``dequant_banks`` (all E experts) to bf16 per call, then the same path.
- ``fused_nvfp4``: ``fused_moe_nvfp4`` (W4A16, dequant in the K loops, no dense copy) with the tuning
  table's tiles for this GPU (the row's ``config`` says which kernel pair: ``swap_ab``).

Floors measured in the same run: HBM bandwidth (one large device copy) turns the bytes of the
routed experts' weights into a weight-read floor for the NVFP4 and bf16 layouts. Every time is also
reported as a ratio to ``bf16_grouped_mm``.

Usage: ``python benchmarks/fused_moe.py [--out benchmarks/results] [--json] [--git-sha SHA]`` (about a
minute on an H200); writes ``fused_moe-<YYYYmmdd-HHMM>.json`` and ``.md`` under ``--out``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

# name -> (H, I, E, K)
SHAPES = {
    "qwen3-30b-a3b": (2048, 768, 128, 8),
    "flash-next": (2560, 640, 512, 10),
}
TOKENS = (16, 64, 128, 1024, 8192)


def random_banks(H: int, I: int, E: int, device, seed: int = 0, pad: bool = True) -> dict:
    """Valid random NVFP4 banks of E experts on ``device`` (weight std ~ 1/sqrt(fan_in)), laid out
    as column slices of one ``[E, row_bytes]`` byte bank like the store's, rows padded to ``ROW_ALIGN``
    as in the store and the slot pool. Unpadded rows (2,654,220 bytes at Qwen3-30B-A3B's shape) give the
    kernels an expert stride Triton cannot prove 16-byte aligned, so their weight loads compile to byte
    loads without cp.async: the tuners before b18b0cc timed that case, not the one the runtime runs
    (``pad=False`` keeps it, for comparison)."""
    from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat
    from moe_offload.host_store import bank_offsets, bank_views, padded_row_bytes

    gen = torch.Generator(device=device).manual_seed(seed)
    specs = Nvfp4ModelOptFormat().banks(H, I)
    row_bytes = sum(s.nbytes for s in specs)
    row_bytes = padded_row_bytes(row_bytes) if pad else row_bytes
    raw_ER = torch.randint(0, 256, (E, row_bytes), dtype=torch.uint8, device=device, generator=gen)
    views = bank_views(specs, bank_offsets(specs), raw_ER)
    for key in ("w13_s", "w2_s"):  # finite E4M3 scales in [32, 128)
        s = views[key]
        s.copy_((64.0 * (0.5 + 1.5 * torch.rand(s.shape, device=device, generator=gen))).to(torch.float8_e4m3fn))
    fan_in = torch.tensor([H, H, I], dtype=torch.float32, device=device)
    views["gs"].copy_((0.5 + torch.rand(E, 3, device=device, generator=gen)) / (2.93 * 80.0 * fan_in.sqrt()))
    return views


def random_routing(T: int, E: int, K: int, device, seed: int = 1):
    """Softmax-top-k routing of random logits: ``(rows_TK int64, weights_TK fp32)``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    logits_TE = torch.randn(T, E, device=device, generator=gen)
    weights_TK, rows_TK = torch.softmax(logits_TE, -1).topk(K, dim=-1)
    return rows_TK, weights_TK


def grouped_mm_moe(hidden_TH, rows_TK, weights_TK, w13_EFH, w2_EHI):
    """SwiGLU MoE with ``torch._grouped_mm`` over dense bf16 weights; no host sync."""
    T, K = rows_TK.shape
    E, two_i, H = w13_EFH.shape
    rows_M = rows_TK.reshape(-1)
    order_M = torch.argsort(rows_M, stable=True)
    counts_E = torch.zeros(E, dtype=torch.int32, device=rows_M.device).scatter_add_(
        0, rows_M, torch.ones_like(rows_M, dtype=torch.int32)
    )
    offs_E = torch.cumsum(counts_E, 0, dtype=torch.int32)
    x_MH = hidden_TH[order_M // K]
    h_MF = torch._grouped_mm(x_MH, w13_EFH.transpose(1, 2), offs=offs_E)
    act_MI = F.silu(h_MF[:, : two_i // 2]) * h_MF[:, two_i // 2 :]
    y_MH = torch._grouped_mm(act_MI, w2_EHI.transpose(1, 2), offs=offs_E)
    y_MH = y_MH * weights_TK.reshape(-1)[order_M, None].to(y_MH.dtype)
    terms_MH = torch.empty_like(y_MH).index_copy_(0, order_M, y_MH)
    return terms_MH.view(T, K, H).sum(1)


def best_fused_config(spaces: dict, block_ms, tile_space, align_at, kernel_times, label: str, unit: float = 1.0):
    """The tuners' search (``tune_fused_moe.py``, ``tune_decode_moe.py``): for each kernel pair (``spaces``:
    swap_ab -> tile space name) and each ``block_m`` that ``align_at(block_m)`` accepts (``(align, align_ms)``
    or None), the gate_up and the down kernel are timed apart over ``tile_space(space)`` by
    ``kernel_times(config, align) -> (gate_up_ms, down_ms)`` (None where a config cannot run) and the fastest of
    each kept; returns ``(config, ms)`` with the lowest align + gate_up + down, or ``(None, inf)``. ``label``
    and ``unit`` (ms -> printed unit) only shape the printed lines."""
    from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig

    best, best_ms = None, float("inf")
    for swap_ab, space in spaces.items():
        for block_m in block_ms:
            aligned = align_at(block_m)
            if aligned is None:
                continue
            align, align_ms = aligned
            timed = {}
            for tiles in tile_space(space):
                times = kernel_times(FusedMoeConfig(block_m, tiles, tiles, swap_ab=swap_ab), align)
                for which, ms in zip(("gate_up", "down"), times):
                    if ms is not None and ms < timed.get(which, (None, float("inf")))[1]:
                        timed[which] = (tiles, ms)
            if len(timed) < 2 or align_ms is None:
                continue
            total = align_ms + timed["gate_up"][1] + timed["down"][1]
            print(f"  {label} swap_ab={swap_ab:d} block_m={block_m:3d}: align {align_ms * unit:.3f} + gate_up "
                  f"{timed['gate_up'][1] * unit:.3f} + down {timed['down'][1] * unit:.3f} = {total * unit:.3f}", flush=True)
            if total < best_ms:
                best = FusedMoeConfig(block_m, timed["gate_up"][0], timed["down"][0], swap_ab=swap_ab)
                best_ms = total
    return best, best_ms


def hbm_bandwidth(device) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write of a 1 GiB buffer)."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50)
    return 2 * src.numel() / (ms * 1e-3)


def versions(device, git_sha: str | None) -> dict:
    import triton

    dirty = None
    if git_sha is None:
        try:
            git_sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
            dirty = bool(subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True).stdout.strip())
        except (OSError, subprocess.CalledProcessError):
            git_sha = "unknown"
    return {
        "git_sha": git_sha,
        "git_dirty": dirty,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(device),
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
    }


def bench_shape(name: str, T: int, device, bandwidth: float) -> list[dict]:
    import triton.testing

    from moe_offload.kernels.fused_moe import config_for, fused_moe_nvfp4
    from moe_offload.kernels.nvfp4 import dequant_banks

    H, I, E, K = SHAPES[name]
    views = random_banks(H, I, E, device)
    rows_TK, weights_TK = random_routing(T, E, K, device)
    hidden_TH = torch.randn(T, H, device=device).bfloat16()
    routed = int(torch.unique(rows_TK).numel())  # setup only: a sync outside the timed region
    nvfp4_bytes = routed * sum(views[k][0].numel() * views[k].element_size() for k in ("w13_q", "w13_s", "w2_q", "w2_s"))
    bf16_bytes = routed * 3 * H * I * 2
    common = {"shape": name, "H": H, "I": I, "E": E, "K": K, "T": T, "routed_experts": routed}

    fused = lambda: fused_moe_nvfp4(hidden_TH, rows_TK, weights_TK, views)  # noqa: E731
    methods = {"fused_nvfp4": (fused, nvfp4_bytes)}
    skipped = {}
    if hasattr(torch, "_grouped_mm"):
        w13, w2 = dequant_banks(views, torch.bfloat16)
        methods["bf16_grouped_mm"] = (lambda: grouped_mm_moe(hidden_TH, rows_TK, weights_TK, w13, w2), bf16_bytes)

        def dequant_then_grouped():
            d13, d2 = dequant_banks(views, torch.bfloat16)
            return grouped_mm_moe(hidden_TH, rows_TK, weights_TK, d13, d2)

        # dequantizes all E experts: reads the NVFP4 banks, writes and re-reads bf16 weights
        methods["dequant_grouped_mm"] = (dequant_then_grouped, bf16_bytes)
    else:
        skipped = {m: f"torch {torch.__version__} has no torch._grouped_mm" for m in ("bf16_grouped_mm", "dequant_grouped_mm")}

    results, ref = [], None
    for method, (fn, floor_bytes) in methods.items():
        try:
            out = fn()
            ms = triton.testing.do_bench(fn, warmup=10, rep=60)
        except RuntimeError as exc:  # e.g. _grouped_mm unsupported on this GPU: reported, not hidden
            skipped[method] = f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
            continue
        if method == "fused_nvfp4":
            ref = out
            row_extra = {"config": config_for(device, H, I, T * K).to_dict()}
        else:
            row_extra = {}
        row = {**common, "method": method, "ms": ms, "weight_floor_ms": floor_bytes / bandwidth * 1e3, **row_extra}
        row["x_weight_floor"] = ms / row["weight_floor_ms"]
        if method == "bf16_grouped_mm" and ref is not None:
            row["fused_vs_bf16_rel_err"] = ((ref.float() - out.float()).norm() / out.float().norm()).item()
        results.append(row)
    base = next((r["ms"] for r in results if r["method"] == "bf16_grouped_mm"), None)
    for r in results:
        r["x_bf16_grouped_mm"] = r["ms"] / base if base else None
    results += [{**common, "method": m, "skipped": why} for m, why in skipped.items()]
    return results


def markdown(report: dict) -> str:
    v = report["versions"]
    lines = [
        "# Fused NVFP4 MoE layer",
        "",
        f"GPU {v['gpu']}, torch {v['torch']}, triton {v['triton']}, CUDA {v['cuda']}, git {v['git_sha'][:12]}"
        f"{' (dirty)' if v['git_dirty'] else ''}, {v['date']}.",
        f"HBM copy bandwidth {report['hbm_bandwidth_GBps']:.0f} GB/s (floor = routed experts' weight bytes / bandwidth).",
        "",
        "| shape | T | method | ms | x bf16 grouped_mm | x weight floor |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for r in report["results"]:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['T']} | {r['method']} | skipped: {r['skipped']} | | |")
            continue
        xb = f"{r['x_bf16_grouped_mm']:.2f}" if r["x_bf16_grouped_mm"] else "-"
        lines.append(f"| {r['shape']} | {r['T']} | {r['method']} | {r['ms']:.3f} | {xb} | {r['x_weight_floor']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results", help="directory for JSON + markdown")
    ap.add_argument("--json", action="store_true", help="print the JSON report to stdout")
    ap.add_argument("--git-sha", help="record this commit (default: `git rev-parse HEAD`; for copies without .git)")
    ap.add_argument("--tokens", nargs="+", type=int, default=TOKENS, help="token counts T of the layer call")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/fused_moe.py needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    bandwidth = hbm_bandwidth(device)
    results = []
    for name in SHAPES:
        for T in args.tokens:
            results += bench_shape(name, T, device, bandwidth)
            torch.cuda.empty_cache()
    report = {"versions": versions(device, args.git_sha), "hbm_bandwidth_GBps": bandwidth / 1e9, "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"fused_moe-{dt.datetime.now().strftime('%Y%m%d-%H%M')}"
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(report))
    print(json.dumps(report, indent=2) if args.json else markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
