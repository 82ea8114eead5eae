"""On CUDA: ``compute.router_gemm_max_tokens`` (kernels/router.py ``router_gemm_topk``): the routers' logits, softmax
and top-k in one launch, at Qwen3-30B-A3B's router shape and inside captured decode steps."""

import pytest
import torch
import torch.nn.functional as F

from moe_offload.config import load_config
from moe_offload.decode_graph import StaticDecoder
from moe_offload.engine import Engine
from moe_offload.kernels.router import router_counters, router_gemm_topk, router_topk

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("T", [1, 4, 16, 64])
def test_at_the_qwen3_router_shape_the_logits_are_f_linears_to_a_bf16_step_and_the_top_k_theirs(T):
    gen = torch.Generator(device="cuda").manual_seed(T)
    x = torch.randn(T, 2048, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(128, 2048, device="cuda", generator=gen) / 45).bfloat16()
    counters = router_counters(64, "cuda")
    for _ in range(3):  # launch after launch on one counter buffer
        logits, w_TK, ids_TK = router_gemm_topk(x, w, 8, True, torch.bfloat16, counters)
        torch.testing.assert_close(logits.float(), F.linear(x, w).float(), atol=0.02, rtol=0.01)
        want_w, want_ids = router_topk(logits, 8, True, torch.bfloat16)
        assert torch.equal(ids_TK, want_ids) and torch.equal(w_TK, want_w)
    assert not counters.any()


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda", "dtype=bfloat16",
                             "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


@pytest.mark.parametrize("budget", ["1.0", "0.37"])
def test_decode_steps_with_the_router_launch_capture_and_give_the_tokens_without_it(tiny_ckpt, budget):
    """Greedy decode on the tiny model, eager then captured and replayed: the same tokens with and without it (the
    logits may differ in a last bit), and no capture declined."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    runs = []
    for gemm in (64, 0):
        eng = _engine(path, f"cache.budget={budget}", "cache.admit_per_step=0",
                      f"compute.router_gemm_max_tokens={gemm}")
        dec = StaticDecoder(eng, 2, 128, graphs=True)
        logits = dec.prefill(torch.tensor([list(range(9, 21)), list(range(30, 42))], device="cuda"))
        toks = []
        for _ in range(6):
            tok = logits.argmax(-1)
            toks.append(tok.tolist())
            logits = dec.step(tok)
        st = eng.cache.stats()
        assert st["compute"].get("decode_graph_replays", 0) >= 3 and not st["declined"], st["declined"]
        runs.append(toks)
    assert runs[0] == runs[1]
