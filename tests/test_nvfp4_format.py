"""NVFP4 against an independent reference written from the format definition (codebook lookup)."""

import pytest
import torch

from moe_offload.formats import get_format
from moe_offload.formats.nvfp4 import dequantize, pack_codes, quantize, unpack_codes

# E2M1 by definition: 1 sign bit, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 is subnormal.
def e2m1_value(code: int) -> float:
    sign = -1.0 if code & 0x8 else 1.0
    exp, man = (code >> 1) & 0x3, code & 0x1
    mag = (man * 0.5) if exp == 0 else (1.0 + man * 0.5) * 2.0 ** (exp - 1)
    return sign * mag


def reference_dequant(packed, scale, global_mult):
    R, half = packed.shape
    out = torch.empty(R, half * 2)
    for r in range(R):
        for c in range(half * 2):
            byte = int(packed[r, c // 2])
            code = (byte & 0xF) if c % 2 == 0 else (byte >> 4)  # element 2k in the low nibble
            out[r, c] = e2m1_value(code) * float(scale[r, c // 16].float()) * global_mult
    return out


def test_codebook_matches_the_e2m1_definition():
    from moe_offload.formats.nvfp4 import E2M1_VALUES

    assert [e2m1_value(c) for c in range(16)] == list(E2M1_VALUES)


def test_pack_puts_element_2k_in_the_low_nibble():
    codes = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7]], dtype=torch.uint8)
    assert pack_codes(codes).tolist() == [[0x10, 0x32, 0x54, 0x76]]
    neg = codes | 0x8
    assert pack_codes(neg).tolist() == [[0x98, 0xBA, 0xDC, 0xFE]]


def test_unpack_inverts_pack_on_random_codes():
    codes = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


@pytest.mark.parametrize("R,C", [(1, 16), (3, 48), (8, 64)])
def test_dequantize_matches_the_codebook_reference(R, C):
    g = torch.Generator().manual_seed(R * C)
    packed = torch.randint(0, 256, (R, C // 2), dtype=torch.uint8, generator=g)
    scale = (torch.rand(R, C // 16, generator=g) * 4 + 0.25).to(torch.float8_e4m3fn)
    got = dequantize(packed, scale, torch.tensor(0.0123))
    # fp32 products of exactly representable factors: exact up to one rounding of the global scale
    torch.testing.assert_close(got, reference_dequant(packed, scale, 0.0123), rtol=1e-6, atol=0)


def test_quantize_round_trip_error_is_within_half_a_code_step():
    w = torch.randn(32, 64) * 0.02
    packed, scale, gmul = quantize(w)
    back = dequantize(packed, scale, gmul)
    # per block the largest E2M1 step is 2 (between 4 and 6) times the block scale; rounding
    # to nearest is off by at most half a step, plus the e4m3 rounding of the scale (<= 6.25%).
    step = scale.float().repeat_interleave(16, dim=1) * gmul
    assert ((back - w).abs() <= step * 1.0 * 1.07 + 1e-9).all()
    assert (back - w).abs().mean() < 0.1 * w.abs().mean() * 2


@pytest.mark.parametrize("fmt_name", ["nvfp4-modelopt", "nvfp4-ct"])
def test_each_layout_applies_its_global_scale_semantics(fmt_name, tmp_path):
    """ModelOpt's weight_scale_2 multiplies; compressed-tensors' weight_global_scale divides."""
    from safetensors.torch import save_file

    from moe_offload.checkpoint.reader import CheckpointReader

    fmt = get_format(fmt_name)
    w = torch.randn(16, 32) * 0.05
    packed, scale, gmul = quantize(w)
    tensors = fmt.to_disk("lin", packed, scale, gmul)
    if fmt_name == "nvfp4-modelopt":
        assert torch.allclose(tensors["lin.weight_scale_2"], gmul)
    else:
        assert torch.allclose(tensors["lin.weight_global_scale"], 1.0 / gmul)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(
        '{"model_type": "qwen3_moe", "num_hidden_layers": 1, "num_experts": 2, "num_experts_per_tok": 1,'
        ' "hidden_size": 32, "moe_intermediate_size": 16, "vocab_size": 10}')
    got = fmt.read_linear(CheckpointReader(tmp_path), "lin", torch.float32)
    # CT stores 1/g: dequantizing through the reciprocal costs at most one fp32 ulp of the scale
    torch.testing.assert_close(got, reference_dequant(packed, scale, float(gmul)), rtol=1e-6, atol=1e-9)
