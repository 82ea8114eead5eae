"""NVFP4 kernels at real sizes on CUDA (Qwen3-30B-A3B MoE layer: H=2048, I=768, E=128, K=8).

Legend: T tokens, K top-k, N bank rows, H hidden, I intermediate.
"""

import pytest
import torch

from moe_offload.formats.base import BankSpec
from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat
from moe_offload.host_store import bank_offsets, bank_views, padded_row_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

H, I, N, T, K = 2048, 768, 128, 1024, 8
FMT = Nvfp4ModelOptFormat()


def random_banks_on_gpu(seed: int = 0, store_rows: bool = False) -> dict:
    """Valid random NVFP4 banks built on the GPU, as column slices of one ``[N, row_bytes]`` byte
    bank (rows 16 bytes longer than the banks need, so dim 0 is not contiguous; ``store_rows``: rows padded
    to ``ROW_ALIGN`` as the store and the slot pool lay them out, 16-byte aligned, so the kernels compile
    with vector loads: the variant the runtime runs)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    specs: list[BankSpec] = FMT.banks(H, I)
    row_bytes = sum(s.nbytes for s in specs)
    row_bytes = padded_row_bytes(row_bytes) if store_rows else row_bytes + 16
    raw_NR = torch.randint(0, 256, (N, row_bytes), dtype=torch.uint8, device="cuda", generator=gen)
    views = bank_views(specs, bank_offsets(specs), raw_NR)
    for key in ("w13_s", "w2_s"):  # finite E4M3 scales in [32, 128)
        s = views[key]
        s.copy_((64.0 * (0.5 + 1.5 * torch.rand(s.shape, device="cuda", generator=gen))).to(torch.float8_e4m3fn))
    # weight std ~ 1/sqrt(fan_in) (random codes: rms 2.93, mean scale ~80)
    fan_in = torch.tensor([H, H, I], dtype=torch.float32, device="cuda")
    views["gs"].copy_((0.5 + torch.rand(N, 3, device="cuda", generator=gen)) / (2.93 * 80.0 * fan_in.sqrt()))
    return views


@pytest.fixture(scope="module")
def banks():
    return random_banks_on_gpu()


def test_dequant_kernel_is_bit_identical_to_the_reference_in_bf16_and_fp32(banks):
    from moe_offload.kernels.nvfp4 import dequant_banks

    for dtype in (torch.float32, torch.bfloat16):
        w13, w2 = dequant_banks(banks, dtype)
        ref13, ref2 = FMT.dequantize(banks, dtype)
        # exact: code * scale is exact in fp32, then one rounding by the same global and one RNE cast
        assert torch.equal(w13, ref13) and torch.equal(w2, ref2)


def _swap(block_m, bn, bk, warps, stages, group_m):
    from moe_offload.kernels.fused_moe_tuning import FusedMoeConfig, KernelTiles

    tiles = KernelTiles(bn, bk, group_m=group_m, num_warps=warps, num_stages=stages)
    return FusedMoeConfig(block_m, tiles, tiles, swap_ab=True)


# the table's tiles, and the swapped-operand kernels (fused_moe_swap.py, wgmma with the weight tile from registers)
# at prefill-sized and decode-sized tiles, one and two warpgroups
CONFIGS = {"table": None, "swap-64x128x128-w8": (64, 128, 128, 8, 3, 8), "swap-16x64x256-w4": (16, 64, 256, 4, 4, 1),
           "swap-32x128x256-w4": (32, 128, 256, 4, 3, 8)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_fused_moe_matches_the_dequantized_reference_at_qwen3_sizes(banks, config, dtype):
    # bf16: the swapped kernels' PTX conversion (bf16 subnormal codes times scaled scales); fp16: their fp16 form
    from moe_offload.kernels.fused_moe import fused_moe_nvfp4, moe_reference

    config = None if config is None else _swap(*config)

    gen = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(T, H, device="cuda", generator=gen).to(dtype)
    logits = torch.randn(T, N, device="cuda", generator=gen)
    weights, rows = torch.softmax(logits, -1).topk(K, dim=-1)
    rows[:3] = torch.arange(K, device="cuda")  # a few tokens share exactly the same experts
    out = fused_moe_nvfp4(hidden, rows, weights, banks, config=config)
    w13, w2 = FMT.dequantize(banks, torch.float32)
    ref = moe_reference(hidden.float(), rows, weights, w13, w2)
    assert out.dtype == dtype and out.shape == (T, H)
    # The fp32 reference sees the same bf16 inputs and exact weights; the kernel rounds to bf16 (RNE,
    # 2^-9 relative) three times (the SiLU activation, each weighted term, the output), so errors stay
    # below ~3 * 2^-9 ~ 6e-3 of the output's scale; 1e-2 gives margin, while a wrong nibble, scale or
    # global changes results by O(1).
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * scale)
    rel_fro = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel_fro < 5e-3  # typical error is ~2^-9 = 2e-3 (one rounding dominates)


@pytest.mark.parametrize("config", [None, (16, 64, 256, 4, 4, 1)], ids=["table", "swap"])
def test_fused_moe_decode_step_reads_only_routed_rows(banks, config):
    from moe_offload.kernels.fused_moe import fused_moe_nvfp4, moe_reference

    config = None if config is None else _swap(*config)

    gen = torch.Generator(device="cuda").manual_seed(2)
    hidden = torch.randn(1, H, device="cuda", generator=gen).bfloat16()
    rows = torch.randperm(N, device="cuda", generator=gen)[:K].view(1, K)
    weights = torch.rand(1, K, device="cuda", generator=gen)
    poisoned = dict(banks)
    unused = torch.ones(N, dtype=torch.bool, device="cuda")
    unused[rows.flatten()] = False
    # NaN globals on rows nobody routes to: any read of them would poison the output
    poisoned["gs"] = torch.where(unused[:, None], torch.nan, banks["gs"])
    out = fused_moe_nvfp4(hidden, rows, weights, poisoned, config=config)
    ref = moe_reference(hidden.float(), rows, weights, *FMT.dequantize(banks, torch.float32))
    scale = ref.abs().max().item()
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * scale)  # as above


@pytest.mark.parametrize("T", [4, 8, 16, 32, 64])  # the H200 buckets of 32 / 64 / 128 / 256 / 512 pairs
def test_decode_moe_with_the_shipped_tiles_matches_the_reference_on_store_aligned_rows(T):
    """The decode tiles (``decode_moe_nvfp4``) with this GPU's shipped ``decode_moe_tuning.json`` entry at each
    bucket, on rows laid out as the store lays them out (16-byte aligned: the vector-load variant that runs)."""
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4
    from moe_offload.kernels.fused_moe import moe_reference

    banks = random_banks_on_gpu(seed=3, store_rows=True)
    assert banks["w13_q"].stride(0) % 16 == 0
    gen = torch.Generator(device="cuda").manual_seed(T)
    hidden = torch.randn(T, H, device="cuda", generator=gen).bfloat16()
    weights, rows = torch.softmax(torch.randn(T, N, device="cuda", generator=gen), -1).topk(K, dim=-1)
    out = decode_moe_nvfp4(hidden, rows, weights, banks)
    ref = moe_reference(hidden.float(), rows, weights, *FMT.dequantize(banks, torch.float32))
    scale = ref.abs().max().item()  # tolerance as in the test above: three bf16 roundings
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * scale)
