"""Where serving spends time beyond the engine's own, one layer of the stack at a time (same engine, same
prompts, one process): the diagnostic behind the residency-1 gap of ``bench serve`` (one-client TTFT 1.37 x
``Engine.measure_ttft`` and full-batch decode 0.86-0.94 x ``bench decode`` on the H200 at d9f7bae).

    python benchmarks/serve_overhead.py --config configs/qwen3-30b-a3b-nvfp4.yaml --set model.layers=12 \\
        --set cache.budget=1.0 --out benchmarks/results

TTFT of ``--prompts`` distinct seeded prompts (``--prompt-len`` tokens), median per variant:
1. ``engine``: ``Engine.measure_ttft`` on the main thread (what ``bench ttft`` and ``bench serve``'s
   ``engine_ttft_ms`` time);
2. ``engine_thread``: the same call on a fresh worker thread (thread-local state: current stream, grad mode);
3. ``scheduler``: ``Scheduler.submit`` of one request at a time, no HTTP; its own clock (prefill start ->
   first token sampled) and the submitter's (submit -> first token at the sink);
4. ``scheduler_http``: the same with the HTTP server thread started and idle;
5. ``engine_after``: ``engine_thread`` again after the scheduler stopped (its static batch, graphs and decode
   state still allocated): a gap that stays here is the engine's state after serving, one that goes is the loop.
Each TTFT variant also reports the host time of its prefill forward (``enqueue_ms``: until the call returns,
its launches enqueued): near the TTFT, the host bounds the prefill.
``--profile DIR``: a torch profiler table (top ops by CUDA and by CPU time) of one prefill per variant
(``engine_thread``, ``scheduler``, ``engine_after``) under DIR.
Decode: the scheduler's host wall time per step (``Scheduler.decode_timing``) with ``--rows`` concurrent
requests beside ``bench decode``'s cell on the same engine (``serve/bench_reference.decode_reference``).
Writes ``serve-overhead-<sha>.json`` and ``.md`` under ``--out`` and prints the markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import threading
import time
from pathlib import Path

import torch


def _sha() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _ms(xs: list[float]) -> float:
    return round(statistics.median(xs) * 1e3, 3)


class Profiles:
    """One profiled call per variant when ``--profile`` names a directory; a plain call otherwise."""

    def __init__(self, out: Path | None):
        self.out = out

    def run(self, name: str, fn):
        if self.out is None:
            return fn()
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            r = fn()
        self.out.mkdir(parents=True, exist_ok=True)
        ka = prof.key_averages()
        text = [f"# {name}", "", "## by device time", "",
                ka.table(sort_by="self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total",
                         row_limit=25), "", "## by host time", "", ka.table(sort_by="self_cpu_time_total", row_limit=25)]
        (self.out / f"profile-{name}.txt").write_text("\n".join(text) + "\n")
        return r


def timed_ttft(engine, prompt: list[int]) -> tuple[float, float]:
    """``Engine.measure_ttft``'s clock, split: (host seconds until the prefill forward returns, i.e. its
    launches are enqueued; seconds until the first token is on the host). Enqueue close to TTFT: the
    forward is bound by the host."""
    engine._sync()
    t0 = time.perf_counter()
    logits, _ = engine.prefill(prompt, last_only=True)
    t1 = time.perf_counter()
    int(logits[0, -1].argmax().item())
    return t1 - t0, time.perf_counter() - t0


def engine_ttfts(engine, prompts: list[list[int]], thread: bool, profiles: Profiles | None = None,
                 name: str = "", enqueue: list[float] | None = None) -> list[float]:
    out: list[float] = []

    def work():
        engine.measure_ttft(prompts[0])  # warm-up
        for p in prompts:
            host, ttft = timed_ttft(engine, p)
            out.append(ttft)
            if enqueue is not None:
                enqueue.append(host)
        if profiles is not None:
            profiles.run(name, lambda: engine.measure_ttft(prompts[0]))

    if not thread:
        work()
        return out
    t = threading.Thread(target=work, name="serve-overhead-engine")
    t.start()
    t.join()
    return out


class EnqueueClock:
    """Wraps the scheduler's ``executor.prefill``: host seconds of each call (the forward's launches enqueued,
    nothing synchronized), the loop-side counterpart of ``timed_ttft``'s first figure."""

    def __init__(self, scheduler):
        self.executor, self.plain, self.times = scheduler.executor, scheduler.executor.prefill, []

        def prefill(rid, ids, *rest):
            t0 = time.perf_counter()
            r = self.plain(rid, ids, *rest)
            self.times.append(time.perf_counter() - t0)
            return r

        self.executor.prefill = prefill

    def close(self) -> None:
        self.executor.prefill = self.plain


