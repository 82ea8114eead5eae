"""NVFP4 Triton kernels (dequant, fused MoE) against the plain-torch references, on awkward shapes.

Legend: T tokens, K top-k, N bank rows, H hidden, I intermediate, R/C rows/cols, G global groups.

Without CUDA the kernels run in the Triton interpreter on CPU tensors; TRITON_INTERPRET must be set
before the kernel modules are imported (``@triton.jit`` reads it when decorating). With CUDA the
same tests run natively.
"""

import json
import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat, dequantize, random_nvfp4  # noqa: E402
from moe_offload.host_store import bank_offsets, bank_views  # noqa: E402
from moe_offload.kernels.fused_moe import (  # noqa: E402
    fused_moe_nvfp4,
    max_padded_pairs,
    moe_align,
    moe_reference,
)
from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig, KernelTiles, TuningTable, load_tuning  # noqa: E402
from moe_offload.kernels.nvfp4 import dequant_banks, dequant_nvfp4  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROOT = Path(__file__).resolve().parents[1]
FMT = Nvfp4ModelOptFormat()


def make_banks(N: int, H: int, I: int, seed: int = 0) -> dict:
    """NVFP4 bank views of N random experts, laid out as the store does: column slices of one
    ``[N, row_bytes]`` byte tensor (plus 8 spare bytes per row), so dim 0 is not contiguous."""
    gen = torch.Generator().manual_seed(seed)
    specs = FMT.banks(H, I)
    raw_NR = torch.zeros(N, sum(s.nbytes for s in specs) + 8, dtype=torch.uint8)
    views = bank_views(specs, bank_offsets(specs), raw_NR)
    for e in range(N):
        q, s, _ = random_nvfp4(2 * I, H, gen)
        views["w13_q"][e], views["w13_s"][e] = q, s
        q, s, _ = random_nvfp4(H, I, gen)
        views["w2_q"][e], views["w2_s"][e] = q, s
    # random_nvfp4 data with global g0 has weight std 0.02; scale gate/up to std ~1/sqrt(H) and down
    # to ~1/sqrt(I) so pre-activations are ~N(0, 1) and SiLU is exercised on both sides of zero.
    # Each global is drawn separately, so a swapped or misapplied global changes the result.
    g0 = 0.02 / (2.93 * 80.0)
    fan_in = torch.tensor([H, H, I], dtype=torch.float32)
    views["gs"].copy_(g0 / 0.02 / fan_in.sqrt() * (0.5 + torch.rand(N, 3, generator=gen)))
    raw_NR = raw_NR.to(DEVICE)
    out = bank_views(specs, bank_offsets(specs), raw_NR)
    return out


