"""The running batch's KV cache: per-sequence caches merged into one left-padded transformers cache.

A sequence is prefilled alone (batch 1, exactly as ``Engine.generate`` does); when it joins the
decode batch its cache rows are left-padded to the batch's cache length and concatenated along the
batch dim; when it leaves, its rows are dropped and columns that are padding in every row are cut.
Attention layers (``keys``/``values`` ``[B, heads, S, D]``) are padded; linear-attention layers
(qwen3_next conv / recurrent states ``[B, ...]``) have no sequence dim and are concatenated as is.

Legend: B sequences in the batch, S cache length (padded), D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class UnsupportedCacheLayer(ValueError):
    """A cache layer type this module cannot merge (e.g. sliding-window layers)."""


_STATE_DICTS = ("conv_states", "recurrent_states")


def _check_layer(layer) -> None:
    name = type(layer).__name__
    if "Sliding" in name or "Static" in name or "Quantized" in name or "Indexed" in name:
        raise UnsupportedCacheLayer(f"cache layer {name} cannot be batched by moe_offload.serve.kv; "
                                    "serving supports full-attention and linear-attention layers")


def _has_kv(layer) -> bool:
    return getattr(layer, "keys", None) is not None and getattr(layer, "is_initialized", False) and layer.keys.numel() > 0


def seq_len(past) -> int:
    """Cache length S of ``past`` (0 for an empty cache)."""
    for layer in past.layers:
        if _has_kv(layer):
            return layer.keys.shape[-2]
    return 0


def _pad_left(t_BHSD: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(t_BHSD, (0, 0, n, 0)) if n else t_BHSD


def append(batch, one, batch_len: int, one_len: int):
    """Merge the single-sequence cache ``one`` (cache length ``one_len``) into ``batch`` (cache length
    ``batch_len``; None for an empty batch) as its last row -> the merged cache (``batch`` mutated)."""
    for layer in one.layers:
        _check_layer(layer)
    if batch is None:
        return one
    S = max(batch_len, one_len)
    for lb, lo in zip(batch.layers, one.layers):
        if _has_kv(lb):
            lb.keys = torch.cat([_pad_left(lb.keys, S - batch_len), _pad_left(lo.keys, S - one_len)])
            lb.values = torch.cat([_pad_left(lb.values, S - batch_len), _pad_left(lo.values, S - one_len)])
        for name in _STATE_DICTS:
            states_b, states_o = getattr(lb, name, None), getattr(lo, name, None)
            if states_b is None:
                continue
            for idx, t in states_b.items():
                if t is not None:
                    states_b[idx] = torch.cat([t, states_o[idx]])
    return batch


def keep(batch, rows: list[int], trim: int):
    """Keep the batch ``rows`` (in that order) and cut ``trim`` leading columns (padding in every kept
    row) -> the cache, or None when no row is kept."""
    if not rows:
        return None
    dev = next((layer.keys.device for layer in batch.layers if _has_kv(layer)), None)
    idx = torch.tensor(rows, dtype=torch.long, device=dev)
    for layer in batch.layers:
        if _has_kv(layer):
            layer.keys = layer.keys.index_select(0, idx)[..., trim:, :]
            layer.values = layer.values.index_select(0, idx)[..., trim:, :]
        for name in _STATE_DICTS:
            states = getattr(layer, name, None)
            if states is None:
                continue
            for i, t in states.items():
                if t is not None:
                    states[i] = t.index_select(0, idx.to(t.device))
    return batch


def attention_mask(lens: list[int], S: int, device) -> torch.Tensor:
    """``[B, S]`` long mask: row b has ones on its last ``lens[b]`` columns (left padding)."""
    lens_B = torch.tensor(lens, dtype=torch.long)
    mask_BS = (torch.arange(S)[None, :] >= (S - lens_B)[:, None]).long()
    return mask_BS.to(device, non_blocking=True)
