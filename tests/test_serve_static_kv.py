"""The serving decode batch over the per-row static KV cache (serve/static_kv.py, serve/static_batch.py), run
eagerly on the CPU: every request of a mixed batch gets the greedy ids Engine.generate gives it alone, rows
are freed and reused, and the graph bookkeeping (capture on a bucket's second step, replays, a failed
capture) runs against a stand-in for CUDA graphs."""

from __future__ import annotations

import logging

import pytest
import torch

from moe_offload import log
from moe_offload.config import ConfigError
from moe_offload.serve.config import ServeConfig
from moe_offload.serve.executor import LocalExecutor
from moe_offload.serve.kv import LeftPaddedBatch
from moe_offload.serve.scheduler import Scheduler
from moe_offload.serve.static_batch import StaticBatch, buckets
from test_serve_scheduler import MAX_NEW, PROMPTS, cancel_after_tokens, make_engine, run_concurrently

ROWS = 4
MAX_LEN = 256  # positions per row: every prompt + output of PROMPTS fits, and a 200-token request


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"))


@pytest.fixture(scope="module")
def reference(engine):
    return [engine.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]


def static_scheduler(engine, graphs=None, rows: int = ROWS) -> Scheduler:
    cfg = ServeConfig(max_batch=rows, max_queue=64)
    return Scheduler(engine, cfg, LocalExecutor(engine, cfg, StaticBatch(engine, rows, MAX_LEN, graphs))).start()


def declined_events(caplog) -> list[dict]:
    return [r.event_fields for r in caplog.records
            if getattr(r, "event_fields", {}).get("event") == "decode_graph_declined"]


class RerunGraphs:
    """A stand-in for ``CudaGraphs`` on the CPU: capturing keeps the step function, a replay re-runs it."""

    def __init__(self):
        self.captured: list = []

    def capture(self, fn):
        graph = _Rerun(fn)
        self.captured.append(graph)
        return graph


class _Rerun:
    def __init__(self, fn):
        self.fn, self.out, self.replays = fn, None, 0

    def replay(self):
        self.out = self.fn()
        self.replays += 1


class FailingGraphs:
    """A capture that fails as a step with a host sync fails under ``torch.cuda.graph``."""

    def __init__(self):
        self.calls = 0

    def capture(self, fn):
        self.calls += 1
        raise RuntimeError("operation not permitted when stream is capturing")


def test_requests_of_different_lengths_joining_and_leaving_static_rows_get_the_greedy_tokens_of_engine_generate(
        engine, reference):
    # 12 requests through 4 rows: rows are loaded, freed, compacted and reused; buckets of 1, 2 and 4 rows
    s = static_scheduler(engine)
    try:
        assert run_concurrently(s, PROMPTS * 2, MAX_NEW * 2) == reference * 2
        assert s.decode_steps["eager"] > 0 and s.executor.batch.rows == 0
    finally:
        s.stop()


@pytest.mark.parametrize("preset", ["tiny-mixtral", "tiny-qwen3-next"])
def test_other_families_decode_from_static_rows_to_the_greedy_tokens_of_engine_generate(tiny_ckpt, preset):
    # qwen3_next: linear-attention layers keep their conv and recurrent states per row
    eng = make_engine(tiny_ckpt(preset, "bf16"))
    ref = [eng.generate(p, n).token_ids for p, n in zip(PROMPTS[:4], MAX_NEW[:4])]
    s = static_scheduler(eng)
    try:
        assert run_concurrently(s, PROMPTS[:4], MAX_NEW[:4]) == ref
        assert s.executor.batch.kind == "static"  # not the left-padded fallback
    finally:
        s.stop()


def _greedy(ex: LocalExecutor, outs: dict[str, list[int]], prompts: dict[str, list[int]], rids: list[str]) -> None:
    """One decode step of the running ``rids`` (in batch order): append each row's greedy token."""
    lens = [len(prompts[r]) + len(outs[r]) - 1 for r in rids]
    logits = ex.decode([outs[r][-1] for r in rids], lens)
    for r, t in zip(rids, logits.argmax(-1).tolist()):
        outs[r].append(t)


