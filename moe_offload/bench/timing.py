"""Measurement primitives of the benchmarks: the bandwidths their floors divide by (H2D: one large copy; HBM: one
large device copy; the decode path's own miss copy from the pinned store) and host-side timers from forward hooks
(no device sync)."""

from __future__ import annotations

import statistics
import time

import torch

from moe_offload.link_rates import LinkError, sm_read_times, time_reps

H2D_BYTES = {"cuda": 1 << 30, "cpu": 64 << 20}  # CPU: small enough for the CI smoke test
H2D_REPS = 10


def measure_h2d(device: torch.device) -> dict:
    """Host -> device bandwidth of one large copy (median over ``H2D_REPS``), in GB/s (1e9 bytes)."""
    nbytes = H2D_BYTES[device.type]
    times = []
    if device.type == "cuda":
        host = torch.empty(nbytes, dtype=torch.uint8)
        cudart = torch.cuda.cudart()
        torch.cuda.check_error(cudart.cudaHostRegister(host.data_ptr(), nbytes, 0))
        try:
            dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
            stream = torch.cuda.Stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))  # dev was allocated on the current stream
            for rep in range(H2D_REPS + 1):  # rep 0 warms up
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with torch.cuda.stream(stream):
                    start.record(stream)
                    dev.copy_(host, non_blocking=True)
                    end.record(stream)
                end.synchronize()
                if rep:
                    times.append(start.elapsed_time(end) / 1e3)
            del dev
        finally:
            torch.cuda.check_error(cudart.cudaHostUnregister(host.data_ptr()))
        method = "pinned host (cudaHostRegister) -> device, one copy, CUDA events"
    else:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        for rep in range(H2D_REPS + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            if rep:
                times.append(time.perf_counter() - t0)
        method = "cpu device: host memcpy (no PCIe link), perf_counter"
    med = statistics.median(times)
    return {"bytes": nbytes, "reps": H2D_REPS, "median_s": med, "min_s": min(times), "max_s": max(times),
            "GBps": nbytes / med / 1e9, "method": method}


def measure_hbm(device: torch.device) -> dict:
    """Device memory bandwidth from one large device-to-device copy (median of ``H2D_REPS``), counting
    read + write: ``GBps = 2 * bytes / time`` (1e9 bytes). CPU: a host memcpy of the H2D smoke size."""
    nbytes = H2D_BYTES[device.type]
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = time_reps(lambda: dst.copy_(src), device, H2D_REPS)
    del src, dst
    med = statistics.median(times)
    method = ("device -> device copy, CUDA events; read + write counted" if device.type == "cuda"
              else "cpu device: host memcpy, perf_counter; read + write counted")
    return {"bytes": nbytes, "reps": H2D_REPS, "median_s": med, "GBps": 2 * nbytes / med / 1e9, "method": method}


UVA_ROWS = 64  # experts per timed miss copy (~170 MB of Qwen3-30B-A3B NVFP4 rows)


def measure_uva(engine, device: torch.device) -> dict:
    """The rate of the decode path's own miss copy: ``UVA_ROWS`` experts of the store's first MoE layer, all
    missing, read from the pinned store by the runtime's copy (``link_rates.sm_read_times``: SMs reading mapped
    host memory on CUDA; the torch reference copy on a CPU) into device rows, median of ``H2D_REPS`` (CUDA events;
    CPU: perf_counter), in GB/s. The PCIe floor stays the copy engine's (``measure_h2d``); this one says how
    close this host lets the SMs' reads come to it: 46-47 GB/s on one H100 host and 25.7 on another at
    8bcd799/de3b3ad, with the same copy code (benchmarks/results/HISTORY.md)."""
    from moe_offload import uva
    from moe_offload.bench.ttft import BenchError

    layer = engine.store.layers[0]
    try:
        times, nbytes = sm_read_times(engine.store, layer, device, UVA_ROWS, H2D_REPS)
    except uva.UvaError as exc:  # the decode path cannot read host rows here either; the cells will say so
        return {"bytes": 0, "rows": 0, "reps": 0, "median_s": None, "GBps": None, "method": f"not measured: {exc}"}
    except LinkError as exc:
        raise BenchError(str(exc)) from None
    med = statistics.median(times)
    n = nbytes // engine.store.bytes_per_expert
    method = (f"decode_miss.serve_misses of {n} experts of layer {layer} from the pinned store, CUDA events"
              if device.type == "cuda" else f"cpu device: the reference copy of {n} experts, perf_counter")
    return {"bytes": nbytes, "rows": n, "reps": H2D_REPS, "median_s": med, "GBps": nbytes / med / 1e9,
            "method": method}


class HostTimer:
    """Host wall time of the model's forward and of every experts call, from forward hooks.

    The hooks read ``perf_counter`` only (no device sync): on CUDA they measure the Python side that
    enqueues the work (routing, copy issue, GEMM launches), not the device time."""

    def __init__(self, model: torch.nn.Module, experts: list[torch.nn.Module]):
        self.forward_s = self.experts_s = 0.0
        self.experts_calls = 0
        self._t = {}
        self._handles = [model.register_forward_pre_hook(self._pre), model.register_forward_hook(self._post_forward)]
        for m in experts:
            self._handles += [m.register_forward_pre_hook(self._pre), m.register_forward_hook(self._post_experts)]

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

    def reset(self) -> None:
        self.forward_s = self.experts_s = 0.0
        self.experts_calls = 0

    def _pre(self, module, _args) -> None:
        self._t[id(module)] = time.perf_counter()

    def _post_forward(self, module, _args, _out) -> None:
        self.forward_s += time.perf_counter() - self._t.pop(id(module))

    def _post_experts(self, module, _args, _out) -> None:
        self.experts_s += time.perf_counter() - self._t.pop(id(module))
        self.experts_calls += 1
