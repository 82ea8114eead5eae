"""On CUDA: the serving decode batch over the static KV rows (serve/static_batch.py) replays one CUDA graph per
(rows, positions) bucket; requests of different lengths join and leave, residency changes between
replays, and every step's logits equal the eager steps' bitwise."""

import numpy as np
import pytest
import torch

from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.serve.config import ServeConfig
from moe_offload.serve.executor import LocalExecutor
from moe_offload.serve.sampling import SamplingParams
from moe_offload.serve.scheduler import Scheduler
from moe_offload.serve.static_batch import CudaGraphs, StaticBatch

pytestmark = pytest.mark.gpu

ROWS, MAX_LEN = 4, 96
# request -> (prompt, step it joins at, decode steps): rows join at different steps, b and c leave early,
# d joins a freed row; c's positions cross from the 32- into the 64-column bucket
SCHEDULE = {
    "a": (list(range(10, 31)), 0, 16),
    "b": (list(range(40, 45)), 0, 4),
    "c": (list(range(50, 80)), 2, 9),
    "d": (list(range(90, 93)), 7, 10),
}


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda", "dtype=bfloat16",
                             "logging.level=WARNING", "decode.max_tokens=8", *extra])
    return Engine.from_config(cfg, progress=False)


def _drive(ex: LocalExecutor) -> tuple[list[torch.Tensor], dict[str, list[int]]]:
    """The scheduler's op sequence for SCHEDULE, greedy -> (every step's logits, ids per request)."""
    outs: dict[str, list[int]] = {}
    running: list[str] = []
    seen = []
    for step in range(32):
        for rid, (prompt, start, _) in SCHEDULE.items():
            if start == step:
                logits = ex.prefill(rid, prompt)
                seen.append(logits.clone())
                outs[rid] = [int(logits.argmax(-1))]
                ex.join(rid, ex.batch_len(), len(prompt))
                running.append(rid)
        if not running:
            continue
        lens = [len(SCHEDULE[r][0]) + len(outs[r]) - 1 for r in running]
        logits = ex.decode([outs[r][-1] for r in running], lens)
        seen.append(logits.clone())
        for r, t in zip(running, logits.argmax(-1).tolist()):
            outs[r].append(t)
        keep = [b for b, r in enumerate(running) if len(outs[r]) <= SCHEDULE[r][2]]
        if len(keep) < len(running):
            ex.keep(keep, 0)
            running = [running[b] for b in keep]
    return seen, outs


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_graph_replayed_serving_steps_equal_eager_steps_bitwise_while_residency_changes(tiny_ckpt, preset):
    path = tiny_ckpt(preset, "nvfp4-modelopt")
    budget = "cache.budget=4 slots"  # far fewer than a step routes: admissions evict between replays
    eager_eng = _engine(path, budget)
    eager, eager_ids = _drive(LocalExecutor(eager_eng, ServeConfig(max_batch=ROWS),
                                            StaticBatch(eager_eng, ROWS, MAX_LEN, graphs=None)))
    eng = _engine(path, budget)
    eng.cache.reset()
    batch = StaticBatch(eng, ROWS, MAX_LEN, CudaGraphs(eng.device))
    graphed, graphed_ids = _drive(LocalExecutor(eng, ServeConfig(max_batch=ROWS), batch))
    st = eng.cache.stats()
    assert st["compute"]["serve_graph_captures"] >= 2 and st["compute"]["serve_graph_replays"] > 0
    assert batch.steps["graph"] == st["compute"]["serve_graph_replays"]
    assert not [k for k in st["declined"] if k.startswith("serve_graph")]
    assert st["total"]["bytes"]["decode_h2d"] > 0 and st["total"]["evictions"] > 0  # residency changed
    assert graphed_ids == eager_ids
    for i, (a, b) in enumerate(zip(eager, graphed)):
        assert torch.equal(a, b), f"output {i} differs"  # same kernels on the same bytes: bitwise
    torch.cuda.synchronize()
    assert np.array_equal(eng.cache.pool.table_LE.cpu().numpy(), eng.cache.pool.slot_of_LE)


def test_the_default_serving_batch_on_cuda_replays_graphs_and_serves_the_eager_tokens(tiny_ckpt):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    prompts = [SCHEDULE[r][0] for r in "abcd"]
    eager_eng = _engine(path, "decode.max_cache_len=128")
    eager_ex = LocalExecutor(eager_eng, ServeConfig(max_batch=ROWS), StaticBatch(eager_eng, ROWS, 128, graphs=None))
    eager = Scheduler(eager_eng, ServeConfig(max_batch=ROWS), eager_ex).start()
    eng = _engine(path, "decode.max_cache_len=128")
    s = Scheduler(eng, ServeConfig(max_batch=ROWS)).start()
    try:
        assert s.executor.batch.kind == "static" and s.executor.batch.graphs is not None
        for p in prompts:  # one at a time: the same batch shapes in both, so the same bits
            want = eager.generate(p, SamplingParams(max_tokens=12, ignore_eos=True), 120).output_ids
            assert s.generate(p, SamplingParams(max_tokens=12, ignore_eos=True), 120).output_ids == want
        assert s.decode_steps["graph"] > 0
    finally:
        s.stop()
        eager.stop()
