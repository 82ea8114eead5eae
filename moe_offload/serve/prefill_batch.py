"""Batched prefill of queued prompts (``serve.prefill_batch_tokens``): which requests go together
(``group``), whether this model may (``budget``), the left-padded inputs and the per-request caches.

With ``serve.prefill_batch_tokens`` > 0 the scheduler's prefill forward takes the oldest admitted
prompt and the later waiting ones that fit beside it whole, left-padded to the longest (``attention_mask`` +
``position_ids``, as transformers' batched generation does), within rows x longest <= the budget; each
request's cache is then cut back to its own positions (``split_rows``). Under load this is what
shortens TTFT with offloaded experts: one forward copies each layer's missing experts once for every
prompt in it, where one prompt per forward copies them once per prompt (the H200 run at 032db7c:
prefill stays 92-222 ms per prompt at 64 clients, TTFT p50 is 4.8-10.5 s of queueing). Decision: off
by default. Greedy ids of a batched prefill equal the one-prompt forward on the CPU (tests); on a GPU
a different token count per expert may pick other GEMM tiles and move the last bits of a logit, which
``bench serve`` (streams compared with single runs) would report; it has not run on a GPU yet.

Legend: B prompts, T the longest prompt, H heads, D head dim.
"""

from __future__ import annotations

import itertools

import torch

from moe_offload import log
from moe_offload.serve.kv import UnsupportedCacheLayer, _has_kv, attention_mask


def budget(engine, prefill_batch_tokens: int) -> int:
    """Tokens one batched prefill forward may carry: ``serve.prefill_batch_tokens``, never more than
    ``prefill.chunk_tokens`` (a single prompt's chunk); 0 when off, or declined for this model with one
    event and a count (``stats()["declined"]["serve_prefill_batch:cache_layers"]``)."""
    tokens = min(prefill_batch_tokens, engine.cfg.prefill.chunk_tokens)
    if tokens <= 0:
        return 0
    reason = unsupported(engine.model.config)
    if reason is None:
        return tokens
    engine.cache.counters.declined["serve_prefill_batch:cache_layers"] += 1
    log.event("serve_prefill_batch_declined", 30, reason=reason, fallback="one_prompt_per_forward",
              setting="serve.prefill_batch_tokens")
    return 0


def group(queue, tokens: int, chunk: int) -> list:
    """The head of the prefill ``queue`` (requests with ``prompt_ids`` and ``prefilled``) and, when
    ``tokens`` > 0, the later requests whose whole prompt fits one forward beside it (rows x the longest
    prompt <= ``tokens``); a request already part-prefilled or longer than ``chunk`` goes alone."""
    head = queue[0]

    def whole(r) -> bool:
        return r.prefilled == 0 and len(r.prompt_ids) <= chunk

    if tokens <= 0 or not whole(head):
        return [head]
    out, longest = [head], len(head.prompt_ids)
    for r in itertools.islice(queue, 1, None):
        n = max(longest, len(r.prompt_ids))
        if whole(r) and (len(out) + 1) * n <= tokens:
            out.append(r)
            longest = n
    return out


def unsupported(model_config) -> str | None:
    """Why prompts of ``model_config``'s model cannot be prefilled together left-padded (None: they can).
    Only full-attention layers qualify: a linear-attention state (qwen3_next) would take the padding in,
    and a sliding-window layer keeps the padded tail of a long row."""
    from transformers import DynamicCache

    for layer in DynamicCache(config=model_config).layers:
        name = type(layer).__name__
        if name != "DynamicLayer":
            return f"cache layer {name} (only full-attention DynamicLayer caches are prefilled together)"
    return None


def left_padded_inputs(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``prompts`` -> (ids ``[B, T]``, attention mask ``[B, T]``, position ids ``[B, T]``), left-padded to the
    longest T: pad ids 0 at mask 0 and position 0, row b's tokens at positions 0..T_b-1 on the right."""
    lens = [len(p) for p in prompts]
    T = max(lens)
    ids_BT = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):
        ids_BT[b, T - len(p):] = torch.as_tensor(p, dtype=torch.long)
    mask_BT = attention_mask(lens, T, "cpu")
    pos_BT = (mask_BT.cumsum(-1) - 1).clamp_(min=0)
    return ids_BT.to(device), mask_BT.to(device), pos_BT.to(device)


def split_rows(past, lens: list[int], model_config) -> list:
    """A left-padded batch cache of a prefill (rows of ``lens`` tokens, padded to max(lens)) -> one
    single-sequence DynamicCache per row, holding only its own positions (views of the batch tensors)."""
    from transformers import DynamicCache

    T = max(lens)
    rows = [DynamicCache(config=model_config) for _ in lens]
    for i, layer in enumerate(past.layers):
        if not _has_kv(layer):
            raise UnsupportedCacheLayer(f"layer {i} of the batched prefill cache holds no keys ({type(layer).__name__})")
        for b, n in enumerate(lens):
            rows[b].update(layer.keys[b:b + 1, :, T - n:], layer.values[b:b + 1, :, T - n:], i)
    return rows
