"""benchmarks/profile_prefill.py's ``device_idle``: the stretches in which no stream of the device runs anything,
from a chrome trace's GPU events (CPU: synthetic traces)."""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("profile_prefill", ROOT / "benchmarks" / "profile_prefill.py")
profile_prefill = importlib.util.module_from_spec(spec)
spec.loader.exec_module(profile_prefill)
device_idle = profile_prefill.device_idle


def _ev(name, ts, dur):
    return {"name": name, "ts": ts, "dur": dur}


def test_only_stretches_where_every_stream_idles_count_and_short_boundaries_do_not():
    # a (0-10); a copy on another stream (5-40) covers a's gap to b (30-35); nothing runs from 40 to 100 (60 us,
    # after the copy); c (100-110), d (112-120): a 2 us boundary, not counted; nothing from 120 to 150 (30 us)
    ev = [_ev("a", 0, 10), _ev("Memcpy HtoD", 5, 35), _ev("b", 30, 5), _ev("c", 100, 10), _ev("d", 112, 8),
          _ev("e", 150, 10)]
    g = device_idle(ev, layers=2)
    assert g["stretches"] == 2 and g["idle_ms"] == pytest.approx(0.09)
    assert g["idle_us_per_layer"] == pytest.approx(45.0)
    first, second = g["by_transition"]
    assert (first["after"], first["before"], first["total_us"]) == ("Memcpy HtoD", "c", 60.0)
    assert (second["after"], second["before"], second["total_us"]) == ("d", "e", 30.0)


def test_events_out_of_order_and_nested_ones_give_no_negative_idle():
    ev = [_ev("b", 20, 5), _ev("a", 0, 50), _ev("c", 70, 1)]  # b inside a: the stretch begins at a's end
    g = device_idle(ev, layers=1)
    assert g["stretches"] == 1 and g["by_transition"][0]["after"] == "a" and g["idle_ms"] == pytest.approx(0.02)
    assert device_idle([], layers=4)["idle_ms"] == 0.0
