"""CPU smoke test of ``moe-offload bench ttft`` on the embedded tiny model (the CI run of the benchmark).

One bench run (module fixture, ~10 s on 2 cores) with the smallest sweep that still shows the
behaviours: residency 0, 0.5 and 1 (the tiny model has 16 experts per layer, so these are exactly
0, 8 and 16 resident experts), modes gather (works on the CPU) and off (full-layer copies).
A second run with two TP ranks (spawned, gloo; ~20 s) checks the per-rank figures, and a third
measures short prompts (16 and 64 tokens) on both prefill paths and the runtime's choice. Timings on a
CPU are not checked: only the structure of the report and the byte/hit accounting, which are exact.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from moe_offload.bench.ttft import BenchError, make_plan
from moe_offload.cli import build_parser
from moe_offload.cli import main as cli_main
from moe_offload.config import load_config

RESIDENCIES = (0.0, 0.5, 1.0)


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    """model.cache_dir shared by the runs below: the tiny preset is built once."""
    return tmp_path_factory.mktemp("presets")


@pytest.fixture(scope="module")
def bench(tmp_path_factory, presets):
    """``(rc, printed JSON, written JSON, out dir)`` of one smoke run."""
    out = tmp_path_factory.mktemp("results")
    cache = presets
    argv = ["bench", "ttft", "--json", "--out", str(out), "--reps", "1", "--prompt-lens", "64",
            "--residency", ",".join(f"{r:g}" for r in RESIDENCIES), "--modes", "gather,off",
            "--set", "device=cpu", "--set", f"model.cache_dir={cache}", "--set", "logging.level=WARNING"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli_main(argv)
    written = sorted(out.glob("ttft-*.json"))
    return rc, stdout.getvalue(), json.loads(written[0].read_text()) if written else None, out


def _cell(result, mode, residency):
    (cell,) = [c for c in result["cells"] if c["mode"] == mode and c["residency"] == residency]
    return cell


def test_the_smoke_run_exits_zero_and_prints_the_json_it_writes(bench):
    rc, printed, written, _ = bench
    assert rc == 0
    assert json.loads(printed) == written


def test_the_file_name_carries_the_preset_and_the_git_sha(bench):
    _, _, result, out = bench
    assert (out / f"ttft-tiny-qwen3-moe-{result['git']['sha'][:12]}.json").is_file()


def test_a_markdown_table_is_written_next_to_the_json(bench):
    _, _, _, out = bench
    (md,) = out.glob("ttft-*.md")
    text = md.read_text()
    assert ("| residency | hit % | PCIe floor ms | routed floor ms | gather ms | ×floor | ×routed | path | "
            "off ms | ×floor | ×routed | path |") in text


def test_the_report_records_versions_device_and_resolved_config(bench):
    result = bench[2]
    assert result["versions"]["torch"] and "transformers" in result["versions"]
    assert result["device"]["type"] == "cpu"
    assert result["config"]["model"]["preset"] == "tiny-qwen3-moe"
    assert result["config"]["prefill"]["warmup"] is True


def test_floors_hold_the_bandwidth_and_a_compute_floor_for_each_prompt_length(bench):
    floors = bench[2]["floors"]
    assert floors["h2d"]["GBps"] > 0
    assert floors["pcie_all_miss_s"] > 0
    assert floors["compute"]["64"]["mode"] == "gather"  # off never takes the hit path: not a compute floor
    assert floors["compute"]["64"]["ttft_s"] > 0


def test_every_mode_and_residency_has_a_measured_cell_with_its_floors(bench):
    result = bench[2]
    want = {(m, r) for m in ("gather", "off") for r in RESIDENCIES}
    assert {(c["mode"], c["residency"]) for c in result["cells"]} == want
    for c in result["cells"]:
        assert c["ttft_s"]["median"] > 0 and len(c["ttft_s"]["reps"]) == 1
        assert c["floor_s"] == max(c["pcie_floor_s"], c["compute_floor_s"])
        assert c["ratio_to_floor"] == pytest.approx(c["ttft_s"]["median"] / c["floor_s"])
        assert c["link"] is None  # the rates the cell's cache measured: nothing is timed on a CPU


@pytest.mark.parametrize("mode", ["gather", "off"])
def test_the_measured_hit_fraction_rises_with_residency(bench, mode):
    fractions = [_cell(bench[2], mode, r)["hit_fraction"] for r in RESIDENCIES]
    assert fractions == [0.0, 0.5, 1.0]  # 0, 8 and 16 of 16 experts: exact


def test_mode_off_moves_more_h2d_bytes_than_gather_at_half_residency(bench):
    result = bench[2]
    off, gather = _cell(result, "off", 0.5), _cell(result, "gather", 0.5)
    all_bytes = result["model"]["all_expert_bytes"]
    assert off["bytes"]["h2d"] == all_bytes  # the whole layer, every layer
    assert gather["bytes"]["h2d"] == all_bytes // 2  # only the misses
    # the hits are read in place from their slots (prefill.read_in_place, on by default): no bytes moved for them
    assert gather["bytes"].get("prefill_hit_gather", 0) == 0


def test_gather_takes_the_hit_path_on_the_cpu_and_off_does_not(bench):
    modes = bench[2]["modes"]
    assert (modes["gather"]["hit_path"], modes["off"]["hit_path"]) == ("gather", "full_layer_copy")


def test_peers_are_skipped_with_a_reason_on_the_cpu(bench):
    peers = bench[2]["peers"]
    assert set(peers) == {"accelerate", "full_gpu"}
    assert all(p["status"] == "skipped" and "cpu" in p["reason"] for p in peers.values())


def test_every_target_is_evaluated_or_says_why_not(bench):
    targets = bench[2]["targets"]
    assert {t["id"] for t in targets} == {"ttft_within_1.10x_floor", "all_resident_vs_bf16_grouped_mm",
                                          "speedup_vs_accelerate_at_0.37", "hit_d2d_speedup_vs_off",
                                          "ttft_within_1.10x_routed_floor"}
    for t in targets:
        assert t["met"] in (True, False) or t["detail"], t


@pytest.mark.parametrize("option, value, needle", [
    ("--residency", "0,1.5", "fractions in [0, 1]"),
    ("--modes", "gather,fast", "subset of"),
    ("--prompt-lens", "0", "positive integers"),
    ("--peers", "vllm", "subset of"),
    ("--prefill-path", "staged,fast", "subset of"),
    ("--peer-layers", "2,4,8", "one or two depths"),
])
def test_a_bad_sweep_option_is_an_error_naming_the_option(option, value, needle):
    args = build_parser().parse_args(["bench", "ttft", option, value])
    with pytest.raises(BenchError) as info:
        make_plan(args, load_config(None))
    assert option in str(info.value) and needle in str(info.value)


def test_residency_one_is_always_measured_because_it_is_the_compute_floor():
    plan = make_plan(build_parser().parse_args(["bench", "ttft", "--residency", "0,0.5"]), load_config(None))
    assert plan.residencies == (0.0, 0.5, 1.0)


def test_a_model_with_fewer_than_three_moe_layers_is_refused(tmp_path, capsys):
    # the cache reuses the last two staged layers across passes: a 2-layer pass would copy nothing
    argv = ["bench", "ttft", "--layers", "2", "--set", "device=cpu", "--set", f"model.cache_dir={tmp_path}",
            "--out", str(tmp_path / "out")]
    assert cli_main(argv) == 2
    assert "at least 3" in capsys.readouterr().err


def test_the_pool_holds_exactly_the_resident_experts_so_it_is_full_when_prefill_starts(bench):
    result = bench[2]
    top_k, layers = result["model"]["top_k"], result["model"]["moe_layers"]
    for c in result["cells"]:
        assert c["slots"] == max(c["resident_per_layer"] * layers, top_k)  # top-k: the decode minimum


@pytest.fixture(scope="module")
def bench_tp2(tmp_path_factory, presets):
    """The written JSON of a TP=2 smoke run (two spawned CPU ranks over gloo)."""
    out = tmp_path_factory.mktemp("results-tp2")
    cache = presets
    argv = ["bench", "ttft", "--tp", "2", "--out", str(out), "--reps", "1", "--prompt-lens", "64",
            "--residency", "0,1", "--modes", "gather", "--set", "device=cpu", "--set", f"model.cache_dir={cache}",
            "--set", "logging.level=WARNING"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(argv) == 0
    (written,) = out.glob("ttft-*.json")
    return json.loads(written.read_text())


def test_under_tp_every_rank_reports_its_bandwidth_and_bytes(bench_tp2):
    assert [r["tp_rank"] for r in bench_tp2["floors"]["h2d"]["per_rank"]] == [0, 1]
    for c in bench_tp2["cells"]:
        assert [r["tp_rank"] for r in c["per_rank"]] == [0, 1]


def test_under_tp_each_rank_moves_only_its_slice_of_the_missed_experts(bench, bench_tp2):
    whole = bench[2]["model"]["all_expert_bytes"]  # TP=1, same preset
    (cold,) = [c for c in bench_tp2["cells"] if c["residency"] == 0.0]
    per_rank = [r["h2d_bytes"] for r in cold["per_rank"]]
    assert per_rank[0] == per_rank[1] == bench_tp2["model"]["all_expert_bytes"]
    # each rank holds half of every expert; only the fp32 global scales (12 bytes an expert) are on both
    assert sum(per_rank) < 1.01 * whole  # 12 of 3468 bytes an expert: 0.35%, so 1% is loose yet tight


def test_staging_a_one_token_prompt_is_refused_because_one_token_always_takes_the_decode_path():
    args = build_parser().parse_args(["bench", "ttft", "--prompt-lens", "1,64", "--prefill-path", "staged"])
    with pytest.raises(BenchError, match="--prefill-path staged"):
        make_plan(args, load_config(None))


PATH_RESIDENCIES = (0.0, 0.5, 1.0)


@pytest.fixture(scope="module")
def bench_paths(tmp_path_factory, presets):
    """``(written JSON, markdown)`` of a run of 16- and 64-token prompts on both paths and auto."""
    out = tmp_path_factory.mktemp("results-paths")
    argv = ["bench", "ttft", "--out", str(out), "--reps", "1", "--prompt-lens", "16,64",
            "--residency", ",".join(f"{r:g}" for r in PATH_RESIDENCIES), "--modes", "gather",
            "--prefill-path", "staged,routed,auto", "--peers", "none", "--set", "device=cpu",
            "--set", f"model.cache_dir={presets}", "--set", "logging.level=WARNING"]
    with contextlib.redirect_stdout(io.StringIO()) as buf:
        assert cli_main(argv) == 0
    (written,) = out.glob("ttft-*.json")
    return json.loads(written.read_text()), buf.getvalue()


def _path_cells(result, variant):
    return [c for c in result["cells"] if c["variant"] == variant]


def test_short_prompts_are_measured_on_every_requested_path(bench_paths):
    result, _ = bench_paths
    want = {(v, n, r) for v in ("gather/staged", "gather/routed", "gather/auto") for n in (16, 64)
            for r in PATH_RESIDENCIES}
    assert {(c["variant"], c["prompt_len"], c["residency"]) for c in result["cells"]} == want
    assert all(c["ttft_s"]["median"] > 0 for c in result["cells"])


def test_each_cell_names_the_path_its_forward_took(bench_paths):
    result, _ = bench_paths
    assert {c["path"] for c in _path_cells(result, "gather/staged")} == {"staged"}
    assert {c["path"] for c in _path_cells(result, "gather/routed")} == {"routed"}
    # auto on a CPU keeps decode.max_tokens (16): the 16-token prompt is routed, the 64-token one staged
    assert {(c["prompt_len"], c["path"]) for c in _path_cells(result, "gather/auto")} == {(16, "routed"), (64, "staged")}


def test_the_routed_path_moves_exactly_the_routed_missing_experts_and_nothing_else(bench_paths):
    result, _ = bench_paths
    for c in _path_cells(result, "gather/routed"):
        assert c["bytes"]["uva"] == c["routed_missing_bytes"]  # counted by the decode path, found by the hooks
        assert c["bytes"]["h2d"] == 0


def test_the_routed_floor_counts_the_routed_missing_experts_of_every_layer(bench_paths):
    result, _ = bench_paths
    bw = result["floors"]["h2d"]["GBps"] * 1e9
    R = result["model"]["bytes_per_expert"]
    for c in result["cells"]:
        assert c["routed_floor_s"] == pytest.approx(c["routed_missing_experts"] * R / bw)
        assert c["routed_floor_s"] <= c["pcie_floor_s"] * (1 + 1e-9)  # routed experts are a subset of the layer
        if c["residency"] == 0.0:
            assert c["routed_missing_experts"] == c["routed_experts"]  # nothing resident: every routed one misses
        if c["residency"] == 1.0:
            assert c["routed_missing_experts"] == 0
    (short,) = [c for c in _path_cells(result, "gather/staged") if c["prompt_len"] == 16 and c["residency"] == 0.0]
    assert short["routed_experts"] < result["model"]["experts"] * result["model"]["moe_layers"]  # 16 x top-4 < 16


def test_the_staged_path_copies_every_missing_expert_of_every_layer_whatever_the_prompt(bench_paths):
    result, _ = bench_paths
    all_bytes = result["model"]["all_expert_bytes"]
    for c in _path_cells(result, "gather/staged"):
        assert c["bytes"]["h2d"] == round((1 - c["residency"]) * all_bytes)


def test_the_markdown_has_the_routed_floor_and_the_path_of_every_variant(bench_paths):
    _, text = bench_paths
    assert ("| residency | hit % | PCIe floor ms | routed floor ms | gather/staged ms | ×floor | ×routed | path | "
            "gather/routed ms | ×floor | ×routed | path | gather/auto ms | ×floor | ×routed | path |") in text
    assert "## 16 tokens" in text and "Prefill paths measured: staged, routed, auto" in text


def test_short_prompts_get_the_routed_floor_target(bench_paths):
    result, _ = bench_paths
    routed = [t for t in result["targets"] if t["id"] == "ttft_within_1.10x_routed_floor"]
    assert {(t["prompt_len"], t["mode"]) for t in routed} == {
        (n, v) for n in (16, 64) for v in ("gather/staged", "gather/routed", "gather/auto")}


def test_a_chunked_prompt_reports_its_chunks_and_a_chunked_floor_that_matches_the_bytes_staged(tmp_path, presets):
    """64 tokens in chunks of 32, both staged (decode.max_tokens 8, routed threshold 0): each chunk copies
    every layer's missing experts again, exactly what the chunked PCIe floor counts."""
    out = tmp_path / "r"
    argv = ["bench", "ttft", "--json", "--out", str(out), "--reps", "1", "--prompt-lens", "64", "--residency", "0.5",
            "--modes", "gather", "--set", "device=cpu", "--set", f"model.cache_dir={presets}",
            "--set", "logging.level=WARNING", "--set", "prefill.chunk_tokens=32", "--set", "decode.max_tokens=8",
            "--set", "prefill.routed_max_tokens=0"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(argv) == 0
    result = json.loads(next(out.glob("ttft-*.json")).read_text())
    cell = _cell(result, "gather", 0.5)
    all_bytes = result["model"]["all_expert_bytes"]
    assert cell["chunks"] == 2 and cell["path"] == "staged"
    assert cell["bytes"]["h2d"] == 2 * all_bytes // 2  # each of the 2 chunks staged half of every layer
    assert cell["pcie_floor_chunked_s"] == pytest.approx(2 * cell["pcie_floor_s"])
    assert "chunked_definition" in result["floors"]


def _faulted_run(out, presets, prompt_lens: str) -> tuple[int, str, dict]:
    """A CPU bench ttft run at residency 0 / 0.5 / 1 with the faults the caller patched in: (exit status, stderr,
    the JSON report written under ``out``)."""
    argv = ["bench", "ttft", "--json", "--out", str(out), "--reps", "1", "--prompt-lens", prompt_lens,
            "--residency", "0,0.5,1", "--modes", "gather", "--set", "device=cpu",
            "--set", f"model.cache_dir={presets}", "--set", "logging.level=WARNING"]
    stderr = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(stderr):
        rc = cli_main(argv)
    return rc, stderr.getvalue(), json.loads(next(out.glob("ttft-*.json")).read_text())


def test_a_cell_that_runs_out_of_device_memory_is_listed_and_the_sweep_goes_on(tmp_path, presets, monkeypatch):
    """Fault injection: every forward of the 32-token prompt raises CUDA's out-of-memory error (its first, untimed
    pass included), and the timed passes of the 64-token prompt at residency 0.5 raise torch's. Those cells are
    listed as failed, every other cell is measured, the reports are written and the run exits 1."""
    import torch

    from moe_offload.bench import sweep
    from moe_offload.engine import Engine

    real_prefill, real_measure = Engine.prefill, sweep.measure_cell

    def prefill(self, input_ids, *args, **kwargs):
        if len(input_ids) == 32:
            raise RuntimeError("CUDA error: out of memory")
        return real_prefill(self, input_ids, *args, **kwargs)

    def measure(engine, timer, ids, resident, reps):
        if len(ids) == 64 and all(len(v) == 8 for v in resident.values()):
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return real_measure(engine, timer, ids, resident, reps)

    monkeypatch.setattr(Engine, "prefill", prefill)
    monkeypatch.setattr(sweep, "measure_cell", measure)
    out = tmp_path / "r"
    rc, stderr, result = _faulted_run(out, presets, "32,64")
    assert rc == 1
    assert "4 cell(s) failed" in stderr
    failed = {(c["prompt_len"], c["residency"]): c["error"] for c in result["failed_cells"]}
    assert set(failed) == {(32, 0.0), (32, 0.5), (32, 1.0), (64, 0.5)}
    assert failed[(32, 0.0)].startswith("out of device memory (CUDA error: out of memory)")  # the first pass
    assert failed[(32, 1.0)].startswith("out of device memory (the untimed first pass at residency 0 failed)")
    assert failed[(64, 0.5)].startswith("out of device memory (CUDA out of memory. Tried to allocate 2.00 GiB.)")
    assert sorted((c["prompt_len"], c["residency"]) for c in result["cells"]) == [(64, 0.0), (64, 1.0)]
    assert all(c["ttft_s"]["median"] > 0 for c in result["cells"])
    assert result["floors"]["compute"]["32"] is None and result["floors"]["compute"]["64"] is not None
    text = next(out.glob("ttft-*.md")).read_text()
    assert "## Failed cells" in text and "| 64 | gather | 0.5 | out of device memory" in text


def test_a_run_stopped_by_an_error_keeps_the_cells_before_it_in_a_partial_report(tmp_path, presets, monkeypatch):
    """Fault injection: the timed passes at residency 0.5 raise an illegal-address error (not a cell result: the
    run stops with it). The report rewritten after each cell holds the cells measured before it, marked partial;
    the complete smoke run's report carries no such mark (``bench`` fixture)."""
    from moe_offload.bench import sweep

    real_measure = sweep.measure_cell

    def measure(engine, timer, ids, resident, reps):
        if all(len(v) == 8 for v in resident.values()):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return real_measure(engine, timer, ids, resident, reps)

    monkeypatch.setattr(sweep, "measure_cell", measure)
    out = tmp_path / "r"
    rc, stderr, result = _faulted_run(out, presets, "32")
    assert rc != 0 and "illegal memory access" in stderr
    assert result["partial"] == {"cells_done": 1, "cells_planned": 3, "peers": "skipped: the device is cpu"}
    assert [(c["prompt_len"], c["residency"]) for c in result["cells"]] == [(32, 0.0)]
    assert result["cells"][0]["ttft_s"]["median"] > 0 and not result["failed_cells"]
    assert "Partial report: 1 of 3 cells done" in next(out.glob("ttft-*.md")).read_text()


def test_the_complete_report_is_not_marked_partial(bench):
    _, _, result, out = bench
    assert "partial" not in result
    assert "Partial report" not in next(out.glob("ttft-*.md")).read_text()


def test_routed_cells_of_a_hit_mode_and_off_give_the_hit_speedup_target_no_value_and_no_crash(tmp_path, presets):
    """A routed prompt has no staged hit fraction (None): the hit-D2D target says it needs a staged cell, where
    the report used to divide by it and raise a TypeError (at the end of the run, or after two cells once the
    report is rewritten after every cell)."""
    out = tmp_path / "r"
    argv = ["bench", "ttft", "--json", "--out", str(out), "--reps", "1", "--prompt-lens", "16", "--residency", "0.5",
            "--modes", "gather,off", "--prefill-path", "routed", "--set", "device=cpu",
            "--set", f"model.cache_dir={presets}", "--set", "logging.level=WARNING"]
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli_main(argv) == 0
    result = json.loads(next(out.glob("ttft-*.json")).read_text())
    assert "partial" not in result and len(result["cells"]) == 4  # gather and off at 0.5 and 1
    (t,) = [t for t in result["targets"] if t["id"] == "hit_d2d_speedup_vs_off" and t.get("residency") == 0.5]
    assert t["value"] is None and t["met"] is None
