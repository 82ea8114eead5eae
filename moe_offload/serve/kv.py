"""The running batch's KV cache: per-sequence caches merged into one left-padded transformers cache.

A sequence is prefilled alone (batch 1, exactly as ``Engine.generate`` does); when it joins the
decode batch its cache rows are left-padded to the batch's cache length and concatenated along the
batch dim; when it leaves, its rows are dropped and columns that are padding in every row are cut.
Attention layers (``keys``/``values`` ``[B, heads, S, D]``) are padded; linear-attention layers
(qwen3_next conv / recurrent states ``[B, ...]``) have no sequence dim and are concatenated as is.

``LeftPaddedBatch`` is the decode batch built on it (one of the two ``DecodeBatch`` kinds; the other is
``serve/static_batch.py``): eager forwards with a 2-D ``attention_mask`` and per-row ``position_ids``.

Legend: B sequences in the batch, S cache length (padded), D head dim, V vocab.
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


class LeftPaddedBatch:
    """The decode batch as one left-padded transformers cache, decoded eagerly (the CPU default, and the
    fallback where the static KV cache is unavailable). Row ``b`` is the scheduler's ``b``-th running request."""

    kind = "dynamic"
    max_len = None  # grows with the longest row

    def __init__(self, engine):
        self.engine = engine
        self.past = None
        self.rows = 0
        self.steps = {"graph": 0, "eager": 0}

    def join(self, one, batch_len: int, one_len: int) -> None:
        """Append the single-sequence cache ``one`` (``one_len`` tokens) as the last row."""
        self.past = append(self.past, one, batch_len, one_len)
        self.rows += 1

    @torch.inference_mode()
    def decode(self, ids: list[int], lens: list[int]) -> torch.Tensor:
        """One forward of every row: ``ids[b]`` at position ``lens[b]`` -> logits ``[B, V]``."""
        dev = self.engine.device
        S = seq_len(self.past)
        mask_BS = attention_mask([n + 1 for n in lens], S + 1, dev)
        pos_B1 = torch.tensor(lens, dtype=torch.long)[:, None].to(dev, non_blocking=True)
        ids_B1 = torch.tensor(ids, dtype=torch.long)[:, None].to(dev, non_blocking=True)
        kw = dict(input_ids=ids_B1, attention_mask=mask_BS, position_ids=pos_B1, use_cache=True, logits_to_keep=1,
                  **{self.engine.kv_name: self.past})
        logits = self.engine.run_model(kw, len(ids))  # the cache object is updated in place
        self.steps["eager"] += 1
        return logits[:, -1]

    def keep(self, rows: list[int], trim: int) -> None:
        """Keep ``rows`` (in that order) and cut ``trim`` leading columns that pad every kept row."""
        self.past = keep(self.past, rows, trim)
        self.rows = len(rows)

    def reset(self) -> None:
        self.past = None
        self.rows = 0

    def seq_len(self) -> int:
        return seq_len(self.past) if self.past is not None else 0
