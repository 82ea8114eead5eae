"""Device (CUDA) tensors that alias pinned host memory (UVA): kernels read host rows over PCIe directly.

Legend: E experts, B bytes per expert row; a host tensor is any strided CPU tensor (the store's
``[E, B]`` uint8 rows in practice).

How: the host memory is registered with ``cudaHostRegister(.., cudaHostRegisterMapped |
cudaHostRegisterPortable)`` (:func:`pin_mapped`; the store pins this way), ``cudaHostGetDevicePointer``
gives its device address, and an object exposing ``__cuda_array_interface__`` (:class:`MappedHostArray`)
hands that address to ``torch.as_tensor``. torch keeps the object alive as long as the tensor's
storage lives, and the object keeps the host tensor alive, so the memory cannot be freed under a view.
It can still be *unregistered* under a view (``ExpertStore.close()``): keep the owner of the
registration alive while views are used.

Facts this relies on: the runtime is the libcudart torch already loaded (bound
with RTLD_NOLOAD, as ``kernels/batch_memcpy.py`` does); every call's return code is checked, and a
failed call is followed by ``cudaGetLastError()`` (a failed call stays as the thread's last error,
which torch would report at its next kernel launch). ``torch.as_tensor`` infers the tensor's device
from ``cudaPointerGetAttributes``; for registered host memory that is the device that was current at
registration, so a mismatch with the requested device is refused before the tensor is built (torch
would otherwise *copy* the whole host tensor to the requested device).

Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

import torch

from moe_offload import log

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context
HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: has a device address (cudaHostGetDevicePointer)
HOST_REGISTER_FLAGS = HOST_REGISTER_MAPPED | HOST_REGISTER_PORTABLE
_ATTR_CAN_MAP_HOST_MEMORY = 19  # cudaDevAttrCanMapHostMemory
_MEMORY_TYPE_HOST = 1  # cudaMemoryTypeHost
_FIX = ("register the host tensor with moe_offload.uva.pin_mapped (ExpertStore(pin=True) does) on a CUDA "
        "build of torch, with the target device current")

_TYPESTR = {
    torch.uint8: "|u1", torch.int8: "|i1", torch.int16: "<i2", torch.int32: "<i4", torch.int64: "<i8",
    torch.float16: "<f2", torch.float32: "<f4", torch.float64: "<f8", torch.bool: "|b1",
}


class UvaError(RuntimeError):
    """Host memory cannot be mapped into the device's address space. ``code``/``name``: the cudaError_t
    when a runtime call failed."""

    def __init__(self, message: str, code: int | None = None, name: str | None = None):
        super().__init__(message)
        self.code = code
        self.name = name


class _PointerAttributes(ctypes.Structure):
    # struct cudaPointerAttributes (CUDA 11+): type, device, devicePointer, hostPointer; CUDA 12.x
    # appends reserved words. The spare tail keeps any runtime's writes inside this buffer.
    _fields_ = [("type", ctypes.c_int), ("device", ctypes.c_int), ("devicePointer", ctypes.c_void_p),
                ("hostPointer", ctypes.c_void_p), ("reserved", ctypes.c_long * 32)]


@dataclass(frozen=True)
class _UvaRuntime:
    """The runtime entry points used here (tests substitute fakes with the same call signatures)."""

    host_get_device_pointer: Callable[..., int]  # (void** dev, void* host, unsigned flags) -> err
    pointer_get_attributes: Callable[..., int]  # (cudaPointerAttributes*, const void*) -> err
    device_get_attribute: Callable[..., int]  # (int* value, int attr, int device) -> err
    host_register: Callable[..., int]  # (void* ptr, size_t bytes, unsigned flags) -> err
    host_unregister: Callable[..., int]  # (void* ptr) -> err
    get_last_error: Callable[[], int]
    get_error_name: Callable[[int], bytes | None]


_lock = threading.Lock()
_bound: _UvaRuntime | UvaError | None = None


def _bind(path: str) -> _UvaRuntime:
    try:  # RTLD_NOLOAD: bind to the runtime torch already uses, never load a second one
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
    except OSError as exc:
        raise UvaError(f"cannot bind the CUDA runtime {path}: {exc}") from exc
    names = ("cudaHostGetDevicePointer", "cudaPointerGetAttributes", "cudaDeviceGetAttribute", "cudaHostRegister",
             "cudaHostUnregister", "cudaGetLastError", "cudaGetErrorName")
    missing = [n for n in names if not hasattr(lib, n)]
    if missing:
        raise UvaError(f"{path} has no {missing}")
    vp, ci = ctypes.c_void_p, ctypes.c_int
    fns = {n: getattr(lib, n) for n in names}
    spec = {
        "cudaHostGetDevicePointer": [ctypes.POINTER(vp), vp, ctypes.c_uint],
        "cudaPointerGetAttributes": [ctypes.POINTER(_PointerAttributes), vp],
        "cudaDeviceGetAttribute": [ctypes.POINTER(ci), ci, ci],
        "cudaHostRegister": [vp, ctypes.c_size_t, ctypes.c_uint],
        "cudaHostUnregister": [vp],
        "cudaGetLastError": [],
    }
    for n, args in spec.items():
        fns[n].argtypes, fns[n].restype = args, ci
    fns["cudaGetErrorName"].argtypes, fns["cudaGetErrorName"].restype = [ci], ctypes.c_char_p
    return _UvaRuntime(fns["cudaHostGetDevicePointer"], fns["cudaPointerGetAttributes"], fns["cudaDeviceGetAttribute"],
                       fns["cudaHostRegister"], fns["cudaHostUnregister"], fns["cudaGetLastError"],
                       fns["cudaGetErrorName"])


def _runtime() -> _UvaRuntime:
    """The bound CUDA runtime (once per process; a failure is cached and raised again)."""
    global _bound
    from moe_offload.kernels.batch_memcpy import _mapped_cudart_paths  # one resolver of torch's libcudart

    with _lock:
        if _bound is None:
            if not torch.cuda.is_available():
                _bound = UvaError(f"torch {torch.__version__} sees no CUDA device; {_FIX}")
            else:
                paths = _mapped_cudart_paths()
                if not paths:
                    _bound = UvaError("no libcudart is mapped into this process (torch linked the CUDA runtime "
                                      "statically or not at all): cannot resolve cudaHostGetDevicePointer")
                else:
                    try:
                        _bound = _bind(paths[0])
                    except UvaError as exc:
                        _bound = exc
        result = _bound
    if isinstance(result, UvaError):
        raise UvaError(str(result), result.code, result.name)
    return result


def _check(rt: _UvaRuntime, err: int, what: str, fix: str = _FIX) -> None:
    if err == 0:
        return
    rt.get_last_error()  # clear it, or torch reports it at its next kernel launch
    raw = rt.get_error_name(err)
    name = raw.decode() if raw else f"cudaError_{err}"
    raise UvaError(f"{what} failed: {name} ({err}); {fix}", code=err, name=name)


# --- registration ------------------------------------------------------------------------------------

_PAGE = 4096


def page_aligned(shape: tuple[int, ...], dtype: torch.dtype, zeroed: bool = True) -> torch.Tensor:
    """A CPU tensor that starts on a page and owns whole pages, for :func:`pin_mapped`: host registration
    works on pages, and two small buffers sharing a page could not both be registered. Zeroed unless ``zeroed`` is
    False (a buffer the caller fills whole, e.g. the expert store's rows: no pass over gigabytes first)."""
    n = 1
    for d in shape:
        n *= d
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = -(-n * size // _PAGE) * _PAGE
    raw = (torch.zeros if zeroed else torch.empty)(nbytes + _PAGE, dtype=torch.uint8)
    off = (-raw.data_ptr()) % _PAGE
    return raw[off:off + nbytes].view(dtype)[:n].view(shape)


def pin_mapped(t: torch.Tensor) -> bool:
    """Register ``t``'s memory as pinned, mapped and portable; False (nothing done) without CUDA or
    for an empty tensor. ``t`` must be a contiguous CPU tensor; undo with :func:`unpin`."""
    if not torch.cuda.is_available() or t.numel() == 0:
        return False
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError(f"pin_mapped needs a contiguous CPU tensor, got {t.device} strides {tuple(t.stride())}")
    rt = _runtime()
    _check(rt, rt.host_register(t.data_ptr(), t.numel() * t.element_size(), HOST_REGISTER_FLAGS),
           f"cudaHostRegister({t.numel() * t.element_size()} bytes, Mapped|Portable)",
           "the GPU or driver cannot map host memory; check `cudaDevAttrCanMapHostMemory` and the pinned-memory "
           "limit (ulimit -l)")
    return True


def unpin(ptrs: list[int]) -> None:
    """Unregister host memory registered by :func:`pin_mapped` (base addresses)."""
    rt = _runtime()
    for p in ptrs:
        _check(rt, rt.host_unregister(p), f"cudaHostUnregister({p:#x})", "pass the base address pin_mapped registered")


def unpin_quietly(host: torch.Tensor, event: str) -> None:
    """:func:`unpin` of ``host``'s base for finalizers and teardown: a failure (at interpreter exit the runtime may be
    gone, with nothing left to protect) logs one ``event`` at WARNING instead of raising."""
    try:
        unpin([host.data_ptr()])
    except Exception as exc:  # noqa: BLE001 - teardown: say so, never raise
        log.event(event, logging.WARNING, detail=f"{type(exc).__name__}: {exc}")


# --- device views -----------------------------------------------------------------------------------

class MappedHostArray:
    """``__cuda_array_interface__`` (v3) of a host tensor's device address; holds the host tensor.

    ``host`` the CPU tensor, ``device_ptr`` its device address (int), ``device`` the CUDA device."""

    def __init__(self, host: torch.Tensor, device_ptr: int, device: torch.device):
        if host.dtype not in _TYPESTR:
            raise ValueError(f"dtype {host.dtype} has no __cuda_array_interface__ type string; view the tensor "
                             "as torch.uint8 first (e.g. t.view(torch.uint8))")
        self.host = host
        self.device_ptr = device_ptr
        self.device = device
        size = host.element_size()
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "typestr": _TYPESTR[host.dtype],
            "data": (device_ptr, False),
            "strides": tuple(s * size for s in host.stride()),
            "version": 3,  # no "stream" key: no stream owns host memory, nothing to synchronize on import
        }


def _cuda_device(device: Any) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_pointer(host: torch.Tensor, device: Any) -> int:
    """Device address of registered host memory at ``host.data_ptr()`` (raises :class:`UvaError`)."""
    dev = _cuda_device(device)
    rt = _runtime()
    can_map = ctypes.c_int(0)
    _check(rt, rt.device_get_attribute(ctypes.byref(can_map), _ATTR_CAN_MAP_HOST_MEMORY, dev.index),
           f"cudaDeviceGetAttribute(CanMapHostMemory, {dev.index})")
    if not can_map.value:
        raise UvaError(f"{dev} cannot map host memory (cudaDevAttrCanMapHostMemory = 0): misses cannot be read over "
                       "UVA on this GPU; serve them with copy-engine copies into slots instead")
    attrs = _PointerAttributes()
    _check(rt, rt.pointer_get_attributes(ctypes.byref(attrs), host.data_ptr()),
           f"cudaPointerGetAttributes({host.data_ptr():#x})")
    if attrs.type != _MEMORY_TYPE_HOST:
        raise UvaError(f"host memory at {host.data_ptr():#x} is not registered with CUDA (memory type {attrs.type}); "
                       f"{_FIX}")
    if attrs.device != dev.index:
        raise UvaError(f"host memory at {host.data_ptr():#x} was registered with cuda:{attrs.device} current, and "
                       f"torch labels its views with that device, not {dev}; register it (build the ExpertStore) "
                       f"after torch.cuda.set_device({dev.index})")
    ptr = ctypes.c_void_p(0)
    with torch.cuda.device(dev):
        _check(rt, rt.host_get_device_pointer(ctypes.byref(ptr), host.data_ptr(), 0),
               f"cudaHostGetDevicePointer({host.data_ptr():#x}) on {dev}",
               "the memory must be registered with cudaHostRegisterMapped: " + _FIX)
    if not ptr.value:
        raise UvaError(f"cudaHostGetDevicePointer returned a null address for {host.data_ptr():#x}; {_FIX}")
    return int(ptr.value)


def mapped_device_view(host_tensor: torch.Tensor, device: Any) -> torch.Tensor:
    """A tensor on ``device`` with ``host_tensor``'s shape, strides and dtype that aliases its memory.

    ``device`` cpu: ``host_tensor`` itself (host memory is the device's memory there). CUDA: the host
    memory must be registered mapped (:func:`pin_mapped`) with ``device`` current at registration.
    Reads by kernels cross PCIe; writes through either tensor are seen by the other (no copy).
    The view holds ``host_tensor`` alive. Raises :class:`UvaError` when the memory cannot be mapped.
    """
    if not isinstance(host_tensor, torch.Tensor) or host_tensor.device.type != "cpu":
        raise ValueError(f"host_tensor must be a CPU tensor, got {getattr(host_tensor, 'device', type(host_tensor))}")
    dev = _cuda_device(device)
    if dev.type == "cpu":
        return host_tensor
    if dev.type != "cuda":
        raise ValueError(f"device must be cpu or cuda, got {dev}")
    if host_tensor.numel() == 0:
        return torch.empty_strided(host_tensor.shape, host_tensor.stride(), dtype=host_tensor.dtype, device=dev)
    arr = MappedHostArray(host_tensor, device_pointer(host_tensor, dev), dev)
    with torch.cuda.device(dev):
        view = torch.as_tensor(arr, device=dev)
    if view.data_ptr() != arr.device_ptr or view.device != dev:
        raise UvaError(f"torch built the view at {view.data_ptr():#x} on {view.device}, not the mapped address "
                       f"{arr.device_ptr:#x} on {dev} (it copied instead of aliasing); {_FIX}")
    return view
