"""Decode over a static KV cache, each step (every layer + the LM head) replayed as one CUDA graph.

Legend: B sequences of a batch, T prompt tokens, V vocab, P = ``decode.max_cache_len`` positions.

A ``StaticDecoder`` owns a transformers ``StaticCache`` of ``B x P`` positions (its full-attention layers
swapped for ``SharedStartLayer``: one shared device start, one write launch per layer) and, on CUDA, one graph
of the decode step: static inputs (token ids ``[B, 1]``, and on transformers versions whose models take
``cache_position`` also the position tensors), static logits out. The offloaded experts in the step
read the device residency table at replay time, so admissions between replays are honoured; the
step's host-side work (admission, the routing record) runs around the replay
(``cache.step_boundary()`` before, ``cache.decode_step_enqueued()`` after).

The step is captured on its second call (the first runs eagerly: Triton compiles, cuBLAS and the
allocator warm up) on a stream made once per decoder. A capture that fails (an op that syncs or
cannot be captured) logs one ``decode_graph_declined`` event, is counted in ``stats()["declined"]``
and the decoder runs eagerly from then on. Prompts are prefilled into the same static cache: a fresh
batch as one CUDA graph per length bucket where it can be (``prefill_graph.py``), else eagerly, each
forward's attention over the positions filled so far (``SharedStartLayer.window``).
Decoders are reused across requests (``reset``): the graph holds the cache's addresses.
"""

from __future__ import annotations

import inspect
import logging

import torch
from transformers.cache_utils import StaticLayer

from moe_offload import log
from moe_offload.graph_capture import capture
from moe_offload.prefill_graph import PrefillGraphs


