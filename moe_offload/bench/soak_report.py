"""The soak benchmark's report: warmup, memory growth, verdicts, the markdown, the PNG and the files.

Per residency:
- warmup = the first ``WARMUP_FRACTION`` of the run, or until the warm passes over the workloads ended
  if that is later (every decoder, graph and kernel exists by then);
- growth of a memory metric = median of the last quarter minus median of the first quarter of the
  samples taken after the warmup (quarters of the post-warmup time span; each needs
  ``MIN_QUARTER_SAMPLES`` samples, else the verdict fails as "too few samples");
- verdicts: no mismatch; no fallback or declined event counted by requests that started after the
  warmup (``stats()["hit_d2d_fallbacks"]`` and ``["declined"]``); growth within ``GROWTH_LIMITS``.
A metric this device does not have (device memory on a CPU, pinned memory without CUDA) has no verdict.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from pathlib import Path

from moe_offload import log
from moe_offload.bench.env import short_sha, write_files
from moe_offload.bench.soak import WARMUP_FRACTION

MIB = 2**20
MIN_QUARTER_SAMPLES = 3
# Growth allowed after warmup, bytes, with why:
GROWTH_LIMITS = {
    # live between requests: pool, staging, static KV caches, graphs and their pools all exist after the warm
    # passes and are reused; a request leaves nothing alive, so any growth is something kept per request
    "device_allocated_idle": 0,
    # the caching allocator's segments only grow: when a request's activations find no cached block that fits
    # (fragmentation after a new interleaving of shapes). One new segment of the largest prefill activation
    # of qwen3-30b-a3b (16384 tokens x top-8 x 2 x 768 x bf16 = 384 MiB) is allowed; a leak grows without bound
    # and shows in device_allocated_idle first
    "device_reserved": 512 * MIB,
    # registered banks and routing record are fixed; torch's pinned host cache holds the index tensors of the
    # copies (KiB each, rounded up to powers of two) and keeps what it has seen
    "pinned_bytes": 16 * MIB,
    # host-side Python objects, allocator arenas per thread, freed-but-kept blocks of the largest activations
    # (tests/test_soak.py measured 7 MiB of drift on the CPU over 1500 steps); a per-request leak of a logits
    # row or a KV block exceeds it within minutes
    "rss_bytes": 64 * MIB,
}
LABELS = {"device_allocated_idle": "device allocated between requests", "device_reserved": "device reserved",
          "pinned_bytes": "pinned host", "rss_bytes": "process RSS"}


def _window(run: dict) -> tuple[float, float]:
    """(warmup end, run end) in seconds since the residency's start."""
    end = run["seconds"]
    warm = max(WARMUP_FRACTION * end, run["warm_passes_end_s"] if run["warm_passes_end_s"] is not None else end)
    return warm, end


def growth(samples: list[dict], metric: str, warm: float, end: float) -> dict:
    """Median of the last quarter minus median of the first quarter of the post-warmup samples."""
    span = end - warm
    values = [(s["t_s"], s[metric]) for s in samples if s["t_s"] >= warm and s[metric] is not None]
    if not any(s[metric] is not None for s in samples):
        return {"value": None, "first_quarter": None, "last_quarter": None, "samples": 0, "measured": False}
    first = [v for t, v in values if t < warm + span / 4]
    last = [v for t, v in values if t >= end - span / 4]
    out = {"samples": len(values), "first_quarter_samples": len(first), "last_quarter_samples": len(last),
           "measured": True, "value": None, "first_quarter": None, "last_quarter": None}
    if min(len(first), len(last)) >= MIN_QUARTER_SAMPLES:
        out.update(first_quarter=statistics.median(first), last_quarter=statistics.median(last))
        out["value"] = out["last_quarter"] - out["first_quarter"]
    return out


def _delta(after: dict, before: dict) -> dict:
    d = Counter(after)
    d.subtract(before)
    return {k: v for k, v in d.items() if v}


