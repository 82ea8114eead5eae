"""CUDA graphs of the prefill expert compute (moe_offload/graphs.py), on the GPU."""

import io
import json

import pytest
import torch

from moe_offload import log
from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.experts import OffloadedExperts

pytestmark = pytest.mark.gpu


def _graphed(eng):
    return next(m for m in eng.model.modules() if isinstance(m, OffloadedExperts)).prefill_compute


def _engine(path, *extra):
    # prefill graphs are the staged path's: keep every forward above decode.max_tokens on it (auto would
    # route the 40-token prompts of the tiny model through the decode path)
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda", "dtype=bfloat16",
                             "logging.level=WARNING", "prefill.routed_max_tokens=0", *extra])
    return Engine.from_config(cfg, progress=False)


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "bf16"])
@pytest.mark.parametrize("budget", ["0.37", "1.0"])
def test_graph_replays_equal_the_eager_compute_bit_for_bit(tiny_ckpt, fmt, budget):
    path = tiny_ckpt("tiny-qwen3-moe", fmt)
    graphed = _engine(path, f"cache.budget={budget}")
    eager = _engine(path, f"cache.budget={budget}", "compute.cuda_graphs=false")
    graphed.cache.reset()
    for T in (40, 300, 40, 300, 300):  # each length is captured on its 2nd call, then replayed
        ids = torch.randint(3, 300, (1, T), generator=torch.Generator().manual_seed(T))
        got, _ = graphed.prefill(ids)
        want, _ = eager.prefill(ids)
        assert torch.equal(got, want), f"T={T}"
    compute = graphed.cache.stats()["compute"]
    assert compute["graph_captures"] >= 2 and compute["graph_replays"] > compute["graph_captures"]
    assert not graphed.cache.stats()["declined"]


def test_a_capture_that_fails_falls_back_to_eager_with_one_event_and_a_count(tiny_ckpt, monkeypatch):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    eng = _engine(path, "cache.budget=1.0")
    want, _ = _engine(path, "cache.budget=1.0", "compute.cuda_graphs=false").prefill(torch.arange(3, 203)[None])
    graphed = _graphed(eng)
    inner = graphed.inner

    def syncing(*args):  # a host sync: illegal while capturing
        out = inner(*args)
        out.sum().item()
        return out

    monkeypatch.setattr(graphed, "inner", syncing)
    buf = io.StringIO()
    log.configure(level="WARNING", fmt="json", stream=buf)
    eng.cache.reset()
    got, _ = eng.prefill(torch.arange(3, 203)[None])
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    events = [json.loads(x) for x in buf.getvalue().splitlines()]
    declined = [e for e in events if e["event"] == "cuda_graph_declined"]
    assert len(declined) == 1 and declined[0]["reason"] == "capture_failed"
    assert eng.cache.stats()["declined"].get("cuda_graph:capture_failed", 0) >= 1
    got2, _ = eng.prefill(torch.arange(3, 203)[None])  # eager for the rest of the process
    torch.testing.assert_close(got2, want, atol=0, rtol=0)


def test_a_call_on_another_stream_runs_eagerly_and_is_counted(tiny_ckpt):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    eng = _engine(path, "cache.budget=1.0")
    ids = torch.arange(3, 103)[None]
    want, _ = eng.prefill(ids)
    eng.prefill(ids)  # captured by now
    eng.cache.reset()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got, _ = eng.prefill(ids)
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert eng.cache.stats()["declined"].get("cuda_graph:other_stream", 0) >= 1


def test_lru_keeps_at_most_max_graphs_and_stays_correct(tiny_ckpt):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    eng = _engine(path, "cache.budget=1.0", "compute.max_graphs=1", "compute.graph_after=1")
    ref = _engine(path, "cache.budget=1.0", "compute.cuda_graphs=false")
    for T in (50, 60, 50, 70, 60):
        ids = torch.randint(3, 300, (1, T), generator=torch.Generator().manual_seed(T))
        assert torch.equal(eng.prefill(ids)[0], ref.prefill(ids)[0]), f"T={T}"
    assert len(_graphed(eng)._graphs) <= 1


def test_fp32_on_cuda_declines_graphs_once_and_counts_it(tiny_ckpt):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    eng = Engine.from_config(load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda",
                                                "dtype=float32", "logging.level=WARNING"]), progress=False)
    eng.cache.reset()
    eng.prefill(torch.arange(3, 103)[None])
    assert eng.cache.stats()["declined"].get("cuda_graph:compute_syncs", 0) >= 1


def test_auto_compute_counts_every_replayed_call_under_the_path_it_took(tiny_ckpt, monkeypatch):
    # compute.backend auto inside prefill graphs: a replay never calls the inner compute, so GraphedCompute hands
    # each replay to its account(); eager calls count themselves, captures count nothing
    from moe_offload.compute.auto import AutoNvfp4Compute

    monkeypatch.setattr(AutoNvfp4Compute, "pick", lambda self, dev, T, K, H, I: "fused" if T <= 64 else "dequant")
    eng = _engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "cache.budget=1.0", "compute.backend=auto")
    assert isinstance(_graphed(eng).inner, AutoNvfp4Compute)
    eng.cache.reset()
    layers = sum(isinstance(m, OffloadedExperts) for m in eng.model.modules())
    for T in (40, 40, 40, 300, 300, 300):  # each length: eager, then capture + replay, then replay
        eng.prefill(torch.randint(3, 300, (1, T), generator=torch.Generator().manual_seed(T)))
    compute = eng.cache.stats()["compute"]
    assert compute["prefill_fused_calls"] == 3 * layers and compute["prefill_dequant_calls"] == 3 * layers
