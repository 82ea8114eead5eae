"""Serving against its targets: ``bench serve`` results beside ``bench decode`` (and optionally ``bench ttft``).

    python benchmarks/serve_targets.py --serve serve-r0.37.json serve-r1.0.json [--decode decode.json] \
        [--ttft ttft.json] [--out DIR]

The "Serve it" issue's targets, per residency (``cache.budget`` of the serve run = ``residency`` of the
other benches):
- TTFT p50 at one client within 10% of ``bench ttft`` at the same prompt length: against
  ``engine_ttft_ms`` (``Engine.measure_ttft`` on the serving engine before it served, the same
  measurement in the same run) and, when ``--ttft`` is given, against that run's median;
- aggregate decode within 10% of ``bench decode`` at the same batch: each level's ``decode_full_batch``
  (the server's decode forwards with every client's row in the batch) against the decode cell of the same
  residency and batch; a level with ``decode_reference`` (``bench serve --decode-reference``: the same cell
  timed on the serving engine before it served) is compared with that instead (same run). A serve run whose
  mix repeated prompts (``distinct_requests`` below the level's
  clients) is marked: identical rows route to the same experts and flatter decode.
Writes ``serve-targets-<sha>.{json,md}`` under ``--out`` (stdout only without it).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TOLERANCE = 0.10


def _residency(serve: dict) -> float:
    if "config" not in serve:
        raise ValueError("a bench serve result without its config (a --url run): the residency is unknown; "
                         "compare in-process runs (bench serve --config ... --set cache.budget=R)")
    budget = serve["config"]["cache"]["budget"]
    if isinstance(budget, dict) and budget.get("kind") == "fraction":
        return float(budget["value"])
    raise ValueError(f"a serve run with cache.budget {budget!r}: only a fraction (the residency) is compared")


def _decode_cell(decode: dict, residency: float, batch: int) -> dict | None:
    """The measured cell of that residency and batch (a failed one, e.g. out of device memory, is no reference)."""
    return next((c for c in decode["cells"] if abs(c["residency"] - residency) < 1e-9 and c["batch"] == batch
                 and not c.get("error")), None)


def _ttft_cell(ttft: dict | None, residency: float, prompt_len: int) -> float | None:
    if ttft is None:
        return None
    cells = [c for c in ttft["cells"] if abs(c["residency"] - residency) < 1e-9 and c["prompt_len"] == prompt_len]
    return min((round(c["ttft_s"]["median"] * 1000, 3) for c in cells), default=None)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else round(a / b, 3)


def compare(serves: list[dict], decode: dict | None = None, ttft: dict | None = None) -> dict:
    """One row per (serve run, level): the measured figures, their references and ratios, and verdicts."""
    rows = []
    for s in serves:
        r = _residency(s)
        lens = s["mix"]["prompt_lens"]
        distinct = s["mix"].get("distinct_requests", 0)
        for lv in s["levels"]:
            full = lv.get("decode_full_batch")
            same_run = lv.get("decode_reference")
            cell = _decode_cell(decode, r, full["rows"]) if full and decode and not same_run else None
            # "diverged": ids differ from the single run; "wrong": not near-argmax under teacher forcing (results
            # before serve/consistency.py have no "diverged": their "wrong" is the exact comparison)
            row = {"residency": r, "clients": lv["clients"], "errors": lv["errors"], "wrong": lv["wrong"],
                   "diverged": lv.get("diverged", lv["wrong"]),
                   "ttft_p50_ms": lv["ttft_p50_ms"], "repeated_prompts": distinct < lv["clients"],
                   "decode_rows": full and full["rows"], "decode_tok_s": full and full["tok_s"],
                   "bench_decode_tok_s": same_run["tok_s"] if same_run else cell and round(cell["tok_s"]["median"], 2),
                   "decode_source": "same run" if same_run else (decode.get("git") or {}).get("sha", "")[:12]
                   if cell else None}
            row["decode_ratio"] = _ratio(row["decode_tok_s"], row["bench_decode_tok_s"])
            if lv["clients"] == 1 and len(lens) == 1:
                row["engine_ttft_ms"] = (s.get("engine_ttft_ms") or {}).get(str(lens[0]))
                row["bench_ttft_ms"] = _ttft_cell(ttft, r, lens[0])
                row["ttft_ratio_engine"] = _ratio(lv["ttft_p50_ms"], row["engine_ttft_ms"])
                row["ttft_ratio_bench"] = _ratio(lv["ttft_p50_ms"], row["bench_ttft_ms"])
            rows.append(row)
    return {"serve_git": sorted({s["env"]["git"]["sha"][:12] for s in serves}),
            "decode_git": ((decode or {}).get("git") or {}).get("sha", "")[:12] or None,
            "ttft_git": ((ttft or {}).get("git") or {}).get("sha", "")[:12] or None,
            "tolerance": TOLERANCE, "rows": rows, "verdict": verdict(rows)}


def verdict(rows: list[dict]) -> dict:
    """The issue's three checks over ``rows``: 0 errors and 0 wrong; one-client TTFT <= 1.10 x the engine's
    (and the bench's where given); full-batch decode >= 0.90 x bench decode where both exist and the mix
    did not repeat prompts (None: nothing to judge)."""
    ok_streams = all(r["errors"] == 0 and r["wrong"] == 0 for r in rows)
    ttft = [r[k] for r in rows for k in ("ttft_ratio_engine", "ttft_ratio_bench") if r.get(k) is not None]
    dec = [r["decode_ratio"] for r in rows if r["decode_ratio"] is not None and not r["repeated_prompts"]]
    return {"streams": ok_streams,
            "ttft": None if not ttft else all(x <= 1 + TOLERANCE for x in ttft),
            "decode": None if not dec else all(x >= 1 - TOLERANCE for x in dec)}


def markdown(result: dict) -> str:
    def f(v):
        return "n/a" if v is None else v

    lines = [f"# serve targets (serve {', '.join(result['serve_git'])}; bench decode "
             f"{result['decode_git'] or 'from the serve run (--decode-reference)'}"
             + (f"; bench ttft {result['ttft_git']}" if result["ttft_git"] else "") + ")", "",
             "| residency | clients | errors / diverged / wrong | TTFT p50 ms | engine TTFT ms (x) | bench ttft ms (x) "
             "| decode rows | serve decode tok/s | bench decode tok/s | x |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        eng = f"{f(r.get('engine_ttft_ms'))} ({f(r.get('ttft_ratio_engine'))})" if "engine_ttft_ms" in r else ""
        bench = f"{f(r.get('bench_ttft_ms'))} ({f(r.get('ttft_ratio_bench'))})" if "bench_ttft_ms" in r else ""
        mark = " *" if r["repeated_prompts"] and r["decode_tok_s"] is not None else ""
        lines.append(f"| {r['residency']} | {r['clients']} | {r['errors']} / {r['diverged']} / {r['wrong']} | {r['ttft_p50_ms']} | {eng} | "
                     f"{bench} | {f(r['decode_rows'])} | {f(r['decode_tok_s'])}{mark} | {f(r['bench_decode_tok_s'])} | "
                     f"{f(r['decode_ratio'])} |")
    v = result["verdict"]
    if any(r["repeated_prompts"] and r["decode_tok_s"] is not None for r in result["rows"]):
        lines += ["", "\\* the mix repeated prompts at this level: not judged."]
    lines += ["",
              f"Verdict (tolerance {int(TOLERANCE * 100)}%): streams {'ok' if v['streams'] else 'FAILED'}; one-client "
              f"TTFT {_word(v['ttft'])}; full-batch decode {_word(v['decode'])}."]
    return "\n".join(lines) + "\n"


def _word(v: bool | None) -> str:
    return "not judged" if v is None else ("met" if v else "not met")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve", nargs="+", required=True, help="bench serve JSON files (one per residency)")
    p.add_argument("--decode", help="bench decode JSON (cells per residency and batch); levels with a same-run "
                   "decode_reference (bench serve --decode-reference) use that instead")
    p.add_argument("--ttft", help="bench ttft JSON (cells per residency and prompt length)")
    p.add_argument("--out", help="directory for serve-targets-<sha>.{json,md}")
    a = p.parse_args(argv)
    load = lambda path: json.loads(Path(path).read_text())  # noqa: E731
    result = compare([load(x) for x in a.serve], load(a.decode) if a.decode else None, load(a.ttft) if a.ttft else None)
    text = markdown(result)
    if a.out:
        stem = Path(a.out) / f"serve-targets-{'-'.join(result['serve_git'])}"
        stem.parent.mkdir(parents=True, exist_ok=True)
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2))
        stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