def scheduler_ttfts(scheduler, prompts: list[list[int]], max_tokens: int) -> tuple[list[float], list[float]]:
    """One request at a time: (scheduler clock prefill -> first token, submitter clock submit -> first token)."""
    from moe_offload.serve.sampling import SamplingParams

    sched_s, client_s = [], []
    for p in prompts:
        first = threading.Event()
        done = threading.Event()
        t_first = []

        def sink(out, first=first, done=done, t_first=t_first):
            if not first.is_set():
                t_first.append(time.perf_counter())
                first.set()
            if out.finished:
                done.set()

        n0 = len(scheduler.finished)
        t0 = time.perf_counter()
        scheduler.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True), sink)
        if not done.wait(300):
            raise TimeoutError("a request did not finish within 300 s")
        client_s.append(t_first[0] - t0)
        row = scheduler.finished[n0]
        if row["finish_reason"] not in ("length", "stop"):
            raise RuntimeError(f"request failed: {row}")
        sched_s.append(row["prefill_s"])
    return sched_s, client_s


def clocked_scheduler_ttfts(scheduler, prompts: list[list[int]], max_tokens: int):
    """``scheduler_ttfts`` plus the host seconds of each prefill call (``EnqueueClock``)."""
    clock = EnqueueClock(scheduler)
    try:
        s, c = scheduler_ttfts(scheduler, prompts, max_tokens)
    finally:
        clock.close()
    return s, c, clock.times


