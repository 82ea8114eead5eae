"""Decode device kernels on CUDA: UVA views of pinned host rows, serve_misses over mapped memory, and a
captured serve_misses + decode_moe step (replays bitwise equal to eager, tables read at replay, no sync).

Legend: T tokens, K top-k, E experts, B bytes per expert row, S resident slots, X scratch rows.
"""

import pytest
import torch

from moe_offload import uva
from moe_offload.formats.nvfp4 import Nvfp4ModelOptFormat
from moe_offload.host_store import ExpertStore, bank_offsets, bank_views

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

FMT = Nvfp4ModelOptFormat()
H, I, E, K = 256, 128, 32, 4  # small NVFP4 experts (B = 55,308 bytes: 4-byte, not 16-byte, aligned rows)


@pytest.fixture
def pinned_host_rows():
    """Valid random NVFP4 experts ``[E, B]`` in host memory registered mapped + portable."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    specs = FMT.banks(H, I)
    B = sum(s.nbytes for s in specs)
    dev_ER = torch.randint(0, 256, (E, B), dtype=torch.uint8, device="cuda", generator=gen)
    views = bank_views(specs, bank_offsets(specs), dev_ER)
    for key in ("w13_s", "w2_s"):  # finite E4M3 scales in [32, 128)
        s = views[key]
        s.copy_((64.0 * (0.5 + 1.5 * torch.rand(s.shape, device="cuda", generator=gen))).to(torch.float8_e4m3fn))
    fan_in = torch.tensor([H, H, I], dtype=torch.float32, device="cuda")
    views["gs"].copy_((0.5 + torch.rand(E, 3, device="cuda", generator=gen)) / (2.93 * 80.0 * fan_in.sqrt()))
    host_ER = dev_ER.cpu()
    assert uva.pin_mapped(host_ER)
    yield host_ER, specs
    uva.unpin([host_ER.data_ptr()])


def test_mapped_view_aliases_the_host_memory(pinned_host_rows):
    host_ER, _ = pinned_host_rows
    view = uva.mapped_device_view(host_ER, "cuda")
    assert view.is_cuda and view.shape == host_ER.shape and view.dtype == torch.uint8
    assert torch.equal(view.cpu(), host_ER)
    host_ER[3, :7] = torch.arange(7, dtype=torch.uint8)  # a host write is seen by the device (no copy)
    assert view[3, :7].cpu().tolist() == list(range(7))
    cols = uva.mapped_device_view(host_ER[:, 100:300], "cuda")  # strided column slice
    assert torch.equal(cols.cpu(), host_ER[:, 100:300])


def test_unregistered_host_memory_is_a_named_error():
    with pytest.raises(uva.UvaError, match="not registered"):
        uva.mapped_device_view(torch.zeros(4096, dtype=torch.uint8), "cuda")


def test_store_device_rows_alias_the_pinned_rows(tiny_ckpt):
    store = ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)
    layer = store.layers[1]
    rows = store.device_rows(layer, "cuda")
    assert rows.is_cuda and torch.equal(rows.cpu(), store.rows(layer))
    assert store.device_rows(layer, "cuda") is rows  # cached
    store.close()


def test_serve_misses_over_mapped_memory_equals_the_reference_bitwise(pinned_host_rows):
    from moe_offload.kernels.decode_miss import MissCopyConfig, serve_misses, serve_misses_reference

    host_ER, _ = pinned_host_rows
    host_dev = uva.mapped_device_view(host_ER, "cuda")
    gen = torch.Generator().manual_seed(1)
    for T, S, cfg in ((1, 5, None), (7, 11, MissCopyConfig(chunk_bytes=1024, ctas_per_sm=1)), (64, 12, None)):
        X = min(T * K, E)
        slot_of_E = torch.full((E,), -1, dtype=torch.int32)
        resident = torch.randperm(E, generator=gen)[:S]
        slot_of_E[resident] = torch.randperm(S, generator=gen).to(torch.int32)
        pool_NR = torch.full((S + X, host_ER.shape[1]), 0xA5, dtype=torch.uint8, device="cuda")
        pool_NR[slot_of_E[resident].long().cuda()] = host_dev[resident.cuda()]
        ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
        slot_of_E = slot_of_E.cuda()
        want_pool = pool_NR.clone()
        want = serve_misses_reference(slot_of_E, ids_TK, host_ER.cuda(), want_pool, S)
        got = serve_misses(slot_of_E, ids_TK, host_dev, pool_NR, S, cfg)
        assert torch.equal(got, want), f"T={T}"
        assert torch.equal(pool_NR, want_pool), f"T={T}"  # scratch rows = host rows; nothing else written


def _step_setup(host_ER, specs, T, S, seed):
    gen = torch.Generator().manual_seed(seed)
    host_dev = uva.mapped_device_view(host_ER, "cuda")
    X = min(T * K, E)
    ids_TK = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    # resident: token 0's first expert plus random others, never token 0's second: hits and misses both
    first, second = int(ids_TK[0, 0]), int(ids_TK[0, 1])
    others = [e for e in torch.randperm(E, generator=gen).tolist() if e not in (first, second)]
    resident = torch.tensor([first] + others[: S - 1])
    slot_of_E = torch.full((E,), -1, dtype=torch.int32)
    slot_of_E[resident] = torch.arange(S, dtype=torch.int32)
    pool_NR = torch.zeros(S + X, host_ER.shape[1], dtype=torch.uint8, device="cuda")
    pool_NR[:S] = host_dev[resident.cuda()]
    views = bank_views(specs, bank_offsets(specs), pool_NR)
    ids_TK = ids_TK.cuda()
    weights_TK = torch.softmax(torch.randn(T, K, generator=gen), -1).cuda()
    hidden_TH = torch.randn(T, H, generator=gen).cuda().bfloat16()
    return host_dev, slot_of_E.cuda(), pool_NR, views, ids_TK, weights_TK, hidden_TH


@pytest.mark.parametrize("T", [1, 16])
def test_captured_step_replays_bitwise_and_honours_a_table_changed_between_replays(pinned_host_rows, T):
    from moe_offload.kernels.decode_miss import serve_misses
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4

    host_ER, specs = pinned_host_rows
    S = 12
    host_dev, slot_of_E, pool_NR, views, ids_TK, weights_TK, hidden_TH = _step_setup(host_ER, specs, T, S, seed=T)

    def step():
        rows_TK = serve_misses(slot_of_E, ids_TK, host_dev, pool_NR, S)
        return decode_moe_nvfp4(hidden_TH, rows_TK, weights_TK, views), rows_TK

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, rows_g = step()

    want_out, want_rows = step()
    graph.replay()
    assert torch.equal(rows_g, want_rows) and torch.equal(out_g, want_out)

    # between replays: evict every routed resident expert and admit one missed expert into a freed slot
    routed = sorted(set(ids_TK.view(-1).tolist()))
    table = slot_of_E.cpu()
    hits = [e for e in routed if table[e] >= 0]
    misses = [e for e in routed if table[e] < 0]
    free = int(table[hits[0]])
    table[hits] = -1
    table[misses[0]] = free
    pool_NR[free] = host_dev[misses[0]]
    slot_of_E.copy_(table)
    graph.replay()
    want_out2, want_rows2 = step()
    assert torch.equal(rows_g, want_rows2) and torch.equal(out_g, want_out2)
    assert not torch.equal(want_rows2, want_rows)  # the change really changed the rows


def test_a_decode_step_makes_no_host_sync(pinned_host_rows):
    from moe_offload.kernels.decode_miss import serve_misses
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4

    host_ER, specs = pinned_host_rows
    S = 10
    host_dev, slot_of_E, pool_NR, views, ids_TK, weights_TK, hidden_TH = _step_setup(host_ER, specs, 8, S, seed=2)

    def step():
        rows_TK = serve_misses(slot_of_E, ids_TK, host_dev, pool_NR, S)
        return decode_moe_nvfp4(hidden_TH, rows_TK, weights_TK, views)

    step()  # compile first: the steady state is what must not sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_decode_moe_matches_the_dequantized_reference_on_the_gpu(pinned_host_rows):
    from moe_offload.kernels.decode_moe import decode_moe_nvfp4
    from moe_offload.kernels.fused_moe import moe_reference

    host_ER, specs = pinned_host_rows
    views = bank_views(specs, bank_offsets(specs), host_ER.cuda())
    gen = torch.Generator().manual_seed(4)
    for T in (1, 3, 64):
        rows = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
        weights = torch.softmax(torch.randn(T, K, generator=gen), -1).cuda()
        hidden = torch.randn(T, H, generator=gen).cuda().bfloat16()
        out = decode_moe_nvfp4(hidden, rows, weights, views)
        ref = moe_reference(hidden.float(), rows, weights, *FMT.dequantize(views, torch.float32))
        # bf16 rounding (RNE, 2^-9 relative) three times (SiLU activation, weighted terms, output):
        # <= ~6e-3 of the output's scale; 1e-2 gives margin, while a wrong nibble/scale/row is O(1).
        scale = ref.abs().max().item()
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * scale)


@pytest.mark.parametrize("variant", ["split_x", "down_per_pair", "both", "grouped_split_x"])
def test_decode_gemv_variants_match_the_reference_and_replay_bitwise_in_a_graph(pinned_host_rows, variant):
    """The tuner's choices (kernels/decode_gemv.py: split_x, down_per_pair) compiled for this GPU: close to the
    dequantized reference, split_x bitwise equal to interleaved x, the PTX weight conversion (sm_90+) bitwise
    equal to the portable one, and a captured call replays its eager bits."""
    from moe_offload.kernels.decode_gemv import decode_gemv_nvfp4
    from moe_offload.kernels.decode_gemv_tuning import GemvConfig, GemvTiles
    from moe_offload.kernels.fused_moe import moe_reference
    from moe_offload.kernels.nvfp4 import ptx_conversion

    host_ER, specs = pinned_host_rows
    views = bank_views(specs, bank_offsets(specs), host_ER.cuda())
    split, per_pair = variant in ("split_x", "both", "grouped_split_x"), variant in ("down_per_pair", "both")
    block_m = 4 if variant == "grouped_split_x" else 1
    base = GemvConfig(block_m, GemvTiles(4, 128), GemvTiles(4, 128), down_per_pair=per_pair)
    cfg = GemvConfig(block_m, GemvTiles(4, 128), GemvTiles(16 if per_pair else 4, 128), down_per_pair=per_pair,
                     split_x=split)
    gen = torch.Generator().manual_seed(6)
    for T in (1, 5, 16):
        rows = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]).cuda()
        weights = torch.softmax(torch.randn(T, K, generator=gen), -1).cuda().bfloat16()
        hidden = torch.randn(T, H, generator=gen).cuda().bfloat16()
        out = decode_gemv_nvfp4(hidden, rows, weights, views, config=cfg)
        ref = moe_reference(hidden.float(), rows, weights.float(), *FMT.dequantize(views, torch.float32))
        # fp32 products and sums, one bf16 rounding of the output (2^-9 relative): 1e-2 of the output's scale
        # leaves margin, while a wrong nibble, scale, row or weight is O(1)
        scale = ref.abs().max().item()
        torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-2 * scale)
        if split and not per_pair:
            assert torch.equal(out, decode_gemv_nvfp4(hidden, rows, weights, views, config=base))
        if ptx_conversion(hidden.device):  # the PTX weight conversion (the default here) gives the portable one's bits
            assert torch.equal(out, decode_gemv_nvfp4(hidden, rows, weights, views, config=cfg, ptx=False))
        graph = torch.cuda.CUDAGraph()
        decode_gemv_nvfp4(hidden, rows, weights, views, config=cfg)  # compiled and warm before the capture
        with torch.cuda.graph(graph):
            captured = decode_gemv_nvfp4(hidden, rows, weights, views, config=cfg)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, out)
