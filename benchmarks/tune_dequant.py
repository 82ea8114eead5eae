"""Tune the NVFP4 dequant kernel's tiles (kernels/nvfp4.py) on this GPU and write them into
``kernels/dequant_tuning.json``.

Legend: E experts of a layer, H hidden, I intermediate.

The prefill path dequantizes every expert of a staged layer to bf16 before ``grouped_mm``
(``compute/dequant.py``): on the H200 at d27eed8 that was 0.73 ms per Qwen3-30B-A3B layer, 40 % of the
all-resident layer's device time, at ~2.1 TB/s of read + write traffic against ~4.2 TB/s for a plain
device copy. The kernel is elementwise, so the tiles only change its speed, never its bits: every
config's output is compared bitwise with the default config's, and one that differs is rejected.

For each shape (one layer of random valid banks, larger than L2), every config of the space is timed
eagerly with CUDA events (median of ``--reps`` calls after a warm-up; a call is ~0.3-3 ms, so launch
overhead does not matter); the config with the smallest summed time over the shapes wins. A device
copy of the same bytes is timed in the same run as the bandwidth reference. ``--write`` stores the
winner under ``devices[<torch.cuda.get_device_name()>]``; other entries are kept.

Usage (CUDA only): ``python benchmarks/tune_dequant.py [--shapes qwen3-30b-a3b flash-next] [--space small|full]
[--write] [--report DIR] [--max-seconds S]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # benchmarks/ is a script folder, not a package
from decode_kernels import events_ms  # noqa: E402
from fused_moe import SHAPES, random_banks  # noqa: E402

SPACES = {
    "small": {"block_r": (4, 8, 16, 32), "block_b": (128, 256, 512), "num_warps": (4, 8), "split_store": (False, True)},
    "full": {"block_r": (1, 2, 4, 8, 16, 32, 64), "block_b": (64, 128, 256, 512, 1024), "num_warps": (2, 4, 8, 16),
             "split_store": (False, True)},
}


def configs(space: dict):
    from moe_offload.kernels.nvfp4 import DequantTiles

    for r, b, w, split in itertools.product(*(space[k] for k in ("block_r", "block_b", "num_warps", "split_store"))):
        if r * b <= 1 << 14:  # register tiles beyond 16 K bytes per program only spill
            yield DequantTiles(block_r=r, block_b=b, num_warps=w, split_store=split)


def layer_bytes(views: dict, dtype: torch.dtype) -> tuple[int, int]:
    """(bytes read, bytes written) by one ``dequant_banks`` call over ``views``."""
    read = sum(views[k].numel() * views[k].element_size() for k in ("w13_q", "w13_s", "w2_q", "w2_s"))
    elems = 2 * (views["w13_q"].numel() + views["w2_q"].numel())
    return read, elems * torch.empty((), dtype=dtype).element_size()


def copy_gbs(nbytes: int, reps: int) -> float:
    """Device-copy bandwidth, bytes read + written per second / 1e9 (the reference for a memory-bound kernel)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = events_ms(lambda: dst.copy_(src), reps)
    return 2 * nbytes / ms / 1e6


