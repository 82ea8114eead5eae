"""Counters of the cache and copy paths: hits, misses, bytes per path, evictions, fallbacks, per layer."""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

#: copy paths whose bytes are counted (decode_uva: misses read from mapped host memory by the decode
#: step; decode_lookahead: experts the decode lookahead copied from mapped host memory a layer ahead;
#: decode_h2d: admissions into slots between steps; prefill_routed_h2d: the routed misses of routed fills, staging.py;
#: decode_graph_h2d: routed misses a captured step copied with the copy engine, graph_copy.py)
PATHS = ("decode_uva", "decode_lookahead", "decode_h2d", "prefill_full_h2d", "prefill_miss_h2d", "prefill_routed_h2d",
         "prefill_hit_d2d", "prefill_hit_gather", "decode_graph_h2d")


@dataclass
class LayerCounters:
    """``hits``/``misses``: decode lookups, one per routed (token, expert) pair; ``prefill_*``: experts of
    the staged layers compute used; ``evictions``: experts dropped from slots."""

    hits: int = 0
    misses: int = 0
    routed_experts: int = 0  # distinct experts routed by each decode step, summed over steps
    evictions: int = 0
    prefill_hits: int = 0
    prefill_misses: int = 0
    bytes: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict:
        return {"hits": self.hits, "misses": self.misses, "routed_experts": self.routed_experts,
                "evictions": self.evictions,
                "prefill_hits": self.prefill_hits, "prefill_misses": self.prefill_misses,
                "bytes": {p: int(self.bytes[p]) for p in PATHS}}


class CacheStats:
    """Per-layer counters plus process-level fallbacks; ``snapshot()`` is what ``stats()`` returns."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.layers: dict[int, LayerCounters] = defaultdict(LayerCounters)
        self.hit_d2d_fallbacks: Counter = Counter()
        #: other declined fast paths (e.g. batched H2D copies), per prefill pass, by "path:reason"
        self.declined: Counter = Counter()
        #: prefill expert compute: "graph_replays", "graph_captures", "eager" (moe_offload/graphs.py)
        self.compute: Counter = Counter()
        self.prefills = 0
        self.decode_steps = 0
        #: host seconds in decode step boundaries (``cache.step_boundary``: commits and admissions, their waits for
        #: copies in flight included): work the GPU waits for between two steps
        self.decode_boundary_s = 0.0

    def layer(self, layer: int) -> LayerCounters:
        return self.layers[layer]

    def fallback(self, reason: str) -> None:
        self.hit_d2d_fallbacks[reason] += 1

    def snapshot(self) -> dict:
        total = LayerCounters()
        for c in self.layers.values():
            total.hits += c.hits
            total.misses += c.misses
            total.routed_experts += c.routed_experts
            total.evictions += c.evictions
            total.prefill_hits += c.prefill_hits
            total.prefill_misses += c.prefill_misses
            total.bytes.update(c.bytes)
        t = total.as_dict()
        lookups = t["hits"] + t["misses"]
        plookups = t["prefill_hits"] + t["prefill_misses"]
        return {
            "total": t,
            "hit_rate": t["hits"] / lookups if lookups else None,
            "prefill_hit_rate": t["prefill_hits"] / plookups if plookups else None,
            "hit_d2d_fallbacks": dict(self.hit_d2d_fallbacks),
            "declined": dict(self.declined),
            "compute": dict(self.compute),
            "prefills": self.prefills,
            "decode_steps": self.decode_steps,
            "decode_boundary_s": self.decode_boundary_s,
            "per_layer": {layer: c.as_dict() for layer, c in sorted(self.layers.items())},
        }