def derive(result: dict) -> None:
    """Warmup, growth and verdicts of every run, then ``passed`` (drops the per-request counters)."""
    for run in result["runs"]:
        warm, end = _window(run)
        run["warmup_s"] = warm
        counters = run.pop("counters_per_request")
        before = {"hit_d2d_fallbacks": {}, "declined": {}}
        for req, c in zip(run["requests"], counters):
            if req["t_end_s"] <= warm:
                before = c
        final = counters[-1] if counters else before
        after = {k: _delta(final[k], before[k]) for k in ("hit_d2d_fallbacks", "declined")}
        run["after_warmup"] = {"requests": sum(r["t_start_s"] >= warm for r in run["requests"]), **after}
        events = sum(after["hit_d2d_fallbacks"].values()) + sum(after["declined"].values())
        verdicts = [
            {"id": "mismatches", "value": run["mismatch_count"], "threshold": 0, "comparison": "==",
             "met": run["mismatch_count"] == 0, "detail": "requests whose greedy tokens differ from the all-resident run"},
            {"id": "fallback_and_declined_events_after_warmup", "value": events, "threshold": 0, "comparison": "==",
             "met": events == 0, "detail": json.dumps(after, sort_keys=True)},
        ]
        run["growth"] = {}
        for metric, limit in GROWTH_LIMITS.items():
            g = growth(run["samples"], metric, warm, end)
            run["growth"][metric] = g
            if not g["measured"]:
                met, detail = None, "not measured on this device"
            elif g["value"] is None:
                met, detail = False, (f"too few samples after warmup ({g['first_quarter_samples']} and "
                                      f"{g['last_quarter_samples']} in the first and last quarter, need "
                                      f"{MIN_QUARTER_SAMPLES}): raise --minutes or lower --sample-s")
            else:
                met, detail = g["value"] <= limit, "median of the last quarter - median of the first quarter"
            verdicts.append({"id": f"growth:{metric}", "value": g["value"], "threshold": limit, "comparison": "<=",
                             "met": met, "detail": detail})
        run["verdicts"] = verdicts
        run["passed"] = all(v["met"] is not False for v in verdicts)
    result["thresholds"] = {"growth_bytes": GROWTH_LIMITS, "mismatches": 0, "fallback_and_declined_events": 0,
                            "warmup": f"max({WARMUP_FRACTION:g} x run, end of the warm passes)",
                            "min_quarter_samples": MIN_QUARTER_SAMPLES}
    result["passed"] = all(r["passed"] for r in result["runs"])


def merge(results: list[dict], sources: list[str]) -> dict:
    """One result from the runs of several (each already derived): the first one's header, every run and
    reference in order. Raises ``BenchError`` when they are not of the same model, settings and commit."""
    from moe_offload.bench.ttft import BenchError

    for path, r in zip(sources, results):
        missing = [k for k in ("schema", "settings", "runs", "references", "notes") if k not in r] \
            if isinstance(r, dict) else ["an object of keys"]
        if missing:
            raise BenchError(f"--merge {path}: not a bench soak result (no {', '.join(missing)}); pass the JSON files "
                             "that bench soak wrote, one per residency")
    first = results[0]
    same = ("schema", "model", "git", "device")
    for path, r in zip(sources, results):
        settings = {k: v for k, v in r.get("settings", {}).items() if k != "residencies"}
        if any(r.get(k) != first.get(k) for k in same) or settings != {
                k: v for k, v in first["settings"].items() if k != "residencies"}:
            raise BenchError(f"--merge {path}: not the same model, commit, device and settings as {sources[0]}; "
                             "merge only the residencies of one soak")
    runs = [run for r in results for run in r["runs"]]
    if len({run["residency"] for run in runs}) != len(runs):
        raise BenchError(f"--merge: a residency appears twice in {', '.join(sources)}")
    out = {**first, "runs": runs, "references": [x for r in results for x in r["references"]],
           "notes": [n for r in results for n in r["notes"]] + [f"merged from {', '.join(sources)}"]}
    out["settings"] = {**first["settings"], "residencies": [run["residency"] for run in runs]}
    out["passed"] = all(run["passed"] for run in runs)
    return out


