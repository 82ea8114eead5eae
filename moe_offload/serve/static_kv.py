"""A static, per-row KV cache for the serving decode batch: preallocated rows, each with its own length.

Every attention layer owns ``keys_RHPD`` / ``values_RHPD``: R rows (``serve.max_batch``) of P positions
(``decode.max_cache_len``), allocated once, so a CUDA graph captured over them stays valid while requests
come and go. A decode step writes each row's new key/value at that row's own position (``pos_R``, a
device tensor: one ``kernels/kv_write.py`` launch per layer for keys and values, no host sync, capturable)
and attends over a window: the first B rows and the first L positions (``window(B, L)``; the caller masks
each row to its own length with a 4-D mask, which transformers' ``create_causal_mask`` passes through
unchanged). Linear-attention layers (qwen3_next) keep their conv and recurrent states per row
(``[R, ...]``); the model updates the ``[:B]`` views in place.

Rows are filled from a request's prefilled DynamicCache (``load``: its keys/values go to positions
0..S-1 of the row) and moved between rows to keep the rows in use contiguous (``move``). Positions past a
row's length hold stale values that the mask hides.

This is a transformers ``Cache`` (5.17 and 5.24): ``update`` for attention layers, the linear-attention
layer API of transformers' own ``LinearAttentionLayer`` for the rest. It only decodes (one token per row
and step) and has no single sequence length: callers pass ``position_ids`` and the 4-D mask.

Legend: R rows, B rows of a step's window, P positions per row, L positions of a step's window,
H key/value heads, D head dim, S a prefilled request's tokens.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import (Cache, CacheLayerMixin, DynamicLayer, LinearAttentionCacheLayerMixin,
                                      LinearAttentionLayer)

from moe_offload.kernels.kv_write import kv_write


class UnsupportedLayout(ValueError):
    """The model's cache has a layer kind the static serving cache cannot hold (e.g. sliding window)."""


class _AttnRows(CacheLayerMixin):
    """One full-attention layer: ``[R, H, P, D]`` keys and values; ``keys``/``values`` are the window."""

    is_sliding = False
    is_compileable = True

    def __init__(self, like, rows: int, max_len: int, pos_R: torch.Tensor):
        super().__init__()
        k, v = like.keys, like.values  # [1, H, S, D] of a prefilled request
        self.dtype, self.device = k.dtype, k.device
        self.keys_RHPD = torch.zeros((rows, k.shape[1], max_len, k.shape[3]), dtype=k.dtype, device=k.device)
        self.values_RHPD = torch.zeros((rows, v.shape[1], max_len, v.shape[3]), dtype=v.dtype, device=v.device)
        self.pos_R = pos_R
        self.max_len = max_len
        self.is_initialized = True
        self.window(rows, max_len)

    def window(self, B: int, L: int) -> None:
        self.B = B
        self.keys, self.values = self.keys_RHPD[:B, :, :L], self.values_RHPD[:B, :, :L]

    def lazy_initialization(self, key_states, value_states) -> None:
        """Allocated at construction (the graph holds these addresses)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B, H, 1, D]`` at each row's ``pos_R`` -> the window ``[B, H, L, D]`` (keys, values)."""
        B, _, T, _ = key_states.shape
        if T != 1 or B != self.B:
            raise ValueError(f"the serving KV cache decodes one token per row of its window ({self.B} rows); got "
                             f"{B} rows x {T} tokens (prefill runs on a DynamicCache and is loaded into a row)")
        kv_write(self.keys_RHPD, self.values_RHPD, key_states, value_states, self.pos_R[:B])
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        raise ValueError("the serving KV cache has one length per row: pass position_ids and a 4-D attention mask")

    def get_max_length(self) -> int:
        return self.max_len

    def reset(self) -> None:
        self.keys_RHPD.zero_()
        self.values_RHPD.zero_()

    def load(self, row: int, like, length: int) -> None:
        if like.keys.shape[0] != 1 or like.keys.shape[2] != length:
            raise ValueError(f"a row is loaded from one sequence of {length} cached tokens; got keys of shape "
                             f"{tuple(like.keys.shape)}")
        self.keys_RHPD[row, :, :length].copy_(like.keys[0, :, :length])
        self.values_RHPD[row, :, :length].copy_(like.values[0, :, :length])

    def move(self, src: int, dst: int, length: int) -> None:
        self.keys_RHPD[dst, :, :length].copy_(self.keys_RHPD[src, :, :length])
        self.values_RHPD[dst, :, :length].copy_(self.values_RHPD[src, :, :length])


