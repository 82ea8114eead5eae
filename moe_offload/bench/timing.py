"""Measurement primitives of the benchmarks: the H2D bandwidth floor (one large copy) and host-side
timers from forward hooks (no device sync)."""

from __future__ import annotations

import statistics
import time

import torch

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


def time_reps(fn, device: torch.device, reps: int = H2D_REPS) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()`` after one untimed call (warm-up, compiles): CUDA events on the
    current stream on CUDA, ``perf_counter`` elsewhere."""
    times = []
    for rep in range(reps + 1):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        if rep:
            times.append(t)
    return times


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
