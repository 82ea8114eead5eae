"""The TMA miss copy (kernels/miss_copy_tma.py, ``decode.miss_copy: tma``) against the plain-torch reference.

Legend: T tokens, K top-k, E experts, B bytes per row, S resident slots. Without CUDA the kernel runs in the Triton
interpreter (tensor descriptors included) on CPU tensors; the mapped-memory case on a GPU is in
tests/gpu/test_miss_copy_tma_gpu.py; its decline off CUDA with the copy engine's in tests/test_graph_copy.py.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from moe_offload.kernels import miss_copy_tma  # noqa: E402
from moe_offload.kernels.decode_miss import MissCopyConfig, serve_misses, serve_misses_reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
POISON = 0xA5


def setup(T, K, E, B, resident, seed=0):
    """Random host rows, a pool of S slots + min(T*K, E) scratch rows of POISON, the resident experts in slots, and
    distinct random ids per token."""
    gen = torch.Generator().manual_seed(seed)
    host_ER = torch.randint(0, 256, (E, B), dtype=torch.uint8, generator=gen)
    S = max(len(resident), 1)
    pool_NR = torch.full((S + min(T * K, E), B), POISON, dtype=torch.uint8)
    slot_of_E = torch.full((E,), -1, dtype=torch.int32)
    for s, e in enumerate(resident):
        slot_of_E[e] = s
        pool_NR[s] = host_ER[e]
    ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    return slot_of_E.to(DEVICE), ids.to(DEVICE), host_ER.to(DEVICE), pool_NR.to(DEVICE), S


CASES = {  # T, K, E, B, resident experts
    "whole-lines": (2, 3, 6, 2048, [1]),
    "a-tail-of-4-words": (2, 3, 6, 3 * 1024 + 16, [0, 5]),
    "a-tail-of-128-words-and-a-part-box": (3, 2, 7, 5 * 1024 + 512, [2]),
    "one-line": (1, 4, 8, 1024, []),
}


@pytest.mark.parametrize("chunk_bytes", [1024, 4096, 16384])
@pytest.mark.parametrize("case", CASES.keys())
def test_the_tma_copy_writes_what_the_reference_writes_and_nothing_else(case, chunk_bytes):
    slot_of_E, ids, host_ER, pool_NR, S = setup(*CASES[case])
    ref_pool = pool_NR.clone()
    want = serve_misses_reference(slot_of_E, ids, host_ER, ref_pool, S)
    got = serve_misses(slot_of_E, ids, host_ER, pool_NR, S, MissCopyConfig(chunk_bytes=chunk_bytes, ctas_per_sm=2,
                                                                           reader="tma"))
    assert torch.equal(got, want)
    assert torch.equal(pool_NR, ref_pool)  # the scratch rows hold the host rows; the slots and the rest untouched


def test_the_start_up_check_passes_on_good_rows_and_names_wrong_bytes(monkeypatch):
    _, _, host_ER, pool_NR, S = setup(*CASES["a-tail-of-4-words"])
    assert miss_copy_tma.check(host_ER, pool_NR, S, 16, 2, 4) is None
    assert torch.equal(pool_NR[S:S + 2].cpu(), host_ER[:2].cpu())
    real = miss_copy_tma.copy_misses_tma

    def corrupting(ids, count, host, pool, base, *args):  # fault injection: the copy, then one flipped byte
        real(ids, count, host, pool, base, *args)
        pool[base + 1, 1030] ^= 1

    monkeypatch.setattr(miss_copy_tma, "copy_misses_tma", corrupting)
    assert miss_copy_tma.check(host_ER, pool_NR, S, 16, 2, 4) == "wrong bytes: expert 1, byte 1030"


@pytest.mark.parametrize("B, why", [(1000, "16-byte aligned"), (512, "at least 1024")])
def test_rows_it_cannot_take_are_named_and_refused(B, why):
    slot_of_E, ids, host_ER, pool_NR, S = setup(1, 2, 4, B, [])
    assert why in miss_copy_tma.unsupported(host_ER, pool_NR)
    assert why in miss_copy_tma.check(host_ER, pool_NR, S, 16, 1, 4)
    with pytest.raises(ValueError, match="use decode.miss_copy=uva"):
        serve_misses(slot_of_E, ids, host_ER, pool_NR, S, MissCopyConfig(reader="tma"))


def test_an_unknown_reader_is_refused():
    with pytest.raises(ValueError, match="ldg or tma"):
        MissCopyConfig(reader="cp.async")


def test_boxes_past_the_shared_memory_of_an_sm_are_refused():
    slot_of_E, ids, host_ER, pool_NR, S = setup(*CASES["whole-lines"])
    with pytest.raises(ValueError, match="a power of two in 1..64"):
        miss_copy_tma.copy_misses_tma(ids.flatten().to(torch.int32), torch.tensor([1], dtype=torch.int32), host_ER,
                                      pool_NR, S, 128, 1, 4)


def test_a_failed_check_that_broke_the_cuda_context_raises_with_the_fix(monkeypatch):
    def sticky(device=None):  # fault injection: the context an illegal address leaves behind
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "synchronize", sticky)
    with pytest.raises(RuntimeError, match="left the CUDA context unusable .*set decode.miss_copy=uva"):
        miss_copy_tma._context_usable(torch.device("cuda", 0), ValueError("launch failed"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    miss_copy_tma._context_usable(torch.device("cuda", 0), ValueError("a compile error"))  # usable: the caller declines
