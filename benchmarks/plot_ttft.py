"""Plot a ``bench ttft`` JSON: TTFT vs residency per mode (median, whiskers min..max), the PCIe floor
(missed bytes / H2D bandwidth of the same run), the compute floor (all resident) and the full-GPU
peer; one panel per prompt length. Needs matplotlib (``pip install moe-offload[plot]``); the bench
itself does not, so it runs on machines without it.

    python benchmarks/plot_ttft.py benchmarks/results/ttft-qwen3-30b-a3b-<sha>.json [--out file.png]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

MODE_STYLE = {"batch_memcpy": ("tab:blue", "o"), "gather": ("tab:green", "s"), "auto": ("tab:purple", "^"),
              "off": ("tab:red", "x")}


def _peer_ms(result: dict, peer: str, n: int) -> float | None:
    p = result.get("peers", {}).get(peer, {})
    return p["ttft_s"][str(n)]["at_engine_layers_s"] * 1e3 if p.get("status") == "ok" else None


def plot(result: dict, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lens = result["settings"]["prompt_lens"]
    fig, axes = plt.subplots(1, len(lens), figsize=(6.0 * len(lens), 4.6), squeeze=False)
    for ax, n in zip(axes[0], lens):
        cells = [c for c in result["cells"] if c["prompt_len"] == n]
        for variant in result["settings"].get("variants") or result["settings"]["modes"]:
            mc = sorted((c for c in cells if c.get("variant", c["mode"]) == variant), key=lambda c: c["residency"])
            if not mc:
                continue
            mode = mc[0]["mode"]  # a variant is a mode, or mode/prefill path when several paths ran
            x = [c["residency"] for c in mc]
            med = [c["ttft_s"]["median"] * 1e3 for c in mc]
            err = [[m - c["ttft_s"]["min"] * 1e3 for m, c in zip(med, mc)],
                   [c["ttft_s"]["max"] * 1e3 - m for m, c in zip(med, mc)]]
            color, marker = MODE_STYLE.get(mode, (None, "."))
            if variant != mode:
                marker = "x" if variant.endswith("/routed") else marker
            if mode == "off":
                label = f"hit-D2D {variant} (full-layer copies)"
            elif result["modes"][variant]["hit_path"] == "full_layer_copy":
                label = f"hit-D2D {variant} (declined: full-layer copies)"
            else:
                label = f"hit-D2D {variant}"
            ax.errorbar(x, med, yerr=err, color=color, marker=marker, capsize=3, label=label)
        floor = sorted({(c["residency"], c["pcie_floor_s"]) for c in cells})
        ax.plot([r for r, _ in floor], [f * 1e3 for _, f in floor], "k--", label="PCIe floor (misses / H2D bw)")
        cf = result["floors"]["compute"].get(str(n))
        if cf:
            ax.axhline(cf["ttft_s"] * 1e3, color="gray", ls=":", label=f"compute floor (all resident, {cf['mode']})")
        gpu = _peer_ms(result, "full_gpu", n)
        if gpu is not None:
            ax.axhline(gpu, color="tab:orange", ls="-.", label="transformers bf16, full GPU")
        acc = _peer_ms(result, "accelerate", n)
        title = f"{n} tokens" + (f"; accelerate offload {acc / 1e3:.2f} s" if acc is not None else "")
        ax.set(title=title, xlabel="residency (fraction of experts resident)", ylabel="TTFT ms")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    m, dev = result["model"], result["device"]
    fig.suptitle(f"{m['label']} ({m['layers']} layers, {m['format']}) on {dev['name']}\n"
                 f"H2D {result['floors']['h2d']['GBps']:.1f} GB/s, git {result['git']['sha'][:12]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=130)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("json", type=Path, help="a ttft-*.json written by `moe-offload bench ttft`")
    p.add_argument("--out", type=Path, help="PNG path (default: the JSON path with .png)")
    a = p.parse_args(argv)
    out = plot(json.loads(a.json.read_text()), a.out or a.json.with_suffix(".png"))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
