"""On CUDA: the decode step has no host sync, captures as one CUDA graph, replays bitwise-equal to eager,
and honours residency changes between replays; a host stack capturing its own step works too."""

import numpy as np
import pytest
import torch

from moe_offload.config import load_config
from moe_offload.decode_graph import StaticDecoder
from moe_offload.engine import Engine

pytestmark = pytest.mark.gpu


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda", "dtype=bfloat16",
                             "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


def _run(dec, prompt, steps):
    """Greedy static-cache decode of ``prompt`` (ids, or a batch of equal-length id lists): every step's logits."""
    logits = dec.prefill(torch.tensor(prompt if isinstance(prompt[0], list) else [prompt], device="cuda"))
    seen = [logits.clone()]
    for _ in range(steps):
        logits = dec.step(logits.argmax(-1))
        seen.append(logits.clone())
    return seen


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "bf16"])
def test_graph_replayed_decode_equals_eager_decode_bitwise_while_residency_changes(tiny_ckpt, fmt):
    path = tiny_ckpt("tiny-qwen3-moe", fmt)
    prompt = list(range(10, 42))
    eager = _run(StaticDecoder(_engine(path, "cache.budget=8 slots"), 1, 64, graphs=False), prompt, 10)
    # 8 of 64 experts: admissions evict between replays; the prefill unpadded and eager as the reference's
    # (tests/gpu/test_prefill_graph_gpu.py replays prefills)
    eng = _engine(path, "cache.budget=8 slots", "prefill.cuda_graphs=false")
    eng.cache.reset()
    graphed = _run(StaticDecoder(eng, 1, 64, graphs=True), prompt, 10)
    st = eng.cache.stats()
    assert st["compute"].get("decode_graph_captures") == 1 and st["declined"] == {}
    assert st["total"]["bytes"]["decode_h2d"] > 0 and st["total"]["evictions"] > 0  # residency changed
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"step {i} differs"  # same kernels, same bytes: bitwise
    torch.cuda.synchronize()
    assert np.array_equal(eng.cache.pool.table_LE.cpu().numpy(), eng.cache.pool.slot_of_LE)


