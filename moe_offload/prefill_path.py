"""Which forwards read only their routed experts instead of staging whole layers: a per-T cost model
whose constants are data (``prefill_path_table.json``), resolved once per cache.

Legend: T tokens of a forward, K top-k, E experts per layer, L MoE layers, R bytes of one expert row
(this rank's slice under TP), M = T*K routed pairs, D(T) expected distinct routed experts of a layer,
f the resident fraction (slots / (L*E)), m = 1 - f.

A forward of T tokens gets a layer's experts one of two ways:
- **staged** (``staging.py``): every missing expert of the layer crosses PCIe through the copy engine
  one layer ahead, whatever T; the compute dequantizes the whole staged layer (``compute/dequant.py``)
  and runs grouped GEMMs. The copy overlaps the previous layer's compute, so per layer
  ``max(m*E*R / h2d, staged_fixed + staged_hbm_factor * E*R / hbm + staged_pair * M)``;
- **routed-only** (``decode_path.py``, the decode path): resident experts are read in place from their
  slots, the routed missing ones are read by SMs over UVA just in time into scratch rows, and the fused
  NVFP4 decode kernels compute. Nothing overlaps, so per layer
  ``uva_fixed + m*D(T)*R / uva + routed_fixed + routed_hbm_factor * D(T)*R / hbm + routed_pair * M``.

``D(T) = E * (1 - (1 - K/E)^T)`` assumes uniform routing; real routers are skewed (fewer distinct
experts), which only favours the routed path, so the model errs towards staging. Work outside the
experts (attention, norms) is the same on both paths and left out. The routed-only path pays where
few tokens route few experts: a 16-token prompt on 512 experts at top-10 routes at most 160.

``auto`` picks the largest T (up to the entry's ``max_tokens``, the largest T its constants were
measured at) such that routed-only is cheaper for every T' <= T; ``decode.max_tokens`` is a floor
(decode steps must take the routed path: it is the one a CUDA graph can capture) unless ``decode.path`` resolves
to ``auto`` (``host`` does wherever this host's link rates were measured, ``link_rates.decode_path``): then the
model's (or the setting's) threshold stands even below ``decode.max_tokens`` (at least 1, or the setting's floor),
and decode steps of more rows than it run eagerly on the staged path, where the model says a whole missing
layer over the copy engine (55 GB/s, overlapped with the previous layer) beats SM reads of the routed misses
(~48 GB/s, not overlapped): e.g. 64 rows at residency 0.37 on the H200 constants, 3.9 vs 5.3 ms per layer. The threshold is
computed once per cache, sizes the decode scratch rows (``min(threshold * K, E)``) and the routing
record, is logged as one ``prefill_path_chosen`` event and reported by ``cache.stats()``.

**This host's rates (``prefill.measure_link``, the ``auto`` threshold on CUDA only).** ``uva`` and ``h2d`` are not
properties of the GPU: two H100 hosts at 8bcd799/de3b3ad read mapped host memory at 46-47 and 25.7 GB/s with the
same copy engine rate. A cache therefore times both on its own pinned store at start-up and decides with them
(``link_rates.link_model``); the table's other constants stand. Not under tensor parallelism (ranks would measure
different rates and choose different paths).

**Observed routing (``prefill.routed_adaptive_max_tokens``, the ``auto`` threshold only).** Uniform routing is
the worst case; real and synthetic routers are skewed, and a single prompt's tokens route to far fewer experts
than ``D(T)``: the H200 run at d9f7bae (benchmarks/results/prefill-path-check-d9f7bae91dc5.md) measured the
routed path faster up to 256 tokens at residency 0.37 and 0.5 (101-126 ms against 199 ms staged) where the
uniform model's threshold is 19. ``AdaptiveRouting`` therefore learns each prompt length's spread: every
single-sequence forward of more than ``decode.max_tokens`` tokens counts the distinct experts each layer routed
(one ``index_fill_`` per layer into a device mask, one non-blocking copy to the host per forward, read at a
later forward without a sync) and keeps, per power-of-two bucket of T, the share ``s`` with
``D(s*T) = observed`` (1 = uniform). A later single-sequence forward of T tokens, above the fixed threshold and
at most ``routed_adaptive_max_tokens``, takes the routed path when the model with ``D(s*T)`` predicts it cheaper
than staging by ``ADAPTIVE_MARGIN``. An unobserved bucket borrows the share of the nearest smaller observed one
(a skewed router's share falls as T grows, so that overestimates the spread: it errs towards staging), and
before any observation the fixed threshold stands. Off under tensor parallelism (ranks read their copies at
different times and must not choose different paths) and wherever the threshold is not the cost model's.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from moe_offload import log
from moe_offload.config import ROUTED_MAX_TOKENS_LIMIT

TABLE_PATH = Path(__file__).with_name("prefill_path_table.json")
DEFAULT = "default"


def distinct(T: float, E: int, K: int) -> float:
    """``D(T)``: expected distinct experts routed by T tokens at top-K of E (uniform routing)."""
    return E * (1.0 - (1.0 - min(K, E) / E) ** T) if T > 0 else 0.0


@dataclass(frozen=True)
class CostModel:
    """Per-layer costs in seconds (see the module docstring); bandwidths in GB/s (1e9 bytes/s)."""

    h2d_GBps: float
    uva_GBps: float
    uva_fixed_s: float
    hbm_GBps: float
    routed_fixed_s: float
    routed_hbm_factor: float
    routed_pair_s: float
    staged_fixed_s: float
    staged_hbm_factor: float
    staged_pair_s: float
    max_tokens: int

    def staged_s(self, T: int, E: int, K: int, R: int, resident: float) -> float:
        copy = (1.0 - resident) * E * R / (self.h2d_GBps * 1e9)
        return max(copy, self._staged_compute_s(T, E, K, R))

    def _staged_compute_s(self, T: int, experts: float, K: int, R: int) -> float:
        return (self.staged_fixed_s + self.staged_hbm_factor * experts * R / (self.hbm_GBps * 1e9)
                + self.staged_pair_s * T * K)

    def fill_s(self, T: int, E: int, K: int, R: int, resident: float, fixed_s: float,
               missing: float | None = None) -> float:
        """A staged call that copies only its routed misses over the copy engine once its routing is known (a routed
        fill, ``staging.py``): ``fixed_s`` (the host's routing read and planning a layer, ``link_rates.
        ROUTED_FILL_FIXED_S``), the copy and the staged compute over the routed experts, in series (nothing is copied
        ahead). ``missing``: the layer's routed misses when known (earlier fills), else uniform routing's."""
        D = distinct(T, E, K)
        miss = (1.0 - resident) * D if missing is None else float(missing)
        return fixed_s + miss * R / (self.h2d_GBps * 1e9) + self._staged_compute_s(T, D, K, R)

    def routed_s(self, T: int, E: int, K: int, R: int, resident: float, routed: float | None = None) -> float:
        """``routed``: the layer's distinct routed experts when known (observed routing), else ``D(T)``."""
        D = distinct(T, E, K) if routed is None else min(float(routed), float(E))
        missing = (1.0 - resident) * D
        uva = (self.uva_fixed_s + missing * R / (self.uva_GBps * 1e9)) if missing > 0 else 0.0
        compute = self.routed_fixed_s + self.routed_hbm_factor * D * R / (self.hbm_GBps * 1e9) + self.routed_pair_s * T * K
        return uva + compute

    def threshold(self, E: int, K: int, R: int, resident: float, limit: int, fill_fixed_s: float | None = None) -> int:
        """Largest T <= min(limit, max_tokens) with routed-only cheaper than staged for every T' <= T (0: none).
        ``fill_fixed_s``: staged calls may be routed fills (``fill_s``), whichever of the two staged forms is cheaper."""
        best = 0
        for T in range(1, min(limit, self.max_tokens) + 1):
            staged = self.staged_s(T, E, K, R, resident)
            if fill_fixed_s is not None:
                staged = min(staged, self.fill_s(T, E, K, R, resident, fill_fixed_s))
            if self.routed_s(T, E, K, R, resident) >= staged:
                break
            best = T
        return best


