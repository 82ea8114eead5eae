"""decode_moe_nvfp4 (kernels/decode_moe.py) against the plain-torch reference (dequant + matmul in fp32),
and its one-launch alignment against the three-kernel one, on awkward decode shapes.

Legend: T tokens, K top-k, N bank rows, H hidden, I intermediate.
Without CUDA the kernels run in the Triton interpreter on CPU tensors (small shapes only).
"""

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat, random_nvfp4  # noqa: E402
from moe_offload.host_store import bank_offsets, bank_views  # noqa: E402
from moe_offload.kernels.decode_moe import (  # noqa: E402
    DECODE_TUNING_PATH,
    SORTED_ALIGN_MAX_PAIRS,
    decode_align,
    decode_config_for,
    decode_moe_nvfp4,
    decode_moe_nvfp4_split,
)
from moe_offload.kernels.fused_moe import moe_align, moe_reference  # noqa: E402
from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig, KernelTiles, load_tuning  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FMT = Nvfp4ModelOptFormat()


def make_pool(N: int, H: int, I: int, seed: int = 0):
    """``(pool_NR, views)``: N random NVFP4 experts as rows of one byte pool (4 spare bytes per row, so
    dim 0 of every bank view is strided), weight std ~ 1/sqrt(fan_in) so SiLU sees both signs."""
    gen = torch.Generator().manual_seed(seed)
    specs = FMT.banks(H, I)
    pool_NR = torch.zeros(N, sum(s.nbytes for s in specs) + 4, dtype=torch.uint8)
    views = bank_views(specs, bank_offsets(specs), pool_NR)
    for e in range(N):
        views["w13_q"][e], views["w13_s"][e], _ = random_nvfp4(2 * I, H, gen)
        views["w2_q"][e], views["w2_s"][e], _ = random_nvfp4(H, I, gen)
    g0 = 0.02 / (2.93 * 80.0)  # random_nvfp4 weights have std 0.02 at this global
    fan_in = torch.tensor([H, H, I], dtype=torch.float32)
    views["gs"].copy_(g0 / 0.02 / fan_in.sqrt() * (0.5 + torch.rand(N, 3, generator=gen)))
    pool_NR = pool_NR.to(DEVICE)
    return pool_NR, bank_views(specs, bank_offsets(specs), pool_NR)


SMALL = FusedMoeConfig(16, KernelTiles(16, 32, group_m=1), KernelTiles(16, 32, group_m=1))  # many N tiles, K steps
WIDE_K = FusedMoeConfig(16, KernelTiles(32, 128), KernelTiles(32, 128))  # BLOCK_K > H, I: masked K tail
BM32 = FusedMoeConfig(32, KernelTiles(32, 64), KernelTiles(16, 32))
# the swapped-operand kernels (fused_moe_swap.py) read pool rows through the same alignment
SWAP = FusedMoeConfig(16, KernelTiles(16, 32, group_m=1), KernelTiles(32, 128, group_m=1), swap_ab=True)
# a register cap per thread (ptxas' limit, a launch option): results must not depend on it
SWAP_CAPPED = FusedMoeConfig(16, KernelTiles(16, 32, group_m=1, maxnreg=96), KernelTiles(32, 128, group_m=1, maxnreg=80),
                             swap_ab=True)
CONFIGS = {"small": SMALL, "wide-k": WIDE_K, "block-m-32": BM32, "table": None, "swap": SWAP, "swap-maxnreg": SWAP_CAPPED}

CASES = {  # T, K, N, H, I, routing
    "one-token-top1": (1, 1, 3, 32, 16, "random"),
    "one-token-top8": (1, 8, 12, 32, 32, "random"),
    "all-pairs-one-row": (9, 2, 4, 32, 16, "all-row-2"),
    "duplicate-row-in-a-token": (3, 3, 5, 64, 16, "dup"),
    "seventeen-tokens-odd-K": (17, 3, 6, 32, 32, "random"),
}


def routing(T, K, N, kind, gen):
    if kind == "random":
        rows = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(T)])
    elif kind == "dup":
        rows = torch.randint(0, 2, (T, K), generator=gen)  # rows 0/1 repeated inside tokens
    else:
        rows = torch.full((T, K), 2)
    w = torch.rand(T, K, generator=gen)
    return rows.to(DEVICE), (w / w.sum(1, keepdim=True)).to(DEVICE)


