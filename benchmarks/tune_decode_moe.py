"""Tune the decode MoE tiles (kernels/decode_moe.py) on this GPU and write them into ``kernels/decode_moe_tuning.json``.

Legend: T tokens, K top-k, M = T*K routed pairs, E experts, H hidden, I intermediate.

For each layer shape and decode token count, each ``block_m`` that can matter is tried; for each, the
gate_up and the down kernel are timed separately over their tile space, the fastest of each is kept,
and the entry stored for bucket M is the ``block_m`` with the lowest sum (plus the one-launch align).
Every call is timed inside a CUDA graph of ``--layers`` copies of the layer's weights, so the weights
come from HBM (one layer's routed experts at T = 1, ~21 MB, would sit in the 50 MB L2) and the launch
overhead of Python is out of the figure, as in a captured decode step.
Results go under ``devices[<torch.cuda.get_device_name()>][H{H}_I{I}][M]``; other entries are kept.

Usage (CUDA only): ``python benchmarks/tune_decode_moe.py [--shapes qwen3-30b-a3b flash-next]
[--tokens 1 2 4 8 16 32 64] [--space small|full] [--maxnreg none 112] [--out kernels/decode_moe_tuning.json]``.
The small space (12 tile configs per kernel) takes a few minutes per shape on an H200 (mostly Triton
compiles); ``--tokens`` trims it. A config that does not compile or run is skipped and printed.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a script folder, not a package
from fused_moe import SHAPES, best_fused_config, random_banks, random_routing  # noqa: E402

DEFAULT_TOKENS = (1, 2, 4, 8, 16, 32, 64)
SPACES = {
    "small": {"block_n": (16, 32, 64), "block_k": (128, 256), "num_warps": (4,), "num_stages": (3, 4)},
    "full": {"block_n": (16, 32, 64, 128), "block_k": (64, 128, 256), "num_warps": (2, 4, 8), "num_stages": (2, 3, 4, 5)},
    # fused_moe_swap.py: block_n >= 64 gives wgmma (64 weight rows per warpgroup), 16/32 mma.sync with more CTAs
    # (at T = 4-16 a 64-row gate_up tile leaves ~400 CTAs for 132 SMs: measured at 1ee779e, gate_up 2.5 x down)
    "swap": {"block_n": (16, 32, 64), "block_k": (128, 256), "num_warps": (2, 4), "num_stages": (3, 4)},
}
BLOCK_MS = (16, 32)


def graph_ms(fn, reps: int = 20) -> float | None:
    """Device ms of one ``fn()`` replayed from a CUDA graph (median over ``reps`` replays); None when
    it cannot compile, run or be captured here (the reason is printed)."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return sorted(times)[len(times) // 2]
    except Exception as exc:  # noqa: BLE001 - a config that fails is skipped, not fatal; it is printed
        print(f"    skipped: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", flush=True)
        return None


def _maxnreg(text: str) -> int | None:
    """``--maxnreg`` values: ``none`` or a cap KernelTiles accepts (checked before any weights are built)."""
    from moe_offload.kernels.fused_moe_tuning import KernelTiles

    if text.lower() == "none":
        return None
    try:
        return KernelTiles(32, 128, maxnreg=int(text)).maxnreg
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def tile_space(space: str, maxnregs=(None,)):
    """Tiles of ``SPACES[space]``, each with every register cap of ``maxnregs`` (None: the compiler's choice)."""
    from moe_offload.kernels.fused_moe_tuning import KernelTiles

    s = SPACES[space]
    for bn, bk, w, st, mr in itertools.product(s["block_n"], s["block_k"], s["num_warps"], s["num_stages"], maxnregs):
        yield KernelTiles(block_n=bn, block_k=bk, group_m=1, num_warps=w, num_stages=st, maxnreg=mr)


