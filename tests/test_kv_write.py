"""The one-launch KV-cache write (kernels/kv_write.py): the kernel (Triton interpreter on CPU tensors, compiled
on a GPU) against its torch reference, and the reference against plain indexing, over awkward shapes.

Legend: R cache rows, B rows written, H heads, T new tokens, P positions, DK / DV head dims.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from moe_offload.kernels.kv_write import kv_write, kv_write_reference, launch  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(R, B, H, T, P, DK, DV, start, transposed, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(R, H, P, DK, generator=gen).to(dtype)
    values = torch.randn(R, H, P, DV, generator=gen).to(dtype)
    if transposed:  # what attention layers hand over: [B, T, H, D] transposed to [B, H, T, D]
        k = torch.randn(B, T, H, DK, generator=gen).to(dtype).transpose(1, 2)
        v = torch.randn(B, T, H, DV, generator=gen).to(dtype).transpose(1, 2)
    else:
        k = torch.randn(B, H, T, DK, generator=gen).to(dtype)
        v = torch.randn(B, H, T, DV, generator=gen).to(dtype)
    start_B = torch.as_tensor(start, dtype=torch.int64)
    start_B = start_B.expand(B) if start_B.dim() == 0 else start_B
    return [x.to(DEV) for x in (keys, values, k, v, start_B)]


def _by_hand(keys, values, k, v, start_B):
    keys, values = keys.clone(), values.clone()
    B, _, T, _ = k.shape
    for b in range(B):
        for t in range(T):
            p = int(start_B[b]) + t
            if 0 <= p < keys.shape[2]:
                keys[b, :, p], values[b, :, p] = k[b, :, t], v[b, :, t]
    return keys, values


CASES = {
    "decode step, one shared start": dict(R=1, B=1, H=4, T=1, P=40, DK=128, DV=128, start=17, transposed=True),
    "serving rows, a position each": dict(R=6, B=4, H=2, T=1, P=33, DK=64, DV=64, start=[0, 31, 5, 32], transposed=True),
    "prefill chunk from a shared start": dict(R=2, B=2, H=3, T=7, P=20, DK=16, DV=16, start=4, transposed=True),
    "odd head dims, values wider than keys": dict(R=3, B=3, H=1, T=2, P=9, DK=24, DV=40, start=[1, 6, 0], transposed=False),
    "positions past the end are dropped": dict(R=2, B=2, H=2, T=5, P=8, DK=16, DV=16, start=[6, -1], transposed=True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_reference_writes_exactly_the_rows_plain_indexing_writes(name):
    keys, values, k, v, start = _case(**CASES[name])
    want_k, want_v = _by_hand(keys, values, k, v, start)
    kv_write_reference(keys, values, k, v, start)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)  # copies: bitwise


@pytest.mark.parametrize("name", list(CASES))
def test_the_kernel_writes_the_same_bits_as_the_reference(name):
    keys, values, k, v, start = _case(**CASES[name])
    want_k, want_v = keys.clone(), values.clone()
    kv_write_reference(want_k, want_v, k, v, start)
    launch(keys, values, k, v, start)
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)  # copies: bitwise, rows past B untouched


def test_fp32_and_int32_starts_are_written_as_well():
    keys, values, k, v, start = _case(R=2, B=2, H=2, T=3, P=10, DK=8, DV=8, start=[2, 7], transposed=True,
                                      dtype=torch.float32)
    want_k, want_v = _by_hand(keys, values, k, v, start)
    launch(keys, values, k, v, start.to(torch.int32))
    assert torch.equal(keys, want_k) and torch.equal(values, want_v)


@pytest.mark.parametrize("bad, match", [
    (dict(k=torch.zeros(1, 3, 1, 8)), "do not fit a cache"),  # heads differ
    (dict(k=torch.zeros(3, 2, 1, 8)), "do not fit a cache"),  # more rows than the cache
    (dict(v=torch.zeros(1, 2, 1, 4)), "new values"),
    (dict(k=torch.zeros(1, 2, 1, 8, dtype=torch.float16)), "dtypes differ"),
    (dict(start=torch.zeros(2, dtype=torch.int64)), r"\[B=1\]"),
    (dict(start=torch.zeros(1)), "int32/int64"),
    (dict(start=torch.zeros(1, dtype=torch.int64, device="meta")), "one device"),
])
def test_mismatched_inputs_are_refused_with_what_differs(bad, match):
    args = dict(keys=torch.zeros(2, 2, 5, 8), values=torch.zeros(2, 2, 5, 8), k=torch.zeros(1, 2, 1, 8),
                v=torch.zeros(1, 2, 1, 8), start=torch.zeros(1, dtype=torch.int64))
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        kv_write(args["keys"], args["values"], args["k"], args["v"], args["start"])


_COMPILE_SM90 = r'''
import triton
from triton.compiler import ASTSource
from triton.backends.compiler import GPUTarget
from moe_offload.kernels import kv_write as kw

fn = kw._kv_write_kernel
names = fn.arg_names
sig = {n: "i32" for n in names}
sig.update({"k_ptr": "*bf16", "v_ptr": "*bf16", "kc_ptr": "*bf16", "vc_ptr": "*bf16", "start_ptr": "*i64"})
consts = {"DK": 128, "DV": 128, "BLOCK_K": 128, "BLOCK_V": 128}
for c in consts:
    sig[c] = "constexpr"
src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in consts.items()})
ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1}).asm["ptx"]
print("st.global" in ptx)
'''


def test_the_kernel_compiles_for_sm90(compiled_without_interpreter):
    """The interpreter runs the kernel as Python; this compiles it for an H200 (sm_90) with Triton's own
    compiler, no GPU needed, in a process without TRITON_INTERPRET."""
    out = compiled_without_interpreter(_COMPILE_SM90)
    assert out == "True"
