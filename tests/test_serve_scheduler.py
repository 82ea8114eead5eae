"""The request scheduler: continuous batching gives every request what Engine.generate gives it alone."""

from __future__ import annotations

import threading
import time

import pytest

from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.serve.config import ServeConfig, load_serve_config
from moe_offload.serve.sampling import RequestError, SamplingParams
from moe_offload.serve.scheduler import Overloaded, Scheduler, SchedulerClosed

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60)), [100], list(range(3, 300, 7)), [42] * 17]
MAX_NEW = [12, 3, 15, 9, 7, 11]


def make_engine(ckpt: str, *overrides: str) -> Engine:
    # decode.max_tokens=4: decode batches of more than 4 sequences take the experts' prefill path,
    # so the batched tests cover both expert paths
    cfg = load_config(None, [f"model.checkpoint={ckpt}", "model.format=auto", "logging.level=WARNING", "decode.max_tokens=4",
                             "prefill.warmup_tokens=8", "prefill.chunk_tokens=16", *overrides])
    return Engine.from_config(cfg, progress=False)


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"))


@pytest.fixture(scope="module")
def reference(engine):
    """Engine.generate's greedy ids per prompt (it does not stop at EOS; serving does unless ignore_eos)."""
    return [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]


@pytest.fixture
def scheduler(engine):
    s = Scheduler(engine, ServeConfig(max_batch=4, max_queue=64)).start()
    yield s
    s.stop()


def run_concurrently(s: Scheduler, prompts, max_new, stagger_s: float = 0.003, **params):
    out = [None] * len(prompts)

    def go(i):
        time.sleep(stagger_s * i)
        req = s.generate(prompts[i], SamplingParams(max_tokens=max_new[i], ignore_eos=True, **params), timeout=120)
        out[i] = req.output_ids

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_requests_joining_and_leaving_a_batch_get_the_greedy_tokens_of_engine_generate(scheduler, reference):
    # 12 requests of different lengths through a batch of 4: rows join after their prefill and leave at
    # different steps, so the padded batch cache is grown, shrunk and trimmed many times
    got = run_concurrently(scheduler, PROMPTS * 2, MAX_NEW * 2)
    assert got == reference * 2


def test_a_prompt_longer_than_a_prefill_chunk_matches_engine_generate(scheduler, reference):
    # prefill.chunk_tokens=16: PROMPTS[2] (40 tokens) and PROMPTS[4] (43) are prefilled in 3 chunks, one
    # per loop step, interleaved with the decode steps of the other requests
    got = run_concurrently(scheduler, [PROMPTS[2], PROMPTS[0], PROMPTS[4]], [MAX_NEW[2], MAX_NEW[0], MAX_NEW[4]])
    assert got == [reference[2], reference[0], reference[4]]


def test_a_seeded_sampled_request_matches_engine_generate_with_that_seed(engine, scheduler):
    d = engine.cfg.decode
    saved = (d.temperature, d.top_k, d.top_p)
    d.temperature, d.top_k, d.top_p = 0.9, 40, 0.95
    try:
        ref = engine.generate(PROMPTS[2], 14, seed=7).token_ids
    finally:
        d.temperature, d.top_k, d.top_p = saved
    others = run_concurrently(scheduler, [PROMPTS[2], PROMPTS[0]], [14, 10], temperature=0.9, top_k=40, top_p=0.95, seed=7)
    assert others[0] == ref


def test_a_stop_token_ends_the_request_with_the_stop_token_last(scheduler, reference):
    ref = reference[0]
    stop_at = ref[4]
    req = scheduler.generate(PROMPTS[0], SamplingParams(max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True), 60)
    assert req.output_ids == ref[:ref.index(stop_at) + 1]
    assert req.finish_reason == "stop"


def test_the_tokenizer_eos_stops_a_request_unless_ignore_eos(engine, scheduler):
    s = scheduler
    s.eos_id = engine.generate(PROMPTS[3], 3).token_ids[1]  # pretend the 2nd greedy token is EOS
    req = s.generate(PROMPTS[3], SamplingParams(max_tokens=9), 60)
    assert (len(req.output_ids), req.finish_reason) == (2, "stop")
    req = s.generate(PROMPTS[3], SamplingParams(max_tokens=9, ignore_eos=True), 60)
    assert (len(req.output_ids), req.finish_reason) == (9, "length")


def cancel_after_tokens(scheduler, prompt: list[int], max_tokens: int, n: int = 3) -> None:
    """Submit a request of ``max_tokens``, cancel it once ``n`` outputs arrived, and wait (up to 10 s)
    until it reports ``cancelled`` and no request runs any more."""
    got_tokens = threading.Event()
    finished = threading.Event()
    outs = []

    def sink(o):
        outs.append(o)
        if len(outs) >= n:
            got_tokens.set()
        if o.finished:
            finished.set()

    req = scheduler.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), sink)
    assert got_tokens.wait(60)
    scheduler.cancel(req)
    assert finished.wait(60)
    assert outs[-1].finish_reason == "cancelled"
    deadline = time.monotonic() + 10
    while scheduler.num_running and time.monotonic() < deadline:
        time.sleep(0.01)


