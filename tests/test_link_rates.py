"""This host's link rates (moe_offload/link_rates.py) and the cost model that decides with them (prefill.measure_link).
On a CPU the SM reads are the reference copy and the rates are host memcpy rates: these tests check the bytes, the
substitution into the model and the events, not the numbers (tests/gpu/test_link_rates_gpu.py times a real link)."""

import io
import json
import logging

import pytest
import torch

from moe_offload import link_rates, log, uva
from moe_offload.cache import OffloadMoeCache
from moe_offload.config import CacheConfig, PrefillConfig, load_config
from moe_offload.host_store import ExpertStore
from moe_offload.kernels import decode_miss
from moe_offload.link_rates import LinkError, LinkUnmeasurable, link_model, measure_link, measured_link_model
from moe_offload.prefill_path import cost_model

H200 = "NVIDIA H200"
QWEN3 = (128, 8, 2658304)  # experts, top-k, NVFP4 row bytes of the qwen3-30b-a3b preset


@pytest.fixture(scope="module")
def store(tiny_ckpt):
    return ExpertStore.from_checkpoint(tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt"), progress=False)


@pytest.fixture(scope="module")
def big(qwen3_layer_store):
    return qwen3_layer_store(pin=False)


def _measure_on_a_busy_cpu(store):
    """measure_link on the CPU, again when a timing came out as noise: real copies timed on a machine whose other
    work can make the larger copy no slower than the smaller (CI run beside a CPU benchmark, 71fe0f3); the product
    then declines the measurement by name, which ``test_a_rate_is_the_slope...`` covers."""
    for attempt in range(3):
        try:
            return measure_link(store, torch.device("cpu"))
        except LinkUnmeasurable as exc:
            if "timing noise" not in str(exc) or attempt == 2:
                raise


def test_both_rates_are_measured_on_the_store_s_own_rows(big):
    rates = _measure_on_a_busy_cpu(big)
    assert rates.h2d_GBps > 0 and rates.uva_GBps > 0
    assert (rates.rows, rates.row_bytes, rates.layer) == (32, big.bytes_per_expert, big.layers[0])


def test_a_rate_is_the_slope_between_two_sizes_so_a_fixed_cost_does_not_lower_it():
    times = {100: ([1.0, 1.1, 0.9], 100), 400: ([2.0, 2.2, 1.9], 400)}  # 1 s fixed + 100 bytes a second
    assert link_rates._slope(times.get, 100, 400, "x") == pytest.approx(300 / 1.0 / 1e9)
    with pytest.raises(LinkUnmeasurable, match="x: 400 bytes took no longer than 100"):
        link_rates._slope({100: ([2.0], 100), 400: ([2.0], 400)}.get, 100, 400, "x")


def _scripted(monkeypatch, uva_large_s: list[float], h2d_large_s: list[float]):
    """Fault injection: each round's larger copy takes the next of these seconds (the smaller one 1 ms, a quarter of
    the bytes), so each round's rate is known; the real copies are not run."""
    def script(large_s):
        seq = iter(large_s)

        def times(store, layer, device, k, reps):
            return ([1e-3] if k < 32 else [next(seq)]), k * 1_000_000
        return times

    monkeypatch.setattr(link_rates, "sm_read_times", script(uva_large_s))
    monkeypatch.setattr(link_rates, "copy_engine_times", script(h2d_large_s))


def test_each_rate_is_the_median_of_its_rounds_and_an_out_of_order_round_is_dropped(big, monkeypatch):
    """At 74b55da one cache of four measured the copy engine at 28.75 GB/s against 55: three rounds, each rate their
    median (a rate is a slope between two sizes, so a disturbed round can read high as well as low); a round whose
    larger copy was no slower is left out with both its rates."""
    # rates: 24e6 bytes over (large - 1 ms) seconds
    _scripted(monkeypatch, [1.5e-3, 1.6e-3, 1.5e-3], [1.4e-3, 1.8e-3, 1.3e-3])  # round 2's copy engine disturbed
    rates = measure_link(big, torch.device("cpu"))
    assert rates.uva_rounds_GBps == pytest.approx((48.0, 40.0, 48.0))
    assert rates.h2d_rounds_GBps == pytest.approx((60.0, 30.0, 80.0))
    assert (rates.uva_GBps, rates.h2d_GBps) == pytest.approx((48.0, 60.0))  # the outliers either way do not decide
    assert rates.to_dict()["h2d_rounds_GBps"] == rates.h2d_rounds_GBps and link_rates.LINK_ROUNDS == 3
    # round 3's SM reads out of order: the round is dropped; two rounds left, their median is their mean
    _scripted(monkeypatch, [1.5e-3, 1.5e-3, 0.5e-3], [1.4e-3, 1.8e-3, 1.4e-3])
    rates = measure_link(big, torch.device("cpu"))
    assert rates.uva_rounds_GBps == pytest.approx((48.0, 48.0)) and rates.h2d_rounds_GBps == pytest.approx((60.0, 30.0))
    assert rates.h2d_GBps == pytest.approx(45.0)
    # round 2's copy engine out of order after its SM reads were timed: that round's SM-read rate goes too
    _scripted(monkeypatch, [1.5e-3, 1.25e-3, 1.5e-3], [1.4e-3, 0.5e-3, 1.4e-3])
    rates = measure_link(big, torch.device("cpu"))
    assert rates.uva_rounds_GBps == pytest.approx((48.0, 48.0)) and rates.h2d_rounds_GBps == pytest.approx((60.0, 60.0))
    with pytest.raises(ValueError, match="at least one round"):
        measure_link(big, torch.device("cpu"), rounds=0)


def test_a_measurement_whose_every_round_is_out_of_order_is_unmeasurable(big, monkeypatch):
    _scripted(monkeypatch, [1.5e-3] * 3, [0.5e-3] * 3)
    with pytest.raises(LinkUnmeasurable, match="every one of 3 rounds was out of order; the last: the copy engine"):
        measure_link(big, torch.device("cpu"))


def test_a_store_too_small_to_time_is_not_measured(store, monkeypatch):
    with pytest.raises(LinkUnmeasurable, match="fewer than the 16777216 a rate needs"):
        measure_link(store, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H200)
    model, link = link_model(store, PrefillConfig(), torch.device("cuda", 0), True, False)
    assert model is None and "too small to time a rate" in link["off"]


def test_a_copy_that_gives_wrong_bytes_voids_the_measurement_with_a_named_error(big, monkeypatch):
    real = decode_miss.serve_misses_reference

    def corrupt(slot_of_E, ids, host_ER, pool_NR, base, *args):  # fault: one flipped byte in the last row
        rows = real(slot_of_E, ids, host_ER, pool_NR, base, *args)
        pool_NR[-1, 0] ^= 0xFF
        return rows

    monkeypatch.setattr(decode_miss, "serve_misses_reference", corrupt)
    with pytest.raises(LinkError, match="SM read of layer 0, expert 7 gave wrong bytes"):
        measure_link(big, torch.device("cpu"), rows=32, reps=1)


def test_a_slow_sm_read_link_lowers_the_routed_threshold():
    """The host at de3b3ad read mapped memory at 25.7 GB/s (the table: 47.99): fewer tokens pay for SM reads."""
    table, _ = cost_model(H200, *QWEN3)
    from dataclasses import replace

    slow = replace(table, uva_GBps=25.7)
    assert slow.threshold(*QWEN3, 0.37, 4096) < table.threshold(*QWEN3, 0.37, 4096)


def test_the_measured_rates_replace_the_table_s_in_the_model_with_one_event(big, monkeypatch):
    table = cost_model(H200, *QWEN3)
    rates = _measure_on_a_busy_cpu(big)  # measured here (again where a busy CPU made it noise), then substituted
    monkeypatch.setattr(link_rates, "measure_link", lambda store, device: rates)
    buf = io.StringIO()
    log.configure("INFO", "json", stream=buf)
    try:
        (model, entry), link = measured_link_model(big, torch.device("cpu"), table)
    finally:
        log.configure("WARNING", "text")
    assert (model.h2d_GBps, model.uva_GBps) == (link["h2d_GBps"], link["uva_GBps"])
    assert model.routed_fixed_s == table[0].routed_fixed_s  # only the two rates change
    assert entry == f"{table[1]} (link measured)" and link["table_uva_GBps"] == table[0].uva_GBps
    events = [r for r in map(json.loads, buf.getvalue().splitlines()) if r["event"] == "link_rates_measured"]
    assert len(events) == 1 and events[0]["change_with"] == "prefill.measure_link"
    assert events[0]["hint"] == link.get("hint")


def test_sm_reads_far_below_the_copy_engine_get_a_hint_naming_decode_path_auto(big, monkeypatch):
    from moe_offload.link_rates import LinkRates

    slow = LinkRates(h2d_GBps=49.4, uva_GBps=25.7, rows=32, row_bytes=big.bytes_per_expert, reps=5, layer=0)
    fast = LinkRates(h2d_GBps=54.9, uva_GBps=46.8, rows=32, row_bytes=big.bytes_per_expert, reps=5, layer=0)
    links = []
    for rates in (slow, fast):  # the measurement replaced by the two hosts' measured rates
        # (benchmarks/results/HISTORY.md)
        monkeypatch.setattr(link_rates, "measure_link", lambda store, device, r=rates: r)
        links.append(measured_link_model(big, torch.device("cpu"), cost_model(H200, *QWEN3))[1])
    assert "0.52 x" in links[0]["hint"] and "decode.path: host or auto" in links[0]["hint"]
    assert "hint" not in links[1]


def test_a_device_that_cannot_map_the_store_keeps_the_table_s_rates_with_one_event(big, monkeypatch, caplog):
    def unmappable(layer, device):  # fault: what uva.mapped_device_view raises where the GPU cannot map host memory
        raise uva.UvaError("cannot map host memory")

    monkeypatch.setattr(big, "device_rows", unmappable)
    log.reset_once_keys()
    with caplog.at_level(logging.WARNING, logger=log.LOGGER_NAME):
        model, link = measured_link_model(big, torch.device("cpu"), cost_model(H200, *QWEN3))
    assert model is None and link["declined"] == "uva_unavailable"
    events = [r for r in caplog.records if getattr(r, "event_fields", {}).get("event") == "link_measure_declined"]
    assert len(events) == 1 and events[0].event_fields["setting"] == "prefill.measure_link"


def test_nothing_is_measured_on_a_cpu_with_a_fixed_threshold_or_when_switched_off(store, monkeypatch):
    assert link_model(store, PrefillConfig(), torch.device("cpu"), True, False) == (None, None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H200)
    cuda = torch.device("cuda", 0)
    assert link_model(store, PrefillConfig(routed_max_tokens=64), cuda, True, False) == (None, None)
    assert link_model(store, PrefillConfig(measure_link=False), cuda, True, False)[1] == {
        "off": "prefill.measure_link is false"}
    assert "tensor parallelism" in link_model(store, PrefillConfig(), cuda, True, True)[1]["off"]


def test_a_declined_measurement_is_counted_in_stats(store, monkeypatch):
    cache = OffloadMoeCache(store, CacheConfig(budget=0.5), PrefillConfig(), "cpu")
    assert cache.stats()["routed_path"]["link"] is None  # a CPU measures nothing
    from dataclasses import replace

    cache.routed_path = replace(cache.routed_path, link={"declined": "uva_unavailable"})
    assert cache.stats()["declined"]["link_measure:uva_unavailable"] == 1


def test_measure_link_is_a_config_key_that_defaults_on():
    assert load_config(None).prefill.measure_link is True
    assert load_config(None, ["prefill.measure_link=false"]).prefill.measure_link is False
