"""The report of ``moe-offload bench serve`` (``serve/bench.py`` measures): the markdown table and the PNG."""

from __future__ import annotations

from pathlib import Path


def markdown(result: dict) -> str:
    mix = result["mix"]
    head = (f"# bench serve: {result['model']}\n\n"
            f"git {result['env']['git']['sha'][:12]}, {result['env']['device']}, mix: prompts {mix['prompt_lens']} x "
            f"outputs {mix['max_tokens']} tokens, greedy, {_per_client(mix['requests_per_client'])} requests per client "
            f"(closed loop, clients {mix.get('clients', 'in process')})"
            f"{_batch_note(result)}\n\n"
            "| clients | requests | errors | diverged / wrong | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | tok/s "
            "| decode steps graph / eager | server queue / prefill (host) / TTFT p50 ms | full-batch decode tok/s (steps) |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
    rows = [f"| {r['clients']} | {r['requests']} | {r['errors']} | {r.get('diverged', r['wrong'])} / {r['wrong']} | {r['ttft_p50_ms']} | {r['ttft_p99_ms']} | "
            f"{r['tpot_p50_ms']} | {r['tpot_p99_ms']} | {r['throughput_tok_s']} | {_steps_cell(r.get('decode_steps'))} | "
            f"{_split_cell(r.get('server'))} | {_full_cell(r.get('decode_full_batch'))} |"
            for r in result["levels"]]
    tail = ""
    if result.get("engine_ttft_ms"):
        tail = ("\nEngine TTFT (`Engine.measure_ttft`, same engine, before the server starts; median of 3): "
                + ", ".join(f"{n} tokens {ms} ms" for n, ms in result["engine_ttft_ms"].items()) + "\n")
    return head + "\n".join(rows) + "\n" + tail + _decode_reference(result) + _consistency(result.get("consistency"))


def _decode_reference(result: dict) -> str:
    """``--decode-reference``: bench decode's cell on the same engine, and each level's full-batch decode over it."""
    ref = result.get("decode_reference")
    if not ref:
        return ""
    ratios = [f"{lv['clients']} clients {lv['decode_reference']['ratio']} x ({lv['decode_reference']['rows']} rows)"
              for lv in result["levels"] if lv.get("decode_reference")]
    return (f"\nDecode reference (`bench decode`'s cell on the same engine before serving; {ref['prompt_len']}-token "
            f"prompts, {ref['steps']} steps, {ref['resident_per_layer']} resident experts per layer): "
            + ", ".join(f"{rows} rows {c['tok_s']} tok/s" for rows, c in ref["cells"].items())
            + ". Full-batch decode over it: " + (", ".join(ratios) or "no level ran a full batch") + ".\n")


def _consistency(c: dict | None) -> str:
    """How the diverged streams were judged (serve/consistency.py), one line per stream."""
    if not c:
        return ""
    if "tolerance" not in c:
        return f"\nStreams: {c['method']}.\n"
    lines = [f"\nStreams that differ from their single run: judged by {c['method']}; tolerance {c['tolerance']} logits "
             f"({c['tolerance_source']}; largest reference margin {c['reference_max_margin']}; a margin within one step of the "
             "logits' dtype at the top logit is a tie whatever the tolerance).\n"]
    if c["streams"]:
        lines += ["| clients | request | first different token | margin there | largest margin | logits' dtype step | consistent |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        lines += [f"| {s['clients']} | {s['job']} | {s['first_difference']} of {s['tokens']} | {s['margin_at_difference']} | "
                  f"{s['max_margin']} | {s.get('max_dtype_step', 'n/a')} | {'yes' if s['consistent'] else '**no**'} |"
                  for s in c["streams"]]
    return "\n".join(lines) + "\n"


def _batch_note(result: dict) -> str:
    eng, batch = result.get("engine") or {}, result.get("decode_batch")
    gpu = f", {eng['gpu']}" if eng.get("gpu") else ""
    return f"{gpu}, decode batch: {batch['kind']} KV cache" if batch else gpu


def _per_client(k) -> str:
    if isinstance(k, list) and len(set(k)) > 1:
        return "/".join(map(str, k)) + " (per level)"
    return str(k[0] if isinstance(k, list) else k)


def _split_cell(split: dict | None) -> str:
    if not split:
        return "n/a"
    host = split.get("prefill_host_p50_ms")
    prefill = split["prefill_p50_ms"] if host is None else f"{split['prefill_p50_ms']} ({host})"
    return f"{split['queue_p50_ms']} / {prefill} / {split['ttft_p50_ms']}"


def _full_cell(full: dict | None) -> str:
    return "n/a" if not full else f"{full['tok_s']} ({full['steps']} x {full['rows']} rows)"


def _steps_cell(steps: dict[str, int] | None) -> str:
    return "n/a" if steps is None else f"{steps.get('graph', 0)} / {steps.get('eager', 0)}"


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lv = result["levels"]
    x = [r["clients"] for r in lv]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for key, style in (("ttft_p50_ms", "o-"), ("ttft_p99_ms", "o--"), ("tpot_p50_ms", "s-"), ("tpot_p99_ms", "s--")):
        a1.plot(x, [r[key] for r in lv], style, label=key.replace("_ms", ""))
    a1.set(xscale="log", yscale="log", xlabel="concurrent clients", ylabel="ms", title="latency")
    a1.legend()
    a2.plot(x, [r["throughput_tok_s"] for r in lv], "o-")
    a2.set(xscale="log", xlabel="concurrent clients", ylabel="output tokens / s", title="throughput")
    fig.suptitle(f"bench serve: {result['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