def run(case, dtype, config, seed=0):
    T, K, N, H, I, kind = CASES[case]
    _, views = make_pool(N, H, I, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    rows, weights = routing(T, K, N, kind, gen)
    out = decode_moe_nvfp4(hidden, rows, weights, views, config=config)
    ref = moe_reference(hidden.float(), rows, weights, *FMT.dequantize(views, torch.float32))
    return out, ref


def layer_inputs(T, K, N, H, I, kind, seed, residual):
    """``(views, hidden, residual or None, rows, weights)`` in bf16 for a layer call of T tokens at top-K over N rows."""
    _, views = make_pool(N, H, I, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE, torch.bfloat16)
    res = torch.randn(T, H, generator=gen).to(DEVICE, torch.bfloat16) if residual else None
    return (views, hidden, res, *routing(T, K, N, kind, gen))


def assert_close_to_scale(out, ref, rel):
    """|out - ref| <= rel * (|ref| + max|ref|)."""
    torch.testing.assert_close(out.float(), ref, rtol=rel, atol=rel * ref.abs().max().item())


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("case", CASES.keys())
def test_decode_moe_matches_the_fp32_reference(case, config):
    out, ref = run(case, torch.float32, config)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # Same exact NVFP4 weights and fp32 activations; only summation order (<= 64 terms per dot) and
    # exp() differ: a few fp32 ulps (~1e-7). 1e-5 leaves two orders of margin, while a wrong nibble,
    # scale, global, row or routing weight moves results by >= 1e-2.
    assert_close_to_scale(out, ref, 1e-5)


@pytest.mark.parametrize("case", ["one-token-top8", "seventeen-tokens-odd-K"])
def test_decode_moe_matches_the_reference_in_bf16(case):
    out, ref = run(case, torch.bfloat16, SMALL)
    assert out.dtype == torch.bfloat16
    # Three roundings to bf16 (SiLU activation, each weighted term, the output), each <= 2^-7 relative
    # (the interpreter truncates; CUDA rounds to nearest, half that): <= 3 * 2^-7 ~ 2.4e-2; 3e-2 above it.
    assert_close_to_scale(out, ref, 3e-2)


def test_decode_moe_reads_slot_rows_of_a_larger_pool_in_place():
    # a pool of 10 rows of which a token uses rows 7 and 9 (like scratch rows past the slots)
    _, views = make_pool(10, 32, 16, seed=4)
    hidden = torch.randn(1, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    rows = torch.tensor([[9, 7]], device=DEVICE)
    weights = torch.tensor([[0.25, 0.75]], device=DEVICE)
    out = decode_moe_nvfp4(hidden, rows, weights, views, config=SMALL)
    ref = moe_reference(hidden, rows, weights, *FMT.dequantize(views, torch.float32))
    assert_close_to_scale(out, ref, 1e-5)  # fp32: as in the test above


@pytest.mark.parametrize("config", [SMALL, SWAP], ids=["tiles", "swap"])
def test_decode_moe_takes_the_miss_plans_alignment_and_gives_the_same_bits(config):
    """The alignment the miss plan makes in its own launch (``decode_miss.serve_misses_plan``) stands in for the
    one ``decode_moe_nvfp4`` would make: the same output, bit for bit; one in other blocks is refused by name."""
    from moe_offload.kernels.decode_miss import plan_misses

    T, K, N, H, I = 6, 3, 7, 32, 16
    pool_NR, views = make_pool(2 * N, H, I, seed=2)  # N slots, N scratch rows
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    ids, weights = routing(T, K, N, "random", gen)
    slot_of_E = torch.arange(N, dtype=torch.int32, device=DEVICE)  # every expert resident: rows = ids
    host = pool_NR[:N].clone()
    plan = plan_misses(slot_of_E, ids, host, pool_NR, N, align_block_m=config.block_m)
    want = decode_moe_nvfp4(hidden, plan.rows_TK, weights, views, config=config)
    got = decode_moe_nvfp4(hidden, plan.rows_TK, weights, views, config=config, alignment=plan.alignment)
    assert torch.equal(got, want)
    other = plan_misses(slot_of_E, ids, host, pool_NR, N, align_block_m=config.block_m * 2).alignment
    with pytest.raises(ValueError, match="blocks of 32.*blocks of 16.*config.block_m"):
        decode_moe_nvfp4(hidden, plan.rows_TK, weights, views, config=config, alignment=other)


@pytest.mark.parametrize("case", ["one-token-top8", "duplicate-row-in-a-token", "seventeen-tokens-odd-K",
                                  "one-token-top1"])
@pytest.mark.parametrize("residual", [False, True])
def test_the_swapped_down_launch_sums_over_k_with_the_sum_launchs_bits(case, residual):
    """``sum_in_down`` (the program storing a token's last term of a column tile sums the K terms): the output of the
    separate sum launch, bit for bit, with and without the residual, twice in a row on the same counters' memory
    (gate_up zeroes them each call); K = 1 keeps its direct write."""
    views, hidden, res, rows, weights = layer_inputs(*CASES[case], seed=8, residual=residual)
    for config in (SWAP, SWAP_CAPPED):
        want = decode_moe_nvfp4(hidden, rows, weights, views, config=config, residual_TH=res, sum_in_down=False)
        for _ in range(2):
            got = decode_moe_nvfp4(hidden, rows, weights, views, config=config, residual_TH=res)
            assert torch.equal(got, want)


@pytest.mark.parametrize("config", ["small", "swap", "table"])
@pytest.mark.parametrize("case", ["one-token-top8", "duplicate-row-in-a-token", "seventeen-tokens-odd-K"])
@pytest.mark.parametrize("residual", [False, True])
def test_the_split_compute_gives_the_one_pass_bits_whichever_pairs_missed(case, config, residual):
    """``decode_moe_nvfp4_split`` (the slot pairs, then ``join``, then the scratch pairs, one sum) gives the bits of the
    one-pass call for the same rows, at every split point: none missed, some, all. ``join`` runs exactly once,
    between the passes."""
    views, hidden, res, rows, weights = layer_inputs(*CASES[case], seed=11, residual=residual)
    N = views["gs"].shape[0]
    cfg = CONFIGS[config]
    want = decode_moe_nvfp4(hidden, rows, weights, views, config=cfg, residual_TH=res, sum_in_down=False)
    for base in (N, N // 2, 1, 0):
        calls = []
        got = decode_moe_nvfp4_split(hidden, rows, weights, views, base, lambda: calls.append(1), config=cfg,
                                     residual_TH=res)
        assert calls == [1]
        assert torch.equal(got, want), f"scratch rows from {base}"


def test_the_swapped_tiles_take_split_activations_made_elsewhere_and_give_the_same_bits():
    """``x_split`` (the norm kernel's copy in ``split_columns``' layout) stands in for the copy ``decode_moe_nvfp4``
    would make: the same output, bit for bit; a wrong layout is refused by name."""
    from moe_offload.kernels.fused_moe_swap import split_columns

    T, K, N, H, I = 5, 3, 7, 64, 16
    _, views = make_pool(N, H, I, seed=6)
    gen = torch.Generator().manual_seed(7)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    rows, weights = routing(T, K, N, "random", gen)
    want = decode_moe_nvfp4(hidden, rows, weights, views, config=SWAP)
    bk = SWAP.gate_up.block_k
    x_split = split_columns(hidden, bk)
    assert torch.equal(decode_moe_nvfp4(hidden, rows, weights, views, config=SWAP, x_split=x_split,
                                        x_split_block_k=bk), want)
    with pytest.raises(ValueError, match=r"x_split is \(5, 32\).*reads \(5, 64\)"):
        decode_moe_nvfp4(hidden, rows, weights, views, config=SWAP, x_split=x_split[:, :32], x_split_block_k=bk)
    with pytest.raises(ValueError, match="chunks of 16 columns, the swapped gate_up kernel reads chunks of 32"):
        decode_moe_nvfp4(hidden, rows, weights, views, config=SWAP, x_split=split_columns(hidden, 16),
                         x_split_block_k=16)


def test_on_a_triton_before_3_5_the_sum_launch_runs_with_one_event(monkeypatch, caplog):
    """Tensor atomics hand their result to every thread only from Triton 3.5: before it the swapped down launch does
    not sum over K (that would lose tokens); the separate sum launch runs, the same bits, and one event says so."""
    import logging

    import triton

    from moe_offload import log

    T, K, N, H, I, kind = CASES["seventeen-tokens-odd-K"]
    _, views = make_pool(N, H, I, seed=10)
    gen = torch.Generator().manual_seed(11)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    rows, weights = routing(T, K, N, kind, gen)
    want = decode_moe_nvfp4(hidden, rows, weights, views, config=SWAP, sum_in_down=False)
    monkeypatch.setattr(triton, "__version__", "3.4.0")
    log.reset_once_keys()
    with caplog.at_level(logging.WARNING, logger=log.LOGGER_NAME):
        for _ in range(2):
            assert torch.equal(decode_moe_nvfp4(hidden, rows, weights, views, config=SWAP), want)
    events = [r for r in caplog.records if getattr(r, "event_fields", {}).get("event") == "fused_moe_sum_unavailable"]
    assert len(events) == 1 and "3.5" in events[0].event_fields["reason"]


@pytest.mark.parametrize("T,K,N,block_m", [
    (13, 3, 9, 16),  # the sorted one-program alignment (T*K <= SORTED_ALIGN_MAX_PAIRS) ...
    (64, 8, 6200, 16),  # ... over a pool of thousands of rows (what a decode step aligns over), at its largest M
    (65, 8, 300, 16),  # the looped one, just above it
    (5, 8, 40, 1),
    (300, 8, 128, 64),  # the looped one (T*K above it)
])
def test_one_launch_alignment_groups_pairs_like_the_three_kernel_alignment(T, K, N, block_m):
    gen = torch.Generator().manual_seed(3)
    rows_TK = torch.randint(0, N, (T, K), generator=gen).to(DEVICE)
    rows_TK[0, 0] = -1  # left out by both
    rows_TK[1, 1] = N  # outside [0, N): left out by both
    got, want = decode_align(rows_TK, N, block_m), moe_align(rows_TK, N, block_m)
    n = int(got.num_padded_1)
    assert n == int(want.num_padded_1)
    # rows in ascending order, same padding; only [0, num_padded) is read (the GEMM programs of later blocks exit)
    assert torch.equal(got.block_row_B[:n // block_m], want.block_row_B[:n // block_m])
    M = rows_TK.numel()
    sorted_alignment = M <= SORTED_ALIGN_MAX_PAIRS
    for b in range(n // block_m):  # same pairs per block (order inside may differ: atomics)
        g = got.sorted_ids_P[b * block_m:(b + 1) * block_m].cpu().tolist()
        w = want.sorted_ids_P[b * block_m:(b + 1) * block_m].cpu().tolist()
        assert sorted(g) == sorted(w)
        if sorted_alignment:  # no atomics: real pairs in ascending pair id, then the sentinel M
            assert g == sorted(g)
    if not sorted_alignment:
        assert (got.sorted_ids_P[n:] == M).all()


def test_decode_moe_with_no_tokens_returns_an_empty_output():
    _, views = make_pool(2, 32, 16)
    out = decode_moe_nvfp4(torch.zeros(0, 32, device=DEVICE), torch.zeros(0, 8, dtype=torch.int64, device=DEVICE),
                           torch.zeros(0, 8, device=DEVICE), views)
    assert out.shape == (0, 32)


def test_decode_moe_names_the_mismatched_input():
    _, views = make_pool(2, 32, 16)
    rows = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="hidden_TH"):
        decode_moe_nvfp4(torch.zeros(3, 64, device=DEVICE), rows, torch.ones(3, 1, device=DEVICE), views)
    with pytest.raises(ValueError, match="out_dtype"):
        decode_moe_nvfp4(torch.zeros(3, 32, device=DEVICE), rows, torch.ones(3, 1, device=DEVICE), views,
                         out_dtype=torch.int32)


def test_the_shipped_decode_tuning_table_loads_and_covers_decode_sizes():
    table = load_tuning(DECODE_TUNING_PATH)
    cfg = decode_config_for(torch.device("cpu"), 2048, 768, 64 * 8)
    assert cfg.block_m == 16 and table.lookup("NVIDIA H200", 2560, 640, 10).block_m >= 16


_COMPILE_SM90 = r'''
import json, re
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from moe_offload.kernels import decode_miss as dm, decode_moe as dmoe, decode_route as droute, fused_moe as fm

def build(fn, sig, consts, attrs=None, **options):
    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()}, attrs=attrs or {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

i32 = dict.fromkeys
out = {}
build(dm._plan_kernel, {**i32(["slot_ptr", "need_ptr", "scratch_of_ptr", "miss_ptr", "count_ptr", "rows_ptr",
      "record_ptr", "pf_ptr"], "*i32"), "ids_ptr": "*i64", "stats_ptr": "*i64", **i32(["M", "E", "scratch_base"], "i32")},
      {"BLOCK": 1024, "STATS": 5, "PF": False, "DENSE": False}, num_warps=4)
for EB, MC, stats, pf in ((128, 8, 5, True), (128, 32, 4, False), (512, 8, 0, False), (4096, 1, 3, False)):
    build(dm._plan_regs_kernel, {**i32(["slot_ptr", "miss_ptr", "count_ptr", "rows_ptr", "record_ptr", "pf_ptr"], "*i32"),
          "ids_ptr": "*i64", "stats_ptr": "*i64", **i32(["M", "E", "scratch_base"], "i32")},
          {"EB": EB, "MC": MC, "STATS": stats, "PF": pf}, num_warps=4)
for EB, MC, MP, stats, regs in ((128, 16, 16, 4, True), (128, 32, 512, 4, False), (512, 8, 128, 0, False)):
    # plan (register or workspace) + sorted alignment, one launch
    build(dm._plan_align_kernel, {**i32(["slot_ptr", "work_ptr", "miss_ptr", "count_ptr", "rows_ptr", "record_ptr",
          "sorted_ids_ptr", "block_row_ptr", "num_padded_ptr"], "*i32"), "ids_ptr": "*i64", "stats_ptr": "*i64",
          "key_ptr": "*i64", **i32(["E_work", "M", "E", "scratch_base", "N"], "i32"), "last_key": "i64"},
          {"EB": EB, "MC": MC, "STATS": stats, "REGS": regs, "BLOCK": 1024, "BLOCK_M": 16, "MP": MP}, num_warps=4)
for EP, KP, EB, MC, MP, align, warps, regs in ((128, 8, 128, 8, 16, False, 1, True), (128, 8, 128, 8, 128, True, 1, False),
                                                (512, 8, 512, 8, 128, True, 4, False)):  # top-k + plan (+ alignment)
    ptx = build(droute._route_plan_kernel, {"logits_ptr": "*bf16", "stride_t": "i32", "w_ptr": "*bf16", "ids_ptr": "*i64",
                **i32(["done_ptr", "slot_ptr", "work_ptr", "miss_ptr", "count_ptr", "rows_ptr", "record_ptr",
                "sorted_ids_ptr", "block_row_ptr", "num_padded_ptr"], "*i32"), "stats_ptr": "*i64", "key_ptr": "*i64",
                **i32(["K", "E_work", "M", "E", "scratch_base", "N"], "i32"), "last_key": "i64"},
                {"RENORM": True, "EP": EP, "KP": KP, "EB": EB, "MC": MC, "STATS": 4, "REGS": regs, "BLOCK": 1024,
                 "ALIGN": align, "BLOCK_M": 16, "MP": MP}, num_warps=warps)
    out.setdefault("route_plan_acq_rel", []).append(len(re.findall(r"atom\.global\.(?:gpu\.)?acq_rel(?:\.gpu)?\.add", ptx)))
    out.setdefault("route_plan_volatile_ids", []).append(len(re.findall(r"ld\.volatile\.global\.(?:v2\.)?b64", ptx)))
ptx = build(dm._copy_kernel, {"src_ptr": "*i32", "dst_ptr": "*i32", **i32(["miss_ptr", "count_ptr"], "*i32"),
            **i32(["row_words", "src_stride_v", "dst_stride_v", "scratch_base", "chunks"], "i32")},
            {"BLOCK": 4096, "VEC": 4}, attrs={(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}, num_warps=4)
out["copy_v4_loads"] = len(re.findall(r"ld\.global[.a-z0-9]*\.v4\.b32", ptx))
build(dmoe._align_kernel, {"rows_ptr": "*i64", **i32(["counts_ptr", "cursor_ptr", "sorted_ids_ptr", "block_row_ptr",
      "num_padded_ptr"], "*i32"), **i32(["M", "N", "P", "NB"], "i32")}, {"BLOCK_M": 16, "BLOCK": 1024}, num_warps=4)
for MP, warps in ((16, 4), (512, 4), (2048, 8)):  # the sorted alignment at the sizes it runs at, and at 2,048 (8 warps)
    build(dmoe._align_sorted_kernel, {"rows_ptr": "*i64", "key_ptr": "*i64", **i32(["sorted_ids_ptr", "block_row_ptr",
          "num_padded_ptr"], "*i32"), **i32(["M", "N"], "i32"), "last_key": "i64"}, {"BLOCK_M": 16, "MP": MP},
          num_warps=warps)
gemm = {"q_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_row_ptr": "*i32",
        "num_padded_ptr": "*i32", **i32(["stride_qn", "stride_qr", "stride_sn", "stride_sr", "stride_gn", "M", "H", "I",
        "num_blocks_m", "stride_am"], "i32")}
cfg = dmoe.load_tuning(dmoe.DECODE_TUNING_PATH).lookup("default", 2048, 768, 8)
for fn, sig, tiles in ((fm._gate_up_silu_kernel, {**gemm, "x_ptr": "*bf16", "stride_xt": "i32", "act_ptr": "*bf16",
                        "TOPK": "i32"}, cfg.gate_up),
                       (fm._down_kernel, {**gemm, "act_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16",
                        "stride_om": "i32"}, cfg.down)):
    build(fn, sig, {"BLOCK_M": cfg.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "GROUP_M": tiles.group_m,
          "EVEN_K": True, "DOT_DTYPE": tl.bfloat16, "INPUT_PRECISION": "tf32"},
          num_warps=tiles.num_warps, num_stages=tiles.num_stages)
# the swapped gate_up kernel with the H200's T = 64 tiles, strides as the runtime passes them (benchmarks/sass_loop.py:
# integers divisible by 16, pointers 16-byte aligned: the store's ROW_ALIGN-padded rows), with and without a
# register cap: the cap reaches ptxas; the weight bytes arrive by 16-byte cp.async either way
import pathlib, runpy
compile_kernel = runpy.run_path(str(pathlib.Path(dmoe.__file__).resolve().parents[1] / "benchmarks" / "sass_loop.py"))["compile_kernel"]
h200 = dmoe.load_tuning(dmoe.DECODE_TUNING_PATH).lookup("NVIDIA H200", 2048, 768, 512)
t = h200.gate_up
for cap in (None, 96):
    ptx = compile_kernel("gate_up", h200.block_m, t.block_n, t.block_k, t.num_warps, t.num_stages, cap, True)[0].asm["ptx"]
    out[f"swap_maxnreg_{cap}"] = re.findall(r"\.maxnreg (\d+)", ptx)
    out[f"swap_cp_async_16_{cap}"] = len(re.findall(r"cp\.async\.c[ag]\.shared\.global(?:\.L2::\w+)? \[[^]]+\], \[[^]]+\], 0x10", ptx))
# the down launch that sums over K: its counters' acq_rel atomics after a barrier, the other programs' terms read volatile
d = h200.down
ptx = compile_kernel("down", h200.block_m, d.block_n, d.block_k, d.num_warps, d.num_stages, None, True, True)[0].asm["ptx"]
out["down_sum_acq_rel"] = len(re.findall(r"atom\.global\.(?:gpu\.)?acq_rel(?:\.gpu)?\.add", ptx))
out["down_sum_volatile"] = len(re.findall(r"ld\.volatile\.global", ptx))
print(json.dumps(out))
'''


def test_decode_kernels_compile_for_sm90_with_16_byte_copies(compiled_without_interpreter):
    """The interpreter runs kernels as Python; this compiles them for an H200 (sm_90) with Triton's own
    ptxas, no GPU needed, in a process without TRITON_INTERPRET."""
    import json

    out = compiled_without_interpreter(_COMPILE_SM90)
    result = json.loads(out)
    # the last program of the one-launch top-k + plan acquires the others' ids: an acq_rel counter, ids read past L1
    assert all(n >= 1 for n in result["route_plan_acq_rel"]) and all(n >= 1 for n in result["route_plan_volatile_ids"])
    assert result["down_sum_acq_rel"] >= 1 and result["down_sum_volatile"] >= 1
    # 4096 int32 words per item over 128 threads: 8 vector loads of 16 bytes per thread
    assert result["copy_v4_loads"] == 8
    # the register cap is passed to ptxas only when a table sets it
    assert result["swap_maxnreg_None"] == [] and result["swap_maxnreg_96"] == ["96"]
    assert result["swap_cp_async_16_None"] > 0 and result["swap_cp_async_16_96"] > 0


def test_kernel_tiles_take_an_optional_register_cap_and_tables_without_it_load_unchanged():
    from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig as Cfg

    plain = {"block_m": 16, "gate_up": {"block_n": 32, "block_k": 128, "group_m": 1, "num_warps": 2, "num_stages": 3},
             "down": {"block_n": 64, "block_k": 128, "group_m": 1, "num_warps": 2, "num_stages": 3},
             "swap_ab": True, "faster_than_dequant": False}
    cfg = Cfg.from_dict(plain)
    assert cfg.gate_up.maxnreg is None and cfg.to_dict() == plain  # no "maxnreg": null written into old tables
    assert cfg.gate_up.launch_options() == {"num_warps": 2, "num_stages": 3}
    capped = {**plain, "gate_up": {**plain["gate_up"], "maxnreg": 96}}
    cfg = Cfg.from_dict(capped)
    assert cfg.gate_up.launch_options()["maxnreg"] == 96 and cfg.to_dict() == capped
    for bad in (20, 100, 256, "96"):
        with pytest.raises(ValueError, match="maxnreg"):
            KernelTiles(32, 128, maxnreg=bad)


def test_sass_loop_counts_the_swapped_kernel_s_k_loop_and_aligned_rows_vectorize(compiled_without_interpreter):
    """benchmarks/sass_loop.py (offline sm_90 compile + nvdisasm): the store-aligned variant's K loop has no
    per-byte global loads and fewer instructions than the unpadded-row variant the tuners timed before b18b0cc."""
    import json
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "sass_loop.py"
    run = (f"import json, runpy, sys, io, contextlib\nout = {{}}\nfor flag in ([], ['--unaligned']):\n"
           f"    buf = io.StringIO()\n    sys.argv = ['sass_loop', '--json', *flag]\n"
           f"    with contextlib.redirect_stdout(buf):\n"
           f"        try:\n            runpy.run_path({str(script)!r}, run_name='__main__')\n"
           f"        except SystemExit:\n            pass\n"
           f"    out['unaligned' if flag else 'aligned'] = json.loads(buf.getvalue())\nprint(json.dumps(out))")
    res = json.loads(compiled_without_interpreter(run))
    al, un = res["aligned"], res["unaligned"]
    assert al["loop_instructions"] > 0 and al["opcodes"].get("HMMA", 0) > 0  # the loop found is the dot loop
    assert "LDG" not in al["opcodes"] and al["opcodes"].get("LDGSTS", 0) > 0  # weights by cp.async, not plain loads
    assert un["opcodes"].get("LDG", 0) > 0 and un["loop_instructions"] > al["loop_instructions"]


def test_a_gpu_of_a_tuned_die_borrows_its_tiles_and_an_unknown_one_gets_the_defaults(caplog):
    from moe_offload.kernels import fused_moe_tuning as fmt
    from moe_offload.kernels.decode_gemv_tuning import load_gemv_tuning
    from moe_offload.kernels.nvfp4 import load_dequant_tuning

    table = load_tuning(DECODE_TUNING_PATH)
    h200 = table.lookup("NVIDIA H200", 2048, 768, 128)
    # the same GH100 die: an H100 variant with no entry of its own borrows the H200's tiles, not the defaults
    assert "NVIDIA H100 PCIe" not in table.devices
    assert table.lookup("NVIDIA H100 PCIe", 2048, 768, 128) == h200
    assert h200 != table.lookup("default", 2048, 768, 128)
    if "NVIDIA H100 80GB HBM3" in table.devices:  # tuned on a lent H100 (9867ced): its own entry wins
        assert table.lookup("NVIDIA H100 80GB HBM3", 2048, 768, 128) != h200
    assert table.lookup("Some Future GPU", 2048, 768, 128) == table.lookup("default", 2048, 768, 128)
    keys = {"default": None, "NVIDIA H200": None}  # a table's device keys: its own entry wins over a borrowed one
    assert fmt.tiles_key("NVIDIA H200 NVL", keys, "k.json") == "NVIDIA H200"
    assert fmt.tiles_key("NVIDIA H200 NVL", {**keys, "NVIDIA H200 NVL": None}, "k.json") == "NVIDIA H200 NVL"
    fmt._BORROWED.clear()
    from moe_offload import log

    with caplog.at_level("INFO", logger=log.LOGGER_NAME):
        for _ in range(3):
            assert fmt.tiles_key("NVIDIA GH200 480GB", load_gemv_tuning(), "decode_gemv_tuning.json") == "NVIDIA H200"
    borrowed = [r.event_fields for r in caplog.records if getattr(r, "event_fields", {}).get("event") == "tuning_borrowed"
                and r.event_fields["device"] == "NVIDIA GH200 480GB"]
    assert len(borrowed) == 1 and borrowed[0]["tiles_of"] == "NVIDIA H200"  # logged once per table and device
    assert "benchmarks/tune_decode_gemv.py" in borrowed[0]["detail"]  # names the tuner that measures its own
    root = Path(fmt.__file__).resolve().parents[1]
    assert all((root / tuner).is_file() for tuner in fmt.TUNERS.values())
    assert fmt.tiles_key("NVIDIA H100 PCIe", load_dequant_tuning(), "d.json") == "NVIDIA H200"
    assert fmt.tiles_key("NVIDIA A100-SXM4-80GB", load_dequant_tuning(), "d.json") == "default"


def test_the_probe_reports_which_entry_of_each_tile_table_a_gpu_uses():
    from moe_offload.kernels.batch_memcpy_probe import tile_sources

    tables = {"fused_moe_tuning.json", "decode_moe_tuning.json", "decode_gemv_tuning.json", "dequant_tuning.json"}
    assert tile_sources("NVIDIA H200") == dict.fromkeys(tables, "NVIDIA H200")
    assert set(tile_sources("NVIDIA H100 80GB HBM3").values()) <= {"NVIDIA H200", "NVIDIA H100 80GB HBM3"}  # same die
    assert tile_sources("NVIDIA L40S") == dict.fromkeys(tables, "default")  # untuned


@settings(max_examples=25, deadline=None)
@given(T=st.integers(1, 64), K=st.integers(1, 8), N=st.integers(1, 7000), block_m=st.sampled_from([1, 2, 8, 16, 64]),
       seed=st.integers(0, 2**16), invalid=st.integers(0, 3))
def test_the_sorted_alignment_is_the_grouping_every_gemm_block_reads(T, K, N, block_m, seed, invalid):
    """Any decode-sized routing (up to SORTED_ALIGN_MAX_PAIRS pairs, rows from a handful to a 48-layer pool, some
    left out): each used block holds one row's pairs in ascending pair id, then the sentinel; every valid pair
    appears exactly once; rows ascend; num_padded is the padded total."""
    gen = torch.Generator().manual_seed(seed)
    rows_TK = torch.randint(0, min(N, 3 * T * K), (T, K), generator=gen) * max(1, N // (3 * T * K))
    rows_TK.view(-1)[torch.randperm(T * K, generator=gen)[:invalid]] = torch.tensor([-1, N, -7, N + 5])[:min(invalid, T * K)]
    a = decode_align(rows_TK.to(DEVICE), N, block_m)
    M, n = T * K, int(a.num_padded_1)
    flat = rows_TK.view(-1).tolist()
    want = {}
    for p, r in enumerate(flat):
        if 0 <= r < N:
            want.setdefault(r, []).append(p)
    assert n == sum(-(-len(v) // block_m) * block_m for v in want.values())
    got_rows, seen = [], []
    ids = a.sorted_ids_P[:n].cpu().tolist()
    for b in range(n // block_m):
        row = int(a.block_row_B[b])
        block = ids[b * block_m:(b + 1) * block_m]
        real = [p for p in block if p < M]
        assert real and real == sorted(real) and all(p == M for p in block[len(real):])
        assert all(flat[p] == row for p in real)
        got_rows.append(row)
        seen += real
    assert got_rows == sorted(got_rows) and sorted(seen) == sorted(p for v in want.values() for p in v)
