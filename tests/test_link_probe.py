"""benchmarks/link_probe.py: one real-size layer measured, its report written and the host's kind named."""

import importlib.util
import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("link_probe", ROOT / "benchmarks" / "link_probe.py")
link_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(link_probe)


def test_the_report_holds_each_run_and_the_kind_follows_the_median_share(tmp_path, capsys):
    assert link_probe.main(["--out", str(tmp_path), "--reps", "3"]) == 0
    report = json.loads((tmp_path / "link.json").read_text())
    assert len(report["runs"]) == 3 and report["device"] == "cpu"
    shares = sorted(r["uva_GBps"] / r["h2d_GBps"] for r in report["runs"])
    assert report["share"] == shares[1]
    assert report["slow"] == (shares[1] < report["slow_below"])
    assert all(r["rows"] == 32 and r["row_bytes"] > 2_000_000 for r in report["runs"])
    assert ("slow SM reads" if report["slow"] else "fast SM reads") in capsys.readouterr().out


def test_a_host_it_cannot_measure_is_named_as_such_never_as_fast(tmp_path, monkeypatch, capsys):
    from moe_offload.link_rates import LinkUnmeasurable

    def unmeasurable(store, device):  # fault injection: every round out of order
        raise LinkUnmeasurable("every one of 3 rounds was out of order")

    monkeypatch.setattr(link_probe, "measure_link", unmeasurable)
    assert link_probe.main(["--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "link.json").read_text())
    assert report["slow"] is None and "LinkUnmeasurable: every one of 3 rounds" in report["error"]
    assert "not measured" in capsys.readouterr().err
