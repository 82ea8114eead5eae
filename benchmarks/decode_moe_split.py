"""The decode MoE layer's kernels one by one (kernels/decode_moe.py with its tuned tiles): align, gate_up, down,
each timed alone in a CUDA graph over ``--layers`` layers of distinct weights, against each kernel's HBM floor.

    python benchmarks/decode_moe_split.py [--shape qwen3-30b-a3b] [--tokens 16 64] [--layers 8] [--unaligned]
        [--tiles-of default "NVIDIA H200"] [--json] [--git-sha SHA]
    ncu --clock-control none -k regex:swap_kernel --launch-skip 4 --launch-count 2 --section WarpStateStats ... \\
        python benchmarks/decode_moe_split.py --ncu --tokens 64

Legend: T tokens, K top-k, E experts, H hidden, I intermediate, D distinct routed experts of the step.
align is timed four ways: decode_align's default (the sorted one-program kernel) and the looped one, each over E rows
and over the 48 x E (+ scratch) rows of a fully resident pool, which the looped kernel zeroes and scans every step.
Floors: D x (the kernel's weight + block-scale bytes) / HBM bandwidth (a 1 GiB device-to-device copy, read +
write counted, measured in the same run: the bandwidth ``bench decode``'s HBM floor uses). ``--unaligned`` also times banks whose expert rows are not
padded to 16 bytes (what the tuners timed before b18b0cc): their weight loads cannot be vectorized.
``--ncu``: no timing; each kernel runs eagerly a few times, for a profiler attached from outside.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a script folder, not a package
from fused_moe import SHAPES, hbm_bandwidth, random_banks, random_routing, versions  # noqa: E402
from tune_decode_moe import graph_ms  # noqa: E402


def kernel_times(name: str, T: int, layers: int, device, pad: bool, ncu: bool, tiles_of: str | None = None) -> dict:
    from moe_offload.kernels.decode_moe import DECODE_TUNING_PATH, decode_align, decode_config_for, load_tuning
    from moe_offload.kernels.fused_moe import kernel_calls

    H, I, E, K = SHAPES[name]
    views = [random_banks(H, I, E, device, seed=s, pad=pad) for s in range(layers)]
    rows_TK, weights_TK = random_routing(T, E, K, device)
    hidden_TH = torch.randn(T, H, device=device).bfloat16()
    M = T * K
    terms_MH = torch.empty(M, H, dtype=torch.bfloat16, device=device)
    weights_M = weights_TK.reshape(-1).float()
    cfg = (decode_config_for(device, H, I, M) if tiles_of is None
           else load_tuning(DECODE_TUNING_PATH).lookup(tiles_of, H, I, M))
    align = decode_align(rows_TK, E, cfg.block_m)
    calls = [kernel_calls(hidden_TH, v, align, weights_M, terms_MH, K, cfg) for v in views]
    if ncu:
        for _ in range(3):
            for c in calls:
                c[0]()
                c[1]()
        torch.cuda.synchronize()
        return {}
    D = rows_TK.unique().numel()
    v = views[0]
    nbytes = lambda *keys: sum(v[k][0].numel() * v[k].element_size() for k in keys)  # noqa: E731
    pool = 48 * E + min(M, E)  # the rows a fully resident 48-layer pool aligns over in a decode step (+ scratch)
    ms = {"align": graph_ms(lambda: [decode_align(rows_TK, E, cfg.block_m) for _ in views]),
          # the sorted one-program alignment (decode_align's default up to SORTED_ALIGN_MAX_PAIRS) against the looped
          # one (zeroes and scans every pool row), over E rows and over a pool's rows
          "align_looped": graph_ms(lambda: [decode_align(rows_TK, E, cfg.block_m, 0) for _ in views]),
          "align_pool": graph_ms(lambda: [decode_align(rows_TK, pool, cfg.block_m) for _ in views]),
          "align_pool_looped": graph_ms(lambda: [decode_align(rows_TK, pool, cfg.block_m, 0) for _ in views]),
          "gate_up": graph_ms(lambda: [c[0]() for c in calls]),
          "down": graph_ms(lambda: [c[1]() for c in calls])}
    us = {k: None if t is None else 1e3 * t / layers for k, t in ms.items()}
    return {"shape": name, "T": T, "tiles_of": tiles_of or "this GPU's lookup", "distinct_experts": D, "rows_padded": pad, "config": cfg.to_dict(), "us_per_layer": us,
            "bytes": {"gate_up": D * nbytes("w13_q", "w13_s"), "down": D * nbytes("w2_q", "w2_s")}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--tokens", nargs="+", type=int, default=(16, 64))
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--unaligned", action="store_true")
    ap.add_argument("--ncu", action="store_true")
    ap.add_argument("--tiles-of", nargs="+", default=[None], metavar="GPU",
                    help="also time with the tiles the table holds for these GPU names (e.g. default \"NVIDIA H200\")")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--git-sha", help="record this commit (default: `git rev-parse HEAD`; a device copy's HEAD may be stale)")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("decode_moe_split: needs CUDA", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    if a.ncu:
        for T in a.tokens:
            kernel_times(a.shape, T, 1, dev, True, True)
        return 0
    bw = hbm_bandwidth(dev)  # bytes moved per second by a copy, read + write counted (as bench decode's floor)
    rows = [kernel_times(a.shape, T, a.layers, dev, pad, False, tiles) for T in a.tokens
            for pad in ((True, False) if a.unaligned else (True,)) for tiles in a.tiles_of]
    for r in rows:
        r["floor_us"] = {k: 1e6 * b / bw for k, b in r["bytes"].items()}
        r["x_floor"] = {k: None if r["us_per_layer"][k] is None else r["us_per_layer"][k] / r["floor_us"][k]
                        for k in r["bytes"]}
    if a.json:
        print(json.dumps({"versions": versions(dev, a.git_sha), "hbm_GBps": bw / 1e9, "rows": rows}, indent=1))
    else:
        print(f"HBM {bw / 1e9:.0f} GB/s")
        for r in rows:
            u, f = r["us_per_layer"], r["floor_us"]
            print(f"{r['shape']} T={r['T']:3d} D={r['distinct_experts']:3d} padded={r['rows_padded']!s:5} tiles of {r['tiles_of']}: "
                  f"align {u['align']:.1f} us (looped {u['align_looped']:.1f}; over a 48-layer pool: "
                  f"{u['align_pool']:.1f}, looped {u['align_pool_looped']:.1f}), gate_up {u['gate_up']:.1f} us (floor {f['gate_up']:.1f}), "
                  f"down {u['down']:.1f} us (floor {f['down']:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