_FIELDS = tuple(CostModel.__dataclass_fields__)


@functools.lru_cache(maxsize=4)
def load_table(path: Path = TABLE_PATH) -> dict:
    """``{device: {shape key or "default": entry}}``; raises ValueError naming a bad entry."""
    data = json.loads(Path(path).read_text())
    if data.get("schema") != 1 or not isinstance(data.get("devices"), dict):
        raise ValueError(f"{path}: expected {{'schema': 1, 'devices': {{...}}}}, got keys {sorted(data)}")
    devices = data["devices"]
    if DEFAULT not in devices.get(DEFAULT, {}):
        raise ValueError(f"{path}: needs devices['default']['default'] (the entry for unknown GPUs)")
    for dev, shapes in devices.items():
        if DEFAULT not in shapes:
            raise ValueError(f"{path}: devices[{dev!r}] needs a 'default' entry (shape entries override it)")
        for key in shapes:
            _entry(devices, dev, key, path)  # every entry must resolve to a complete model
    return devices


def shape_key(E: int, K: int, R: int) -> str:
    """Table key of a layer shape: experts, top-k and row bytes (this rank's)."""
    return f"E{E}_K{K}_R{R}"


def _entry(devices: dict, device: str, key: str, path=TABLE_PATH) -> tuple[CostModel, dict]:
    shapes = devices[device]
    merged = {**shapes[DEFAULT], **shapes.get(key, {})}
    try:
        model = CostModel(**{f: merged[f] for f in _FIELDS})
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{path}: devices[{device!r}][{key!r}] is incomplete or malformed ({exc}); "
                         f"an entry (or its device's default) needs {', '.join(_FIELDS)}") from None
    return model, merged


