"""Tune the fused NVFP4 MoE tiles on this GPU and write them into ``kernels/fused_moe_tuning.json``.

Legend: T tokens, K top-k, M = T*K routed pairs, E experts, H hidden, I intermediate.

For each layer shape and token count, each kernel pair (``--layouts``: the ``fused_moe.py`` kernels and
the swapped-operand ones of ``fused_moe_swap.py``) and every ``block_m`` is tried; for each, the gate_up and
the down kernel are timed separately over their tile space (``triton.testing.do_bench``) and the fastest of
each is kept; the entry stored for bucket M is the ``block_m`` with the lowest sum. Results go under
``devices[<torch.cuda.get_device_name()>][H{H}_I{I}][M]``; other devices' entries are kept. Each bucket
also records the whole fused call against the runtime's dequant + grouped_mm at the same size
(``faster_than_dequant``, read by ``compute.backend: auto``; ``ms`` and ``dequant_ms`` as a record).

Usage (CUDA only): ``python benchmarks/tune_fused_moe.py [--shapes qwen3-30b-a3b flash-next]
[--tokens 1 8 64 ...] [--space small|full] [--out kernels/fused_moe_tuning.json]``.
The small space (16 tile configs per kernel and block_m) takes roughly 10 minutes per shape at the
default token counts on an H200, mostly Triton compiles; ``--tokens`` trims it.
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

DEFAULT_TOKENS = (1, 4, 16, 64, 256, 1024, 4096, 8192)
SPACES = {
    "small": {"block_n": (64, 128), "block_k": (64, 128), "num_warps": (4, 8), "num_stages": (3, 4)},
    "full": {"block_n": (32, 64, 128, 256), "block_k": (64, 128, 256), "num_warps": (4, 8), "num_stages": (2, 3, 4, 5)},
    # fused_moe_swap.py: the weight tile is the wgmma's M side (64 rows per warpgroup), so block_n >= 64
    "swap": {"block_n": (64, 128), "block_k": (128, 256), "num_warps": (4, 8), "num_stages": (3,)},
}
BLOCK_MS = (16, 32, 64, 128)


def tile_space(space: str, group_m: int = 1):
    from moe_offload.kernels.fused_moe_tuning import KernelTiles

    s = SPACES[space]
    for bn, bk, w, st in itertools.product(s["block_n"], s["block_k"], s["num_warps"], s["num_stages"]):
        yield KernelTiles(block_n=bn, block_k=bk, group_m=group_m, num_warps=w, num_stages=st)


def time_ms(fn) -> float | None:
    """Median ms of ``fn``; None when the config cannot run here (e.g. out of shared memory)."""
    import triton.testing
    from triton.runtime.errors import OutOfResources

    try:
        return triton.testing.do_bench(fn, warmup=5, rep=25)
    except (OutOfResources, RuntimeError):
        return None


def tune_bucket(views, H: int, I: int, E: int, K: int, T: int, spaces: dict[bool, str],
                block_ms=BLOCK_MS) -> tuple[dict, float]:
    """The fastest config at T tokens over ``spaces`` (swap_ab -> tile space name)."""
    from moe_offload.kernels.fused_moe import kernel_calls, moe_align

    dev = views["w13_q"].device
    rows_TK, weights_TK = random_routing(T, E, K, dev)
    hidden_TH = torch.randn(T, H, device=dev).bfloat16()
    M = T * K
    terms_MH = torch.empty(M, H, dtype=torch.bfloat16, device=dev)
    weights_M = weights_TK.reshape(-1).float()
    group_m = 1 if M <= E else 8  # group_m only helps when several M blocks share an expert's weight tiles

    def align_at(block_m):
        if block_m > 16 and block_m > 2 * M:  # a block mostly of padding: never faster than a smaller one
            return None
        return moe_align(rows_TK, E, block_m), time_ms(lambda: moe_align(rows_TK, E, block_m))

    def kernel_times(cfg, align):
        return [time_ms(fn) for fn in kernel_calls(hidden_TH, views, align, weights_M, terms_MH, K, cfg)]

    best, best_ms = best_fused_config(spaces, block_ms, lambda space: tile_space(space, group_m), align_at,
                                      kernel_times, f"T={T:5d}")
    if best is None:
        raise RuntimeError(f"no config ran for H={H} I={I} E={E} K={K} T={T}")
    return best.to_dict(), best_ms


def against_dequant(views, E: int, K: int, T: int, cfg: dict) -> dict:
    """The whole fused call with ``cfg`` (alignment, the hidden states' split copy, both kernels, the sum over
    K) against the runtime's dequant + grouped_mm compute (every expert dequantized, as at prefill), same
    routing: ``{"faster_than_dequant", "ms", "dequant_ms"}`` for the table (``compute/auto.py`` reads the flag)."""
    from moe_offload.compute.dequant import DequantGroupedCompute
    from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat
    from moe_offload.kernels.fused_moe import fused_moe_nvfp4
    from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig

    dev = views["w13_q"].device
    H = views["w13_q"].shape[2] * 2
    rows_TK, weights_TK = random_routing(T, E, K, dev)
    hidden_TH = torch.randn(T, H, device=dev).bfloat16()
    config = FusedMoeConfig.from_dict(cfg)
    dequant = DequantGroupedCompute(Nvfp4ModelOptFormat(), torch.bfloat16, E, use_triton_dequant=True)
    fused_ms = time_ms(lambda: fused_moe_nvfp4(hidden_TH, rows_TK, weights_TK, views, config=config))
    dequant_ms = time_ms(lambda: dequant(hidden_TH, rows_TK, weights_TK, views, E))
    faster = fused_ms is not None and dequant_ms is not None and fused_ms < dequant_ms
    print(f"  T={T:5d}: fused {fused_ms} ms, dequant + grouped_mm {dequant_ms} ms", flush=True)
    return {"faster_than_dequant": faster, "ms": fused_ms, "dequant_ms": dequant_ms}


def main(argv=None) -> int:
    from moe_offload.kernels.fused_moe_tuning import TUNING_PATH, TuningTable, shape_key

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    ap.add_argument("--tokens", nargs="+", type=int, default=DEFAULT_TOKENS, help="token counts T to tune at")
    ap.add_argument("--space", choices=sorted(SPACES), default="small", help="tile space of the fused_moe.py kernels")
    ap.add_argument("--layouts", nargs="+", choices=("ab", "swap"), default=("ab", "swap"),
                    help="kernel pairs to tune: ab = fused_moe.py (over --space), swap = fused_moe_swap.py (its own space)")
    ap.add_argument("--block-ms", nargs="+", type=int, default=BLOCK_MS, help="block_m values to try (compiles scale with them)")
    ap.add_argument("--out", type=Path, default=TUNING_PATH, help="tuning table to update")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/tune_fused_moe.py needs CUDA", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    name = torch.cuda.get_device_name(device)
    data = json.loads(args.out.read_text()) if args.out.exists() else {"schema": 1, "devices": {}}
    TuningTable.from_json(data, str(args.out))  # refuse to extend a malformed table
    spaces = {layout == "swap": "swap" if layout == "swap" else args.space for layout in args.layouts}
    for shape in args.shapes:
        H, I, E, K = SHAPES[shape]
        print(f"{name} {shape}: H={H} I={I} E={E} K={K}", flush=True)
        views = random_banks(H, I, E, device)
        entries = dict(data["devices"].get(name, {}).get(shape_key(H, I), {}))  # buckets not re-tuned are kept
        for T in sorted(args.tokens):
            cfg, ms = tune_bucket(views, H, I, E, K, T, spaces, args.block_ms)
            cfg.update(against_dequant(views, E, K, T, cfg))
            entries[str(T * K)] = cfg
            print(f"  -> T={T}: {ms:.3f} ms with {cfg}", flush=True)
            data["devices"].setdefault(name, {})[shape_key(H, I)] = entries
            TuningTable.from_json(data, str(args.out))  # what we write must load
            args.out.write_text(json.dumps(data, indent=1) + "\n")  # after each bucket: a cut-short run keeps its results
        del views
        torch.cuda.empty_cache()
        print(f"wrote {shape} to {args.out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