class SharedStartLayer(StaticLayer):
    """transformers' ``StaticLayer`` whose write position is a device scalar its decoder owns and shares
    with every layer (``start_0``: positions cached before the forward), written in one launch
    (``kernels/kv_write.py``). ``StaticLayer.update`` spends five kernels per layer and step on it: an
    ``arange`` and an ``add`` for the positions, an ``add_`` of its own length counter, two
    ``index_copy_``. The decoder fills ``start_0`` before each forward (one fill per step, not per layer).
    ``get_seq_length`` returns it, i.e. the positions cached *before* the current forward (what models read
    at its start); unlike ``StaticLayer``'s counter it does not advance during the forward. ``crop`` is
    refused (it would move the shared start once per layer).

    ``window`` (host int or None, set by the decoder around one prefill forward): the forward's attention
    covers positions ``0 .. window - 1`` only (``update`` returns views of that many positions and the mask
    is built for them) instead of all ``max_cache_len``; a prefill at start ``s`` of ``T`` tokens sets
    ``s + T``. Decode steps leave it None (the whole cache, masked by position)."""

    def __init__(self, max_cache_len: int, start_0: torch.Tensor):
        super().__init__(max_cache_len)
        self.cumulative_length = self.start_0 = start_0
        self.window: int | None = None

    def get_mask_sizes(self, *args, **kwargs) -> tuple[int, int]:
        if self.window is not None:
            return self.window, 0
        return super().get_mask_sizes(*args, **kwargs)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)  # moves cumulative_length to the keys' device
        if self.start_0.device != self.keys.device:
            raise ValueError(f"SharedStartLayer: the decoder's start is on {self.start_0.device}, this layer's "
                             f"keys on {self.keys.device}; a layer on another device would write at a private copy")
        self.cumulative_length = self.start_0  # the shared tensor, not a copy

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("SharedStartLayer cannot be cropped: its decoder owns the start (reset it instead)")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Write ``[B, H, T, D]`` at positions ``start_0 .. start_0 + T - 1`` -> the whole cache (keys, values)."""
        from moe_offload.kernels.kv_write import kv_write

        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        kv_write(self.keys, self.values, key_states, value_states,
                 self.cumulative_length.view(1).expand(key_states.shape[0]))
        if self.window is not None:
            return self.keys[:, :, :self.window], self.values[:, :, :self.window]
        return self.keys, self.values

    def reset(self) -> None:
        """Zero the keys and values; the start belongs to the decoder."""
        if self.is_initialized:
            self.keys.zero_()
            self.values.zero_()


def _shared_start(layer, start_0: torch.Tensor):
    """``layer`` itself unless it is a plain ``StaticLayer`` (sliding-window and linear-attention layers
    keep transformers' own update)."""
    return SharedStartLayer(layer.max_cache_len, start_0) if type(layer) is StaticLayer else layer


class StaticDecoder:
    """Prefill + decode of ``batch`` equal-length sequences over a static KV cache (see module doc)."""

    def __init__(self, engine, batch: int, max_len: int, graphs: bool, padded_prefill: bool = False):
        from transformers import StaticCache

        for name, v, low in (("batch", batch, 1), ("max_len", max_len, 2)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"StaticDecoder {name}={v!r}: an integer >= {low}")
        self.engine, self.batch, self.max_len = engine, batch, max_len
        dev = engine.device
        self.kv = StaticCache(config=engine.model.config, max_cache_len=max_len)
        # positions cached before the next forward: one device scalar for every layer (see SharedStartLayer)
        self.start_0 = torch.zeros((), dtype=torch.long, device=dev)
        self.kv.layers = [_shared_start(layer, self.start_0) for layer in self.kv.layers]
        params = inspect.signature(type(engine.model).forward).parameters
        self._positions = "cache_position" in params  # transformers < 5.2x: positions are passed in
        self.ids_B1 = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.pos_1 = self.start_0.view(1)  # the step's cache_position: the same storage as start_0
        self.pos_B1 = torch.zeros((batch, 1), dtype=torch.long, device=dev)
        self.graphs = graphs and dev.type == "cuda"
        self.graph = None
        self.logits_BV = None
        self.length = 0  # positions filled
        self._eager_steps = 0
        self.capture_stream = torch.cuda.Stream(dev) if self.graphs else None
        self._declined: str | None = None
        self._windowed = [layer for layer in self.kv.layers if isinstance(layer, SharedStartLayer)]
        # a fresh batch's prefill as a graph per length bucket; ``padded_prefill`` without graphs (CPU tests):
        # the same padded forwards, eager. Only over full-attention layers: pad tokens would advance a
        # linear-attention layer's state (or a sliding window's counter) past the prompt
        graphed = self.graphs and engine.cfg.prefill.cuda_graphs
        self.prefill_graphs = None
        if (graphed or padded_prefill) and not self.hands_off:
            engine.cache.counters.declined["prefill_graph:non_full_attention_layers"] += 1
            log.log_once("prefill_graph_declined:non_full_attention_layers", "prefill_graph_declined", logging.INFO,
                         reason="non_full_attention_layers", fallback="eager", setting="prefill.cuda_graphs",
                         detail="pad tokens would advance linear-attention or sliding-window layers past the prompt")
        elif graphed or padded_prefill:
            self.prefill_graphs = PrefillGraphs(self, graphed, engine.cfg.compute.graph_after)

    # ------------------------------------------------------------------ inputs
    def _kwargs(self, ids_BT: torch.Tensor, start: int) -> dict:
        kw = dict(input_ids=ids_BT, use_cache=True, logits_to_keep=1, **{self.engine.kv_name: self.kv})
        self.start_0.fill_(start)
        if self._positions:
            T = ids_BT.shape[1]
            cache_pos = torch.arange(start, start + T, device=ids_BT.device)
            kw.update(cache_position=cache_pos, position_ids=cache_pos[None].expand(ids_BT.shape[0], T))
        return kw

    def _step_kwargs(self) -> dict:
        kw = dict(input_ids=self.ids_B1, use_cache=True, logits_to_keep=1, **{self.engine.kv_name: self.kv})
        if self._positions:
            kw.update(cache_position=self.pos_1, position_ids=self.pos_B1)
        return kw

    # ------------------------------------------------------------------ running
    @torch.inference_mode()
    def reset(self) -> None:
        """Forget the sequences (the cache's addresses, and so the graph, stay valid)."""
        self.kv.reset()
        self.length = 0

    @property
    def hands_off(self) -> bool:
        """Whether ``to_dynamic`` can hand the cache out (every layer a full-attention ``SharedStartLayer``)."""
        return len(self._windowed) == len(self.kv.layers)

    def to_dynamic(self):
        """A transformers ``DynamicCache`` holding copies of the positions filled so far (a request prefilled here,
        handed to the serving batch, ``serve/executor.py``); this decoder is free for the next prefill."""
        from transformers import DynamicCache

        if not self.hands_off:
            raise ValueError("only a cache of full-attention layers is handed out (sliding-window or linear-attention "
                             "layers keep their own layout)")
        out = DynamicCache(config=self.engine.model.config)
        for i, layer in enumerate(self.kv.layers):
            out.update(layer.keys[:, :, :self.length], layer.values[:, :, :self.length], i)
        return out

    def set_window(self, positions: int | None) -> None:
        """The next forward's attention covers positions ``0 .. positions - 1`` (None: the whole cache)."""
        for layer in self._windowed:
            layer.window = positions

    @torch.inference_mode()
    def prefill(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """Prefill into the static cache -> last logits ``[B, V]``: a fresh batch as a CUDA graph of its length
        bucket where it can be (``prefill_graph.py``), else eagerly (chunked like ``Engine.prefill``; the
        attention of each chunk covers the positions filled so far, not the whole cache)."""
        if ids_BT.dim() != 2 or ids_BT.dtype.is_floating_point or ids_BT.dtype == torch.bool or 0 in ids_BT.shape:
            raise ValueError(f"prefill: an integer [B, T] tensor of token ids with B, T >= 1, got {ids_BT.dtype} of "
                             f"shape {tuple(ids_BT.shape)}")
        B, T = ids_BT.shape
        if B != self.batch:
            raise ValueError(f"a prefill of {B} sequences on a decoder of {self.batch}; build one of {B}")
        if self.length + T >= self.max_len:
            raise ValueError(f"a prefill of {T} tokens does not fit this decoder ({self.max_len - self.length - 1} "
                             "fit: one position stays for the first decode step); raise decode.max_cache_len")
        self._check_vocab(ids_BT, "prefill")
        if self.length == 0 and self.prefill_graphs is not None:
            logits_BV = self.prefill_graphs.run(ids_BT)
            if logits_BV is not None:
                self.length = T
                return logits_BV
        chunk = self.engine.cfg.prefill.chunk_tokens
        logits, start = None, self.length
        try:
            for s in range(0, T, chunk):
                part = ids_BT[:, s:s + chunk]
                self.set_window(self.length + part.shape[1])
                try:
                    logits = self.engine.run_model(self._kwargs(part, self.length), part.numel())
                finally:
                    self.set_window(None)
                self.length += part.shape[1]
        except BaseException:
            self.length = start  # none of the prompt counts: a retry writes the same positions again
            raise
        return logits[:, -1]

    def _check_vocab(self, ids: torch.Tensor, what: str) -> None:
        """Token ids held on the host must index the vocab; ids on the device (sampled there) are not read back:
        that would be a host sync a step."""
        if ids.device.type != "cpu":
            return
        vocab = self.engine.reader.geometry.vocab
        bad = ids[(ids < 0) | (ids >= vocab)]
        if bad.numel():
            raise ValueError(f"{what}: token ids {bad[:5].tolist()} are outside the vocab (0..{vocab - 1})")

    @torch.inference_mode()
    def step(self, tok_B: torch.Tensor) -> torch.Tensor:
        """One decode step for the sampled tokens ``tok_B [B]`` -> logits ``[B, V]`` (a static buffer on
        the graph path: read it before the next step)."""
        if self.length + 1 > self.max_len:
            raise ValueError(f"the sequences reached decode.max_cache_len={self.max_len} positions")
        if tok_B.numel() != self.batch or tok_B.dtype.is_floating_point or tok_B.dtype == torch.bool:
            raise ValueError(f"step: one integer token id per sequence ({self.batch}), got {tok_B.dtype} of shape "
                             f"{tuple(tok_B.shape)}")
        self._check_vocab(tok_B, "step")
        self.ids_B1.copy_(tok_B.view(self.batch, 1))
        self.start_0.fill_(self.length)  # a fill kernel with the value as an argument: no sync (also pos_1)
        if self._positions:
            self.pos_B1.fill_(self.length)
        self.length += 1
        try:
            return self._step()
        except BaseException:
            self.length -= 1  # the step did not happen: the next one writes this position again
            raise

    def _step(self) -> torch.Tensor:
        cache = self.engine.cache
        if self.graph is not None:
            cache.step_boundary()
            self.graph.replay()
            cache.decode_step_enqueued(self.batch)
            cache.counters.compute["decode_graph_replays"] += 1
            return self.logits_BV
        if self.graphs and self._declined is None and self._eager_steps >= 1:
            cache.step_boundary()
            if self._capture():
                self.graph.replay()
                cache.decode_step_enqueued(self.batch)
                return self.logits_BV
        self._eager_steps += 1
        return self.engine.run_model(self._step_kwargs(), self.batch)[:, -1]

    def _capture(self) -> bool:
        cur = torch.cuda.current_stream(self.engine.device)
        graph = torch.cuda.CUDAGraph()
        self.capture_stream.wait_stream(cur)
        pool = torch.cuda.graph_pool_handle()  # named here: a failed capture's pool must be ended (graph_capture.py)
        try:
            with capture(graph, pool, self.capture_stream), self.engine.pdl_launches(self.batch):
                out = self.engine.model(**self._step_kwargs())
                logits_BV = out.logits[:, -1]
        except Exception as exc:  # an op that syncs or cannot be captured: eager from now on
            cur.wait_stream(self.capture_stream)
            self._decline("capture_failed", f"{type(exc).__name__}: {exc}")
            return False
        cur.wait_stream(self.capture_stream)
        self.graph, self.logits_BV = graph, logits_BV
        self.engine.cache.counters.compute["decode_graph_captures"] += 1
        log.event("decode_graph_captured", logging.INFO, batch=self.batch, max_len=self.max_len)
        return True

    def _decline(self, reason: str, detail: str) -> None:
        self._declined = reason
        log.log_once(f"decode_graph_declined:{reason}", "decode_graph_declined", logging.WARNING, reason=reason,
                     fallback="eager", detail=detail[:500], setting="decode.cuda_graphs")
        self.engine.cache.counters.declined[f"decode_graph:{reason}"] += 1