def stacked_nvfp4(N: int, R: int, C: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    parts = [random_nvfp4(R, C, gen) for _ in range(N)]
    packed = torch.stack([p[0] for p in parts]).to(DEVICE)
    scale = torch.stack([p[1] for p in parts]).to(DEVICE)
    return packed, scale, gen


# ---------------------------------------------------------------------------------------------
# dequant_nvfp4 / dequant_banks
#
# Exactness in fp32: E2M1 values have <= 2 significant bits and E4M3 scales <= 4, so code * scale
# is exact in fp32; the kernel then does one fp32 multiply by the same global, in the same order
# as the torch reference. Both round the same exact product once, so the results are bit-identical.


def test_dequant_decodes_every_code_and_every_scale_exactly():
    # all 256 bytes (every low/high nibble pair) against every finite E4M3 bit pattern
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(1, 16, 16).repeat(254, 1, 1)
    scale_bits = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    scale = scale_bits.view(torch.float8_e4m3fn).view(254, 1, 1).expand(254, 16, 2).contiguous()
    glob = torch.ones(254, 1)
    packed, scale, glob = packed.to(DEVICE), scale.to(DEVICE), glob.to(DEVICE)
    out = dequant_nvfp4(packed, scale, glob, torch.float32)
    ref = dequantize(packed, scale, glob.view(-1, 1, 1), torch.float32)
    assert torch.equal(out, ref)


@pytest.mark.parametrize(
    "N, R, C, G",
    [(1, 16, 16, 1), (5, 48, 96, 2), (3, 34, 272, 2), (2, 7, 32, 1), (3, 30, 48, 3)],
    ids=["single", "odd-N-G2", "two-column-programs", "rows-not-a-tile-multiple", "G3"],
)
def test_dequant_matches_the_torch_reference_bit_for_bit_in_fp32(N, R, C, G):
    packed, scale, gen = stacked_nvfp4(N, R, C)
    glob_NG = (torch.rand(N, G, generator=gen) * 0.01 + 1e-4).to(DEVICE)
    out = dequant_nvfp4(packed, scale, glob_NG, torch.float32)
    ref = dequantize(packed, scale, torch.repeat_interleave(glob_NG, R // G, dim=1).unsqueeze(-1), torch.float32)
    assert out.shape == (N, R, C)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("tiles", [dict(block_r=4, block_b=128, split_store=True),
                                   dict(block_r=32, block_b=512, num_warps=8, split_store=True),
                                   dict(block_r=1, block_b=8, num_warps=1, split_store=False)],
                         ids=["split-store", "large-split-store", "smallest-interleaved"])
def test_every_dequant_tile_choice_gives_the_reference_bits(tiles):
    # the tuner (benchmarks/tune_dequant.py) picks tiles by speed alone: they must never change a bit,
    # including tiles that overhang the rows and columns (masked loads and stores)
    from moe_offload.kernels.nvfp4 import DequantTiles

    packed, scale, gen = stacked_nvfp4(3, 34, 272)
    glob_NG = (torch.rand(3, 2, generator=gen) * 0.01 + 1e-4).to(DEVICE)
    out = dequant_nvfp4(packed, scale, glob_NG, torch.float32, DequantTiles(**tiles))
    ref = dequantize(packed, scale, torch.repeat_interleave(glob_NG, 17, dim=1).unsqueeze(-1), torch.float32)
    assert torch.equal(out, ref)


def test_dequant_tuning_table_names_the_file_and_the_bad_entry(tmp_path):
    from moe_offload.kernels.nvfp4 import DequantTiles, dequant_tiles, load_dequant_tuning

    assert dequant_tiles(torch.device("cpu")) == load_dequant_tuning()["default"]  # cpu: no entry of its own
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"schema": 1, "devices": {"default": {"block_r": 16}, "GPU X": {"block_r": 3}}}))
    with pytest.raises(ValueError, match=r"t\.json: devices\['GPU X'\]"):
        load_dequant_tuning(bad)
    bad.write_text(json.dumps({"schema": 1, "devices": {"GPU X": {}}}))
    with pytest.raises(ValueError, match="default"):
        load_dequant_tuning(bad)
    with pytest.raises(ValueError, match="block_b >= 8"):
        DequantTiles(block_b=4)


