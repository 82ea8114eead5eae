"""OffloadMoeCache: the facade over the parts that keep experts on the device.

- ``budget.py``: how many slots the budget buys (``plan``);
- ``slot_pool.py``: the slot pool and the residency map (host and device copies), admission;
- ``staging.py``: the prefill pass (two staging buffers, events, admission into free slots);
- ``hit_copy.py``: how prefill hits reach staging (resolved once per cache, declines logged + counted);
- ``streams.py``: the copy and hit streams and the CPU no-op.

Legend: T tokens, K top-k, E experts per layer, S slots, R bytes of one expert row.

The prefill protocol, owned by the caller (the engine, or the first experts call of a forward that
nobody announced)::

    with cache.prefill_pass():          # one per model forward on the prefill path
        views, index_N = cache.stage_rows(layer)  # per MoE layer: its bank for compute; the layer two ahead is assembled at done()
        ... compute ...
        cache.done(layer)               # the layer's GEMMs are enqueued

A pass that raises leaves nothing unordered behind (``staging.py``); ``close()`` synchronizes the
streams before memory goes.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from dataclasses import replace

import numpy as np
import torch

from moe_offload import log
from moe_offload.budget import BudgetError, BudgetPlan, is_device_oom, oom_message, plan_budget
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.copy_paths import RowCopy
from moe_offload.decode_path import DecodeResidency
from moe_offload.lookahead import lookahead_rows
from moe_offload.hit_copy import FULL_LAYER_COPY, FullLayerCopy, H2DRows, log_hit_fallback, resolve_hit_copy
from moe_offload.link_rates import decode_path as resolve_decode_path, decode_path_floor, link_model, routed_copy
from moe_offload.prefill_path import cost_model as prefill_cost_model, plan_cache
from moe_offload.slot_pool import SlotPool
from moe_offload.staging import PrefillStaging
from moe_offload.stats import CacheStats
from moe_offload.streams import Streams

__all__ = ["OffloadMoeCache", "BudgetError", "BudgetPlan", "plan_budget"]


class OffloadMoeCache:
    """Device-resident subset of the experts in ``store`` and the copy machinery around it."""

    def __init__(self, store, cache_cfg: CacheConfig, prefill_cfg: PrefillConfig, device: torch.device | str,
                 decode_max_tokens: int = 16, fused_decode: bool = True, decode_path: str = "routed",
                 cost_model=None, observe_routing: bool = False, lookahead: bool = False, miss_copy: str = "uva",
                 overlap_misses_from: int = 0):
        """``decode_max_tokens``: steps of at most this many tokens always take the decode path; longer
        forwards up to ``prefill.routed_max_tokens`` (resolved here, ``prefill_path.py``) too.
        ``decode_path`` (``decode.path``) "auto": the threshold may be lower than ``decode_max_tokens``
        where the cost model says staging pays; steps above it are then staged. "host": "auto" where this host's
        link rates were measured at start-up (its threshold never below ``link_rates.decode_path_floor``: 16 rows on a
        host with slow SM reads, 32 elsewhere), else "routed" (``link_rates.decode_path``).
        ``fused_decode``: whether the decode compute may use the fused NVFP4 kernels (the cost model).
        ``cost_model``: ``(prefill_path.CostModel, entry)`` to decide paths with instead of the table's entry
        for this GPU (one measured elsewhere; the CPU has none). ``observe_routing``: the forwards are announced
        (``begin_forward``/``end_forward``, as ``Engine.run_model`` does), so ``prefill.routed_adaptive_max_tokens``
        may apply; a cache whose caller announces nothing keeps the fixed threshold and pays no scratch rows
        for it. ``lookahead`` (``decode.lookahead``): decode steps prefetch the next MoE layer's predicted misses
        (``lookahead.py``: its rows come out of the budget; ``lookahead.attach_routers`` gives it the routers).
        ``miss_copy`` (``decode.miss_copy``): "copy_engine" copies a captured step's routed misses with the copy
        engine (``graph_copy.py``). ``overlap_misses_from`` (``decode.overlap_misses_from``): decode steps of at least
        that many tokens copy their misses beside the compute of the pairs read from slots (``decode_plan_split``)."""
        if isinstance(decode_max_tokens, bool) or not isinstance(decode_max_tokens, int) or decode_max_tokens < 1:
            raise ValueError(f"decode_max_tokens={decode_max_tokens!r}: an integer >= 1 (decode.max_tokens)")
        if miss_copy not in ("uva", "copy_engine"):
            raise ValueError(f"miss_copy={miss_copy!r}: uva or copy_engine (decode.miss_copy)")
        if decode_path not in ("host", "routed", "auto", "fills"):
            raise ValueError(f"decode_path={decode_path!r}: host, routed, auto or fills (decode.path)")
        if isinstance(overlap_misses_from, bool) or not isinstance(overlap_misses_from, int) or overlap_misses_from < 0:
            raise ValueError(f"overlap_misses_from={overlap_misses_from!r}: an integer >= 0 "
                             "(decode.overlap_misses_from)")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.store, self.device = store, device
        self.cache_cfg, self.prefill_cfg = cache_cfg, prefill_cfg
        self.counters = CacheStats()
        tp = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        link = None
        if cost_model is None:  # this host's link rates in place of the table's (prefill.measure_link)
            cost_model, link = link_model(store, prefill_cfg, device, fused_decode, tp)
        path_setting = decode_path
        decode_path, path_why = resolve_decode_path(path_setting, link)
        log.info_rank0("decode_path_chosen", path=decode_path, reason=path_why, setting=path_setting,
                       change_with="decode.path")
        self.plan, self.routed_path = plan_cache(store, cache_cfg, prefill_cfg, device, decode_max_tokens,
                                                 fused_decode, decode_path, cost_model, tp, observe_routing,
                                                 lookahead_rows(decode_max_tokens, store) if lookahead else 0,
                                                 decode_path_floor(path_setting, link))
        self._fill_model = None  # decode.path fills: the cost model that weighs a staged step's two forms
        if decode_path == "fills" and self.routed_path.reason == "cost_model":
            self._fill_model = (cost_model or prefill_cost_model(torch.cuda.get_device_name(device), store.num_experts,
                                                                 store.geometry.top_k, store.bytes_per_expert))[0]
        copy, why = routed_copy(prefill_cfg.routed_copy, device, link)
        self.routed_path = replace(self.routed_path, link=link, routed_copy=copy, routed_copy_reason=why,
                                   decode_path_reason=path_why)
        log.info_rank0("prefill_routed_copy_chosen", copy=copy, reason=why, setting=prefill_cfg.routed_copy,
                       change_with="prefill.routed_copy")
        scratch = self.plan.scratch_rows
        self.streams = Streams(device)
        pool = decode = None
        try:
            pool = SlotPool(store, self.plan.num_slots, cache_cfg.policy, device, self.counters, scratch,
                            lead_rows=2 * store.num_experts)  # the two staging buffers (staging.py)
            decode = DecodeResidency(store, pool, self.streams, self.counters, self.routed_path.record_tokens,
                                     cache_cfg.admit_per_step, decode_max_tokens if lookahead else 0,
                                     cache_cfg.admit_filter, miss_copy, overlap_misses_from)
            staging = PrefillStaging(store, pool, self.streams, self.counters, self._hit_failed)
        except (torch.OutOfMemoryError, torch.AcceleratorError) as exc:  # a start-up error naming the setting
            if not is_device_oom(exc):
                raise
            if decode is not None:
                decode.close()  # its routing record is registered host memory
            pool = decode = None
            message = oom_message(cache_cfg.budget, self.plan, store.bytes_per_expert, device, exc)
        else:
            message = None
        if message is not None:  # raised outside the except block: the OOM (its frames hold the partial
            raise BudgetError(message)  # allocations) is not kept alive as the error's context
        self.pool, self.decode, self.staging = pool, decode, staging
        self.observed = self._observed_routing(decode_max_tokens, cost_model)
        self.staging.hit, self.staging.h2d = FullLayerCopy(), H2DRows()
        self.staging.read_in_place = prefill_cfg.read_in_place
        self._resolution = None
        self.pad_src_N = None  # a padded prefill's row map for the routed ids (prefill_graph.py) while it runs
        self.prefill_split = None  # the piecewise capture under way (prefill_graph.Segments) while it runs
        self._pass_open = False  # a pass announced by prefill_pass() whose first layer is not staged yet
        self._routed_fills = False  # a forward whose experts calls stage only their routed misses (routed_fills)
        self._closed = False
        self._finalizer = weakref.finalize(self, _close_streams, self.streams)
        log.info_rank0("cache_ready", device=str(device), slots=self.num_slots, slot_bytes=self.plan.slot_bytes,
                       staging_bytes=self.plan.staging_bytes, bytes_per_expert=store.bytes_per_expert,
                       resident_capacity=round(self.num_slots / (len(store.layers) * self.E), 4))

    # ------------------------------------------------------------------ facts
    @property
    def E(self) -> int:
        return self.store.num_experts

    @property
    def num_slots(self) -> int:
        return self.plan.num_slots

    @property
    def routed_max_tokens(self) -> int:
        """Forwards of at most this many tokens take the routed-only (decode) path; longer ones stage unless
        observed routing routes them (``takes_routed_path``)."""
        return self.routed_path.max_tokens

    def _observed_routing(self, decode_max_tokens: int, cost_model):
        rp = self.routed_path
        if not rp.adaptive_max_tokens:
            return None
        from moe_offload.observed_routing import ObservedRouting
        from moe_offload.prefill_path import AdaptiveRouting, resident_fraction
        from moe_offload.prefill_path import cost_model as table_model

        E, K, R = self.E, self.store.geometry.top_k, self.store.bytes_per_expert
        model = (cost_model or table_model(torch.cuda.get_device_name(self.device), E, K, R))[0]
        resident = resident_fraction(self.num_slots, len(self.store.layers), E)  # the final plan's (scratch rows taken)
        adaptive = AdaptiveRouting(model, E, K, R, resident, rp.max_tokens, rp.adaptive_max_tokens)
        return ObservedRouting(adaptive, self.layers, E, decode_max_tokens, self.device, self.streams)

    # ------------------------------------------------------------------ the path of a forward
    def begin_forward(self, tokens: int, sequences: int) -> bool:
        """An engine's forward of ``tokens`` tokens over ``sequences`` sequences starts -> whether it takes
        the routed path (``observed_routing.py``); ``end_forward`` must follow."""
        if self.observed is None:
            return tokens <= self.routed_max_tokens
        return self.observed.begin(tokens, sequences)

    def end_forward(self, ok: bool = True) -> None:
        if self.observed is not None:
            self.observed.end(ok)

    def takes_routed_path(self, tokens: int) -> bool:
        """Whether an experts call of ``tokens`` tokens reads only its routed experts (else it is staged; a
        routed-fill forward stages only its routed misses)."""
        if self._routed_fills:
            return False
        if self.observed is None:
            return tokens <= self.routed_max_tokens
        return self.observed.routed(tokens)

    def forget_observations(self) -> None:
        """Drop the observed routing spreads (e.g. after a warmup on random ids)."""
        if self.observed is not None:
            self.observed.adaptive.forget()

    def observe_routing(self, layer: int, ids_TK: torch.Tensor) -> None:
        """An experts call's routed ids, for the observed spread (a no-op unless the forward is observed)."""
        if self.observed is not None:
            self.observed.layer(layer, ids_TK)

    @property
    def hit_path(self) -> str:
        """The prefill hit path in use: ``gather``, ``batch_memcpy`` or ``full_layer_copy``."""
        return self.staging.hit.name

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.store.layers)

    def resident(self, layer: int) -> np.ndarray:
        """Slot of each expert of ``layer`` (-1 = not resident), a host array [E]."""
        return self.pool.resident(layer)

    def residency_map(self) -> np.ndarray:
        """``[L, E]`` bool, which experts are resident (a copy)."""
        return self.pool.residency_map()

    def holds_every_expert(self) -> bool:
        """Whether every expert of every layer is resident (host map; no sync)."""
        return bool((self.pool.slot_of_LE >= 0).all())

    def pool_views(self) -> dict[str, torch.Tensor]:
        """Typed per-bank views ``[S, ...]`` of the slot pool (rows read in place)."""
        return self.pool.views()

    # ------------------------------------------------------------------ hit path
    def resolve_hit_path(self) -> None:
        """Decide how prefill hits are copied (once; the warmup calls it under load)."""
        if self._resolution is not None:
            return
        cfg = self.prefill_cfg
        res = resolve_hit_copy(cfg.hit_copy, cfg.hit_copy_on_unavailable, cfg.overlap, self.num_slots, self.device,
                               self.store.bytes_per_expert, self.streams.copy)
        self._resolution = res
        res.h2d.on_batch_failure = self._h2d_batch_failed
        self.staging.hit, self.staging.h2d = res.hit, res.h2d
        self.decode.h2d = res.h2d

    def _h2d_batch_failed(self, exc: Exception) -> None:
        """The batched H2D call failed mid-run (``H2DRows`` copies per run from now on): counted now, and
        per prefill pass from now on like a batch path declined at start-up."""
        self._resolution.batch_h2d_reason = "call_failed"
        self.counters.declined["batch_h2d:call_failed"] += 1

    def _hit_failed(self, exc: Exception):
        """A hit copy raised mid-run: full-layer copies for the rest of the process (or fail)."""
        reason, detail = "call_failed", f"{type(exc).__name__}: {exc}"
        if self.prefill_cfg.hit_copy_on_unavailable == "error":
            from moe_offload.hit_copy import HitPathUnavailable

            raise HitPathUnavailable(reason, detail) from exc
        self._resolution.decline = (reason, detail)
        if self.staging.hit.name == "batch_memcpy":  # the binding failed: PCIe misses per run from now on
            self._resolution.h2d = self.staging.h2d = self.decode.h2d = H2DRows(stream=self.streams.copy)
        log_hit_fallback(reason, detail)
        self.counters.fallback(reason)  # this pass; later passes are counted in begin
        return FullLayerCopy()

    # ------------------------------------------------------------------ prefill
    def routed_fills_for(self, tokens: int, rows: int | None = None) -> bool:
        """Whether a prefill of ``tokens`` tokens (``rows`` rows once padded) that reads only its routed experts gets
        the missing ones over the copy engine, one host sync a layer (routed fills, ``staging.py``), instead of SM
        reads in a graph (``prefill.routed_copy`` resolved): never while every expert is resident (nothing to copy);
        per prompt, ``link_rates.routed_fills_pay`` with the layer's routed misses: as earlier fills of as many rows
        found them (the host learns each fill's routing), else expected (the observed routing's spread for this
        length where learned, else uniform routing, which overestimates a skewed router's misses: a wrong first
        choice corrects itself after one forward)."""
        copy = self.routed_path.routed_copy
        if copy == "uva" or self.holds_every_expert():
            return False
        if copy == "copy_engine":
            return True
        from moe_offload.link_rates import routed_fills_pay
        from moe_offload.prefill_path import distinct, resident_fraction

        missing = self.staging.missing_seen(rows if rows is not None else tokens)
        if missing is None:
            E = self.E
            share = self.observed.adaptive.share(tokens) if self.observed is not None else None
            routed = distinct(tokens * (share or 1.0), E, self.store.geometry.top_k)
            missing = (1.0 - resident_fraction(self.num_slots, len(self.store.layers), E)) * routed
        return routed_fills_pay(self.routed_path.link, missing, self.store.bytes_per_expert)

    def decode_fills_for(self, tokens: int) -> bool:
        """Whether a decode step of ``tokens`` rows on the staged path (above the routed threshold) stages only its
        routed misses, one host sync a layer (routed fills, ``staging.py``), rather than whole missing layers:
        ``decode.path: fills`` only, never while every expert is resident; by the cost model
        (``CostModel.fill_s`` against ``staged_s``) with the misses earlier fills of as many rows found, else uniform
        routing's."""
        model = self._fill_model
        if model is None or self.holds_every_expert():
            return False
        from moe_offload.link_rates import ROUTED_FILL_FIXED_S
        from moe_offload.prefill_path import resident_fraction

        E, K, R = self.E, self.store.geometry.top_k, self.store.bytes_per_expert
        resident = resident_fraction(self.num_slots, len(self.store.layers), E)
        missing = self.staging.missing_seen(tokens)
        return (model.fill_s(tokens, E, K, R, resident, ROUTED_FILL_FIXED_S, missing)
                < model.staged_s(tokens, E, K, R, resident))

    @contextlib.contextmanager
    def routed_fill_forward(self):
        """Experts calls inside take the staged path, whatever their token count (a routed-fill forward being
        captured piecewise: its experts calls split the capture, ``prefill_graph.py``)."""
        saved, self._routed_fills = self._routed_fills, True
        try:
            yield self
        finally:
            self._routed_fills = saved

    @contextlib.contextmanager
    def prefill_pass(self, routed_fills: bool = False):
        """One prefill pass (one model forward on the prefill path): the first layer's copy starts now,
        overlapping whatever the caller runs before the first MoE layer. On an exception the compute
        stream is joined behind every copy in flight (no host sync). ``routed_fills``: every experts call of the
        pass stages only the missing experts its tokens routed, just in time (``staging.py``): nothing is copied
        ahead."""
        self._check_open("prefill_pass")
        self.staging.routed_fills = routed_fills
        with self.routed_fill_forward() if routed_fills else contextlib.nullcontext():
            self._begin()
            self._pass_open = True
            try:
                yield self
            except BaseException:
                self.streams.current_joins_copies()
                self.staging.computing = None
                raise
            finally:
                self._pass_open = False
                self.staging.routed_fills = False

    def _begin(self) -> None:
        self.resolve_hit_path()
        # decode admissions enqueued at the last step boundary enter the map now (their copies were issued
        # a step ago): left pending until the next decode step, their slots were neither resident nor free
        # for this prefill (after a request ended, up to cache.admit_per_step slots sat out every prefill
        # until the next request decoded)
        self.decode.commit_pending()
        self.counters.prefills += 1
        self.staging.begin()
        res = self._resolution
        if res.decline is not None:
            self.counters.fallback(res.decline[0])
        if self.device.type == "cuda" and res.batch_h2d_reason is not None:
            self.counters.declined[f"batch_h2d:{res.batch_h2d_reason}"] += 1
        if self.prefill_cfg.overlap and not self.staging.routed_fills:  # both buffers: layers 0 and 1 (later ones
            # are refilled at release, ``done``); a routed-fill pass copies each layer once its routing is known
            b0 = self.staging.prefetch(self.store.layers[0])
            if len(self.store.layers) > 1:  # into the other buffer: a reusable fill of layer 0 is kept
                self.staging.prefetch(self.store.layers[1], into=1 - b0)

    def stage(self, layer: int) -> dict[str, torch.Tensor]:
        """Views ``[E, ...]`` of ``layer`` (``stage_rows``; a layer read in place is gathered from its slots
        into new tensors: for callers that want the bank itself, not the compute path)."""
        views, index_N = self.stage_rows(layer)
        if index_N is None:
            return views
        return {k: v.index_select(0, index_N.long()) for k, v in views.items()}

    def stage_rows(self, layer: int, ids_TK: torch.Tensor | None = None
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """``(views, index_N)`` of ``layer`` for compute (the compute stream waits for them): its staged
        views ``[E, ...]`` and None, or, when every expert of it is resident and ``prefill.read_in_place``
        is on, the pool's views and the layer's device slot table row (``staging.py``). The next layer's
        assembly is enqueued behind it. The first MoE layer of a forward outside ``prefill_pass()`` begins
        a pass itself. ``ids_TK``: the call's routed ids, which a routed-fill pass stages by (HOST SYNC there)."""
        self._check_open("stage_rows")
        self.pool.check_layer(layer, "stage_rows")
        if layer == self.store.layers[0]:
            if self._pass_open:
                self._pass_open = False
            else:
                self._begin()
        return self.staging.wait(layer, ids_TK)

    def done(self, layer: int) -> None:
        """``layer``'s GEMMs are enqueued: admission into free slots, then its buffer is released and (with
        ``prefill.overlap``) refilled at once with the layer two ahead. Issued here, at the earliest point
        its copies may be enqueued (they wait for the release on the device), rather than when the host
        reaches the next experts call: a host held back by a long launch queue (the linear-attention layers
        of qwen3_next) no longer delays the copy engine (README "Decisions", prefetch at release)."""
        refill = None
        if self.prefill_cfg.overlap and not self.staging.routed_fills:
            lp = self.pool.layer_pos[layer] + 2
            refill = self.store.layers[lp] if lp < len(self.store.layers) else None
        self.staging.done(layer, refill)

    # ------------------------------------------------------------------ decode
    def decode_rows(self, layer: int, ids_TK: torch.Tensor, hidden_TH: torch.Tensor | None = None) -> torch.Tensor:
        """Pool row ``[T, K]`` int32 of each routed pair: its slot, a lookahead row, or a scratch row its expert
        was just copied into from mapped host memory. No host sync (``decode_path.py``). ``hidden_TH``: the
        layer's MoE input, from which the lookahead (when on) predicts the next MoE layer."""
        self._check_open("decode_rows")
        return self.decode.rows(layer, ids_TK, hidden_TH)

    def decode_plan(self, layer: int, ids_TK: torch.Tensor, hidden_TH: torch.Tensor | None = None,
                    align_block_m: int | None = None):
        """``(rows_TK, alignment)``: ``decode_rows``, and with ``align_block_m`` the rows grouped in blocks of that many
        pairs for the decode tile kernels, made in the miss plan's launch (None where that does not apply: the
        compute aligns them itself)."""
        self._check_open("decode_plan")
        return self.decode.plan(layer, ids_TK, hidden_TH, align_block_m)

    def decode_splits(self, T: int) -> bool:
        """Whether a decode-path forward of T tokens may copy its misses beside the compute (``decode_plan_split``)."""
        return self.decode.splits(T)

    def decode_plan_split(self, layer: int, ids_TK: torch.Tensor):
        """``(rows_TK, scratch_base, join)``: the rows of ``decode_rows`` with the misses' copy forked onto a side
        stream; ``join()`` orders the compute stream after it (``decode_path.DecodeResidency.plan_split``)."""
        self._check_open("decode_plan_split")
        return self.decode.plan_split(layer, ids_TK)

    def decode_routes(self, T: int, K: int, E: int) -> bool:
        """Whether ``decode_route`` serves a decode-path forward of T tokens at top-K over E router outputs."""
        return self.decode.routes(T, K, E)

    def decode_route(self, layer: int, logits_TE: torch.Tensor, top_k: int, renorm: bool, w_dtype: torch.dtype,
                     align_block_m: int | None = None):
        """``(w_TK, ids_TK, rows_TK, alignment)``: the router's softmax + top-k (+ renormalisation) and
        ``decode_plan`` of its ids in one launch (``decode_path.DecodeResidency.route``)."""
        self._check_open("decode_route")
        return self.decode.route(layer, logits_TE, top_k, renorm, w_dtype, align_block_m)

    def decode_views(self) -> dict[str, torch.Tensor]:
        """Bank views ``[S + X, ...]`` of the pool (slots and scratch rows) that ``decode_rows`` index."""
        return self.pool.views()

    @property
    def decode_num_rows(self) -> int:
        return int(self.pool.rows_NR.shape[0])

    def decode_step_enqueued(self, tokens: int | None = None) -> None:
        """Every layer of a decode step is enqueued (its routing record completes with it); a graph
        replayer passes the step's token count."""
        self.decode.step_enqueued(tokens)

    @contextlib.contextmanager
    def read_late(self, on: bool = True):
        """Context: while decode steps are enqueued before the host read the last one (``decode.run_ahead``),
        boundaries admit from the step before the one in flight and never wait for it (``decode_path.py``,
        "read late"); afterwards the next boundary reads the last step as usual."""
        self.decode.set_late(on)
        try:
            yield
        finally:
            self.decode.set_late(False)

    def step_boundary(self) -> None:
        """Between decode steps (never inside a captured step): commit and schedule admissions. Its host time is
        counted (``stats()["decode_boundary_s"]``): the GPU waits for it before the next step."""
        t0 = time.perf_counter()
        try:
            self.resolve_hit_path()
            self.decode.boundary()
        finally:
            self.counters.decode_boundary_s += time.perf_counter() - t0

    # ------------------------------------------------------------------ residency for tests/benchmarks
    def set_residency(self, experts_per_layer: dict[int, list[int]]) -> None:
        """Make exactly these experts resident (deterministic residency for benchmarks and tests).
        Copies host -> slots and waits for them (HOST SYNC: not a hot path). Every layer and expert id is checked
        before anything changes: a bad one raises ``ValueError`` with the residency as it was."""
        self._check_open("set_residency")
        for layer, experts in experts_per_layer.items():
            self.pool.check_experts(layer, experts, "set_residency")
        need = sum(len(v) for v in experts_per_layer.values())
        if need > self.num_slots:
            raise BudgetError(f"set_residency wants {need} resident experts but the pool has {self.num_slots} slots")
        s = self.streams
        self.synchronize()
        self.decode.drop_pending()
        self.resolve_hit_path()
        self.staging.forget()  # the next pass starts cold: nothing reused from staging
        with s.on(s.copy):
            self.pool.clear()
            for layer, experts in experts_per_layer.items():
                ids = np.asarray(sorted(experts), dtype=np.int64)
                rows = self.store.rows(layer)

                def copy(slots: list[int], ids=ids, rows=rows) -> None:
                    self.staging.h2d.copy([RowCopy(self.pool.rows_SR, rows, np.asarray(slots, dtype=np.int64), ids)],
                                          coalesce=False)

                self.pool.admit(layer, ids, copy, free_only=True)
        self.synchronize()

    # ------------------------------------------------------------------ lifecycle and stats
    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"{what} on a closed OffloadMoeCache (close() freed its slots); build a new cache")

    def synchronize(self) -> None:
        """HOST SYNC: every copy and the compute queued so far are done."""
        self.streams.synchronize()

    def close(self) -> None:
        """Synchronize the streams, then drop the pool and staging memory (idempotent). The store's
        pinned rows may be unpinned after this: no copy still reads them."""
        if self._closed:
            return
        self._finalizer()
        self._closed = True
        self.decode.close()
        empty = torch.empty((0, self.store.bytes_per_expert), dtype=torch.uint8, device=self.device)
        self.pool.rows_NR = self.pool.rows_SR = self.pool.backing = empty  # the backing holds slots and staging
        self.staging.rows = [empty, empty]

    def stats(self) -> dict:
        """Counters since the last ``reset`` (HOST SYNC: reads the decode step's device counters)."""
        lookahead = self.decode.account()
        snap = self.counters.snapshot()
        if lookahead is not None:
            snap["lookahead"] = lookahead
        snap["hit_path"] = self.hit_path if self._resolution is not None else FULL_LAYER_COPY
        snap["slots"] = self.num_slots
        snap["resident_experts"] = self.pool.resident_count
        snap["routed_path"] = self.routed_path.to_dict()
        declined = (self.routed_path.link or {}).get("declined")
        if declined:  # a start-up decline: counted once, whatever was reset since
            snap["declined"][f"link_measure:{declined}"] = 1
        if self.observed is not None:
            snap["routed_adaptive"] = self.observed.adaptive.to_dict()
        return snap

    @property
    def pinned_bytes(self) -> int:
        """Host bytes this cache holds registered (pinned): the decode routing record. The experts' banks
        belong to the store (``ExpertStore.pinned_bytes``)."""
        return self.decode.pinned_bytes

    @property
    def decode_steps(self) -> int:
        return self.counters.decode_steps

    def reset(self) -> None:
        """Zero the counters (residency and observed routing spreads are kept)."""
        self.counters.reset()
        if self.observed is not None:
            self.observed.adaptive.reset_counts()
        self.decode.reset_counts()


def _close_streams(streams: Streams) -> None:
    try:
        streams.synchronize()
    except Exception as exc:  # a sticky CUDA error at teardown: report it, unpinning still must happen
        log.event("cache_close_sync_failed", logging.ERROR, detail=f"{type(exc).__name__}: {exc}")
