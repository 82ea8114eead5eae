"""Structured logging: stable event names, fields, rank on every record, once-per-key."""

import io
import json

from moe_offload import log


def _capture(fmt):
    buf = io.StringIO()
    log.configure("INFO", fmt, stream=buf)
    return buf


def test_text_records_carry_event_fields_rank_and_world_size():
    buf = _capture("text")
    log.set_rank(1, 2)
    try:
        log.warning("demo_event", reason="x y", n=3)
    finally:
        log.set_rank(0, 1)
    line = buf.getvalue().strip()
    assert line.startswith("WARNING event=demo_event")
    assert 'reason="x y"' in line and "n=3" in line and "rank=1" in line and "world_size=2" in line


def test_json_records_are_one_object_per_line():
    buf = _capture("json")
    log.event("a", x=1)
    log.event("b", y="z")
    rows = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert [r["event"] for r in rows] == ["a", "b"] and rows[0]["rank"] == 0 and rows[1]["world_size"] == 1


def test_log_once_logs_a_key_once_per_process():
    buf = _capture("text")
    assert log.log_once("k", "once_event") is True
    assert log.log_once("k", "once_event") is False
    assert buf.getvalue().count("once_event") == 1


def test_info_rank0_is_silent_on_other_ranks():
    buf = _capture("text")
    log.set_rank(1, 2)
    try:
        log.info_rank0("hello")
    finally:
        log.set_rank(0, 1)
    log.info_rank0("hello0")
    out = buf.getvalue()
    assert "event=hello " not in out and "event=hello0" in out
