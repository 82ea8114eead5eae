"""How a prefill hit (an expert resident in a slot) reaches the staging buffer: one seam, three paths.

Legend: E experts per layer (staging rows), S slots (pool rows), R bytes of one expert row, M rows copied.

- ``FullLayerCopy``: no device-side hit copy; the whole layer crosses PCIe (hit path off or declined).
- ``GatherHitCopy``: one SM gather kernel, slot rows -> staging rows (``kernels/copy.py``).
- ``BatchMemcpyHitCopy``: one ``cudaMemcpyBatchAsync`` call, one entry per hit (``kernels/batch_memcpy.py``).

``resolve_hit_copy`` picks once per cache (device): ``prefill.hit_copy`` off | auto | batch_memcpy |
gather; ``auto`` reads ``hit_copy_table.json`` (measurements stored as data, keyed by GPU name and row
size). A declined path logs ONE structured event per reason per process and the cache counts it in
``stats()["hit_d2d_fallbacks"]`` for every pass it affects. ``H2DRows`` is the host -> device row
copier of the misses (large rows in one batched call, small rows per coalesced run).
"""

from __future__ import annotations

import ctypes
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Protocol

import numpy as np
import torch

from moe_offload import log
from moe_offload.copy_paths import RowCopy, copy_rows_torch, index_tensor, pointer_arrays, versions
from moe_offload.kernels.batch_memcpy import BatchMemcpyError

FULL_LAYER_COPY = "full_layer_copy"
HIT_COPY_CHOICES = ("batch_memcpy", "gather")
_TABLE_PATH = Path(__file__).with_name("hit_copy_table.json")
#: ``H2DRows.copy_entries``: entries in the first batched call of a planned copy
FIRST_ENTRIES = 2