def cost_model(device_name: str, E: int, K: int, R: int, path: Path = TABLE_PATH) -> tuple[CostModel, str]:
    """The model for this GPU and shape and the table entry it came from (``device/shape``)."""
    devices = load_table(path)
    device = device_name if device_name in devices else DEFAULT
    key = shape_key(E, K, R)
    model, _ = _entry(devices, device, key, path)
    return model, f"{device}/{key if key in devices[device] else DEFAULT}"


def scratch_rows(max_tokens: int, K: int, E: int) -> int:
    """Decode scratch rows for forwards of up to ``max_tokens`` tokens: a step's distinct misses."""
    return min(max_tokens * K, E)


def resident_fraction(num_slots: int, layers: int, E: int) -> float:
    return min(1.0, num_slots / max(layers * E, 1))


@dataclass(frozen=True)
class RoutedPath:
    """The resolved choice: forwards of at most ``max_tokens`` tokens take the routed-only path."""

    max_tokens: int
    setting: str | int  # prefill.routed_max_tokens
    decode_max_tokens: int
    reason: str  # "cost_model", "setting", "cpu_device", "row_gather_decode"
    model_tokens: int | None = None  # what the cost model chose before the decode.max_tokens floor
    entry: str | None = None  # table entry (device/shape)
    resident_fraction: float | None = None
    staged_ms_per_layer: dict | None = None  # model estimates at a few T, for the log and stats
    routed_ms_per_layer: dict | None = None
    decode_path: str = "routed"  # decode.path: "auto" lets max_tokens fall below decode_max_tokens
    adaptive_max_tokens: int = 0  # observed routing may route single prompts up to this many tokens (0: off)
    adaptive_off: str | None = None  # why observed routing is off, when the setting asked for it
    link: dict | None = None  # prefill.measure_link: the rates measured (and the table's), or why not measured
    routed_copy: str = "uva"  # prefill.routed_copy resolved: uva, copy_engine or per_prompt (link_rates.routed_copy)
    routed_copy_reason: str = "setting"
    decode_path_reason: str = "setting"  # why decode.path resolved as it did (link_rates.decode_path)

    @property
    def record_tokens(self) -> int:
        """Tokens a routed forward may have: what the routing record and the scratch rows are sized for."""
        return max(self.max_tokens, self.adaptive_max_tokens)

    def to_dict(self) -> dict:
        return asdict(self)


ADAPTIVE_MARGIN = 0.8  # observed routing takes the routed path only where the model predicts it 20% cheaper
_ADAPTIVE_MIN_OBSERVED = 2  # forwards of a bucket before its share is used
_ADAPTIVE_EMA = 0.3