# ---------------------------------------------------------------------------------------- markdown
def _bytes(v) -> str:
    return "–" if v is None else f"{v / MIB:+.2f} MiB"


def _rate(v) -> str:
    return "–" if v is None else f"{100 * v:.1f} %"


def markdown(result: dict) -> str:
    m, s, v, git = result["model"], result["settings"], result["versions"], result["git"]
    refs = result["references"]
    ref_s = " + ".join(f"{x['seconds']:.1f}" for x in refs)
    lines = [
        f"# Soak: {m['label']} ({m['moe_layers']} MoE layers, {m['format']}) on {result['device']['name']}", "",
        f"git {short_sha(git)}{' (dirty)' if git['dirty'] else ''} · torch {v['torch']} · transformers "
        f"{v['transformers']} · triton {v['triton']} · CUDA runtime {v['cuda_runtime']} · {result['created']}", "",
        *([f"**PARTIAL**: written while residency {result['partial']['residency']:g} was running, "
           f"{result['partial']['seconds']:g} s into it ({result['partial']['written']}); the run had not ended.", ""]
          if result.get("partial") else []),
        f"**{'PASSED' if result['passed'] else 'FAILED'}.** {s['minutes']:g} min per residency; {s['workloads']} "
        f"seeded workloads (prompts {s['prompt_lens'][0]}..{s['prompt_lens'][1]} tokens log-uniform, batch 1.."
        f"{s['max_batch']}, at most {s['max_batch_tokens']} prompt tokens per batch), {s['new_tokens']} greedy "
        f"tokens each, compared exactly with the all-resident run ({refs[0]['slots']} slots; references in "
        f"{ref_s} s, once per routed-path threshold). Warmup: {result['thresholds']['warmup']}; memory sampled every "
        f"{s['sample_s']:g} s; growth = median of the last quarter - median of the first quarter after warmup.",
        "", "| residency | slots | routed path up to (tokens) | requests (after warmup) | mismatches | decode hit rate | prefill hit rate | "
        "fallback/declined after warmup | " + " | ".join(f"{LABELS[k]} growth" for k in GROWTH_LIMITS) + " | passed |",
        "| " + " | ".join(["---"] * (9 + len(GROWTH_LIMITS))) + " |",
    ]
    for run in result["runs"]:
        st, aw = run["stats"], run["after_warmup"]
        events = sum(aw["hit_d2d_fallbacks"].values()) + sum(aw["declined"].values())
        cols = [f"{run['residency']:g}", str(run["slots"]), str(run["routed_max_tokens"]),
                f"{len(run['requests'])} ({aw['requests']})",
                str(run["mismatch_count"]), _rate(st["hit_rate"]), _rate(st["prefill_hit_rate"]), str(events)]
        for metric, limit in GROWTH_LIMITS.items():
            g = run["growth"][metric]
            cols.append("n/a" if not g["measured"] else f"{_bytes(g['value'])} (≤ {limit / MIB:g} MiB)")
        cols.append("yes" if run["passed"] else "**NO**")
        lines.append("| " + " | ".join(cols) + " |")
    failed = [(run["residency"], x) for run in result["runs"] for x in run["verdicts"] if x["met"] is False]
    if failed:
        lines += ["", "## Failed verdicts", ""]
        lines += [f"- residency {r:g}: {x['id']} = {x['value']} (needs {x['comparison']} {x['threshold']}): "
                  f"{x['detail']}" for r, x in failed]
    mism = [(run["residency"], mm) for run in result["runs"] for mm in run["mismatches"]]
    if mism:
        lines += ["", "## Mismatches (first of each request)", "", "| residency | request | workload | sequence | "
                  "position | got | want |", "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {r:g} | {mm['request']} | {mm['workload']} | {mm['sequence']} | {mm['position']} | {mm['got']} | "
                  f"{mm['want']} |" for r, mm in mism]
    warnings = {k: n for run in result["runs"] for k, n in run["warning_events"].items()}
    if warnings:
        lines += ["", f"Warning events logged during the soak: {json.dumps(warnings, sort_keys=True)}"]
    if result["notes"]:
        lines += ["", "## Notes", ""] + [f"- {x}" for x in result["notes"]]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------- files
