"""Routed misses copied by the copy engine inside a captured step (``decode.miss_copy: copy_engine``).

Legend: E experts of a layer, M = T x K routed pairs of a step, R bytes of one expert row, X scratch rows of the
decode path (``min(max_tokens x K, E)``), base the first scratch row (``DecodeResidency.scratch_base``).

Why: a captured step cannot hand the routing it computes on the device to the copy engine, so the miss server
(``kernels/decode_miss.py``) reads missing experts with SM loads from mapped host memory. That rate depends on the
host: 28.5 GB/s on the H100 of the 4c209c0 run against 54.3 GB/s for the copy engine, where batch 16 / 64 decode at
residency 0.37 then ran at 1.03 / 1.04 x the SM-read floor and 2.0 x the copy engine's
(benchmarks/results/HISTORY.md "4c209c0").

How (per MoE layer, while a step is captured; ``enqueue``):
1. one kernel per 256 experts (compiled once with NVRTC, ``torch.cuda._compile_kernel``, launched with the
   handles in its parameters) reads the step's routed ids and the layer's device slot table, marks each expert
   that is routed and not resident, writes the row map ``pf_E`` (``base + e`` for such an expert, -1 otherwise)
   and sets one graph condition per expert (``cudaGraphSetConditional``);
2. E conditional (IF) nodes after it, each holding one H2D memcpy node: host row e -> pool row ``base + e``.
   The IF nodes run in parallel; the capture continues after all of them (CUDA runtime via ctypes:
   ``cudaGraphConditionalHandleCreate``, ``cudaGraphAddNode``, ``cudaGraphAddMemcpyNode1D``,
   ``cudaStreamUpdateCaptureDependencies``; CUDA >= 12.4);
3. the miss plan gets ``pf_E`` as its row map (``pf_row_E``, the same input as the lookahead's), so every routed
   missing expert is read from its row and the SM copy copies nothing.
So each expert has a fixed row, which needs X >= E scratch rows (true whenever max_tokens x K >= E: Qwen3-30B-A3B
at decode.max_tokens >= 16). Rows are rewritten only after every earlier reader on the stream (graph edges).
Eager forwards (not captured) keep the SM copy: a conditional node exists only in a graph.

Declined (one ``decode_miss_copy_declined`` event, ``stats()["declined"]["decode_miss_copy:<reason>"]``, the SM
copy serves): ``not_cuda``, ``lookahead`` (it owns the row map), ``scratch_rows`` (X < E), ``probe_failed`` (the
runtime, NVRTC or a one-expert capture at start-up failed or copied wrong bytes; the detail names it).
Counted: ``stats()["compute"]["decode_graph_copy_layers"]`` (layers captured this way) and the bytes of the experts
the copies moved as ``decode_graph_h2d`` (``DecodeResidency.account``).

Measured (H100, 10cf59a; benchmarks/results/HISTORY.md "10cf59a"): correct on the GPU (tests/gpu/test_graph_copy_gpu.py),
and slower than the SM reads it replaces on a host where those ran at ~29 GB/s. 128 IF nodes cost 0.12 ms a layer
with nothing to copy, and their copies ran at 11.7-16.9 GB/s against 46-51 for the copy engine. Decode lost 38-56 %,
and 16-256-token prompts took ~1.6 x as long. So ``decode.miss_copy`` stays ``uva`` by default; this stays an opt-in
experiment, re-measured by benchmarks/conditional_copy.py (on a newer driver, say).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

import torch

from moe_offload import log
from moe_offload.graph_capture import capture

#: the kernel of step 1: one block, E flags in shared memory (E <= MAX_EXPERTS), conditions for experts e0 .. e0 + n - 1
_KERNEL = r"""
extern "C" __device__ __cudart_builtin__ void CUDARTAPI cudaGraphSetConditional(
    cudaGraphConditionalHandle handle, unsigned int value);

struct Handles { unsigned long long h[CHUNK]; };

