"""This host's two link rates (``link_rates.measure_link``: SM reads of mapped pinned rows against the copy engine) on
one real-size pinned layer of Qwen3-30B-A3B NVFP4 rows, without a checkpoint: which kind of host a lent GPU is
(``slow``: SM reads below ``link_rates.SLOW_SM_READS`` x the copy engine; null, with ``error``, where nothing could
be measured), so that a GPU call can pick the
measurements that host is for (``benchmarks/gpu_run.sh`` stage ``link``). Seconds on a GPU; CPU runs the reference
copies (their "rates" say nothing about a link).

    python benchmarks/link_probe.py --out DIR [--reps 3]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from moe_offload.host_store import ExpertStore
from moe_offload.link_rates import SLOW_SM_READS, LinkUnmeasurable, measure_link
from moe_offload.uva import UvaError


def probe(reps: int, device: torch.device) -> dict:
    """One entry per measurement (``reps`` of them: each is already the best of ``LINK_REPS``), and ``slow`` by
    their median share."""
    store = ExpertStore.for_preset("qwen3-30b-a3b", 1, pin=device.type == "cuda")
    runs = [measure_link(store, device).to_dict() for _ in range(reps)]
    shares = sorted(r["uva_GBps"] / r["h2d_GBps"] for r in runs)
    share = shares[len(shares) // 2]
    return {"runs": runs, "share": share, "slow": share < SLOW_SM_READS, "slow_below": SLOW_SM_READS,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for link.json")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        report = probe(args.reps, device)
    except (LinkUnmeasurable, UvaError) as exc:  # no kind of host to name: say why, never "fast" by default
        (args.out / "link.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}", "slow": None}))
        print(f"link: not measured ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 1
    (args.out / "link.json").write_text(json.dumps(report, indent=1))
    print(f"link: SM reads {[round(r['uva_GBps'], 1) for r in report['runs']]} GB/s, copy engine "
          f"{[round(r['h2d_GBps'], 1) for r in report['runs']]} GB/s, share {report['share']:.2f}: "
          f"{'slow' if report['slow'] else 'fast'} SM reads")
    return 0


if __name__ == "__main__":
    sys.exit(main())
