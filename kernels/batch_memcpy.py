"""``cudaMemcpyBatchAsync`` through ctypes, bound from the CUDA runtime that torch already loaded.

Legend: N entries in one batch call; entry i copies ``sizes_N[i]`` bytes from ``src_ptrs_N[i]`` to
``dst_ptrs_N[i]``. Pointers and sizes travel as numpy uint64 arrays (``void*`` and ``size_t`` on 64-bit
Linux); their buffers are handed to the runtime as they are, with no per-entry Python work.

The facts this module is built on (measured on an H200, CUDA runtime 13.0):

- The symbol exists from CUDA 12.8. In 12.8/12.9 it takes ``size_t* failIdx`` before the stream; 13.x
  dropped that argument. The signature is chosen from ``cudaRuntimeGetVersion`` (:func:`signature_for`)
  and then verified with real copies (:func:`load_batch_memcpy`); a wrong arity would be undefined
  behaviour, so an unknown future major version is declined rather than guessed.
- It rejects the legacy NULL stream (cudaErrorInvalidValue) and cannot be captured into a CUDA graph:
  both are refused before the call (:func:`_check_stream`).
- A failed runtime call stays as the thread's last error, which torch then reports at its next kernel
  launch; every failed call here is followed by ``cudaGetLastError()``.
- The probe race: the probe fills its buffers with torch constructors, i.e. on the current stream, and
  copies on a private stream, which therefore first waits on the current stream. Without that join a
  backlog on the current stream lets the fill land after the copy (``batch_memcpy_probe._probe_unjoined`` keeps that
  variant for the regression test).

ABI of ``struct cudaMemcpyAttributes`` (driver_types.h; the same in CUDA 12.8, 13.1 and 13.3)::

    offset  0  enum cudaMemcpySrcAccessOrder srcAccessOrder   (4 B; cudaMemcpySrcAccessOrderStream = 1)
    offset  4  struct cudaMemLocation srcLocHint              (8 B: enum cudaMemLocationType type; int id)
    offset 12  struct cudaMemLocation dstLocHint              (8 B; in 13.x ``id`` sits in a 4-byte union)
    offset 20  unsigned int flags                             (4 B; 0 = cudaMemcpyFlagDefault)
    sizeof 24, alignof 4

Zeroed location hints are cudaMemLocationTypeInvalid = "no hint"; the hints only matter for managed
memory. One attribute (``attrsIdxs = {0}``, ``numAttrs = 1``) applies to every entry of a call.

Nothing here touches CUDA at import time. Declining the fast path is the caller's decision: the loader
raises :class:`BatchMemcpyUnavailable`, and the cache logs the structured event and counts it.
"""

from __future__ import annotations

import ctypes
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch

MIN_RUNTIME_VERSION = 12080  # cudaMemcpyBatchAsync first shipped in CUDA 12.8
_FIRST_UNKNOWN_RUNTIME = 14000  # no signature is known for 14.x yet: declined, never guessed
SRC_ACCESS_ORDER_STREAM = 1  # cudaMemcpySrcAccessOrderStream
_LEGACY_STREAM_HANDLES = (0, 1)  # the NULL stream and cudaStreamLegacy (0x1)
_CAPTURE_STATUS_NONE = 0  # cudaStreamCaptureStatusNone
_SIZE_MAX = 2**64 - 1

REASONS = ("no_cuda", "runtime_too_old", "runtime_unsupported", "symbol_missing", "call_failed", "wrong_bytes")



class BatchMemcpyError(RuntimeError):
    """A refused or failed batch call. ``code``/``name`` are the cudaError_t when the runtime failed."""

    def __init__(self, message: str, code: int | None = None, name: str | None = None):
        super().__init__(message)
        self.code = code
        self.name = name