def _join(ex: LocalExecutor, rid: str, prompt: list[int], outs: dict[str, list[int]]) -> None:
    outs[rid] = [int(ex.prefill(rid, prompt).argmax(-1))]
    ex.join(rid, ex.batch_len(), len(prompt))


def test_a_leaving_row_is_filled_by_the_highest_row_and_reused_by_the_next_join(engine):
    ex = LocalExecutor(engine, ServeConfig(max_batch=ROWS), StaticBatch(engine, ROWS, MAX_LEN))
    prompts = {"a": PROMPTS[0], "b": PROMPTS[1], "c": PROMPTS[2], "d": PROMPTS[5]}
    outs: dict[str, list[int]] = {}
    for rid in "abc":
        _join(ex, rid, prompts[rid], outs)
    running = ["a", "b", "c"]
    for _ in range(2):
        _greedy(ex, outs, prompts, running)
    batch = ex.batch
    n_c = len(prompts["c"]) + len(outs["c"]) - 1
    keys_c = batch.kv.layers[0].keys_RHPD[2, :, :n_c].clone()
    ex.keep([0, 2], 0)  # b leaves: c moves from row 2 into row 1
    running = ["a", "c"]
    assert batch.row_of == [0, 1]
    assert torch.equal(batch.kv.layers[0].keys_RHPD[1, :, :n_c], keys_c)
    _greedy(ex, outs, prompts, running)
    _join(ex, "d", prompts["d"], outs)  # takes row 2, free again
    running.append("d")
    assert batch.row_of == [0, 1, 2]
    while len(outs["d"]) < 6:
        _greedy(ex, outs, prompts, running)
    for rid in running:
        assert outs[rid] == engine.generate(prompts[rid], len(outs[rid])).token_ids, rid


def test_a_cancelled_request_frees_its_row_for_a_full_batch_afterwards(engine, reference):
    s = static_scheduler(engine)
    try:
        cancel_after_tokens(s, PROMPTS[0], 200)
        assert s.executor.batch.rows == 0
        # all ROWS rows at once: a row the cancelled request kept would make the last join fail
        assert run_concurrently(s, PROMPTS[:ROWS], MAX_NEW[:ROWS], stagger_s=0) == reference[:ROWS]
    finally:
        s.stop()


def test_a_bucket_is_captured_on_its_second_step_and_replayed_after_with_the_same_tokens(engine, reference):
    graphs = RerunGraphs()
    s = static_scheduler(engine, graphs)
    try:
        assert run_concurrently(s, PROMPTS, MAX_NEW) == reference
        steps = s.decode_steps
    finally:
        s.stop()
    replays = sum(g.replays for g in graphs.captured)
    assert graphs.captured and replays == steps["graph"] > 0
    # each captured bucket ran eagerly exactly once before its capture (the capture step replays)
    assert steps["eager"] >= len(graphs.captured)


def test_a_failed_capture_is_one_declined_event_and_a_count_and_decode_goes_on_eagerly(engine, reference, caplog):
    graphs = FailingGraphs()
    before = engine.cache.stats()["declined"].get("serve_graph:capture_failed", 0)
    with caplog.at_level(logging.WARNING, logger=log.LOGGER_NAME):
        s = static_scheduler(engine, graphs)
        try:
            assert run_concurrently(s, PROMPTS, MAX_NEW) == reference
            steps = s.decode_steps
        finally:
            s.stop()
    events = declined_events(caplog)
    assert len(events) == 1 and events[0]["reason"] == "capture_failed" and events[0]["fallback"] == "eager"
    assert graphs.calls == 1 and steps["graph"] == 0
    assert engine.cache.stats()["declined"]["serve_graph:capture_failed"] == before + 1