def tune_bucket(layers_views: list[dict], H: int, I: int, E: int, K: int, T: int, spaces: dict[bool, str],
                maxnregs=(None,)) -> tuple[dict, float]:
    """The fastest config at T tokens over ``spaces`` (swap_ab -> tile space name), per layer in a graph."""
    from moe_offload.kernels.decode_moe import decode_align
    from moe_offload.kernels.fused_moe import kernel_calls

    dev = layers_views[0]["w13_q"].device
    L = len(layers_views)
    rows_TK, weights_TK = random_routing(T, E, K, dev)
    hidden_TH = torch.randn(T, H, device=dev).bfloat16()
    M = T * K
    terms_MH = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    weights_M = weights_TK.reshape(-1).float()

    def align_at(block_m):
        if block_m > 16 and M <= E:  # about one pair per expert: a wider block is only padding
            return None
        return decode_align(rows_TK, E, block_m), graph_ms(lambda: decode_align(rows_TK, E, block_m))

    def kernel_times(cfg, align):
        calls = [kernel_calls(hidden_TH, views, align, weights_M, terms_MH, K, cfg) for views in layers_views]
        times = [graph_ms(lambda: [c[i]() for c in calls]) for i in (0, 1)]
        return [None if ms is None else ms / L for ms in times]

    best, best_ms = best_fused_config(spaces, BLOCK_MS, lambda space: tile_space(space, maxnregs), align_at, kernel_times,
                                      f"T={T:3d} (us)", 1e3)
    if best is None:
        raise RuntimeError(f"no config ran for H={H} I={I} E={E} K={K} T={T}")
    return best.to_dict(), best_ms


def gemv_ms(layers_views: list[dict], E: int, K: int, T: int) -> float | None:
    """ms per layer of ``decode_gemv_nvfp4`` (``kernels/decode_gemv.py``, its tuning table's tiles) at T tokens,
    same harness and routing as ``tune_bucket``: the tiles' competitor below ``gemv_max_pairs``."""
    from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4

    dev = layers_views[0]["w13_q"].device
    H = layers_views[0]["w13_q"].shape[2] * 2
    rows_TK, weights_TK = random_routing(T, E, K, dev)
    hidden_TH = torch.randn(T, H, device=dev).bfloat16()
    ms = graph_ms(lambda: [decode_gemv_nvfp4(hidden_TH, rows_TK, weights_TK, v) for v in layers_views])
    return None if ms is None else ms / len(layers_views)


def main(argv=None) -> int:
    from moe_offload.kernels.decode_moe import DECODE_TUNING_PATH
    from moe_offload.kernels.fused_moe_tuning import TuningTable, shape_key

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=DEFAULT_TOKENS, help="token counts T to tune at")
    ap.add_argument("--space", choices=sorted(SPACES), default="small", help="tile space of the fused_moe.py kernels")
    ap.add_argument("--layouts", nargs="+", choices=("ab", "swap"), default=("ab", "swap"),
                    help="kernel pairs to tune: ab = fused_moe.py (over --space), swap = fused_moe_swap.py (its own space)")
    ap.add_argument("--layers", type=int, default=8, help="weight copies cycled so reads come from HBM, not L2")
    ap.add_argument("--out", type=Path, default=DECODE_TUNING_PATH, help="tuning table to update")
    ap.add_argument("--maxnreg", nargs="+", type=_maxnreg, default=[None],
                    help="register caps per thread to try with every tile config (none = the compiler's choice), e.g. "
                         "none 112: the swapped kernels are issue-bound at 25%% occupancy "
                         "(benchmarks/results/HISTORY.md 'b18b0cc')")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune_decode_moe.py needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    data = json.loads(args.out.read_text()) if args.out.exists() else {"schema": 1, "devices": {}}
    TuningTable.from_json(data, str(args.out))  # refuse to extend a malformed table
    spaces = {layout == "swap": "swap" if layout == "swap" else args.space for layout in args.layouts}
    maxnregs = tuple(args.maxnreg)
    for shape in args.shapes:
        H, I, E, K = SHAPES[shape]
        print(f"{name} {shape}: H={H} I={I} E={E} K={K}, {args.layers} layers of weights", flush=True)
        layers_views = [random_banks(H, I, E, device, seed=s) for s in range(args.layers)]
        entries = dict(data["devices"].get(name, {}).get(shape_key(H, I), {}))  # buckets not re-tuned are kept
        for T in sorted(args.tokens):
            cfg, ms = tune_bucket(layers_views, H, I, E, K, T, spaces, maxnregs)
            entries[str(T * K)] = cfg
            print(f"  -> T={T}: {ms * 1e3:.1f} us per layer with {cfg}", flush=True)
            gemv = gemv_ms(layers_views, E, K, T)
            print(f"  -> T={T}: the decode GEMV (its table's tiles) {gemv * 1e3:.1f} us per layer" if gemv else
                  f"  -> T={T}: the decode GEMV did not run", flush=True)
            data["devices"].setdefault(name, {})[shape_key(H, I)] = entries
            TuningTable.from_json(data, str(args.out))  # what we write must load
            args.out.write_text(json.dumps(data, indent=1) + "\n")  # after each bucket: a cut-short run keeps its results
        del layers_views
        torch.cuda.empty_cache()
        print(f"wrote {shape} to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
