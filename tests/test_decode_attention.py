"""kernels/decode_attention.py (split-K grouped-query decode attention) against torch's SDPA, and its
route through ``gqa_decode_sdpa`` when ``compute.decode_attention`` is ``triton``. The kernels run in
the Triton interpreter here (tests/conftest.py); tests/gpu/test_decode_attention_gpu.py runs them on CUDA.

Legend: B rows, Hkv KV heads, G query heads per KV head, S positions, D head dim.
"""

import pytest
import torch
import torch.nn.functional as F

from moe_offload.kernels.decode_attention import BLOCK_S, AttnConfig, decode_attention, splits_for

#: a branch skips hidden tiles; the bounded loop with a smaller tile; one split (one launch, no combine)
CONFIGS = {"branch": AttnConfig(bound=False), "bound": AttnConfig(block=32, bound=True, target_programs=512),
           "one_split": AttnConfig(target_programs=1, direct=True)}


def _case(B, Hkv, G, S, D, dtype, mask_kind, seed=0, pad=7):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hkv, G, D, generator=gen).to(dtype)
    # k/v as the first S positions of a longer static cache: strided views, as decode reads them
    k = torch.randn(B, Hkv, S + pad, D, generator=gen).to(dtype)[:, :, :S]
    v = torch.randn(B, Hkv, S + pad, D, generator=gen).to(dtype)[:, :, :S]
    lens = torch.randint(1, S + 1, (B,), generator=gen)
    keep = torch.arange(S)[None, :] < lens[:, None]
    mask = {"bool": keep[:, None, None, :],
            "float": torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :].to(dtype),
            "none": None}[mask_kind]
    return q, k, v, mask


def _sdpa(q, k, v, mask, scale):
    m = None if mask is None else (mask if mask.dtype == torch.bool else mask.float())
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m, scale=scale)


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize("B,Hkv,G,S,D,splits", [(1, 4, 8, 300, 64, None), (3, 2, 3, 130, 8, 3), (2, 1, 1, 5, 16, None),
                                                 (2, 2, 4, 2 * BLOCK_S, 32, 1)])
@pytest.mark.parametrize("config", CONFIGS)
def test_fp32_equals_sdpa(mask_kind, B, Hkv, G, S, D, splits, config):
    q, k, v, mask = _case(B, Hkv, G, S, D, torch.float32, mask_kind, seed=S)
    got = decode_attention(q, k, v, mask, D ** -0.5, splits, CONFIGS[config])
    assert got.shape == (B, Hkv, G, D) and got.dtype == torch.float32
    torch.testing.assert_close(got, _sdpa(q, k, v, mask, D ** -0.5), atol=2e-6, rtol=2e-6)


def test_bf16_is_sdpa_rounded_once():
    """bf16 in, bf16 out: within one bf16 rounding of the fp32 result (the statistics stay fp32)."""
    q, k, v, mask = _case(1, 4, 8, 1152, 128, torch.bfloat16, "bool")
    got = decode_attention(q, k, v, mask, 128 ** -0.5)
    want = _sdpa(q, k, v, mask, 128 ** -0.5)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, atol=2 ** -8, rtol=2 ** -7)