def test_an_attention_without_4d_masks_falls_back_to_the_left_padded_batch_with_one_event(engine, caplog, monkeypatch):
    from moe_offload.serve.executor import make_batch

    monkeypatch.setattr(engine.model.config, "_attn_implementation", "flash_attention_2")  # no such kernel runs here
    before = engine.cache.stats()["declined"].get("serve_graph:static_kv_unavailable", 0)
    with caplog.at_level(logging.WARNING, logger=log.LOGGER_NAME):
        batch = make_batch(engine, ServeConfig(max_batch=ROWS), "static")
    assert isinstance(batch, LeftPaddedBatch)
    assert engine.cache.stats()["declined"]["serve_graph:static_kv_unavailable"] == before + 1
    events = declined_events(caplog)
    assert len(events) == 1 and events[0]["reason"] == "static_kv_unavailable"


def test_serving_from_static_rows_limits_max_model_len_to_their_positions(engine):
    s = Scheduler(engine, ServeConfig(max_batch=2),
                  LocalExecutor(engine, ServeConfig(), StaticBatch(engine, 2, MAX_LEN)))
    assert s.max_model_len == MAX_LEN  # the tiny model's own limit is 4096
    with pytest.raises(ConfigError, match="decode.max_cache_len"):
        Scheduler(engine, ServeConfig(max_model_len=MAX_LEN + 1),
                  LocalExecutor(engine, ServeConfig(), StaticBatch(engine, 2, MAX_LEN)))


@pytest.mark.parametrize("kv", ["static", "dynamic"])
def test_max_model_len_above_the_model_s_positions_is_refused_whatever_the_kv_cache(engine, kv):
    """The tiny model has 4096 positions: a longer serve.max_model_len would let requests run past them (a dynamic KV
    cache has no positions of its own to stop it), so the scheduler refuses it by name."""
    batch = LeftPaddedBatch(engine) if kv == "dynamic" else StaticBatch(engine, 2, 8192)
    with pytest.raises(ConfigError, match=r"serve.max_model_len=4097 is more than the model's 4096 positions"):
        Scheduler(engine, ServeConfig(max_model_len=4097), LocalExecutor(engine, ServeConfig(), batch))
    ok = Scheduler(engine, ServeConfig(max_model_len=4096), LocalExecutor(engine, ServeConfig(), batch))
    assert ok.max_model_len == 4096


def test_a_step_takes_the_smallest_bucket_of_rows_and_positions_holding_it(engine):
    assert buckets(1) == [1] and buckets(8) == [1, 2, 4, 8] and buckets(6) == [1, 2, 4, 6]
    batch = StaticBatch(engine, 6, 100)  # 100 positions: not a power of two
    assert batch.bucket(1, 0) == (1, 32)
    assert batch.bucket(3, 32) == (4, 64)  # position 32 is the 33rd column
    assert batch.bucket(5, 70) == (6, 100)  # capped at the positions per row
    with pytest.raises(ValueError, match="decode.max_cache_len"):
        batch.bucket(1, 100)


def test_with_decode_path_auto_buckets_above_the_routed_threshold_run_eagerly_staged_and_give_the_same_tokens(
        tiny_ckpt, reference):
    # decode.path auto, routed threshold 1: the 1-row bucket is captured (routed), the 2- and 4-row buckets
    # are declined (counted once per step as serve_graph:batch_staged) and run eagerly on the staged path
    eng = make_engine(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), "decode.path=auto", "prefill.routed_max_tokens=1")
    assert eng.cache.routed_max_tokens == 1
    graphs = RerunGraphs()
    s = static_scheduler(eng, graphs)
    try:
        assert run_concurrently(s, PROMPTS, MAX_NEW) == reference
    finally:
        s.stop()
    st = eng.cache.stats()
    assert st["declined"].get("serve_graph:batch_staged", 0) > 0
    assert st["prefills"] > len(PROMPTS)  # staged decode steps beside the prompts' own prefills
    assert all(rows == 1 for rows, _positions in s.executor.batch._graph)  # only routed buckets were captured
