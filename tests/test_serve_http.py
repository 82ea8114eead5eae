"""The OpenAI-compatible server: a real uvicorn on 127.0.0.1 (ephemeral port), the official openai client."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest

from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.serve.config import ServeConfig
from moe_offload.serve.protocol import PLAIN_CHAT_TEMPLATE, PLAIN_GENERATION_PROMPT
from moe_offload.serve.scheduler import Scheduler
from moe_offload.serve.server import ServerThread, build_app

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60)), [100], list(range(3, 300, 7)), [42] * 17,
           [7, 7, 8], list(range(50, 80))]
MAX_NEW = [12, 3, 15, 9, 7, 11, 6, 10]
NO_EOS = {"ignore_eos": True}  # Engine.generate does not stop at EOS; the comparisons run to max_tokens


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    # decode.max_tokens=4: a decode batch of more than 4 sequences takes the experts' prefill path
    cfg = load_config(None, [f"model.checkpoint={tiny_ckpt('tiny-qwen3-moe', 'nvfp4-modelopt')}", "model.format=auto",
                             "logging.level=WARNING", "decode.max_tokens=4", "prefill.warmup_tokens=8"])
    return Engine.from_config(cfg, progress=False)


@pytest.fixture(scope="module")
def reference(engine):
    return [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]


class Served:
    def __init__(self, engine, cfg: ServeConfig, scheduler_cls=Scheduler):
        self.scheduler = scheduler_cls(engine, cfg).start()
        self.http = ServerThread(build_app(self.scheduler)).start()
        self.url = self.http.url
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self):
        self.http.stop()
        self.scheduler.stop()

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            health = httpx.get(self.url + "/health").json()
            if (health["running"], health["waiting"]) == (0, 0) or time.monotonic() > deadline:
                return health
            time.sleep(0.02)


@pytest.fixture(scope="module")
def served(engine, reference):  # reference first: Engine.generate must not run beside the scheduler
    s = Served(engine, ServeConfig(max_batch=16, max_queue=64))
    yield s
    s.stop()


def stream_ids(client, prompt, max_tokens, **kw) -> tuple[list[int], str | None]:
    ids, reason = [], None
    for chunk in client.completions.create(model="m", prompt=prompt, max_tokens=max_tokens, stream=True,
                                           extra_body=NO_EOS, **kw):
        ids += chunk.choices[0].model_extra["token_ids"]
        reason = chunk.choices[0].finish_reason or reason
    return ids, reason


def test_the_openai_client_gets_the_greedy_tokens_of_engine_generate(served, reference):
    r = served.client.completions.create(model="m", prompt=PROMPTS[2], max_tokens=MAX_NEW[2], extra_body=NO_EOS)
    assert r.choices[0].model_extra["token_ids"] == reference[2]
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(PROMPTS[2]), MAX_NEW[2])


def test_a_streaming_openai_client_gets_the_greedy_tokens_of_engine_generate(served, reference):
    assert stream_ids(served.client, PROMPTS[0], MAX_NEW[0]) == (reference[0], "length")


def test_a_text_prompt_is_tokenized_and_its_text_streams_back_whole(served, engine):
    ref = engine.tokenizer.decode(served.client.completions.create(model="m", prompt="The capital of", max_tokens=8,
                                                                   extra_body=NO_EOS).choices[0].model_extra["token_ids"])
    text = "".join(c.choices[0].text for c in served.client.completions.create(
        model="m", prompt="The capital of", max_tokens=8, stream=True, extra_body=NO_EOS))
    assert text == ref


def test_sixteen_concurrent_streaming_clients_each_get_what_they_get_alone(served, reference):
    got = [None] * 16

    def go(i):
        time.sleep(0.002 * i)  # staggered: clients join a batch already decoding
        got[i] = stream_ids(served.client, PROMPTS[i % 8], MAX_NEW[i % 8])[0]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [reference[i % 8] for i in range(16)]


def test_a_client_that_disconnects_mid_stream_frees_its_slot(served, reference):
    body = {"prompt": PROMPTS[0], "max_tokens": 3000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        chunks = []
        for line in lines:
            if line.startswith("data:"):
                chunks.append(line)
            if len(chunks) == 3:
                break
    assert served.scheduler.num_running <= 1
    health = served.wait_idle()
    assert (health["running"], health["waiting"]) == (0, 0)
    assert served.scheduler.executor.batch.rows == 0  # the batch KV cache went with its last row
    metrics = httpx.get(served.url + "/metrics").text
    assert 'moe_offload_requests_total{endpoint="completions",outcome="disconnected"}' in metrics
    assert stream_ids(served.client, PROMPTS[1], MAX_NEW[1])[0] == reference[1]


@pytest.mark.parametrize("body, param", [
    ({"prompt": [5] * 5000, "max_tokens": 4}, "max_tokens"),
    ({"prompt": [5], "temperature": -1}, "temperature"),
    ({"prompt": [5], "top_p": 0}, "top_p"),
    ({"prompt": [5], "max_tokens": 0}, "max_tokens"),
    ({"prompt": [5], "n": 2}, "n"),
    ({"prompt": [5], "logprobs": 2}, "logprobs"),
    ({"prompt": [], "max_tokens": 2}, "prompt"),
    ({"prompt": [5, 10**7]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"max_tokens": 2}, "prompt"),
    ({"prompt": [5], "max_tokens": "many"}, "max_tokens"),
    ({"prompt": [5], "seed": 10**30}, "seed"),  # beyond torch's 64-bit seeds: a 500 before
    ({"prompt": [5], "seed": -(2**63) - 1}, "seed"),  # torch takes -2^63 .. 2^64 - 1, as vLLM's signed seeds
])
def test_a_bad_completion_request_gets_400_with_an_openai_error_body(served, body, param):
    r = httpx.post(served.url + "/v1/completions", json=body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert (err["type"], err["param"]) == ("invalid_request_error", param)
    assert err["message"]


def test_a_body_that_is_not_json_gets_400_saying_so_with_no_param(served):
    r = httpx.post(served.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] is None and "not valid JSON" in err["message"]


def test_the_openai_client_raises_bad_request_for_a_prompt_that_is_too_long(served):
    with pytest.raises(openai.BadRequestError, match="maximum of 4096"):
        served.client.completions.create(model="m", prompt=[5] * 4096, max_tokens=1)


def test_a_bad_chat_request_gets_400(served):
    r = httpx.post(served.url + "/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_overload_gets_429_and_a_stopped_scheduler_gets_503(engine, served):
    gate = threading.Event()

    class Gated(Scheduler):
        """Holds every loop step until the gate opens: the first request keeps the one batch slot."""

        def _step(self):
            gate.wait(30)
            super()._step()

    # a second server on the same engine while the module's server is idle (one loop touches the model at a time)
    s = Served(engine, ServeConfig(max_batch=1, max_queue=0), Gated)
    try:
        first = {}
        t = threading.Thread(target=lambda: first.update(r=httpx.post(s.url + "/v1/completions", timeout=60,
                                                                       json={"prompt": [5, 6], "max_tokens": 3})))
        t.start()
        deadline = time.monotonic() + 10
        while s.scheduler.num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError):
            s.client.completions.create(model="m", prompt=[5], max_tokens=2)
        late = httpx.post(s.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert late.status_code == 429 and late.json()["error"]["code"] == "queue_full"
        gate.set()
        t.join(60)
        assert first["r"].status_code == 200
        s.scheduler.stop()
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "scheduler_closed"
        assert httpx.get(s.url + "/health").status_code == 503
    finally:
        gate.set()
        s.stop()


def test_chat_uses_the_plain_template_when_the_tokenizer_has_none(served, engine):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = served.client.chat.completions.create(model="m", messages=messages, max_tokens=5, extra_body=NO_EOS)
    text = "".join(PLAIN_CHAT_TEMPLATE.format(**m) for m in messages) + PLAIN_GENERATION_PROMPT
    prompt_ids = engine.tokenizer.encode(text)
    assert r.usage.prompt_tokens == len(prompt_ids)
    alone = served.client.completions.create(model="m", prompt=prompt_ids, max_tokens=5, extra_body=NO_EOS)
    assert r.choices[0].model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
    assert r.choices[0].message.role == "assistant"


def test_streaming_chat_sends_a_role_delta_then_tokens_then_usage(served):
    chunks = list(served.client.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4, stream=True,
        stream_options={"include_usage": True}, extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert sum(len(c.choices[0].model_extra["token_ids"]) for c in chunks if c.choices) == 4
    assert chunks[-1].usage.completion_tokens == 4


def test_a_stop_string_cuts_the_text_before_it(served, engine):
    full = served.client.completions.create(model="m", prompt="Hello", max_tokens=12, extra_body=NO_EOS).choices[0].text
    stop = full[3:5]
    if not stop.strip("\ufffd"):
        pytest.skip("the tiny model's text has no printable stop string here")
    r = served.client.completions.create(model="m", prompt="Hello", max_tokens=12, stop=stop, extra_body=NO_EOS)
    assert r.choices[0].text == full[:full.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_models_lists_the_served_model(served):
    models = served.client.models.list().data
    assert [m.id for m in models] == ["tiny-qwen3-moe-nvfp4-modelopt"]


def test_metrics_expose_requests_queue_latencies_and_cache_counters(served):
    served.client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=4)
    text = httpx.get(served.url + "/metrics").text
    for name in ("moe_offload_requests_total", "moe_offload_queue_depth", "moe_offload_ttft_seconds_bucket",
                 "moe_offload_time_per_output_token_seconds_bucket", "moe_offload_cache_hits_total",
                 "moe_offload_cache_misses_total", "moe_offload_cache_bytes_total", "moe_offload_cache_fallbacks_total",
                 "moe_offload_cache_declined_total", "moe_offload_queue_seconds_bucket",
                 "moe_offload_prefill_seconds_bucket", "moe_offload_decode_rows_steps_total",
                 "moe_offload_decode_rows_seconds_total", "moe_offload_prefill_batches_total",
                 "moe_offload_decode_boundary_seconds_total"):
        assert name in text, name
    count = next(line for line in text.splitlines() if line.startswith("moe_offload_ttft_seconds_count"))
    assert float(count.split()[-1]) >= 1


def test_sse_ends_with_done(served):
    with httpx.stream("POST", served.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2, "stream": True}) as r:
        data = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert json.loads(data[0])["object"] == "text_completion"


def test_the_mailbox_delivers_every_output_in_order_with_one_wakeup_per_burst():
    import asyncio

    from moe_offload.serve.server import Mailbox

    def decode_steps(box, queues, steps):  # a decode loop's Outputs: one per row per step
        for step in range(steps):
            for row, q in enumerate(queues):
                box.post(q, (row, step))

    async def main():
        box = Mailbox(asyncio.get_running_loop())
        queues = [asyncio.Queue() for _ in range(8)]
        # the loop is busy (this coroutine blocks it) while 50 steps x 8 rows are posted: one burst
        t = threading.Thread(target=decode_steps, args=(box, queues, 50))
        t.start()
        t.join()
        burst = box.wakeups
        got = [[await q.get() for _ in range(50)] for q in queues]
        # posted while the loop runs: bursts end whenever a drain ran, every Output still arrives in order
        t = threading.Thread(target=decode_steps, args=(box, queues, 20))
        t.start()
        more = [[await q.get() for _ in range(20)] for q in queues]
        t.join()
        return box, burst, got, more

    box, burst, got, more = asyncio.run(main())
    assert burst == 1  # 400 Outputs, one call_soon_threadsafe (it was one each)
    assert got == [[(row, step) for step in range(50)] for row in range(8)]
    assert more == [[(row, step) for step in range(20)] for row in range(8)]
    assert 2 <= box.wakeups <= 1 + 160


def test_a_mailbox_whose_loop_closed_raises_on_every_post():
    import asyncio

    from moe_offload.serve.server import Mailbox

    loop = asyncio.new_event_loop()
    box = Mailbox(loop)
    loop.close()
    q = asyncio.Queue()
    for _ in range(3):  # each request's sink fails, so the scheduler cancels each (not only the first)
        with pytest.raises(RuntimeError):
            box.post(q, "out")
