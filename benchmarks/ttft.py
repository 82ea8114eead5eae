"""TTFT vs residency per prefill copy mode, with floors and peers: the same ``main`` as
``moe-offload bench ttft`` (moe_offload/bench/ttft.py holds the one implementation and its docs).

    python benchmarks/ttft.py                                        # embedded tiny model, CPU smoke
    python benchmarks/ttft.py --config configs/qwen3-30b-a3b-nvfp4.yaml --prompt-lens 1024 --peer-layers 8
    python benchmarks/plot_ttft.py benchmarks/results/ttft-<preset>-<sha>.json   # the PNG (matplotlib)
"""

from __future__ import annotations

import argparse
import sys

from moe_offload.bench.ttft import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/ttft.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
