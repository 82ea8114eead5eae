"""The TTFT benchmark's report: floors and ratios per cell, the TTFT targets, the markdown table and
the files under ``--out`` (the run's environment and model entry: ``bench/env.py``).

Ratios: ``ratio_to_floor = TTFT / max(PCIe floor, compute floor)`` where the PCIe floor of a cell is
its missing bytes of every layer (``(1 - measured hit fraction) * all expert bytes``; the resident
fraction where the forward staged nothing) over the H2D bandwidth measured in the same run: what
staging must copy. ``ratio_to_routed_floor = TTFT / max(routed floor, compute floor)`` where the
routed-bytes floor is the bytes of the distinct missing experts the prompt really routed (every layer)
over the same bandwidth: what any path must copy. The compute floor is the fastest variant whose hits
were really served from the device (copied D2D, or read in place on the routed path) at residency 1
(every expert resident), for the same prompt length.
"""

from __future__ import annotations

import math
from pathlib import Path

from moe_offload.bench.env import no_peers_line, on_cuda, partial_lines, short_sha, write_files

FULL_LAYER = "full_layer_copy"
TARGET_PROMPT_LEN = 1024  # the TTFT targets are stated for a 1024-token prompt; other lengths are reported too
TARGET_RESIDENCY_MAX = 0.75
TTFT_OVER_FLOOR_MAX = 1.10
ALL_RESIDENT_OVER_BF16_MAX = 1.5
ACCELERATE_RESIDENCY, ACCELERATE_SPEEDUP_MIN = 0.37, 30.0
ROUTED_TARGET_MAX_LEN, TTFT_OVER_ROUTED_FLOOR_MAX = 256, 1.10  # short prompts: within 1.10x the routed bytes
HIT_SPEEDUP_RESIDENCIES, HIT_SPEEDUP_OF_IDEAL_MIN = (0.37, 0.5), 0.9


# ---------------------------------------------------------------------------------------- derive
def _variant(c: dict) -> str:
    return c.get("variant", c["mode"])


def _variants(result: dict) -> list[str]:
    return result["settings"].get("variants") or result["settings"]["modes"]


def _cell(result: dict, n: int, variant: str, r: float) -> dict | None:
    for c in result["cells"]:
        if c["prompt_len"] == n and _variant(c) == variant and abs(c["residency"] - r) < 1e-9:
            return c
    return None


def _hit_on(cell: dict | None) -> bool:
    """Hits served from the device: copied D2D into staging, or read in place by the routed path."""
    return cell is not None and (cell["hit_path"] != FULL_LAYER or cell.get("path") == "routed")


def derive(result: dict) -> None:
    """Add floors, ratios, per-layer and extrapolated figures to every cell, then the targets."""
    m = result["model"]
    bw = result["floors"]["h2d"]["GBps"] * 1e9
    all_bytes = m["all_expert_bytes"]
    result["floors"]["pcie_all_miss_s"] = all_bytes / bw
    compute = {}
    for n in result["settings"]["prompt_lens"]:
        full = [c for c in result["cells"] if c["prompt_len"] == n and c["residency"] == 1.0 and _hit_on(c)]
        best = min(full, key=lambda c: c["ttft_s"]["median"], default=None)
        compute[str(n)] = None if best is None else {"ttft_s": best["ttft_s"]["median"], "mode": _variant(best)}
    result["floors"]["compute"] = compute
    result["floors"]["compute_definition"] = ("median TTFT at residency 1 of the fastest variant whose hits were "
                                              "served from the device (copied D2D, or read in place when routed)")
    result["floors"]["routed_definition"] = ("bytes of the distinct missing experts the prompt routed, every layer "
                                             "(ids from the variant's untimed pass), / H2D bandwidth")
    chunk = result.get("config", {}).get("prefill", {}).get("chunk_tokens")
    result["floors"]["chunked_definition"] = ("a prompt longer than prefill.chunk_tokens is prefilled in chunks and "
                                              "every staged chunk copies each layer's missing experts again: "
                                              "chunked PCIe floor = chunks x PCIe floor")
    for c in result["cells"]:
        med = c["ttft_s"]["median"]
        cf = compute[str(c["prompt_len"])]
        hit = c["hit_fraction"] if c["hit_fraction"] is not None else c.get("resident_fraction", 0.0)
        c["pcie_floor_s"] = (1.0 - hit) * all_bytes / bw
        c["chunks"] = math.ceil(c["prompt_len"] / chunk) if chunk else 1
        if c["chunks"] > 1:  # what this design copies (each chunk stages again); pcie_floor_s stays the lower bound
            c["pcie_floor_chunked_s"] = c["chunks"] * c["pcie_floor_s"]
            chunked_floor = max(c["pcie_floor_chunked_s"], cf["ttft_s"] if cf else 0.0)
            c["ratio_to_chunked_floor"] = med / chunked_floor if chunked_floor > 0 else None
        # the bytes this pass really moved over PCIe: copy engine (staging, admissions) and SM reads (UVA)
        c["h2d_at_bandwidth_s"] = (c["bytes"]["h2d"] + c["bytes"].get("uva", 0)) / bw
        c["compute_floor_s"] = None if cf is None else cf["ttft_s"]
        c["floor_s"] = max(c["pcie_floor_s"], c["compute_floor_s"] or 0.0)
        c["ratio_to_floor"] = med / c["floor_s"] if c["floor_s"] > 0 else None
        if "routed_missing_bytes" in c:
            c["routed_floor_s"] = c["routed_missing_bytes"] / bw
            routed_floor = max(c["routed_floor_s"], c["compute_floor_s"] or 0.0)
            c["ratio_to_routed_floor"] = med / routed_floor if routed_floor > 0 else None
        c["per_layer_s"] = med / m["layers"]
        c["extrapolated_s"] = med * m["full_layers"] / m["layers"] if m["full_layers"] != m["layers"] else None
    result["targets"] = targets(result)
    if not on_cuda(result):
        for t in result["targets"]:  # measured, but a CPU run cannot meet or miss a PCIe target
            t.update(met=None, detail=f"{CPU_NOTE} (value measured: {t['value']})")


