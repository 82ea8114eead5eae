"""Fit the constants of the staged vs routed-only cost model (moe_offload/prefill_path.py) from kernel
benchmark results, and check the model against a ``bench ttft --prefill-path staged,routed`` run.

    python benchmarks/fit_prefill_path.py --decode-kernels benchmarks/results/decode_kernels-<...>.json \\
        --fused-moe benchmarks/results/fused_moe-<...>.json [--write]
    python benchmarks/fit_prefill_path.py --check benchmarks/results/ttft-<label>-<sha>.json

Fits (least squares, seconds per MoE layer; R bytes of an NVFP4 expert row, hbm the D2D bandwidth of the
decode-kernel run, D routed experts, M = T*K routed pairs):
- UVA reads (``serve_misses``, rows padded to 16 B, default launch): ``uva_fixed_s + n*R / uva_GBps``;
- routed compute (``decode_moe_nvfp4``, CUDA graph): ``routed_fixed_s + routed_hbm_factor*D*R/hbm +
  routed_pair_s*M``, over every shape (the GPU's default entry) and per shape (overrides);
- staged compute (dequant + grouped_mm over the whole layer): ``staged_fixed_s +
  staged_hbm_factor*E*R/hbm + staged_pair_s*M``, over every shape.
``h2d_GBps`` and ``hbm_GBps`` are the bandwidths measured in the decode-kernel run; ``max_tokens`` is the
largest T of its decode-kernel rows (``auto`` does not extrapolate past it). ``--write`` replaces the
GPU's entries in moe_offload/prefill_path_table.json.

``--check`` prints, per prompt length and residency of a TTFT result holding both paths, the measured
difference routed - staged beside the model's (per-layer costs x MoE layers; work outside the experts
cancels), and the measured crossover beside the model's threshold.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from moe_offload.host_store import padded_row_bytes
from moe_offload.prefill_path import DEFAULT, TABLE_PATH, CostModel, cost_model, shape_key


MEASURED_ROW_ALIGN = 16  # the rows of the benchmarks' layer rows: padded to 16 bytes (decode_kernels.py's store rows)


def nvfp4_data_bytes(H: int, I: int) -> int:
    """Bytes of one NVFP4 expert's banks (gate_up + down codes, block scales, 3 fp32 global scales): the format's own
    bank sizes."""
    from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat

    return sum(s.nbytes for s in Nvfp4ModelOptFormat().banks(H, I))


def nvfp4_row_bytes(H: int, I: int) -> int:
    """Bytes of one NVFP4 expert row as the measured kernels read it (padded to ``MEASURED_ROW_ALIGN``): the bytes
    term of the fits. Entries are keyed by the store's row bytes (``host_store.padded_row_bytes``), which the
    runtime looks up."""
    return -(-nvfp4_data_bytes(H, I) // MEASURED_ROW_ALIGN) * MEASURED_ROW_ALIGN


def _lstsq(rows: list[list[float]], y: list[float]) -> list[float]:
    coef, *_ = np.linalg.lstsq(np.asarray(rows, dtype=float), np.asarray(y, dtype=float), rcond=None)
    return [float(c) for c in coef]


def fit(decode_kernels: dict, fused_moe: dict, dk_name: str, fm_name: str) -> tuple[str, dict]:
    """``(gpu name, {"default": entry, shape key: overrides})`` from the two result files."""
    gpu = decode_kernels["versions"]["gpu"]
    hbm = decode_kernels["floors"]["d2d_rw_GBps"]
    h2d = decode_kernels["floors"]["h2d_GBps"]
    uva = [u for u in decode_kernels["uva"] if u["path"].startswith("serve_misses") and "padded" in u["layout"]
           and u.get("config", {}).get("chunk_bytes") == 16384 and u["config"].get("ctas_per_sm") == 4]
    u_fixed, u_per_byte = _lstsq([[1.0, u["missing"] * u["row_bytes"]] for u in uva], [u["ms"] * 1e-3 for u in uva])
    layer = [r for r in decode_kernels["layer"] if r["method"] == "decode_moe_nvfp4"]

    def routed_rows(rows):
        R = {r["shape"]: nvfp4_row_bytes(r["H"], r["I"]) for r in rows}
        return ([[1.0, r["routed_experts"] * R[r["shape"]] / (hbm * 1e9), r["T"] * r["K"]] for r in rows],
                [r["graph_ms"] * 1e-3 for r in rows])

    r_fixed, r_factor, r_pair = _lstsq(*routed_rows(layer))
    staged = [r for r in fused_moe["results"] if r["method"] == "dequant_grouped_mm"]
    s_fixed, s_factor, s_pair = _lstsq(
        [[1.0, r["E"] * nvfp4_row_bytes(r["H"], r["I"]) / (hbm * 1e9), r["T"] * r["K"]] for r in staged],
        [r["ms"] * 1e-3 for r in staged])
    max_t = max(r["T"] for r in layer)
    src_dk = f"{dk_name} ({gpu}, {decode_kernels['versions']['date']})"
    src_fm = f"{fm_name} ({fused_moe['versions']['gpu']}, {fused_moe['versions']['date']})"
    default = {
        "h2d_GBps": round(h2d, 2), "uva_GBps": round(1e-9 / u_per_byte, 2), "uva_fixed_s": round(u_fixed, 7),
        "hbm_GBps": round(hbm, 1), "routed_fixed_s": round(r_fixed, 7), "routed_hbm_factor": round(r_factor, 3),
        "routed_pair_s": round(r_pair, 10), "staged_fixed_s": round(s_fixed, 7),
        "staged_hbm_factor": round(s_factor, 3), "staged_pair_s": round(s_pair, 10), "max_tokens": max_t,
        "sources": {
            "h2d_GBps": f"{src_dk}: floors.h2d_GBps (1 GiB pinned copy, copy engine)",
            "hbm_GBps": f"{src_dk}: floors.d2d_rw_GBps (read + write counted)",
            "uva_GBps, uva_fixed_s": f"{src_dk}: uva rows 'rows padded to 16 B', serve_misses at 16 KiB x 4/SM, "
                                     f"{sorted(u['missing'] for u in uva)} missing experts",
            "routed_*": f"{src_dk}: layer rows decode_moe_nvfp4 graph_ms, every shape, T = "
                        f"{sorted({r['T'] for r in layer})}",
            "staged_*": f"{src_fm}: dequant_grouped_mm ms (dequant of the whole layer + grouped_mm), every shape",
            "max_tokens": "largest T of the decode_moe_nvfp4 rows: auto does not extrapolate past it",
        },
    }
    entries = {DEFAULT: default}
    for shape in sorted({r["shape"] for r in layer}):
        rows = [r for r in layer if r["shape"] == shape]
        a, b, c = _lstsq(*routed_rows(rows))
        first = rows[0]
        key = shape_key(first["E"], first["K"], padded_row_bytes(nvfp4_data_bytes(first["H"], first["I"])))
        entries[key] = {"routed_fixed_s": round(a, 7), "routed_hbm_factor": round(b, 3), "routed_pair_s": round(c, 10),
                        "sources": {"routed_*": f"{src_dk}: layer rows decode_moe_nvfp4 graph_ms, shape {shape}"},
                        "shape": f"{shape} (H {first['H']}, I {first['I']}, NVFP4, TP 1)"}
    return gpu, entries


def write(gpu: str, entries: dict, path: Path = TABLE_PATH) -> None:
    table = json.loads(path.read_text())
    table["devices"][gpu] = entries
    path.write_text(json.dumps(table, indent=2) + "\n")


def check(result: dict) -> str:
    """Markdown: measured routed - staged per (tokens, residency) beside the model's."""
    m = result["model"]
    gpu = result["device"]["name"]
    E, K, R, L = m["experts"], m["top_k"], m["bytes_per_expert"], m["moe_layers"]
    model, entry = cost_model(gpu, E, K, R)
    cells = {}
    for c in result["cells"]:
        cells.setdefault((c["prompt_len"], c["residency"]), {})[c.get("prefill_path")] = c["ttft_s"]["median"]
    lines = [f"# Cost model vs measured: {m['label']} on {gpu} (entry {entry}, {L} MoE layers)", "",
             "| tokens | residency | staged ms | routed ms | measured routed - staged ms | model ms |",
             "| --- | --- | --- | --- | --- | --- |"]
    for (n, r), by in sorted(cells.items()):
        if "staged" not in by or "routed" not in by:
            continue
        modelled = L * (model.routed_s(n, E, K, R, r) - model.staged_s(n, E, K, R, r))
        lines.append(f"| {n} | {r:g} | {by['staged'] * 1e3:.1f} | {by['routed'] * 1e3:.1f} | "
                     f"{(by['routed'] - by['staged']) * 1e3:+.1f} | {modelled * 1e3:+.1f} |")
    lines += ["", "| residency | measured: routed faster up to tokens | model threshold (uncapped) |", "| --- | --- | --- |"]
    for r in sorted({r for _, r in cells}):
        lens = sorted(n for (n, rr) in cells if rr == r and {"staged", "routed"} <= set(cells[(n, rr)]))
        faster = [n for n in lens if cells[(n, r)]["routed"] < cells[(n, r)]["staged"]]
        uncapped = CostModel(**{**model.__dict__, "max_tokens": max(lens, default=1)}).threshold(E, K, R, r, 4096)
        lines.append(f"| {r:g} | {max(faster) if faster else 'none'} (of {lens}) | {uncapped} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--decode-kernels", type=Path, help="a benchmarks/decode_kernels.py JSON result")
    p.add_argument("--fused-moe", type=Path, help="a benchmarks/fused_moe.py JSON result")
    p.add_argument("--write", action="store_true", help=f"replace the GPU's entries in {TABLE_PATH.name}")
    p.add_argument("--check", type=Path, help="a bench ttft JSON result with --prefill-path staged,routed")
    a = p.parse_args(argv)
    if a.check:
        print(check(json.loads(a.check.read_text())), end="")
    if a.decode_kernels or a.fused_moe:
        if not (a.decode_kernels and a.fused_moe):
            p.error("--decode-kernels and --fused-moe go together")
        gpu, entries = fit(json.loads(a.decode_kernels.read_text()), json.loads(a.fused_moe.read_text()),
                           f"benchmarks/results/{a.decode_kernels.name}", f"benchmarks/results/{a.fused_moe.name}")
        print(json.dumps({gpu: entries}, indent=2))
        if a.write:
            write(gpu, entries)
    elif not a.check:
        p.error("give --decode-kernels and --fused-moe, or --check")
    return 0


if __name__ == "__main__":
    sys.exit(main())