extern "C" __global__ void routed_miss_rows_IDT(const IDT* ids, int M, const int* table, int E, Handles hs, int e0,
                                                 int n, int* pf, int base) {
  extern __shared__ int seen[];
  for (int e = threadIdx.x; e < E; e += blockDim.x) seen[e] = 0;
  __syncthreads();
  for (int m = threadIdx.x; m < M; m += blockDim.x) {
    long long id = (long long)ids[m];
    if (id >= 0 && id < E) seen[id] = 1;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    int e = e0 + i;
    int need = seen[e] && table[e] < 0;
    pf[e] = need ? base + e : -1;
    cudaGraphSetConditional((cudaGraphConditionalHandle)hs.h[i], need ? 1u : 0u);
  }
}
"""
#: handles per launch, passed by value in the kernel's parameters (2 KiB: inside the classic 4 KiB limit), so the
#: graph node keeps them and nothing outside the graph must stay alive; layers of more experts take more launches
CHUNK = 256
_IDT = {torch.int32: "int", torch.int64: "long long"}
MAX_EXPERTS = 8192  # the kernel's shared flags (4 bytes an expert) stay within 48 KiB
_COND_TYPE_IF = 0  # cudaGraphCondTypeIf
_NODE_TYPE_CONDITIONAL = 13  # cudaGraphNodeTypeConditional
_SET_DEPENDENCIES = 1  # cudaStreamSetCaptureDependencies
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault
_CAPTURE_ACTIVE = 1  # cudaStreamCaptureStatusActive


def routed_miss_rows_reference(ids_TK: torch.Tensor, table_E: torch.Tensor, base: int) -> torch.Tensor:
    """What the kernel writes as ``pf_E`` (int32 ``[E]``): ``base + e`` for an expert routed in ``ids_TK`` (ids outside
    [0, E) ignored) whose ``table_E[e] < 0``, else -1. Its conditions equal ``pf_E >= 0``."""
    E = table_E.shape[0]
    ids = ids_TK.reshape(-1).long()
    ids = ids[(ids >= 0) & (ids < E)]
    seen = torch.zeros(E, dtype=torch.bool, device=table_E.device)
    seen[ids] = True
    need = seen & (table_E < 0)
    return torch.where(need, base + torch.arange(E, device=table_E.device, dtype=torch.int32),
                       torch.full_like(table_E, -1, dtype=torch.int32)).to(torch.int32)


class _ConditionalParams(ctypes.Structure):
    # struct cudaConditionalNodeParams (CUDA 12.4+): handle, type, size, phGraph_out (CUDA 12.8 appends a context)
    _fields_ = [("handle", ctypes.c_ulonglong), ("type", ctypes.c_int), ("size", ctypes.c_uint),
                ("phGraph_out", ctypes.POINTER(ctypes.c_void_p)), ("ctx", ctypes.c_void_p)]


class _NodeParams(ctypes.Structure):
    # struct cudaGraphNodeParams: type, int reserved0[3], a union of 29 long longs, long long reserved2 (256 bytes)
    _fields_ = [("type", ctypes.c_int), ("reserved0", ctypes.c_int * 3), ("conditional", _ConditionalParams),
                ("pad", ctypes.c_longlong * (29 - 4)), ("reserved2", ctypes.c_longlong)]


class _Runtime:
    """The CUDA runtime entry points used here, bound to the libcudart torch loaded (RTLD_NOLOAD)."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path, mode=os.RTLD_NOLOAD | os.RTLD_NOW)
        ver = ctypes.c_int()
        lib.cudaRuntimeGetVersion.argtypes, lib.cudaRuntimeGetVersion.restype = [ctypes.POINTER(ctypes.c_int)], \
            ctypes.c_int
        if lib.cudaRuntimeGetVersion(ctypes.byref(ver)) or ver.value < 12040:
            raise RuntimeError(f"CUDA runtime {ver.value} has no conditional graph nodes (12.4 and later have them)")
        self.version = ver.value
        new = ver.value >= 13000  # CUDA 13 folded the _v2 / _v3 signatures into the plain names
        vp, ci, cu, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
        pp = ctypes.POINTER(vp)

        def fn(name, args):
            f = getattr(lib, name)
            f.argtypes, f.restype = args, ci
            return f

        self.capture_info = fn("cudaStreamGetCaptureInfo" if new else "cudaStreamGetCaptureInfo_v3",
                               [vp, ctypes.POINTER(ci), ctypes.POINTER(ctypes.c_ulonglong), pp,
                                ctypes.POINTER(pp), pp, ctypes.POINTER(sz)])
        self.handle_create = fn("cudaGraphConditionalHandleCreate", [ctypes.POINTER(ctypes.c_ulonglong), vp, cu, cu])
        self.add_node = fn("cudaGraphAddNode" if new else "cudaGraphAddNode_v2",
                           [pp, vp, pp, vp, sz, ctypes.POINTER(_NodeParams)])
        self.add_memcpy = fn("cudaGraphAddMemcpyNode1D", [pp, vp, pp, sz, vp, vp, sz, ci])
        self.update_deps = fn("cudaStreamUpdateCaptureDependencies" if new
                              else "cudaStreamUpdateCaptureDependencies_v2", [vp, pp, vp, sz, cu])
        self.last_error = fn("cudaGetLastError", [])
        self.error_name = lib.cudaGetErrorName
        self.error_name.argtypes, self.error_name.restype = [ci], ctypes.c_char_p

    def capture_state(self, stream: ctypes.c_void_p):
        """``(graph, deps)`` of ``stream``'s capture in progress: the graph it captures into and a copy of its current
        dependency nodes (the runtime's own array is valid only until the next call on the stream)."""
        status, graph = ctypes.c_int(), ctypes.c_void_p()
        deps, n = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
        self.check(self.capture_info(stream, ctypes.byref(status), None, ctypes.byref(graph), ctypes.byref(deps),
                                     None, ctypes.byref(n)), "cudaStreamGetCaptureInfo")
        if status.value != _CAPTURE_ACTIVE:
            raise RuntimeError("GraphMissCopy.enqueue needs a stream capture in progress")
        return graph, (ctypes.c_void_p * n.value)(*[deps[i] for i in range(n.value)])

    def check(self, err: int, what: str) -> None:
        if err:
            self.last_error()  # clear it, or torch reports it at its next launch
            name = self.error_name(err)
            raise RuntimeError(f"{what} failed: {name.decode() if name else err} ({err})")


