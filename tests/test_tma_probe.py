"""benchmarks/tma_probe.py: both kernels copy every byte of the rows (interpreter), a wrong copy fails the run, and its
report holds each config."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("tma_probe", ROOT / "benchmarks" / "tma_probe.py")
tma_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tma_probe)

def test_both_kernels_copy_every_byte_and_the_report_names_each_config(tmp_path):
    assert tma_probe.main(["--out", str(tmp_path), "--mb", "1", "--reps", "1"]) == 0
    report = json.loads((tmp_path / "tma_probe.json").read_text())
    assert report["device"] == "cpu" and report["bytes"] == 1024 * tma_probe.COLS * 4 and report["copy_engine_ok"]
    assert [(c["tile_rows"], c["stages"]) for c in report["configs"]] == [(8, 1), (32, 3)]
    assert all(c["ldg_ok"] and c["tma_ok"] and c["tma_GBps"] > 0 for c in report["configs"])
    mc = report["miss_copy"]  # the production copy, on rows padded to 16 bytes (a tail past whole KiB)
    assert mc["ldg_ok"] and mc["ldg_GBps"] > 0 and mc["row_bytes"] % 1024 == 16 and mc["row_align"] == 16
    sides = report["miss_copy_row_align"]  # the same copy on 16-byte rows, page rows, page rows in huge-page memory
    huge = [] if tma_probe._huge_pages_unavailable() else [(4096, 0, True, True)]  # the third side where the kernel has THP
    assert [(m["row_align"], m["row_bytes"] % m["row_align"], m["huge_pages"], m["ldg_ok"]) for m in sides] == [
        (16, 0, False, True), (4096, 0, False, True), *huge]
    assert sorted(report["miss_copy_row_align_median_GBps"]) == ["16", "4096"] + ["4096_huge"] * len(huge)

def test_a_copy_with_wrong_bytes_fails_the_run(tmp_path, monkeypatch):
    real = tma_probe._tma_copy

    class Corrupting:  # fault injection: the TMA kernel's copy then one flipped word
        def __getitem__(self, grid):
            def launch(desc, dst, *args, **kw):
                real[grid](desc, dst, *args, **kw)
                dst.view(-1)[7] ^= 1
            return launch

    monkeypatch.setattr(tma_probe, "_tma_copy", Corrupting())
    assert tma_probe.main(["--out", str(tmp_path), "--mb", "1", "--reps", "1"]) == 1
    report = json.loads((tmp_path / "tma_probe.json").read_text())
    assert all(c["ldg_ok"] and c["tma_ok"] is False for c in report["configs"])

def test_sizes_past_the_int32_offsets_are_refused(tmp_path, capsys):

    with pytest.raises(SystemExit):
        tma_probe.main(["--out", str(tmp_path), "--mb", "2048"])
    assert "--mb 2048: 1-1024" in capsys.readouterr().err
