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
    plain = _engine(path, f"cache.budget={budget}", "decode.run_ahead=false")
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


def test_run_ahead_boundaries_below_residency_one_admit_without_waiting_for_the_step_in_flight(tiny_ckpt):
    """Read late (decode_path.py): the host never waits on the record event of the step in flight, admissions still
    happen (from the step before), and the tokens equal the plain loop's."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    plain = _engine(path, "cache.budget=0.37", "decode.run_ahead=false")
    ahead = _engine(path, "cache.budget=0.37", "decode.run_ahead=true")
    dec = ahead.cache.decode

    class Spy:  # the real event, its host waits noted with the mode they happened in
        def __init__(self, event):
            self.event, self.waits = event, []

        def record(self, stream=None):
            self.event.record(stream)

        def synchronize(self):
            self.waits.append(dec.late)
            self.event.synchronize()

    dec._record_event = spy = Spy(dec._record_event)
    prompts = [[random.Random(b).randrange(3, 300) for _ in range(21)] for b in range(4)]
    want = [r.token_ids for r in plain.generate_batch(prompts, 24)]
    assert [r.token_ids for r in ahead.generate_batch(prompts, 24)] == want
    assert not any(spy.waits)
    assert ahead.cache.stats()["total"]["bytes"]["decode_h2d"] > 0