def test_tune_dequant_writes_this_gpu_s_entry_and_keeps_the_others(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("tune_dequant", ROOT / "benchmarks" / "tune_dequant.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    table = tmp_path / "dequant_tuning.json"
    table.write_text(json.dumps({"schema": 1, "devices": {"default": {"block_r": 16, "block_b": 128, "num_warps": 4,
                                                                      "split_store": False}}}))
    best = {"block_r": 8, "block_b": 256, "num_warps": 8, "split_store": True}
    mod.write_table(table, "NVIDIA H200", best)
    from moe_offload.kernels.nvfp4 import load_dequant_tuning

    loaded = load_dequant_tuning(table)
    assert loaded["NVIDIA H200"].to_dict() == best and loaded["default"].block_r == 16
    space = list(mod.configs(mod.SPACES["small"]))
    assert space and all(t.block_r * t.block_b <= 1 << 14 for t in space)


def test_dequant_banks_reads_non_contiguous_bank_views():
    views = make_banks(N=5, H=64, I=32)
    assert not views["w13_q"].is_contiguous() and not views["gs"].is_contiguous()
    w13, w2 = dequant_banks(views, torch.float32)
    ref13, ref2 = FMT.dequantize(views, torch.float32)
    assert torch.equal(w13, ref13) and torch.equal(w2, ref2)


def test_dequant_to_bf16_matches_the_reference_within_one_bf16_ulp():
    views = make_banks(N=3, H=32, I=16)
    w13, w2 = dequant_banks(views, torch.bfloat16)
    ref13, ref2 = FMT.dequantize(views, torch.float32)
    # On CUDA the fp32 -> bf16 conversion rounds to nearest even (bit-identical; the GPU test checks
    # equality); the Triton interpreter truncates, which is off by at most one bf16 ulp = 2^-7 relative.
    for out, ref in ((w13, ref13), (w2, ref2)):
        torch.testing.assert_close(out.float(), ref, rtol=2**-7, atol=0.0)


def test_dequant_names_the_tensor_with_the_wrong_dtype_or_shape():
    packed, scale, _ = stacked_nvfp4(2, 16, 32)
    glob = torch.ones(2, 1, device=DEVICE)
    with pytest.raises(ValueError, match="scale_NRS"):
        dequant_nvfp4(packed, scale.view(torch.uint8), glob)
    with pytest.raises(ValueError, match="global_NG"):
        dequant_nvfp4(packed, scale, torch.ones(2, 3, device=DEVICE))
    with pytest.raises(ValueError, match="packed_NRB"):
        dequant_nvfp4(packed.float(), scale, glob)
    views = make_banks(N=2, H=32, I=16)
    del views["w2_s"]
    with pytest.raises(ValueError, match="w2_s"):
        dequant_banks(views)


# ---------------------------------------------------------------------------------------------
# moe_align


def test_moe_align_groups_pairs_by_row_in_whole_blocks():
    rows_TK = torch.tensor([[3, 0], [3, 3], [0, 4], [3, 1], [4, 3]], device=DEVICE)
    N, block_m = 6, 16
    al = moe_align(rows_TK, N, block_m)
    M = rows_TK.numel()
    ids, block_row = al.sorted_ids_P.cpu(), al.block_row_B.cpu()
    assert ids.numel() == max_padded_pairs(M, N, block_m) and ids.numel() % block_m == 0
    real = ids[ids < M]
    assert sorted(real.tolist()) == list(range(M))  # every pair exactly once
    num_padded = int(al.num_padded_1)
    assert num_padded == 4 * block_m  # rows 0, 1, 3, 4 are non-empty; each fits one block
    flat = rows_TK.flatten().cpu()
    for b in range(num_padded // block_m):
        block = ids[b * block_m : (b + 1) * block_m]
        assert (flat[block[block < M]] == block_row[b]).all()
    assert (ids[num_padded:] == M).all() and (block_row[num_padded // block_m :] == -1).all()


def test_moe_align_leaves_out_rows_outside_the_bank_without_writing_out_of_bounds():
    rows_TK = torch.tensor([[0, 7], [-1, 1]], device=DEVICE)
    al = moe_align(rows_TK, num_rows=2, block_m=16)
    ids = al.sorted_ids_P.cpu()
    assert sorted(ids[ids < 4].tolist()) == [0, 3]  # the pairs routed to rows 0 and 1
    assert int(al.num_padded_1) == 32


# ---------------------------------------------------------------------------------------------
# fused_moe_nvfp4

SMALL_TILES = FusedMoeConfig(16, KernelTiles(16, 32, group_m=2), KernelTiles(16, 32, group_m=2))  # many K steps/N tiles
WIDE_K = FusedMoeConfig(32, KernelTiles(32, 64), KernelTiles(32, 64))  # BLOCK_K > H or I: masked K tail
# the swapped-operand kernels (fused_moe_swap.py): small tiles with many K steps and N tiles, and a K tile wider
# than H or I (masked tail, padded split layout); down's BLOCK_K differs from gate_up's so the activations are
# written in a split layout other than the one the hidden states were read in
SWAP_SMALL = FusedMoeConfig(16, KernelTiles(16, 32, group_m=2), KernelTiles(32, 64, group_m=2), swap_ab=True)
SWAP_WIDE_K = FusedMoeConfig(32, KernelTiles(32, 128), KernelTiles(16, 32), swap_ab=True)
CONFIGS = {"small-tiles": SMALL_TILES, "wide-k": WIDE_K, "table": None, "swap-small": SWAP_SMALL,
           "swap-wide-k": SWAP_WIDE_K}

# (T, K, N, H, I, routing)
CASES = {
    "one-token-top1": (1, 1, 3, 32, 16, "random"),
    "one-token-top4": (1, 4, 6, 64, 32, "random"),
    "odd-T-some-experts-empty": (7, 2, 5, 64, 16, "rows-0-and-3"),
    "all-tokens-on-one-expert": (17, 2, 4, 32, 32, "all-row-2"),
    "odd-T-top3": (7, 3, 9, 32, 32, "random"),
}


def routing(T, K, N, kind, gen):
    if kind == "random":
        rows = torch.stack([torch.randperm(N, generator=gen)[:K] for _ in range(T)])
    elif kind == "rows-0-and-3":
        rows = torch.tensor([0, 3])[torch.randint(0, 2, (T, K), generator=gen)]
    else:
        rows = torch.full((T, K), 2)
    weights = torch.rand(T, K, generator=gen)
    return rows.to(DEVICE), (weights / weights.sum(1, keepdim=True)).to(DEVICE)


def run_case(case, dtype, config, seed=0):
    T, K, N, H, I, kind = CASES[case]
    views = make_banks(N, H, I, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE, dtype)
    rows, weights = routing(T, K, N, kind, gen)
    out = fused_moe_nvfp4(hidden, rows, weights, views, config=config)
    w13, w2 = FMT.dequantize(views, torch.float32)
    ref = moe_reference(hidden.float(), rows, weights, w13, w2)
    return out, ref


def assert_close_to_scale(out, ref, rel):
    """|out - ref| <= rel * (|ref| + max|ref|): relative where values are large, scaled by the
    output's magnitude where they cancel to near zero."""
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=rel, atol=rel * scale)


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
@pytest.mark.parametrize("case", CASES.keys())
def test_fused_moe_matches_the_reference_in_fp32(case, config):
    out, ref = run_case(case, torch.float32, config)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    # Same exact weights and fp32 activations on both sides; only the summation order (<= 64 terms)
    # and exp() differ, i.e. a few fp32 ulps (~1e-7 relative). 1e-5 leaves two orders of margin while
    # any wrong nibble, scale, global or routing weight moves results by >= 1e-2.
    assert_close_to_scale(out, ref, 1e-5)


@pytest.mark.parametrize("config", [SMALL_TILES, None, SWAP_SMALL], ids=["small-tiles", "table", "swap-small"])
@pytest.mark.parametrize("case", CASES.keys())
def test_fused_moe_matches_the_reference_in_bf16(case, config):
    out, ref = run_case(case, torch.bfloat16, config)
    assert out.dtype == torch.bfloat16
    # The fp32 reference sees the same bf16 inputs; the kernel rounds three times to bf16 (the SiLU
    # activation, each weighted per-pair term, the output), each <= 2^-7 relative (one ulp: the
    # interpreter truncates, CUDA rounds to nearest, half that). Errors add up to ~3 * 2^-7 ~ 2.4e-2
    # in the worst case; 3e-2 sits just above it.
    assert_close_to_scale(out, ref, 3e-2)


def test_fused_moe_writes_the_requested_out_dtype():
    T, K, N, H, I = 5, 2, 4, 32, 16
    views = make_banks(N, H, I)
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    rows, weights = routing(T, K, N, "random", gen)
    out = fused_moe_nvfp4(hidden, rows, weights, views, out_dtype=torch.bfloat16, config=SMALL_TILES)
    ref = moe_reference(hidden, rows, weights, *FMT.dequantize(views, torch.float32))
    assert out.dtype == torch.bfloat16
    # fp32 compute, two roundings to bf16 (per-pair terms and the sum): <= 2 * 2^-7
    assert_close_to_scale(out, ref, 2 * 2**-7)


def test_fused_moe_with_no_tokens_returns_an_empty_output():
    views = make_banks(N=2, H=32, I=16)
    hidden = torch.zeros(0, 32, device=DEVICE)
    rows = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    out = fused_moe_nvfp4(hidden, rows, torch.zeros(0, 2, device=DEVICE), views)
    assert out.shape == (0, 32)


def test_fused_moe_names_the_mismatched_input():
    views = make_banks(N=2, H=32, I=16)
    rows = torch.zeros(3, 1, dtype=torch.int64, device=DEVICE)
    weights = torch.ones(3, 1, device=DEVICE)
    with pytest.raises(ValueError, match="hidden_TH"):
        fused_moe_nvfp4(torch.zeros(3, 64, device=DEVICE), rows, weights, views)
    with pytest.raises(ValueError, match="weights_TK"):
        fused_moe_nvfp4(torch.zeros(3, 32, device=DEVICE), rows, weights[:2], views)
    with pytest.raises(ValueError, match="rows_TK"):
        fused_moe_nvfp4(torch.zeros(3, 32, device=DEVICE), rows.float(), weights, views)


# ---------------------------------------------------------------------------------------------
# Tuning table


def tiles(bn):
    return {"block_n": bn, "block_k": 64, "group_m": 8, "num_warps": 4, "num_stages": 3}


def entry(bm, bn=64):
    return {"block_m": bm, "gate_up": tiles(bn), "down": tiles(bn)}


def test_tuning_lookup_picks_device_then_shape_then_the_smallest_bucket_that_fits():
    table = TuningTable.from_json(
        {
            "schema": 1,
            "devices": {
                "default": {"default": {"64": entry(16)}},
                "GPU X": {"H2048_I768": {"64": entry(32), "4096": entry(64)}, "default": {"8": entry(128)}},
            },
        }
    )
    assert table.lookup("GPU X", 2048, 768, 64).block_m == 32
    assert table.lookup("GPU X", 2048, 768, 65).block_m == 64
    assert table.lookup("GPU X", 2048, 768, 10**6).block_m == 64  # past the last bucket: the largest
    assert table.lookup("GPU X", 4096, 768, 1).block_m == 128  # unknown shape: the device default
    assert table.lookup("other GPU", 2048, 768, 1).block_m == 16  # unknown device: the global default


def test_tuning_table_rejects_a_bad_entry_naming_where_it_is():
    bad = {"schema": 1, "devices": {"default": {"default": {"64": {"block_m": 24, **entry(16)}}}}}
    bad["devices"]["default"]["default"]["64"]["block_m"] = 24
    with pytest.raises(ValueError, match=r"devices\['default'\]\['default'\]\['64'\]"):
        TuningTable.from_json(bad)
    with pytest.raises(ValueError, match="default"):
        TuningTable.from_json({"schema": 1, "devices": {"GPU X": {"default": {"64": entry(16)}}}})


def test_the_shipped_tuning_table_loads():
    assert load_tuning().lookup("default", 2048, 768, 8).block_m >= 16


def test_dequant_banks_with_an_index_reads_those_rows_in_that_order():
    # the in-place prefill path dequantizes a layer's experts straight from their slots of the pool
    views = make_banks(N=7, H=64, I=32)
    index = torch.tensor([5, 0, 3, 3, 6], dtype=torch.int32, device=DEVICE)
    w13, w2 = dequant_banks(views, torch.float32, index_N=index)
    ref13, ref2 = FMT.dequantize({k: v.index_select(0, index.long()) for k, v in views.items()}, torch.float32)
    assert w13.shape[0] == 5 and torch.equal(w13, ref13) and torch.equal(w2, ref2)
    with pytest.raises(ValueError, match="index_N"):
        dequant_banks(views, torch.float32, index_N=index.float())


def test_fused_compute_reading_a_layer_in_place_equals_the_gathered_layer():
    # prefill.read_in_place with compute.backend triton: the pairs are aligned by expert id, then each block's
    # bank row is mapped through index_N into a larger bank (the pool); must equal the same experts gathered
    from moe_offload.compute.fused import FusedNvfp4Compute

    E, H, I, T, K = 6, 64, 32, 9, 2
    pool = make_banks(N=15, H=H, I=I)
    index = torch.tensor([14, 3, 7, 0, 9, 11], dtype=torch.int32, device=DEVICE)  # slot of each expert, shuffled
    gathered = {k: v.index_select(0, index.long()) for k, v in pool.items()}
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(T, H, generator=gen).to(DEVICE)
    rows, weights = routing(T, K, E, "random", gen)
    compute = FusedNvfp4Compute(torch.float32)
    in_place = compute(hidden, rows, weights, pool, E, index)
    want = compute(hidden, rows, weights, gathered, E)
    assert torch.equal(in_place, want)


def test_auto_compute_sends_each_call_where_the_table_measured_it_faster():
    # compute.backend auto: per call, the fused kernels where the bucket says faster_than_dequant, else dequant +
    # grouped_mm; both give the reference's answer and each call is counted under the path it took
    from moe_offload.compute.auto import AutoNvfp4Compute
    from moe_offload.compute.dequant import DequantGroupedCompute
    from moe_offload.compute.fused import FusedNvfp4Compute
    from moe_offload.stats import CacheStats

    E, H, I, K = 5, 64, 32, 2
    tiles = KernelTiles(16, 32, group_m=1)
    table = TuningTable({"default": {"default": {
        8: FusedMoeConfig(16, tiles, tiles, swap_ab=True, faster_than_dequant=True),  # up to 4 tokens: fused
        64: FusedMoeConfig(16, tiles, tiles)}}})  # more: dequant
    compute = AutoNvfp4Compute(FusedNvfp4Compute(torch.float32),
                               DequantGroupedCompute(FMT, torch.float32, E, use_triton_dequant=False))
    compute._config_for = lambda dev, h, i, pairs: table.lookup("default", h, i, pairs)
    stats = CacheStats()
    compute.bind(stats)
    views = make_banks(N=E, H=H, I=I)
    w13, w2 = FMT.dequantize(views, torch.float32)
    gen = torch.Generator().manual_seed(5)
    for T, want in ((3, "fused"), (9, "dequant")):
        assert compute.pick(torch.device(DEVICE), T, K, H, I) == want
        hidden = torch.randn(T, H, generator=gen).to(DEVICE)
        rows, weights = routing(T, K, E, "random", gen)
        out = compute(hidden, rows, weights, views, E)
        # fp32 on both sides, exact weights: summation order only (as the fp32 fused test)
        assert_close_to_scale(out, moe_reference(hidden, rows, weights, w13, w2), 1e-5)
    assert stats.compute["prefill_fused_calls"] == 1 and stats.compute["prefill_dequant_calls"] == 1


def test_tuning_entries_without_a_measurement_never_prefer_the_fused_kernels():
    # the shipped default entries (any GPU without its own, and the CPU) keep dequant + grouped_mm under auto
    table = load_tuning()
    for dev, shapes in table.devices.items():
        if dev == "default":
            assert not any(c.faster_than_dequant for b in shapes.values() for c in b.values())
    assert FusedMoeConfig.from_dict({"block_m": 16, "gate_up": {"block_n": 16, "block_k": 32},
                                     "down": {"block_n": 16, "block_k": 32}}).faster_than_dequant is False
    with pytest.raises(ValueError, match="unknown keys"):
        FusedMoeConfig.from_dict({"block_m": 16, "gate_up": {"block_n": 16, "block_k": 32},
                                  "down": {"block_n": 16, "block_k": 32}, "swapab": True})


_COMPILE_SWAP_SM90 = r'''
import json, re
import triton
import triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from moe_offload.kernels import fused_moe_swap as s

fn = s._gate_up_swap_kernel
names = fn.arg_names
ints = ["stride_qn", "stride_qr", "stride_sn", "stride_sr", "stride_gn", "M", "H", "I", "TOPK", "num_blocks_m",
        "stride_xt", "stride_am"]
sig = {"q_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "x_ptr": "*bf16", "act_ptr": "*bf16",
       **dict.fromkeys(ints, "i32"), **dict.fromkeys(["sorted_ids_ptr", "block_row_ptr", "num_padded_ptr"], "*i32")}
consts = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "ACT_BLOCK_K": 128, "EVEN_K": True,
          "DOT_DTYPE": tl.bfloat16, "INPUT_PRECISION": "tf32"}
div16 = ["q_ptr", "s_ptr", "x_ptr", "act_ptr", "stride_qn", "stride_qr", "stride_sn", "stride_sr", "H", "I",
         "stride_xt", "stride_am"]
src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                constexprs={(names.index(k),): v for k, v in consts.items()},
                attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div16})
k = triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": 4, "num_stages": 3})
dots = [l for l in k.asm["ttgir"].splitlines() if "warp_group_dot " in l]
print(json.dumps({"wgmma": len(dots),
                  "weights_in_registers": sum("dot_op<{opIdx = 0" in l for l in dots),
                  "ptx_bf16x2_scale_muls": len(re.findall(r"fma\.rn\.bf16x2", k.asm["ptx"]))}))
'''


def test_swapped_gate_up_compiles_for_sm90_to_wgmma_with_the_weight_tile_in_registers(compiled_without_interpreter):
    # the reason for the swap (fused_moe_swap.py): on Hopper the dequantized weight tile is wgmma's left operand,
    # read from registers, and the PTX conversion multiplies codes by scales as bf16 pairs
    import json

    out = json.loads(compiled_without_interpreter(_COMPILE_SWAP_SM90))
    assert out["wgmma"] >= 4 and out["weights_in_registers"] == out["wgmma"]
    assert out["ptx_bf16x2_scale_muls"] > 0


def test_the_tuners_random_banks_have_the_store_s_16_byte_aligned_rows():
    """The tuners (benchmarks/tune_*.py) time kernels on benchmarks/fused_moe.py's random banks. Unpadded rows
    (2,654,220 bytes at Qwen3-30B-A3B's shape) made Triton compile byte loads without cp.async: the decode
    tiles were tuned on a kernel 2.5 x slower than the one the runtime runs (its rows are ROW_ALIGN-padded)."""
    import importlib.util
    import sys

    from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat
    from moe_offload.host_store import ROW_ALIGN

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("fused_moe_bench", ROOT / "benchmarks" / "fused_moe.py")
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    data_bytes = sum(s.nbytes for s in Nvfp4ModelOptFormat().banks(256, 128))
    assert data_bytes % ROW_ALIGN  # this shape's banks do not fill whole 16-byte rows: the padding matters
    views = mod.random_banks(256, 128, 4, torch.device("cpu"))
    assert all(v.stride(0) * v.element_size() % ROW_ALIGN == 0 for v in views.values())
    assert views["w13_q"].stride(0) == -(-data_bytes // ROW_ALIGN) * ROW_ALIGN
    assert mod.random_banks(256, 128, 4, torch.device("cpu"), pad=False)["w13_q"].stride(0) == data_bytes


def test_random_nvfp4_is_seeded_uniform_and_valid():
    """Real-size synthetic checkpoints are written with random_nvfp4 (NumPy's PCG64 stream, seeded by one draw of
    the torch generator): the same seed gives the same bytes, codes cover every nibble, scales are finite E4M3 in
    [32, 128], and the global puts the weight std at the target."""
    a = random_nvfp4(256, 512, torch.Generator().manual_seed(5), target_std=0.03)
    b = random_nvfp4(256, 512, torch.Generator().manual_seed(5), target_std=0.03)
    c = random_nvfp4(256, 512, torch.Generator().manual_seed(6), target_std=0.03)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1].view(torch.uint8), b[1].view(torch.uint8))
    assert not torch.equal(a[0], c[0])
    q, s, g = a
    assert q.shape == (256, 256) and q.dtype == torch.uint8 and s.shape == (256, 32) and s.dtype == torch.float8_e4m3fn
    nibbles = torch.cat([q & 15, q >> 4]).flatten()
    assert torch.bincount(nibbles.long(), minlength=16).min() > 0.8 * nibbles.numel() / 16  # ~uniform codes
    sf = s.float()
    assert torch.isfinite(sf).all() and sf.min() >= 32 and sf.max() <= 128
    w = dequantize(q, s, g, torch.float32)
    assert 0.8 * 0.03 < w.std().item() < 1.2 * 0.03


def _run_ptx_b32(asm: str, operands: dict[int, "np.ndarray"]) -> dict[int, "np.ndarray"]:
    """Interpret the few 32-bit PTX instructions ``nvfp4.E2M1_TO_BF16_SCALED`` uses (mov, prmt, shl, and, mul.lo,
    lop3, fma.rn.bf16x2 with a -0.0 addend) over arrays of register values; ``operands`` maps $n to input arrays, outputs come
    back under their $n. Enough to check the bit tricks on CPU; the GPU tests check the compiled kernel."""
    import numpy as np

    regs = {f"${n}": v.astype(np.uint32) for n, v in operands.items()}

    def val(tok: str):
        return np.uint32(int(tok, 0)) if tok[0].isdigit() else regs[tok]

    def bf16_mul(a, b):
        def lanes(x):
            return torch.from_numpy(np.stack([x & 0xFFFF, x >> 16]).astype(np.int32)).to(torch.int16).view(torch.bfloat16)
        prod = (lanes(a).float() * lanes(b).float()).to(torch.bfloat16).view(torch.int16).int().numpy() & 0xFFFF
        return (prod[0] | (prod[1] << 16)).astype(np.uint32)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        d, *src = [a.strip() for a in args.split(",")]
        if op == "prmt.b32":
            a, b, sel = val(src[0]), val(src[1]), int(src[2], 0)
            pool = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
            regs[d] = sum((pool[(sel >> (4 * i)) & 7] << (8 * i)) for i in range(4)).astype(np.uint32)
            assert not sel & 0x8888, "sign-replicating selectors are not interpreted"
        elif op == "shl.b32":
            regs[d] = (val(src[0]).astype(np.uint64) << int(src[1])).astype(np.uint32)
        elif op == "and.b32":
            regs[d] = val(src[0]) & val(src[1])
        elif op == "mul.lo.u32":
            regs[d] = (val(src[0]).astype(np.uint64) * np.uint64(val(src[1]))).astype(np.uint32)
        elif op == "lop3.b32":
            a, b, c, lut = val(src[0]), val(src[1]), val(src[2]), int(src[3], 0)
            full = np.uint32(0xFFFFFFFF)
            out = np.zeros_like(a)
            for i in range(8):
                if lut >> i & 1:
                    out |= (a if i & 4 else a ^ full) & (b if i & 2 else b ^ full) & (c if i & 1 else c ^ full)
            regs[d] = out
        elif op == "mul.rn.bf16x2":
            regs[d] = bf16_mul(val(src[0]), val(src[1]))
        elif op == "fma.rn.bf16x2":  # only as a multiply: the addend must be -0.0 in both lanes
            assert np.all(val(src[2]) == np.uint32(0x80008000)), "fma.rn.bf16x2 interpreted with a -0.0 addend only"
            regs[d] = bf16_mul(val(src[0]), val(src[1]))
        elif op == "mov.b32":
            regs[d] = np.broadcast_to(val(src[0]), next(iter(operands.values())).shape).astype(np.uint32)
        else:
            raise AssertionError(f"uninterpreted PTX op {op}")
    return {int(k[1:]): v for k, v in regs.items() if k.startswith("$")}


def test_the_swapped_kernels_ptx_decodes_every_code_with_every_scale_exactly():
    """``nvfp4.E2M1_TO_BF16_SCALED`` (the bf16 weight conversion of the swapped kernels and the decode GEMV) gives
    code * scale * 2^-14 exactly for every byte in every byte position of a word (random neighbours: the bit
    tricks must not let one byte's bits reach another's lane) and every finite E4M3 scale, subnormals and 0 included."""
    import numpy as np

    from moe_offload.kernels.nvfp4 import E2M1_TO_BF16_SCALED
    from moe_offload.formats.nvfp4 import E2M1_VALUES

    rng = np.random.default_rng(0)
    e4m3 = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    e4m3 = e4m3[torch.isfinite(e4m3.float())]
    n = 256 * 4 * 3
    words = rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(np.uint32)
    pos = np.arange(n) // 256 % 4  # every byte value at every position, neighbours random
    words = (words & ~(np.uint32(0xFF) << (8 * pos).astype(np.uint32))) | ((np.arange(n) % 256).astype(np.uint32) << (8 * pos).astype(np.uint32))
    scale_idx = rng.integers(0, e4m3.numel(), (n, 4))
    scale_idx[: e4m3.numel(), 0] = np.arange(e4m3.numel())  # every scale at least once
    scales = e4m3.float()[torch.from_numpy(scale_idx)]  # [n, 4]
    sbits = (scales * 2.0**112).to(torch.bfloat16).view(torch.int16).int().numpy() & 0xFFFF  # exact
    regs = _run_ptx_b32(E2M1_TO_BF16_SCALED.value, {4: sbits[:, 0] | (sbits[:, 1] << 16),
                                                      5: sbits[:, 2] | (sbits[:, 3] << 16), 6: words})
    values = torch.tensor(E2M1_VALUES, dtype=torch.float64)
    for out, (nibble_shift, first) in {0: (0, 0), 1: (0, 2), 2: (4, 0), 3: (4, 2)}.items():
        for lane in range(2):
            elem = first + lane
            got = torch.from_numpy(((regs[out] >> (16 * lane)) & 0xFFFF).astype(np.int32)).to(torch.int16)
            got = got.view(torch.bfloat16).double()
            code = torch.from_numpy(((words >> (8 * elem + nibble_shift)) & 15).astype(np.int64))
            want = values[code] * scales[:, elem].double() * 2.0**-14
            assert torch.equal(got, want), f"${out} lane {lane}"


_COMPILE_ADA = r'''
import json
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_offload.kernels import decode_gemv as g
from moe_offload.kernels import fused_moe_swap as fs

def compile_for(fn, sig, consts, cap):
    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", cap, 32), options={"num_warps": 4}).asm["ptx"]

i32 = dict.fromkeys
gemm = {"q_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "sorted_ids_ptr": "*i32", "block_row_ptr": "*i32",
        "num_padded_ptr": "*i32", **i32(["stride_qn", "stride_qr", "stride_sn", "stride_sr", "stride_gn", "M", "H", "I",
                                         "num_blocks_m", "stride_am", "stride_xt", "TOPK", "stride_om"], "i32")}
tiles = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 1, "EVEN_K": True, "DOT_DTYPE": tl.bfloat16,
         "INPUT_PRECISION": "tf32"}
gemv = {"q_ptr": "*u8", "s_ptr": "*fp8e4nv", "g_ptr": "*fp32", "rows_ptr": "*i64", "act_ptr": "*fp32", "w_ptr": "*bf16",
        "part_ptr": "*fp32", **i32(["stride_qn", "stride_qr", "stride_sn", "stride_sr", "stride_gn", "N", "H", "I"], "i32")}
out = {}
for cap in (89, 90):
    ptx = [compile_for(fs._gate_up_swap_kernel, {**gemm, "x_ptr": "*bf16", "act_ptr": "*bf16"}, {**tiles, "ACT_BLOCK_K": 128}, cap),
           compile_for(fs._down_swap_kernel, {**gemm, "act_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16"}, tiles, cap),
           compile_for(g._down_pair_kernel, gemv, {"BLOCK_N": 8, "BLOCK_K": 256, "EVEN_K": True, "PTX": True}, cap)]
    out[cap] = [p.count("fma.rn.bf16x2") for p in ptx]
print(json.dumps(out))
'''


def test_the_ptx_weight_conversion_compiles_for_ada_and_hopper(compiled_without_interpreter):
    """The swapped fused-MoE kernels and the decode GEMV, with ``nvfp4.E2M1_TO_BF16_SCALED``, compiled by Triton's own
    ptxas for sm_89 (Ada: RTX 6000 Ada, L40S) and sm_90 (H100/H200), no GPU needed. With ``mul.rn.bf16x2`` (sm_90+
    only) ptxas refused sm_89; ``fma.rn.bf16x2`` with a -0.0 addend assembles from sm_80 on."""
    import json

    counts = json.loads(compiled_without_interpreter(_COMPILE_ADA))
    for cap in ("89", "90"):
        assert all(n > 0 for n in counts[cap]), counts  # every kernel compiled with the conversion's multiplies