_lock = threading.Lock()
_kernels: dict = {}


def kernel_source(dtype: torch.dtype) -> tuple[str, str]:
    """``(source, name)`` of the kernel for routed ids of ``dtype`` (int32 or int64)."""
    name = f"routed_miss_rows_{_IDT[dtype].replace(' ', '_')}"
    src = _KERNEL.replace("routed_miss_rows_IDT", name).replace("const IDT*", f"const {_IDT[dtype]}*")
    return src.replace("CHUNK", str(CHUNK)), name


def _kernel(dtype: torch.dtype):
    """The NVRTC-compiled kernel for routed ids of ``dtype`` (cached per process)."""
    with _lock:
        if dtype not in _kernels:
            _kernels[dtype] = torch.cuda._compile_kernel(*kernel_source(dtype))
        return _kernels[dtype]


class _Handles(ctypes.Structure):
    _fields_ = [("h", ctypes.c_ulonglong * CHUNK)]


def _launch(kernel, stream, shared: int, ids, table, E: int, handles: list[int], e0: int, pf_E, base: int) -> None:
    """One launch of the kernel for experts ``e0 .. e0 + len(handles) - 1`` on ``stream`` (driver API: the handles
    travel by value, which ``torch.cuda._compile_kernel``'s own call cannot pass)."""
    lib = torch.cuda._utils._get_gpu_runtime_library()
    hs = _Handles()
    for i, h in enumerate(handles):
        hs.h[i] = h
    vals = [ctypes.c_void_p(ids.data_ptr()), ctypes.c_int(ids.numel()), ctypes.c_void_p(table.data_ptr()),
            ctypes.c_int(E), hs, ctypes.c_int(e0), ctypes.c_int(len(handles)), ctypes.c_void_p(pf_E.data_ptr()),
            ctypes.c_int(base)]
    params = (ctypes.c_void_p * len(vals))(*[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in vals])
    err = lib.cuLaunchKernel(kernel.func, 1, 1, 1, 256, 1, 1, shared, ctypes.c_void_p(stream.cuda_stream), params,
                             None)
    if err:
        raise RuntimeError(f"cuLaunchKernel(routed_miss_rows) failed: CUresult {err}")


class GraphMissCopy:
    """Step 1 and 2 of the module docstring for one cache; ``enqueue`` under a capture returns ``pf_E``."""

    def __init__(self, store, pool, scratch_base: int, counters):
        self.store, self.pool, self.base, self.counters = store, pool, scratch_base, counters
        self.E = store.num_experts
        self.R = store.bytes_per_expert
        from moe_offload.kernels.batch_memcpy import _mapped_cudart_paths

        paths = _mapped_cudart_paths()
        if not paths:
            raise RuntimeError("no libcudart is mapped into this process")
        self.rt = _Runtime(paths[0])
        self.pf_LE = torch.full((len(store.layers), self.E), -1, dtype=torch.int32, device=pool.device)

    def enqueue(self, layer: int, table_E: torch.Tensor, ids_TK: torch.Tensor) -> torch.Tensor:
        """Under a stream capture on the current stream: the kernel and the E IF-copy nodes of ``layer``; returns the
        layer's ``pf_E`` (written at replay, before the nodes after these read it)."""
        rt, E, R = self.rt, self.E, self.R
        stream = torch.cuda.current_stream()
        s = ctypes.c_void_p(stream.cuda_stream)
        graph, _ = rt.capture_state(s)
        handles = []
        for _ in range(E):
            h = ctypes.c_ulonglong()
            rt.check(rt.handle_create(ctypes.byref(h), graph, 0, 0), "cudaGraphConditionalHandleCreate")
            handles.append(h.value)
        lp = self.pool.layer_pos[layer]
        pf_E = self.pf_LE[lp]
        ids = ids_TK.reshape(-1)
        if ids.dtype not in _IDT:
            ids = ids.to(torch.int64)
        ids = ids.contiguous()
        table = (table_E if table_E.dtype == torch.int32 else table_E.to(torch.int32)).contiguous()
        for e0 in range(0, E, CHUNK):
            _launch(_kernel(ids.dtype), stream, 4 * E, ids, table, E, handles[e0:e0 + CHUNK], e0, pf_E, self.base)
        _, kdeps = rt.capture_state(s)  # the kernel node(s) just captured
        host = self.store.rows(layer)
        dst = self.pool.rows_NR
        conds = (ctypes.c_void_p * E)()
        for e in range(E):
            p = _NodeParams()
            p.type = _NODE_TYPE_CONDITIONAL
            p.conditional.handle = handles[e]
            p.conditional.type = _COND_TYPE_IF
            p.conditional.size = 1
            node = ctypes.c_void_p()
            rt.check(rt.add_node(ctypes.byref(node), graph, kdeps, None, len(kdeps), ctypes.byref(p)),
                     "cudaGraphAddNode(conditional)")
            conds[e] = node.value
            body = ctypes.c_void_p(p.conditional.phGraph_out[0])
            m = ctypes.c_void_p()
            rt.check(rt.add_memcpy(ctypes.byref(m), body, None, 0, ctypes.c_void_p(dst[self.base + e].data_ptr()),
                                   ctypes.c_void_p(host[e].data_ptr()), R, _MEMCPY_DEFAULT),
                     "cudaGraphAddMemcpyNode1D")
        rt.check(rt.update_deps(s, conds, None, E, _SET_DEPENDENCIES), "cudaStreamUpdateCaptureDependencies")
        self.counters.compute["decode_graph_copy_layers"] += 1
        return pf_E


