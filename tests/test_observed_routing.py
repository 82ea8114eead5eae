"""Observed routing (moe_offload/observed_routing.py, prefill_path.AdaptiveRouting): single prompts above the
cost model's fixed threshold take the routed path where the spread this cache observed for their length makes
it cheaper; the counts are the distinct experts each layer routed; the outputs equal the staged path's."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from moe_offload.cache import OffloadMoeCache
from moe_offload.config import load_config
from moe_offload.engine import Engine
from moe_offload.observed_routing import ObservedRouting
from moe_offload.prefill_path import ADAPTIVE_MARGIN, AdaptiveRouting, CostModel, cost_model, distinct, resolve
from moe_offload.streams import Streams

H200 = "NVIDIA H200"
QWEN3 = (128, 8, 2658304)  # experts, top-k, NVFP4 row bytes of the qwen3-30b-a3b preset


def _h200(resident=0.37, cap=256):
    model, _ = cost_model(H200, *QWEN3)
    fixed = model.threshold(*QWEN3, resident, 4096)
    return AdaptiveRouting(model, *QWEN3, resident, fixed, cap), model


def _distinct_for_share(model, T, share):
    return distinct(share * T, 128, 8)


def test_uniform_observations_change_nothing_and_skewed_ones_route_what_the_model_then_prefers():
    ad, model = _h200()
    assert ad.fixed_max_tokens == 19  # the uniform model's crossover at residency 0.37 on the H200 constants
    assert not ad.routes(64)  # nothing observed: the fixed threshold stands
    for _ in range(3):
        ad.observe(64, [distinct(64, 128, 8)] * 48)  # uniform routing
    assert ad.share(64) == pytest.approx(1.0, abs=1e-6) and not ad.routes(64)
    # the d9f7bae H200 run: a 64-token prompt of the synthetic preset routed ~23 distinct experts per layer
    sk, _ = _h200()
    for _ in range(2):
        sk.observe(64, [22.6] * 48)
    s = sk.share(64)
    assert s == pytest.approx(math.log(1 - 22.6 / 128) / math.log(1 - 8 / 128) / 64, rel=1e-9)
    assert sk.routes(64) and sk.routes(40)  # the same bucket (32, 64]
    D = distinct(s * 64, 128, 8)
    assert model.routed_s(64, *QWEN3, 0.37, D) < ADAPTIVE_MARGIN * model.staged_s(64, *QWEN3, 0.37)


def test_an_unobserved_length_borrows_the_nearest_shorter_spread_which_errs_towards_staging():
    ad, model = _h200()
    ad.observe(64, [22.6] * 48)
    assert ad.share(64) is None  # one forward is not enough
    ad.observe(64, [22.6] * 48)
    assert ad.share(256) == ad.share(64) and ad.share(32) is None  # only shorter buckets lend their spread
    # a 64-token share extrapolated to 256 tokens predicts ~69 experts: staged, although the run measured
    # routed faster at 256 tokens (27 experts); once 256-token prompts are observed they route
    assert not ad.routes(256)
    for _ in range(2):
        ad.observe(256, [26.6] * 48)
    assert ad.routes(256)
    assert not ad.routes(257 + 256)  # above routed_adaptive_max_tokens: always staged
    assert ad.to_dict()["share_by_tokens"]["<=256"]["forwards"] == 2


def test_resolve_turns_observed_routing_on_only_above_a_cost_model_threshold(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H200)
    cuda = torch.device("cuda", 0)
    on = resolve("auto", 16, *QWEN3, 0.37, cuda, True, adaptive_max_tokens=256)
    assert (on.max_tokens, on.adaptive_max_tokens, on.record_tokens, on.adaptive_off) == (19, 256, 256, None)
    full = resolve("auto", 16, *QWEN3, 1.0, cuda, True, adaptive_max_tokens=32)  # threshold 64 >= 32
    assert full.adaptive_max_tokens == 0 and "at least" in full.adaptive_off
    fixed = resolve(40, 16, *QWEN3, 0.37, cuda, True, adaptive_max_tokens=256)
    assert fixed.adaptive_max_tokens == 0 and fixed.record_tokens == 40  # a fixed setting is the operator's
    cpu = resolve("auto", 16, *QWEN3, 0.37, torch.device("cpu"), True, adaptive_max_tokens=256)
    assert cpu.adaptive_max_tokens == 0 and cpu.adaptive_off == "no cost model (cpu_device)"


def test_the_observer_counts_the_distinct_experts_of_each_layer_and_skips_forwards_that_raised():
    model = CostModel(55.0, 48.0, 1e-4, 4000.0, 4e-5, 8.0, 2e-7, 4e-4, 11.0, 3e-8, 64)
    ad = AdaptiveRouting(model, 16, 4, 1 << 20, 0.5, 4, 64)
    obs = ObservedRouting(ad, (3, 5), 16, 4, torch.device("cpu"), Streams(torch.device("cpu")))
    assert obs.begin(10, 1) is False and obs.routed(10) is False and obs.routed(4) is True
    obs.layer(3, torch.tensor([[0, 1, 2, 3]] * 10))  # 4 distinct
    obs.layer(5, torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]] * 5))  # 8 distinct
    obs.end(True)
    obs.begin(10, 1)  # collects the previous forward
    want = ad.effective_tokens(6.0) / 10  # the mean over layers
    assert ad.buckets[ad.bucket(10)] == [pytest.approx(want), 1]
    obs.layer(3, torch.tensor([[9, 9, 9, 9]] * 10))
    obs.end(False)  # raised: not observed
    obs.begin(10, 1)
    assert ad.buckets[ad.bucket(10)][1] == 1
    obs.end(True)
    assert obs.begin(10, 2) is False and obs.plan == (10, False, False)  # two sequences: neither routed nor observed
    obs.end(True)
    assert obs.begin(3, 1) is True and obs.plan == (3, True, False)  # a decode-sized forward is not observed


def make_adaptive_engine(tiny_ckpt) -> Engine:
    """A CPU engine whose cache observes routing under a cost model where skewed prompts route."""
    cfg = load_config(None, [f"model.checkpoint={tiny_ckpt('tiny-qwen3-moe', 'nvfp4-modelopt')}", "model.format=auto",
                             "device=cpu", "cache.budget=0.37", "prefill.hit_copy=gather", "decode.max_tokens=4",
                             "prefill.routed_adaptive_max_tokens=64", "logging.level=WARNING"])
    eng = Engine.from_config(cfg, progress=False)
    # a model whose uniform crossover sits at its measured limit of 4 tokens, and where a skew routes longer
    # prompts: staging costs a fixed 5 ms a layer, the routed path grows with its distinct experts
    model = CostModel(h2d_GBps=55.0, uva_GBps=48.0, uva_fixed_s=1e-4, hbm_GBps=4000.0, routed_fixed_s=4e-5,
                      routed_hbm_factor=8.0, routed_pair_s=2e-7, staged_fixed_s=5e-3, staged_hbm_factor=0.0,
                      staged_pair_s=0.0, max_tokens=4)
    eng.replace_cache(OffloadMoeCache(eng.store, cfg.cache, cfg.prefill, "cpu", 4, cost_model=(model, "test"),
                                      observe_routing=True))
    return eng


@pytest.fixture(scope="module")
def engine(tiny_ckpt):
    return make_adaptive_engine(tiny_ckpt)


def test_a_prompt_length_is_staged_until_observed_then_routed_with_the_staged_logits(engine):
    cache = engine.cache
    assert cache.routed_max_tokens == 4 and cache.routed_path.adaptive_max_tokens == 64
    ids = torch.randint(3, 300, (1, 32), generator=torch.Generator().manual_seed(1))
    paths, outs = [], []
    for _ in range(3):
        cache.reset()
        logits, _ = engine.prefill(ids)
        st = cache.stats()
        paths.append("routed" if st["decode_steps"] else "staged")
        outs.append(logits)
    assert paths == ["staged", "staged", "routed"]  # two observed forwards, then the spread decides
    seen = cache.stats()["routed_adaptive"]
    assert seen["routed_forwards"] == 1 and seen["staged_forwards"] == 0  # since the last reset (before the 3rd)
    assert seen["share_by_tokens"]["<=32"]["forwards"] >= 2
    # fp32 on the CPU: the same sums in another order (tests/test_prefill_path.py's tolerance)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-4, rtol=0)
    big = torch.randint(3, 300, (1, 100), generator=torch.Generator().manual_seed(2))
    for _ in range(3):
        cache.reset()
        engine.prefill(big)
        assert cache.stats()["prefills"] == 1  # above routed_adaptive_max_tokens: staged however observed


def test_greedy_generation_is_unchanged_when_prompts_switch_path(engine):
    prompt = list(range(10, 42))  # 32 tokens: routed once its length has been observed twice
    first = engine.generate(prompt, 8).token_ids
    for _ in range(2):
        assert engine.generate(prompt, 8).token_ids == first
    assert np.isfinite(engine.cache.stats()["routed_adaptive"]["share_by_tokens"]["<=32"]["share"])


def test_the_warmup_on_random_ids_leaves_no_observed_spread_and_a_nested_forward_keeps_the_outer_plan(engine):
    engine.prefill(torch.randint(3, 300, (1, 32), generator=torch.Generator().manual_seed(3)))
    engine.cache.synchronize()
    engine.warmup()
    assert engine.cache.stats()["routed_adaptive"]["share_by_tokens"] == {}
    obs = engine.cache.observed
    assert obs.begin(32, 1) is False and obs.plan == (32, False, True)
    assert obs.begin(2, 1) is True  # a forward inside it: fixed threshold, the outer plan untouched
    obs.end(True)
    assert obs.plan == (32, False, True) and obs.routed(32) is False
    obs.end(False)
    assert obs.plan is None and obs.depth == 0
