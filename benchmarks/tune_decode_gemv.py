"""Tune the decode GEMV tiles (kernels/decode_gemv.py) on this GPU and write them into
``kernels/decode_gemv_tuning.json``.

Legend: T tokens, K top-k, M = T*K routed pairs, E experts, H hidden, I intermediate.

For each layer shape and token count T up to the entry's ``gemv_max_pairs`` (one pair per gate_up program,
``block_m`` 1), the gate_up tiles are swept (x interleaved, then ``split_x``) with the down tiles held at the
table's current ones, then the down tiles with the best gate_up, both down variants (all pairs of a token per
program, or ``down_per_pair`` + the pair sum), then from T = 4 gate_up programs of 2 and 4 pairs of one row
(``block_m``, x interleaved and split); each call is timed inside a CUDA graph over ``--layers`` copies of the
layer's weights (reads come from HBM, not the 50 MB L2; no Python launch overhead, as in a captured decode
step). The entry for bucket M keeps the fastest config; ``gemv_max_pairs`` and larger buckets are kept as
they are. Results go under ``devices[<torch.cuda.get_device_name()>][H{H}_I{I}]``; other entries are kept.

Usage (CUDA only): ``python benchmarks/tune_decode_gemv.py [--shapes qwen3-30b-a3b] [--tokens 1 2 4 8 16]
[--space small|full] [--out kernels/decode_gemv_tuning.json] [--report DIR]``. Triton compiles dominate
(~2 s per config, shared across T): the small space (2 x 12 + 8 + 6) takes two to three minutes on an H200.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a script folder, not a package
from fused_moe import SHAPES, random_banks, random_routing  # noqa: E402
from tune_decode_moe import graph_ms  # noqa: E402

SPACES = {  # Triton compiles dominate (~2 s each on the H200 image): "small" is 2 x 12 + 8 + 6 configs
    # gate_up tiles (block_k 2048: one K step for Qwen3's H, every load of a program in flight at once), all-pairs
    # down tiles, per-pair down tiles (down_per_pair: KP times the programs, so more rows per program for the
    # same bytes in flight)
    "small": ({"block_n": (4, 8, 16, 32), "block_k": (512, 1024, 2048), "num_warps": (4,)},
              {"block_n": (2, 4, 8, 16), "block_k": (256, 512), "num_warps": (4,)},
              {"block_n": (8, 16, 32), "block_k": (256, 512), "num_warps": (4,)}),
    "full": ({"block_n": (1, 2, 4, 8, 16, 32), "block_k": (256, 512, 1024, 2048), "num_warps": (2, 4, 8)},
             {"block_n": (1, 2, 4, 8), "block_k": (128, 256, 512), "num_warps": (1, 2, 4)},
             {"block_n": (4, 8, 16, 32, 64), "block_k": (128, 256, 512), "num_warps": (2, 4, 8)}),
}


def space(s: dict):
    from moe_offload.kernels.decode_gemv_tuning import GemvTiles

    for bn, bk, w in itertools.product(s["block_n"], s["block_k"], s["num_warps"]):
        yield GemvTiles(block_n=bn, block_k=bk, num_warps=w)


def tune(layers_views: list[dict], H: int, I: int, E: int, K: int, T: int, start, spaces) -> tuple[object, float, float, dict]:
    """-> (best GemvConfig, its us per layer, the starting config's us per layer, the same two with the portable
    weight conversion where this GPU runs the PTX one: ``{"start": us, "best": us}``, else ``{}``)."""
    from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4
    from moe_offload.kernels.decode_gemv_tuning import GemvConfig
    from moe_offload.kernels.nvfp4 import ptx_conversion

    dev = layers_views[0]["w13_q"].device
    L = len(layers_views)
    rows_TK, weights_TK = random_routing(T, E, K, dev)
    hidden_TH = torch.randn(T, H, device=dev).bfloat16()

    def timed(cfg, ptx=None):
        def fn():
            for views in layers_views:
                decode_gemv_nvfp4(hidden_TH, rows_TK, weights_TK, views, config=cfg, ptx=ptx)
        ms = graph_ms(fn)
        return None if ms is None else ms * 1e3 / L

    base = timed(start)
    best, best_us = start, base if base is not None else float("inf")
    for split_x in (False, True):
        for tiles in space(spaces[0]):
            cfg = GemvConfig(1, tiles, best.down, best.down_per_pair, split_x)
            us = timed(cfg)
            if us is not None and us < best_us:
                best, best_us = cfg, us
    for per_pair, down_space in ((False, spaces[1]), (True, spaces[2])):
        for tiles in space(down_space):
            cfg = GemvConfig(1, best.gate_up, tiles, down_per_pair=per_pair, split_x=best.split_x)
            us = timed(cfg)
            if us is not None and us < best_us:
                best, best_us = cfg, us
    if T >= 4:  # several tokens may share an expert: gate_up programs of block_m pairs of one row (+ the align launch)
        for block_m, split_x in itertools.product((2, 4), (False, True)):
            cfg = GemvConfig(block_m, best.gate_up, best.down, best.down_per_pair, split_x)
            us = timed(cfg)
            if us is not None and us < best_us:
                best, best_us = cfg, us
    portable = {"start": timed(start, ptx=False), "best": timed(best, ptx=False)} if ptx_conversion(dev) else {}
    return best, best_us, base, portable


def main(argv=None) -> int:
    from moe_offload.kernels.decode_gemv_tuning import GEMV_TUNING_PATH, gemv_config_for, gemv_entry, load_gemv_tuning
    from moe_offload.kernels.fused_moe_tuning import shape_key

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen3-30b-a3b"])
    ap.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    ap.add_argument("--space", choices=sorted(SPACES), default="small")
    ap.add_argument("--layers", type=int, default=8, help="weight copies cycled so reads come from HBM, not L2")
    ap.add_argument("--out", type=Path, default=GEMV_TUNING_PATH, help="tuning table to update")
    ap.add_argument("--report", type=Path, default=None, help="also write the timings as JSON under this folder")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune_decode_gemv.py needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    data = json.loads(args.out.read_text())
    report = {"device": name, "torch": torch.__version__, "cells": []}
    for shape in args.shapes:
        H, I, E, K = SHAPES[shape]
        print(f"{name} {shape}: H={H} I={I} E={E} K={K}, {args.layers} layers of weights", flush=True)
        layers_views = [random_banks(H, I, E, device, seed=s) for s in range(args.layers)]
        entry = gemv_entry(device, H, I)
        buckets = {str(m): cfg.to_dict() for m, cfg in entry.buckets.items()}
        for T in sorted(args.tokens):
            if T * K > entry.gemv_max_pairs:  # "auto" never picks this kernel there
                continue
            start = gemv_config_for(device, H, I, T * K)
            best, us, base, portable = tune(layers_views, H, I, E, K, T, start, SPACES[args.space])
            buckets[str(T * K)] = best.to_dict()
            report["cells"].append({"shape": shape, "T": T, "pairs": T * K, "us_per_layer": us,
                                    "start_us_per_layer": base, "config": best.to_dict(),
                                    "portable_conversion_us_per_layer": portable})
            print(f"  T={T}: {base:.1f} -> {us:.1f} us per layer with {best.to_dict()}", flush=True)
            if portable:
                start_us, best_us = (f"{v:.1f}" if v is not None else "failed" for v in portable.values())
                print(f"  T={T} portable weight conversion (ptx=False): start {start_us}, best {best_us} us per layer",
                      flush=True)
            # written after every T: a run cut short by its timeout keeps what it measured (at fb04647 the T = 1
            # result, 49.3 -> 36.5 us per layer, was printed but never written: the table was written per shape)
            data["devices"].setdefault(name, {})[shape_key(H, I)] = {
                "gemv_max_pairs": entry.gemv_max_pairs,
                "buckets": dict(sorted(buckets.items(), key=lambda kv: int(kv[0])))}
            args.out.write_text(json.dumps(data, indent=1) + "\n")
            load_gemv_tuning.cache_clear()
            load_gemv_tuning(args.out)  # what we wrote must load
            print(f"wrote {shape} T={T} to {args.out}", flush=True)
        del layers_views
        torch.cuda.empty_cache()
    if args.report:
        args.report.mkdir(parents=True, exist_ok=True)
        (args.report / "tune_decode_gemv.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
