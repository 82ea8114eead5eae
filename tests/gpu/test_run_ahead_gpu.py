"""On CUDA: decode.run_ahead with graph-replayed steps gives the plain loop's tokens and stream, at a cache holding
every expert (no boundary work: the next replay is queued behind the running one) and at caches that miss (the
boundary waits for the last step's routing, admissions between steps)."""

import random

import pytest
import torch

from moe_offload.config import load_config
from moe_offload.engine import Engine

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(path, *extra):
    cfg = load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cuda", "dtype=bfloat16",
                             "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


@pytest.mark.parametrize("budget", ["1.0", "0.37", "8 slots"])
def test_run_ahead_replays_give_the_plain_loops_tokens(tiny_ckpt, budget):
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    plain = _engine(path, f"cache.budget={budget}")
    ahead = _engine(path, f"cache.budget={budget}", "decode.run_ahead=true")
    rng = random.Random(1)
    for B in (1, 3):
        prompts = [[rng.randrange(3, 300) for _ in range(13)] for _ in range(B)]
        runs = []
        for eng in (plain, ahead):
            streamed = []
            res = eng.generate_batch(prompts, 16, on_token=lambda b, t: streamed.append((b, t)))
            runs.append(([r.token_ids for r in res], streamed))
        assert runs[1] == runs[0], (budget, B)
    st = ahead.cache.stats()
    assert st["compute"].get("decode_graph_replays", 0) > 0 and not st["declined"], st["declined"]
