"""Judging a concurrent greedy stream that differs from its single-request run (``bench serve``).

A batched decode step is not bitwise the single-row step on a GPU: other GEMM tiles, split reductions and
bf16 rounding give logits that differ in the last bits, and where two tokens are (nearly) tied the greedy
pick can flip; from there the stream continues on its own, correct, prefix. vLLM and SGLang make the same
statement (batch-invariant kernels are an opt-in mode there). A flip at a near-tie is numerics; a token the
model does not rank (near) first is a bug. The H200 run at edd2da4 (benchmarks/results/serve-*-edd2da44f57a.*)
had 3 of 8, 5 of 16 and 21 of 64 streams differing from their single runs at residency 0.37 and 1.0 alike,
with no expert offloaded at 1.0; this module tells the two apart.

Teacher forcing: the served prompt + ids run through the engine alone (one prefill of the prompt, then one
forward over the served ids but the last), which gives, for every served token i, the logits the model puts
on the position that produced it. Its margin is ``max(logits_i) - logits_i[served_i]`` (>= 0; 0 when it is
the argmax). A stream is *consistent* when every margin is <= the tolerance, and ``wrong`` otherwise.

The tolerance states the numerics of the run itself: the same teacher forcing over the single-request
reference streams measures how far the prefill forward's ranking sits from the decode steps that picked
those tokens; the default (``auto``) is twice the largest such margin. A stated value (``--tie-tolerance``)
replaces it. A margin of at most one step of the logits' dtype at the top logit's magnitude is a tie
whatever the tolerance (with bf16 logits two tokens cannot be closer than that without being equal), so a
run whose references happen to hold no near-tie (tolerance 0) does not call a one-step flip wrong. On the
CPU in fp32 batched and single decode are bitwise equal (tests/test_serve_*.py), so
nothing diverges there and every reference margin is 0.
"""

from __future__ import annotations

import torch

AUTO_FACTOR = 2.0


def margins(engine, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """Per served token: max logit - the served token's logit, on the engine alone (teacher forced)."""
    return teacher_forced(engine, prompt_ids, ids)[0]


@torch.inference_mode()
def teacher_forced(engine, prompt_ids: list[int], ids: list[int]) -> tuple[list[float], list[float]]:
    """Per served token: its margin and one step of the logits' dtype at the top logit's magnitude (the
    smallest difference two logits there can have: 2^-9 for bf16 logits in [0.25, 0.5), 0.0625 at 8..16)."""
    if not ids:
        return [], []
    logits_1V, past = engine.prefill(list(prompt_ids), None, last_only=True)
    rows = [logits_1V[0, -1]]
    if len(ids) > 1:
        rest = torch.as_tensor([ids[:-1]], dtype=torch.long, device=engine.device)
        logits_BTV, _ = engine.forward(rest, past)
        rows.extend(logits_BTV[0])
    stacked = torch.stack(rows)
    logits_NV = stacked.float()
    served_N = torch.as_tensor(ids, dtype=torch.long, device=logits_NV.device)
    top_N = logits_NV.max(1).values
    margin_N = top_N - logits_NV.gather(1, served_N[:, None])[:, 0]
    return ([round(float(m), 6) for m in margin_N.cpu()], [float(x) for x in dtype_step(top_N, stacked.dtype).cpu()])


def dtype_step(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at the magnitude of each of ``x``: eps * 2^floor(log2 |x|)."""
    return torch.finfo(dtype).eps * torch.exp2(torch.floor(torch.log2(x.float().abs().clamp_min(
        torch.finfo(torch.float32).tiny))))


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the two id lists differ (the shorter one's length when one is a prefix; None
    when equal). ``bench/soak.py`` compares its answers with it too."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def judge(engine, references: list[tuple[list[int], list[int]]], diverged: list[dict],
          tolerance: float | None = None) -> dict:
    """``references``: (prompt, single-run ids) per distinct request; ``diverged``: dicts with ``prompt``,
    ``ids``, ``expected`` and any labels to keep (``clients``, ``job``). Returns the tolerance, how it was
    set, the references' largest margin and one record per diverged stream with ``consistent``."""
    ref_max = None  # teacher forcing costs a prefill per stream: only when a stream needs judging
    if diverged:
        ref_max = max((max(margins(engine, p, ids), default=0.0) for p, ids in references), default=0.0)
    tol = AUTO_FACTOR * (ref_max or 0.0) if tolerance is None else float(tolerance)
    streams = []
    for d in diverged:
        m, step = teacher_forced(engine, d["prompt"], d["ids"])
        j = first_difference(d["ids"], d["expected"])
        labels = {k: v for k, v in d.items() if k not in ("prompt", "ids", "expected")}
        # a token within one step of the logits' dtype of the top is tied with it whatever the tolerance
        consistent = all(mi <= max(tol, si) for mi, si in zip(m, step))
        streams.append({**labels, "first_difference": j, "tokens": len(d["ids"]),
                        "margin_at_difference": m[j] if j is not None and j < len(m) else None,
                        "max_margin": max(m, default=0.0), "max_dtype_step": max(step, default=0.0),
                        "consistent": consistent})
    return {"method": "teacher-forced margins on the engine alone (max logit - served token's logit)",
            "tolerance": round(tol, 6),
            "tolerance_source": (f"auto: {AUTO_FACTOR:g} x the largest margin of the single-request reference "
                                 "streams" if tolerance is None else "--tie-tolerance"),
            "reference_max_margin": None if ref_max is None else round(ref_max, 6), "references": len(references),
            "streams": streams}