def decode_steps(scheduler, prompts: list[list[int]], max_tokens: int) -> dict:
    """``len(prompts)`` concurrent requests; the scheduler's ms per step at the full batch."""
    from moe_offload.serve.sampling import SamplingParams

    before = dict(scheduler.decode_timing)
    done = [threading.Event() for _ in prompts]
    for p, ev in zip(prompts, done):
        scheduler.submit(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                         lambda out, ev=ev: ev.set() if out.finished else None)
    for ev in done:
        if not ev.wait(600):
            raise TimeoutError("decode requests did not finish within 600 s")
    n0, s0 = before.get(len(prompts), (0, 0.0))
    n1, s1 = scheduler.decode_timing.get(len(prompts), (0, 0.0))
    return {"rows": len(prompts), "steps": n1 - n0, "ms_per_step": round((s1 - s0) / max(n1 - n0, 1) * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config")
    p.add_argument("--set", action="append", default=[])
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--rows", default="1,4", help="concurrent requests for the decode comparison")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path, default=Path("."))
    p.add_argument("--profile", type=Path, help="write torch profiler tables of one prefill per variant here")
    a = p.parse_args(argv)
    profiles = Profiles(a.profile)

    from moe_offload import log
    from moe_offload.config import load_config
    from moe_offload.engine import Engine
    from moe_offload.serve.bench_reference import decode_reference
    from moe_offload.serve.scheduler import Scheduler
    from moe_offload.serve.server import ServerThread, build_app

    cfg = load_config(a.config, a.set)
    log.configure(cfg.logging.level, cfg.logging.format)
    engine = Engine.from_config(cfg, progress=True)
    vocab = int(engine.reader.geometry.vocab)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (a.prompts, a.prompt_len), generator=g).tolist()
    rows = [int(x) for x in a.rows.split(",")]
    res: dict = {"sha": _sha(), "config": a.config, "set": a.set, "prompt_len": a.prompt_len, "prompts": a.prompts,
                 "gpu": torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else "cpu",
                 "versions": {"torch": torch.__version__}}
    enq: dict[str, list[float]] = {k: [] for k in ("engine", "engine_thread", "scheduler", "scheduler_http",
                                                   "engine_after")}
    res["ttft_ms"] = {"engine": _ms(engine_ttfts(engine, prompts, False, enqueue=enq["engine"])),
                      "engine_thread": _ms(engine_ttfts(engine, prompts, True, profiles, "engine_thread",
                                                        enq["engine_thread"]))}
    ref = decode_reference(engine, rows, a.prompt_len, a.max_tokens, vocab, 0)
    engine.drop_decoders()
    scheduler = Scheduler(engine, cfg.serve).start()
    try:
        scheduler_ttfts(scheduler, prompts[:1], 2)  # warm-up (graph capture of the 1-row bucket)
        s, c, enq["scheduler"] = clocked_scheduler_ttfts(scheduler, prompts, a.max_tokens)
        res["ttft_ms"]["scheduler"], res["ttft_ms"]["scheduler_submit"] = _ms(s), _ms(c)
        if a.profile is not None:  # the profiler records the thread it runs on: the loop's, around one prefill
            plain = scheduler.executor.prefill
            scheduler.executor.prefill = lambda rid, ids, *rest: profiles.run("scheduler", lambda: plain(rid, ids, *rest))
            try:
                scheduler_ttfts(scheduler, prompts[:1], 1)
            finally:
                scheduler.executor.prefill = plain
        res["decode"] = []
        for n in rows:
            decode_steps(scheduler, [prompts[i % len(prompts)] for i in range(n)], 4)  # warm-up
            d = decode_steps(scheduler, [prompts[i % len(prompts)] for i in range(n)], a.max_tokens)
            d["reference_ms_per_step"] = ref["cells"][str(n)]["ms_per_step_median"]
            d["ratio"] = round(d["ms_per_step"] / d["reference_ms_per_step"], 3)
            res["decode"].append(d)
        http = ServerThread(build_app(scheduler, cfg.serve)).start()
        try:
            s, c, enq["scheduler_http"] = clocked_scheduler_ttfts(scheduler, prompts, a.max_tokens)
            res["ttft_ms"]["scheduler_http"], res["ttft_ms"]["scheduler_http_submit"] = _ms(s), _ms(c)
        finally:
            http.stop()
    finally:
        scheduler.stop()
    res["ttft_ms"]["engine_after"] = _ms(engine_ttfts(engine, prompts, True, profiles, "engine_after",
                                                      enq["engine_after"]))
    res["enqueue_ms"] = {k: _ms(v) for k, v in enq.items() if v}
    base = res["ttft_ms"]["engine"]
    lines = [f"# Serving overhead ({res['gpu']}, git {res['sha']}, {' '.join(a.set)})", "",
             f"TTFT of {a.prompts} distinct {a.prompt_len}-token prompts, median:", "",
             "| variant | ms | x engine |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v} | {v / base:.3f} |" for k, v in res["ttft_ms"].items()]
    lines += ["", "Host time of the prefill forward (returns once its launches are enqueued, before the first token "
              "is read): close to the TTFT means the host bounds the prefill.", "",
              "| variant | enqueue ms | TTFT ms |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v} | {res['ttft_ms'][k]} |" for k, v in res["enqueue_ms"].items()]
    lines += ["", "| rows | scheduler ms/step | bench decode ms/step | x |", "| --- | --- | --- | --- |"]
    lines += [f"| {d['rows']} | {d['ms_per_step']} | {d['reference_ms_per_step']} | {d['ratio']} |" for d in res["decode"]]
    text = "\n".join(lines) + "\n"
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"serve-overhead-{res['sha']}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    stem.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
