"""benchmarks/serve_targets.py on the committed H200 results: serving against bench ttft / bench decode."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "benchmarks" / "results"


def _module():
    spec = importlib.util.spec_from_file_location("serve_targets", ROOT / "benchmarks" / "serve_targets.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _load(name: str) -> dict:
    return json.loads((RES / name).read_text())


def test_the_032db7c_serve_run_against_bench_decode_and_bench_ttft():
    st = _module()
    serves = [_load(f"serve-qwen3-30b-a3b-r{r}-032db7c87464.json") for r in ("0.37", "1.0")]
    result = st.compare(serves, _load("decode-qwen3-30b-a3b-51a5ded.json"), _load("ttft-qwen3-30b-a3b-c6e05d5.json"))
    rows = {(r["residency"], r["clients"]): r for r in result["rows"]}
    one = rows[(1.0, 1)]
    assert one["ttft_ratio_engine"] == 0.939 and one["ttft_ratio_bench"] == 1.054  # 96.4 vs 102.7 / 91.5 ms
    assert one["decode_rows"] == 1 and one["decode_ratio"] == 0.926  # 133.8 vs 144.4 tok/s
    assert rows[(0.37, 1)]["ttft_ratio_bench"] == 1.194  # over the 10%: the verdict says so
    # that run's mix had one prompt: every level with more than one client repeated it and is not judged
    assert all(r["repeated_prompts"] == (r["clients"] > 1) for r in result["rows"])
    assert rows[(1.0, 64)]["decode_ratio"] == 1.531  # computed, shown, but flattered by identical rows
    v = result["verdict"]
    # judged: the one-row levels only (0.93 x at residency 1; 1.30 x at 0.37, where bench decode measured
    # its own resident set, and the server had decoded that same prompt in every earlier request)
    assert v == {"streams": True, "ttft": False, "decode": True}
    text = st.markdown(result)
    assert "not judged" in text and "| 1.0 | 64 |" in text


def test_a_level_with_a_same_run_decode_reference_is_compared_with_it_not_with_the_decode_file():
    st = _module()
    serve = _load("serve-qwen3-30b-a3b-r0.37-e153b4d6bc05.json")
    for lv in serve["levels"]:  # as bench serve --decode-reference writes it: 10 % above what the server decoded
        rows = lv["decode_full_batch"]["rows"]
        lv["decode_reference"] = {"rows": rows, "tok_s": round(lv["decode_full_batch"]["tok_s"] * 1.1, 2)}
    result = st.compare([serve], None)
    assert result["decode_git"] is None
    assert all(r["decode_source"] == "same run" and r["decode_ratio"] == round(1 / 1.1, 3) for r in result["rows"])
    assert result["verdict"]["decode"] is True  # 0.909 >= 0.90
    assert "from the serve run (--decode-reference)" in st.markdown(result)
    # without a reference the decode file is used, and names its commit
    plain = st.compare([_load("serve-qwen3-30b-a3b-r0.37-e153b4d6bc05.json")], _load("decode-qwen3-30b-a3b-edd2da44f57a.json"))
    assert {r["decode_source"] for r in plain["rows"]} == {"edd2da44f57a"}


def test_a_failed_bench_decode_cell_is_no_reference():
    """A bench decode cell that ran out of device memory (its "error" in place of the figures) gives that level no
    decode reference instead of a crash."""
    st = _module()
    serves = [_load(f"serve-qwen3-30b-a3b-r{r}-032db7c87464.json") for r in ("0.37", "1.0")]
    decode = _load("decode-qwen3-30b-a3b-51a5ded.json")
    for c in decode["cells"]:
        if c["residency"] == 1.0 and c["batch"] == 1:
            for k in [k for k in c if k not in ("residency", "batch")]:
                del c[k]
            c["error"] = "out of device memory (CUDA out of memory)"
    rows = {(r["residency"], r["clients"]): r for r in st.compare(serves, decode)["rows"]}
    assert rows[(1.0, 1)]["bench_decode_tok_s"] is None and rows[(1.0, 1)]["decode_ratio"] is None
    assert rows[(0.37, 1)]["decode_ratio"] is not None  # the other cells still compare
