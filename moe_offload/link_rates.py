"""This host's two ways of moving expert rows from pinned host memory to the device, timed on the store itself.

Legend: E experts of a layer, R bytes of one expert row, N rows timed.

- **copy engine** (the staged path, ``staging.py``): ``copy_`` of N whole rows, one DMA;
- **SM reads** (the routed path, ``decode_miss.serve_misses``): the decode path's own miss copy, SMs reading the
  rows' mapped (UVA) device view into device rows.

Why measure them at all: the routed-vs-staged cost model (``prefill_path.py``) divides missed bytes by these two
rates, and the second one depends on the host, not on the GPU. On two H100 hosts with the same GPU, driver and
copy-engine rate (49-55 GB/s), ``serve_misses`` read 46-47 GB/s on one and 25.7 GB/s on the other (8bcd799 and
de3b3ad, ``benchmarks/results/decode-qwen3-30b-a3b-de3b3ad-r0.37-h100b.md``), and the decode cells with many
misses (batch 16 and 64) ran at 1.00-1.06 x the floor that rate sets. A table keyed by GPU name cannot know this,
so a cache measures both rates once at start-up (``prefill.measure_link``; tens of ms once the copy kernels are
compiled) and decides with them (``link_model``: the table's model with the two measured rates in place of its
own). Each rate is the slope between two sizes (:class:`LinkRates`).
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, replace

import torch

from moe_offload import log
from moe_offload.prefill_path import CostModel, cost_model

LINK_ROWS = 32  # rows of the larger timed copy (85 MB of Qwen3-30B-A3B NVFP4 rows; the smaller one takes a quarter)
LINK_REPS = 5
LINK_WARMUP = 3  # untimed copies first: at b703e18 one was too few on a fast H100 host (h2d 40-45 GB/s at start-up
# against 55.0 for the bench's 1 GiB copy in the same run, benchmarks/results/HISTORY.md "e9c32fa / 9867ced / b703e18")
#: whole measurements a start-up makes; each rate is their median. At 74b55da one of four caches on a fast H100
#: measured the copy engine at 28.75 GB/s (55 in the other three and in the bench's 1 GiB copy) and its cost model
#: then kept batch 64 at residency 0.37 routed; another measured SM reads at 0.77 x the copy engine's rate (0.88-0.90
#: in the others), i.e. a slow host (benchmarks/results/HISTORY.md "74b55da"). A rate is a slope, so a disturbed
#: smaller copy raises it: the median, not the maximum, drops one outlier either way. Each round costs ~30-40 ms on an
#: H100
LINK_ROUNDS = 3
LINK_MIN_BYTES = 16 << 20  # below this the larger copy is mostly fixed cost (a 2.65 MB expert: ~60 us at 45 GB/s)


def time_reps(fn, device: torch.device, reps: int, warmup: int = 1) -> list[float]:
    """Seconds of each of ``reps`` calls of ``fn()`` after ``warmup`` untimed calls (compiles, a link waking from
    idle): CUDA events on the current stream on CUDA, ``perf_counter`` elsewhere."""
    times = []
    for rep in range(reps + warmup):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()  # a measurement: the host waits for its own events
            t = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            fn()
            t = time.perf_counter() - t0
        if rep >= warmup:
            times.append(t)
    return times


class LinkError(RuntimeError):
    """A measurement copied the wrong bytes (the rows read back differ from the store's)."""


def sm_read_times(store, layer: int, device: torch.device, rows: int, reps: int) -> tuple[list[float], int]:
    """``(seconds per rep, bytes per rep)`` of the decode path's miss copy of the first ``rows`` experts of
    ``layer``, all missing, from the pinned store into device rows (``serve_misses`` over the mapped view on CUDA;
    the reference copy elsewhere). Checks the last row's bytes. Raises ``uva.UvaError`` where the device cannot
    map the store, ``LinkError`` on wrong bytes."""
    from moe_offload.kernels.decode_miss import serve_misses, serve_misses_reference

    host_ER = store.device_rows(layer, device)
    n = min(rows, host_ER.shape[0])
    pool_NR = torch.empty((n, host_ER.shape[1]), dtype=torch.uint8, device=device)
    slot_of_E = torch.full((host_ER.shape[0],), -1, dtype=torch.int32, device=device)
    ids_N1 = torch.arange(n, device=device).view(n, 1)
    copy = serve_misses if device.type == "cuda" else serve_misses_reference
    times = time_reps(lambda: copy(slot_of_E, ids_N1, host_ER, pool_NR, 0), device, reps, LINK_WARMUP)
    _check_row(pool_NR[n - 1], store.rows(layer)[n - 1], f"the SM read of layer {layer}, expert {n - 1}")
    return times, n * host_ER.shape[1]


def copy_engine_times(store, layer: int, device: torch.device, rows: int, reps: int) -> tuple[list[float], int]:
    """``(seconds per rep, bytes per rep)`` of one ``copy_`` of the first ``rows`` experts of ``layer`` from the
    pinned store to the device (the copy engine on CUDA). Checks the last row's bytes."""
    host_NR = store.rows(layer)[:rows]
    dev_NR = torch.empty(host_NR.shape, dtype=torch.uint8, device=device)
    times = time_reps(lambda: dev_NR.copy_(host_NR, non_blocking=True), device, reps, LINK_WARMUP)
    n = host_NR.shape[0]
    _check_row(dev_NR[n - 1], host_NR[n - 1], f"the copy-engine copy of layer {layer}, expert {n - 1}")
    return times, host_NR.numel()


def _check_row(got_R: torch.Tensor, want_R: torch.Tensor, what: str) -> None:
    if not torch.equal(got_R.cpu(), want_R):  # a start-up measurement, not a hot path: the sync is fine
        raise LinkError(f"{what} gave wrong bytes: the link measurement is void (the decode path's copies would be "
                        "wrong too); check the device and driver")


@dataclass(frozen=True)
class LinkRates:
    """Both rates in GB/s (1e9 B/s): the slope between ``rows // 4`` and ``rows`` rows of ``row_bytes`` each (the
    fastest of ``reps`` at each size, after ``LINK_WARMUP`` untimed ones: the rep least disturbed by the rest of the
    host), so that a copy's fixed cost (launches, the first bytes' latency), which the cost model carries apart
    (``uva_fixed_s``), does not lower the rate."""

    h2d_GBps: float
    uva_GBps: float
    rows: int
    row_bytes: int
    reps: int
    layer: int
    h2d_rounds_GBps: tuple[float, ...] = ()  # each kept round's rate (``LINK_ROUNDS``); the rate is their median
    uva_rounds_GBps: tuple[float, ...] = ()

    def to_dict(self) -> dict:
        return asdict(self)


class LinkUnmeasurable(RuntimeError):
    """The store is too small for a rate to stand out of the timing noise (or the two sizes timed out of order)."""


def link_bytes(store, rows: int = LINK_ROWS) -> int:
    """Bytes of the larger of the two timed copies."""
    return min(rows, store.num_experts) * store.bytes_per_expert


def _slope(times, small: int, large: int, what: str) -> float:
    (t_small, b_small), (t_large, b_large) = [(min(t), b) for t, b in (times(small), times(large))]
    if t_large <= t_small:
        raise LinkUnmeasurable(f"{what}: {b_large} bytes took no longer than {b_small} ({t_large:.6f} vs "
                               f"{t_small:.6f} s): timing noise")
    return (b_large - b_small) / (t_large - t_small) / 1e9


def measure_link(store, device: torch.device, rows: int = LINK_ROWS, reps: int = LINK_REPS,
                 min_bytes: int = LINK_MIN_BYTES, rounds: int | None = None) -> LinkRates:
    """Both rates on the store's first MoE layer (see the module docstring and :class:`LinkRates`), each the median
    of ``rounds`` (``LINK_ROUNDS``) measurements; a round whose timing is out of order is dropped. Raises
    ``LinkUnmeasurable`` where ``rows`` rows hold fewer than ``min_bytes`` (tiny test models: latency, not rate)
    or every round's timing is out of order, ``uva.UvaError`` where the device cannot map the store and
    ``LinkError`` on wrong bytes; the temporary device rows are freed on return."""
    rounds = LINK_ROUNDS if rounds is None else rounds
    if rounds < 1:
        raise ValueError(f"rounds={rounds}: a measurement needs at least one round")
    if link_bytes(store, rows) < min_bytes:
        raise LinkUnmeasurable(f"{link_bytes(store, rows)} bytes in {min(rows, store.num_experts)} expert rows, "
                               f"fewer than the {min_bytes} a rate needs")
    layer, n = store.layers[0], min(rows, store.num_experts)
    small = max(1, n // 4)
    if device.type == "cuda":
        # Work already queued on the device shares the link with the timed copies: a cache built while another
        # one's admissions were still crossing PCIe read the copy engine at 28.7 against 54.8 GB/s (median of three
        # rounds, so a decode path chosen on half the link; benchmarks/results/HISTORY.md "04e15c0"). A start-up
        # measurement may wait for it.
        torch.cuda.synchronize(device)
    # A rate is a slope between two sizes: interference with the larger copy lowers it, with the smaller one raises
    # it, so the median of the rounds, not an extreme, stands for the link
    uva_r, h2d_r, noise = [], [], []
    for _ in range(rounds):
        try:
            uva_r.append(_slope(lambda k: sm_read_times(store, layer, device, k, reps), small, n, "the SM reads"))
            h2d_r.append(_slope(lambda k: copy_engine_times(store, layer, device, k, reps), small, n,
                                "the copy engine"))
        except LinkUnmeasurable as exc:  # one disturbed round: the others decide
            noise.append(str(exc))
            del uva_r[len(h2d_r):]  # the round's SM-read rate, where its copy-engine timing was the disturbed one
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the temporary rows must not shrink what the budget plan sees as free
    if not h2d_r:
        raise LinkUnmeasurable(f"every one of {rounds} rounds was out of order; the last: {noise[-1]}")
    return LinkRates(h2d_GBps=statistics.median(h2d_r), uva_GBps=statistics.median(uva_r), rows=n,
                     row_bytes=store.bytes_per_expert, reps=reps, layer=layer, h2d_rounds_GBps=tuple(h2d_r),
                     uva_rounds_GBps=tuple(uva_r))


#: SM reads below this share of the copy engine's rate get a hint in ``link_rates_measured`` (and ``routed_copy``'s
#: ``auto`` weighs routed fills): 0.78 sits between the 0.85 of the fast H100 host at 8bcd799 (46.8 vs 54.9 GB/s) and
#: the 0.57-0.72 that start-up measurements gave on a slow one at 10cf59a (27.5-29.2 GB/s of SM reads, the copy
#: engine read low at 40.8-50.6 against ~53 for the bench's 1 GiB copy; 0.6 until then, at or above which 10 of
#: that host's 12 bench caches measured it; benchmarks/results/HISTORY.md "10cf59a")
SLOW_SM_READS = 0.78


def link_model(store, prefill_cfg, device, fused_decode: bool, tensor_parallel: bool
               ) -> tuple[tuple[CostModel, str] | None, dict | None]:
    """``(model, link)``: with ``prefill.measure_link`` where the cost model decides (``routed_max_tokens`` auto, CUDA,
    the fused NVFP4 decode compute), the table's model for this GPU and shape with this host's copy-engine and
    SM-read rates measured on the store (``measure_link``) in place of the table's, and what was
    measured; ``(None, why not)`` elsewhere (the table's model then decides, as before). Under tensor parallelism
    nothing is measured: every rank must choose the same path, and ranks measure different rates; nor on a store
    whose rows are too small to time (tiny test models). A device that cannot map the store, or timings out of
    order, decline with one ``link_measure_declined`` event (``stats()['declined']``); wrong bytes raise
    ``LinkError``."""
    if prefill_cfg.routed_max_tokens != "auto" or device.type != "cuda" or not (fused_decode and
                                                                                 store.format.is_quantized):
        return None, None
    if not prefill_cfg.measure_link:
        return None, {"off": "prefill.measure_link is false"}
    if tensor_parallel:
        return None, {"off": "tensor parallelism (every rank must choose the same path)"}
    if link_bytes(store) < LINK_MIN_BYTES:
        return None, {"off": f"the store's rows are too small to time a rate ({link_bytes(store)} bytes timed, "
                              f"{LINK_MIN_BYTES} needed)"}
    model = cost_model(torch.cuda.get_device_name(device), store.num_experts, store.geometry.top_k,
                       store.bytes_per_expert)
    return measured_link_model(store, device, model)


def measured_link_model(store, device, model: tuple[CostModel, str]) -> tuple[tuple[CostModel, str] | None, dict]:
    """``link_model``'s measurement (any device; the CPU tests run the reference copy): ``model`` with the rates
    measured on ``store`` in place of its ``h2d_GBps`` / ``uva_GBps`` and one ``link_rates_measured`` event, or
    ``(None, declined)`` with one ``link_measure_declined`` event where the device cannot map the store or the
    timing is out of order."""
    from moe_offload import uva

    model, entry = model
    try:
        rates = measure_link(store, device)
    except (uva.UvaError, LinkUnmeasurable) as exc:
        reason = "uva_unavailable" if isinstance(exc, uva.UvaError) else "unmeasurable"
        log.log_once(f"link_measure_declined:{reason}", "link_measure_declined", logging.WARNING, reason=reason,
                     fallback="the table's rates", detail=str(exc)[:300], setting="prefill.measure_link")
        return None, {"declined": reason, "detail": str(exc)[:300]}
    link = {**rates.to_dict(), "table_h2d_GBps": model.h2d_GBps, "table_uva_GBps": model.uva_GBps}
    if _slow_sm_reads(link)[0]:
        link["hint"] = (f"this host's SM reads of mapped memory run at {rates.uva_GBps / rates.h2d_GBps:.2f} x its "
                        "copy engine's rate: decode steps with many misses (large batches at low residency) stage "
                        "over the copy engine where the cost model says it pays (decode.path: host or auto); short "
                        "prompts get their misses over the copy engine where that pays (prefill.routed_copy: auto)")
    log.info_rank0("link_rates_measured", h2d_GBps=round(rates.h2d_GBps, 2), uva_GBps=round(rates.uva_GBps, 2),
                   table_h2d_GBps=model.h2d_GBps, table_uva_GBps=model.uva_GBps, entry=entry, rows=rates.rows,
                   hint=link.get("hint"), change_with="prefill.measure_link")
    return (replace(model, h2d_GBps=rates.h2d_GBps, uva_GBps=rates.uva_GBps), f"{entry} (link measured)"), link


#: a routed fill's per-layer cost beyond its copy (the piecewise stretch boundary, the host sync on the layer's routed
#: ids, the host's planning and launches): 0.28 / 0.26 ms on an H100 at b703e18, from 16 / 64-token prompts fully
#: resident (19.5 / 20.6 ms with routed fills against 6.1 / 7.9 ms as one routed graph, 48 layers)
ROUTED_FILL_FIXED_S = 0.28e-3
#: the same with ``prefill.routed_plan: device``: 0.14-0.16 ms a layer on a fast H100 at 65790fb, as TTFT less the routed
#: floor and the compute floor over 48 layers at 16 / 64 tokens, residency 0 / 0.37 (the host plan's runs of the same
#: ABBA gave 0.22-0.30 by the same sum; benchmarks/results/HISTORY.md "feb415a / 65790fb")
ROUTED_FILL_FIXED_S_DEVICE_PLAN = 0.15e-3


def routed_fill_fixed_s(plan: str) -> float:
    """A routed fill's fixed cost a layer under ``prefill.routed_plan`` ``plan`` (host, device or graph). graph is priced
    as device: on the H100 at 700c00c, TTFT less both floors over 48 layers gave 0.15-0.32 ms a layer for graph against
    0.10-0.31 for device, the same within that host's noise (its TTFT was 0.966 x device's on average)."""
    return ROUTED_FILL_FIXED_S_DEVICE_PLAN if plan in ("device", "graph") else ROUTED_FILL_FIXED_S


def routed_copy(setting: str, device: torch.device, link: dict | None) -> tuple[str, str]:
    """``(copy, reason)``: how routed prefill forwards get their missing experts (``prefill.routed_copy``):
    ``"copy_engine"`` (routed fills, ``staging.py``: one host sync a layer, the copy engine's rate), ``"uva"`` (SM
    reads inside the graph) or ``"per_prompt"`` (``auto`` on a host whose SM reads were measured below
    ``SLOW_SM_READS`` x its copy engine's rate: ``routed_fills_pay`` decides per prompt). On the H100 at 9867ced (27.9
    vs 49.6 GB/s) a 16-token prompt at residency 0.37 read its misses at the SM rate: 61.0 ms against 30.4 ms of
    routed bytes at the copy engine's rate. On a fast host (the H100 at b703e18: SM reads at 48.5, copy engine 45.1
    GB/s) routed fills were 3-19 % slower than the routed graph at 16-256 tokens: the host sync a layer costs more
    than the faster copy saves, so ``auto`` keeps SM reads there."""
    if setting != "auto":
        return setting, "setting"
    if device.type != "cuda":
        return "uva", "cpu_device"
    slow, why = _slow_sm_reads(link)
    return ("per_prompt" if slow else "uva"), why


def _slow_sm_reads(link: dict | None) -> tuple[bool, str]:
    """``(slow, reason)``: whether the measured ``link`` puts SM reads below ``SLOW_SM_READS`` x the copy engine's
    rate (False where nothing was measured)."""
    rates = link or {}
    if "uva_GBps" not in rates:
        return False, "no measured link rates (prefill.measure_link)"
    share = rates["uva_GBps"] / rates["h2d_GBps"]
    return share < SLOW_SM_READS, f"SM reads at {share:.2f} x the copy engine's rate"


#: with ``decode.path: host`` on a host with slow SM reads, steps and prompts of up to this many rows stay routed:
#: batch 16 at residency 0.37 tied on the slow host of 9867ced (193.5 ms routed, 197.1 staged), and single prompts of up
#: to 16 tokens keep the routed path (with routed fills on such hosts) that short-prompt TTFT was measured on
HOST_AUTO_MIN_TOKENS = 16
#: the same on a host whose SM reads are fast: on the fast H100 of 74b55da (SM reads 0.88-0.90 x the copy engine's
#: rate) batch 32 at residency 0.5 ran 8 % slower staged (215.7 against 233.6 tok/s) and batch 64 17 % faster (431.2
#: against 367.4; 428.8 against 367.6-368.9 in the call before), benchmarks/results/HISTORY.md "74b55da"
FAST_HOST_AUTO_MIN_TOKENS = 32


def decode_path(setting: str, link: dict | None) -> tuple[str, str]:
    """``(path, reason)``: ``decode.path`` resolved to ``"routed"`` or ``"auto"``. ``"host"`` (the default): ``"auto"``
    on a host whose rates were measured at start-up (``prefill.measure_link``), so that decode steps of more rows than
    the cost model's threshold at those rates stage their missing layers over the copy engine, eagerly; the threshold
    is never below ``decode_path_floor`` (16 rows where SM reads run below ``SLOW_SM_READS`` x the copy engine's rate,
    32 elsewhere). ``"routed"`` where nothing was measured (a CPU, tensor parallelism: every rank must choose the same
    path, an integer ``prefill.routed_max_tokens``). On the slow H100 host of 9867ced (27.9 vs 49.6 GB/s) ``auto``
    took 0.53 / 0.66 / 1.02 x the routed step's time at batch 64 / 32 / 16, residency 0.37; on the fast one of
    74b55da 0.85 x at batch 64 and 1.08 x at batch 32, residency 0.5 (``FAST_HOST_AUTO_MIN_TOKENS``). An embedder
    capturing its own steps needs every step of up to ``decode.max_tokens`` rows routed: ``decode.path: routed``
    (``OffloadMoeCache``'s own default) (benchmarks/results/HISTORY.md "e9c32fa / 9867ced / b703e18", "74b55da")."""
    if setting != "host":  # routed, auto, fills
        return setting, "setting"
    if not link or "uva_GBps" not in link:  # why nothing was measured, where the link says
        return "routed", (f"no measured link rates: {link.get('off') or link.get('declined')}" if link
                          else "no measured link rates (prefill.measure_link)")
    return "auto", _slow_sm_reads(link)[1]


def decode_path_floor(setting: str, link: dict | None) -> int:
    """The lowest routed threshold ``decode.path`` ``setting`` lets ``auto`` reach (``prefill_path.resolve``'s
    ``auto_floor``): for ``host`` ``HOST_AUTO_MIN_TOKENS`` on a host with slow SM reads (``link``, the start-up
    measurement) and ``FAST_HOST_AUTO_MIN_TOKENS`` elsewhere; ``FILLS_MIN_TOKENS`` for ``fills``, 1 for an explicit
    ``auto``."""
    if setting == "host":
        return HOST_AUTO_MIN_TOKENS if _slow_sm_reads(link)[0] else FAST_HOST_AUTO_MIN_TOKENS
    return FILLS_MIN_TOKENS if setting == "fills" else 1


#: ``decode.path: fills`` keeps decode steps of fewer rows routed whatever the cost model says: its uniform routing
#: overestimates a warm cache's misses (a skewed router's hot experts are resident), most of all for few rows, and a
#: step of routed fills pays the fixed cost of a host sync at every layer (48 x ~0.28 ms on Qwen3-30B-A3B against a
#: ~5 ms batch-1 step). A guard, not a measurement: not yet timed on a GPU
FILLS_MIN_TOKENS = 8


def routed_fills_pay(link: dict, missing_experts: float, row_bytes: int, fixed_s: float = ROUTED_FILL_FIXED_S) -> bool:
    """Whether a layer whose routed tokens miss ``missing_experts`` experts of ``row_bytes`` each is cheaper as a
    routed fill (copy engine plus ``fixed_s``, ``routed_fill_fixed_s``) than read by SMs at this host's measured
    rates."""
    moved = missing_experts * row_bytes
    return fixed_s + moved / (link["h2d_GBps"] * 1e9) < moved / (link["uva_GBps"] * 1e9)
