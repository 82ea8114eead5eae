"""decode.run_ahead (moe_offload/run_ahead.py): the next step is enqueued before the host reads this step's tokens.
Same tokens, same streaming order, at most one discarded step, non-finite logits still named; and a cache holding
every expert skips the boundary's admission work (which would make the host wait for the last step)."""

from __future__ import annotations

import random

import pytest
import torch

from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.guards import NonFiniteLogitsError
from moe_offload.run_ahead import TokenReadback


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")


def _engine(ckpt: str, *extra: str) -> Engine:
    cfg = load_config(None, [f"model.checkpoint={ckpt}", "model.format=auto", "logging.level=WARNING", *extra])
    return Engine.from_config(cfg, progress=False)


def _run(eng: Engine, prompts: list[list[int]], max_new: int):
    streamed = []
    res = eng.generate_batch(prompts, max_new, on_token=lambda b, t: streamed.append((b, t)))
    return [r.token_ids for r in res], streamed


@torch.inference_mode()
def _forward_argmax(eng: Engine, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Greedy ids from the engine's forwards alone (prefill, then one forward per step, argmax read each step)."""
    logits, past = eng.prefill(torch.tensor(prompts), last_only=True)
    tok = logits[:, -1].argmax(-1)
    outs = [[t] for t in tok.tolist()]
    for _ in range(max_new - 1):
        tok = eng.forward(tok.view(-1, 1), past, 1)[0][:, -1].argmax(-1)
        for o, t in zip(outs, tok.tolist()):
            o.append(t)
    return outs


@pytest.mark.parametrize("budget", ["0.37", "1.0"])
def test_greedy_decode_with_and_without_run_ahead_gives_the_forwards_argmax_and_one_stream(ckpt, budget):
    plain = _engine(ckpt, f"cache.budget={budget}", "decode.run_ahead=false")
    ahead = _engine(ckpt, f"cache.budget={budget}", "decode.run_ahead=true")
    ref = _engine(ckpt, f"cache.budget={budget}", "decode.run_ahead=false")
    rng = random.Random(0)
    for _ in range(4):
        B, T = rng.choice([1, 2, 3]), rng.randint(1, 24)
        prompts = [[rng.randrange(3, 300) for _ in range(T)] for _ in range(B)]
        for max_new in (1, 2, 9):
            toks, stream = _run(plain, prompts, max_new)
            assert toks == _forward_argmax(ref, prompts, max_new), (prompts, max_new)
            assert stream == [(b, toks[b][i]) for i in range(max_new) for b in range(B)]
            assert _run(ahead, prompts, max_new) == (toks, stream), (prompts, max_new)


def test_a_stop_token_ends_each_sequence_at_the_same_token_and_costs_at_most_one_discarded_step(ckpt):
    plain = _engine(ckpt, "cache.budget=1.0", "decode.run_ahead=false")
    prompts = [[11, 12, 13, 14], [40, 41, 42, 43]]
    free_run, _ = _run(plain, prompts, 12)
    # stop at the 4th token of sequence 0 and at whatever sequence 1 has at its 6th position
    stops = [free_run[0][3], free_run[1][5]]
    cfg = [f"decode.stop_token_ids=[{stops[0]},{stops[1]}]", "cache.budget=1.0"]
    plain, ahead = _engine(ckpt, *cfg, "decode.run_ahead=false"), _engine(ckpt, *cfg, "decode.run_ahead=true")
    want = _run(plain, prompts, 12)
    assert _run(ahead, prompts, 12) == want
    assert all(seq[-1] in stops or len(seq) == 12 for seq in want[0])
    steps = [e.cache.stats()["decode_steps"] for e in (plain, ahead)]
    assert steps[1] - steps[0] in (0, 1)  # a step enqueued after the last sequence stopped, never read


def test_non_finite_logits_at_a_decode_step_are_named_with_run_ahead(ckpt, monkeypatch):
    """Fault injection: the 3rd decode step's logits are NaN. The error comes one step later than without
    run_ahead, naming the same generated token."""
    errors = []
    for extra in (("decode.run_ahead=false",), ("decode.run_ahead=true",)):
        eng = _engine(ckpt, "cache.budget=1.0", *extra)
        calls = {"n": 0}
        real = eng.forward

        def forward(ids, past, keep=0, **kw):
            out, past = real(ids, past, keep, **kw)
            if ids.shape[1] == 1:  # a decode step
                calls["n"] += 1
                if calls["n"] == 3:
                    out = torch.full_like(out, float("nan"))
            return out, past

        monkeypatch.setattr(eng, "forward", forward)
        with pytest.raises(NonFiniteLogitsError) as info:
            eng.generate([5, 6, 7, 8], 10)
        errors.append(str(info.value))
        monkeypatch.undo()
    assert "generated token 3" in errors[0] and errors[1] == errors[0]


def test_a_boundary_with_every_expert_resident_does_no_admission_work(ckpt, monkeypatch):
    """Nothing can miss: the routing record is neither waited for nor read (with run_ahead the host would wait for
    the step it just queued); one expert short of that, the boundary admits again."""
    eng = _engine(ckpt, "cache.budget=1.0")
    eng.generate([5, 6, 7, 8, 9], 4)
    cache = eng.cache
    assert cache.pool.holds_every_expert()
    calls = []
    real = cache.decode._admit
    monkeypatch.setattr(cache.decode, "_admit", lambda *a: calls.append(1) or real(*a))
    eng.generate([9, 8, 7, 6, 5], 6)
    assert calls == []
    layer = cache.store.layers[0]
    keep = [e for e in range(cache.E) if e != 3]
    cache.set_residency({lr: (keep if lr == layer else list(range(cache.E))) for lr in cache.store.layers})
    assert not cache.pool.holds_every_expert()
    eng.generate([9, 8, 7, 6, 5], 6)
    assert calls  # admissions are scheduled again


def test_the_readback_buffers_alternate_and_hold_ids_and_the_flag():
    rb = TokenReadback(2, torch.device("cpu"))
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 1.0, 0.0]])
    tok, s0 = rb.enqueue(logits)
    _, s1 = rb.enqueue(torch.tensor([[0.0, float("inf"), 1.0], [1.0, 2.0, 0.0]]))
    assert tok.tolist() == [1, 0] and (s0, s1) == (0, 1)
    assert rb.read(s0) == ([1, 0], True) and rb.read(s1) == ([1, 1], False)
