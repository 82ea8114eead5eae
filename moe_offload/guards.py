"""Runtime guard: non-finite logits become a request error naming the first module (and layer) that
produced NaN/Inf, never silently sampled tokens (argmax over NaN is token 0).

The check costs one device sync per sampled token, which generation pays anyway (the sampled id goes
to the host); greedy decoding reads the check's flag with the ids in one copy (moe_offload/run_ahead.py).
The diagnosis runs only after a failure: one uncached forward over the whole sequence with a hook on every
module, reporting the first module, in execution order, whose output is non-finite.
"""

from __future__ import annotations

import re
from typing import NoReturn

import torch

_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


class NonFiniteLogitsError(RuntimeError):
    """The model produced NaN/Inf logits; the message names the first module that did."""


def finite_logits(engine, logits_BV: torch.Tensor, prompt_ids: list[int], generated: list[int]) -> torch.Tensor:
    """``logits_BV`` unchanged when finite; else raise NonFiniteLogitsError naming the first bad module."""
    if bool(torch.isfinite(logits_BV).all()):  # one sync; the caller syncs for the sampled id anyway
        return logits_BV
    raise_nonfinite(engine, prompt_ids, generated)


def raise_nonfinite(engine, prompt_ids: list[int], generated: list[int]) -> NoReturn:
    """The logits after ``generated`` (the first sequence's tokens so far) held NaN/Inf: raise
    NonFiniteLogitsError naming the first module whose output holds them (a forward of the tokens again)."""
    where = first_nonfinite_module(engine.model, torch.tensor([list(prompt_ids) + list(generated)], device=engine.device))
    step = "the prompt" if not generated else f"generated token {len(generated)}"
    path = getattr(engine.reader, "path", "the checkpoint")
    raise NonFiniteLogitsError(
        f"non-finite logits (NaN/Inf) after {step}; first produced by {where}. The weights or scales are likely "
        f"corrupt: run `moe-offload inspect {path}` (it checks every float tensor's values)")


@torch.inference_mode()
def first_nonfinite_module(model: torch.nn.Module, ids_BT: torch.Tensor) -> str:
    """Name (and layer) of the first module whose output holds NaN/Inf in a forward of ``ids_BT``."""
    found: list[str] = []
    handles = []

    def hook(name):
        def fn(_mod, _inp, out):
            if found:
                return
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            t = getattr(t, "logits", t)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                found.append(name)
        return fn

    for name, mod in model.named_modules():
        if name:
            handles.append(mod.register_forward_hook(hook(name)))
    try:
        model(input_ids=ids_BT, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if not found:
        return "no single module (the non-finite values appeared only with the KV cache)"
    m = _LAYER_RE.search(found[0])
    return f"{found[0]} (layer {m.group(1)})" if m else found[0]