class HitPathUnavailable(RuntimeError):
    """``prefill.hit_copy_on_unavailable: error`` and the hit path cannot be used."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"prefill hit copy path unavailable: reason={reason} ({detail}); "
                         "set prefill.hit_copy_on_unavailable=fallback to run with full-layer copies")
        self.reason, self.detail = reason, detail


class HitCopy(Protocol):
    """Copies hit rows ``pool_SR[hit_slots_M] -> staging_ER[hit_e_M]`` on the current stream."""

    name: str
    bytes_key: str  # the stats counter of the bytes it moves

    def copy(self, staging_ER: torch.Tensor, hit_e_M: np.ndarray, pool_SR: torch.Tensor,
             hit_slots_M: np.ndarray, stream: Any, table_E: torch.Tensor | None = None) -> None:
        """``table_E``: the layer's device slot table row, equal to the host's ``hit_e_M``/``hit_slots_M`` at this
        point of the stream order (a path may read it instead of copying host indices)."""


class FullLayerCopy:
    name = FULL_LAYER_COPY
    bytes_key = "prefill_full_h2d"

    def copy(self, staging_ER, hit_e_M, pool_SR, hit_slots_M, stream, table_E=None) -> None:
        raise RuntimeError("FullLayerCopy copies no hits: the staging copies the whole layer over PCIe")


class GatherHitCopy:
    name = "gather"
    bytes_key = "prefill_hit_gather"

    def copy(self, staging_ER, hit_e_M, pool_SR, hit_slots_M, stream, table_E=None) -> None:
        from moe_offload.kernels import copy as kernels

        if table_E is not None:  # no host indices: no H2D copy queued behind the miss copies (kernels/copy.py)
            kernels.gather_resident(staging_ER, pool_SR, table_E)
            return
        dev = staging_ER.device
        kernels.gather_rows(staging_ER, index_tensor(hit_e_M, dev), pool_SR, index_tensor(hit_slots_M, dev))


class BatchMemcpyHitCopy:
    name = "batch_memcpy"
    bytes_key = "prefill_hit_d2d"

    def __init__(self, batch):
        self.batch = batch

    def copy(self, staging_ER, hit_e_M, pool_SR, hit_slots_M, stream, table_E=None) -> None:
        dst, src, size = pointer_arrays([RowCopy(staging_ER, pool_SR, hit_e_M, hit_slots_M)], coalesce=False)
        self.batch.copy(dst, src, size, stream)


class H2DRows:
    """Host -> device rows: rows >= ``min_batch_row_bytes`` in one batched call (``batch``), the rest
    with ``Tensor.copy_`` per coalesced run (small entries in a batch held the host for the whole copy
    on the H200). ``batch`` None: every row per run.

    A batched call that fails mid-run (``BatchMemcpyError``: an error code from the runtime) is redone
    per run on the same stream (entries it did enqueue write the same bytes first) and the batch path
    is dropped for good: one ``batch_memcpy_unavailable`` event, then ``on_batch_failure(exc)`` (the
    cache counts it). Without this a persistent error code failed every later request."""

    def __init__(self, batch=None, min_batch_row_bytes: int = 0, stream=None):
        self.batch, self.min_batch_row_bytes, self.stream = batch, min_batch_row_bytes, stream
        self.on_batch_failure = None

    def copy(self, copies: list[RowCopy], coalesce: bool) -> None:
        if self.batch is None:
            copy_rows_torch(copies, coalesce)
            return
        large = [c for c in copies if c.dst.shape[1] >= self.min_batch_row_bytes]
        dst, src, size = pointer_arrays(large, coalesce)
        if size.size:
            try:
                self.batch.copy(dst, src, size, self.stream)
            except BatchMemcpyError as exc:
                self._batch_failed(exc)
                copy_rows_torch(large, coalesce)
        copy_rows_torch([c for c in copies if c.dst.shape[1] < self.min_batch_row_bytes], coalesce)

    def entries_unavailable(self, row_bytes: int, device: torch.device) -> str | None:
        """Why ``copy_entries`` cannot copy rows of ``row_bytes`` on ``device`` (None: it can): on CUDA it needs the
        batched call (``batch_memcpy_unavailable``, or ``small_rows`` below this GPU's ``min_batch_row_bytes``)."""
        if device.type != "cuda":
            return None
        if self.batch is None:
            return "batch_memcpy_unavailable"
        return "small_rows" if row_bytes < self.min_batch_row_bytes else None

    def copy_entries(self, dst_N: np.ndarray, src_N: np.ndarray, size_N: np.ndarray,
                     fallback: Callable[[], list[RowCopy]], device: torch.device) -> None:
        """Copies planned as entries (uint64 addresses and byte counts, e.g. ``kernels/routed_plan.py``'s), where
        ``entries_unavailable`` said they can be. On CUDA the first ``FIRST_ENTRIES`` go in a batched call of their
        own: the copy engine starts on them while the driver takes the rest (~1.6 us an entry on the lent H100 at
        feb415a, benchmarks/results/HISTORY.md). A failed call is redone with ``fallback()``'s row copies (as
        ``copy``). Off CUDA, a host copy per entry."""
        if self.batch is None:
            if device.type == "cuda":  # the caller asks entries_unavailable first
                raise RuntimeError("copy_entries on CUDA needs the batched call; see entries_unavailable")
            for d, s, n in zip(dst_N.tolist(), src_N.tolist(), size_N.tolist()):
                ctypes.memmove(d, s, n)
            return
        k = FIRST_ENTRIES
        try:
            self.batch.copy(dst_N[:k], src_N[:k], size_N[:k], self.stream)
            if size_N.size > k:
                self.batch.copy(dst_N[k:], src_N[k:], size_N[k:], self.stream)
        except BatchMemcpyError as exc:
            self._batch_failed(exc)
            copy_rows_torch(fallback(), coalesce=True)

    def _batch_failed(self, exc: Exception) -> None:
        self.batch = None
        log.log_once("batch_memcpy_unavailable:call_failed", "batch_memcpy_unavailable", logging.WARNING,
                     reason="call_failed", detail=str(exc), fallback="copy_per_run", **versions())
        if self.on_batch_failure is not None:
            self.on_batch_failure(exc)


# ---------------------------------------------------------------------------------------- the table
@functools.cache
def _hit_copy_table() -> dict[str, Any]:
    table = json.loads(_TABLE_PATH.read_text())
    for entry in [table["unknown_device"], *table["devices"].values()]:
        for choice in [entry.get("choice")] + [r["choice"] for r in entry.get("rules", [])]:
            if choice is not None and choice not in HIT_COPY_CHOICES:
                raise ValueError(f"{_TABLE_PATH}: choice {choice!r} is not one of {HIT_COPY_CHOICES}")
    return table


def choose_hit_copy(device_name: str, row_bytes: int) -> str:
    """``"batch_memcpy"`` or ``"gather"`` for ``row_bytes``-byte rows on ``device_name``
    (``torch.cuda.get_device_name()``). The rule with the largest ``min_row_bytes <= row_bytes`` wins; a
    device with no measurements gets the table's ``unknown_device`` choice (``gather``: faster in
    isolation at every row size measured, no CUDA >= 12.8 runtime or probe needed)."""
    if row_bytes < 0:
        raise ValueError(f"row_bytes must be >= 0, got {row_bytes}")
    table = _hit_copy_table()
    entry = table["devices"].get(device_name)
    if entry is None:
        return table["unknown_device"]["choice"]
    fitting = [r for r in entry["rules"] if r["min_row_bytes"] <= row_bytes]
    return max(fitting, key=lambda r: r["min_row_bytes"])["choice"]


def h2d_batch_min_row_bytes(device_name: str) -> int:
    """Smallest row (bytes) that goes into a host->device batched call on this device."""
    table = _hit_copy_table()["h2d_batch"]
    entry = table["devices"].get(device_name, table["unknown_device"])
    return int(entry["min_row_bytes"])


# ---------------------------------------------------------------------------------------- resolution
@dataclass
class Resolution:
    """What ``resolve_hit_copy`` decided: the hit path, the miss copier, and why a fast path is off."""

    hit: Any  # a HitCopy
    h2d: H2DRows
    decline: tuple[str, str] | None = None  # (reason, detail) when the hit path was declined
    batch_h2d_reason: str | None = None  # why batched H2D copies are off (CUDA only)


def _load_batch(device: torch.device):
    """(binding or None, reason or None, detail)."""
    from moe_offload.kernels.batch_memcpy import BatchMemcpyUnavailable, load_batch_memcpy

    try:
        return load_batch_memcpy(device), None, ""
    except BatchMemcpyUnavailable as exc:
        log.log_once("batch_memcpy_unavailable", "batch_memcpy_unavailable", logging.WARNING, reason=exc.reason,
                     detail=str(exc), fallback="copy_per_run", **versions())
        return None, f"probe_failed:{exc.reason}", str(exc)


def resolve_hit_copy(setting: str, on_unavailable: str, overlap: bool, num_slots: int, device: torch.device,
                     row_bytes: int, copy_stream=None) -> Resolution:
    """Pick the hit path for this device (see the module docstring). Raises ``HitPathUnavailable`` when
    a requested path is unavailable and ``on_unavailable`` is ``error``."""
    batch = reason = None
    detail = ""
    h2d = H2DRows(stream=copy_stream)
    if device.type == "cuda":
        batch, reason, detail = _load_batch(device)
        h2d = H2DRows(batch, h2d_batch_min_row_bytes(torch.cuda.get_device_name(device)), copy_stream)
    res = Resolution(FullLayerCopy(), h2d, None, reason)
    if setting == "off":
        return res
    decline = None
    if not overlap:
        decline = ("overlap_off", "prefill.overlap is false; the hit/miss split runs only in the overlapped pipeline")
    elif num_slots == 0:
        decline = ("no_hit_region", "the budget leaves no slots to hit")
    else:
        choice = setting
        if setting == "auto":
            choice = choose_hit_copy(torch.cuda.get_device_name(device), row_bytes) if device.type == "cuda" else "gather"
        if choice == "batch_memcpy" and device.type != "cuda":
            decline = ("cpu_device", "prefill.hit_copy=batch_memcpy needs a CUDA device (gather runs on any device)")
        elif choice == "batch_memcpy" and batch is None:
            decline = (reason, detail)
        else:
            res.hit = GatherHitCopy() if choice == "gather" else BatchMemcpyHitCopy(batch)
            log.info_rank0("prefill_hit_path", mode=res.hit.name, row_bytes=row_bytes, setting=setting)
            return res
    if on_unavailable == "error":
        raise HitPathUnavailable(*decline)
    res.decline = decline
    log_hit_fallback(*decline)
    return res


def log_hit_fallback(reason: str, detail: str) -> None:
    """One WARNING event per reason per process."""
    log.log_once(f"prefill_hit_d2d_unavailable:{reason}", "prefill_hit_d2d_unavailable", logging.WARNING,
                 reason=reason, fallback=FULL_LAYER_COPY, detail=detail, setting="prefill.hit_copy", **versions())
