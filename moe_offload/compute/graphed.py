"""CUDA graphs for the prefill expert compute.

Eager, one MoE layer of prefill enqueues ~40 kernels (routing sort, dequant, two grouped GEMMs,
SwiGLU, the weighted scatter) at ~10 us of host time each, plus Triton launches at ~100 us; on the
H200 that host time, not the device, bounded the all-resident TTFT (benchmarks/results/profile-*).
The compute reads its weights from a staging buffer whose address is fixed and is free of host
syncs, so for a given (token count, staging buffer) it is a static graph: capture it once, then
each layer costs three input copies, one ``cudaGraphLaunch`` and one output copy.

Rules:
- a key (shapes, dtypes, the weight views' addresses and strides) is captured on its
  ``graph_after``-th call; earlier calls run eagerly (one-off prompt lengths never pay a capture);
- at most ``max_graphs`` graphs are kept (least recently used dropped);
- all graphs share one memory pool, which is safe only if their replays never overlap: every
  replay goes to the stream of the first capture; a call on another stream runs eagerly;
- captures run on one side stream made up front, right after the cache's copy and hit streams (torch
  hands out streams round-robin from a pool of 32 per device; a fresh stream per capture would
  sooner or later alias the copy or hit stream);
- a call inside another capture (a whole prefill forward, ``prefill_graph.py``) runs the inner compute,
  which becomes part of that graph;
- a capture that fails (an op that cannot be captured) turns graphs off for this wrapper and the
  call runs eagerly. Each declined case logs one structured event per reason and is counted in
  the cache's ``stats()["declined"]`` as ``cuda_graph:<reason>``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Callable

import torch

from moe_offload import log
from moe_offload.graph_capture import end_failed_capture


class GraphedCompute:
    """Wraps a prefill compute ``(hidden_TH, rows_TK, weights_TK, views, num_rows) -> out_TH``."""

    def __init__(self, inner: Callable, device: torch.device, graph_after: int = 2, max_graphs: int = 16):
        self.inner = inner
        self.stats = None  # the cache counters (bind)
        self._side = torch.cuda.Stream(device)  # the capture stream
        self.name = f"{getattr(inner, 'name', '?')}+cuda_graph"
        self.graph_after, self.max_graphs = graph_after, max_graphs
        self._graphs: OrderedDict = OrderedDict()  # key -> (graph, static inputs, static output)
        self._seen: dict = {}
        self._pool = None
        self._stream = None  # the stream every replay goes to (first capture's current stream)
        self._disabled: str | None = None

    def bind(self, stats) -> None:
        """Report captures, replays and declines into ``stats`` (a ``CacheStats``)."""
        self.stats = stats
        self.inner.bind(stats)

    def disable(self, reason: str, detail: str) -> None:
        """Run eagerly from now on (each call is counted as declined with ``reason``)."""
        self._disabled = reason
        self._graphs.clear()
        self._decline(reason, detail=detail)

    @staticmethod
    def _key(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N=None) -> tuple:
        idx = None if index_N is None else (tuple(index_N.shape), index_N.dtype)  # its values are an input
        return (tuple(hidden_TH.shape), hidden_TH.dtype, tuple(rows_TK.shape), rows_TK.dtype, weights_TK.dtype,
                num_rows, hidden_TH.device, idx,
                tuple((k, v.data_ptr(), tuple(v.shape), v.stride(), v.dtype) for k, v in views.items()))

    def _decline(self, reason: str, **detail) -> None:
        log.log_once(f"cuda_graph_declined:{reason}", "cuda_graph_declined", logging.WARNING, reason=reason,
                     fallback="eager", **detail)
        if self.stats is not None:
            self.stats.declined[f"cuda_graph:{reason}"] += 1

    def _count(self, what: str) -> None:
        if self.stats is not None:
            self.stats.compute[what] += 1

    def __call__(self, hidden_TH, rows_TK, weights_TK, views, num_rows, index_N=None):
        if self._disabled is not None:
            self._decline(self._disabled)
            return self.inner(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N)
        if hidden_TH.device.type != "cuda" or torch.cuda.is_current_stream_capturing():  # inside a whole-forward
            return self.inner(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N)  # graph: part of it
        stream = torch.cuda.current_stream(hidden_TH.device)
        if self._stream is not None and stream != self._stream:
            self._decline("other_stream", detail="graphs share a memory pool and replay on one stream")
            return self.inner(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N)
        key = self._key(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N)
        entry = self._graphs.get(key)
        if entry is None:
            if len(self._seen) > 4096:  # many one-off shapes: forget the counts, never the graphs
                self._seen.clear()
            n = self._seen.get(key, 0) + 1
            self._seen[key] = n
            if n < self.graph_after:
                self._count("eager")
                return self.inner(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N)
            entry = self._capture(key, hidden_TH, rows_TK, weights_TK, views, num_rows, index_N, stream)
            if entry is None:
                return self.inner(hidden_TH, rows_TK, weights_TK, views, num_rows, index_N)
        else:
            self._graphs.move_to_end(key)
        graph, (s_h, s_r, s_w, s_i), s_out = entry
        s_h.copy_(hidden_TH)
        s_r.copy_(rows_TK)
        s_w.copy_(weights_TK)
        if s_i is not None:  # a layer's slot table row: a static input, so one graph serves every layer
            s_i.copy_(index_N)
        graph.replay()
        self._count("graph_replays")
        account = getattr(self.inner, "account", None)  # an inner that counts its own calls (compute/auto.py)
        if account is not None:
            account(hidden_TH, rows_TK, views)
        # the static output is overwritten by the next replay: hand out a copy
        return s_out.clone()

    def _capture(self, key, hidden_TH, rows_TK, weights_TK, views, num_rows, index_N, stream):
        static = (hidden_TH.clone(), rows_TK.clone(), weights_TK.clone(),
                  None if index_N is None else index_N.clone())
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        side = self._side
        side.wait_stream(stream)
        try:
            with torch.cuda.stream(side):
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = self.inner(*static[:3], views, num_rows, static[3])
                finally:
                    graph.capture_end()
        except Exception as exc:  # an op that cannot be captured: eager from now on
            end_failed_capture(side.device, self._pool)
            stream.wait_stream(side)
            self.disable("capture_failed", f"{type(exc).__name__}: {exc}")
            return None
        stream.wait_stream(side)
        self._stream = stream
        self._graphs[key] = (graph, static, out)
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        self._count("graph_captures")
        log.event("cuda_graph_captured", logging.DEBUG, tokens=int(hidden_TH.shape[0]), graphs=len(self._graphs))
        return self._graphs[key]