def test_cancelling_a_running_request_frees_its_row_and_the_rest_still_match(scheduler, reference):
    cancel_after_tokens(scheduler, PROMPTS[0], 3000)
    assert scheduler.num_running == 0
    assert scheduler.executor.batch.rows == 0  # the batch KV cache was dropped with its last row
    assert run_concurrently(scheduler, PROMPTS[:2], MAX_NEW[:2]) == reference[:2]


def test_a_full_queue_raises_overloaded(engine):
    # not started: nothing leaves the queue, so the bound is exact (1 free batch slot + 1 queued)
    s = Scheduler(engine, ServeConfig(max_batch=1, max_queue=1))
    s.submit([5], SamplingParams(), lambda o: None)
    s.submit([5], SamplingParams(), lambda o: None)
    with pytest.raises(Overloaded, match="max_queue=1"):
        s.submit([5], SamplingParams(), lambda o: None)


@pytest.mark.parametrize("prompt, params, param", [
    ([], SamplingParams(), "prompt"),
    ([5, 10**6], SamplingParams(), "prompt"),
    ([5] * 4000, SamplingParams(max_tokens=200), "max_tokens"),
])
def test_an_unservable_request_is_a_request_error_naming_the_param(engine, prompt, params, param):
    s = Scheduler(engine, ServeConfig())
    with pytest.raises(RequestError) as err:
        s.submit(prompt, params, lambda o: None)
    assert err.value.param == param


def test_out_of_range_sampling_params_are_a_request_error():
    with pytest.raises(RequestError, match="top_p"):
        SamplingParams(top_p=0.0)


def test_a_stopped_scheduler_fails_in_flight_requests_and_refuses_new_ones(engine):
    s = Scheduler(engine, ServeConfig(max_batch=2))
    outs = []
    s.submit([5, 6], SamplingParams(), outs.append)  # queued before the loop starts
    s.start()
    s.stop()
    if outs and outs[-1].error is None:  # the loop may have served it before the stop arrived
        assert outs[-1].finish_reason in ("length", "stop")
    with pytest.raises(SchedulerClosed):
        s.submit([5], SamplingParams(), lambda o: None)


def test_serve_overrides_are_validated_and_name_the_key():
    assert load_serve_config(["max_batch=8"]).max_batch == 8
    with pytest.raises(ValueError, match="serve.max_bach"):
        load_serve_config(["max_bach=8"])


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-next"])
def test_other_families_batch_to_the_greedy_tokens_of_engine_generate(tiny_ckpt, preset):
    eng = make_engine(tiny_ckpt(preset, "bf16"))
    ref = [eng.generate(p, n).token_ids for p, n in zip(PROMPTS[:4], MAX_NEW[:4])]
    s = Scheduler(eng, ServeConfig(max_batch=4)).start()
    try:
        assert run_concurrently(s, PROMPTS[:4], MAX_NEW[:4]) == ref
    finally:
        s.stop()


def test_serving_with_the_decode_lookahead_gives_the_tokens_without_it(tiny_ckpt):
    """decode.lookahead (moe_offload/lookahead.py) in the serving loop, at a cache small enough to miss: the
    batched rows' tokens are those of Engine.generate without the lookahead, and it did copy experts."""
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    ref = [make_engine(path, "cache.budget=0.3").generate(p, n).token_ids for p, n in zip(PROMPTS[:4], MAX_NEW[:4])]
    eng = make_engine(path, "cache.budget=0.3", "decode.lookahead=true")
    s = Scheduler(eng, ServeConfig(max_batch=4)).start()
    try:
        assert run_concurrently(s, PROMPTS[:4], MAX_NEW[:4]) == ref
    finally:
        s.stop()
    assert eng.cache.stats()["lookahead"]["used"] > 0


def test_a_decode_steps_tokens_are_sent_after_the_next_step_is_enqueued_and_the_last_one_at_once(engine, reference):
    """The sinks (and the HTTP work behind them) overlap the next device step instead of delaying its launch."""
    s = Scheduler(engine, ServeConfig(max_batch=4, max_queue=64))
    assert s._defer is False  # a CPU forward runs in the call: nothing to overlap, so tokens go out at once
    s._defer = True  # what CUDA does (its forward is enqueued asynchronously)
    log: list[tuple] = []
    launch = s.executor.decode

    def decode(tokens, lens):  # an observer on the real executor: records when each step is enqueued
        log.append(("step", len(log)))
        return launch(tokens, lens)

    s.executor.decode = decode
    s.start()
    try:
        done = threading.Event()

        def sink(out):
            log.append(("out", list(out.token_ids), out.finish_reason))
            if out.finished:
                done.set()

        s.submit(PROMPTS[0], SamplingParams(max_tokens=MAX_NEW[0], ignore_eos=True), sink)
        assert done.wait(120)
    finally:
        s.stop()
    outs = [e for e in log if e[0] == "out"]
    assert [t for e in outs for t in e[1]] == reference[0][:MAX_NEW[0]]
    steps = [i for i, e in enumerate(log) if e[0] == "step"]
    assert len(steps) == MAX_NEW[0] - 1  # the first token comes from the prefill
    # the token of step k is sent after step k + 1 was enqueued ...
    for k in range(len(steps) - 1):
        sent = [i for i, e in enumerate(log) if e[0] == "out"][k + 1]  # outs[0] is the prefill's token
        assert steps[k + 1] < sent, (k, log)
    # ... and the last step's (the request's end) without waiting for a step that will not come
    assert log[-1] == ("out", [reference[0][MAX_NEW[0] - 1]], "length")
