"""Decode tok/s vs residency and batch size, with HBM/PCIe floors and full-GPU peers: the same ``main``
as ``moe-offload bench decode`` (moe_offload/bench/decode.py holds the one implementation and its docs).

    python benchmarks/decode.py                                          # embedded tiny model, CPU smoke
    python benchmarks/decode.py --config configs/qwen3-30b-a3b-nvfp4.yaml --out benchmarks/results
"""

from __future__ import annotations

import argparse
import sys

from moe_offload.bench.decode import add_arguments, main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="benchmarks/decode.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