class AdaptiveRouting:
    """Per-prompt-length routing spread observed on this cache and the path decision it drives (see the
    module docstring). Host-only state; ``observe`` takes a forward's distinct routed experts per layer."""

    def __init__(self, model: CostModel, E: int, K: int, R: int, resident: float, fixed_max_tokens: int,
                 max_tokens: int):
        self.model, self.E, self.K, self.R, self.resident = model, E, K, R, resident
        self.fixed_max_tokens, self.max_tokens = fixed_max_tokens, max_tokens
        self.buckets: dict[int, list] = {}  # bucket -> [share EMA, forwards observed]
        self.routed = self.staged = 0  # forwards above the fixed threshold, by the path they were given

    def forget(self) -> None:
        self.buckets.clear()

    def reset_counts(self) -> None:
        self.routed = self.staged = 0

    @staticmethod
    def bucket(T: int) -> int:
        return max(0, int(T - 1).bit_length())  # 2^(b-1) < T <= 2^b

    def effective_tokens(self, distinct: float) -> float:
        """``t`` with ``D(t) = distinct`` under uniform routing (``inf`` at or beyond every expert)."""
        E, K = self.E, min(self.K, self.E)
        if distinct <= 0:
            return 0.0
        if distinct >= E - 0.5 or K >= E:
            return math.inf
        return math.log(1.0 - distinct / E) / math.log(1.0 - K / E)

    def observe(self, T: int, distinct_per_layer) -> None:
        d = float(sum(distinct_per_layer)) / max(len(distinct_per_layer), 1)
        share = min(1.0, self.effective_tokens(d) / T) if T > 0 else 1.0
        b = self.bucket(T)
        if b in self.buckets:
            ema, n = self.buckets[b]
            self.buckets[b] = [ema + _ADAPTIVE_EMA * (share - ema), n + 1]
        else:
            self.buckets[b] = [share, 1]

    def share(self, T: int) -> float | None:
        """The spread for a forward of T tokens: its bucket's, else the nearest smaller observed bucket's."""
        b = self.bucket(T)
        seen = [k for k, (_, n) in self.buckets.items() if n >= _ADAPTIVE_MIN_OBSERVED and k <= b]
        return self.buckets[max(seen)][0] if seen else None

    def learned(self, T: int) -> bool:
        """Whether the bucket of T itself has been observed enough to decide its path (no borrowed share)."""
        seen = self.buckets.get(self.bucket(T))
        return seen is not None and seen[1] >= _ADAPTIVE_MIN_OBSERVED

    def routes(self, T: int, count: bool = True) -> bool:
        """Whether a single-sequence forward of T tokens above the fixed threshold takes the routed path
        (``count``: the forward is given that path, counted in ``routed`` / ``staged``)."""
        s = self.share(T) if self.fixed_max_tokens < T <= self.max_tokens else None
        ok = False
        if s is not None:
            m, E, K, R, f = self.model, self.E, self.K, self.R, self.resident
            D = distinct(s * T, E, K) if s < 1.0 else None
            ok = m.routed_s(T, E, K, R, f, D) < ADAPTIVE_MARGIN * m.staged_s(T, E, K, R, f)
        if count and T > self.fixed_max_tokens:
            if ok:
                self.routed += 1
            else:
                self.staged += 1
        return ok

    def to_dict(self) -> dict:
        return {"max_tokens": self.max_tokens, "margin": ADAPTIVE_MARGIN, "routed_forwards": self.routed,
                "staged_forwards": self.staged,
                "share_by_tokens": {f"<={1 << b}": {"share": round(v[0], 4), "forwards": v[1]}
                                    for b, v in sorted(self.buckets.items())}}


def _estimates(model: CostModel, E: int, K: int, R: int, f: float) -> tuple[dict, dict]:
    ts = (1, 16, 64, 256, 1024)
    return ({str(t): round(model.staged_s(t, E, K, R, f) * 1e3, 4) for t in ts},
            {str(t): round(model.routed_s(t, E, K, R, f) * 1e3, 4) for t in ts})