def tune(shapes: list[str], space: dict, reps: int, max_seconds: float, dtype=torch.bfloat16) -> dict:
    from moe_offload.kernels.nvfp4 import DequantTiles, dequant_banks, load_dequant_tuning

    dev = torch.device("cuda")
    banks = {name: random_banks(*SHAPES[name][:3], dev) for name in shapes}
    start_tiles = load_dequant_tuning()["default"]
    refs = {name: dequant_banks(v, dtype, DequantTiles()) for name, v in banks.items()}
    rows, t0 = [], time.perf_counter()
    for tiles in configs(space):
        if time.perf_counter() - t0 > max_seconds:
            print(f"stopping: --max-seconds {max_seconds} reached", flush=True)
            break
        row = {"tiles": tiles.to_dict(), "ms": {}, "ok": True}
        try:
            for name, views in banks.items():
                w13, w2 = dequant_banks(views, dtype, tiles)
                if not (torch.equal(w13, refs[name][0]) and torch.equal(w2, refs[name][1])):
                    row["ok"], row["reason"] = False, f"output differs from the default tiles on {name}"
                    break
                del w13, w2
                row["ms"][name] = events_ms(lambda v=views: dequant_banks(v, dtype, tiles), reps)
        except Exception as exc:  # noqa: BLE001 - a config that cannot compile or run is skipped and reported
            row["ok"], row["reason"] = False, f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if row["ok"]:
            row["total_ms"] = sum(row["ms"].values())
        rows.append(row)
        print(json.dumps(row), flush=True)
    good = [r for r in rows if r["ok"]]
    if not good:
        raise RuntimeError("no dequant config ran and matched the default tiles' output")
    best = min(good, key=lambda r: r["total_ms"])
    start = next((r for r in good if r["tiles"] == start_tiles.to_dict()), None)
    per_shape = {}
    for name, views in banks.items():
        rd, wr = layer_bytes(views, dtype)
        per_shape[name] = {"read_bytes": rd, "write_bytes": wr,
                           "best_ms": best["ms"][name], "best_gbs": (rd + wr) / best["ms"][name] / 1e6,
                           "start_ms": start["ms"][name] if start else None,
                           "start_gbs": (rd + wr) / start["ms"][name] / 1e6 if start else None}
    return {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__, "dtype": str(dtype),
            "copy_gbs": copy_gbs(1 << 30, reps), "start": start_tiles.to_dict(), "best": best["tiles"],
            "shapes": per_shape, "configs": rows}


def write_table(path: Path, gpu: str, tiles: dict) -> None:
    data = json.loads(path.read_text())
    data["devices"][gpu] = tiles
    path.write_text(json.dumps(data, indent=1) + "\n")


def markdown(res: dict) -> str:
    lines = [f"# NVFP4 dequant tiles ({res['gpu']}, torch {res['torch']}, {res['dtype']})", "",
             f"Device copy {res['copy_gbs']:.0f} GB/s (read + write). Start {res['start']} -> best {res['best']}.", "",
             "| shape | bytes read + written per layer | start ms (GB/s) | best ms (GB/s) | x copy bandwidth (best) |",
             "| --- | --- | --- | --- | --- |"]
    for name, s in res["shapes"].items():
        start = f"{s['start_ms']:.3f} ({s['start_gbs']:.0f})" if s["start_ms"] else "n/a"
        lines.append(f"| {name} | {(s['read_bytes'] + s['write_bytes']) / 1e6:.0f} MB | {start} | "
                     f"{s['best_ms']:.3f} ({s['best_gbs']:.0f}) | {s['best_gbs'] / res['copy_gbs']:.2f} |")
    bad = [c for c in res["configs"] if not c["ok"]]
    lines += ["", f"{len(res['configs'])} configs timed, {len(bad)} rejected."]
    lines += [f"- {c['tiles']}: {c['reason']}" for c in bad[:10]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    from moe_offload.kernels.nvfp4 import DEQUANT_TUNING_PATH

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["qwen3-30b-a3b", "flash-next"])
    ap.add_argument("--space", choices=sorted(SPACES), default="small")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--max-seconds", type=float, default=240.0, help="stop sweeping after this long (best so far)")
    ap.add_argument("--write", action="store_true", help="store the winner in --table under this GPU's name")
    ap.add_argument("--table", type=Path, default=DEQUANT_TUNING_PATH)
    ap.add_argument("--report", type=Path, default=None, help="write tune_dequant-<gpu>.json and .md here")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("tune_dequant needs a CUDA device", file=sys.stderr)
        return 2
    res = tune(a.shapes, SPACES[a.space], a.reps, a.max_seconds)
    text = markdown(res)
    print(text)
    if a.write:
        write_table(a.table, res["gpu"], res["best"])
    if a.report is not None:
        a.report.mkdir(parents=True, exist_ok=True)
        stem = a.report / f"tune_dequant-{res['gpu'].replace(' ', '_')}"
        stem.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
        stem.with_suffix(".md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
