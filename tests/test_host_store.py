"""ExpertStore: exact bank sizes, bytes per expert, TP slices that concatenate to the whole expert."""

import pytest
import torch

from moe_offload.formats import FormatError
from moe_offload.host_store import ExpertStore


@pytest.mark.parametrize("fmt,expected", [
    # tiny-qwen3-moe: H=64, I=32. NVFP4: codes 2I*H/2 + scales 2I*H/16 + codes H*I/2 + scales H*I/16 + 3 fp32
    ("nvfp4-modelopt", 2048 + 256 + 1024 + 128 + 12),
    ("bf16", (2 * 32 * 64 + 64 * 32) * 2),
])
def test_bytes_per_expert_and_exact_bank_sizes(tiny_ckpt, fmt, expected):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", fmt), progress=False)
    assert store.data_bytes_per_expert == expected
    row = -(-expected // 16) * 16  # rows padded to 16 bytes (aligned vector loads)
    assert store.bytes_per_expert == row and store.rows(store.layers[0]).stride(0) == row
    for layer in store.layers:
        assert not store.rows(layer)[:, expected:].any()  # the padding is zero
        for name, nbytes in store.bank_bytes.items():
            assert store.bank(layer, name).shape == (store.num_experts, nbytes)
    assert store.total_bytes == row * store.num_experts * len(store.layers)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4-modelopt", "nvfp4-ct"])
def test_tp_rank_slices_concatenate_to_the_whole_expert(tiny_ckpt, fmt):
    path = tiny_ckpt("tiny-qwen3-moe", fmt)
    full = ExpertStore.from_checkpoint(path, progress=False)
    parts = [ExpertStore.from_checkpoint(path, tp_rank=r, tp_size=2, progress=False) for r in range(2)]
    layer = full.layers[1]
    w13, w2 = full.format.dequantize(full.views(layer), torch.float32)
    p = [s.format.dequantize(s.views(layer), torch.float32) for s in parts]
    half = full.inter // 2
    gate = torch.cat([p[0][0][:, :half], p[1][0][:, :half]], 1)
    up = torch.cat([p[0][0][:, half:], p[1][0][:, half:]], 1)
    assert torch.equal(torch.cat([gate, up], 1), w13)
    assert torch.equal(torch.cat([p[0][1], p[1][1]], 2), w2)
    # every rank holds half of each bank; the three fp32 global scales are whole on both ranks
    assert parts[0].data_bytes_per_expert * 2 == full.data_bytes_per_expert + (12 if fmt != "bf16" else 0)


def test_nvfp4_tp_that_breaks_16_element_blocks_is_a_named_error(tiny_ckpt):
    with pytest.raises(FormatError, match="multiple of 16"):
        ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-ct"), tp_rank=0, tp_size=4, progress=False)


def test_triton_dequant_reads_the_strided_bank_views_of_expert_rows(tiny_ckpt):
    """Bank views are column slices of [E, bytes_per_expert] rows (dim-0 stride = the whole row): the
    Triton kernel (interpreted on CPU) must give the torch reference's values on exactly those views."""
    pytest.importorskip("triton")
    from moe_offload.kernels.nvfp4 import dequant_banks

    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-ct"), progress=False)
    views = {k: v[3:9] for k, v in store.views(store.layers[2]).items()}
    assert views["gs"].stride(0) * 4 == store.bytes_per_expert  # really strided
    got = dequant_banks(views, torch.float32)
    want = store.format.dequantize(views, torch.float32)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)  # same fp32 products: exact


def test_rows_of_a_real_model_size_are_padded_to_a_page_and_small_rows_to_16_bytes():
    from moe_offload.host_store import PAGE_ROW_ALIGN, PAGE_ROWS_FROM, padded_row_bytes

    assert padded_row_bytes(2654220) == 2658304  # Qwen3-30B-A3B's NVFP4 expert: a page multiple, +0.15 %
    assert padded_row_bytes(PAGE_ROWS_FROM) == PAGE_ROWS_FROM
    assert padded_row_bytes(PAGE_ROWS_FROM - 4) == PAGE_ROWS_FROM - 4 + 16 - (PAGE_ROWS_FROM - 4) % 16
    assert padded_row_bytes(3468) == 3472  # a tiny model's row keeps 16-byte padding
    for n in (PAGE_ROWS_FROM + 1, 2764812, 10 << 20):
        assert padded_row_bytes(n) % PAGE_ROW_ALIGN == 0 and 0 <= padded_row_bytes(n) - n < PAGE_ROW_ALIGN


def test_a_preset_sized_store_starts_every_row_on_a_page():
    store = ExpertStore.for_preset("qwen3-30b-a3b", layers=1, pin=False)
    rows = store.rows(store.layers[0])
    assert store.bytes_per_expert % 4096 == 0 and rows.data_ptr() % 4096 == 0
    assert store.bytes_per_expert - store.data_bytes_per_expert < 4096