#: why a CPU run gives no verdicts (its "H2D" is a host memcpy; there is no PCIe link to be near)
CPU_NOTE = "targets apply on CUDA: this run has no GPU, so its floors are not PCIe floors"


def _target(tid: str, n: int, value, threshold: float, op: str, detail, mode: str | None = None, **extra) -> dict:
    met = None if value is None else (value <= threshold if op == "<=" else value >= threshold)
    return {"id": tid, "prompt_len": n, "primary": n == TARGET_PROMPT_LEN, "mode": mode, "value": value,
            "threshold": threshold, "comparison": op, "met": met, "detail": detail, **extra}


def _peer_ttft(result: dict, peer: str, n: int) -> float | None:
    p = result.get("peers", {}).get(peer, {})
    if p.get("status") != "ok":
        return None
    return p["ttft_s"][str(n)]["at_engine_layers_s"]


def targets(result: dict) -> list[dict]:
    """Issue 5's targets per prompt length (``primary``: the 1024-token prompt they are stated for)."""
    s = result["settings"]
    variants = _variants(result)
    modes = {v: (result.get("modes", {}).get(v) or {}).get("mode", v) for v in variants}
    hit_modes = [v for v in variants if modes[v] != "off"]
    out = []
    for n in s["prompt_lens"]:
        for mode in hit_modes:
            cells = [c for r in s["residencies"] if r <= TARGET_RESIDENCY_MAX and (c := _cell(result, n, mode, r))]
            declined = [c for c in cells if not _hit_on(c)]
            ratios = {str(c["residency"]): c["ratio_to_floor"] for c in cells}
            value = None if declined or not cells or None in ratios.values() else max(ratios.values())
            detail = ratios if not declined else (
                f"mode declined to full-layer copies: {declined[0]['hit_d2d_fallbacks']}")
            out.append(_target("ttft_within_1.10x_floor", n, value, TTFT_OVER_FLOOR_MAX, "<=", detail, mode,
                               description="max over residency 0..0.75 of TTFT / max(PCIe floor, compute floor)"))
            if n <= ROUTED_TARGET_MAX_LEN:
                routed = {str(c["residency"]): c.get("ratio_to_routed_floor") for c in cells}
                value = None if not cells or None in routed.values() else max(routed.values())
                out.append(_target("ttft_within_1.10x_routed_floor", n, value, TTFT_OVER_ROUTED_FLOOR_MAX, "<=",
                                   routed if value else "needs the routed experts of the cells", mode,
                                   description="max over residency 0..0.75 of TTFT / max(routed-bytes floor, "
                                               f"compute floor), prompts of at most {ROUTED_TARGET_MAX_LEN} tokens"))
        cf = result["floors"]["compute"][str(n)]
        gpu = _peer_ttft(result, "full_gpu", n)
        value = cf["ttft_s"] / gpu if cf and gpu else None
        out.append(_target("all_resident_vs_bf16_grouped_mm", n, value, ALL_RESIDENT_OVER_BF16_MAX, "<=",
                           None if value else "needs the compute floor and the full_gpu peer",
                           cf["mode"] if cf else None,
                           description="all-resident TTFT / TTFT of transformers bf16 grouped_mm fully on the GPU "
                                       "(same layers, same prompt)"))
        acc = _peer_ttft(result, "accelerate", n)
        for mode in hit_modes:
            c = _cell(result, n, mode, ACCELERATE_RESIDENCY)
            value = acc / c["ttft_s"]["median"] if acc and _hit_on(c) else None
            why = "needs residency 0.37, a working hit path and the accelerate peer"
            out.append(_target("speedup_vs_accelerate_at_0.37", n, value, ACCELERATE_SPEEDUP_MIN, ">=",
                               None if value else why, mode))
        for mode in hit_modes:
            off_variant = next((v for v in variants if modes[v] == "off" and _same_path(result, v, mode)), "off")
            for r in HIT_SPEEDUP_RESIDENCIES:
                on, off = _cell(result, n, mode, r), _cell(result, n, off_variant, r)
                if not (_hit_on(on) and off):
                    out.append(_target("hit_d2d_speedup_vs_off", n, None, HIT_SPEEDUP_OF_IDEAL_MIN, ">=",
                                       f"needs modes {mode} (hit path working) and off at residency {r}", mode,
                                       residency=r))
                    continue
                if on["hit_fraction"] is None:  # a routed-path cell: no staged hit fraction to set the ideal by
                    out.append(_target("hit_d2d_speedup_vs_off", n, None, HIT_SPEEDUP_OF_IDEAL_MIN, ">=",
                                       "needs a staged cell: the routed path reads hits in place and has no staged "
                                       "hit fraction", mode, residency=r))
                    continue
                speedup = off["ttft_s"]["median"] / on["ttft_s"]["median"]
                ideal = 1.0 / (1.0 - on["hit_fraction"])
                out.append(_target("hit_d2d_speedup_vs_off", n, speedup / ideal, HIT_SPEEDUP_OF_IDEAL_MIN, ">=",
                                   {"speedup": speedup, "ideal": ideal}, mode, residency=r,
                                   description="(TTFT off / TTFT on) / (1 / (1 - measured hit fraction))"))
    return out


