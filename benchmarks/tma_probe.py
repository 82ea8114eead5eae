"""SM-side reads of mapped pinned host memory through the Tensor Memory Accelerator against plain loads and the copy
engine (seconds on a GPU, no checkpoint).

Every path that reads a missing expert inside a CUDA graph (decode steps, routed prefills) has SMs load it from mapped
host memory (``kernels/decode_miss.py``), at 0.84-0.88 x the copy engine's rate on fast H100 hosts and ~0.5 x on slow
ones (``link_rates.measure_link``; benchmarks/results/HISTORY.md). That share bounds issue 12's batch-16 cells with
misses and issue 14's short prompts. This probe asks whether the TMA (``cp.async.bulk.tensor``, Triton tensor
descriptors on sm_90) reads the same memory faster than ``ld.global``: both kernels copy the same mapped rows into
device memory, tile by tile, in a persistent loop of ``--ctas-per-sm`` programs per SM; the copy engine copies them
with one ``copy_``. Each rate is the median of ``--reps`` timed copies (CUDA events) after a warm-up; every copy's
bytes are checked against the source.

    python benchmarks/tma_probe.py --out DIR [--mb 256] [--reps 7]

``miss_copy_row_align`` in the report times the production plain-load copy (``decode_miss.copy_misses``) on 64 rows
shaped as Qwen3-30B-A3B's experts, beside the flat tiles above: rows padded to 16 bytes and to a page, alternated
``ROUNDS`` times (``miss_copy``: the first 16-byte round), and page rows in memory advised for transparent huge
pages, each with the copy engine's rate over the same rows.

Measured on a fast H100 at fdd1739 (benchmarks/results/tma-probe-fdd1739-h100.json): TMA loads equal plain loads
within 1 % in all 12 configs (50.5-51.2 GB/s, 0.92 x the copy engine's 55.4), so the link, not the load instruction,
bounds SM reads of mapped memory. A production miss copy through the TMA (``decode.miss_copy: tma``, 16-line boxes,
built at 618106f) ran at 29.8 GB/s against 48.6 with plain loads and was removed (README Decisions).

The buffer is viewed as rows of ``COLS`` int32 words (1 KiB); a tile is ``rows x COLS``. Off CUDA (CI) the kernels
run in the Triton interpreter on a small buffer with the host tensor itself as the "mapped" view, which checks the
kernels' bytes, not any rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROUNDS = 3  # alternations of the miss copy's two row layouts
COLS = 256  # int32 words per buffer row: 1 KiB, a TMA box's widest inner extent (256 elements)


@triton.jit
def _ldg_copy(src_ptr, dst_ptr, n_tiles, ROWS: tl.constexpr, C: tl.constexpr):
    """Tile t (rows [t*ROWS, (t+1)*ROWS) of C words) with plain loads, programs striding over the tiles."""
    offs = tl.arange(0, ROWS)[:, None] * C + tl.arange(0, C)[None, :]
    for t in range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        base = t * ROWS * C  # int32: --mb is capped at 1024 (2^28 words)
        tl.store(dst_ptr + base + offs, tl.load(src_ptr + base + offs))


@triton.jit
def _tma_copy(src_desc, dst_ptr, n_tiles, ROWS: tl.constexpr, C: tl.constexpr, STAGES: tl.constexpr):
    """The same tiles read through the source's tensor descriptor (TMA on sm_90), stored with plain stores."""
    offs = tl.arange(0, ROWS)[:, None] * C + tl.arange(0, C)[None, :]
    for t in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), num_stages=STAGES):
        tl.store(dst_ptr + t * ROWS * C + offs, src_desc.load([t * ROWS, 0]))


def _mapped_rows(n_rows: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, object]:
    """``(host, view, release)``: page-aligned host rows of random words, registered mapped on CUDA, and the device
    view the kernels read (the host tensor itself off CUDA)."""
    from moe_offload.uva import mapped_device_view, page_aligned, pin_mapped, unpin

    host = page_aligned((n_rows, COLS), torch.int32)
    host.copy_(torch.randint(-2**31, 2**31 - 1, (n_rows, COLS), dtype=torch.int32))
    if device.type != "cuda":
        return host, host, lambda: None
    pin_mapped(host)
    return host, mapped_device_view(host, device), lambda: unpin([host.data_ptr()])


