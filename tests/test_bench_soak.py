"""CPU smoke test of ``moe-offload bench soak`` on the embedded tiny model, and proof that its checks can fail.

One soak through the CLI (module fixture, ~20 s on 2 busy cores): residencies 0.1 and 0.5, 3 s each (plus the
warm passes if they take longer than 0.6 s), 3 small workloads, memory sampled every 20 ms so that the post-warmup quarters have samples. A second, shorter run
has a wrong token injected into every soak answer: the checker must report it and the run must fail.
"""

from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from moe_offload.bench import soak_report
from moe_offload.cli import main as cli_main
from moe_offload.engine import Engine

SMALL = ["--workloads", "3", "--prompt-lens", "16..64", "--max-batch", "2", "--new-tokens", "4", "--sample-s", "0.02"]


def _soak(out, cache, *args: str) -> tuple[int, str, dict | None]:
    argv = ["bench", "soak", "--json", "--out", str(out), *SMALL, *args, "--set", "device=cpu",
            "--set", f"model.cache_dir={cache}", "--set", "logging.level=WARNING"]
    stdout = io.StringIO()
    with contextlib.redirect_stdout(stdout):
        rc = cli_main(argv)
    written = sorted(out.glob("soak-*.json"))
    return rc, stdout.getvalue(), json.loads(written[0].read_text()) if written else None


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: the tiny model gains nothing from two, and on a busy 2-core host OpenMP workers
    spinning against other processes made each request ~6x slower (measured 1.7 s vs 0.26 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def presets(tmp_path_factory):
    return tmp_path_factory.mktemp("presets")


@pytest.fixture(scope="module")
def soak(tmp_path_factory, presets):
    out = tmp_path_factory.mktemp("results")
    return (*_soak(out, presets, "--minutes", "0.05"), out)


def test_a_healthy_soak_exits_zero_and_prints_the_json_it_writes(soak):
    rc, printed, result, _ = soak
    failed = [(r["residency"], v) for r in result["runs"] for v in r["verdicts"] if v["met"] is False]
    assert rc == 0 and result["passed"] is True, failed
    assert json.loads(printed) == result


def test_json_markdown_and_png_are_named_for_the_model_and_the_git_sha(soak):
    _, _, result, out = soak
    stem = f"soak-tiny-qwen3-moe-r0.1+0.5-{result['git']['sha'][:12]}"
    assert (out / f"{stem}.json").is_file()
    assert "| residency | slots | routed path up to (tokens) | requests (after warmup) |" in (out / f"{stem}.md").read_text()
    assert (out / f"{stem}.png").stat().st_size > 0


def test_every_residency_soaks_its_own_pool_with_every_answer_equal_and_no_fallback(soak):
    _, _, result, _ = soak
    assert [r["residency"] for r in result["runs"]] == [0.1, 0.5]
    # on a CPU the routed path takes decode.max_tokens (16) at any residency: one set of references serves both
    assert [x["routed_max_tokens"] for x in result["references"]] == [16] and result["references"][0]["slots"] == 64
    for run in result["runs"]:
        # the tiny model: 16 experts x 4 MoE layers, top-4; round(0.1 x 16) = 2 per layer, 8 per layer at 0.5
        assert run["slots"] == {0.1: 8, 0.5: 32}[run["residency"]]
        assert run["mismatch_count"] == 0 and run["mismatches"] == []
        assert run["after_warmup"]["requests"] > 0
        assert run["after_warmup"]["hit_d2d_fallbacks"] == {} and run["after_warmup"]["declined"] == {}
        assert 0 < run["stats"]["hit_rate"] < 1  # offloaded: some decode lookups hit, some read host memory
        verdicts = {v["id"]: v for v in run["verdicts"]}
        assert verdicts["mismatches"]["met"] and verdicts["fallback_and_declined_events_after_warmup"]["met"]
        assert verdicts["growth:rss_bytes"]["met"] is True  # measured: /proc/self/status
        # no device and no CUDA on this CPU: those metrics have no verdict rather than a vacuous pass
        for metric in ("device_allocated_idle", "device_reserved", "pinned_bytes"):
            assert verdicts[f"growth:{metric}"]["met"] is None


def test_the_warmup_covers_the_warm_passes_and_a_fifth_of_the_run(soak):
    _, _, result, _ = soak
    for run in result["runs"]:
        warm_requests = 2 * len(result["workloads"])
        assert run["warmup_s"] >= run["requests"][warm_requests - 1]["t_end_s"]
        assert run["warmup_s"] >= 0.2 * run["seconds"]
        assert {r["workload"] for r in run["requests"][:len(result["workloads"])]} == set(range(3))
        assert run["seconds"] - run["warmup_s"] >= 0.8 * 3  # 0.05 min: four fifths of it follow the warm passes


def test_growth_is_the_last_quarter_median_minus_the_first_quarter_median_after_warmup():
    # warmup ends at t=20; quarters of [20, 100]: [20, 40) and [80, 100]. The pre-warmup spike is ignored.
    samples = [{"t_s": t, "rss_bytes": (10**9 if t < 20 else 1000 + 10 * t)} for t in range(0, 101)]
    g = soak_report.growth(samples, "rss_bytes", 20.0, 100.0)
    assert g["first_quarter"] == 1000 + 10 * 29.5 and g["last_quarter"] == 1000 + 10 * 90
    assert g["value"] == 10 * (90 - 29.5)
    assert soak_report.growth(samples[:25], "rss_bytes", 20.0, 24.0)["value"] is None  # 1 sample per quarter


def test_a_wrong_token_is_reported_as_a_mismatch_and_fails_the_run(tmp_path, presets, monkeypatch):
    real = Engine.generate_batch

    def one_token_off(self, prompts, *args, **kw):
        results = real(self, prompts, *args, **kw)
        if self.cache.num_slots < len(self.store.layers) * self.store.num_experts:  # the soak, not the reference
            results[-1].token_ids[-1] = (results[-1].token_ids[-1] + 1) % self.reader.geometry.vocab
        return results

    monkeypatch.setattr(Engine, "generate_batch", one_token_off)
    rc, _, result = _soak(tmp_path, presets, "--residencies", "0.5", "--minutes", "0.01")
    assert rc == 1 and result["passed"] is False
    (run,) = result["runs"]
    assert run["mismatch_count"] == len(run["requests"]) > 0
    first = run["mismatches"][0]
    # the last token (4 new tokens: position 3) of the last sequence, one id off in the tiny vocab of 320
    assert first["position"] == 3 and first["sequence"] == result["workloads"][first["workload"]]["batch"] - 1
    assert first["got"] == (first["want"] + 1) % 320
    assert next(v for v in run["verdicts"] if v["id"] == "mismatches")["met"] is False


def test_each_routed_path_threshold_gets_its_own_references_and_every_answer_still_matches(tmp_path, presets,
                                                                                           monkeypatch):
    """On CUDA ``prefill.routed_max_tokens: auto`` depends on the resident fraction, and a forward on the routed
    path runs other kernels than on the staged one; stand in for that on the CPU with a threshold of 40 tokens
    below residency 0.3 (16, the decode.max_tokens floor, above)."""
    from moe_offload import prefill_path

    real = prefill_path.resolve

    def by_fraction(setting, decode_max_tokens, E, K, R, resident, *args):
        return real(40 if setting == "auto" and resident < 0.3 else setting, decode_max_tokens, E, K, R, resident, *args)

    monkeypatch.setattr(prefill_path, "resolve", by_fraction)
    _, _, result = _soak(tmp_path, presets, "--minutes", "0.01")
    assert [r["routed_max_tokens"] for r in result["runs"]] == [40, 16]
    assert sorted(x["routed_max_tokens"] for x in result["references"]) == [16, 40]
    assert all(x["slots"] == 64 for x in result["references"])  # every expert of the tiny model resident
    assert [r["mismatch_count"] for r in result["runs"]] == [0, 0]


def test_one_residency_per_run_merges_into_one_report_and_other_settings_are_refused(soak, tmp_path, capsys):
    _, _, result, _ = soak
    parts = []
    for run in result["runs"]:  # as if each residency had run in its own command
        part = dict(result, runs=[run], settings=dict(result["settings"], residencies=[run["residency"]]))
        parts.append(tmp_path / f"r{run['residency']:g}.json")
        parts[-1].write_text(json.dumps(part))
    out = tmp_path / "merged"
    with contextlib.redirect_stdout(io.StringIO()):
        rc = cli_main(["bench", "soak", "--merge", *map(str, parts), "--out", str(out)])
    (merged,) = out.glob("soak-tiny-qwen3-moe-r0.1+0.5-*.json")
    got = json.loads(merged.read_text())
    assert rc == 0 and got["passed"] is True and got["runs"] == result["runs"]
    assert (out / merged.name.replace(".json", ".png")).stat().st_size > 0
    other = json.loads(parts[1].read_text())
    other["settings"]["new_tokens"] += 1
    parts[1].write_text(json.dumps(other))
    assert cli_main(["bench", "soak", "--merge", *map(str, parts), "--out", str(out)]) == 2
    assert "not the same model, commit, device and settings" in capsys.readouterr().err


class Killed(Exception):
    """Stands for the end of the process mid-request (a time limit's signal)."""


def test_a_soak_cut_short_leaves_a_partial_report_of_what_it_measured(tmp_path, presets, monkeypatch):
    # what a command time limit or a machine taken back does to a GPU soak: the process ends mid-residency.
    # The soak writes a partial report (the same files, "partial" set) every CHECKPOINT_S of soaking.
    from moe_offload.bench import soak

    monkeypatch.setattr(soak, "CHECKPOINT_S", 0.3)
    real, calls = Engine.generate_batch, []

    def killed_after_a_while(self, prompts, *args, **kw):
        if self.cache.num_slots < len(self.store.layers) * self.store.num_experts:  # the soak, not the reference
            calls.append(1)
            if len(calls) == 40:
                raise Killed("the command's time limit")
        return real(self, prompts, *args, **kw)

    monkeypatch.setattr(Engine, "generate_batch", killed_after_a_while)
    try:
        rc = _soak(tmp_path, presets, "--residencies", "0.5", "--minutes", "5")[0]
    except Killed:
        rc = None
    assert rc != 0 and len(calls) == 40
    (written,) = sorted(tmp_path.glob("soak-*.json"))
    result = json.loads(written.read_text())
    assert result["partial"]["residency"] == 0.5 and 0 < result["partial"]["seconds"] < 300
    (run,) = result["runs"]
    assert 0 < len(run["requests"]) < 40 and run["mismatch_count"] == 0 and len(run["samples"]) > 0
    assert run["verdicts"] and "growth" in run  # derived like a whole run, on the data so far
    assert "**PARTIAL**" in written.with_suffix(".md").read_text()
    # no PNG while soaking (drawing one grows the process's RSS, which the soak measures); --merge draws it
    assert not written.with_suffix(".png").exists()
    merged = tmp_path / "merged"
    assert cli_main(["bench", "soak", "--merge", str(written), "--out", str(merged)]) in (0, 1)
    (png,) = merged.glob("soak-*.png")
    assert png.stat().st_size > 0 and "**PARTIAL**" in png.with_suffix(".md").read_text()


def test_a_whole_run_replaces_its_partial_reports(tmp_path, presets, monkeypatch):
    from moe_offload.bench import soak

    monkeypatch.setattr(soak, "CHECKPOINT_S", 0.3)
    real_write, partials = soak_report.write, []

    def spy(result, out, png=True):
        partials.append(bool(result.get("partial")))
        assert png is not bool(result.get("partial"))  # the PNG only with the whole run
        return real_write(result, out, png)

    monkeypatch.setattr(soak_report, "write", spy)
    # two residencies: the second one's partials hold the first (whole) run too
    rc, _, result = _soak(tmp_path, presets, "--residencies", "0.1,0.5", "--minutes", "0.03")
    assert rc == 0 and partials[:-1] and all(partials[:-1]) and partials[-1] is False  # partials, then the whole
    assert "partial" not in result and [r["residency"] for r in result["runs"]] == [0.1, 0.5]
    assert len(list(tmp_path.glob("soak-*.json"))) == 1  # the partials were written under the whole one's name
    assert all("**PARTIAL**" not in p.read_text() for p in tmp_path.glob("*.md"))
