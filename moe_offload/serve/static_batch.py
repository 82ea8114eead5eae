"""The serving decode batch over the per-row static KV cache (``serve/static_kv.py``), each step replayed
as a CUDA graph of its (rows, positions) bucket.

Rows: a request joining the batch takes the lowest free row; when requests leave, the highest rows move
into the holes (only their filled positions are copied), so the rows in use are always ``0..n-1`` and a
step's window is the smallest batch bucket holding them (1, 2, 4, 8, ..., ``serve.max_batch``). Rows of
the window nobody uses decode token 0 at position 0 of their own (free) row: the shapes stay static,
their output is dropped, and a joining request overwrites what they wrote. They are routed like any
token, so the decode hit/miss counters include them.

Positions: a step attends over the smallest power of two (at least 32, at most P =
``decode.max_cache_len``) above every row's position, so attention reads what the rows hold rather than
P columns per row. The 4-D mask (row b sees positions ``<= pos[b]``) is computed on the device from the
position tensor inside the step, so a replay rebuilds it.

Graphs (CUDA with ``decode.cuda_graphs``): a (rows, positions) bucket runs eagerly on its first step
and is captured on its second (Triton compiles and the allocator warms up first), as ``StaticDecoder``
(``moe_offload/decode_graph.py``) does; all the batch's graphs share one memory pool (replays never
overlap, and a step's logits are read before the next step). Around each replay the engine's cache runs
``step_boundary()`` (before) and ``decode_step_enqueued()`` (after); the offloaded experts read the
device residency table at replay time. A bucket above ``decode.max_tokens`` rows takes the experts'
prefill path, which cannot be captured: it runs eagerly. A capture that fails logs one
``decode_graph_declined`` event, is counted in ``stats()["declined"]["serve_graph:capture_failed"]``, the
step runs eagerly and no further bucket is captured (buckets captured before keep replaying). Counters
(engine cache ``stats()["compute"]``): ``serve_graph_captures``, ``serve_graph_replays``,
``serve_eager_steps``.

Legend: R rows, B rows of a step's bucket, n rows in use, P positions per row, L positions of a step's
bucket, V vocab.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch

from moe_offload import log
from moe_offload.graph_capture import capture

#: the smallest positions bucket (a power of two): shorter windows would only add graphs
_MIN_WINDOW = 32


def buckets(rows: int) -> list[int]:
    """Batch buckets for ``rows`` rows: powers of two below ``rows``, then ``rows``."""
    out, b = [], 1
    while b < rows:
        out.append(b)
        b *= 2
    return out + [rows]


class CudaGraphs:
    """Captures step functions as CUDA graphs on one side stream, into one shared memory pool."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn) -> "_Graph":
        """-> a replayable graph of ``fn()`` whose ``out`` is ``fn``'s output (a static tensor).
        Raises what the capture raised (the current stream is joined either way)."""
        cur = torch.cuda.current_stream(self.device)
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(cur)
        try:
            with capture(graph, self.pool, self.stream):
                out = fn()
        finally:
            cur.wait_stream(self.stream)
        return _Graph(graph, out)


class _Graph:
    """A captured step: ``replay()`` (on the current stream) rewrites ``out``."""

    def __init__(self, graph, out: torch.Tensor):
        self.graph, self.out = graph, out

    def replay(self) -> None:
        self.graph.replay()