def _time(fn, device: torch.device, reps: int) -> list[float]:
    """Seconds per call: CUDA events on CUDA (one warm-up call first), wall time elsewhere."""
    import time

    fn()
    out = []
    for _ in range(reps):
        if device.type == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
    return out


def probe(mb: int, reps: int, device: torch.device, configs: list[tuple[int, int, int]]) -> dict:
    """Rates (GB/s) of the copy engine, plain loads and TMA loads over the same mapped rows; ``configs`` are
    ``(tile rows, programs per SM, stages)`` for both kernels (stages: the TMA loop's)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    n_rows = max(mb * 1024, 64)
    host, view, release = _mapped_rows(n_rows, device)
    dst = torch.empty((n_rows, COLS), dtype=torch.int32, device=device)
    nbytes = host.numel() * 4
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    rows_out = []

    def check(what: str) -> bool:
        ok = torch.equal(dst.cpu(), host)
        dst.zero_()
        if not ok:
            print(f"{what}: wrong bytes", file=sys.stderr)
        return ok

    try:
        ce = _time(lambda: dst.copy_(view if device.type != "cuda" else host, non_blocking=True), device, reps)
        ce_ok = check("copy engine")
        for rows, per_sm, stages in configs:
            if n_rows % rows:
                continue
            n_tiles, grid = n_rows // rows, (min(n_rows // rows, per_sm * sms),)
            entry = {"tile_rows": rows, "tile_bytes": rows * COLS * 4, "ctas_per_sm": per_sm, "stages": stages}
            try:
                t = _time(lambda: _ldg_copy[grid](view, dst, n_tiles, ROWS=rows, C=COLS, num_warps=4), device, reps)
                entry.update(ldg_GBps=nbytes / statistics.median(t) / 1e9, ldg_ok=check("ldg"))
            except Exception as exc:  # a config this GPU cannot run: recorded, the others go on
                entry["ldg_error"] = f"{type(exc).__name__}: {exc}"[:300]
            try:
                desc = TensorDescriptor.from_tensor(view, [rows, COLS])
                t = _time(lambda: _tma_copy[grid](desc, dst, n_tiles, ROWS=rows, C=COLS, STAGES=stages, num_warps=4),
                          device, reps)
                entry.update(tma_GBps=nbytes / statistics.median(t) / 1e9, tma_ok=check("tma"))
            except Exception as exc:
                entry["tma_error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows_out.append(entry)
            print(json.dumps(entry), flush=True)
    finally:
        release()
    return {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__, "triton": triton.__version__, "bytes": nbytes, "reps": reps,
            "copy_engine_GBps": nbytes / statistics.median(ce) / 1e9, "copy_engine_ok": ce_ok, "configs": rows_out}


def _anon_huge_kb() -> int:
    """This process's anonymous memory backed by transparent huge pages, KiB (0 where the kernel does not say)."""
    try:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("AnonHugePages:"):
                return int(line.split()[1])
    except OSError:
        pass
    return 0


THP_ENABLED_PATH = "/sys/kernel/mm/transparent_hugepage/enabled"
HUGE_PAGE = 2 << 20  # bytes: a transparent huge page on x86-64


def _huge_pages_unavailable() -> str | None:
    """Why memory advised for transparent huge pages would not get them here (None: it would)."""
    import mmap

    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "no_madv_hugepage"
    try:
        mode = Path(THP_ENABLED_PATH).read_text()
    except OSError:
        return "thp_mode_unreadable"
    return "thp_never" if "[never]" in mode else None


