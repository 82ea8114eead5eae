"""serve.prefill_batch_tokens: waiting prompts prefilled together, left-padded, give every request what
Engine.generate gives it alone; what cannot be batched goes alone; a failing batched forward fails only
its own requests."""

from __future__ import annotations

import logging
import threading

from moe_offload.serve.config import ServeConfig
from moe_offload.serve.executor import LocalExecutor
from moe_offload.serve.sampling import SamplingParams
from moe_offload.serve.scheduler import Request, Scheduler
from moe_offload.serve.static_batch import StaticBatch

from test_serve_scheduler import MAX_NEW, PROMPTS, engine, make_engine, reference  # noqa: F401 (fixtures)


def collecting_sinks(n: int):
    """(outputs per request index, a done event per request, ``sink(i)`` for request i)."""
    outs: dict[int, list] = {}
    done = [threading.Event() for _ in range(n)]

    def sink(i):
        def f(o):
            outs.setdefault(i, []).append(o)
            if o.finished:
                done[i].set()
        return f

    return outs, done, sink


def submit_then_start(s: Scheduler, prompts, max_new) -> list:
    """Queue every request before the loop runs (so they wait together), start it, wait for all."""
    done = [threading.Event() for _ in prompts]
    reqs = [s.submit(p, SamplingParams(max_tokens=n, ignore_eos=True),
                     lambda o, e=e: e.set() if o.finished else None) for p, n, e in zip(prompts, max_new, done)]
    s.start()
    try:
        assert all(e.wait(120) for e in done)
    finally:
        s.stop()
    return reqs


def test_waiting_prompts_prefilled_together_get_the_greedy_tokens_of_engine_generate(engine, reference):
    # prefill.chunk_tokens=16 (make_engine) caps the budget at 16 tokens per forward: PROMPTS[2] (40 tokens),
    # PROMPTS[4] (43) and PROMPTS[5] (17) are prefilled alone in chunks; 5, 3 and 1 tokens go together (3 x 5)
    s = Scheduler(engine, ServeConfig(max_batch=6, max_queue=64, prefill_batch_tokens=128))
    reqs = submit_then_start(s, PROMPTS, MAX_NEW)
    assert [r.output_ids for r in reqs] == reference
    assert s.prefill_batches >= 1


def test_prefill_batches_into_static_rows_get_the_greedy_tokens_of_engine_generate(engine, reference):
    cfg = ServeConfig(max_batch=6, max_queue=64, prefill_batch_tokens=64)
    s = Scheduler(engine, cfg, LocalExecutor(engine, cfg, StaticBatch(engine, 6, 128, None)))
    reqs = submit_then_start(s, PROMPTS * 2, MAX_NEW * 2)
    assert [r.output_ids for r in reqs] == reference * 2
    assert s.prefill_batches >= 2


def _queued(s: Scheduler, lens: list[int], prefilled: list[int] | None = None) -> list[Request]:
    reqs = [Request(f"r{i}", [5] * n, SamplingParams(), lambda o: None) for i, n in enumerate(lens)]
    for r, done in zip(reqs, prefilled or [0] * len(reqs)):
        r.prefilled = done
        s._prefilling.append(r)
    return reqs


def test_a_group_is_the_head_and_the_later_whole_prompts_that_fit_the_budget(engine, monkeypatch):
    monkeypatch.setattr(engine.cfg.prefill, "chunk_tokens", 64)
    # no forward carries more tokens than prefill.chunk_tokens: the budget is capped at it
    assert Scheduler(engine, ServeConfig(max_batch=8, prefill_batch_tokens=1000))._batch_tokens == 64
    s = Scheduler(engine, ServeConfig(max_batch=8, prefill_batch_tokens=40))  # never started
    r = _queued(s, [10, 12, 30, 5, 3])
    # 2 x 12 = 24, 3 x 30 = 90 > 40 (skipped), 3 x 12 = 36, 4 x 12 = 48 > 40
    assert s._prefill_group() == [r[0], r[1], r[3]]
    s._prefilling.clear()
    r = _queued(s, [20, 4, 4], prefilled=[16, 0, 0])  # the head is part-prefilled: it goes alone
    assert s._prefill_group() == [r[0]]
    s._prefilling.clear()
    r = _queued(s, [70, 4])  # longer than prefill.chunk_tokens=64: chunked, alone
    assert s._prefill_group() == [r[0]]
    s._prefilling.clear()
    off = Scheduler(engine, ServeConfig(max_batch=8))
    r = _queued(off, [4, 4, 4])
    assert off._prefill_group() == [r[0]]  # prefill_batch_tokens=0 (the default): one prompt per forward