def plot(result: dict, path: Path) -> None:
    """One panel per memory metric (MiB over minutes), one line per residency, the warmup end dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, metric in zip(axes.flat, GROWTH_LIMITS):
        measured = False
        for i, run in enumerate(result["runs"]):
            pts = [(x["t_s"] / 60, x[metric] / MIB) for x in run["samples"] if x[metric] is not None]
            col = colors[i % len(colors)]
            if pts:
                measured = True
                ax.plot(*zip(*pts), "-", color=col, lw=1.2, label=f"residency {run['residency']:g}")
            if metric == "device_allocated_idle":  # the instantaneous value, requests in flight included
                inst = [(x["t_s"] / 60, x["device_allocated"] / MIB) for x in run["samples"]
                        if x["device_allocated"] is not None]
                if inst:
                    ax.plot(*zip(*inst), ":", color=col, lw=0.8, alpha=0.6, label=f"{run['residency']:g}, any time")
            ax.axvline(run["warmup_s"] / 60, color=col, ls="--", lw=0.8, alpha=0.7)
        ax.set_title(LABELS[metric], fontsize=9)
        ax.set_ylabel("MiB")
        ax.grid(True, alpha=0.3)
        if measured:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "not measured on this device", ha="center", va="center", transform=ax.transAxes)
    for ax in axes[1]:
        ax.set_xlabel("minutes since the residency's start (dashed: warmup end)")
    m = result["model"]
    fig.suptitle(f"soak {m['label']} · {result['device']['name']} · {short_sha(result['git'])} · "
                 f"{'passed' if result['passed'] else 'FAILED'}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_partial(result: dict, out: Path) -> None:
    """``result`` of a soak still running (its last run so far) as a partial report under ``write``'s name:
    the JSON and markdown, not the PNG. Drawing the PNG grows the soaking process's RSS by 4-10 MiB a time
    (matplotlib's render buffers; measured with this module's ``write``), and the H200 soaks at edd2da4 showed
    a +5.5-8 MiB RSS step at each 60 s partial report (~+30 MiB in 6-7 minutes, counted as the runtime's
    growth); without the PNG a report adds ~1 MiB once. ``bench soak --merge PARTIAL.json`` draws it later.
    A partial report is a safety net: failing to write one logs an event and never ends the soak."""
    last = result["runs"][-1]
    result["partial"] = {"residency": last["residency"], "seconds": round(last["seconds"], 1),
                         "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        derive(result)
        write(result, out, png=False)
    except Exception as exc:
        log.event("bench_soak_partial_not_written", 30, error=type(exc).__name__, message=str(exc))


def load_plotting() -> None:
    """Import the plotting library now (before soaking), so its memory is not counted as growth later."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401
    except ImportError:
        pass


def write(result: dict, out: Path, png: bool = True) -> dict:
    """Write ``soak-<label>-<sha>.{png,json,md}`` under ``out``; returns the paths and the markdown.
    Without matplotlib (or with ``png=False``) the PNG is not written; without matplotlib a note says so."""
    # named for the planned residencies: a partial report (fewer runs so far) and the whole one share a name
    planned = result.get("settings", {}).get("residencies") or [r["residency"] for r in result["runs"]]
    res = "+".join(f"{r:g}" for r in planned)
    stem = f"soak-{result['model']['label']}-r{res}-{short_sha(result['git'])}"
    return write_files(result, out, stem, markdown, plot if png else None, "soak")