def _huge_page_rows(experts: int, row_bytes: int) -> torch.Tensor:
    """Uninitialised rows in an anonymous mapping advised for transparent huge pages (``MADV_HUGEPAGE``), starting
    on a 2 MiB boundary; the tensor keeps the mapping alive (``torch.frombuffer`` holds it)."""
    import mmap

    nbytes = experts * row_bytes
    m = mmap.mmap(-1, -(-nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    m.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(m, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE_PAGE
    return raw[off:off + nbytes].view(experts, row_bytes)


def miss_copy_rates(experts: int, row_bytes: int, reps: int, device: torch.device, huge_pages: bool = False) -> dict:
    """The production miss copy (``decode_miss.copy_misses``, the plan's count read on the device, plain loads at
    its default launch shape) of ``experts`` mapped host rows of ``row_bytes`` (Qwen3-30B-A3B's on a GPU) into
    device rows; ``huge_pages``: the rows in memory advised for transparent huge pages (else page-aligned rows, the
    store's layout), and the copy engine's rate over the same rows beside it."""
    from moe_offload.kernels.decode_miss import MissPlan, copy_misses
    from moe_offload.uva import mapped_device_view, page_aligned, pin_mapped, unpin

    huge_before = _anon_huge_kb()
    host = _huge_page_rows(experts, row_bytes) if huge_pages else page_aligned((experts, row_bytes), torch.uint8)
    host.copy_(torch.randint(0, 256, host.shape, dtype=torch.uint8))
    out = {"experts": experts, "row_bytes": row_bytes, "huge_pages": huge_pages,
           "anon_huge_kb_added": _anon_huge_kb() - huge_before}
    pinned = device.type == "cuda" and pin_mapped(host)
    view = mapped_device_view(host, device) if pinned else host
    pool = torch.empty((experts, row_bytes), dtype=torch.uint8, device=device)
    ids = torch.arange(experts, dtype=torch.int32, device=device)
    plan = MissPlan(ids, ids, torch.tensor([experts], dtype=torch.int32, device=device))
    try:
        t = _time(lambda: copy_misses(plan, view, pool, 0), device, reps)
        out["ldg_GBps"] = experts * row_bytes / statistics.median(t) / 1e9
        out["ldg_ok"] = torch.equal(pool.cpu(), host)
        t = _time(lambda: pool.copy_(host, non_blocking=True), device, reps)
        out["copy_engine_GBps"] = experts * row_bytes / statistics.median(t) / 1e9
    finally:
        if pinned:
            unpin([host.data_ptr()])
    print(json.dumps(out), flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="directory for tma_probe.json")
    ap.add_argument("--mb", type=int, default=256, help="MiB of mapped rows (CPU: at most 1)")
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    if not 1 <= a.mb <= 1024:
        ap.error(f"--mb {a.mb}: 1-1024 (the kernels' word offsets are int32)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda":
        configs = [(r, c, s) for r in (8, 32) for c in (1, 2, 4) for s in (1, 3)]
        mb = a.mb
    else:  # the interpreter: bytes only
        configs, mb = [(8, 1, 1), (32, 1, 3)], min(a.mb, 1)
    result = probe(mb, a.reps, device, configs)
    # the production copy, on rows shaped as the model's (the probe's tiles above are a flat buffer), on rows padded to
    # 16 bytes (the store's layout before 1631575) and to a page (the store's since: host_store.padded_row_bytes, after
    # 46.1 / 47.7 GB/s in one run at 97f3897 on the H200, 48.2 / 50.1 alternated on an H100 at 1631575), and the page
    # rows in memory advised for transparent huge pages (fewer translations for the GPU to walk? no faster on an H100
    # at d87958f, so the store does not offer them: README Decisions), alternated ROUNDS times so that drift falls
    # on every side
    experts, data = (64, 2654220) if device.type == "cuda" else (4, 3 * 1024 + 12)
    sides = {"16": [], "4096": []} | ({} if _huge_pages_unavailable() else {"4096_huge": []})
    for _ in range(ROUNDS if device.type == "cuda" else 1):
        for side in sides:
            al = int(side.split("_")[0])
            sides[side].append(miss_copy_rates(experts, -(-data // al) * al, a.reps, device, side.endswith("huge"))
                               | {"row_align": al})
    result["miss_copy"] = sides["16"][0]
    result["miss_copy_row_align"] = [r for rs in sides.values() for r in rs]
    result["miss_copy_row_align_median_GBps"] = {side: statistics.median(r["ldg_GBps"] for r in rs)
                                                 for side, rs in sides.items()}
    result["miss_copy_copy_engine_median_GBps"] = {side: statistics.median(r["copy_engine_GBps"] for r in rs)
                                                   for side, rs in sides.items()}
    try:
        result["thp_enabled"] = Path(THP_ENABLED_PATH).read_text().strip()
    except OSError:
        result["thp_enabled"] = None
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "tma_probe.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "configs"}))
    ok = (result["copy_engine_ok"] and all(c.get("ldg_ok", True) and c.get("tma_ok", True) for c in result["configs"])
          and all(m["ldg_ok"] for m in [result["miss_copy"], *result["miss_copy_row_align"]]))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
