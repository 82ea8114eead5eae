"""``moe-offload serve`` and ``moe-offload bench serve`` on the command line."""

from __future__ import annotations

import json

import pytest

from moe_offload.cli import build_parser, main


def test_the_serve_command_takes_config_host_port_and_set():
    a = build_parser().parse_args(["serve", "--host", "0.0.0.0", "--port", "0", "--set", "serve.max_batch=2"])
    assert (a.host, a.port, a.set, a.config) == ("0.0.0.0", 0, ["serve.max_batch=2"], None)


def test_an_unknown_serve_key_exits_2_naming_it_before_loading_a_model(capsys):
    assert main(["serve", "--set", "serve.max_bach=2"]) == 2
    assert "serve.max_bach" in capsys.readouterr().err


def test_bench_serve_writes_json_markdown_and_png_with_no_errors_and_no_wrong_outputs(tiny_ckpt, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    ckpt = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    rc = main(["bench", "serve", "--set", f"model.checkpoint={ckpt}", "--set", "model.format=auto",
               "--set", "prefill.warmup_tokens=8", "--set", "logging.level=WARNING", "--clients", "1,3",
               "--requests-per-client", "3,2", "--prompt-lens", "4,9", "--max-tokens", "3,6", "--out", str(tmp_path),
               "--json", "--git-sha", "0123456789abcdef"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["env"]["git"]["sha"] == "0123456789abcdef"  # a copied tree records the commit it was given
    assert [lv["clients"] for lv in result["levels"]] == [1, 3]
    assert all(lv["errors"] == 0 and lv["wrong"] == 0 and lv["diverged"] == 0 for lv in result["levels"])
    # nothing diverged (fp32 on the CPU is batch-invariant), so nothing was teacher-forced
    assert result["consistency"]["streams"] == [] and result["consistency"]["reference_max_margin"] is None
    assert "_diverged" not in result and "_references" not in result
    # closed loop, ignore_eos: every request yields exactly its max_tokens. The mix has max(3 clients, 2 x 2
    # combinations) = 4 distinct requests (lengths 4, 9, 4, 9; outputs 3, 3, 6, 6); client c's k-th request
    # is request (2c + k) % 4: 3, 3, 6, 6, 3, 3
    assert result["mix"]["distinct_requests"] == 4
    assert result["mix"]["clients"] == "child process"  # the clients' Python work is not on the server's GIL
    assert result["levels"][1]["output_tokens"] == 24
    assert [lv["requests"] for lv in result["levels"]] == [3, 6]  # --requests-per-client per level
    assert result["levels"][0]["ttft_p50_ms"] > 0 and result["levels"][1]["tpot_p99_ms"] > 0
    # each level says how its decode steps ran (from the server's /metrics): eager on the CPU
    assert result["decode_batch"]["kind"] == "dynamic"
    assert all(lv["decode_steps"]["graph"] == 0 and lv["decode_steps"]["eager"] > 0 for lv in result["levels"])
    # where the time went: the scheduler's own split of every request of the level, and the level's decode
    # forwards at full batch (1 row, then 3 rows: closed loops keep all three clients in the batch for a while)
    for lv, rows in zip(result["levels"], (1, 3)):
        split = lv["server"]
        assert split["requests"] == lv["requests"]
        assert 0 <= split["queue_p50_ms"] <= split["ttft_p50_ms"] and 0 < split["prefill_p50_ms"] <= split["ttft_p50_ms"]
        assert 0 < split["prefill_host_p50_ms"] <= split["prefill_p50_ms"]  # the forwards, without the sampling
        full = lv["decode_full_batch"]
        assert full["rows"] == rows and full["steps"] >= 1 and full["tok_s"] > 0
    assert result["levels"][0]["server"]["ttft_p50_ms"] <= result["levels"][0]["ttft_p50_ms"]  # HTTP adds time
    assert set(result["engine_ttft_ms"]) == {"4", "9"} and min(result["engine_ttft_ms"].values()) > 0
    names = sorted(p.suffix for p in tmp_path.iterdir())
    assert names == [".json", ".md", ".png"]
    assert all("0123456789ab" in p.name for p in tmp_path.iterdir())


def test_requests_per_client_takes_one_value_or_one_per_level():
    from moe_offload.serve.bench import requests_per_client

    assert requests_per_client("2", [1, 4, 16]) == [2, 2, 2]
    assert requests_per_client("5,2,1", [1, 4, 16]) == [5, 2, 1]
    with pytest.raises(ValueError, match="one per --clients level"):
        requests_per_client("5,2", [1, 4, 16])
    with pytest.raises(ValueError, match=">= 1"):
        requests_per_client("0", [1])


def test_the_mix_gives_every_request_its_own_prompt_and_covers_every_combination():
    from moe_offload.serve.bench import make_mix

    mix = make_mix([4, 9], [3, 6], vocab=1000, seed=0, distinct=64)
    assert len(mix) == 64 and len({job.prompt_ids for job in mix}) == 64  # 64 concurrent clients: 64 sequences
    assert {(len(j.prompt_ids), j.max_tokens) for j in mix[:4]} == {(4, 3), (9, 3), (4, 6), (9, 6)}
    assert len(make_mix([4, 9], [3, 6], vocab=1000, seed=0, distinct=1)) == 4  # never fewer than the combinations
    assert make_mix([4], [3], vocab=1000, seed=5, distinct=3) == make_mix([4], [3], vocab=1000, seed=5, distinct=3)


def test_bench_serve_decode_reference_times_bench_decodes_cell_on_the_serving_engine_per_full_batch(tiny_ckpt, capsys):
    ckpt = tiny_ckpt("tiny-qwen3-moe", "nvfp4-modelopt")
    rc = main(["bench", "serve", "--set", f"model.checkpoint={ckpt}", "--set", "model.format=auto",
               "--set", "prefill.warmup_tokens=8", "--set", "logging.level=WARNING", "--set", "cache.budget=0.5",
               "--set", "serve.max_batch=2", "--clients", "1,3", "--requests-per-client", "2,1", "--prompt-lens", "9",
               "--max-tokens", "6", "--decode-reference", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    ref = result["decode_reference"]
    # one cell per full batch: min(clients, serve.max_batch) = 1 and 2 rows; 6 tokens = 5 timed steps
    assert sorted(ref["cells"]) == ["1", "2"] and (ref["prompt_len"], ref["steps"]) == (9, 5)
    assert ref["resident_per_layer"] == 8  # half of the tiny model's 16 experts per layer
    assert all(c["tok_s"] > 0 and c["path"] == "routed" and 0 <= c["hit_rate"] <= 1 for c in ref["cells"].values())
    for lv in result["levels"]:
        full, r = lv["decode_full_batch"], lv["decode_reference"]
        assert r["rows"] == full["rows"] and r["tok_s"] == ref["cells"][str(full["rows"])]["tok_s"]
        assert r["ratio"] == round(full["tok_s"] / r["tok_s"], 3)
    assert all(lv["errors"] == 0 and lv["wrong"] == 0 for lv in result["levels"])
    from moe_offload.serve import bench_report

    text = bench_report.markdown(result)
    assert "Decode reference" in text and "1 clients" in text and "3 clients" in text