def test_the_split_count_does_not_change_the_result_beyond_rounding():
    q, k, v, mask = _case(2, 2, 8, 5 * BLOCK_S + 3, 32, torch.float32, "bool", seed=3)
    outs = [decode_attention(q, k, v, mask, 0.2, s) for s in (1, 2, 6)]
    for o in outs[1:]:
        torch.testing.assert_close(o, outs[0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("config", CONFIGS)
def test_positions_a_mask_hides_do_not_matter(config):
    """A tile nobody may see is not read, and masked positions inside a tile weigh 0: garbage there
    (NaN included, as in never-written static-cache rows) changes nothing."""
    q, k, v, mask = _case(2, 2, 4, 3 * BLOCK_S, 16, torch.float32, "bool", seed=5)
    want = decode_attention(q, k, v, mask, 0.25, config=CONFIGS[config])
    b, s = (~mask[:, 0, 0, :]).nonzero(as_tuple=True)
    k2, v2 = k.clone(), v.clone()
    k2[b, :, s] = float("nan")
    v2[b, :, s] = float("nan")
    assert torch.equal(decode_attention(q, k2, v2, mask, 0.25, config=CONFIGS[config]), want)


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_the_bounded_loop_handles_holes_and_empty_splits(mask_kind):
    """bound: a split whose mask hides everything runs no tile, one with a hole in the middle reads across it,
    and a split longer than MAX_SPLIT_TILES tiles is cut into more splits: all equal SDPA."""
    from moe_offload.kernels.decode_attention import MAX_SPLIT_TILES, split_plan

    B, Hkv, G, D, block = 3, 2, 4, 16, 16
    S = (MAX_SPLIT_TILES + 5) * block
    q, k, v, _ = _case(B, Hkv, G, S, D, torch.float32, "none", seed=9)
    keep = torch.zeros(B, S, dtype=torch.bool)
    keep[0, :3] = True  # only the first split sees anything
    keep[1, 5:S // 3] = True  # a hole from S // 3 to S - 40
    keep[1, S - 40:] = True
    keep[2, S - 1] = True  # one visible position, in the last tile
    mask = keep[:, None, None, :] if mask_kind == "bool" else \
        torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
    cfg = AttnConfig(block=block, bound=True, target_programs=1)  # 1 split asked: the tile cap makes 2
    assert split_plan(S, B * Hkv, cfg) == (2, -(-(MAX_SPLIT_TILES + 5) // 2) * block)
    assert split_plan(S, B * Hkv, AttnConfig(block=block, bound=False, target_programs=1)) == (1, S)
    for splits in (None, 4):
        got = decode_attention(q, k, v, mask, D ** -0.5, splits, cfg)
        torch.testing.assert_close(got, _sdpa(q, k, v, mask, D ** -0.5), atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("config", CONFIGS)
def test_a_hole_inside_one_split_is_not_read_and_weighs_nothing(config):
    """One split holding visible positions on both sides of a hidden stretch: the bounded loop reads across
    it, and NaN keys and values there (never-written cache rows) change nothing."""
    B, Hkv, G, D, S = 2, 2, 4, 16, 100
    q, k, v, _ = _case(B, Hkv, G, S, D, torch.float32, "none", seed=13)
    keep = torch.zeros(B, S, dtype=torch.bool)
    keep[:, :5] = True
    keep[:, 90:] = True
    keep[1, 40] = True  # a lone visible position inside the hole of row 1
    mask = keep[:, None, None, :]
    k[:, :, ~keep[0]] = float("nan")
    v[:, :, ~keep[0]] = float("nan")
    k[1, :, 40], v[1, :, 40] = q[1, :, 0], q[1, :, 1]  # row 1's position 40 is visible: real values
    want = _sdpa(q, k.nan_to_num(), v.nan_to_num(), mask, 0.25)
    cfg = CONFIGS[config]
    got = decode_attention(q, k, v, mask, 0.25, 1, AttnConfig(**{**cfg.__dict__, "block": 16}))
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)


@pytest.mark.parametrize("bound", [True, False])
def test_an_fp16_models_minus_65504_is_a_bias_not_a_hole(bound):
    """An additive mask above -1e30 (fp16's most negative finite, as fp16 models build their masks) is added
    as it is, not read as hidden: a row that is -65504 everywhere attends everywhere, like SDPA."""
    B, Hkv, G, D, S = 2, 2, 4, 16, 70
    q, k, v, _ = _case(B, Hkv, G, S, D, torch.float16, "none", seed=17)
    m = torch.zeros(B, S, dtype=torch.float16)
    m[0, 30:] = -65504.0
    m[1, :] = -65504.0
    mask = m[:, None, None, :]
    got = decode_attention(q, k, v, mask, 0.25, None, AttnConfig(block=16, bound=bound))
    torch.testing.assert_close(got.float(), _sdpa(q, k, v, mask, 0.25), atol=2e-3, rtol=2e-3)


def test_split_count_keeps_whole_tiles_and_enough_programs():
    assert splits_for(1, 4) == 1
    assert splits_for(1152, 4) == 1152 // BLOCK_S  # 18 tiles, 4 (row, head) pairs: every tile its own split
    assert splits_for(1152, 256) == 1  # enough programs without splitting
    assert 1 <= splits_for(100_000, 16) <= 16
    # at least two tiles per split (AttnConfig's default): 18 tiles at 1 row make 9 splits, not 18
    assert splits_for(1152, 4, min_tiles=2) == 9
    assert splits_for(BLOCK_S, 4, min_tiles=2) == 1  # one tile: one split
    assert splits_for(1152, 64, min_tiles=2) == 4  # the target, not the tile floor, sets it at 16 rows


def test_bad_launch_choices_are_named():
    for bad in ({"block": 48}, {"block": 8}, {"warps": 3}, {"stages": 0}, {"target_programs": 0},
                {"min_split_tiles": 0}, {"combine_block_d": 8}, {"combine_block_d": 48}):
        with pytest.raises(ValueError, match="AttnConfig|invalid"):
            AttnConfig(**bad)


def test_bad_shapes_are_named():
    q, k, v, _ = _case(1, 2, 2, 8, 16, torch.float32, "none")
    with pytest.raises(ValueError, match="mask must be"):
        decode_attention(q, k, v, torch.ones(1, 1, 1, 9, dtype=torch.bool), 0.25)
    with pytest.raises(ValueError, match="do not match"):
        decode_attention(q, k[:, :1], v[:, :1], None, 0.25)
    with pytest.raises(ValueError, match="splits"):
        decode_attention(q, k, v, None, 0.25, 0)


class _Attn(torch.nn.Module):
    def __init__(self, groups, kernel):
        super().__init__()
        self.num_key_value_groups = groups
        self._moe_offload_gqa_decode = kernel


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_gqa_decode_routes_to_the_kernel_when_configured(mask_kind):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from moe_offload.integrations.fused_norms import gqa_decode_sdpa

    B, Hkv, G, S, D = 2, 2, 4, 70, 16
    q_BHGD, k, v, mask = _case(B, Hkv, G, S, D, torch.float32, mask_kind, seed=11)
    query = q_BHGD.reshape(B, Hkv * G, 1, D)
    fn = gqa_decode_sdpa(sdpa_attention_forward)
    want, _ = sdpa_attention_forward(_Attn(G, "sdpa"), query, k, v, mask, scaling=D ** -0.5)
    got, _ = fn(_Attn(G, "triton"), query, k, v, mask, scaling=D ** -0.5)
    assert got.shape == want.shape == (B, 1, Hkv * G, D)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    # the kernel really ran: NaN keys at masked positions make SDPA's output NaN, not the kernel's
    hidden = (mask[:, 0, 0, :] if mask.dtype == torch.bool else mask[:, 0, 0, :] == 0).logical_not()
    b, s = hidden.nonzero(as_tuple=True)
    k_nan = k.clone()
    k_nan[b, :, s] = float("nan")
    assert torch.isnan(sdpa_attention_forward(_Attn(G, "sdpa"), query, k_nan, v, mask, scaling=D ** -0.5)[0]).any()
    assert torch.equal(fn(_Attn(G, "triton"), query, k_nan, v, mask, scaling=D ** -0.5)[0], got)


def test_the_config_key_reaches_the_attention_modules(tiny_ckpt):
    from moe_offload.integrations.fused_norms import mark_gqa_decode
    from moe_offload.integrations.reference import build_reference_model

    ref = build_reference_model(tiny_ckpt("tiny-qwen3-moe", "bf16"), torch.float32, "cpu")
    assert mark_gqa_decode(ref, "triton") == ref.config.num_hidden_layers
    marks = {m._moe_offload_gqa_decode for m in ref.modules() if hasattr(m, "_moe_offload_gqa_decode")}
    assert marks == {"triton"}
    with pytest.raises(ValueError, match="decode_attention"):
        mark_gqa_decode(ref, "flash")


def test_a_model_decodes_the_same_logits_with_the_kernel(tiny_ckpt, monkeypatch):
    from test_router_attention import decode_logits

    from moe_offload.integrations.fused_norms import mark_gqa_decode
    from moe_offload.integrations.reference import build_reference_model
    from moe_offload.kernels import decode_attention as module

    ref = build_reference_model(tiny_ckpt("tiny-qwen3-moe", "bf16"), torch.float32, "cpu")
    want = decode_logits(ref)
    calls = []
    monkeypatch.setattr(module, "decode_attention", lambda *a, **kw: calls.append(1) or decode_attention(*a, **kw))
    mark_gqa_decode(ref, "triton")
    torch.testing.assert_close(decode_logits(ref), want, atol=1e-5, rtol=1e-5)
    assert len(calls) == ref.config.num_hidden_layers  # the decode step's attention, once per layer


_COMPILE_SM90 = r'''
import json, re
import triton, triton.language as tl
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from moe_offload.kernels import decode_attention as da

def build(fn, sig, consts, num_warps=4):
    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm["ptx"]

i32 = dict.fromkeys
strides = i32(["sqb", "sqh", "sqg", "skb", "skh", "sks", "svb", "svh", "svs", "smb", "sms", "Hkv", "G", "S", "D",
               "per_split"], "i32")
out = {}
for kind, mask in ((1, "*u8"), (2, "*bf16"), (0, "*bf16")):
    for bound, maxt, direct in ((False, 1, False), (True, 8, False), (True, 64, True)):
        ptx = build(da._partial_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "m_ptr": mask,
                                         **i32(["m_out", "l_out", "acc_out"], "*fp32"), "out_ptr": "*bf16",
                                         **i32(["sob", "soh", "sog"], "i32"), **strides, "scale": "fp32"},
                    {"MASK_KIND": kind, "GP": 16, "DP": 128, "BLOCK": da.BLOCK_S, "DOT_DTYPE": tl.bfloat16,
                     "PREC": "tf32", "BOUND": bound, "MAXT": maxt, "DIRECT": direct})
        out[f"partial_{kind}_{'bound' if bound else 'branch'}{'_direct' if direct else ''}_mma"] = \
            len(re.findall(r"mma|wgmma", ptx)) > 0
build(da._combine_kernel, {**i32(["m_in", "l_in", "acc_in"], "*fp32"), "out_ptr": "*bf16",
                           **i32(["sob", "soh", "sog", "Hkv", "G", "D", "SP"], "i32")}, {"GP": 16, "DP": 128, "BLOCK_D": 32})
print(json.dumps(out))
'''


def test_the_kernels_compile_for_sm90_with_tensor_core_dots(compiled_without_interpreter):
    """The interpreter runs kernels as Python; this compiles both kernels for an H200 (sm_90) with Triton's
    own compiler, no GPU needed, in a process without TRITON_INTERPRET, for each mask kind and each loop
    (per-tile branch; bounded; bounded with the one-split direct write)."""
    import json

    out = compiled_without_interpreter(_COMPILE_SM90)
    result = json.loads(out)
    assert len(result) == 9 and all(result.values()), result


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
def test_one_split_written_directly_equals_the_combined_one_bit_for_bit(mask_kind):
    """``direct``: the partial kernel's own output equals what the combine kernel makes of its one partial."""
    q, k, v, mask = _case(3, 2, 4, 2 * BLOCK_S + 5, 32, torch.float32, mask_kind, seed=21)
    combined = decode_attention(q, k, v, mask, 0.2, 1, AttnConfig(direct=False))
    assert torch.equal(decode_attention(q, k, v, mask, 0.2, 1, AttnConfig(direct=True)), combined)


@pytest.mark.parametrize("D,G", [(128, 8), (32, 3), (16, 16)])
def test_the_combine_split_over_d_gives_the_same_bits(D, G):
    """``combine_block_d``: each combine program merges the splits for its D columns with the same arithmetic, so
    16 columns a program, 32 (the default) and all of D in one give identical outputs (and padding query rows,
    no longer read, change nothing)."""
    q, k, v, mask = _case(2, 2, G, 3 * BLOCK_S + 9, D, torch.float32, "bool", seed=4)
    outs = [decode_attention(q, k, v, mask, 0.3, 4, AttnConfig(direct=False, combine_block_d=bd)) for bd in (16, 32, 128)]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    torch.testing.assert_close(outs[0].float(), _sdpa(q, k, v, mask, 0.3), rtol=1e-5, atol=1e-5)
