"""A CPU `bench ttft` gives no target verdicts: there is no PCIe link, so its floors are not floors."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from moe_offload.cli import main as cli_main


@pytest.fixture(scope="module")
def cpu_bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    argv = ["bench", "ttft", "--reps", "1", "--prompt-lens", "64", "--residency", "0,0.37,0.5,1", "--modes",
            "gather,off", "--peers", "none", "--set", "device=cpu", "--set", f"model.cache_dir={out / 'cache'}",
            "--set", "logging.level=WARNING", "--out", str(out)]
    with contextlib.redirect_stdout(io.StringIO()) as buf:
        assert cli_main(argv) == 0
    (written,) = out.glob("ttft-*.json")
    return json.loads(written.read_text()), buf.getvalue()


def test_no_target_of_a_cpu_run_is_met_or_missed(cpu_bench):
    result, _ = cpu_bench
    assert result["targets"] and all(t["met"] is None and "targets apply on CUDA" in t["detail"]
                                     for t in result["targets"])


def test_the_cpu_markdown_prints_no_verdicts_and_no_floor_ratios(cpu_bench):
    _, text = cpu_bench
    assert "No verdicts: targets apply on CUDA" in text and "| NO |" not in text and "| yes |" not in text
    assert "| 0 | 0.0 | n/a |" in text
