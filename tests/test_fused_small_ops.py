"""The fused RMSNorm kernel (Triton, interpreted on CPU) against the transformers modules it replaces."""

import pytest
import torch

from moe_offload.integrations.fused_norms import FLAVOURS, fuse_rms_norms
from moe_offload.kernels.rmsnorm import rms_norm, rms_norm_reference


def _modules():
    from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    return [Qwen3MoeRMSNorm(48, eps=1e-6), MixtralRMSNorm(48, eps=1e-5), Qwen3NextRMSNorm(48, eps=1e-6)]


@pytest.mark.parametrize("shape", [(1, 48), (3, 5, 48), (7, 48)])
def test_the_reference_is_each_listed_modules_own_arithmetic(shape):
    gen = torch.Generator().manual_seed(0)
    for m in _modules():
        with torch.no_grad():
            m.weight.copy_(torch.randn(48, generator=gen))
        x = torch.randn(shape, generator=gen)
        want = m(x)
        got = rms_norm_reference(x, m.weight, m.variance_epsilon if hasattr(m, "variance_epsilon") else m.eps,
                                 FLAVOURS[type(m).__name__])
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("H", [1, 48, 100])
@pytest.mark.parametrize("scale", ["weight", "one_plus_weight"])
def test_the_kernel_matches_the_reference_over_awkward_shapes(H, scale):
    gen = torch.Generator().manual_seed(H)
    x = torch.randn(3, 2, H, generator=gen) * 3
    w = torch.randn(H, generator=gen)
    # fp32 in and out: only the order of the fp32 sum differs (a few ulp)
    torch.testing.assert_close(rms_norm(x, w, 1e-6, scale), rms_norm_reference(x, w, 1e-6, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", ["weight", "one_plus_weight"])
def test_the_heads_of_a_fused_qkv_slice_are_normalized_in_place(scale):
    """q and k as attention passes them from the fused q/k/v GEMM (integrations/fused_qkv.py): a column slice
    of ``[B, T, Q + 2 KV]`` viewed as ``[B, T, heads, D]``. The kernel reads the rows through their strides (no
    copy of the slice) and equals the reference on a contiguous copy."""
    from moe_offload.kernels.rmsnorm import _rows_view

    gen = torch.Generator().manual_seed(1)
    B, T, Hq, Hk, D = 2, 3, 4, 2, 16
    y = torch.randn(B, T, (Hq + 2 * Hk) * D, generator=gen)
    w = torch.randn(D, generator=gen)
    for lo, heads in ((0, Hq), (Hq * D, Hk)):
        x = y[..., lo:lo + heads * D].view(B, T, heads, D)
        assert not x.is_contiguous() and _rows_view(x, heads, D) is not None
        got = rms_norm(x, w, 1e-6, scale)
        assert got.shape == x.shape and got.is_contiguous()
        torch.testing.assert_close(got, rms_norm_reference(x.contiguous(), w, 1e-6, scale), atol=1e-5, rtol=1e-5)
    # a transposed view merges no leading dims: copied first, same result
    xt = y[..., :Hq * D].view(B, T, Hq, D).transpose(0, 1)
    assert _rows_view(xt, Hq, D) is None
    torch.testing.assert_close(rms_norm(xt, w, 1e-6, scale), rms_norm_reference(xt.contiguous(), w, 1e-6, scale),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("shape", [(48,), (2, 0, 48), (0, 48), (3, 0), (2, 1, 1)])
def test_edge_shapes_of_the_norm(shape):
    x = torch.randn(shape)
    w = torch.randn(shape[-1])
    got = rms_norm(x, w, 1e-6)
    assert got.shape == x.shape
    torch.testing.assert_close(got, rms_norm_reference(x, w, 1e-6), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("Hq,Hk", [(0, 2), (3, 0)])
def test_the_one_launch_rotary_with_no_q_or_no_k_heads(Hq, Hk):
    from moe_offload.kernels.rotary import apply_rotary, apply_rotary_reference

    gen = torch.Generator().manual_seed(Hq)
    q, k = torch.randn(2, Hq, 3, 8, generator=gen), torch.randn(2, Hk, 3, 8, generator=gen)
    ang = torch.randn(2, 3, 8, generator=gen)
    for got, want in zip(apply_rotary(q, k, ang.cos(), ang.sin()), apply_rotary_reference(q, k, ang.cos(), ang.sin())):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


def test_a_model_with_fused_norms_gives_the_same_logits(tiny_ckpt):
    from moe_offload.integrations.reference import build_reference_model

    path = tiny_ckpt("tiny-qwen3-moe", "bf16")
    ref = build_reference_model(path, torch.float32, "cpu")
    ids = torch.arange(3, 20)[None]
    want = ref(ids).logits
    assert fuse_rms_norms(ref) == 4 * 4 + 1  # 4 layers x (input, post-attention, q, k) + the final norm
    torch.testing.assert_close(ref(ids).logits, want, atol=1e-4, rtol=0)  # fp32 sum order only


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm(torch.randn(2, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="scale="):
        rms_norm(torch.randn(2, 8), torch.randn(8), 1e-6, "nope")


@pytest.mark.parametrize("B,Hq,Hk,T,D", [(1, 4, 2, 1, 16), (2, 3, 1, 5, 8), (1, 2, 2, 3, 6)])
def test_the_rotary_kernel_matches_transformers_arithmetic(B, Hq, Hk, T, D):
    from moe_offload.kernels.rotary import apply_rotary, apply_rotary_reference

    gen = torch.Generator().manual_seed(D)
    q = torch.randn(B, T, Hq, D, generator=gen).transpose(1, 2)  # the strided layout attention passes
    k = torch.randn(B, T, Hk, D, generator=gen).transpose(1, 2)
    ang = torch.randn(B, T, D, generator=gen)
    cos, sin = ang.cos(), ang.sin()
    want_q, want_k = apply_rotary_reference(q, k, cos, sin)
    # interpreted kernel on CPU tensors (the CUDA wrapper adds only the device guard); fp32 products
    # and sum: the same roundings as torch's elementwise ops
    got_q, got_k = apply_rotary(q, k, cos, sin)  # one launch for both
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=1e-6)
    assert got_q.is_contiguous() and got_k.is_contiguous()


_COMPILE_SM90 = r'''
import json
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from moe_offload.kernels import qk_norm_rope, rmsnorm, rotary

def build(fn, sig, consts, options):
    names = fn.arg_names
    src = ASTSource(fn=fn, signature={n: sig.get(n, "constexpr") for n in names},
                    constexprs={(names.index(k),): v for k, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]

i32 = dict.fromkeys
out = {}
for one_plus in (False, True):
    ptx = build(rmsnorm._rms_norm_kernel, {"x_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "eps": "fp32",
                                           **i32(["H", "x_stride", "inner_n", "inner_stride", "out_stride"], "i32")},
                {"ONE_PLUS": one_plus, "BLOCK": 128}, {"num_warps": 4, **rmsnorm.LAUNCH_OPTIONS})
    out[f"rms_norm_{one_plus}"] = "st.global" in ptx and "fma.rn" not in ptx
ptx = build(rotary._rotary_kernel, {**i32(["q_ptr", "k_ptr", "cos_ptr", "sin_ptr", "qo_ptr", "ko_ptr"], "*bf16"),
                                    **i32(["Hq", "Hk", "T", "sqb", "sqh", "sqt", "skb", "skh", "skt", "scb", "sct"],
                                          "i32")}, {"HALF": 64, "BLOCK": 64}, rotary.LAUNCH_OPTIONS)
out["rotary"] = "st.global" in ptx
# with FP fusion on, the first rounded product and the sum became one fma.rn.bf16 (one rounding fewer than the
# module: last-bit differences on the H200); the launch's options must keep every product rounded
out["rotary_no_fma"] = "fma.rn" not in ptx
# the q/k norms + rotary + KV write kernel at Qwen3-30B-A3B's head dim, with the launch's options
ptx = build(qk_norm_rope._qk_norm_rope_kernel,
            {**i32(["y_ptr", "qw_ptr", "kw_ptr", "cos_ptr", "sin_ptr", "q_ptr", "kc_ptr", "vc_ptr"], "*bf16"),
             "start_ptr": "*i64", "eps": "fp32",
             **i32(["syb", "syt", "scb", "sct", "skb", "skh", "skp", "svb", "svh", "svp", "stride_start", "P", "Hq",
                    "Hk", "T", "Dr"], "i32")},
            {"D": 128, "BLOCK": 128, "HALF_BLOCK": 64}, {"num_warps": rmsnorm.num_warps(128), **rmsnorm.LAUNCH_OPTIONS})
out["qk_norm_rope"] = "st.global" in ptx and "fma.rn" not in ptx
print(json.dumps(out))
'''


def test_the_kernels_compile_for_sm90(compiled_without_interpreter):
    """The interpreter runs kernels as Python and accepts code the compiler refuses: the RMSNorm (strided rows)
    and the one-launch rotary kernels compiled for an H200 (sm_90) by Triton's own compiler, no GPU needed."""
    import json

    result = json.loads(compiled_without_interpreter(_COMPILE_SM90))
    assert result == {"rms_norm_False": True, "rms_norm_True": True, "rotary": True, "rotary_no_fma": True,
                      "qk_norm_rope": True}