def graph_miss_copy(setting: str, store, pool, scratch_base: int, counters, lookahead: bool):
    """``decode.miss_copy`` resolved: ``(GraphMissCopy, None)`` for ``copy_engine`` where it applies and its start-up
    probe passes, else ``(None, None)`` for ``uva`` or ``(None, reason)`` (declined: one event and a count, which the
    caller books again after each counter reset)."""
    if setting != "copy_engine":
        return None, None
    reason, detail = None, ""
    if pool.device.type != "cuda":
        reason, detail = "not_cuda", f"device {pool.device}: no copy engine"
    elif lookahead:
        reason, detail = "lookahead", "decode.lookahead owns the miss plan's row map"
    elif store.num_experts > MAX_EXPERTS or pool.rows_NR.shape[0] < scratch_base + store.num_experts:
        reason, detail = "scratch_rows", (f"{pool.rows_NR.shape[0] - scratch_base} scratch rows for "
                                          f"{store.num_experts} experts: raise decode.max_tokens so that max_tokens x "
                                          "top-k >= experts")
    if reason is None:
        try:
            g = GraphMissCopy(store, pool, scratch_base, counters)
            _probe(g, store, pool)
            return g, None
        except Exception as exc:  # the runtime, NVRTC or the probe capture: the SM copy serves
            reason, detail = "probe_failed", f"{type(exc).__name__}: {exc}"
    log.event("decode_miss_copy_declined", logging.WARNING, reason=reason, detail=detail,
              change_with="decode.miss_copy=uva")
    counters.declined[f"decode_miss_copy:{reason}"] += 1
    return None, reason


def _probe(g: GraphMissCopy, store, pool) -> None:
    """Capture the first layer with expert 0 routed and missing, replay it, and check the row's bytes and ``pf_E``;
    the scratch row, the row map and the counters are left as they were (nothing reads them between steps)."""
    layer = store.layers[0]
    dev = pool.device
    ids = torch.zeros((1, 1), dtype=torch.int64, device=dev)
    table = torch.full((store.num_experts,), -1, dtype=torch.int32, device=dev)
    table[1:] = 0  # only expert 0 is missing (the others would be read from slot 0, never copied)
    row = pool.rows_NR[g.base]
    keep = row.clone()
    layers_before = g.counters.compute["decode_graph_copy_layers"]
    pf = None
    try:
        row.zero_()
        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.device(dev):
            with capture(graph, torch.cuda.graph_pool_handle(), torch.cuda.Stream(dev)):
                pf = g.enqueue(layer, table, ids)  # a failed capture is ended for the allocator too (capture)
            graph.replay()
        torch.cuda.synchronize(dev)
        want = store.rows(layer)[0].to(dev)
        if not torch.equal(row, want):
            raise RuntimeError("the captured IF-copy left the scratch row unlike host row 0")
        got = pf[:2].tolist()
        if got != [g.base, -1]:
            raise RuntimeError(f"the row map came out {got}, expected [{g.base}, -1]")
    finally:
        row.copy_(keep)
        if pf is not None:
            pf.fill_(-1)
        if layers_before:
            g.counters.compute["decode_graph_copy_layers"] = layers_before
        else:
            g.counters.compute.pop("decode_graph_copy_layers", None)
