"""Instruction mix of the swapped decode MoE kernels' K loop, compiled offline for sm_90 (no GPU needed).

    python benchmarks/sass_loop.py [--kernel gate_up|down] [--block-m 16 --block-n 32 --block-k 128 --warps 2
        --stages 3] [--maxnreg N] [--unaligned] [--json]

Compiles ``kernels/fused_moe_swap.py``'s kernel with this machine's Triton for an H100/H200 target
(``GPUTarget("cuda", 90, 32)``) and its own ptxas, disassembles the cubin with the nvdisasm Triton ships,
and counts the instructions of the innermost loop (the block between a label and the backward branch to it)
by opcode, plus the registers per thread (cuobjdump). Integer and pointer arguments are marked divisible
by 16 as Triton's launcher specializes them for the store's ``ROW_ALIGN``-padded rows (``--unaligned``: not,
the byte-load variant the tuners timed before b18b0cc). Figures come from the local Triton version, which
may differ from the GPU machine's; the file records it.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path


def compile_kernel(kernel: str, bm: int, bn: int, bk: int, warps: int, stages: int, maxnreg: int | None, aligned: bool,
                   fused_sum: bool = False):
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from moe_offload.kernels import fused_moe_swap as fs

    i32 = dict.fromkeys
    gemm = {"q_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_row_ptr": "*i32",
            "num_padded_ptr": "*i32", **i32(["stride_qn", "stride_qr", "stride_sn", "stride_sr", "stride_gn", "M", "H",
                                             "I", "num_blocks_m", "stride_am"], "i32")}
    consts = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 1, "EVEN_K": True, "DOT_DTYPE": tl.bfloat16,
              "INPUT_PRECISION": "tf32"}
    if kernel == "gate_up":
        fn, sig = fs._gate_up_swap_kernel, {**gemm, "x_ptr": "*bf16", "stride_xt": "i32", "act_ptr": "*bf16", "TOPK": "i32"}
        consts["ACT_BLOCK_K"] = 256
        if fused_sum:  # it zeroes the down launch's counters
            sig.update({"cnt_ptr": "*i32", "n_cnt": "i32"})
        consts["ZERO_BLOCK"] = 128 if fused_sum else 0
    else:
        fn, sig = fs._down_swap_kernel, {**gemm, "act_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "stride_om": "i32"}
        if fused_sum:  # it sums each token's K terms in its epilogue (compute.fused_moe_launches)
            sig.update({"cnt_ptr": "*i32", "final_ptr": "*bf16", "stride_ft": "i32", "res_ptr": "*bf16",
                        "stride_rt": "i32", "TOPK": "i32"})
        consts.update({"SUM_K": fused_sum, "RESIDUAL": fused_sum})
    names = fn.arg_names
    # stride_gn (fp32 elements) is 4 mod 16 on padded rows: never marked
    div = [n for n in names if n in sig and n != "stride_gn" and (sig[n].startswith("*") or n.startswith("stride") or n in ("H", "I"))]
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div} if aligned else {})
    options = {"num_warps": warps, "num_stages": stages, **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options), triton


def loop_mix(sass: str) -> tuple[int, dict]:
    """Instructions of the longest loop (label ... backward branch to it) and their opcodes."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*\.(L_x_\d+):", line))}
    best: list[str] = []
    for i, line in enumerate(lines):
        m = re.search(r"BRA `\(\.(L_x_\d+)\)", line)
        if m and labels.get(m.group(1), 1 << 30) < i:
            ops = [o.group(1) for x in lines[labels[m.group(1)]:i + 1]
                   if (o := re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", x))]
            best = max(best, ops, key=len)
    return len(best), dict(collections.Counter(best).most_common())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", choices=("gate_up", "down"), default="gate_up")
    ap.add_argument("--block-m", type=int, default=16)
    ap.add_argument("--block-n", type=int, default=32)
    ap.add_argument("--block-k", type=int, default=128)
    ap.add_argument("--warps", type=int, default=2)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--maxnreg", type=int, default=None)
    ap.add_argument("--unaligned", action="store_true")
    ap.add_argument("--fused-sum", action="store_true", help="the forms that sum over K in the down launch (gate_up "
                    "zeroes the counters, down sums finished tokens and adds the residual)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    k, triton = compile_kernel(a.kernel, a.block_m, a.block_n, a.block_k, a.warps, a.stages, a.maxnreg, not a.unaligned,
                               a.fused_sum)
    bindir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        sass = subprocess.run([str(bindir / "nvdisasm"), "-c", f.name], capture_output=True, text=True, check=True).stdout
        usage = subprocess.run([str(bindir / "cuobjdump"), "-res-usage", f.name], capture_output=True, text=True).stdout
    regs = re.search(r"REG:(\d+)", usage)
    n, mix = loop_mix(sass)
    weights = a.block_n * a.block_k * (2 if a.kernel == "gate_up" else 1)  # gate and up rows per K step
    per_thread = weights / (32 * a.warps)
    out = {"kernel": a.kernel, "tiles": {"block_m": a.block_m, "block_n": a.block_n, "block_k": a.block_k, "warps": a.warps,
           "stages": a.stages, "maxnreg": a.maxnreg}, "aligned": not a.unaligned, "triton": triton.__version__,
           "target": "sm_90", "registers": int(regs.group(1)) if regs else None, "loop_instructions": n,
           "weights_per_thread_per_step": per_thread, "instructions_per_weight": n / per_thread if per_thread else None,
           "opcodes": mix}
    if a.json:
        print(json.dumps(out, indent=1))
    else:
        print(f"{a.kernel} {out['tiles']} aligned={out['aligned']} (Triton {out['triton']}, sm_90): {out['registers']} registers, "
              f"K loop {n} instructions, {out['instructions_per_weight']:.2f} per weight")
        print("  " + ", ".join(f"{op} {c}" for op, c in list(mix.items())[:16]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
