"""The model side of the scheduler: every forward and every KV-cache edit, as a small set of ops.

The scheduler decides (which request, which rows, which tokens); the executor does. Every op is a
deterministic function of its arguments and the executor's state, so under tensor parallelism rank 0's
``BroadcastExecutor`` sends each op to the other ranks, whose ``follow`` loop replays it on their own
engine (the expert all-reduce inside the forward keeps them in lock step). Followers never sample:
rank 0's sampled ids come to them as the next decode op's input, and rank 0 alone decides stops.

The decode batch is one of two kinds behind one seam (``join``/``decode``/``keep``/``reset``): the per-row
static KV cache whose steps replay CUDA graphs (``serve/static_batch.py``; CUDA with ``decode.cuda_graphs``)
or one left-padded transformers cache decoded eagerly (``serve/kv.py``; the CPU, and the fallback).

Legend: B sequences in the decode batch, S padded cache length, T chunk tokens, V vocab.
"""

from __future__ import annotations

import logging

import torch

from moe_offload import log
from moe_offload.config import ServeConfig
from moe_offload.serve.config import decode_kv_kind
from moe_offload.serve.kv import LeftPaddedBatch
from moe_offload.serve.prefill_batch import left_padded_inputs, split_rows
from moe_offload.serve.static_batch import CudaGraphs, StaticBatch


def make_batch(engine, cfg: ServeConfig, kind: str | None = None):
    """The decode batch of ``kind`` (``static`` | ``dynamic``; None: ``serve.config.decode_kv_kind``)."""
    kind = kind or decode_kv_kind(engine.cfg, engine.device)
    if kind == "dynamic":
        return LeftPaddedBatch(engine)
    if kind != "static":
        raise ValueError(f"decode batch kind {kind!r}; accepted: static, dynamic")
    dev = engine.device
    graphs = CudaGraphs(dev) if dev.type == "cuda" and engine.cfg.decode.cuda_graphs else None
    try:
        return StaticBatch(engine, cfg.max_batch, engine.cfg.decode.max_cache_len, graphs)
    except ValueError as exc:  # e.g. an attention implementation that takes no 4-D mask
        return _decline_static(engine, exc)


def _decline_static(engine, exc: Exception) -> LeftPaddedBatch:
    engine.cache.counters.declined["serve_graph:static_kv_unavailable"] += 1
    log.log_once(f"decode_graph_declined:serve:static_kv:{type(exc).__name__}", "decode_graph_declined",
                 logging.WARNING, path="serve", reason="static_kv_unavailable", fallback="dynamic_kv_eager",
                 detail=f"{type(exc).__name__}: {exc}"[:500], setting="decode.cuda_graphs, decode.max_cache_len")
    return LeftPaddedBatch(engine)


