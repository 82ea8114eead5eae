"""The model side of the scheduler: every forward and every KV-cache edit, as a small set of ops.

The scheduler decides (which request, which rows, which tokens); the executor does. Every op is a
deterministic function of its arguments and the executor's state, so under tensor parallelism rank 0's
``BroadcastExecutor`` sends each op to the other ranks, whose ``follow`` loop replays it on their own
engine (the expert all-reduce inside the forward keeps them in lock step). Followers never sample:
rank 0's sampled ids come to them as the next decode op's input, and rank 0 alone decides stops.

Legend: B sequences in the decode batch, S padded cache length, T chunk tokens, V vocab.
"""

from __future__ import annotations

import inspect

import torch

from moe_offload.serve import kv


class LocalExecutor:
    """Per-request prefill caches (by request id) and the decode batch's left-padded cache."""

    def __init__(self, engine):
        self.engine = engine
        params = inspect.signature(type(engine.model).forward).parameters
        # transformers 5.24 renamed past_key_values -> cache (5.17 has only the old name)
        self._kv_name = "cache" if "cache" in params else "past_key_values"
        self.pasts: dict[str, object] = {}
        self.batch = None

    def prefill(self, rid: str, ids: list[int]) -> torch.Tensor:
        """One prefill chunk of request ``rid`` (batch 1, ``Engine.forward``) -> last-position logits [1, V]."""
        ids_1T = torch.tensor([ids], dtype=torch.long, device=self.engine.device)
        logits, self.pasts[rid] = self.engine.forward(ids_1T, self.pasts.get(rid), 1)
        return logits[:, -1]

    def join(self, rid: str, batch_len: int, one_len: int) -> None:
        """Move request ``rid``'s cache into the decode batch as its last row."""
        self.batch = kv.append(self.batch, self.pasts.pop(rid), batch_len, one_len)

    def drop(self, rid: str) -> None:
        self.pasts.pop(rid, None)

    @torch.inference_mode()
    def decode(self, ids: list[int], lens: list[int]) -> torch.Tensor:
        """One forward of every batch row: ``ids[b]`` at position ``lens[b]`` (its cached tokens) ->
        logits [B, V]."""
        dev = self.engine.device
        S = kv.seq_len(self.batch)
        mask_BS = kv.attention_mask([n + 1 for n in lens], S + 1, dev)
        pos_B1 = torch.tensor(lens, dtype=torch.long)[:, None].to(dev, non_blocking=True)
        ids_B1 = torch.tensor(ids, dtype=torch.long)[:, None].to(dev, non_blocking=True)
        out = self.engine.model(input_ids=ids_B1, attention_mask=mask_BS, position_ids=pos_B1, use_cache=True,
                                logits_to_keep=1, **{self._kv_name: self.batch})
        self.batch = getattr(out, self._kv_name)
        return out.logits[:, -1]

    def keep(self, rows: list[int], trim: int) -> None:
        """Keep batch ``rows`` and cut ``trim`` leading padding columns."""
        self.batch = kv.keep(self.batch, rows, trim)

    def reset(self) -> None:
        """Drop every cache (after a failed forward, whose cache state is unknown)."""
        self.pasts.clear()
        self.batch = None

    def batch_len(self) -> int:
        return kv.seq_len(self.batch) if self.batch is not None else 0

    def stop(self) -> None:
        """End of serving (followers leave their loop)."""


class BroadcastExecutor(LocalExecutor):
    """Rank 0 under TP: each op is broadcast to the group before it runs here."""

    def __init__(self, engine, group=None, src: int = 0):
        super().__init__(engine)
        self.group, self.src = group, src

    def _send(self, op: str, *args) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([(op, args)], src=self.src, group=self.group)

    def prefill(self, rid, ids):
        self._send("prefill", rid, ids)
        return super().prefill(rid, ids)

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
