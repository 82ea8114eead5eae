"""kernels/decode_attention.py on CUDA: bf16 decode shapes against torch's SDPA, and a captured call that
replays bitwise equal to eager and reads the mask (the positions) at replay time.

Legend: B rows, Hkv KV heads, G query heads per KV head, S positions, D head dim.
"""

import pytest
import torch
import torch.nn.functional as F

from moe_offload.kernels.decode_attention import AttnConfig, decode_attention

#: the default launch and others: the per-tile branch, a smaller tile, one split (one launch, no combine)
CONFIGS = {"default": None, "bound": AttnConfig(block=32, warps=4, stages=3, target_programs=512, bound=True),
           "branch": AttnConfig(bound=False), "one_split": AttnConfig(target_programs=1, direct=True)}

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _inputs(B, Hkv, G, S, D, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hkv, G, D, device="cuda", generator=gen).bfloat16()
    k = torch.randn(B, Hkv, S, D, device="cuda", generator=gen).bfloat16()
    v = torch.randn(B, Hkv, S, D, device="cuda", generator=gen).bfloat16()
    lens = torch.randint(1, S + 1, (B,), device="cuda", generator=gen)
    keep = torch.arange(S, device="cuda")[None, :] < lens[:, None]
    return q, k, v, keep[:, None, None, :]


@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("config", CONFIGS)
def test_bf16_decode_shapes_match_sdpa(B, mask_kind, config):
    q, k, v, keep = _inputs(B, 4, 8, 1152, 128, seed=B)
    mask = keep if mask_kind == "bool" else torch.where(keep, 0.0, torch.finfo(torch.bfloat16).min).bfloat16()
    got = decode_attention(q, k, v, mask, 128 ** -0.5, config=CONFIGS[config])
    want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=keep, scale=128 ** -0.5)
    torch.testing.assert_close(got.float(), want, atol=2 ** -7, rtol=2 ** -6)


@pytest.mark.parametrize("config", CONFIGS)
def test_captured_call_replays_bitwise_and_reads_the_mask_at_replay(config):
    cfg = CONFIGS[config]
    q, k, v, keep = _inputs(2, 4, 8, 1152, 128, seed=7)
    mask = keep.clone()
    eager = decode_attention(q, k, v, mask, 0.1, config=cfg)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        decode_attention(q, k, v, mask, 0.1, config=cfg)  # compile before capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention(q, k, v, mask, 0.1, config=cfg)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    mask[:, :, :, 700:] = False  # fewer visible positions, as the next step of a shorter row
    mask[:, :, :, 0] = True
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_attention(q, k, v, mask, 0.1, config=cfg))
    mask[:, :, :, :] = False  # a hole: the first and the last tiles visible (bound: one loop reads across)
    mask[:, :, :, :5] = True
    mask[:, :, :, 1100:] = True
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_attention(q, k, v, mask, 0.1, config=cfg))


@pytest.mark.parametrize("B", [1, 16])
def test_the_combine_split_over_d_gives_the_same_bits_on_the_gpu(B):
    """``AttnConfig.combine_block_d``: 16 and 32 columns a combine program (32 the default) and one program per
    (row, KV head) give identical bf16 outputs at decode shapes (4 KV heads x 8 query heads, D 128)."""
    q, k, v, keep = _inputs(B, 4, 8, 1152, 128, seed=11 + B)
    outs = [decode_attention(q, k, v, keep, 128 ** -0.5, config=AttnConfig(direct=False, combine_block_d=bd))
            for bd in (16, 32, 128)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