@pytest.mark.parametrize("batch", [1, 4])
def test_the_router_s_top_k_and_the_miss_plan_in_one_launch_change_no_bit(tiny_ckpt, monkeypatch, batch):
    """``compute.fused_moe_launches`` on with ``compute.route_plan_max_pairs`` 128 (``OffloadedExperts.route``: top-k +
    plan, and at batch 4 the tile kernels' alignment, in one launch; the sums over K in the down launch) against off (``router_topk``, the plan, the alignment): the same logits at every step,
    bit for bit, eager and replayed, while admissions change the residency; the same counts."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompt = [list(range(10 + b, 42 + b)) for b in range(batch)]
    runs, counts = [], []
    for one_launch in (True, False):
        eng = _engine(path, "cache.budget=8 slots", "prefill.cuda_graphs=false",
                      f"compute.fused_moe_launches={str(one_launch).lower()}", "compute.route_plan_max_pairs=128",
                      "compute.moe_sum_in_down=true")
        calls = []
        real = eng.cache.decode_route
        monkeypatch.setattr(eng.cache, "decode_route", lambda *a, **k: calls.append(1) or real(*a, **k))
        eng.cache.reset()
        runs.append([_run(StaticDecoder(eng, batch, 64, graphs=g), prompt, 6) for g in (False, True)])
        counts.append(eng.cache.decode.counts())
        assert bool(calls) == one_launch
        monkeypatch.undo()
    for graphs in (0, 1):
        for i, (a, b) in enumerate(zip(runs[0][graphs], runs[1][graphs])):
            assert torch.equal(a, b), f"graphs={graphs} step {i} differs"
    assert counts[0] == counts[1]


def _eager_step_without_sync(eng, prompts):
    """Prefill ``prompts`` (equal-length id lists) on an eager static decoder, decode 3 warm steps (kernels compiled,
    admissions done), then run one more eager step (every layer, misses from host memory) under
    ``torch.cuda.set_sync_debug_mode("error")``: a host sync inside it raises."""
    dec = StaticDecoder(eng, len(prompts), 64, graphs=False)
    logits = dec.prefill(torch.tensor(prompts, device="cuda"))
    for _ in range(3):
        logits = dec.step(logits.argmax(-1))
    tok = logits.argmax(-1)
    eng.cache.step_boundary()
    eng.cache.step_boundary()  # nothing left for the step's own boundary to commit
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        dec.ids_B1.copy_(tok.view(len(prompts), 1))
        if dec._positions:
            dec.pos_1.fill_(dec.length)
            dec.pos_B1.fill_(dec.length)
        with torch.inference_mode():
            eng.model(**dec._step_kwargs())
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_a_steady_state_decode_step_makes_no_host_sync(tiny_ckpt):
    _eager_step_without_sync(_engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-ct"), "cache.budget=0.37"),
                             [list(range(5, 30))])


def test_a_host_stack_capturing_its_own_step_around_offloaded_experts_matches_eager(tiny_ckpt):
    """The embedding contract: the host owns the static KV cache and the graph; it calls
    cache.step_boundary() before and cache.decode_step_enqueued() after each replay."""
    from transformers import StaticCache

    path = tiny_ckpt("tiny-mixtral", "nvfp4-modelopt")
    prompt = torch.tensor([list(range(7, 27))], device="cuda")

    def steps(eng, graphed: bool):
        kv = StaticCache(config=eng.model.config, max_cache_len=48)
        dec = StaticDecoder(eng, 1, 48, graphs=False)  # only for its version-aware kwargs
        dec.kv = kv
        logits = dec.prefill(prompt)
        outs, graph, static_logits = [], None, None
        for i in range(6):
            dec.ids_B1.copy_(logits.argmax(-1).view(1, 1))
            if dec._positions:
                dec.pos_1.fill_(dec.length)
                dec.pos_B1.fill_(dec.length)
            dec.length += 1
            if graphed and i >= 1:
                if graph is None:
                    graph = torch.cuda.CUDAGraph()
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    with torch.inference_mode(), torch.cuda.graph(graph, stream=side):
                        static_logits = eng.model(**dec._step_kwargs()).logits[:, -1]
                    torch.cuda.current_stream().wait_stream(side)
                eng.cache.step_boundary()
                graph.replay()
                eng.cache.decode_step_enqueued()
                logits = static_logits.clone()
            else:
                with torch.inference_mode():
                    logits = eng.model(**dec._step_kwargs()).logits[:, -1]
            outs.append(logits.clone())
        return outs

    eager = steps(_engine(path, "cache.budget=0.5"), graphed=False)
    graphed = steps(_engine(path, "cache.budget=0.5"), graphed=True)
    for a, b in zip(eager, graphed):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "nvfp4-ct", "bf16"])
def test_graph_decode_logits_match_the_oracle_at_every_step(tiny_ckpt, preset, fmt):
    """The decode path (UVA misses, in-place slot reads, the decode kernel, graphs) against plain
    transformers on the same dequantized weights, fp32, one step at a time."""
    from moe_offload.integrations.reference import build_reference_model

    path = tiny_ckpt(preset, fmt)
    eng = _engine(path, "cache.budget=0.25", "dtype=float32")
    ref = build_reference_model(path, torch.float32, "cpu")
    prompt = list(range(20, 44))
    dec = StaticDecoder(eng, 1, 64, graphs=True)
    logits = dec.prefill(torch.tensor([prompt], device="cuda"))
    seq = list(prompt)
    for step in range(6):
        tok = int(logits.argmax(-1))
        seq.append(tok)
        logits = dec.step(torch.tensor([tok], device="cuda"))
        with torch.no_grad():
            want = ref(torch.tensor([seq])).logits[0, -1]
        # fp32 both sides; kernel and cuBLAS summation orders differ: 1e-3 is ~100x that noise and far
        # below what a wrong expert or a stale slot gives (> 1e-2)
        torch.testing.assert_close(logits[0].cpu(), want, atol=1e-3, rtol=0, msg=f"step {step}")


def test_decode_path_auto_runs_batches_above_its_threshold_eagerly_staged_with_a_count_and_the_same_tokens(tiny_ckpt):
    """decode.path auto with the threshold at 2: a 4-row generate declines the graph (counted as
    decode_graph:batch_staged), stages every step, and its greedy tokens equal the routed, graph-replayed
    engine's within bf16 ties (the compute differs: grouped GEMMs vs the fused decode kernels); a one-row
    generate still replays a graph."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    common = ("cache.budget=0.37", "decode.max_tokens=8", "prefill.routed_max_tokens=2")
    routed, auto = _engine(path, *common), _engine(path, *common, "decode.path=auto")
    prompts = [list(range(10 + 7 * b, 42 + 7 * b)) for b in range(4)]
    want = [r.token_ids for r in routed.generate_batch(prompts, 8)]
    auto.cache.reset()
    got = [r.token_ids for r in auto.generate_batch(prompts, 8)]
    st = auto.cache.stats()
    assert st["declined"].get("decode_graph:batch_staged") == 1 and st["decode_steps"] == 0
    assert sum(a == b for a, b in zip(got, want)) >= 3, (got, want)  # at most one stream flips at a tie
    auto.generate(prompts[0], 4)
    assert auto.cache.stats()["compute"].get("decode_graph_replays", 0) > 0


@pytest.mark.parametrize("kernel", ["gemv", "tiles"])
@pytest.mark.parametrize("batch", [1, 4])
def test_programmatic_dependent_launch_changes_no_bit(tiny_ckpt, monkeypatch, kernel, batch):
    """``compute.pdl_max_tokens`` (kernels/pdl.py) 64 against 0: every decode-path Triton launch carries the PDL
    switch when on and none when off; the same logits at every step, bit for bit, eager and replayed, while
    admissions change the residency. A kernel that touched memory before its wait would race its predecessor: at 8
    of 64 experts resident, every step's miss copy writes the rows the next launches read."""
    from moe_offload.kernels import pdl

    if pdl.unsupported(torch.device("cuda")):
        pytest.skip(pdl.unsupported(torch.device("cuda")))
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompt = [list(range(10 + b, 42 + b)) for b in range(batch)]
    runs, counts = [], []
    for on in (True, False):
        eng = _engine(path, "cache.budget=8 slots", "prefill.cuda_graphs=false", f"compute.decode_kernel={kernel}",
                      f"compute.pdl_max_tokens={64 if on else 0}")
        assert eng.pdl is on
        launches = []
        real = pdl.launch_kwargs
        monkeypatch.setattr(pdl, "launch_kwargs", lambda: launches.append(bool(r := real())) or r)
        eng.cache.reset()
        runs.append([_run(StaticDecoder(eng, batch, 64, graphs=g), prompt, 6) for g in (False, True)])
        st = eng.cache.stats()
        assert st["declined"] == {} and st["compute"].get("decode_graph_captures") == 1
        counts.append(eng.cache.decode.counts())
        assert launches and any(launches) == on  # the prefill's launches run without it either way
        monkeypatch.undo()
    for graphs in (0, 1):
        for i, (a, b) in enumerate(zip(runs[0][graphs], runs[1][graphs])):
            assert torch.equal(a, b), f"graphs={graphs} step {i} differs"
    assert counts[0] == counts[1]
