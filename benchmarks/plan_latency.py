"""Host-side latency of a routed fill's device plan, in parts, without a checkpoint (seconds on a GPU).

A routed fill (``moe_offload/staging.py``, ``prefill.routed_plan: device``) launches the plan program
(``kernels/routed_plan.py``), copies the plan's words into pinned memory, records an event and waits for it, while
the whole device waits for the copy that follows. A 16-token prefill profiled on an H100 (benchmarks/results/HISTORY.md
"2758f41") spent a median ~150 us of host time a layer from the routing's arrival to the copy call, for a program
that does O(N + E) work. This script times each step of that stretch in isolation, median host microseconds over
``--iters`` rounds, on idle streams:

- ``sync_idle``: ``torch.cuda.synchronize()`` with nothing queued (the floor of any wait);
- ``tiny_read``: one elementwise kernel, the words' D2H copy, an event record and its wait (a read's floor);
- ``plan_launch``: ``plan_routed_fill``'s host call alone (the Triton launcher);
- ``plan_read``: the plan, its D2H copy, the record and the wait, as a fill does them;
- ``graph_read``: the plan captured in a CUDA graph, replayed, then the copy, record and wait;
- ``graph_d2h_read``: the plan and the copy both in the graph, replayed, then the record and wait;
- ``mapped_read``: the plan writing its words into mapped pinned host memory (``prefill.routed_plan: graph``'s
  buffers, ``moe_offload/fill_plan.py``), the record and the wait: ``device``'s read without its D2H launch;
- ``mapped_graph_read``: the same program captured in a CUDA graph, replayed, then the record and wait: what a fill
  in a routed-fill prefill graph waits for under ``graph`` (the replay stands for the stretch that ends with it);
- ``plan_back_to_back_us``: device time per launch over 200 launches back to back (the larger of the launcher's
  rate and the program's time);
- ``same_words``: every form's words equal the plain-torch plan's.

    python benchmarks/plan_latency.py --out DIR [--iters 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from moe_offload.fill_plan import RoutedPlanBuffers
from moe_offload.kernels.routed_plan import HEADER, out_words, plan_reference, plan_routed_fill, plan_words

#: (experts, routed ids): Qwen3-30B-A3B at 16 / 256 tokens (top-8), the 512-expert shape at 16 tokens (top-10)
SHAPES = ((128, 128), (128, 2048), (512, 160))


def _median_us(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    out = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return round(statistics.median(out) * 1e6, 2)


def measure(E: int, N: int, iters: int, device: torch.device) -> dict:
    gen = torch.Generator().manual_seed(E + N)
    ids = torch.randint(0, E, (N,), generator=gen).to(device)
    table = torch.where(torch.rand(E, generator=gen) < 0.37, torch.randint(0, 99, (E,), generator=gen), -1)
    table = table.to(torch.int32).to(device)
    dev_P = torch.zeros(plan_words(E), dtype=torch.int64, device=device)
    host_P = torch.zeros(dev_P.shape, dtype=torch.int64, pin_memory=True)
    R, dst, src = 2654224, 0, 1 << 41  # destinations as offsets, as the runtime plans them
    mapped = RoutedPlanBuffers._buffers(E, device, mapped=True)
    if mapped.mapped_P is None:
        raise RuntimeError("pinned host memory could not be mapped on this device: no mapped_read to time")
    ref = plan_reference(ids, table, R, dst, src).cpu()
    runs = int(ref[0])
    spans = [(0, HEADER), (HEADER + 3 * E, out_words(E))] + [(HEADER + k * E, HEADER + k * E + runs) for k in range(3)]

    def same(words) -> bool:
        words = torch.as_tensor(words)
        return all(torch.equal(words[lo:hi], ref[lo:hi]) for lo, hi in spans)

    ev = torch.cuda.Event()
    x = torch.zeros(1024, device=device)

    def launch():
        plan_routed_fill(ids, table, dev_P, R, dst, src)

    def read():
        host_P.copy_(dev_P, non_blocking=True)
        ev.record()
        ev.synchronize()

    def tiny_read():
        x.add_(1)
        read()

    def plan_read():
        launch()
        read()

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # compile outside the capture
        launch()
    torch.cuda.synchronize(device)
    with torch.cuda.stream(side):
        mapped.launch(ids, table, R, src)
    torch.cuda.synchronize(device)
    g_plan, g_both, g_mapped = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_plan, stream=side):
        launch()
    try:  # a D2H copy into torch's pinned memory inside a capture: torch may refuse it (then that row is None)
        with torch.cuda.graph(g_both, stream=side):
            launch()
            host_P.copy_(dev_P, non_blocking=True)
    except RuntimeError as exc:
        print(f"plan_latency: graph_d2h_read not timed: {exc}", file=sys.stderr)
        g_both = None
    with torch.cuda.graph(g_mapped, stream=side):
        mapped.launch(ids, table, R, src)
    torch.cuda.synchronize(device)

    def mapped_read():
        mapped.launch(ids, table, R, src)
        mapped.wait(torch.cuda.current_stream(device))

    def mapped_graph_read():
        g_mapped.replay()
        mapped.wait(torch.cuda.current_stream(device))

    def graph_read():
        g_plan.replay()
        read()

    def graph_d2h_read():
        g_both.replay()
        ev.record()
        ev.synchronize()

    ok = []
    for fn in (plan_read, graph_d2h_read) if g_both is not None else (plan_read,):
        host_P.fill_(-5)
        fn()
        ok.append(same(host_P))
    for fn in (mapped_read, mapped_graph_read):
        mapped.host_P.fill_(-5)
        fn()
        ok.append(same(mapped.host_P))

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(200):
        launch()
    end.record()
    end.synchronize()
    out = {"experts": E, "ids": N, "same_words": all(ok),
           "sync_idle": _median_us(lambda: torch.cuda.synchronize(device), iters),
           "tiny_read": _median_us(tiny_read, iters),
           "plan_launch": _median_us(launch, iters),
           "plan_read": _median_us(plan_read, iters),
           "graph_read": _median_us(graph_read, iters),
           "graph_d2h_read": _median_us(graph_d2h_read, iters) if g_both is not None else None,
           "mapped_read": _median_us(mapped_read, iters),
           "mapped_graph_read": _median_us(mapped_graph_read, iters),
           # back-to-back launches: the larger of the launcher's rate and the program's time
           "plan_back_to_back_us": round(start.elapsed_time(end) * 1e3 / 200, 2)}
    torch.cuda.synchronize(device)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for plan_latency.json")
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("plan_latency: needs CUDA (it times host waits on a GPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())
    rows = [measure(E, N, args.iters, device) for E, N in SHAPES]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "rows": rows}
    (args.out / "plan_latency.json").write_text(json.dumps(report, indent=1))
    for r in rows:
        print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