def _same_path(result: dict, a: str, b: str) -> bool:
    m = result.get("modes", {})
    return (m.get(a) or {}).get("prefill_path") == (m.get(b) or {}).get("prefill_path")


# ---------------------------------------------------------------------------------------- markdown
def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def _header(result: dict) -> list[str]:
    m, s, f, env, git = result["model"], result["settings"], result["floors"], result["versions"], result["git"]
    h2d = f["h2d"]
    lines = [
        f"# TTFT: {m['label']} ({m['layers']} layers, {m['format']}) on {result['device']['name']}",
        "",
        f"git {short_sha(git)}{' (dirty)' if git['dirty'] else ''} · torch {env['torch']} · transformers "
        f"{env['transformers']} · accelerate {env['accelerate']} · triton {env['triton']} · CUDA runtime "
        f"{env['cuda_runtime']} · {result['created']}",
        "",
        f"H2D bandwidth {h2d['GBps']:.1f} GB/s ({h2d['bytes'] / 2**30:.3g} GiB, median of {h2d['reps']}; "
        f"{h2d['method']}). Experts: {m['bytes_per_expert'] / 1e6:.3g} MB each, {m['experts']} x "
        f"{m['moe_layers']} layers = {m['all_expert_bytes'] / 1e9:.3g} GB; every expert missing costs "
        f"{_ms(f['pcie_all_miss_s'])} ms over PCIe. Slot pool: {_budget_text(s)}; "
        f"{s['reps']} reps per cell: median [min–max] ms; warmup {'on' if s['warmup'] else 'off'}. "
        "×floor = TTFT / max(PCIe floor, compute floor); PCIe floor = missing bytes of every layer / H2D bandwidth "
        "(what staging copies); routed floor = bytes of the distinct missing experts the prompt routed (every "
        "layer) / H2D bandwidth (what any path must copy); ×routed = TTFT / max(routed floor, compute floor); "
        "path = the path the forward took (staged: whole layers staged; routed: only the routed experts read, "
        "resident ones in place; routed_fills: only the routed missing experts copied over the copy engine, one "
        f"host sync a layer, prefill.routed_copy). Prefill paths measured: {', '.join(s.get('prefill_paths', ['auto']))}.",
    ]
    if not on_cuda(result):
        lines += ["", f"**CPU run: {CPU_NOTE}; the floor and ×floor columns are n/a and no target has a verdict.**"]
    if m["tp"] > 1:
        lines += ["", f"TP={m['tp']}: expert bytes, H2D bytes and the PCIe floor are per rank (each rank moves its "
                  f"1/{m['tp']} slice of every expert over its own link; bandwidth of the slowest rank, all ranks "
                  "measured at once; JSON: cells[*].per_rank, floors.h2d.per_rank)."]
    if m["full_layers"] != m["layers"]:
        lines += ["", f"Truncated to {m['layers']} of {m['full_layers']} layers: per layer = TTFT / {m['layers']}; "
                  f"extrapolated to {m['full_layers']} layers = TTFT x {m['full_layers'] / m['layers']:.3g} "
                  "(JSON: per_layer_s, extrapolated_s; a ratio, so it scales the fixed costs too: an upper bound)."]
    return lines


