"""What a failed CUDA graph capture leaves behind on this torch (moe_offload/graph_capture.py cites its output).

A capture on a side stream into a named pool is invalidated by a host read (with and without a random op in it).
Then, printed step by step: the error, which stream is current, whether the allocator still routes to the pool
(``_cuda_endAllocateToPool`` succeeds), whether a random op raises, and whether a new capture works into the same
pool or a new one, on the same stream or a new one. Deliberately raw torch calls, not ``graph_capture.capture``: it
shows what that module has to repair. Needs CUDA; runs in seconds:
``python3 benchmarks/failed_capture_probe.py > probe.txt``. At a21f336 on an H100 (torch 2.11):
benchmarks/results/failed-capture-probe-a21f336-h100.txt.
"""

from __future__ import annotations

import inspect
import sys

import torch


def try_end(pool, tag: str) -> None:
    try:
        torch._C._cuda_endAllocateToPool(0, pool)
        print(tag, "end: ok (was recording)")
    except RuntimeError as e:
        print(tag, "end raised", type(e).__name__, str(e)[:120])


def try_capture(pool, stream: torch.cuda.Stream, tag: str) -> None:
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            z = torch.ones(4, device="cuda") * 2
        graph.replay()
        torch.cuda.synchronize()
        print(tag, "capture ok", z.tolist())
    except RuntimeError as e:
        print(tag, "capture raised", type(e).__name__, str(e)[:160])


def try_random(tag: str) -> None:
    try:
        torch.rand(2, device="cuda")
        print(tag, "rand ok")
    except RuntimeError as e:
        print(tag, "rand raised", str(e)[:100])


def probe(random_op: bool) -> None:
    print("=== variant", "rand" if random_op else "norand")
    x = torch.ones(1024, device="cuda")
    pool = torch.cuda.graph_pool_handle()
    print("pool", pool)
    caller = torch.cuda.current_stream()
    side = torch.cuda.Stream()
    side.wait_stream(caller)
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            y = x * (torch.rand_like(x) if random_op else 1)
            y.sum().item()  # a host read: invalidates the capture
    except RuntimeError as e:
        print("capture failed:", type(e).__name__, str(e)[:200])
    print("current stream is side:", torch.cuda.current_stream() == side, "is caller's:",
          torch.cuda.current_stream() == caller)
    print("capturing:", torch.cuda.is_current_stream_capturing())
    try_end(pool, "first")
    try_end(pool, "second")
    try_random("after ending:")
    try_capture(pool, side, "same pool same stream")
    try_capture(torch.cuda.graph_pool_handle(), side, "new pool same stream")
    try_capture(torch.cuda.graph_pool_handle(), torch.cuda.Stream(), "new pool new stream")
    try_capture(pool, torch.cuda.Stream(), "same pool new stream")
    torch.cuda.set_stream(caller)
    try_capture(pool, torch.cuda.Stream(), "same pool new stream after set_stream(caller)")
    try_random("gen state after:")
    from moe_offload.graph_capture import end_generator_capture

    end_generator_capture(0)  # for the next variant


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    print(torch.__version__)
    print(inspect.getsource(torch.cuda.graphs.graph.__exit__))
    for random_op in (True, False):
        probe(random_op)


if __name__ == "__main__":
    main()