class BatchMemcpyUnavailable(RuntimeError):
    """The batch path cannot be used in this process; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str):
        if reason not in REASONS:
            raise ValueError(f"unknown reason {reason!r}; expected one of {REASONS}")
        super().__init__(f"cudaMemcpyBatchAsync unavailable ({reason}): {detail}")
        self.reason = reason
        self.detail = detail


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_int),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


def signature_for(runtime_version: int) -> str:
    """``"12.8"`` (with ``failIdx``) or ``"13"`` for a ``cudaRuntimeGetVersion`` value (1000*major + 10*minor).

    Raises :class:`BatchMemcpyUnavailable` ``runtime_too_old`` below 12080 and ``runtime_unsupported``
    from 14000 on, where the signature is not known.
    """
    version = int(runtime_version)
    if version < MIN_RUNTIME_VERSION:
        raise BatchMemcpyUnavailable("runtime_too_old", f"CUDA runtime {version} < {MIN_RUNTIME_VERSION}")
    if version >= _FIRST_UNKNOWN_RUNTIME:
        raise BatchMemcpyUnavailable(
            "runtime_unsupported", f"CUDA runtime {version}: signature not known here (add it to signature_for)"
        )
    return "12.8" if version < 13000 else "13"


def _check_stream(handle: int, capturing: bool) -> None:
    """Refuse the legacy NULL stream (rejected by the runtime) and a capturing stream (not capturable)."""
    if handle in _LEGACY_STREAM_HANDLES:
        raise BatchMemcpyError(
            f"cudaMemcpyBatchAsync rejects the legacy NULL stream (handle {handle:#x}); "
            "pass a created stream such as torch.cuda.Stream()"
        )
    if capturing:
        raise BatchMemcpyError(
            f"stream {handle:#x} is capturing a CUDA graph; cudaMemcpyBatchAsync cannot be captured, "
            "keep it outside captured regions"
        )


def row_pointers(base_ptr: int, row_bytes: int, rows_N: np.ndarray) -> np.ndarray:
    """Addresses ``base_ptr + rows_N * row_bytes`` as a uint64 [N] array (``row_bytes``: row stride in bytes)."""
    rows = np.asarray(rows_N)
    if rows.ndim != 1 or rows.dtype.kind not in "iu":
        raise ValueError(f"rows_N must be a 1-D integer array, got shape {rows.shape} dtype {rows.dtype}")
    if base_ptr < 0 or row_bytes < 0:
        raise ValueError(f"base_ptr and row_bytes must be >= 0, got {base_ptr}, {row_bytes}")
    if rows.size and rows.min() < 0:
        raise ValueError("rows_N holds negative row indices")
    return np.uint64(base_ptr) + rows.astype(np.uint64) * np.uint64(row_bytes)


@dataclass(frozen=True)
class _CudaRuntime:
    """The runtime entry points this module calls, plus what identified them."""

    library_path: str
    runtime_version: int
    driver_version: int
    signature: str
    memcpy_batch: Callable[..., int]
    stream_is_capturing: Callable[..., int]
    get_last_error: Callable[[], int]
    get_error_name: Callable[[int], bytes | None]


class BatchMemcpy:
    """One ``cudaMemcpyBatchAsync`` call per :meth:`copy`; obtain it from :func:`load_batch_memcpy`.

    Attributes: ``library_path`` (the libcudart bound), ``runtime_version`` and ``driver_version``
    (1000*major + 10*minor), ``signature`` (``"12.8"`` or ``"13"``).
    """

    def __init__(self, runtime: _CudaRuntime):
        self._rt = runtime
        self.library_path, self.signature = runtime.library_path, runtime.signature
        self.runtime_version, self.driver_version = runtime.runtime_version, runtime.driver_version
        self._attrs = _MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM)
        self._attrs_idx = (ctypes.c_size_t * 1)(0)
        self._attrs_addr = ctypes.addressof(self._attrs)
        self._attrs_idx_addr = ctypes.addressof(self._attrs_idx)

    def copy(self, dst_ptrs_N: np.ndarray, src_ptrs_N: np.ndarray, sizes_N: np.ndarray, stream: Any) -> None:
        """Enqueue N copies (sizes in bytes) on ``stream`` (a ``torch.cuda.Stream`` or a raw handle).

        Sources are read in stream order. The call is asynchronous: the memory behind the pointers must
        stay valid until ``stream`` has passed the copy. Call it with the stream's device current. An
        empty batch is a no-op. Raises ValueError for malformed arrays, and :class:`BatchMemcpyError` for
        the legacy NULL stream, a capturing stream, or a failed call (the thread's last CUDA error is
        cleared first).
        """
        n = _check_entries(dst_ptrs_N, src_ptrs_N, sizes_N)
        if n == 0:
            return
        handle = int(getattr(stream, "cuda_stream", stream))
        _check_stream(handle, handle not in _LEGACY_STREAM_HANDLES and self._is_capturing(handle))
        self._enqueue(dst_ptrs_N, src_ptrs_N, sizes_N, handle)

    def _is_capturing(self, handle: int) -> bool:
        status = ctypes.c_int(_CAPTURE_STATUS_NONE)
        self._raise_on_error(self._rt.stream_is_capturing(handle, ctypes.byref(status)), "cudaStreamIsCapturing")
        return status.value != _CAPTURE_STATUS_NONE

    def _enqueue(self, dst_ptrs_N: np.ndarray, src_ptrs_N: np.ndarray, sizes_N: np.ndarray, handle: int) -> None:
        """The raw call, without the stream checks (tests use it to exercise the failure path)."""
        args = (
            dst_ptrs_N.ctypes.data,
            src_ptrs_N.ctypes.data,
            sizes_N.ctypes.data,
            len(sizes_N),
            self._attrs_addr,
            self._attrs_idx_addr,
            1,
        )
        if self._rt.signature == "12.8":
            fail_idx = ctypes.c_size_t(_SIZE_MAX)
            err = self._rt.memcpy_batch(*args, ctypes.addressof(fail_idx), handle)
            where = "" if fail_idx.value == _SIZE_MAX else f" at entry {fail_idx.value}"
        else:
            err = self._rt.memcpy_batch(*args, handle)
            where = ""
        self._raise_on_error(err, f"cudaMemcpyBatchAsync({len(sizes_N)} entries, stream {handle:#x}){where}")

    def _raise_on_error(self, err: int, what: str) -> None:
        if err == 0:
            return
        self._rt.get_last_error()  # clear it, or torch reports it at its next kernel launch
        raw = self._rt.get_error_name(err)
        name = raw.decode() if raw else f"cudaError_{err}"
        raise BatchMemcpyError(f"{what} failed: {name} ({err})", code=err, name=name)


def _check_entries(dst_ptrs_N: np.ndarray, src_ptrs_N: np.ndarray, sizes_N: np.ndarray) -> int:
    """N, after checking the arrays can be handed to the runtime as they are (ValueError if not)."""
    for label, arr in (("dst_ptrs_N", dst_ptrs_N), ("src_ptrs_N", src_ptrs_N), ("sizes_N", sizes_N)):
        if not isinstance(arr, np.ndarray) or arr.dtype != np.uint64 or arr.ndim != 1:
            raise ValueError(f"{label} must be a 1-D numpy uint64 array, got {type(arr).__name__} "
                             f"{getattr(arr, 'dtype', None)} {getattr(arr, 'shape', None)}")
        if not arr.flags.c_contiguous:
            raise ValueError(f"{label} must be contiguous (its buffer is passed to the runtime as is)")
    n = len(sizes_N)
    if len(dst_ptrs_N) != n or len(src_ptrs_N) != n:
        raise ValueError(f"entry counts differ: {len(dst_ptrs_N)} dst, {len(src_ptrs_N)} src, {n} sizes")
    if n and not sizes_N.all():
        raise ValueError("sizes_N holds zero-byte entries")
    return n


# --- resolution (once per process) -------------------------------------------------------------------

_lock = threading.Lock()
_runtime: _CudaRuntime | BatchMemcpyUnavailable | None = None
_loaded: dict[int, BatchMemcpy | BatchMemcpyUnavailable] = {}


def _mapped_cudart_paths() -> list[str]:
    """Paths of the libcudart images mapped into this process, torch's CUDA major first."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split(None, 5)[5].strip() for line in maps if "libcudart.so" in line}
    except OSError:
        return []
    major = (torch.version.cuda or "").split(".")[0]
    return sorted(paths, key=lambda p: (f".so.{major}" not in p, p))