def resolve(setting: str | int, decode_max_tokens: int, E: int, K: int, R: int, resident: float, device,
            fused_decode: bool, decode_path: str = "routed", adaptive_max_tokens: int = 0,
            model: tuple[CostModel, str] | None = None, auto_floor: int = 1, routed_plan: str = "host") -> RoutedPath:
    """The routed-only threshold of a cache (see the module docstring); logs ``prefill_path_chosen``.
    ``decode_path`` "auto" (or "fills": staged steps may be routed fills, which the model weighs too): a setting or
    the cost model may put the threshold below ``decode_max_tokens``
    (never below 1: a one-token step always reads only its routed experts); without a model (a CPU, the
    unfused decode compute) the threshold stays ``decode_max_tokens``. ``adaptive_max_tokens``
    (``prefill.routed_adaptive_max_tokens``): observed routing may route single prompts up to it (cost model
    thresholds only; the caller turns it off under tensor parallelism). ``model``: ``(CostModel, entry)`` to
    decide with instead of the table's entry for this GPU (a GPU measured elsewhere, or a CPU test). ``auto_floor``:
    the lowest threshold ``auto`` may reach (``link_rates.decode_path_floor``: for ``decode.path: host`` 16 rows on a
    host with slow SM reads, 32 elsewhere). ``routed_plan``: ``prefill.routed_plan``, which sets a fill's fixed cost."""
    if decode_path not in ("routed", "auto", "fills"):
        raise ValueError(f"decode_path {decode_path!r}: resolve it first (routed, auto or fills; link_rates.decode_path)")
    floor = decode_max_tokens
    lowest = floor if decode_path == "routed" else max(1, min(floor, auto_floor))
    if setting != "auto":
        choice = RoutedPath(max(lowest, int(setting)), setting, floor, "setting", decode_path=decode_path)
    elif model is not None or (device.type == "cuda" and fused_decode):
        if model is None:
            import torch

            model = cost_model(torch.cuda.get_device_name(device), E, K, R)  # host-side property, no sync
        model, entry = model
        fill_fixed_s = None
        if decode_path == "fills":
            from moe_offload.link_rates import routed_fill_fixed_s  # it imports this module

            fill_fixed_s = routed_fill_fixed_s(routed_plan)
        chosen = model.threshold(E, K, R, resident, ROUTED_MAX_TOKENS_LIMIT, fill_fixed_s)
        staged, routed = _estimates(model, E, K, R, resident)
        top = max(lowest, chosen)
        adapt = adaptive_max_tokens if adaptive_max_tokens > top else 0
        choice = RoutedPath(top, setting, floor, "cost_model", chosen, entry, round(resident, 4), staged, routed,
                            decode_path, adapt, None if adapt or not adaptive_max_tokens
                            else f"the cost model's threshold {top} is at least prefill.routed_adaptive_max_tokens")
    elif device.type != "cuda":
        # no PCIe link, no UVA: both paths are host copies and the table's constants are GPU measurements
        choice = RoutedPath(floor, setting, floor, "cpu_device", resident_fraction=resident, decode_path=decode_path)
    else:
        # the unfused decode compute gathers T*K expert rows (compute/decode.py): not modelled, and it grows
        # with T where the staged path does not
        choice = RoutedPath(floor, setting, floor, "row_gather_decode", resident_fraction=resident,
                            decode_path=decode_path)
    if choice.reason != "cost_model" and adaptive_max_tokens:
        choice = replace(choice, adaptive_off=f"no cost model ({choice.reason})")
    log.info_rank0("prefill_path_chosen", routed_max_tokens=choice.max_tokens, setting=setting,
                   decode_max_tokens=floor, decode_path=decode_path, reason=choice.reason, model_tokens=choice.model_tokens,
                   entry=choice.entry, resident_fraction=choice.resident_fraction, experts=E, top_k=K, row_bytes=R,
                   staged_ms_per_layer=choice.staged_ms_per_layer, routed_ms_per_layer=choice.routed_ms_per_layer,
                   adaptive_max_tokens=choice.adaptive_max_tokens, adaptive_off=choice.adaptive_off,
                   change_with="prefill.routed_max_tokens")
    return choice


def _plan_for(prefill_cfg, device, R: int) -> str:
    """``prefill.routed_plan`` as a fill of ``R``-byte rows will take it: on CUDA rows below the GPU's batched-copy
    minimum decline the device plan (``staging.PrefillStaging.plan_in_effect`` decides per fill)."""
    if prefill_cfg.routed_plan in ("device", "graph") and device.type == "cuda":
        import torch

        from moe_offload.hit_copy import h2d_batch_min_row_bytes

        if R < h2d_batch_min_row_bytes(torch.cuda.get_device_name(device)):
            return "host"
    return prefill_cfg.routed_plan


def plan_cache(store, cache_cfg, prefill_cfg, device, decode_max_tokens: int, fused_decode: bool,
               decode_path: str = "routed", model: tuple[CostModel, str] | None = None, tensor_parallel: bool = False,
               observe_routing: bool = True, extra_rows: int = 0, auto_floor: int = 1):
    """``(BudgetPlan, RoutedPath)`` of a cache: the threshold is chosen at the slot count the budget buys
    with the decode floor's scratch rows, then the plan is redone with the scratch rows it needs (a
    byte or ``auto`` budget then buys slightly fewer slots). ``extra_rows``: pool rows on top of the scratch
    rows (the decode lookahead's), budgeted the same way."""
    from moe_offload.budget import plan_budget

    R, E, L, K = store.bytes_per_expert, store.num_experts, len(store.layers), store.geometry.top_k
    budget, reserve = cache_cfg.budget, cache_cfg.auto_reserve
    base_rows = scratch_rows(decode_max_tokens, K, E) + extra_rows
    plan = plan_budget(store, budget, device, reserve, base_rows)
    adaptive = prefill_cfg.routed_adaptive_max_tokens if observe_routing else 0
    choice = resolve(prefill_cfg.routed_max_tokens, decode_max_tokens, E, K, R,
                     resident_fraction(plan.num_slots, L, E), device, fused_decode and store.format.is_quantized,
                     decode_path, 0 if tensor_parallel else adaptive, model, auto_floor, _plan_for(prefill_cfg, device, R))
    if tensor_parallel and adaptive and choice.reason == "cost_model":
        choice = replace(choice, adaptive_off="tensor parallelism")
    rows = scratch_rows(choice.record_tokens, K, E) + extra_rows
    if rows != base_rows:
        plan = plan_budget(store, budget, device, reserve, rows)
    return plan, choice
