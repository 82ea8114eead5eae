"""benchmarks/serve_overhead.py on the embedded tiny model (CPU): every layer of the serving stack is timed on
the same engine and prompts, and the profiles are of the thread that ran the prefill."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("serve_overhead", ROOT / "benchmarks" / "serve_overhead.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_serve_overhead_times_each_layer_of_the_stack_and_profiles_the_loop_thread(tmp_path, capsys):
    so = _module()
    assert so.main(["--prompt-len", "16", "--prompts", "2", "--max-tokens", "4", "--rows", "1,2",
                    "--out", str(tmp_path), "--profile", str(tmp_path / "prof")]) == 0
    res = json.loads(next(tmp_path.glob("serve-overhead-*.json")).read_text())
    assert set(res["ttft_ms"]) == {"engine", "engine_thread", "scheduler", "scheduler_submit", "scheduler_http",
                                   "scheduler_http_submit", "engine_after"}
    assert all(v > 0 for v in res["ttft_ms"].values())
    # the host time of each variant's prefill forward is part of its TTFT
    assert set(res["enqueue_ms"]) == {"engine", "engine_thread", "scheduler", "scheduler_http", "engine_after"}
    for k, v in res["enqueue_ms"].items():
        assert 0 < v <= res["ttft_ms"][k], k
    # the submitter's clock starts before the scheduler's (queue wait) and ends at the sink, after sampling
    assert res["ttft_ms"]["scheduler_submit"] >= res["ttft_ms"]["scheduler"]
    assert [d["rows"] for d in res["decode"]] == [1, 2]
    for d in res["decode"]:
        assert d["steps"] >= 1 and d["ms_per_step"] > 0 and d["reference_ms_per_step"] > 0
        assert d["ratio"] == round(d["ms_per_step"] / d["reference_ms_per_step"], 3)
    for name in ("engine_thread", "scheduler", "engine_after"):
        text = (tmp_path / "prof" / f"profile-{name}.txt").read_text()
        assert "aten::" in text, name  # recorded on the thread that ran the forward, not an empty table
    assert "| engine_after |" in capsys.readouterr().out
