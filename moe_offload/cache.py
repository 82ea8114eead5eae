"""OffloadMoeCache: the facade over the parts that keep experts on the device.

- ``budget.py``: how many slots the budget buys (``plan``);
- ``slot_pool.py``: the slot pool and the residency map (host and device copies), admission;
- ``staging.py``: the prefill pass (two staging buffers, events, admission into free slots);
- ``hit_copy.py``: how prefill hits reach staging (resolved once per cache, declines logged + counted);
- ``streams.py``: the copy and hit streams and the CPU no-op;
- ``decode_path.py``: the decode step's rows; ``decode_boundary.py``: admission at step boundaries (``decode_*``,
  ``step_boundary``).

The facade's methods live in three modules: this one (construction, facts, decode, residency for tests and
benchmarks, lifecycle and stats), ``forward_paths.py`` (which path each forward takes: routed, staged or routed
fills) and ``prefill_protocol.py`` (``prefill_pass`` / ``stage_rows`` / ``done``, and the hit path they copy with).

Legend: T tokens, K top-k, E experts per layer, S slots, R bytes of one expert row.

``close()`` synchronizes the streams before memory goes.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref

import numpy as np
import torch

from moe_offload import log
from moe_offload.budget import BudgetError, BudgetPlan, is_device_oom, oom_message, plan_budget
from moe_offload.config import CacheConfig, PrefillConfig
from moe_offload.copy_paths import RowCopy
from moe_offload.decode_path import DecodeResidency
from moe_offload.fill_plan import RoutedPlanBuffers
from moe_offload.forward_paths import ForwardPaths
from moe_offload.hit_copy import FULL_LAYER_COPY, FullLayerCopy, H2DRows
from moe_offload.prefill_protocol import PrefillProtocol
from moe_offload.slot_pool import SlotPool
from moe_offload.staging import PrefillStaging
from moe_offload.stats import CacheStats
from moe_offload.streams import Streams

__all__ = ["OffloadMoeCache", "BudgetError", "BudgetPlan", "plan_budget"]


class OffloadMoeCache(ForwardPaths, PrefillProtocol):
    """Device-resident subset of the experts in ``store`` and the copy machinery around it (the path each
    forward takes: ``forward_paths.ForwardPaths``; the prefill protocol: ``prefill_protocol.PrefillProtocol``)."""

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
        # sets plan, routed_path and the fill model (forward_paths.py); a measured cost model replaces None
        cost_model = self._resolve_paths(decode_max_tokens, fused_decode, decode_path, cost_model, observe_routing,
                                         lookahead)
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
        if prefill_cfg.routed_plan in ("device", "graph"):
            graph = prefill_cfg.routed_plan == "graph"
            self.staging.plan, self.staging.plan_declined = RoutedPlanBuffers.make(self.E, device, mapped=graph)
            self.staging.plan_in_graph = graph
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
        boundaries admit from the step before the one in flight and never wait for it (``decode_boundary.py``,
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
        if self.staging.plan is not None:
            self.staging.plan.close()
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
        snap["routed_path"] = {**self.routed_path.to_dict(), "routed_plan": self.staging.plan_in_effect(),
                               "miss_copy": self.decode.miss_copy_in_effect()}
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
