"""The generate loop over an Engine: a batch of equal-length prompts prefilled (through the static decoder's
CUDA graphs where one applies), the first tokens sampled, then decode steps (greedy ones run ahead,
run_ahead.py) until every sequence stops, each token streamed as it comes; ``GenerateResult`` is what one
sequence gives back.

``Engine.generate`` and ``Engine.generate_batch`` (engine.py, which re-exports ``GenerateResult``) are the entry
points; they hold the engine's one-thread guard around ``generate_batch`` here.

Legend: B batch, T prompt tokens, V vocab.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from moe_offload.guards import finite_logits, raise_nonfinite
from moe_offload.run_ahead import decode_greedy
from moe_offload.sampling import sample_tokens

if TYPE_CHECKING:
    from moe_offload.engine import Engine


@dataclass
class GenerateResult:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str | None
    ttft_s: float
    decode_tok_s: float | None
    stats: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        """What ``moe-offload generate`` prints."""
        return {
            "prompt_tokens": len(self.prompt_ids), "token_ids": self.token_ids, "text": self.text,
            "ttft_s": round(self.ttft_s, 6),
            "decode_tok_s": None if self.decode_tok_s is None else round(self.decode_tok_s, 2),
            "cache": {k: v for k, v in self.stats.items() if k != "per_layer"},
        }


def _sample(engine: Engine, logits_BV: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
    d = engine.cfg.decode
    return sample_tokens(logits_BV, d.temperature, d.top_k, d.top_p, gen)


def generate_batch(engine: Engine, prompts, max_new_tokens, seed, on_token) -> list[GenerateResult]:
    """``Engine.generate_batch``'s loop, run under the engine's one-thread guard: ``prompts`` (B of length T)
    prefilled, the first tokens sampled (TTFT ends there), then one forward per step for all B until each
    sequence stops; ``on_token(b, id)`` streams. Once Engine's own method, it still reads the engine's batch
    decoders and device sync."""
    if not prompts or len({len(p) for p in prompts}) != 1 or not prompts[0]:
        raise ValueError(f"generate_batch needs non-empty prompts of one length, got lengths "
                         f"{[len(p) for p in prompts]}; batch prompts of different lengths through the server")
    if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                       or max_new_tokens < 1):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: an integer >= 1, or None for "
                         f"decode.max_new_tokens ({engine.cfg.decode.max_new_tokens})")
    max_new = engine.cfg.decode.max_new_tokens if max_new_tokens is None else max_new_tokens
    for b, p in enumerate(prompts):
        engine.check_prompt(p, max_new, f"prompt {b}")
    stop = set(engine.cfg.decode.stop_token_ids)
    gen = torch.Generator().manual_seed(seed)
    ids_BT = torch.as_tensor(prompts, dtype=torch.long)
    B, T = ids_BT.shape
    dec = engine.decoder(B) if T + max_new <= engine.cfg.decode.max_cache_len else None
    if dec is None and engine.cfg.decode.cuda_graphs and engine.device.type == "cuda" and B in engine._decoders:
        engine.cache.counters.declined["decode_graph:longer_than_max_cache_len"] += 1
    engine._sync()
    t0 = time.perf_counter()
    if dec is not None:
        dec.reset()
        logits_BV = dec.prefill(ids_BT.to(engine.device))
        step = dec.step
    else:
        logits, past = engine.prefill(ids_BT, last_only=True)
        logits_BV = logits[:, -1]

        def step(tok_B):
            return engine.forward(tok_B.view(B, 1), past, 1)[0][:, -1]

    tok_B = _sample(engine, finite_logits(engine, logits_BV, prompts[0], []), gen)
    outs = [[t] for t in tok_B.tolist()]  # synchronizes: TTFT includes the first sampled tokens
    ttft = time.perf_counter() - t0
    done = [o[-1] in stop for o in outs]
    if on_token is not None:
        for b, o in enumerate(outs):
            on_token(b, o[-1])
    def take(toks: list[int]) -> None:  # a step's tokens: appended to the sequences still running
        for b, t in enumerate(toks):
            if not done[b]:
                outs[b].append(t)
                done[b] = t in stop or len(outs[b]) >= max_new
                if on_token is not None:
                    on_token(b, t)

    t1 = time.perf_counter()
    steps = 0
    if engine.cfg.decode.temperature == 0:
        ahead = engine.cfg.decode.run_ahead
        with engine.cache.read_late(ahead):  # a boundary then never waits for the step in flight
            steps = decode_greedy(step, tok_B, max_new, done, take,
                                  lambda: raise_nonfinite(engine, prompts[0], outs[0]), ahead, engine.device)
    else:
        while steps + 1 < max_new and not all(done):
            logits_BV = step(tok_B)
            tok_B = _sample(engine, finite_logits(engine, logits_BV, prompts[0], outs[0]), gen)
            steps += 1
            take(tok_B.tolist())
    dt = time.perf_counter() - t1
    stats = engine.cache.stats()
    results = []
    for p, o in zip(prompts, outs):
        text = engine.tokenizer.decode(o) if engine.tokenizer is not None else None
        rate = steps / dt if steps and dt > 0 else None
        results.append(GenerateResult(list(p), o, text, ttft, rate, stats))
    return results