def test_a_batched_prefill_that_raises_fails_its_requests_and_the_next_ones_are_correct(engine, reference, monkeypatch):
    s = Scheduler(engine, ServeConfig(max_batch=6, max_queue=64, prefill_batch_tokens=128))
    real = s.executor.prefill_batch
    calls = []

    def fail_once(rids, prompts):
        calls.append(list(rids))
        if len(calls) == 1:
            raise RuntimeError("injected: batched prefill forward")
        return real(rids, prompts)

    monkeypatch.setattr(s.executor, "prefill_batch", fail_once)
    outs, done, sink = collecting_sinks(len(PROMPTS))

    for i, (p, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        s.submit(p, SamplingParams(max_tokens=n, ignore_eos=True), sink(i))
    s.start()
    try:
        assert all(e.wait(120) for e in done)
        failed = {i for i, o in outs.items() if o[-1].error}
        assert failed and len(failed) == len(calls[0])  # exactly the requests of the failing forward
        assert all("injected" in outs[i][-1].error for i in failed)
        for i in set(range(len(PROMPTS))) - failed:  # the others were served correctly
            assert [t for o in outs[i] for t in o.token_ids] == reference[i]
        # the loop survived: a new batch of requests is served correctly
        again = [s.generate(PROMPTS[i], SamplingParams(max_tokens=MAX_NEW[i], ignore_eos=True), timeout=120)
                 for i in sorted(failed)]
        assert [r.output_ids for r in again] == [reference[i] for i in sorted(failed)]
    finally:
        s.stop()


def test_a_model_with_linear_attention_declines_with_one_event_a_count_and_serves_one_at_a_time(tiny_ckpt, caplog):
    eng = make_engine(tiny_ckpt("tiny-qwen3-next", "bf16"))
    ref = [eng.generate(p, n).token_ids for p, n in zip(PROMPTS[:4], MAX_NEW[:4])]
    with caplog.at_level(logging.WARNING, logger="moe_offload"):
        s = Scheduler(eng, ServeConfig(max_batch=4, prefill_batch_tokens=128))
    events = [r.event_fields for r in caplog.records
              if getattr(r, "event_fields", {}).get("event") == "serve_prefill_batch_declined"]
    assert len(events) == 1 and "setting" in events[0] and "cache layer" in events[0]["reason"]
    assert eng.cache.stats()["declined"].get("serve_prefill_batch:cache_layers") == 1
    reqs = submit_then_start(s, PROMPTS[:4], MAX_NEW[:4])
    assert [r.output_ids for r in reqs] == ref and s.prefill_batches == 0


def test_a_join_that_fails_after_a_one_prompt_prefill_fails_only_that_request(engine, reference, monkeypatch):
    # found by review: the single-prompt path removed the head of the prefill queue a second time when the
    # join raised, so the next queued request was dropped without an answer (its stream hung)
    s = Scheduler(engine, ServeConfig(max_batch=4, max_queue=64))
    real, calls = s.executor.join, []

    def join_fails_once(rid, batch_len, one_len):
        calls.append(rid)
        if len(calls) == 1:
            raise RuntimeError("injected: join")
        return real(rid, batch_len, one_len)

    monkeypatch.setattr(s.executor, "join", join_fails_once)
    outs, done, sink = collecting_sinks(3)

    for i in range(3):
        s.submit(PROMPTS[i], SamplingParams(max_tokens=MAX_NEW[i], ignore_eos=True), sink(i))
    s.start()
    try:
        assert all(e.wait(120) for e in done)  # every request ends: none dropped
    finally:
        s.stop()
    assert "injected" in outs[0][-1].error
    for i in (1, 2):
        assert outs[i][-1].error is None and [t for o in outs[i] for t in o.token_ids] == reference[i]


def test_whole_prompts_prefilled_in_the_static_prefill_decoder_get_the_greedy_tokens_of_engine_generate(engine,
                                                                                                       reference):
    """With prefill graphs (CUDA), a prompt that fits one chunk is prefilled in the executor's static decoder
    (padded to its bucket; a graph replay on CUDA) and its positions are copied into the request's own
    cache; here the same padded forwards run eagerly on the CPU. Longer prompts are chunked as before."""
    from moe_offload.decode_graph import StaticDecoder

    cfg = ServeConfig(max_batch=6, max_queue=64)
    for batch in (None, StaticBatch(engine, 6, 128, None)):
        ex = LocalExecutor(engine, cfg, batch)
        ex.prefill_decoder = StaticDecoder(engine, 1, 128, graphs=False, padded_prefill=True)
        before = engine.cache.counters.compute["prefill_graph_eager"]
        s = Scheduler(engine, cfg, ex)
        reqs = submit_then_start(s, PROMPTS, MAX_NEW)
        assert [r.output_ids for r in reqs] == reference
        # whole prompts (at most prefill.chunk_tokens = 16): 5, 3 and 1 tokens; the 3- and 1-token ones fit the
        # routed threshold (decode.max_tokens = 4 on the CPU) and are padded, the 5-token one is staged and padded
        # too (the forward a piecewise capture splits at its experts calls, prefill.piecewise_graphs)
        assert engine.cache.counters.compute["prefill_graph_eager"] - before == 3
