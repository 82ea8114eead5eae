"""benchmarks/profile_decode.py's split of a replayed decode step's idle GPU time: gaps between kernels inside a
replay against the host's stretches between steps (CPU: synthetic traces and a trace an H100 recorded)."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_decode", ROOT / "benchmarks" / "profile_decode.py")
profile_decode = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_decode)
boundary_gaps = profile_decode.boundary_gaps


def _trace(*events):
    return [{"name": n, "start_us": s, "us": d} for n, s, d in events]


def test_short_gaps_are_boundaries_long_ones_the_hosts():
    # step 1: a (0-10) b (10.5-20) a (21-30); the host: 50 us; step 2: a (80-90) b (90.5-100)
    tr = _trace(("a", 0, 10), ("b", 10.5, 9.5), ("a", 21, 9), ("a", 80, 10), ("b", 90.5, 9.5))
    g = boundary_gaps(tr, steps=2)
    assert g["host_us_per_step"] == pytest.approx(25.0)
    assert g["inside_us_per_step"] == pytest.approx((0.5 + 1.0 + 0.5) / 2)
    assert g["boundaries_per_step"] == pytest.approx(1.5)
    assert g["inside_us_per_boundary"] == pytest.approx(2.0 / 3)
    ab, ba = g["by_transition"]
    assert (ab["from"], ab["to"], ab["count_per_step"], ab["mean_us"]) == ("a", "b", 1.0, pytest.approx(0.5))
    assert (ba["from"], ba["to"], ba["us_per_step"]) == ("b", "a", pytest.approx(0.5))


def test_overlapping_events_count_no_negative_gap():
    g = boundary_gaps(_trace(("a", 0, 10), ("b", 8, 5)), steps=1)
    assert g["inside_us_per_step"] == 0.0 and g["boundaries_per_step"] == 1.0


def test_an_empty_or_single_event_trace_has_no_boundaries():
    assert boundary_gaps([], steps=1)["inside_us_per_boundary"] == 0.0
    assert boundary_gaps(_trace(("a", 0, 1)), steps=1)["by_transition"] == []


def test_the_h100_batch16_trace_idles_under_half_a_microsecond_a_boundary():
    """The graph trace of bb13400 on an H100 (8 layers, batch 16, PDL off at that commit's default): the replay's
    kernels sit ~0.5 us apart, ~18 boundaries a layer, ~4 % of the replay's kernel time; the host's stretches
    between steps are far longer (benchmarks/results/HISTORY.md "bb13400 / 3ce9df3 on an H100")."""
    d = json.loads((ROOT / "benchmarks/results/profile-decode-l8-r1.0-b16-bb13400-h100f.json").read_text())
    g = boundary_gaps(d["graph_trace"], steps=2)
    assert 0.3 < g["inside_us_per_boundary"] < 0.7
    assert 14 * 8 <= g["boundaries_per_step"] <= 18 * 8 + 20
    assert g["inside_us_per_step"] < 0.06 * d["graph_busy_ms"] * 1e3  # ~4 % of the replay's kernel time
    assert g["host_us_per_step"] > 3 * g["inside_us_per_step"]
