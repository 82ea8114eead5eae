"""The probe of the ``cudaMemcpyBatchAsync`` path (``batch_memcpy.py``): real H2D and D2D batch copies
into poisoned buffers, checked byte for byte, plus the host cost of one call (``moe-offload probe``).

Legend: N entries of one batch call.

The probe race: the probe fills its buffers with torch constructors, i.e. on the current stream, and
copies on a private stream, which therefore first waits on the current stream (``_run_probe(joined=True)``).
``_probe_unjoined`` keeps the racy variant for the regression test.
"""

from __future__ import annotations

import functools
import statistics
import time
from typing import Any

import numpy as np
import torch

from moe_offload.kernels.batch_memcpy import (
    BatchMemcpy, BatchMemcpyUnavailable, BatchMemcpyError, _resolve_runtime, _cuda_device, row_pointers,
)

_POISON = 0xA5  # destination fill; a byte that still reads 0xA5 after the copy was never written
_PROBE_SIZES = (1, 12, 4099, 65536, 196611, 1 << 20, (3 << 20) + 5)  # bytes: small and large, odd
_PROBE_GAP = 256  # bytes left untouched after every entry, to catch over-long writes
_TIMING_ENTRIES = 512
_TIMING_ENTRY_BYTES = 64 << 10


def _probe_layout(sizes_N: np.ndarray) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Byte offsets of the entries in the destination (in order) and the source (reversed order)."""
    slots_N = (sizes_N + _PROBE_GAP - 1) // _PROBE_GAP * _PROBE_GAP + _PROBE_GAP
    dst_off_N = np.concatenate([[0], np.cumsum(slots_N)[:-1]]).astype(np.uint64)
    src_off_N = np.empty_like(dst_off_N)
    rev = np.arange(len(sizes_N))[::-1]
    src_off_N[rev] = np.concatenate([[0], np.cumsum(slots_N[rev])[:-1]]).astype(np.uint64)
    total = int(slots_N.sum())
    return dst_off_N, src_off_N, total, total


def _run_probe(device: Any, joined: bool) -> None:
    """One H2D and one D2D batch call into poisoned torch-allocated buffers, then a byte comparison.

    ``joined=False`` omits ``private.wait_stream(current)``: the race regression variant, tests only.
    Raises :class:`BatchMemcpyUnavailable` (``call_failed`` or ``wrong_bytes``).
    """
    copier = BatchMemcpy(_resolve_runtime())
    dev = _cuda_device(device)
    sizes_N = np.asarray(_PROBE_SIZES, dtype=np.uint64)
    dst_off_N, src_off_N, dst_total, src_total = _probe_layout(sizes_N)
    host_src = _probe_host_bytes(src_total)
    with torch.cuda.device(dev):
        current = torch.cuda.current_stream(dev)
        src_pinned = torch.empty(src_total, dtype=torch.uint8, pin_memory=True)
        src_pinned.numpy()[:] = host_src
        # Enqueued on the current stream, behind whatever it already holds (no sync before the copy).
        src_dev = torch.randint(1, 256, (src_total,), dtype=torch.uint8, device=dev)
        src_dev.masked_fill_(src_dev == _POISON, 0x5A)
        dst_h2d = torch.full((dst_total,), _POISON, dtype=torch.uint8, device=dev)
        dst_d2d = torch.full((dst_total,), _POISON, dtype=torch.uint8, device=dev)
        private = torch.cuda.Stream(dev)
        if joined:
            private.wait_stream(current)
        try:
            for dst, src in ((dst_h2d, src_pinned), (dst_d2d, src_dev)):
                copier.copy(dst_off_N + np.uint64(dst.data_ptr()), src_off_N + np.uint64(src.data_ptr()),
                            sizes_N, private)
        except BatchMemcpyError as exc:
            raise BatchMemcpyUnavailable("call_failed", f"{exc} (runtime {copier.runtime_version}, "
                                         f"signature {copier.signature})") from exc
        finally:
            private.synchronize()
        # .cpu() runs on the current stream, so a fill that landed after the copy reads as poison here.
        got = {"h2d": dst_h2d.cpu().numpy(), "d2d": dst_d2d.cpu().numpy()}
        src_bytes = {"h2d": host_src, "d2d": src_dev.cpu().numpy()}
    problems = [p for kind in ("h2d", "d2d")
                for p in _compare(kind, got[kind], src_bytes[kind], sizes_N, dst_off_N, src_off_N)]
    if problems:
        raise BatchMemcpyUnavailable("wrong_bytes", "; ".join(problems) + f" (joined={joined})")


@functools.lru_cache(maxsize=1)
def _probe_host_bytes(nbytes: int) -> np.ndarray:
    """Random non-poison bytes, made once per process.

    Generating them takes ~25 ms of host time; per probe, that would let a few ms of backlog on the
    current stream drain before the fills are enqueued, and hide the race the probe must survive.
    """
    out = np.random.default_rng(0x5EED).integers(1, 256, size=nbytes, dtype=np.uint8)
    out[out == _POISON] = 0x5A
    out.flags.writeable = False
    return out


def _compare(kind: str, got: np.ndarray, src: np.ndarray, sizes_N: np.ndarray, dst_off_N: np.ndarray,
             src_off_N: np.ndarray) -> list[str]:
    want = np.full_like(got, _POISON)
    for size, d, s in zip(sizes_N.tolist(), dst_off_N.tolist(), src_off_N.tolist()):  # 7 entries
        want[d:d + size] = src[s:s + size]
    bad = got != want
    if not bad.any():
        return []
    poison = int((got[bad] == _POISON).sum())
    return [f"{kind}: {int(bad.sum())} of {got.size} bytes differ, first at byte {int(np.argmax(bad))}, "
            f"{poison} of them still hold the poison fill"]


def _probe_unjoined(device: Any = None) -> None:
    """The probe WITHOUT the join: the race regression variant, used only by tests.

    Behind a busy current stream it copies before the fills land and raises ``wrong_bytes``.
    """
    _run_probe(device, joined=False)


def _host_ms_per_call(copier: BatchMemcpy, dev: torch.device, repeats: int = 5) -> float:
    """Median host wall time (ms) of one 512-entry D2D batch call, 64 KiB per entry."""
    nbytes = _TIMING_ENTRIES * _TIMING_ENTRY_BYTES
    with torch.cuda.device(dev):
        src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        private = torch.cuda.Stream(dev)
        private.wait_stream(torch.cuda.current_stream(dev))
        rows_N = np.arange(_TIMING_ENTRIES)
        dst_N = row_pointers(dst.data_ptr(), _TIMING_ENTRY_BYTES, rows_N)
        src_N = row_pointers(src.data_ptr(), _TIMING_ENTRY_BYTES, rows_N[::-1].copy())
        sizes_N = np.full(_TIMING_ENTRIES, _TIMING_ENTRY_BYTES, dtype=np.uint64)
        times = []
        for _ in range(repeats + 1):  # the first call warms up
            t0 = time.perf_counter()
            copier.copy(dst_N, src_N, sizes_N, private)
            times.append(time.perf_counter() - t0)
            private.synchronize()
    return statistics.median(times[1:]) * 1e3


def tile_sources(device_name: str) -> dict[str, str]:
    """Which entry of each kernel tile table a GPU named ``device_name`` uses: its own name, the ``SAME_DIE`` GPU
    whose tiles it borrows, or ``default`` (untuned: run the table's tuner in benchmarks/)."""
    from moe_offload.kernels.decode_gemv_tuning import load_gemv_tuning
    from moe_offload.kernels.decode_moe import DECODE_TUNING_PATH
    from moe_offload.kernels.fused_moe_tuning import TUNING_PATH, load_tuning, tiles_key
    from moe_offload.kernels.nvfp4 import load_dequant_tuning

    tables = {"fused_moe_tuning.json": load_tuning(TUNING_PATH).devices,
              "decode_moe_tuning.json": load_tuning(DECODE_TUNING_PATH).devices,
              "decode_gemv_tuning.json": load_gemv_tuning(), "dequant_tuning.json": load_dequant_tuning()}
    return {name: tiles_key(device_name, keys, name) for name, keys in tables.items()}


def probe(device: Any = None, joined: bool = True) -> dict[str, Any]:
    """Run the probe afresh (no cache) and report it as a JSON-able dict (``moe-offload probe``).

    Keys: ok, reason, detail, joined, library, runtime_version, driver_version, signature, device,
    device_name, tiles (:func:`tile_sources`), nvfp4 (``nvfp4.nvfp4_kernel_report``: whether the NVFP4 kernels run
    on this GPU; CUDA only), host_ms_512_entries (median host time of one 512 x 64 KiB call, ms),
    torch, torch_cuda.
    ``joined=False`` runs the race variant (:func:`_probe_unjoined`) for demonstration.
    """
    out: dict[str, Any] = {
        "ok": False, "reason": None, "detail": None, "joined": joined, "library": None,
        "runtime_version": None, "driver_version": None, "signature": None, "device": None,
        "device_name": None, "tiles": None, "nvfp4": None, "host_ms_512_entries": None, "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():  # which tiles the kernels use does not depend on the batch-copy path
        try:
            out["tiles"] = tile_sources(torch.cuda.get_device_name(_cuda_device(device)))
        except Exception as exc:  # noqa: BLE001 - a table that does not load is reported, the probe goes on
            out["tiles"] = {"error": f"{type(exc).__name__}: {exc}"}
        from moe_offload.kernels.nvfp4 import nvfp4_kernel_report

        out["nvfp4"] = nvfp4_kernel_report(_cuda_device(device))
    try:
        rt = _resolve_runtime()
        out.update(library=rt.library_path, runtime_version=rt.runtime_version,
                   driver_version=rt.driver_version, signature=rt.signature)
        dev = _cuda_device(device)
        out.update(device=str(dev), device_name=torch.cuda.get_device_name(dev))
        _run_probe(dev, joined=joined)
        out["host_ms_512_entries"] = _host_ms_per_call(BatchMemcpy(rt), dev)
        out["ok"] = True
    except BatchMemcpyUnavailable as exc:
        out.update(reason=exc.reason, detail=exc.detail)
    except BatchMemcpyError as exc:
        out.update(reason="call_failed", detail=str(exc))
    return out