def _budget_text(s: dict) -> str:
    if s["budget"] == "residency":
        return "exactly the resident experts at each residency (full when prefill starts)"
    return f"{max(s['slots'].values())} slots at every residency (free slots get prefill admissions)"


def _routed_floor_text(cells: list[dict]) -> str:
    """The row's routed floor: one value, or a range where the variants routed differently."""
    vals = sorted({round(c["routed_floor_s"] * 1e3, 1) for c in cells if c.get("routed_floor_s") is not None})
    return "–" if not vals else f"{vals[0]:.1f}" if len(vals) == 1 else f"{vals[0]:.1f}–{vals[-1]:.1f}"


def _ttft_table(result: dict, n: int) -> list[str]:
    s, m, modes = result["settings"], result["model"], _variants(result)
    truncated = m["full_layers"] != m["layers"]
    cf = result["floors"]["compute"][str(n)]
    floor = f"{_ms(cf['ttft_s'])} ms, {cf['mode']}" if cf else "–"
    extra = [f"best hit-D2D ms at {m['full_layers']} layers"] if truncated else []
    head = ["residency", "hit %", "PCIe floor ms", "routed floor ms",
            *(f"{mo} ms | ×floor | ×routed | path" for mo in modes), *extra]
    chunked = [c for c in result["cells"] if c["prompt_len"] == n and c.get("chunks", 1) > 1]
    chunk_note = ""
    if chunked and on_cuda(result):
        chunk_note = (f" Prefilled in {chunked[0]['chunks']} chunks (prefill.chunk_tokens): staged chunks copy each "
                      "layer's misses again, so this design's PCIe floor is chunks x the PCIe floor; ×chunked "
                      "(TTFT / max(that, compute floor)) by residency and variant: " + "; ".join(
                          f"{c['residency']:g} {_variant(c)} {_num(c.get('ratio_to_chunked_floor'))}" for c in chunked) + ".")
    lines = ["", f"## {n} tokens", "", f"Compute floor (all experts resident): {floor}.{chunk_note}", "",
             "| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * (4 + 4 * len(modes) + len(extra))) + " |"]
    for r in s["residencies"]:
        row = {mo: _cell(result, n, mo, r) for mo in modes}
        first = next((c for c in row.values() if c), None)
        if first is None:
            continue
        hit = 100 * first["hit_fraction"] if first["hit_fraction"] is not None else (
            None if first.get("resident_fraction") is None else 100 * first["resident_fraction"])
        cuda = on_cuda(result)
        cols = [f"{r:g}", _num(hit, 1), _ms(first["pcie_floor_s"]) if cuda else "n/a",
                _routed_floor_text([c for c in row.values() if c]) if cuda else "n/a"]
        for mo, c in row.items():
            if c is None:
                cols += ["–", "–", "–", "–"]
                continue
            t = c["ttft_s"]
            mark = "" if c["mode"] == "off" or _hit_on(c) else " †"
            cols += [f"{_ms(t['median'])} [{_ms(t['min'])}–{_ms(t['max'])}]{mark}",
                     _num(c["ratio_to_floor"]) if cuda else "n/a",
                     _num(c.get("ratio_to_routed_floor")) if cuda else "n/a", c.get("path", "staged")]
        if truncated:
            hits = [c["extrapolated_s"] for c in row.values() if c and c["mode"] != "off" and _hit_on(c)]
            cols.append(_ms(min(hits)) if hits else "–")
        lines.append("| " + " | ".join(cols) + " |")
    return lines


def _host_table(result: dict) -> list[str]:
    s = result["settings"]
    r0 = s["residencies"][0]
    lines = ["", "## Host time (Python side, no sync)", "",
             f"| variant | tokens | experts call per layer ms | forward ms | TTFT ms (residency {r0:g}) |",
             "| --- | --- | --- | --- | --- |"]
    for mo in _variants(result):
        for n in s["prompt_lens"]:
            c = _cell(result, n, mo, r0)
            if c and not c["host"]["forward_s"]:  # no eager forward was timed: the prefill was a graph replay
                lines.append(f"| {mo} | {n} | – (graph replay) | – | {_ms(c['ttft_s']['median'])} |")
            elif c:
                lines.append(f"| {mo} | {n} | {c['host']['experts_per_layer_s'] * 1e3:.3f} | "
                             f"{_ms(c['host']['forward_s'])} | {_ms(c['ttft_s']['median'])} |")
    return lines


def _peer_table(result: dict) -> list[str]:
    lens = result["settings"]["prompt_lens"]
    lines = ["", "## Peers (same run, same prompts)", ""]
    if not result["peers"]:
        return lines + [no_peers_line(result)]
    lines += ["| peer | status | layers | " + " | ".join(f"{n} tokens ms" for n in lens) + " | note |",
              "| " + " | ".join(["---"] * (4 + len(lens))) + " |"]
    for name, p in result["peers"].items():
        vals = []
        for n in lens:
            t = p["ttft_s"][str(n)] if p["status"] == "ok" else None
            vals.append("–" if t is None else _ms(t["at_engine_layers_s"]) + ("\\*" if t["extrapolated"] else ""))
        lines.append(f"| {name} | {p['status']} | {p.get('layers', '–')} | " + " | ".join(vals)
                     + f" | {p.get('reason', '')} |")
    scaled = [p for p in result["peers"].values() if p["status"] == "ok" and p.get("depths")]
    if not scaled:
        return lines
    a, b = scaled[0]["depths"]
    L = scaled[0]["engine_layers"]
    return lines + ["", f"\\* measured at {a} and {b} layers and scaled to the engine's {L} by the per-layer slope of "
                    f"the two depths: t({b}) + ({L} - {b}) x (t({b}) - t({a})) / ({b} - {a}); the fixed costs "
                    "(embedding, LM head, launch) are counted once, not multiplied (JSON: peers.*.ttft_s.*.per_layer_s, "
                    "fixed_s, depths)."]


def _target_table(result: dict) -> list[str]:
    lines = ["", "## Targets", ""]
    if not on_cuda(result):
        return lines + [f"No verdicts: {CPU_NOTE}. The values stay in the JSON (targets[*].value)."]
    lines += ["| target | tokens | mode | value | threshold | met |", "| --- | --- | --- | --- | --- | --- |"]
    for t in result["targets"]:
        name = t["id"] + (f" @ {t['residency']:g}" if "residency" in t else "")
        met = {True: "yes", False: "NO", None: "n/a"}[t["met"]]
        lines.append(f"| {name} | {t['prompt_len']}{' (primary)' if t['primary'] else ''} | {t['mode'] or '–'} | "
                     f"{_num(t['value'])} | {t['comparison']} {t['threshold']:g} | {met} |")
    return lines


def _failed_table(result: dict) -> list[str]:
    failed = result.get("failed_cells") or []
    if not failed:
        return []
    lines = ["", "## Failed cells (not measured; left out of the tables and targets above)", "",
             "| tokens | variant | residency | error |", "| --- | --- | --- | --- |"]
    return lines + [f"| {c['prompt_len']} | {c['variant']} | {c['residency']:g} | {c['error']} |" for c in failed]


def markdown(result: dict) -> str:
    lines = _header(result) + partial_lines(result, "--prompt-lens / --residency")
    for n in result["settings"]["prompt_lens"]:
        lines += _ttft_table(result, n)
    declined = [mo for mo, d in result["modes"].items()
                if d.get("mode", mo) != "off" and d.get("prefill_path") != "routed" and d["hit_path"] == FULL_LAYER]
    if declined:
        lines += ["", "† hit-D2D requested but declined, full-layer copies ran: "
                  + ", ".join(f"{mo} ({_reasons(result, mo)})" for mo in declined)]
    lines += _host_table(result) + _peer_table(result) + _failed_table(result) + _target_table(result)
    if result["notes"]:
        lines += ["", "## Notes", ""] + [f"- {x}" for x in result["notes"]]
    return "\n".join(lines) + "\n"


def _reasons(result: dict, mode: str) -> str:
    reasons = {k for c in result["cells"] if _variant(c) == mode for k in c["hit_d2d_fallbacks"]}
    return ", ".join(sorted(reasons)) or "see log"


def write(result: dict, out: Path) -> dict:
    """Write ``ttft-<label>-<sha>.json`` and ``.md`` under ``out``; returns their paths and the markdown."""
    return write_files(result, out, f"ttft-{result['model']['label']}-{short_sha(result['git'])}", markdown)
