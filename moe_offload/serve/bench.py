"""``moe-offload bench serve``: N concurrent streaming clients against a live OpenAI-compatible server.

Without ``--url`` the benchmark starts the server itself (engine from ``--config``/``--set``, uvicorn on
127.0.0.1, an ephemeral port) and talks to it over HTTP like any client. Each client is a closed loop:
it sends its next request when the previous stream ends. The request mix is stated in the result:
``--distinct`` requests, each with its own seeded random prompt, cycling through the ``--prompt-lens`` x
``--max-tokens`` combinations, greedy, ``ignore_eos`` (so every request produces exactly its max_tokens).
By default there are as many distinct requests as the largest level has clients, so no two concurrent
streams are the same sequence (identical rows route to the same experts and would flatter decode
throughput; the 032db7c run in benchmarks/results/ had one prompt for every client, which is why).

Correctness: every distinct request of the mix is first run alone (one client); ``diverged`` counts the
concurrent streams whose ids differ from that run. In-process runs then judge each diverged stream by
teacher forcing on the engine alone (``serve/consistency.py``): ``wrong`` counts the streams with a token
the model does not rank first within the run's stated tolerance (a greedy flip at a near-tie is batch
numerics, not an error); a ``--url`` run has no engine to ask, and there ``wrong`` = ``diverged``.
Per level: TTFT p50/p99 (request sent -> first token), time per output token p50/p99 (per request:
(last token - first token) / (tokens - 1)), output tokens per second over the level's wall time, errors,
and the server's decode steps during the level by path (``decode_steps``: ``graph`` = CUDA graph replays
over the static KV cache, ``eager``), read from its ``/metrics`` before and after the level (null when
the server exports none).

Where the time goes (to compare with ``bench ttft`` and ``bench decode`` of the same model):
- ``decode_full_batch``: the server's decode forwards during the level that ran with every client's row
  in the batch (rows = min(clients, serve.max_batch)): steps, ms per step and tok/s = rows / step time,
  the figure ``bench decode`` reports at that batch (from ``/metrics``; host wall time per step, which
  includes the device work because the sampled ids are read on the host);
- in-process runs only: the scheduler's own split of each request (``server``: queue wait, prefill,
  TTFT p50 on the scheduler's clock, without the HTTP layer) and ``engine_ttft_ms``, ``Engine.measure_ttft``
  of each prompt length on the same engine before the server starts (the ``bench ttft`` measurement,
  one warm-up and three timed runs, median; with ``--decode-reference`` also ``bench decode``'s cell per
  full batch: ``serve/bench_reference.py``).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import re
from importlib import metadata
from pathlib import Path

import numpy as np

from moe_offload import log
from moe_offload.config import seed_arg
from moe_offload.serve import bench_report
from moe_offload.serve.bench_clients import ClientProcess, Job


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config of the server to start (default: the embedded tiny model)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (serve.* too)")
    p.add_argument("--url", help="benchmark a running server at this base URL instead of starting one")
    p.add_argument("--clients", default="1,4,16,64", help="concurrency levels, comma-separated")
    p.add_argument("--requests-per-client", default="4",
                   help="closed-loop requests per client: one value for every level, or one per --clients level "
                        "(e.g. 5,2,1,1: more requests where few clients give few samples)")
    p.add_argument("--prompt-lens", default="16,128", help="prompt lengths in tokens, comma-separated")
    p.add_argument("--max-tokens", default="16,64", help="output lengths in tokens, comma-separated")
    p.add_argument("--distinct", type=int, default=None,
                   help="distinct requests in the mix, each its own seeded prompt, each first run alone as the "
                        "reference (default: the largest --clients level, at least every length x output combination)")
    p.add_argument("--vocab", type=int, default=None, help="prompt ids are drawn from [3, vocab) (default: the model's)")
    p.add_argument("--seed", type=seed_arg, default=0)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out", help="directory for serve-<model>-<sha>.{json,md,png}")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--git-sha", help="record this commit when the tree has no .git or a copy reports another")
    p.add_argument("--decode-reference", action="store_true",
                   help="in-process runs: before serving, time bench decode's cell on the same engine at each level's "
                        "full batch (min(clients, serve.max_batch) rows of the first prompt length, the first output "
                        "length in tokens, the budget's seeded resident set), so full-batch decode is compared "
                        "within one run (JSON: decode_reference; levels[*].decode_reference)")
    p.add_argument("--clients-in-process", action="store_true",
                   help="run the clients on this process's event loop instead of a child process (the default keeps "
                        "their Python work off the GIL of an in-process server, as real clients are)")
    p.add_argument("--tie-tolerance", type=float, default=None,
                   help="logits: a diverged stream is consistent when every served token's logit is within this of "
                        "the maximum under teacher forcing (default: 2 x the largest such margin of the reference "
                        "streams, measured in the same run)")


def _ints(text: str, option: str) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{option} {text!r}: expected comma-separated integers such as 1,4,16") from None
    if not vals or min(vals) < 1:
        raise ValueError(f"{option} {text!r}: every value must be an integer >= 1")
    return vals


def requests_per_client(text: str, levels: list[int]) -> list[int]:
    """``--requests-per-client``: one value for every level or one per level -> one per level."""
    vals = _ints(str(text), "--requests-per-client")
    if len(vals) == 1:
        return vals * len(levels)
    if len(vals) != len(levels):
        raise ValueError(f"--requests-per-client {text!r}: give one value or one per --clients level ({len(levels)})")
    return vals


def make_mix(prompt_lens: list[int], max_tokens: list[int], vocab: int, seed: int, distinct: int = 0) -> list[Job]:
    """``max(distinct, lengths x outputs)`` requests, each with its own seeded prompt; request j has length
    ``prompt_lens[j % L]`` and output ``max_tokens[(j // L) % M]`` (every combination within the first L x M)."""
    rng = random.Random(seed)
    L, M = len(prompt_lens), len(max_tokens)
    return [Job(tuple(rng.randrange(3, vocab) for _ in range(prompt_lens[j % L])), max_tokens[(j // L) % M])
            for j in range(max(distinct, L * M))]


_DECODE_STEPS_RE = re.compile(r'^moe_offload_decode_steps_total\{path="(\w+)"\} ([0-9.e+]+)$', re.MULTILINE)
_ROWS_RE = re.compile(r'^moe_offload_decode_rows_(steps|seconds)_total\{rows="(\d+)"\} ([0-9.e+-]+)$', re.MULTILINE)


def scrape(url: str) -> dict | None:
    """The server's decode counters from ``/metrics``: ``{"steps": {path: n}, "rows": {rows: [steps, s]}}``
    (None when it cannot be read; its parts are None when the server exports none)."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError as exc:  # the level's numbers stand without it; the result says null
        log.event("bench_serve_metrics_unavailable", 30, url=url, error=type(exc).__name__, message=str(exc))
        return None
    rows: dict[int, list] = {}
    for kind, n, v in _ROWS_RE.findall(text):
        rows.setdefault(int(n), [0, 0.0])[0 if kind == "steps" else 1] = float(v)
    steps = {path: int(float(n)) for path, n in _DECODE_STEPS_RE.findall(text)}
    return {"steps": steps or None, "rows": rows or None}


def _delta(after: dict[str, int] | None, before: dict[str, int] | None) -> dict[str, int] | None:
    if after is None or before is None:
        return None
    return {path: n - before.get(path, 0) for path, n in after.items()}


def full_batch(after: dict | None, before: dict | None, rows: int) -> dict | None:
    """The level's decode forwards with ``rows`` rows: steps, ms per step, tok/s (None without them)."""
    if after is None or before is None:  # a failed scrape: the level's figures are unknown, not since start
        return None
    a = after.get("rows") or {}
    b = before.get("rows") or {}
    steps = a.get(rows, [0, 0.0])[0] - b.get(rows, [0, 0.0])[0]
    secs = a.get(rows, [0, 0.0])[1] - b.get(rows, [0, 0.0])[1]
    if steps <= 0 or secs <= 0:
        return None
    return {"rows": rows, "steps": int(steps), "ms_per_step": round(secs / steps * 1000, 3),
            "tok_s": round(rows * steps / secs, 2)}


def server_split(rows: list[dict]) -> dict | None:
    """p50 of the scheduler's queue wait, prefill, prefill host time (its forwards' enqueue: close to the
    prefill means the host bounds it) and TTFT over ``rows`` (``Scheduler.timings``)."""
    def p50(key):
        return _ms(_pct([r[key] for r in rows if r[key] is not None], 50))

    if not rows:
        return None
    return {"requests": len(rows), "queue_p50_ms": p50("queue_s"), "prefill_p50_ms": p50("prefill_s"),
            "prefill_host_p50_ms": p50("prefill_host_s"), "ttft_p50_ms": p50("ttft_s")}


def _pct(vals: list[float], q: float) -> float | None:
    return float(np.percentile(vals, q)) if vals else None


def summarize(records: list[dict], wall_s: float, expected: dict[Job, list[int]], clients: int) -> dict:
    ok = [r for r in records if r["error"] is None]
    ttft = [r["t_tokens"][0] for r in ok if r["t_tokens"]]
    tpot = [(r["t_tokens"][-1] - r["t_tokens"][0]) / (len(r["t_tokens"]) - 1) for r in ok if len(r["t_tokens"]) > 1]
    tokens = sum(len(r["ids"]) for r in ok)
    diverged = sum(1 for r in ok if expected and r["ids"] != expected.get(r["job"]))
    errors = [r["error"] for r in records if r["error"] is not None]
    return {"clients": clients, "requests": len(records), "errors": len(errors), "error_examples": errors[:3],
            "diverged": diverged, "wrong": diverged, "output_tokens": tokens, "wall_s": round(wall_s, 4),
            "throughput_tok_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
            "ttft_p50_ms": _ms(_pct(ttft, 50)), "ttft_p99_ms": _ms(_pct(ttft, 99)),
            "tpot_p50_ms": _ms(_pct(tpot, 50)), "tpot_p99_ms": _ms(_pct(tpot, 99))}


def _ms(s: float | None) -> float | None:
    return None if s is None else round(s * 1000, 3)


def _environment(git_sha: str | None = None) -> dict:
    from moe_offload.bench.env import git_info

    def version(d):
        try:
            return metadata.version(d)
        except metadata.PackageNotFoundError:
            return None

    return {"git": git_info(git_sha), "device": platform.processor() or platform.machine(),
            "versions": {"python": platform.python_version(),
                         **{d: version(d) for d in ("torch", "transformers", "fastapi", "uvicorn", "moe-offload")}}}


def run(url: str, a: argparse.Namespace, vocab: int, model: str, extra: dict | None = None,
        scheduler=None, max_batch: int | None = None) -> dict:
    """Run the reference pass and every concurrency level against ``url`` -> the result dict.
    ``scheduler`` (in-process runs): the server's scheduler, whose per-request timings are reported too."""
    levels = _ints(a.clients, "--clients")
    per_client = requests_per_client(a.requests_per_client, levels)
    mix = make_mix(_ints(a.prompt_lens, "--prompt-lens"), _ints(a.max_tokens, "--max-tokens"), vocab, a.seed,
                   a.distinct if a.distinct is not None else max(levels))
    with ClientProcess(getattr(a, "clients_in_process", False)) as clients:
        where = clients.where
        out, diverged, expected = _levels(clients, url, a, mix, levels, per_client, scheduler, max_batch)
    return {"model": model, "url": url, "env": _environment(getattr(a, "git_sha", None)), **(extra or {}),
            "mix": {"prompt_lens": _ints(a.prompt_lens, "--prompt-lens"), "max_tokens": _ints(a.max_tokens, "--max-tokens"),
                    "requests_per_client": per_client, "distinct_requests": len(mix), "seed": a.seed,
                    "sampling": "greedy, ignore_eos", "clients": where},
            "levels": out, "_diverged": diverged,
            "_references": [(list(job.prompt_ids), expected[job]) for job in mix]}


def _levels(clients: ClientProcess, url: str, a, mix: list[Job], levels: list[int], per_client: list[int],
            scheduler, max_batch: int | None) -> tuple[list[dict], list[dict], dict[Job, list[int]]]:
    """The single-client reference pass, then every level -> (levels, diverged streams, reference ids)."""
    alone, _ = clients.level(url, mix, 1, len(mix), a.timeout)
    bad = [r["error"] for r in alone if r["error"] is not None]
    if bad:
        raise RuntimeError(f"the single-client reference pass failed: {bad[0]}")
    expected = {r["job"]: r["ids"] for r in alone}
    out, diverged = [], []
    for n, k in zip(levels, per_client):
        before = scrape(url)
        seen = {r["id"] for r in scheduler.timings()} if scheduler is not None else set()
        recs, wall = clients.level(url, mix, n, k, a.timeout)
        after = scrape(url)
        steps = _delta(*(None if x is None else x["steps"] for x in (after, before)))
        diverged += [{"clients": n, "job": mix.index(r["job"]), "prompt": list(r["job"].prompt_ids), "ids": r["ids"],
                      "expected": expected[r["job"]]} for r in recs
                     if r["error"] is None and r["ids"] != expected[r["job"]]]
        level = {**summarize(recs, wall, expected, n), "decode_steps": steps,
                 "decode_full_batch": full_batch(after, before, min(n, max_batch or n))}
        if scheduler is not None:
            level["server"] = server_split([r for r in scheduler.timings() if r["id"] not in seen])
        out.append(level)
        # "wrong" is provisional (= diverged) until apply_judgement: the event leaves it out, bench_serve_judged has it
        log.info_rank0("bench_serve_level", **{k: v for k, v in out[-1].items() if k not in ("error_examples", "wrong")})
    return out, diverged, expected


def apply_judgement(result: dict, judgement: dict | None) -> dict:
    """Set each level's ``wrong`` from ``judgement`` (``consistency.judge``) or, without one (a ``--url`` run),
    to its ``diverged``; drop the private stream lists."""
    result.pop("_references", None)
    result.pop("_diverged", None)
    if judgement is None:
        result["consistency"] = {"method": "exact: a --url run has no engine to teacher-force; wrong = diverged"}
    else:
        for level in result["levels"]:
            level["wrong"] = sum(1 for s in judgement["streams"]
                                 if s["clients"] == level["clients"] and not s["consistent"])
        result["consistency"] = judgement
    log.info_rank0("bench_serve_judged", method=result["consistency"].get("method"),
                   tolerance=result["consistency"].get("tolerance"),
                   wrong={lv["clients"]: lv["wrong"] for lv in result["levels"]},
                   diverged={lv["clients"]: lv["diverged"] for lv in result["levels"]})
    return result


def main(a: argparse.Namespace) -> int:
    requests_per_client(a.requests_per_client, _ints(a.clients, "--clients"))  # bad values fail before any work
    if a.distinct is not None and a.distinct < 1:
        raise ValueError(f"--distinct {a.distinct}: must be >= 1")
    from moe_offload.bench.env import check_out_dir

    check_out_dir(a.out)
    if a.url:
        import httpx

        try:
            model = httpx.get(a.url.rstrip("/") + "/v1/models", timeout=30).json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise ValueError(f"--url {a.url}: no OpenAI-compatible server answered GET /v1/models "
                             f"({type(exc).__name__}: {exc}); start one (moe-offload serve) or fix the URL, e.g. "
                             "http://127.0.0.1:8000") from None
        result = apply_judgement(run(a.url.rstrip("/"), a, a.vocab or 256, model), None)
    else:
        result = _run_in_process(a)
    text = bench_report.markdown(result)
    if a.out:
        out = Path(a.out)
        out.mkdir(parents=True, exist_ok=True)
        stem = out / f"serve-{result['model']}-{result['env']['git']['sha'][:12]}"
        stem.with_suffix(".json").write_text(json.dumps(result, indent=2, default=str))
        stem.with_suffix(".md").write_text(text)
        bench_report.plot(result, stem.with_suffix(".png"))
        log.info_rank0("bench_serve_written", path=str(stem) + ".{json,md,png}")
    print(json.dumps(result, indent=2, default=str) if a.json else text)
    failed = any(r["errors"] or r["wrong"] for r in result["levels"])
    return 1 if failed else 0


def _run_in_process(a: argparse.Namespace) -> dict:
    from moe_offload.config import config_to_dict, load_config
    from moe_offload.engine import Engine
    from moe_offload.serve.bench_reference import attach_decode_reference, decode_reference, engine_ttft
    from moe_offload.serve.scheduler import Scheduler
    from moe_offload.serve.server import ServerThread, build_app, model_name

    cfg = load_config(a.config, a.set)  # serve.* keys are part of the config tree
    serve_cfg = cfg.serve
    log.configure(cfg.logging.level, cfg.logging.format)
    engine = Engine.from_config(cfg, progress=not a.json)
    vocab = a.vocab or int(engine.reader.geometry.vocab)
    ttft_ms = engine_ttft(engine, [job.prompt_ids for job in make_mix(_ints(a.prompt_lens, "--prompt-lens"), [1],
                                                                        vocab, a.seed)])
    reference = None
    if getattr(a, "decode_reference", False):
        rows = sorted({min(n, serve_cfg.max_batch) for n in _ints(a.clients, "--clients")})
        reference = decode_reference(engine, rows, _ints(a.prompt_lens, "--prompt-lens")[0],
                                     _ints(a.max_tokens, "--max-tokens")[0], vocab, a.seed)
    scheduler = Scheduler(engine, serve_cfg).start()
    http = ServerThread(build_app(scheduler, serve_cfg)).start()
    try:
        extra = {"config": config_to_dict(cfg), "serve_config": serve_cfg.model_dump(),
                 "engine": {"device": str(engine.device), "dtype": str(engine.dtype).replace("torch.", ""),
                            "gpu": _gpu_name(engine.device)},
                 "engine_ttft_ms": ttft_ms}
        if reference is not None:
            extra["decode_reference"] = reference
        result = run(http.url, a, vocab, model_name(engine, serve_cfg), extra, scheduler, serve_cfg.max_batch)
        if reference is not None:
            attach_decode_reference(result["levels"], reference)
        result["cache"] = {k: v for k, v in scheduler.cache_stats.items() if k != "per_layer"}
        result["decode_batch"] = {"kind": scheduler.executor.batch.kind, "steps": scheduler.decode_steps}
    finally:
        http.stop()
        scheduler.stop()
    # the loop thread has stopped: the engine is this thread's again (teacher forcing, after the cache stats)
    from moe_offload.serve.consistency import judge

    judgement = judge(engine, result["_references"], result["_diverged"], getattr(a, "tie_tolerance", None))
    return apply_judgement(result, judgement)


def _gpu_name(device) -> str | None:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else None