class StaticBatch:
    """The decode batch of up to ``rows`` sequences of at most ``max_len`` positions each (see the module
    docstring). ``graphs``: a ``CudaGraphs`` (or a stand-in with the same ``capture``), None = eager."""

    kind = "static"

    def __init__(self, engine, rows: int, max_len: int, graphs=None):
        self.engine, self.R, self.max_len = engine, rows, max_len
        self.graphs = graphs
        self._attn = getattr(engine.model.config, "_attn_implementation", None) or "sdpa"
        if self._attn not in ("sdpa", "eager"):
            raise ValueError(f"attention implementation {self._attn!r} takes no 4-D mask; the static serving KV "
                             "cache needs sdpa or eager attention")
        self.kv = None  # RowKV, made at the first join (its layers take the prefilled cache's shapes)
        dev = engine.device
        self._buckets = buckets(rows)
        # a step's token ids (row 0) and positions (row 1) per row: the graphs' inputs
        self.inp_2R = torch.zeros((2, rows), dtype=torch.long, device=dev)
        self.cols_P = torch.arange(max_len, device=dev)
        # their host staging: pinned on CUDA, so the copy is asynchronous; it is rewritten only after the
        # previous step's logits were read (the scheduler samples them before the next step)
        self._host_2R = torch.zeros((2, rows), dtype=torch.long, pin_memory=dev.type == "cuda")
        self.row_of: list[int] = []  # the scheduler's b-th running request decodes in row row_of[b]
        self.len_R = [0] * rows  # tokens held per row
        self._uses: Counter = Counter()
        self._graph: dict[tuple[int, int], object] = {}
        self._graph_cache = None  # the expert cache the graphs were captured with
        self._declined: str | None = None
        self.steps = {"graph": 0, "eager": 0}

    @property
    def rows(self) -> int:
        return len(self.row_of)

    def seq_len(self) -> int:
        return max((self.len_R[r] for r in self.row_of), default=0)

    # ------------------------------------------------------------------ rows join and leave
    def join(self, one, batch_len: int, one_len: int) -> None:
        """Load the single-sequence cache ``one`` (``one_len`` tokens) into the lowest free row."""
        if self.kv is None:
            from moe_offload.serve.static_kv import RowKV

            self.kv = RowKV(one, self.R, self.max_len, self.inp_2R[1])
        row = len(self.row_of)
        if row >= self.R:
            raise ValueError(f"the batch is full ({self.R} rows = serve.max_batch)")
        self.kv.load(row, one, one_len)
        self.row_of.append(row)
        self.len_R[row] = one_len

    def keep(self, rows: list[int], trim: int) -> None:
        """Keep the scheduler's ``rows`` (in that order); the rows of the others are free. The highest
        kept rows move into the freed ones so rows ``0..n-1`` are in use (``trim`` is the left-padded
        batch's business)."""
        kept = [self.row_of[b] for b in rows]
        n = len(kept)
        holes = sorted(set(range(n)) - set(kept))
        movers = sorted(r for r in kept if r >= n)
        dst_of = dict(zip(movers, holes))
        for src, dst in dst_of.items():
            self.kv.move(src, dst, self.len_R[src])
            self.len_R[dst] = self.len_R[src]
        self.row_of = [dst_of.get(r, r) for r in kept]

    def reset(self) -> None:
        """Every row free (buffers and graphs stay: they hold the addresses)."""
        self.row_of = []

    # ------------------------------------------------------------------ one step
    def bucket(self, n: int, max_pos: int) -> tuple[int, int]:
        """(B, L) of a step over rows ``0..n-1`` whose largest position is ``max_pos``."""
        if max_pos >= self.max_len:
            raise ValueError(f"position {max_pos} is past decode.max_cache_len={self.max_len}")
        B = next(b for b in self._buckets if b >= n)
        L = _MIN_WINDOW
        while L <= max_pos:
            L *= 2
        return B, min(L, self.max_len)

    @torch.inference_mode()
    def decode(self, ids: list[int], lens: list[int]) -> torch.Tensor:
        """One step: ``ids[b]`` at position ``lens[b]`` in row ``row_of[b]`` -> logits ``[n, V]`` in the
        scheduler's order (on the graph path a view of the graph's output: read it before the next step)."""
        n = len(ids)
        if n != len(self.row_of):
            raise ValueError(f"{n} tokens for a batch of {len(self.row_of)} rows")
        B, L = self.bucket(n, max(lens))
        ids_R, pos_R = [0] * self.R, [0] * self.R  # rows nobody uses: token 0 at position 0
        for b, r in enumerate(self.row_of):
            ids_R[r], pos_R[r] = ids[b], lens[b]
            self.len_R[r] = lens[b] + 1
        self._host_2R.copy_(torch.tensor([ids_R, pos_R], dtype=torch.long))
        self.inp_2R.copy_(self._host_2R, non_blocking=True)
        logits_BV = self._step(B, L)
        if self.row_of == list(range(n)):
            return logits_BV[:n]
        order = torch.tensor(self.row_of, dtype=torch.long).to(logits_BV.device, non_blocking=True)
        return logits_BV.index_select(0, order)

    def _forward(self, B: int, L: int) -> torch.Tensor:
        """The step's forward (eager, or the body of a capture) -> logits ``[B, V]``."""
        self.kv.window(B, L)
        pos_B1 = self.kv.pos_R[:B, None]
        see_BL = self.cols_P[:L][None, :] <= pos_B1  # row b attends to its positions 0..pos[b]
        kw = dict(input_ids=self.inp_2R[0, :B, None], attention_mask=self._mask(see_BL)[:, None, None, :],
                  position_ids=pos_B1, use_cache=True, logits_to_keep=1, **{self.engine.kv_name: self.kv})
        return self.engine.run_model(kw, B)[:, -1]

    def _mask(self, see_BL: torch.Tensor) -> torch.Tensor:
        """The mask in the form the model's attention takes it (as transformers' own mask functions make
        it): bool for sdpa, additive (0 / dtype min) for eager."""
        if self._attn == "sdpa":
            return see_BL
        dtype = self.engine.dtype
        zeros_BL = torch.zeros(see_BL.shape, dtype=dtype, device=see_BL.device)
        return zeros_BL.masked_fill(~see_BL, torch.finfo(dtype).min)

    def _step(self, B: int, L: int) -> torch.Tensor:
        cache = self.engine.cache
        if self._graph_cache is not cache:  # graphs hold the cache's addresses (Engine.replace_cache)
            self._graph.clear()
            self._uses.clear()
            self._graph_cache = cache
        key = (B, L)
        graph = self._graph.get(key)
        if graph is None and self._uses[key] >= 1 and self._capturable(B):
            graph = self._capture(key)
        if graph is not None:
            cache.step_boundary()
            graph.replay()
            cache.decode_step_enqueued(B)
            cache.counters.compute["serve_graph_replays"] += 1
            self.steps["graph"] += 1
            return graph.out
        self._uses[key] += 1
        cache.counters.compute["serve_eager_steps"] += 1
        self.steps["eager"] += 1
        return self._forward(B, L)

    def _capturable(self, B: int) -> bool:
        if self.graphs is None or self._declined is not None:
            return False
        reason = self.engine.graph_decline_reason(B)
        if reason is None:
            return True
        self.engine.cache.counters.declined[f"serve_graph:{reason}"] += 1
        if reason == "batch_above_decode_max_tokens":
            log.log_once("decode_graph_declined:serve:batch_above_decode_max_tokens", "decode_graph_declined",
                         logging.WARNING, path="serve", reason=reason, fallback="eager",
                         detail=f"a step of {B} rows takes the experts' prefill path", setting="decode.max_tokens")
        else:
            log.log_once(f"decode_graph_declined:serve:batch_staged:{B}", "decode_graph_declined", logging.INFO,
                         path="serve", reason=reason, fallback="eager_staged", rows=B,
                         routed_max_tokens=self.engine.cache.routed_max_tokens, setting="decode.path")
        return False

    def _capture(self, key: tuple[int, int]):
        B, L = key
        try:
            graph = self.graphs.capture(lambda: self._forward(B, L))
        except Exception as exc:  # an op that syncs or cannot be captured: eager from now on
            self._declined = "capture_failed"
            self.engine.cache.counters.declined["serve_graph:capture_failed"] += 1
            log.log_once("decode_graph_declined:serve:capture_failed", "decode_graph_declined", logging.WARNING,
                         path="serve", reason="capture_failed", fallback="eager", rows=B, positions=L,
                         detail=f"{type(exc).__name__}: {exc}"[:500], setting="decode.cuda_graphs")
            return None
        self._graph[key] = graph
        self.engine.cache.counters.compute["serve_graph_captures"] += 1
        log.event("decode_graph_captured", logging.INFO, path="serve", rows=B, positions=L)
        return graph
