"""benchmarks/boundary_host.py: a decode boundary's host time on the real cache, on the CPU (a smoke run)."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("boundary_host", ROOT / "benchmarks" / "boundary_host.py")
boundary_host = importlib.util.module_from_spec(spec)
spec.loader.exec_module(boundary_host)


def test_a_short_run_writes_the_cells_it_prints(tmp_path, capsys):
    assert boundary_host.main(["--batch", "1,2", "--steps", "3", "--out", str(tmp_path), "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    (written,) = tmp_path.glob("boundary_host-*.json")
    assert json.loads(written.read_text()) == printed
    assert [c["batch"] for c in printed["cells"]] == [1, 2]
    assert printed["shape"] == {"layers": 48, "experts": 128, "top_k": 8}
    for c in printed["cells"]:
        assert c["boundary_us"]["median"] > 0 and 0 < c["hit_rate"] <= 1 and c["admitted_layers_per_step"] >= 0
    assert (tmp_path / written.name.replace(".json", ".md")).read_text().startswith("# Decode boundary host time")


def test_a_label_with_dots_names_both_files_whole_and_each_filter_and_start_is_a_cell(tmp_path, capsys):
    assert boundary_host.main(["--batch", "1", "--steps", "2", "--filter", "none,frequency", "--placement", "both",
                               "--out", str(tmp_path), "--git-sha", "abc1234-skew0.7", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["boundary_host-abc1234-skew0.7.json",
                                                          "boundary_host-abc1234-skew0.7.md"]
    assert [(c["placement"], c["admit_filter"]) for c in printed["cells"]] == [
        ("popular", "none"), ("popular", "frequency"), ("random", "none"), ("random", "frequency")]
    for c in printed["cells"]:
        assert 0 < c["hit_rate_first_20"] <= 1 and 0 < c["hit_rate_timed"] <= 1
