"""OffloadMoeCache: the device slot pool, the residency map, the decode path and the prefill
staging pipeline. Policy (which slot to evict) lives in ``policy.py``; copy mechanisms in
``copy_paths.py``. This class owns memory, streams and events.

Legend: L MoE layers (``lp`` = position of a layer in ``store.layers``), E experts per layer,
S slots, B bytes of one expert (all banks), T tokens, K top-k.

Device memory: one slot pool ``[S, B]`` plus two staging buffers ``[E, B]`` (prefill double
buffering), raw bytes laid out like the host store's rows (all banks of an expert side by side), so
every copy moves whole expert rows: one entry per hit, one per run of misses. A fraction or slot-count budget sizes the pool and
the staging comes on top; a byte budget (and ``auto``) includes the staging.

Streams: PCIe copies run on ``copy_stream``; prefill hit copies (device-side) on ``hit_stream``;
compute runs on the caller's current stream. Ordering is by events only: ``ready[b]`` (misses of
staging b landed), ``hits_ready[b]`` (its hits copied), ``release[b]`` (the GEMMs and the admission
copy reading staging b are enqueued), ``decode_done`` (a decode miss copy landed). Prefill
admission (staging -> free slots) runs on the compute stream. The hit copy has its own stream
because an SM gather queued on the copy stream waits for SMs held by the compute stream's GEMMs
and holds the next layer's PCIe copy behind it (H200, 49415ec: +0.5 ms per layer at residency 0.5).
On the CPU there are no streams and every copy completes before the call returns.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from moe_offload import log
from moe_offload.config import Budget, CacheConfig, PrefillConfig, parse_bytes
from moe_offload.copy_paths import (
    HitPathUnavailable, RowCopy, copy_rows_torch, index_tensor, log_hit_fallback, pointer_arrays, versions,
)
from moe_offload.host_store import ExpertStore, bank_views
from moe_offload.policy import make_policy
from moe_offload.stats import CacheStats


class BudgetError(ValueError):
    pass


@dataclass(frozen=True)
class BudgetPlan:
    num_slots: int
    slot_bytes: int
    staging_bytes: int
    min_bytes: int
    min_fraction: float

    @property
    def total_bytes(self) -> int:
        return self.slot_bytes + self.staging_bytes


def plan_budget(store: ExpertStore, budget: Budget, device: torch.device, auto_reserve: str = "8GiB") -> BudgetPlan:
    """Turn a budget into a slot count; raises ``BudgetError`` stating the minimum."""
    B, E, L, K = store.bytes_per_expert, store.num_experts, len(store.layers), store.geometry.top_k
    all_experts = L * E
    staging = 2 * E * B
    min_slots = K
    min_bytes = staging + min_slots * B
    min_fraction = min_slots / all_experts
    if budget.kind == "fraction":
        slots = math.floor(budget.value * all_experts)
    elif budget.kind == "slots":
        slots = int(budget.value)
    elif budget.kind == "bytes":
        slots = (int(budget.value) - staging) // B
    else:  # auto
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            avail = free - parse_bytes(auto_reserve)
        else:
            avail = staging + all_experts * B  # host memory is the device: hold everything
        slots = min(all_experts, max(0, (avail - staging) // B))
    slots = min(slots, all_experts)
    if slots < min_slots:
        raise BudgetError(
            f"cache.budget {budget.kind}={budget.value:g} gives {max(slots, 0)} slots, below the minimum of {min_slots} "
            f"(one layer's routed experts, top-k) plus two staging layers: at least {min_bytes} bytes "
            f"({min_bytes / 2**30:.3f} GiB) or a fraction of experts of {min_fraction:.4f}; raise cache.budget"
        )
    return BudgetPlan(slots, slots * B, staging, min_bytes, min_fraction)


class OffloadMoeCache:
    """Device-resident subset of the experts in ``store`` and the copy machinery around it."""

    def __init__(self, store: ExpertStore, cache_cfg: CacheConfig, prefill_cfg: PrefillConfig, device: torch.device | str):
        self.store = store
        self.cfg, self.prefill_cfg = cache_cfg, prefill_cfg
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.is_cuda = self.device.type == "cuda"
        self.plan = plan_budget(store, cache_cfg.budget, self.device, cache_cfg.auto_reserve)
        self.num_slots = self.plan.num_slots
        self.layer_pos = {layer: i for i, layer in enumerate(store.layers)}
        self.E = store.num_experts
        S = self.num_slots
        B = store.bytes_per_expert
        self.pool_rows = torch.empty((S, B), dtype=torch.uint8, device=self.device)
        self.staging_rows = [torch.empty((self.E, B), dtype=torch.uint8, device=self.device) for _ in range(2)]
        self.slot_of = np.full((len(store.layers), self.E), -1, dtype=np.int32)
        self.owner = np.full(S, -1, dtype=np.int64)  # lp * E + e
        self.policy = make_policy(cache_cfg.policy, S)
        self.stats_ = CacheStats()
        self.copy_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.hit_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        ev = (lambda: torch.cuda.Event()) if self.is_cuda else (lambda: None)
        self.ready = [ev(), ev()]
        self.hits_ready = [ev(), ev()]
        self._hits_pending = [False, False]
        self.release = [ev(), ev()]
        self.decode_done = ev()
        self.staged_layer: list[int | None] = [None, None]
        self._computing: int | None = None  # staging buffer the current layer reads
        self.begun_early = False  # begin_prefill(early=True) ran for the pass about to start
        self._last_filled = 1
        self._batch = None  # resolved cudaMemcpyBatchAsync binding, or None
        self._hit_mode: str | None = None  # "batch_memcpy" | "gather" | None (full-layer copies)
        self._resolved = False
        self._decline_reason: str | None = None
        self._batch_reason: str | None = None  # why batched H2D copies are off (CUDA only)
        log.info_rank0("cache_ready", device=str(self.device), slots=S, slot_bytes=self.plan.slot_bytes,
                       staging_bytes=self.plan.staging_bytes, bytes_per_expert=store.bytes_per_expert,
                       resident_capacity=round(S / (len(store.layers) * self.E), 4))

    # ------------------------------------------------------------------ residency
    def resident(self, layer: int) -> np.ndarray:
        """Slot of each expert of ``layer`` (-1 = not resident), a host array [E]."""
        return self.slot_of[self.layer_pos[layer]]

    def _evict(self, slot: int) -> None:
        key = int(self.owner[slot])
        if key >= 0:
            lp, e = divmod(key, self.E)
            self.slot_of[lp, e] = -1
            self.stats_.layer(self.store.layers[lp]).evictions += 1
        self.owner[slot] = -1

    def _assign(self, layer: int, experts: np.ndarray, slots: list[int]) -> None:
        lp = self.layer_pos[layer]
        for e, s in zip(experts.tolist(), slots):
            self._evict(s)
            self.slot_of[lp, e] = s
            self.owner[s] = lp * self.E + e

    def _h2d_rows(self, copies: list[RowCopy], coalesce: bool) -> None:
        """Host -> device rows: large rows in one batched call, small rows per coalesced run
        (small entries in a batch made the host wait for the whole copy on the H200)."""
        if self._batch is None:
            copy_rows_torch(copies, coalesce)
            return
        large = [c for c in copies if c.dst.shape[1] >= self._h2d_batch_min]
        dst, src, size = pointer_arrays(large, coalesce)
        if size.size:
            self._batch.copy(dst, src, size, self.copy_stream)
        copy_rows_torch([c for c in copies if c.dst.shape[1] < self._h2d_batch_min], coalesce)

    def _host_rows(self, layer: int, experts: np.ndarray, slots) -> RowCopy:
        return RowCopy(self.pool_rows, self.store.rows(layer), np.asarray(slots, dtype=np.int64), experts)

    def set_residency(self, experts_per_layer: dict[int, list[int]]) -> None:
        """Make exactly these experts resident (deterministic residency for benchmarks and tests).

        Copies host -> slots and waits for them (not a hot path)."""
        need = sum(len(v) for v in experts_per_layer.values())
        if need > self.num_slots:
            raise BudgetError(f"set_residency wants {need} resident experts but the pool has {self.num_slots} slots")
        self._join_copy_stream()
        self.staged_layer = [None, None]  # the next pass starts cold: nothing reused from staging
        for s in range(self.num_slots):
            self._evict(s)
            self.policy.free(s)
        with self._on_copy_stream():
            for layer, experts in experts_per_layer.items():
                ids = np.asarray(sorted(experts), dtype=np.int64)
                slots = self.policy.choose(ids.size, set())
                self._assign(layer, ids, slots)
                self._h2d_rows([self._host_rows(layer, ids, slots)], coalesce=False)
        self.synchronize()

    # ------------------------------------------------------------------ streams
    def _on_copy_stream(self):
        return self._on(self.copy_stream)

    def _on(self, stream):
        return torch.cuda.stream(stream) if self.is_cuda else _Null()

    def _join_copy_stream(self) -> None:
        """Copy and hit streams wait for everything already queued on the current (compute) stream."""
        if self.is_cuda:
            cur = torch.cuda.current_stream(self.device)
            self.copy_stream.wait_stream(cur)
            self.hit_stream.wait_stream(cur)

    def synchronize(self) -> None:
        if self.is_cuda:
            self.copy_stream.synchronize()
            self.hit_stream.synchronize()
            torch.cuda.current_stream(self.device).synchronize()

    # ------------------------------------------------------------------ decode
    def ensure(self, layer: int, topk_ids_TK: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Make every expert routed in ``topk_ids_TK`` resident; return host arrays
        ``(experts, slots, ids_TK)``: the distinct routed experts (sorted), their slots, the routed ids.

        Misses are copied host -> victim slots on the copy stream, which first joins the compute
        stream (no slot still read by queued compute is overwritten); compute waits on
        ``decode_done`` before reading. Victims never include a slot used by this step.
        """
        # HOST SYNC: the routed ids must be known on the host to pick victims and issue copies.
        ids_TK = topk_ids_TK.to("cpu", non_blocking=False).numpy()
        experts = np.unique(ids_TK)
        lp = self.layer_pos[layer]
        slots = self.slot_of[lp, experts]
        hit = slots >= 0
        counters = self.stats_.layer(layer)
        counters.hits += int(hit.sum())
        miss_e = experts[~hit]
        counters.misses += int(miss_e.size)
        protected = set(slots[hit].tolist())
        self.policy.touch(slots[hit].tolist())
        if miss_e.size:
            victims = self.policy.choose(int(miss_e.size), protected)
            self._join_copy_stream()
            with self._on_copy_stream():
                self._assign(layer, miss_e, victims)
                self._h2d_rows([self._host_rows(layer, miss_e, victims)], coalesce=False)
                if self.is_cuda:
                    self.decode_done.record(self.copy_stream)
            counters.bytes["decode_h2d"] += int(miss_e.size) * self.store.bytes_per_expert
            slots = self.slot_of[lp, experts]
        if self.is_cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(self.decode_done)
        return experts, slots.astype(np.int64), ids_TK

    @property
    def pool(self) -> dict[str, torch.Tensor]:
        """Per-bank column views ``[S, bank_bytes]`` of the slot pool."""
        return {n: self.pool_rows[:, o:o + b] for n, (o, b) in self.store.offsets.items()}


    # ------------------------------------------------------------------ prefill
    def begin_prefill(self, first_layer: int | None = None, early: bool = False) -> None:
        """Start a prefill pass: fence the copy stream behind queued compute, resolve the hit path
        (first call; under load when it is the warmup), prefetch the first layer if overlapping.

        ``early``: called by the engine before the model's forward (the first layer's PCIe copy then
        overlaps the embedding and the first attention); the first experts call does not begin again."""
        self.begun_early = early
        self.stats_.prefills += 1
        self._join_copy_stream()
        if not self._resolved:
            self.resolve_hit_path()
        if self._decline_reason is not None:
            self.stats_.fallback(self._decline_reason)
        if self.is_cuda and self._batch is None and self._batch_reason is not None:
            self.stats_.declined[f"batch_h2d:{self._batch_reason}"] += 1
        if self.prefill_cfg.overlap:
            self.prefetch_layer(self.store.layers[0] if first_layer is None else first_layer)

    def next_layer(self, layer: int) -> int | None:
        lp = self.layer_pos[layer] + 1
        return self.store.layers[lp] if lp < len(self.store.layers) else None

    def _buffer_for(self, layer: int) -> int | None:
        for b in (0, 1):
            if self.staged_layer[b] == layer:
                return b
        return None

    def prefetch_layer(self, layer: int) -> int:
        """Assemble ``layer`` into a staging buffer on the copy stream (hits D2D, misses H2D).

        A buffer that still holds ``layer`` (and was not overwritten since) is reused as is."""
        b = self._buffer_for(layer)
        if b is not None:
            return b
        b = 1 - (self._computing if self._computing is not None else self._last_filled)
        self.staged_layer[b] = None
        self._hits_pending[b] = False
        with self._on_copy_stream():
            if self.is_cuda:
                self.copy_stream.wait_event(self.release[b])
            self._assemble(layer, self.staging_rows[b], b)
            if self.is_cuda:
                self.ready[b].record(self.copy_stream)
        self.staged_layer[b] = layer
        self._last_filled = b
        return b

    def _assemble(self, layer: int, staging_EB: torch.Tensor, b: int) -> None:
        counters = self.stats_.layer(layer)
        resident = self.resident(layer)  # host snapshot: no device sync
        hit_e = np.nonzero(resident >= 0)[0]
        miss_e = np.nonzero(resident < 0)[0]
        counters.prefill_hits += int(hit_e.size)
        counters.prefill_misses += int(miss_e.size)
        row_total = self.store.bytes_per_expert
        if self._hit_mode is None or hit_e.size == 0:
            staging_EB.copy_(self.store.rows(layer), non_blocking=True)
            counters.bytes["prefill_full_h2d"] += self.E * row_total
            return
        # Misses first: the DMA starts as soon as the buffer is released. An SM gather queued ahead
        # of it waits for SMs held by the previous layer's GEMMs and held the PCIe copy back with
        # it (H200, fca575a: TTFT at residency 0.5 above the full-layer-copy TTFT).
        self._h2d_rows([RowCopy(staging_EB, self.store.rows(layer), miss_e, miss_e)], coalesce=True)
        counters.bytes["prefill_miss_h2d"] += int(miss_e.size) * row_total
        try:
            with self._on(self.hit_stream):
                if self.is_cuda:
                    self.hit_stream.wait_event(self.release[b])
                self._copy_hits(staging_EB, hit_e, resident[hit_e].astype(np.int64), counters, self.hit_stream)
                if self.is_cuda:
                    self.hits_ready[b].record(self.hit_stream)
            self._hits_pending[b] = True
        except Exception as exc:  # a failed hit copy mid-run: fall back for the rest of the process
            self._decline("call_failed", f"{type(exc).__name__}: {exc}")
            staging_EB.copy_(self.store.rows(layer), non_blocking=True)
            counters.bytes["prefill_full_h2d"] += self.E * row_total

    def _copy_hits(self, staging_EB: torch.Tensor, hit_e: np.ndarray, hit_slots: np.ndarray, counters, stream) -> None:
        """Slot rows -> staging rows on the device (on ``stream``): one batched call, or one gather kernel."""
        nbytes = int(hit_e.size) * staging_EB.shape[1]
        if self._hit_mode == "batch_memcpy":
            dst, src, size = pointer_arrays([RowCopy(staging_EB, self.pool_rows, hit_e, hit_slots)], coalesce=False)
            self._batch.copy(dst, src, size, stream)
            counters.bytes["prefill_hit_d2d"] += nbytes
            return
        from moe_offload.kernels import copy as copy_kernels

        dst_idx, src_idx = index_tensor(hit_e, self.device), index_tensor(hit_slots, self.device)
        copy_kernels.gather_rows(staging_EB, dst_idx, self.pool_rows, src_idx)
        counters.bytes["prefill_hit_gather"] += nbytes

    def wait_layer(self, layer: int) -> dict[str, torch.Tensor]:
        """Typed views ``[E, ...]`` of ``layer`` in staging; the compute stream waits until it is ready."""
        b = self._buffer_for(layer)
        if b is None:
            self._join_copy_stream()
            b = self.prefetch_layer(layer)
        self._computing = b
        if self.is_cuda:
            cur = torch.cuda.current_stream(self.device)
            cur.wait_event(self.ready[b])
            if self._hits_pending[b]:
                cur.wait_event(self.hits_ready[b])
        return bank_views(self.store.specs, self.store.offsets, self.staging_rows[b])

    def release_layer(self, layer: int) -> None:
        """The GEMMs reading ``layer``'s staging are enqueued: the buffer may be refilled after them
        (and after the admission copy, which reads it too)."""
        b = self._buffer_for(layer)
        if b is None:
            return
        self._admit_free(layer, b)
        if self.is_cuda:
            self.release[b].record(torch.cuda.current_stream(self.device))
        self._computing = None

    def _admit_free(self, layer: int, b: int) -> None:
        """Warm the decode cache from staging: copy staged experts into FREE slots only (no eviction).

        Runs on the compute stream, right after the layer's GEMMs: it is SM work, and on the copy
        stream it would hold the next layer's PCIe copy behind the GEMMs."""
        free = np.nonzero(self.owner < 0)[0]
        if free.size == 0:
            return
        resident = self.resident(layer)
        new_e = np.nonzero(resident < 0)[0][: free.size]
        if new_e.size == 0:
            return
        slots = self.policy.choose(int(new_e.size), set())
        self._assign(layer, new_e, slots)
        from moe_offload.kernels import copy as copy_kernels

        dst_idx, src_idx = index_tensor(np.asarray(slots), self.device), index_tensor(new_e, self.device)
        copy_kernels.gather_rows(self.pool_rows, dst_idx, self.staging_rows[b], src_idx)

    # ------------------------------------------------------------------ hit path resolution
    def resolve_hit_path(self) -> None:
        """Decide how prefill hits are copied; one logged event per reason if declined."""
        self._resolved = True
        cfg = self.prefill_cfg
        if not cfg.hit_d2d:
            self._hit_mode = None
            self._resolve_batch_for_h2d()
            return
        if not cfg.overlap:
            return self._decline("overlap_off", "prefill.overlap is false; the hit/miss split runs only in the overlapped pipeline")
        if self.num_slots == 0:
            return self._decline("no_hit_region", "the budget leaves no slots to hit")
        if not self.is_cuda:
            if cfg.hit_copy == "gather":
                self._hit_mode = "gather"
                return
            return self._decline("cpu_device", "device is cpu: no copy engine (hit_copy=gather runs on cpu)")
        choice = cfg.hit_copy
        if choice == "auto":
            from moe_offload.kernels.copy import choose_hit_copy

            choice = choose_hit_copy(torch.cuda.get_device_name(self.device), self.store.bytes_per_expert)
        self._resolve_batch_for_h2d()
        if choice == "batch_memcpy" and self._batch is None:
            return self._decline(self._batch_reason, self._batch_detail)
        self._hit_mode = choice
        log.info_rank0("prefill_hit_path", mode=choice, row_bytes=self.store.bytes_per_expert, setting=cfg.hit_copy)

    def _resolve_batch_for_h2d(self) -> None:
        self._batch = None
        self._batch_reason, self._batch_detail = "cpu_device", "device is cpu"
        if not self.is_cuda:
            return
        self._batch_reason = None
        from moe_offload.kernels.batch_memcpy import BatchMemcpyUnavailable, load_batch_memcpy

        from moe_offload.kernels.copy import h2d_batch_min_row_bytes

        self._h2d_batch_min = h2d_batch_min_row_bytes(torch.cuda.get_device_name(self.device))
        try:
            self._batch = load_batch_memcpy(self.device)
        except BatchMemcpyUnavailable as exc:
            self._batch_reason, self._batch_detail = f"probe_failed:{exc.reason}", str(exc)
            log.log_once("batch_memcpy_unavailable", "batch_memcpy_unavailable", logging.WARNING, reason=exc.reason,
                         detail=str(exc), fallback="copy_per_run", **versions())

    def _decline(self, reason: str, detail: str) -> None:
        """Switch prefill to full-layer copies for the rest of the process (or fail, if configured)."""
        self._hit_mode = None
        if reason == "call_failed":
            self._batch = None
        if self.prefill_cfg.hit_d2d_on_unavailable == "error":
            raise HitPathUnavailable(reason, detail)
        self._decline_reason = reason
        log_hit_fallback(reason, detail)
        if reason == "call_failed":  # the pass in flight; later passes are counted in begin_prefill
            self.stats_.fallback(reason)

    @property
    def hit_mode(self) -> str | None:
        return self._hit_mode

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        snap = self.stats_.snapshot()
        snap["hit_path"] = self._hit_mode or "full_layer_copy"
        snap["slots"] = self.num_slots
        snap["resident_experts"] = int((self.owner >= 0).sum())
        return snap

    def reset(self) -> None:
        """Zero the counters (residency is kept)."""
        self.stats_.reset()


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
