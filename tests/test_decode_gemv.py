"""decode_gemv_nvfp4 (kernels/decode_gemv.py) against the plain-torch reference (dequant + matmul in fp32)
on awkward decode shapes, one pair per program and pairs grouped by row.

Legend: T tokens, K top-k, N bank rows, H hidden, I intermediate.
Without CUDA the kernels run in the Triton interpreter on CPU tensors (small shapes only).
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat  # noqa: E402
from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4  # noqa: E402
from moe_offload.kernels.decode_gemv_tuning import GemvConfig, GemvTiles, gemv_config_for, gemv_entry  # noqa: E402
from moe_offload.kernels.fused_moe import moe_reference  # noqa: E402
from test_decode_moe import DEVICE, assert_close_to_scale, layer_inputs, make_pool, routing  # noqa: E402

FMT = Nvfp4ModelOptFormat()

PER_PAIR = GemvConfig(1, GemvTiles(8, 32), GemvTiles(8, 32))  # many N tiles and K steps
WIDE_K = GemvConfig(1, GemvTiles(16, 128), GemvTiles(16, 128))  # BLOCK_K > H, I: masked K tail
GROUPED = GemvConfig(4, GemvTiles(8, 64), GemvTiles(8, 64))  # align launch, 4 pairs per program
PAIR_DOWN = GemvConfig(1, GemvTiles(8, 32), GemvTiles(8, 32), down_per_pair=True)  # down per pair + pair sum
GROUPED_PAIR_DOWN = GemvConfig(4, GemvTiles(8, 64), GemvTiles(16, 128), down_per_pair=True)  # + masked K tail
SPLIT_X = GemvConfig(1, GemvTiles(8, 32), GemvTiles(8, 32), split_x=True)  # x's even/odd columns apart first
SPLIT_X_WIDE = GemvConfig(1, GemvTiles(16, 128), GemvTiles(16, 128), down_per_pair=True, split_x=True)  # + K tail
GROUPED_SPLIT_X = GemvConfig(4, GemvTiles(8, 64), GemvTiles(8, 64), split_x=True)  # align launch + split x
CONFIGS = {"per-pair": PER_PAIR, "wide-k": WIDE_K, "grouped": GROUPED, "pair-down": PAIR_DOWN,
           "grouped-pair-down": GROUPED_PAIR_DOWN, "split-x": SPLIT_X, "split-x-wide": SPLIT_X_WIDE,
           "grouped-split-x": GROUPED_SPLIT_X, "table": None}

CASES = {  # T, K, N, H, I, routing (H, I multiples of 16 as NVFP4 needs; 48 and 80 are not powers of two)
    "one-token-top1": (1, 1, 3, 32, 16, "random"),
    "one-token-top8": (1, 8, 12, 48, 32, "random"),
    "all-pairs-one-row": (9, 2, 4, 32, 16, "all-row-2"),
    "duplicate-row-in-a-token": (3, 3, 5, 64, 16, "dup"),
    "five-tokens-odd-K-odd-sizes": (5, 3, 6, 80, 48, "random"),
}


def run(case, dtype, config, seed=0, drop=(), **kw):
    """(out, ref); ``drop`` lists (t, k) pairs routed to row -1, which the reference gets as weight 0; ``kw`` goes to
    ``decode_gemv_nvfp4``."""
    T, K, N, H, I, kind = CASES[case]
    _, views = make_pool(N, H, I, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    rows, weights = routing(T, K, N, kind, gen)
    ref_weights = weights.clone()
    for t, k in drop:
        rows[t, k] = -1
        ref_weights[t, k] = 0.0
    out = decode_gemv_nvfp4(hidden, rows, weights, views, config=config, **kw)
    ref_rows = rows.clamp(min=0)  # weight 0 makes the row irrelevant to the reference
    ref = moe_reference(hidden.float(), ref_rows, ref_weights, *FMT.dequantize(views, torch.float32))
    return out, ref


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("case", CASES.keys())
def test_decode_gemv_matches_the_fp32_reference(case, config):
    out, ref = run(case, torch.float32, config)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # Same exact NVFP4 weights, fp32 activations and fp32 accumulation; only summation order (<= 80
    # terms per dot) and exp() differ: a few fp32 ulps (~1e-7). 1e-5 leaves two orders of margin,
    # while a wrong nibble, scale, global, row or routing weight moves results by >= 1e-2.
    assert_close_to_scale(out, ref, 1e-5)


@pytest.mark.parametrize("config", [PER_PAIR, GROUPED, PAIR_DOWN], ids=["per-pair", "grouped", "pair-down"])
def test_decode_gemv_leaves_out_pairs_routed_to_row_minus_one(config):
    out, ref = run("all-pairs-one-row", torch.float32, config, drop=[(0, 1), (3, 0), (8, 1)])
    assert_close_to_scale(out, ref, 1e-5)  # fp32: as above; a dropped pair that counted moves it by ~0.3


@pytest.mark.parametrize("case", ["one-token-top8", "five-tokens-odd-K-odd-sizes"])
def test_decode_gemv_matches_the_reference_in_bf16(case):
    out, ref = run(case, torch.bfloat16, PER_PAIR)
    assert out.dtype == torch.bfloat16
    # bf16 input x is exact in both; the activation and sums stay fp32, so the only extra error is the
    # final rounding to bf16, <= 2^-8 relative (2^-7 where the interpreter truncates); 1e-2 is ~1.3x that
    # bound at the scale of max|ref|, and far below a wrong-weight error.
    assert_close_to_scale(out, ref, 1e-2)


def test_decode_gemv_reads_slot_rows_of_a_larger_pool_in_place():
    _, views = make_pool(10, 32, 16, seed=4)  # rows 7 and 9, like scratch rows past the slots
    hidden = torch.randn(1, 32, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    rows = torch.tensor([[9, 7]], device=DEVICE, dtype=torch.int32)
    weights = torch.tensor([[0.25, 0.75]], device=DEVICE)
    out = decode_gemv_nvfp4(hidden, rows, weights, views, config=PER_PAIR)
    ref = moe_reference(hidden, rows.long(), weights, *FMT.dequantize(views, torch.float32))
    assert_close_to_scale(out, ref, 1e-5)  # fp32: as above


@pytest.mark.parametrize("config", [PER_PAIR, GROUPED, PAIR_DOWN], ids=["per-pair", "grouped", "pair-down"])
def test_bf16_routing_weights_are_read_in_place_as_their_fp32_values(config):
    """The router hands bf16 weights (Qwen3's cast to the logits' dtype): the kernels read them in their own
    dtype (no cast launch) and use them in fp32, so the output is the one of the same weights cast first."""
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4

    T, K, N, H, I, kind = CASES["five-tokens-odd-K-odd-sizes"]
    _, views = make_pool(N, H, I, seed=7)
    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE, torch.bfloat16)
    rows, weights = routing(T, K, N, kind, gen)
    w_bf16 = weights.to(torch.bfloat16)
    want = decode_gemv_nvfp4(hidden, rows, w_bf16.float(), views, config=config)
    assert torch.equal(decode_gemv_nvfp4(hidden, rows, w_bf16, views, config=config), want)
    assert torch.equal(decode_moe_nvfp4(hidden, rows, w_bf16, views), decode_moe_nvfp4(hidden, rows, w_bf16.float(), views))


def test_decode_gemv_with_no_tokens_returns_an_empty_output():
    _, views = make_pool(2, 32, 16)
    out = decode_gemv_nvfp4(torch.zeros(0, 32, device=DEVICE), torch.zeros(0, 8, dtype=torch.int64, device=DEVICE),
                            torch.zeros(0, 8, device=DEVICE), views)
    assert out.shape == (0, 32)


def test_decode_gemv_names_the_mismatched_input():
    _, views = make_pool(2, 32, 16)
    rows = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="hidden_TH"):
        decode_gemv_nvfp4(torch.zeros(3, 64, device=DEVICE), rows, torch.ones(3, 1, device=DEVICE), views)
    with pytest.raises(ValueError, match="out_dtype"):
        decode_gemv_nvfp4(torch.zeros(3, 32, device=DEVICE), rows, torch.ones(3, 1, device=DEVICE), views,
                          out_dtype=torch.int32)


@pytest.mark.parametrize("case", ["one-token-top8", "duplicate-row-in-a-token"])
def test_the_per_pair_down_gives_the_bits_of_the_same_sum_done_by_hand(case):
    """The pair sum adds a token's K partials in the order k = 0..K-1: the output is exactly the fp32 sum of the
    single-pair outputs in that order (each a call with one pair of the token), rounded once."""
    T, K, N, H, I, kind = CASES[case]
    _, views = make_pool(N, H, I, seed=3)
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    rows, weights = routing(T, K, N, kind, gen)
    got = decode_gemv_nvfp4(hidden, rows, weights, views, config=PAIR_DOWN)
    for t in range(T):
        want = torch.zeros(H, device=DEVICE)
        for k in range(K):
            want += decode_gemv_nvfp4(hidden[t:t + 1], rows[t:t + 1, k:k + 1], weights[t:t + 1, k:k + 1], views,
                                      config=PAIR_DOWN)[0]
        assert torch.equal(got[t], want)


def test_the_pair_sum_covers_every_output_block(monkeypatch):
    """With a pair-sum block of 16 outputs, H = 48 and 80 take several programs along H (H = 2048 takes two
    of the shipped 1024): each must add its own block."""
    from moe_offload.kernels import moe_sum

    monkeypatch.setattr(moe_sum, "SUM_BLOCK", 16)
    for case in ("one-token-top8", "five-tokens-odd-K-odd-sizes"):
        out, ref = run(case, torch.float32, PAIR_DOWN, sum_in_down=False)
        assert_close_to_scale(out, ref, 1e-5)  # fp32: as in test_decode_gemv_matches_the_fp32_reference


@pytest.mark.parametrize("config", [PAIR_DOWN, GROUPED_PAIR_DOWN, SPLIT_X_WIDE], ids=["pair", "grouped", "wide"])
@pytest.mark.parametrize("residual", [False, True])
def test_the_per_pair_down_launch_sums_over_k_with_the_sum_launchs_bits(config, residual):
    """``sum_in_down`` (the last of a token's pair programs per column tile sums its K partials): the sum launch's
    output bit for bit, with and without the residual, with pairs left out (row -1: they count, with partial 0),
    twice in a row (the gate_up launch zeroes the counters each call)."""
    for case in ("one-token-top8", "duplicate-row-in-a-token", "five-tokens-odd-K-odd-sizes"):
        views, hidden, res, rows, weights = layer_inputs(*CASES[case], seed=12, residual=residual)
        rows[0, -1] = -1
        want = decode_gemv_nvfp4(hidden, rows, weights, views, config=config, residual_TH=res, sum_in_down=False)
        for _ in range(2):
            got = decode_gemv_nvfp4(hidden, rows, weights, views, config=config, residual_TH=res)
            assert torch.equal(got, want), case


@pytest.mark.parametrize("split, interleaved", [(SPLIT_X, PER_PAIR), (GROUPED_SPLIT_X, GROUPED)],
                         ids=["one-pair", "grouped"])
def test_split_x_gives_the_bits_of_interleaved_x(split, interleaved):
    """Splitting x's columns apart is a copy and the kernel does the same products in the same order."""
    for case in ("one-token-top8", "all-pairs-one-row", "five-tokens-odd-K-odd-sizes"):
        assert torch.equal(run(case, torch.bfloat16, split)[0], run(case, torch.bfloat16, interleaved)[0])


def test_a_config_with_a_non_boolean_down_per_pair_is_refused_by_name():
    with pytest.raises(ValueError, match=r"\['buckets'\]\['8'\].*JSON object"):
        GemvConfig.from_dict([1, 2], "table['buckets']['8']")
    with pytest.raises(ValueError, match="down_per_pair"):
        GemvConfig.from_dict({"block_m": 1, "gate_up": {"block_n": 8, "block_k": 32},
                              "down": {"block_n": 8, "block_k": 32}, "down_per_pair": "yes"})
    assert GemvConfig.from_dict({"block_m": 1, "gate_up": {"block_n": 8, "block_k": 32},
                                 "down": {"block_n": 8, "block_k": 32}}).down_per_pair is False


def test_gemv_tiles_reject_a_block_k_that_splits_a_scale_block():
    with pytest.raises(ValueError, match="block_k"):
        GemvTiles(8, 16)


def test_the_shipped_gemv_tuning_table_covers_decode_sizes_and_sets_the_auto_threshold():
    cpu = torch.device("cpu")
    assert gemv_config_for(cpu, 2048, 768, 8).block_m == 1  # T = 1: one pair per program, no align launch
    assert gemv_config_for(cpu, 2048, 768, 64 * 8).block_m > 1  # many tokens per expert: grouped
    assert gemv_entry(cpu, 2560, 640).gemv_max_pairs >= 16 * 10  # auto picks gemv up to T = 16 at K <= 10


def test_decode_compute_auto_picks_gemv_up_to_the_table_threshold_and_tiles_past_it():
    from types import SimpleNamespace

    from moe_offload.compute.decode import DecodeCompute

    cpu = torch.device("cpu")
    compute = DecodeCompute(SimpleNamespace(is_quantized=True), SimpleNamespace(name="x"), cpu, fused=True)
    limit = gemv_entry(cpu, 2048, 768).gemv_max_pairs
    assert compute.pick(cpu, limit // 8, 8, 2048, 768) == "gemv"
    assert compute.pick(cpu, limit // 8 + 1, 8, 2048, 768) == "tiles"
    forced = DecodeCompute(SimpleNamespace(is_quantized=True), SimpleNamespace(name="x"), cpu, fused=True, kernel="tiles")
    assert forced.pick(cpu, 1, 8, 2048, 768) == "tiles"
    with pytest.raises(ValueError, match="kernel"):
        DecodeCompute(SimpleNamespace(is_quantized=True), SimpleNamespace(name="x"), cpu, fused=True, kernel="fast")


_COMPILE_SM90 = r'''
import json, re
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from moe_offload.kernels import decode_gemv as g
from moe_offload.kernels import decode_gemv_tuning as gt

PTX = True  # the weight conversion on sm_90 (nvfp4.ptx_conversion)

def v4_loads(fn, sig, consts, div16, num_warps):
    names = fn.arg_names
    consts = {"PTX": PTX, **consts} if "PTX" in names else consts
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    return len(re.findall(r"ld\.global[.a-z0-9]*\.v4\.b32", ptx))

i32 = dict.fromkeys
cfg = gt.load_gemv_tuning()["default"]["default"].config(8)  # T = 1, K = 8
common = {"q_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "rows_ptr": "*i64",
          **i32(["stride_qn", "stride_qr", "stride_sn", "stride_sr", "stride_gn", "N", "H", "I", "TOPK", "x_odd_off"], "i32")}
div16 = ["q_ptr", "s_ptr", "stride_qn", "stride_qr", "stride_sn", "H", "I"]
gate_up_sig = {**common, "x_ptr": "*bf16", "stride_xt": "i32", "act_ptr": "*fp32", "M": "i32",
               **i32(["sorted_ids_ptr", "block_row_ptr", "num_padded_ptr"], "*i32")}
down_sig = {**common, "act_ptr": "*fp32", "w_ptr": "*bf16", "out_ptr": "*bf16", "stride_ot": "i32", "res_ptr": "*bf16",
            "stride_rt": "i32"}
out = {"gate_up": v4_loads(g._gate_up_kernel, gate_up_sig,
                           {"BLOCK_M": 1, "BLOCK_N": cfg.gate_up.block_n, "BLOCK_K": cfg.gate_up.block_k, "EVEN_K": True,
                            "SPLIT_X": False, "SPLIT_ACT": False}, div16, cfg.gate_up.num_warps),
       "down": v4_loads(g._down_sum_kernel, down_sig,
                        {"KP": 8, "BLOCK_N": cfg.down.block_n, "BLOCK_K": cfg.down.block_k, "EVEN_K": True,
                         "RESIDUAL": False}, div16, cfg.down.num_warps),
       "gate_up_bytes": cfg.gate_up.block_n * cfg.gate_up.block_k // 2 // (32 * cfg.gate_up.num_warps),
       "down_bytes": 8 * cfg.down.block_n * cfg.down.block_k // 2 // (32 * cfg.down.num_warps)}
def loop_of(fn, sig, consts, div, num_warps):
    """The PTX of the K loop of ``fn`` compiled for sm_90."""
    names = fn.arg_names
    consts = {"PTX": PTX, **consts} if "PTX" in names else consts
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div if n in names})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]
    return re.search(r"Inner Loop Header.*?\n(.*?)bra\s+\$L__BB0_\d+;", ptx, re.S).group(1)

def stats(loop):
    return {"barriers": len(re.findall(r"bar\.sync", loop)), "scalar_x_loads": len(re.findall(r"ld\.global\.b16", loop)),
            "v4_loads": len(re.findall(r"ld\.global[.a-z0-9]*\.v4\.b32", loop))}

# the per-pair down at 8 x 256 tiles (8 weight bytes a thread): split activations loaded in the weight tile's layout
out["down_pair"] = stats(loop_of(g._down_pair_kernel, {**common, "act_ptr": "*fp32", "w_ptr": "*bf16", "part_ptr": "*fp32"},
                                 {"BLOCK_N": 8, "BLOCK_K": 256, "EVEN_K": True}, div16 + ["act_ptr"], 4))
# split x at 4 x 512 gate_up tiles, 4 warps (the H200's T = 1 tiles until 6395f5e; its T = 1 bucket now holds 16 x 512
# tiles with interleaved x, where split x would take barriers too): the K loop's barriers and x loads
x_tiles = gt.GemvTiles(4, 512, 4)
for split in (False, True):
    consts = {"BLOCK_M": 1, "BLOCK_N": x_tiles.block_n, "BLOCK_K": x_tiles.block_k, "EVEN_K": True, "SPLIT_X": split,
              "SPLIT_ACT": split}
    out["split" if split else "interleaved"] = stats(loop_of(g._gate_up_kernel, gate_up_sig, consts,
                                                             div16 + ["x_ptr", "stride_xt", "x_odd_off"], x_tiles.num_warps))
# and at the H200's grouped tiles (bucket 1024: block_m 4)
grp = gt.load_gemv_tuning()["NVIDIA H200"]["H2048_I768"].config(1024)
for split in (False, True):
    consts = {"BLOCK_M": grp.block_m, "BLOCK_N": grp.gate_up.block_n, "BLOCK_K": grp.gate_up.block_k, "EVEN_K": True,
              "SPLIT_X": split, "SPLIT_ACT": False}
    out["grouped_split" if split else "grouped_interleaved"] = stats(loop_of(
        g._gate_up_kernel, gate_up_sig, consts, div16 + ["x_ptr", "stride_xt", "x_odd_off"], grp.gate_up.num_warps))
# the residual-adding variants compile too (the pair sum's, and the down kernel's at T = 1 tiles)
from moe_offload.kernels import moe_sum
for residual in (False, True):
    v4_loads(moe_sum._sum_pairs_kernel, {"part_ptr": "*fp32", "out_ptr": "*bf16", "res_ptr": "*bf16",
                                         **i32(["stride_pm", "stride_rt", "stride_ot", "H", "TOPK"], "i32")},
             {"BLOCK": moe_sum.SUM_BLOCK, "RESIDUAL": residual}, ["part_ptr", "H"], 4)
v4_loads(g._down_sum_kernel, down_sig, {"KP": 8, "BLOCK_N": cfg.down.block_n, "BLOCK_K": cfg.down.block_k,
                                        "EVEN_K": True, "RESIDUAL": True}, div16, cfg.down.num_warps)
# the per-pair down that sums over K itself (compute.fused_moe_launches): its K loop as without it, then the
# barrier, one scalar acq_rel atomic, the other programs' partials read volatile; gate_up zeroing its counters
pair_sig = {**common, "act_ptr": "*fp32", "w_ptr": "*bf16", "part_ptr": "*fp32", "cnt_ptr": "*i32", "final_ptr": "*bf16",
            "stride_ft": "i32", "res_ptr": "*bf16", "stride_rt": "i32"}
names = g._down_pair_kernel.arg_names
src = ASTSource(fn=g._down_pair_kernel, signature={n: pair_sig.get(n, "constexpr") for n in names},
                constexprs={(names.index(k),): v for k, v in {"BLOCK_N": 32, "BLOCK_K": 256, "EVEN_K": True, "PTX": PTX,
                                                              "SUM_K": True, "RESIDUAL": True}.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["ptx"]
out["pair_sum"] = {"acq_rel": len(re.findall(r"atom\.global\.(?:gpu\.)?acq_rel(?:\.gpu)?\.add", ptx)),
                   "volatile": len(re.findall(r"ld\.volatile\.global", ptx))}
v4_loads(g._gate_up_kernel, {**gate_up_sig, "cnt_ptr": "*i32", "n_cnt": "i32"},
         {"BLOCK_M": 1, "BLOCK_N": 16, "BLOCK_K": 512, "EVEN_K": True, "SPLIT_X": False, "SPLIT_ACT": True,
          "ZERO_BLOCK": 16}, div16, 4)
print(json.dumps(out))
'''


def test_gemv_weight_loads_compile_to_16_byte_vectors_for_sm90(compiled_without_interpreter):
    """The interpreter runs kernels as Python; this compiles the shipped T = 1 tiles for an H200
    (sm_90) with Triton's own ptxas, no GPU needed, in a process without TRITON_INTERPRET."""
    import json

    out = compiled_without_interpreter(_COMPILE_SM90)
    r = json.loads(out)
    assert r["pair_sum"]["acq_rel"] >= 1 and r["pair_sum"]["volatile"] >= 1
    # every thread's share of each weight tile (gate and up: two tiles) arrives as 16-byte loads
    assert r["gate_up"] == 2 * r["gate_up_bytes"] // 16 and r["down"] == r["down_bytes"] // 16
    # interleaved x reaches the weight tile's layout through shared memory (barriers) in scalar loads; split
    # x is loaded in that layout (what kernels/decode_gemv.py's split_x claims, at the shipped H200 tiles), as are
    # the per-pair down's split activations (down_per_pair) at 8 x 256 tiles, all in 16-byte loads
    assert r["interleaved"]["barriers"] > 0 and r["interleaved"]["scalar_x_loads"] > 0
    assert r["split"]["barriers"] == 0 and r["split"]["scalar_x_loads"] == 0 and r["split"]["v4_loads"] >= 2
    assert r["down_pair"]["barriers"] == 0 and r["down_pair"]["v4_loads"] >= 3  # weights + even + odd
    assert r["grouped_interleaved"]["barriers"] > 0 and r["grouped_interleaved"]["scalar_x_loads"] > 0
    assert r["grouped_split"]["barriers"] == 0 and r["grouped_split"]["scalar_x_loads"] == 0