def _bind(path: str) -> _CudaRuntime:
    try:  # RTLD_NOLOAD: bind to the runtime torch already uses, never load a second one
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError as exc:
        raise BatchMemcpyUnavailable("symbol_missing", f"cannot bind {path}: {exc}") from exc
    for name in ("cudaRuntimeGetVersion", "cudaDriverGetVersion", "cudaGetLastError", "cudaGetErrorName",
                 "cudaStreamIsCapturing"):
        if not hasattr(lib, name):
            raise BatchMemcpyUnavailable("symbol_missing", f"{path} has no {name}")
    get_error_name = lib.cudaGetErrorName
    get_error_name.argtypes, get_error_name.restype = [ctypes.c_int], ctypes.c_char_p
    versions = {}
    for name in ("cudaRuntimeGetVersion", "cudaDriverGetVersion"):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
        value = ctypes.c_int(0)
        err = fn(ctypes.byref(value))
        if err != 0:
            lib.cudaGetLastError()
            err_name = (get_error_name(err) or b"?").decode()
            raise BatchMemcpyUnavailable("call_failed", f"{name} returned {err_name} ({err})")
        versions[name] = value.value
    runtime_version, driver_version = versions["cudaRuntimeGetVersion"], versions["cudaDriverGetVersion"]
    signature = signature_for(runtime_version)
    if driver_version < MIN_RUNTIME_VERSION:
        raise BatchMemcpyUnavailable("runtime_too_old", f"CUDA driver {driver_version} < {MIN_RUNTIME_VERSION}")
    if not hasattr(lib, "cudaMemcpyBatchAsync"):
        raise BatchMemcpyUnavailable(
            "symbol_missing", f"{path} (runtime {runtime_version}) has no cudaMemcpyBatchAsync")
    batch = lib.cudaMemcpyBatchAsync
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    # dsts, srcs, sizes, count, attrs, attrsIdxs, numAttrs, [failIdx,] stream
    batch.argtypes = [vp, vp, vp, sz, vp, vp, sz] + ([vp] if signature == "12.8" else []) + [vp]
    batch.restype = ctypes.c_int
    capturing = lib.cudaStreamIsCapturing
    capturing.argtypes, capturing.restype = [vp, ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    lib.cudaGetLastError.argtypes, lib.cudaGetLastError.restype = [], ctypes.c_int
    return _CudaRuntime(path, runtime_version, driver_version, signature, batch, capturing,
                        lib.cudaGetLastError, get_error_name)


def runtime_versions() -> tuple[str, str]:
    """``("13.0", "13.2")``: the CUDA runtime torch loaded and the driver's CUDA version, as text
    (raises ``BatchMemcpyUnavailable`` when the runtime cannot be bound)."""
    rt = _resolve_runtime()

    def text(v: int) -> str:
        return f"{v // 1000}.{v % 1000 // 10}"

    return text(rt.runtime_version), text(rt.driver_version)


def _resolve_runtime() -> _CudaRuntime:
    """Bind the loaded CUDA runtime once per process; the outcome (or its failure) is cached."""
    global _runtime
    with _lock:
        if _runtime is None:
            _runtime = _try_resolve()
        result = _runtime
    if isinstance(result, BatchMemcpyUnavailable):
        raise BatchMemcpyUnavailable(result.reason, result.detail)
    return result


def _try_resolve() -> _CudaRuntime | BatchMemcpyUnavailable:
    if not torch.cuda.is_available():
        return BatchMemcpyUnavailable(
            "no_cuda", f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})")
    paths = _mapped_cudart_paths()
    if not paths:
        return BatchMemcpyUnavailable("symbol_missing", "no libcudart is mapped into this process "
                                      "(torch linked the CUDA runtime statically or not at all)")
    try:
        return _bind(paths[0])
    except BatchMemcpyUnavailable as exc:
        return exc


def _cuda_device(device: Any) -> torch.device:
    if device is None:
        return torch.device("cuda", torch.cuda.current_device())
    dev = torch.device(device)
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, got {dev}")
    return dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())


def load_batch_memcpy(device: Any = None) -> BatchMemcpy:
    """The validated batch copier for ``device`` (default: the current CUDA device).

    Binds the runtime once per process, then proves it with real H2D and D2D batch copies (joined
    probe); the outcome per device is cached, a failure included. Raises :class:`BatchMemcpyUnavailable`.
    """
    _resolve_runtime()  # raises no_cuda, runtime_too_old, ... (cached)
    dev = _cuda_device(device)
    with _lock:
        cached = _loaded.get(dev.index)
    if cached is None:
        try:
            from moe_offload.kernels.batch_memcpy_probe import _run_probe

            _run_probe(dev, joined=True)
            cached = BatchMemcpy(_resolve_runtime())
        except BatchMemcpyUnavailable as exc:
            cached = exc
        with _lock:
            cached = _loaded.setdefault(dev.index, cached)
    if isinstance(cached, BatchMemcpyUnavailable):
        raise BatchMemcpyUnavailable(cached.reason, cached.detail)
    return cached
