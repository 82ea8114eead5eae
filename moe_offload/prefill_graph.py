"""A fresh batch's prefill as one CUDA graph per length bucket (``StaticDecoder.prefill``).

Legend: B sequences, T prompt tokens, Tb the bucket T is padded to, N = B x Tb rows of an experts call,
V vocab, H hidden.

Eager, a prefill forward costs ~1.7 ms of host time per layer on the H200 (Python, ~50 launches), more
than the device needs at short prompts and whenever every expert is resident (benchmarks/results/HISTORY.md). A
start-0 prefill whose experts calls do no host work is captured once per bucket and replayed:
- ``routed``: ``B x Tb <= cache.routed_max_tokens`` (or a single prompt that the observed routing,
  ``prefill.routed_adaptive_max_tokens``, sends down the routed path), every experts call takes the routed path (resident
  experts read in place, misses copied from mapped host memory inside the step, ``decode_path.py``): valid
  at any residency, since the device slot table is read at replay time;
- ``in_place``: the cache holds every expert of every layer (``prefill.read_in_place`` on, a device hit
  path): under capture each experts call reads its layer's experts from their slots through the device
  table (``in_place_rows``), with no staging; such a graph is replayed only while that still holds
  (``plan`` checks it before every prefill).
- ``piecewise`` (``prefill.piecewise_graphs``): any other prefill that fits a bucket, i.e. one whose layers are
  staged. Its experts calls need host work (the staging pass), so the forward is captured as one graph per
  stretch between two experts calls (``Segments``: embedding + layer 0's attention and router, then each
  layer's residual, next attention and router, ..., the last norm and the LM head): at each experts call the
  call's inputs are copied into buffers every call shares, the capture of the current stretch ends, and the
  shared output buffer is handed to the model, whose next stretch (the TP reduce, the residual) reads it. A replay runs, inside one
  staging pass, stretch 0, the experts call of layer 0 eagerly (``OffloadedExperts.staged``, its result copied
  into that buffer), stretch 1, and so on. Valid at any residency (the staging decides per pass, on the host).
  Why: eager, such a prefill's host time (~1.7-2.5 ms per layer on the lent H200s, nearly all outside the
  experts call) set residency 0.75's TTFT (1.12-1.63 x its PCIe floor); a replayed stretch costs ~10-20 us.

- ``routed_fills``: a prefill the rules above would route, where the cache gets routed misses over the copy
  engine (``cache.routed_fills_for``, ``prefill.routed_copy``): captured like ``piecewise``, and each eager experts
  call reads its layer's routing on the host (one sync a layer) and stages only the routed missing experts
  (``staging.py``). Pad rows route as in ``routed``. For hosts whose SM reads of mapped memory run far below
  the copy engine's rate (benchmarks/results/HISTORY.md "e9c32fa / 9867ced / b703e18 on two more H100s"). With
  ``prefill.routed_plan: graph`` each stretch also ends with its layer's fill plan (``fill_plan.py``), so the eager
  call only waits for the plan's words.

A single prompt whose length the observed routing (``observed_routing.py``) may still route but has not yet
learned is not captured piecewise (its padded forward would not be observed): it runs eagerly, observed, and is
declined as ``observing_routing`` until its length bucket is learned.

Padding: T is rounded up to a bucket (``bucket``: multiples of 16 up to 64, then at most 25 % above T)
with pad tokens after the prompt. Causal attention keeps them out of every real position; their KV entries
(positions T..Tb-1) are masked for the decode steps and overwritten as decode reaches them. On the routed
path each pad row takes its sequence's last real row's experts (``cache.pad_src_N``, read by
``OffloadedExperts``: one gather of the routed ids per layer), so padding copies no expert the prompt did
not route. The last real position's logits are kept (``logits_to_keep`` as a device index), and the
attention covers Tb positions, not the whole static cache (``SharedStartLayer.window``).

A bucket runs eagerly (padded: the capture then meets compiled kernels) on its first ``graph_after - 1``
calls and is captured on the next; at most ``max_graphs`` are kept (least recently used dropped), sharing
one memory pool (their replays never overlap: one decoder, one stream). Every declined case (longer
prompt, cache not holding every expert for a staged bucket, capture failed) logs one
``prefill_graph_declined`` event per reason and counts ``stats()["declined"]["prefill_graph:<reason>"]``;
``stats()["compute"]`` counts ``prefill_graph_eager`` / ``_captures`` / ``_replays``.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict

import torch

from moe_offload import log
from moe_offload.graph_capture import capture, end_failed_capture

#: largest bucket: a longer prompt is prefilled eagerly (its host time is small beside its device time)
MAX_BUCKET = 4096


class PrefillNotCapturable(RuntimeError):
    """An experts call under a prefill capture that would need host work (staging)."""


class Segments:
    """One forward captured as CUDA graphs split at its staged experts calls (mode ``piecewise``, see the module
    docstring). ``parts``: ``(graph, call)`` in forward order; ``call`` runs the experts call that follows the graph
    eagerly (None after the last graph). Replays must follow the capture order (the graphs share one pool)."""

    def __init__(self, pool, stream, fills=None):
        self.pool, self.stream = pool, stream
        self.fills = fills  # routed fills: the staging, which may capture each layer's plan (``capture_plan``)
        self.parts: list[tuple[torch.cuda.CUDAGraph, object]] = []
        self._open: torch.cuda.CUDAGraph | None = None
        self._io: tuple[torch.Tensor, ...] | None = None  # (hidden, ids, weights, out): one set for every call

    def capture(self, forward):
        """Capture ``forward()`` (whose experts calls ``split`` it) on ``stream``; returns its result. A failure
        ends the open capture on that stream (``abort``) and is raised."""
        with torch.cuda.stream(self.stream):
            try:
                self.begin()
                out = forward()
                self.end()
            except BaseException:
                self.abort()
                raise
        return out

    def begin(self) -> None:
        """Start capturing the first stretch (on ``stream``, a side stream, current under the capture)."""
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self.pool, capture_error_mode="thread_local")

    def split(self, module, hidden_TH: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor) -> torch.Tensor:
        """At an experts call under capture: copy its inputs into the buffers every call shares (captured, the
        stretch's last work), end the stretch, start the next. The returned ``[T, H]`` buffer receives the call's
        result at each replay; the next stretch reads it before the next call rewrites it (one stream), so one
        set of buffers serves every layer and a graph holds no per-layer inputs or outputs in its pool."""
        if self._io is None:
            self._io = tuple(torch.empty_like(t, memory_format=torch.contiguous_format)
                             for t in (hidden_TH, ids_TK, w_TK, hidden_TH))
        h, ids, w, out_TH = self._io
        for buf, t in ((h, hidden_TH), (ids, ids_TK), (w, w_TK)):
            if buf.shape != t.shape or buf.dtype != t.dtype:
                raise PrefillNotCapturable(f"experts call inputs differ between layers ({tuple(t.shape)} {t.dtype} "
                                           f"vs {tuple(buf.shape)} {buf.dtype}): no shared buffers")
            buf.copy_(t)
        planned = False
        if self.fills is not None:  # the layer's routed-fill plan, worked out on the device right after its router
            from moe_offload.experts import pad_rows_routed

            planned = self.fills.capture_plan(module.layer_idx, pad_rows_routed(module.cache, ids))
        graph, self._open = self._open, None
        graph.capture_end()

        def call() -> None:
            if planned:
                with self.fills.planned_in_graph(module.layer_idx):
                    out_TH.copy_(module.staged(h, ids, w))
            else:
                out_TH.copy_(module.staged(h, ids, w))

        self.parts.append((graph, call))
        self.begin()
        return out_TH

    def end(self) -> None:
        graph, self._open = self._open, None
        graph.capture_end()
        self.parts.append((graph, None))

    def abort(self) -> None:
        """After a failed capture: end the open one on its own stream (torch ends a capture only on the stream
        that began it; left open, every later allocation would go to the pool and the side stream stay
        captured; its error is the one already raised) and drop the rest."""
        graph, self._open = self._open, None
        if graph is not None:
            with torch.cuda.stream(self.stream):
                try:
                    graph.capture_end()
                except Exception:  # noqa: BLE001 - the capture was invalidated; the first error is reported
                    end_failed_capture(self.stream.device, self.pool)
        self.parts.clear()

    def replay(self) -> None:
        for graph, call in self.parts:
            graph.replay()
            if call is not None:
                call()


def bucket(tokens: int, limit: int) -> int | None:
    """The padded length of a ``tokens``-token prefill (None: above ``limit``): a multiple of 16 up to 64,
    then of ``2^(floor(log2 T) - 2)`` (at most 25 % padding), never above ``limit``."""
    if tokens < 1 or tokens > limit:
        return None
    step = 16 if tokens <= 64 else 1 << (tokens.bit_length() - 3)
    return min(-(-tokens // step) * step, limit)


def _in_place_allowed(cache) -> bool:
    """``prefill.read_in_place`` on and ``prefill.hit_copy`` not off: from the config, not from the hit path
    resolved at run time (a fallback on one TP rank must not make the ranks pad differently)."""
    return cache.prefill_cfg.read_in_place and cache.prefill_cfg.hit_copy != "off"


def in_place_rows(cache, layer: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """``(pool views, the layer's device slot table row)`` for an experts call under a prefill capture:
    the compute reads every expert from its slot. Raises ``PrefillNotCapturable`` unless every expert of
    ``layer`` is resident and ``prefill.read_in_place`` is on (``prefill.hit_copy`` not off)."""
    pool = cache.pool
    if not (_in_place_allowed(cache) and bool((pool.resident(layer) >= 0).all())):
        raise PrefillNotCapturable(f"layer {layer} is staged (not every expert resident, or prefill.read_in_place "
                                   "off): its prefill needs host work per layer")
    return pool.views(), pool.table_LE[pool.layer_pos[layer]]


@contextlib.contextmanager
def _planned(cache, tokens: int, routed: bool):
    """Experts calls of ``tokens`` tokens take the routed path inside, or the staged one (the observed
    routing's plan for the forward, which a capture would otherwise reset to the fixed threshold). Not
    observed: the path is decided (``PrefillGraphs.plan``), and pad rows must not count in the spreads."""
    obs = cache.observed
    if obs is None:
        yield
        return
    saved = obs.plan, obs.depth
    obs.plan, obs.depth = (tokens, routed, False), obs.depth + 1
    try:
        yield
    finally:
        obs.plan, obs.depth = saved


class PrefillGraphs:
    """The prefill graphs of one ``StaticDecoder`` (see the module docstring)."""

    def __init__(self, decoder, graphs: bool, graph_after: int = 2, max_graphs: int = 8):
        self.decoder, self.graphs = decoder, graphs
        self.graph_after, self.max_graphs = max(1, graph_after), max_graphs
        self._graphs: OrderedDict = OrderedDict()  # (B, Tb, mode) -> entry
        self._seen: dict[tuple[int, int, str], int] = {}
        self._static: dict[tuple[int, int], dict] = {}  # the bucket's input buffers (eager and captured)
        self._pool = None

    # ------------------------------------------------------------------ eligibility
    def plan(self, B: int, T: int) -> tuple[int, str] | None:
        """``(Tb, mode)`` for a start-0 prefill of ``B x T`` tokens, or None (eager, unpadded; counted)."""
        dec = self.decoder
        cache = dec.engine.cache
        limit = min(MAX_BUCKET, dec.engine.cfg.prefill.chunk_tokens, dec.max_len - 1)
        # every input is the same on every TP rank (thresholds, residency, config; observed routing is off
        # under TP), so the ranks pad alike and their all-reduces see the same shapes
        def routed(Tb: int) -> str:  # the misses over the copy engine (routed fills) or by SM reads in the graph
            fills = cache.prefill_cfg.piecewise_graphs and cache.routed_fills_for(B * T, B * Tb)
            return "routed_fills" if fills else "routed"

        Tb = bucket(T, min(cache.routed_max_tokens // B, limit))
        if Tb is not None:
            return Tb, routed(Tb)
        obs = cache.observed  # a single prompt the observed routing sends down the routed path (adaptive)
        if obs is not None and B == 1 and T > obs.decode_max_tokens and obs.would_route(T):
            Tb = bucket(T, min(cache.decode.max_tokens, limit))  # what the routing record and scratch rows hold
            if Tb is not None:
                obs.adaptive.routed += 1  # the forward's path, counted as its begin() would
                return Tb, routed(Tb)
        mode = "in_place"
        if not (cache.holds_every_expert() and _in_place_allowed(cache)):
            if not cache.prefill_cfg.piecewise_graphs:
                self._decline("staged_layers", "a layer with missing experts is staged (host work per layer) and "
                              "prefill.piecewise_graphs is off", T=T)
                return None
            adaptive = obs is not None and B == 1 and obs.decode_max_tokens < T <= obs.adaptive.max_tokens
            if adaptive and not obs.adaptive.learned(T):  # padded forwards are not observed: learn it eagerly first
                self._decline("observing_routing", "a single prompt of a length whose routing spread the cache "
                              "has not yet learned runs eagerly, observed (prefill.routed_adaptive_max_tokens)", T=T)
                return None
            mode = "piecewise"
        Tb = bucket(T, limit)
        if Tb is None:
            self._decline("longer_than_bucket", f"prompts above {limit} tokens are prefilled eagerly", T=T)
            return None
        if mode == "piecewise" and obs is not None and B == 1 and T > obs.adaptive.fixed_max_tokens:
            obs.adaptive.staged += 1  # the forward's path, counted as its begin() would (routes() counts this range)
        return Tb, mode

    def _decline(self, reason: str, detail: str, **fields) -> None:
        log.log_once(f"prefill_graph_declined:{reason}", "prefill_graph_declined", logging.INFO, reason=reason,
                     fallback="eager", detail=detail[:500], setting="prefill.cuda_graphs", **fields)
        self.decoder.engine.cache.counters.declined[f"prefill_graph:{reason}"] += 1

    # ------------------------------------------------------------------ running
    def _buffers(self, B: int, Tb: int) -> dict:
        key = (B, Tb)
        st = self._static.get(key)
        if st is None:
            dev = self.decoder.engine.device
            rows_N = torch.arange(B * Tb, device=dev)
            st = dict(ids=torch.zeros((B, Tb), dtype=torch.long, device=dev),
                      n=torch.zeros((), dtype=torch.long, device=dev),  # real tokens per sequence
                      last=torch.zeros((1,), dtype=torch.long, device=dev),  # the last real position
                      rows=rows_N, t=rows_N % Tb, src=torch.empty_like(rows_N),
                      pos=torch.arange(Tb, device=dev))
            self._static[key] = st
        return st

    def _forward(self, st: dict, Tb: int, mode: str, capture: bool):
        """The model forward over the bucket's static inputs -> logits ``[B, 1, V]``."""
        dec, engine = self.decoder, self.decoder.engine
        cache = engine.cache
        # pad rows take the routed ids of their sequence's last real row (computed from ``n``: in the graph)
        torch.where(st["t"] < st["n"], st["rows"], st["rows"] - st["t"] + st["n"] - 1, out=st["src"])
        kw = dict(input_ids=st["ids"], use_cache=True, logits_to_keep=st["last"], **{engine.kv_name: dec.kv})
        if dec._positions:
            kw.update(cache_position=st["pos"], position_ids=st["pos"][None].expand(st["ids"].shape[0], Tb))
        dec.set_window(Tb)
        cache.pad_src_N = st["src"] if mode in ("routed", "routed_fills") else None
        n = st["ids"].numel()
        try:
            if mode == "routed":  # every experts call routed, eager or captured (no staged pass announced)
                with _planned(cache, n, routed=True):  # decode-path kernels, plain launches (PDL: decode steps only)
                    return engine.model(**kw).logits
            if mode == "routed_fills":  # staged calls of the routed misses only: split under capture, else a pass
                fills = cache.routed_fill_forward() if capture else cache.prefill_pass(routed_fills=True)
                with _planned(cache, n, routed=False), fills:
                    return engine.model(**kw).logits
            if capture and mode == "piecewise":  # staged: each experts call splits the capture (Segments)
                with _planned(cache, n, routed=False):
                    return engine.model(**kw).logits
            if capture:
                return engine.model(**kw).logits
            with _planned(cache, n, routed=False), cache.prefill_pass():  # staged (in place: every layer read in place)
                return engine.model(**kw).logits
        finally:
            cache.pad_src_N = None
            dec.set_window(None)

    def run(self, ids_BT: torch.Tensor) -> torch.Tensor | None:
        """Prefill ``ids_BT [B, T]`` at start 0 -> last real logits ``[B, V]``, or None when this prefill is
        not eligible (the caller prefills eagerly, unpadded)."""
        B, T = ids_BT.shape
        planned = self.plan(B, T)
        if planned is None:
            return None
        Tb, mode = planned
        key = (B, Tb, mode)  # a length may be staged (in place) at one time and routed at another
        st = self._buffers(B, Tb)
        st["ids"][:, :T].copy_(ids_BT)
        st["ids"][:, T:].fill_(0)
        st["n"].fill_(T)
        st["last"].fill_(T - 1)
        dec = self.decoder
        dec.start_0.fill_(0)
        cache = dec.engine.cache
        counters = cache.counters.compute
        entry = self._graphs.get(key) if self.graphs else None
        if entry is None and self.graphs:
            n = self._seen.get(key, 0) + 1
            self._seen[key] = n
            if n >= self.graph_after:
                entry = self._capture(key, st, Tb, mode)
        if entry is None:
            counters["prefill_graph_eager"] += 1
            return self._forward(st, Tb, mode, capture=False)[:, 0].clone()
        graph, logits, graph_mode = entry  # an in-place graph only while every expert is resident: plan() checks
        self._graphs.move_to_end(key)
        if graph_mode in ("piecewise", "routed_fills"):  # the stretches replayed, the experts calls eager, in one
            fills = graph_mode == "routed_fills"  # staging pass (of the routed misses only, with the pad rows' map)
            cache.pad_src_N = st["src"] if fills else None
            try:
                with cache.prefill_pass(routed_fills=fills):
                    graph.replay()
            finally:
                cache.pad_src_N = None
            counters["prefill_graph_replays"] += 1
            counters["prefill_graph_piecewise_replays"] += 1
            return logits[:, 0].clone()
        cache.step_boundary()
        graph.replay()
        if graph_mode == "routed":  # its routing record is complete with it (admission at the next boundary)
            cache.decode_step_enqueued(B * Tb)
        else:  # counted as the staged pass it replaces: every layer's experts hits, read in place
            cache.counters.prefills += 1
            for layer in cache.layers:
                cache.counters.layer(layer).prefill_hits += cache.E
            counters["prefill_in_place_layers"] += len(cache.layers)
        counters["prefill_graph_replays"] += 1
        return logits[:, 0].clone()

    def _capture(self, key, st: dict, Tb: int, mode: str):
        dec = self.decoder
        cur = torch.cuda.current_stream(dec.engine.device)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        dec.engine.cache.step_boundary()  # host work a captured forward cannot do (admissions, the record)
        side = dec.capture_stream
        side.wait_stream(cur)
        cache = dec.engine.cache
        try:
            if mode in ("piecewise", "routed_fills"):
                graph = Segments(self._pool, side, cache.staging if mode == "routed_fills" else None)
                cache.prefill_split = graph
                try:
                    logits = graph.capture(lambda: self._forward(st, Tb, mode, capture=True))
                finally:
                    cache.prefill_split = None
            else:
                graph = torch.cuda.CUDAGraph()
                with capture(graph, self._pool, side):
                    logits = self._forward(st, Tb, mode, capture=True)
        except Exception as exc:  # an op that syncs, cannot be captured, or a staged layer: eager from now on
            # a piecewise stretch whose capture_end raised inside ``split`` is not the one ``abort`` ends (a no-op
            # where ``capture`` or ``abort`` already ended it)
            end_failed_capture(side.device, self._pool)
            cur.wait_stream(side)
            self.graphs = False
            self._graphs.clear()
            self._decline("capture_failed", f"{type(exc).__name__}: {exc}", T=Tb)
            return None
        cur.wait_stream(side)
        self._graphs[key] = (graph, logits, mode)
        if len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        dec.engine.cache.counters.compute["prefill_graph_captures"] += 1
        log.event("prefill_graph_captured", logging.INFO, batch=key[0], tokens=Tb, mode=mode, graphs=len(self._graphs))
        return self._graphs[key]
