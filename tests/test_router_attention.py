"""The fused router kernel (Triton, interpreted on CPU) and the grouped-query decode attention against
the transformers code they replace."""

import inspect

import pytest
import torch

from moe_offload.integrations.fused_norms import ROUTERS, gqa_decode_sdpa
from moe_offload.kernels.router import router_topk, router_topk_reference

# the kernel runs interpreted on CPU tensors in CI and compiled on CUDA ones where a GPU is present
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("T,E,K", [(1, 128, 8), (5, 512, 10), (3, 8, 2), (2, 100, 7)])
@pytest.mark.parametrize("renorm", [True, False])
def test_the_router_kernel_matches_the_reference(T, E, K, renorm):
    gen = torch.Generator().manual_seed(E + K)
    logits = (torch.randn(T, E, generator=gen) * 2).to(torch.bfloat16).to(DEV)
    w, ids = router_topk(logits, K, renorm, torch.float32)
    w_ref, ids_ref = router_topk_reference(logits, K, renorm, torch.float32)
    # bf16 logits tie often at 512 experts: torch's CPU top-k breaks ties its own way, the kernel takes the
    # lowest index (as CUDA's top-k selection does). So: the same top-k logit values, largest first, every
    # chosen logit >= every other one, and equal weights.
    for t in range(T):
        chosen = logits[t, ids[t]].float()
        assert torch.equal(chosen, logits[t, ids_ref[t]].float())
        assert torch.all(chosen[:-1] >= chosen[1:])
        others = torch.ones(E, dtype=torch.bool, device=DEV)
        others[ids[t]] = False
        assert others.sum() == E - K and (not others.any() or chosen.min() >= logits[t, others].float().max())
    torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=1e-5)
    assert ids.dtype == torch.int64 and w.dtype == torch.float32


def test_router_ties_pick_the_lowest_index_and_largest_first():
    logits = torch.tensor([[0.0, 3.0, 1.0, 3.0, 1.0, -1.0]], device=DEV)
    w, ids = router_topk(logits, 3, False, torch.float32)
    assert ids.tolist() == [[1, 3, 2]]
    assert w[0, 0] == w[0, 1] and w[0, 1] > w[0, 2]


def test_router_refuses_bad_arguments():
    with pytest.raises(ValueError, match="top-k"):
        router_topk(torch.randn(2, 4, device=DEV), 5, True, torch.float32)
    with pytest.raises(ValueError, match="floating"):
        router_topk(torch.ones(2, 4, dtype=torch.long, device=DEV), 2, True, torch.float32)


def test_every_listed_router_is_the_reference_arithmetic():
    """ROUTERS' flags say what each transformers router does: cast to the logits' dtype, renormalize."""
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for cls, cfg in ((Qwen3MoeTopKRouter, Qwen3MoeConfig(hidden_size=16, num_experts=12, num_experts_per_tok=3,
                                                          norm_topk_prob=True)),
                     (MixtralTopKRouter, MixtralConfig(hidden_size=16, num_local_experts=12, num_experts_per_tok=3))):
        m = cls(cfg).to(torch.bfloat16)
        with torch.no_grad():
            m.weight.copy_(torch.randn(12, 16))
        x = torch.randn(4, 16, dtype=torch.bfloat16)
        logits, w, ids = m(x)
        cast, always = ROUTERS[cls.__name__]
        renorm = always or m.norm_topk_prob
        w_ref, ids_ref = router_topk_reference(logits, 3, renorm, logits.dtype if cast else torch.float32)
        assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)


class _Attn(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups
        self._moe_offload_gqa_decode = True


@pytest.mark.parametrize("mask_kind", ["bool", "float", "none"])
@pytest.mark.parametrize("B,Hkv,G,P,D", [(1, 4, 8, 37, 16), (3, 2, 3, 9, 8)])
def test_gqa_decode_attention_matches_transformers_sdpa(mask_kind, B, Hkv, G, P, D):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(P)
    q = torch.randn(B, Hkv * G, 1, D, generator=gen)
    k, v = torch.randn(B, Hkv, P, D, generator=gen), torch.randn(B, Hkv, P, D, generator=gen)
    lens = torch.randint(1, P + 1, (B,), generator=gen)
    keep = torch.arange(P)[None, :] < lens[:, None]
    mask = {"bool": keep[:, None, None, :],
            "float": torch.where(keep, 0.0, torch.finfo(torch.float32).min)[:, None, None, :],
            "none": None}[mask_kind]
    module = _Attn(G)
    fn = gqa_decode_sdpa(sdpa_attention_forward)
    got, _ = fn(module, q, k, v, mask, scaling=D ** -0.5)
    want, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=D ** -0.5)
    assert got.shape == want.shape == (B, 1, Hkv * G, D)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # an unmarked module and a prefill-length query take transformers' own path
    calls = []
    spy = gqa_decode_sdpa(lambda *a, **kw: calls.append(1) or (None, None))
    spy(_Attn(G).__class__.__bases__[0](), q, k, v, mask)
    spy(module, torch.randn(B, Hkv * G, 2, D), k, v, None)
    assert calls == [1, 1]


def decode_logits(ref) -> torch.Tensor:
    """Logits of one greedy decode step of ``ref`` after a 17-token prompt (a fresh DynamicCache)."""
    from transformers import DynamicCache

    # transformers 5.24 renamed the forward's past_key_values to cache (5.25 warns on the old name)
    kv = "cache" if "cache" in inspect.signature(type(ref).forward).parameters else "past_key_values"
    ids = torch.arange(3, 20)[None]
    past = DynamicCache(config=ref.config)
    out = ref(ids, use_cache=True, **{kv: past})
    nxt = out.logits[:, -1:].argmax(-1)
    return ref(nxt, use_cache=True, **{kv: past}).logits


def test_a_model_with_gqa_decode_attention_gives_the_same_decode_logits(tiny_ckpt):
    from moe_offload.integrations.fused_norms import mark_gqa_decode
    from moe_offload.integrations.reference import build_reference_model

    ref = build_reference_model(tiny_ckpt("tiny-qwen3-moe", "bf16"), torch.float32, "cpu")
    want = decode_logits(ref)
    assert mark_gqa_decode(ref) == ref.config.num_hidden_layers
    torch.testing.assert_close(decode_logits(ref), want, atol=1e-5, rtol=1e-5)


def test_fused_qkv_gives_the_same_logits_and_parameter_bytes(tiny_ckpt):
    from moe_offload.integrations.fused_qkv import fuse_qkv
    from moe_offload.integrations.reference import build_reference_model

    path = tiny_ckpt("tiny-qwen3-moe", "bf16")
    ref = build_reference_model(path, torch.float32, "cpu")
    ids = torch.arange(3, 20)[None]
    want = ref(ids).logits
    nbytes = sum(p.numel() for p in ref.parameters())
    assert fuse_qkv(ref) == ref.config.num_hidden_layers
    assert sum(p.numel() for p in ref.parameters()) == nbytes  # the q/k/v views share the fused storage
    torch.testing.assert_close(ref(ids).logits, want, atol=1e-5, rtol=1e-5)
    attn = ref.model.layers[0].self_attn
    x = torch.randn(2, ref.config.hidden_size)
    # a projection called on its own input still computes its own slice
    torch.testing.assert_close(attn.k_proj(x), x @ attn.k_proj.weight.T)
    assert attn.k_proj.weight.data_ptr() != attn.q_proj.weight.data_ptr()
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn.k_proj.weight.untyped_storage().data_ptr()
