"""Serving under TP=2 on the CPU (two gloo ranks): rank 0 schedules and samples, rank 1 replays its ops."""

from __future__ import annotations

import pytest

from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.launch import run_on_ranks
from moe_offload.serve.tp import generate_rank

PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 60)), [100], [42] * 17]
MAX_NEW = [10, 3, 12, 8, 6]


def _cfg(path: str, *overrides: str):
    # decode.max_tokens=2: decode batches of 3+ sequences take the experts' prefill path under TP too
    return load_config(None, [f"model.checkpoint={path}", "model.format=auto", "device=cpu", "logging.level=WARNING",
                              "decode.max_tokens=2", "prefill.warmup_tokens=8", "prefill.chunk_tokens=16", *overrides])


@pytest.mark.parametrize("kv, batch_tokens", [("dynamic", 0), ("static", 0), ("static", 64)],
                         ids=["dynamic", "static", "static-prefill_batch"])
def test_tp2_serving_gives_every_request_the_greedy_tokens_of_tp1_engine_generate(tiny_ckpt, kv, batch_tokens):
    # static: the follower loads, moves and frees the same static KV rows as rank 0; prefill_batch: queued
    # prompts are prefilled together on both ranks (the follower replays the prefill_batch op)
    path = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    tp1 = Engine.from_config(_cfg(path), progress=False)
    ref = [tp1.generate(p, n).token_ids for p, n in zip(PROMPTS, MAX_NEW)]
    jobs = [(p, {"max_tokens": n, "ignore_eos": True}) for p, n in zip(PROMPTS, MAX_NEW)]
    got = run_on_ranks(_cfg(path, "parallel.tp=2", "decode.max_cache_len=128"), generate_rank,
                       {"max_batch": 3, "prefill_batch_tokens": batch_tokens}, jobs, kv)
    assert got == ref