class LocalExecutor:
    """Per-request prefill caches (by request id) and the decode batch (``batch``: a StaticBatch or a
    LeftPaddedBatch, chosen by ``make_batch`` unless given)."""

    def __init__(self, engine, cfg: ServeConfig | None = None, batch=None):
        self.engine = engine
        self.cfg = cfg or ServeConfig()
        self.pasts: dict[str, object] = {}
        self.batch = batch if batch is not None else make_batch(engine, self.cfg)
        #: the static decoder whole prompts are prefilled with (tests set one); None: the engine's one-sequence
        #: decoder with ``prefill.cuda_graphs`` on CUDA (a graph replay per length bucket, ``prefill_graph.py``),
        #: looked up per prompt (``Engine.replace_cache`` drops decoders: their graphs hold the old cache)
        self.prefill_decoder = None

    def _decoder_for(self, tokens: int):
        eng = self.engine
        dec = self.prefill_decoder
        if dec is None and eng.cfg.prefill.cuda_graphs and eng.cfg.decode.cuda_graphs and eng.device.type == "cuda":
            dec = eng.decoder(1)
        ok = dec is not None and dec.prefill_graphs is not None and dec.hands_off and tokens + 1 <= dec.max_len
        return dec if ok else None

    def prefill(self, rid: str, ids: list[int], whole: bool = False) -> torch.Tensor:
        """One prefill chunk of request ``rid`` (batch 1) -> last-position logits [1, V]. ``whole``: the chunk is
        the whole prompt; it is prefilled in the static prefill decoder (its length bucket's CUDA graph where
        one applies) and its positions are copied into the request's own cache; else ``Engine.forward``."""
        ids_1T = torch.tensor([ids], dtype=torch.long, device=self.engine.device)
        dec = self._decoder_for(len(ids)) if whole and rid not in self.pasts else None
        if dec is not None:
            dec.reset()
            logits_1V = dec.prefill(ids_1T)
            self.pasts[rid] = dec.to_dynamic()
            return logits_1V
        logits, self.pasts[rid] = self.engine.forward(ids_1T, self.pasts.get(rid), 1)
        return logits[:, -1]

    def prefill_batch(self, rids: list[str], prompts: list[list[int]]) -> list[torch.Tensor]:
        """Whole prompts of several new requests in one left-padded forward -> each one's last-position
        logits ``[1, V]``; each request's cache (its own positions only) is kept as after ``prefill``."""
        eng = self.engine
        ids_BT, mask_BT, pos_BT = left_padded_inputs(prompts, eng.device)
        logits, past = eng.forward(ids_BT, None, 1, attention_mask=mask_BT, position_ids=pos_BT)
        for rid, one in zip(rids, split_rows(past, [len(p) for p in prompts], eng.model.config)):
            self.pasts[rid] = one
        return [logits[b:b + 1, -1] for b in range(len(rids))]

    def join(self, rid: str, batch_len: int, one_len: int) -> None:
        """Move request ``rid``'s cache into the decode batch as its last row."""
        one = self.pasts.pop(rid)
        try:
            self.batch.join(one, batch_len, one_len)
        except (ValueError, torch.OutOfMemoryError) as exc:
            # the static cache is made at the first join (from the prefilled cache's layers); if it cannot
            # be made, the batch is still empty and the left-padded one takes over
            if self.batch.kind != "static" or self.batch.kv is not None:
                raise
            self.batch = _decline_static(self.engine, exc)
            self.batch.join(one, batch_len, one_len)

    def drop(self, rid: str) -> None:
        self.pasts.pop(rid, None)

    def decode(self, ids: list[int], lens: list[int]) -> torch.Tensor:
        """One forward of every batch row: ``ids[b]`` at position ``lens[b]`` (its cached tokens) ->
        logits [B, V]."""
        return self.batch.decode(ids, lens)

    def keep(self, rows: list[int], trim: int) -> None:
        """Keep batch ``rows`` and cut ``trim`` leading padding columns (left-padded batch)."""
        self.batch.keep(rows, trim)

    def reset(self) -> None:
        """Drop every cache (after a failed forward, whose cache state is unknown)."""
        self.pasts.clear()
        self.batch.reset()

    def batch_len(self) -> int:
        return self.batch.seq_len()

    def stop(self) -> None:
        """End of serving (followers leave their loop)."""


class BroadcastExecutor(LocalExecutor):
    """Rank 0 under TP: each op is broadcast to the group before it runs here."""

    def __init__(self, engine, cfg: ServeConfig | None = None, group=None, src: int = 0, batch=None):
        super().__init__(engine, cfg, batch)
        self.group, self.src = group, src

    def _send(self, op: str, *args) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([(op, args)], src=self.src, group=self.group)

    def prefill(self, rid, ids, whole=False):
        self._send("prefill", rid, ids, whole)
        return super().prefill(rid, ids, whole)

    def prefill_batch(self, rids, prompts):
        self._send("prefill_batch", rids, prompts)
        return super().prefill_batch(rids, prompts)

    def join(self, rid, batch_len, one_len):
        self._send("join", rid, batch_len, one_len)
        super().join(rid, batch_len, one_len)

    def drop(self, rid):
        self._send("drop", rid)
        super().drop(rid)

    def decode(self, ids, lens):
        self._send("decode", ids, lens)
        return super().decode(ids, lens)

    def keep(self, rows, trim):
        self._send("keep", rows, trim)
        super().keep(rows, trim)

    def reset(self):
        self._send("reset")
        super().reset()

    def stop(self):
        self._send("stop")


def follow(executor: LocalExecutor, group=None, src: int = 0) -> int:
    """A follower rank: replay rank 0's ops on ``executor`` until ``stop`` -> ops replayed."""
    import torch.distributed as dist

    n = 0
    while True:
        box = [None]
        dist.broadcast_object_list(box, src=src, group=group)
        op, args = box[0]
        if op == "stop":
            return n
        getattr(executor, op)(*args)
        n += 1
