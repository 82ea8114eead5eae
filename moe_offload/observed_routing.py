"""The path of each forward and the routing it is learned from (``prefill_path.AdaptiveRouting`` decides).

``Engine.run_model`` announces every forward (``begin``: tokens, sequences) and ends it (``end``). A forward
of at most the cache's fixed threshold takes the routed path as before; a longer single-sequence forward asks
``AdaptiveRouting`` (observed spread of its prompt length + the cost model). Every single-sequence forward of
more than ``decode.max_tokens`` tokens is observed on whichever path it takes: each MoE layer marks the experts
it routed in a device mask ``[L, E]`` (one ``index_fill_``), ``end`` sums the mask per layer into pinned host
memory with one non-blocking copy and records an event, and a later ``begin`` hands the counts to
``AdaptiveRouting`` once the event has completed (``query``: never a sync; a copy still in flight waits for a
later forward). Nothing happens while a stream is capturing (decode steps replayed as CUDA graphs are fewer
tokens than the fixed threshold anyway). A forward that raised is not observed. The experts module reads the
decision through ``routed(T)``; a forward that no engine announced (a host stack calling the model itself)
gets the fixed threshold.
"""

from __future__ import annotations

import torch

from moe_offload.prefill_path import AdaptiveRouting


class ObservedRouting:
    def __init__(self, adaptive: AdaptiveRouting, layers: tuple[int, ...], E: int, decode_max_tokens: int,
                 device: torch.device, streams):
        self.adaptive, self.decode_max_tokens = adaptive, decode_max_tokens
        self.layer_pos = {layer: i for i, layer in enumerate(layers)}
        cuda = device.type == "cuda"
        self.seen_LE = torch.zeros((len(layers), E), dtype=torch.uint8, device=device)
        self.host_L = torch.zeros(len(layers), dtype=torch.int32, pin_memory=cuda)
        self.streams = streams
        self.event = streams.event() if cuda else None
        self.pending: int | None = None  # tokens of the observed forward whose counts are in flight
        self.plan: tuple[int, bool, bool] | None = None  # (tokens, routed, observed) of the forward running
        self.depth = 0  # a forward run inside another (same thread) keeps the outer one's plan

    def begin(self, tokens: int, sequences: int) -> bool:
        """Decide the path of a forward of ``tokens`` tokens over ``sequences`` sequences (True: routed)."""
        fixed = self.adaptive.fixed_max_tokens
        self.depth += 1
        if self.depth > 1:  # nested: the outer forward's plan stands; this one gets the fixed threshold
            return tokens <= fixed
        if self.seen_LE.is_cuda and torch.cuda.is_current_stream_capturing():
            self.plan = None
            return tokens <= fixed
        self._collect()
        single = sequences == 1
        routed = tokens <= fixed or (single and self.adaptive.routes(tokens))
        observe = single and tokens > self.decode_max_tokens
        if observe:
            self.seen_LE.zero_()
        self.plan = (tokens, routed, observe)
        return routed

    def routed(self, tokens: int) -> bool:
        """The path of an experts call of ``tokens`` tokens: the announced forward's, else the fixed threshold."""
        plan = self.plan
        if plan is not None and plan[0] == tokens:
            return plan[1]
        return tokens <= self.adaptive.fixed_max_tokens

    def layer(self, layer: int, ids_TK: torch.Tensor) -> None:
        """Mark the experts ``layer`` routed in the announced forward (when it is observed)."""
        plan = self.plan
        if plan is not None and plan[2] and ids_TK.shape[0] == plan[0]:
            self.seen_LE[self.layer_pos[layer]].index_fill_(0, ids_TK.reshape(-1).long(), 1)

    def end(self, ok: bool) -> None:
        """The forward is enqueued (``ok``) or raised: an observed one sends its counts to the host."""
        self.depth = max(0, self.depth - 1)
        if self.depth:
            return
        plan, self.plan = self.plan, None
        if plan is None or not plan[2] or not ok:
            return
        counts_L = self.seen_LE.sum(dim=1, dtype=torch.int32)
        self.host_L.copy_(counts_L, non_blocking=self.event is not None)
        if self.event is not None:
            self.streams.record(self.event, self.streams.current())
        self.pending = plan[0]

    def would_route(self, tokens: int) -> bool:
        """Whether a single-sequence forward of ``tokens`` tokens above the fixed threshold would be routed now
        (finished observations are taken in first; not counted: the forward's own ``begin`` counts its path,
        or, for a padded prefill, ``prefill_graph.py`` does)."""
        self._collect()
        return self.adaptive.routes(tokens, count=False)

    def _collect(self) -> None:
        if self.pending is None or (self.event is not None and not self.event.query()):
            return
        self.adaptive.observe(self.pending, self.host_L.numpy().copy())
        self.pending = None