class _LinearRows(LinearAttentionLayer):
    """One linear-attention layer: conv and recurrent states ``[R, ...]`` per state index; the model reads
    and updates the ``[:B]`` views (transformers' LinearAttentionLayer copies into them in place)."""

    def __init__(self, like, rows: int):
        super().__init__(number_of_states=like.number_of_states)
        self.conv_R: dict[int, torch.Tensor | None] = {}
        self.rec_R: dict[int, torch.Tensor | None] = {}
        for i in range(like.number_of_states):
            for src, dst, flag in ((like.conv_states, self.conv_R, self.is_conv_states_initialized),
                                   (like.recurrent_states, self.rec_R, self.is_recurrent_states_initialized)):
                t = src.get(i)
                dst[i] = None if t is None else torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
                flag[i] = t is not None
                if t is not None:
                    self.dtype, self.device = t.dtype, t.device
            self.conv_kernel_size[i] = like.conv_kernel_size.get(i)
            self.has_previous_state[i] = True  # rows are loaded from prefilled requests: decode steps only
        self.window(rows, 0)

    def window(self, B: int, L: int) -> None:
        for i in self.conv_R:
            self.conv_states[i] = None if self.conv_R[i] is None else self.conv_R[i][:B]
            self.recurrent_states[i] = None if self.rec_R[i] is None else self.rec_R[i][:B]

    def reset(self) -> None:
        for t in [*self.conv_R.values(), *self.rec_R.values()]:
            if t is not None:
                t.zero_()

    def load(self, row: int, like, length: int) -> None:
        for i in self.conv_R:
            for src, dst in ((like.conv_states, self.conv_R), (like.recurrent_states, self.rec_R)):
                if dst[i] is not None:
                    dst[i][row].copy_(src[i][0])

    def move(self, src: int, dst: int, length: int) -> None:
        for t in [*self.conv_R.values(), *self.rec_R.values()]:
            if t is not None:
                t[dst].copy_(t[src])


def _row_layer(like, rows: int, max_len: int, pos_R: torch.Tensor):
    name = type(like).__name__
    if isinstance(like, LinearAttentionCacheLayerMixin):
        if isinstance(like, CacheLayerMixin) or getattr(like, "record_past", False):
            raise UnsupportedLayout(f"cache layer {name} (linear and attention states in one layer, or recording "
                                    "past states) has no static serving layout")
        return _LinearRows(like, rows)
    if type(like) is DynamicLayer and getattr(like, "keys", None) is not None and like.keys.dim() == 4:
        return _AttnRows(like, rows, max_len, pos_R)
    raise UnsupportedLayout(f"cache layer {name} has no static serving layout; the static KV cache holds "
                            "full-attention and linear-attention layers")


class RowKV(Cache):
    """The per-row static cache (see the module docstring). ``like``: a prefilled request's DynamicCache,
    whose layers give each layer's kind, shapes, dtype and device; ``pos_R``: the device tensor of the
    position each row writes in the next step (its owner fills it before each step)."""

    def __init__(self, like, rows: int, max_len: int, pos_R: torch.Tensor):
        self.pos_R = pos_R
        super().__init__(layers=[_row_layer(layer, rows, max_len, self.pos_R) for layer in like.layers])
        self.rows, self.max_len = rows, max_len

    def window(self, B: int, L: int) -> None:
        """The next forward decodes rows ``0..B-1`` and attends over positions ``0..L-1``."""
        for layer in self.layers:
            layer.window(B, L)

    def load(self, row: int, one, length: int) -> None:
        """Copy the single-sequence cache ``one`` (``length`` tokens) into ``row``."""
        if len(one.layers) != len(self.layers):
            raise ValueError(f"a cache of {len(one.layers)} layers cannot fill rows of {len(self.layers)} layers")
        if length >= self.max_len:
            raise ValueError(f"a sequence of {length} tokens does not fit decode.max_cache_len={self.max_len}")
        for mine, theirs in zip(self.layers, one.layers):
            mine.load(row, theirs, length)

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy row ``src`` (its first ``length`` positions and its states) into row ``dst``."""
        for layer in self.layers:
            layer.move(src, dst, length)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        raise ValueError("the serving KV cache has one length per row: pass position_ids and a 4-D attention mask")
