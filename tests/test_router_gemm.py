"""``kernels/router.py`` ``router_gemm_topk``: a router's logits (x @ weight.T), softmax, top-k and renormalisation in
one launch (``compute.router_gemm_max_tokens``; Triton, interpreted on CPU tensors in CI, compiled on CUDA ones)."""

import pytest
import torch
import torch.nn.functional as F

from moe_offload.kernels.router import (GEMM_BLOCK_T, router_counters, router_gemm_topk, router_topk,
                                        router_topk_reference)

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(T, E, H, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype).to(DEV)
    w = (torch.randn(E, H, generator=gen) / H ** 0.5).to(dtype).to(DEV)
    return x, w


@pytest.mark.parametrize("T,E,H,K", [(1, 128, 256, 8), (5, 100, 96, 7), (16, 16, 512, 2), (17, 64, 288, 4),
                                     (40, 512, 64, 10)])
@pytest.mark.parametrize("renorm", [True, False])
def test_the_logits_are_f_linears_and_the_top_k_is_router_topk_of_them(T, E, H, K, renorm):
    x, w = _inputs(T, E, H, torch.float32, seed=T * E + K)
    counters = router_counters(64, DEV)
    logits, w_TK, ids_TK = router_gemm_topk(x, w, K, renorm, torch.float32, counters)
    assert logits.shape == (T, E) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, F.linear(x, w), atol=1e-5, rtol=1e-5)
    want_w, want_ids = router_topk(logits, K, renorm, torch.float32)  # the same arithmetic on the same logits
    assert torch.equal(ids_TK, want_ids) and torch.equal(w_TK, want_w)
    ref_w, ref_ids = router_topk_reference(F.linear(x, w), K, renorm, torch.float32)
    assert torch.equal(ids_TK, ref_ids)  # random fp32 logits: no near ties
    torch.testing.assert_close(w_TK, ref_w, atol=1e-6, rtol=1e-5)
    assert not counters.any()  # every launch leaves its counters at 0 for the next one


def test_one_counter_buffer_serves_launch_after_launch_of_any_size():
    counters = router_counters(48, DEV)
    for i, T in enumerate([3, 48, 1, 33, 48]):
        x, w = _inputs(T, 32, 64, torch.float32, seed=i)
        logits, w_TK, ids_TK = router_gemm_topk(x, w, 4, True, torch.float16, counters)
        want_w, want_ids = router_topk(logits, 4, True, torch.float16)
        assert torch.equal(ids_TK, want_ids) and torch.equal(w_TK, want_w) and w_TK.dtype == torch.float16
    assert not counters.any() and counters.numel() == -(-48 // GEMM_BLOCK_T)


@pytest.mark.skipif(DEV == "cpu", reason="the Triton interpreter's bf16 x bf16 dot returns garbage (Triton 3.9); "
                    "the product runs this kernel on CUDA only (fused_norms.fuse_routers)")
def test_bf16_logits_are_f_linears_to_a_bf16_step():
    x, w = _inputs(9, 128, 2048, torch.bfloat16, seed=3)
    logits, w_TK, ids_TK = router_gemm_topk(x, w, 8, True, torch.bfloat16, router_counters(16, DEV))
    assert logits.dtype == torch.bfloat16
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(logits.float(), want, atol=0.02, rtol=0.01)  # rounding of the fp32 sums to bf16
    want_w, want_ids = router_topk(logits, 8, True, torch.bfloat16)
    assert torch.equal(ids_TK, want_ids) and torch.equal(w_TK, want_w)


def test_an_empty_batch_launches_nothing():
    x, w = _inputs(0, 8, 32, torch.float32)
    logits, w_TK, ids_TK = router_gemm_topk(x, w, 2, False, torch.float32, router_counters(16, DEV))
    assert logits.shape == (0, 8) and w_TK.shape == (0, 2) and ids_TK.shape == (0, 2)


@pytest.mark.parametrize("case,match", [
    ("hidden", r"x \[T, H\] and weight \[E, H\]"), ("dtype", "share one float dtype"),
    ("counters_small", r"router_counters of >= 40 tokens"), ("counters_dtype", "int32"),
    ("columns", "rows must be contiguous"), ("k", r"top-k=9 of E=8")])
def test_bad_arguments_are_refused_with_the_fix(case, match):
    x, w = _inputs(40, 8, 32, torch.float32)
    counters, k = router_counters(64, DEV), 2
    if case == "hidden":
        w = w[:, :16]
    elif case == "dtype":
        w = w.double()
    elif case == "counters_small":
        counters = router_counters(16, DEV)
    elif case == "counters_dtype":
        counters = counters.long()
    elif case == "columns":
        x = x.t().contiguous().t()
    elif case == "k":
        k = 9
    with pytest.raises(ValueError, match=match):
        router_gemm_topk(x, w, k, True, torch.float32, counters)


_COMPILE_SM90 = r'''
import json, re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from moe_offload.kernels.router import _router_gemm_topk_kernel as fn

names = fn.arg_names
sig = {n: "i32" for n in names}
sig.update({"x_ptr": "*bf16", "r_ptr": "*bf16", "logits_ptr": "*bf16", "w_ptr": "*bf16", "ids_ptr": "*i64",
            "cnt_ptr": "*i32"})
consts = {"RENORM": True, "EP": 128, "KP": 8, "BLOCK_T": 16, "BLOCK_E": 16, "BLOCK_H": 256, "INPUT_PRECISION": "tf32",
          "USE_PDL": False}
for k in consts:
    sig[k] = "constexpr"
src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]
print(json.dumps({"mma": "mma.sync" in ptx, "atom": bool(re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx)),
                  "volatile": "ld.volatile.global" in ptx}))
'''


def test_compiled_for_sm90_it_sums_on_tensor_cores_and_reads_other_programs_logits_past_l1(
        compiled_without_interpreter):
    """The real compiler (not the interpreter, which runs programs one after another): the sums are MMAs, the
    counter is an acq_rel atomic at GPU scope, and the top-k phase reads the logits with volatile loads."""
    import json

    got = json.loads(compiled_without_interpreter(_COMPILE_SM90))
    assert got == {"mma": True, "atom": True, "volatile": True}, got
