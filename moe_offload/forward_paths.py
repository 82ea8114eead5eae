"""Which path each forward of an ``OffloadMoeCache`` takes: routed-only (the decode path), staged, or staged by its
routed misses alone (routed fills, ``staging.py``).

Resolved once as the cache is built (``ForwardPaths._resolve_paths``): this host's link rates (``link_rates.py``,
``prefill.measure_link``) -> ``decode.path``; the budget plan and the routed threshold (``prefill_path.plan_cache``);
the cost model that weighs a staged step's two forms (``decode.path: fills``); ``prefill.routed_copy``. Then per
forward: the fixed threshold, or the observed routing's (``observed_routing.py``, for announced forwards), and
whether a staged forward copies only its routed misses (``routed_fills_for``, ``decode_fills_for``).

A mixin of ``OffloadMoeCache`` (``cache.py``), which it is no use without: it sets the cache's ``plan``,
``routed_path``, ``observed``, ``_fill_model`` and ``_routed_fills``, and reads its ``store``, ``pool``, ``staging``,
``streams`` and ``device``.

Legend: T tokens, K top-k, E experts per layer.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from moe_offload import log
from moe_offload.link_rates import decode_path as resolve_decode_path, decode_path_floor, link_model, routed_copy
from moe_offload.lookahead import lookahead_rows
from moe_offload.prefill_path import CostModel, cost_model as prefill_cost_model, plan_cache


class ForwardPaths:
    """The routed-or-staged decision of an ``OffloadMoeCache``'s forwards (see the module docstring)."""

    def _resolve_paths(self, decode_max_tokens: int, fused_decode: bool, decode_path: str,
                       cost_model: tuple[CostModel, str] | None, observe_routing: bool, lookahead: bool
                       ) -> tuple[CostModel, str] | None:
        """Set ``plan``, ``routed_path`` and ``_fill_model`` from the cache's settings (``OffloadMoeCache.__init__``
        documents the arguments) -> the cost model they were decided with, for ``_observed_routing``: the one given,
        else this host's measured one, else None (the table's entry for this GPU then decides)."""
        store, cache_cfg, prefill_cfg, device = self.store, self.cache_cfg, self.prefill_cfg, self.device
        tp = torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1
        link = None
        if cost_model is None:  # this host's link rates in place of the table's (prefill.measure_link)
            cost_model, link = link_model(store, prefill_cfg, device, fused_decode, tp)
        path_setting = decode_path
        decode_path, path_why = resolve_decode_path(path_setting, link)
        log.info_rank0("decode_path_chosen", path=decode_path, reason=path_why, setting=path_setting,
                       change_with="decode.path")
        self.plan, self.routed_path = plan_cache(store, cache_cfg, prefill_cfg, device, decode_max_tokens,
                                                 fused_decode, decode_path, cost_model, tp, observe_routing,
                                                 lookahead_rows(decode_max_tokens, store) if lookahead else 0,
                                                 decode_path_floor(path_setting, link))
        self._fill_model = None  # decode.path fills: the cost model that weighs a staged step's two forms
        if decode_path == "fills" and self.routed_path.reason == "cost_model":
            self._fill_model = (cost_model or prefill_cost_model(torch.cuda.get_device_name(device), store.num_experts,
                                                                 store.geometry.top_k, store.bytes_per_expert))[0]
        copy, why = routed_copy(prefill_cfg.routed_copy, device, link)
        self.routed_path = replace(self.routed_path, link=link, routed_copy=copy, routed_copy_reason=why,
                                   decode_path_reason=path_why)
        log.info_rank0("prefill_routed_copy_chosen", copy=copy, reason=why, setting=prefill_cfg.routed_copy,
                       change_with="prefill.routed_copy")
        return cost_model

    @property
    def routed_max_tokens(self) -> int:
        """Forwards of at most this many tokens take the routed-only (decode) path; longer ones stage unless
        observed routing routes them (``takes_routed_path``)."""
        return self.routed_path.max_tokens

    def _observed_routing(self, decode_max_tokens: int, cost_model):
        rp = self.routed_path
        if not rp.adaptive_max_tokens:
            return None
        from moe_offload.observed_routing import ObservedRouting
        from moe_offload.prefill_path import AdaptiveRouting, resident_fraction
        from moe_offload.prefill_path import cost_model as table_model

        E, K, R = self.E, self.store.geometry.top_k, self.store.bytes_per_expert
        model = (cost_model or table_model(torch.cuda.get_device_name(self.device), E, K, R))[0]
        resident = resident_fraction(self.num_slots, len(self.store.layers), E)  # the final plan's (scratch rows taken)
        adaptive = AdaptiveRouting(model, E, K, R, resident, rp.max_tokens, rp.adaptive_max_tokens)
        return ObservedRouting(adaptive, self.layers, E, decode_max_tokens, self.device, self.streams)

    # ------------------------------------------------------------------ the path of a forward
    def begin_forward(self, tokens: int, sequences: int) -> bool:
        """An engine's forward of ``tokens`` tokens over ``sequences`` sequences starts -> whether it takes
        the routed path (``observed_routing.py``); ``end_forward`` must follow."""
        if self.observed is None:
            return tokens <= self.routed_max_tokens
        return self.observed.begin(tokens, sequences)

    def end_forward(self, ok: bool = True) -> None:
        if self.observed is not None:
            self.observed.end(ok)

    def takes_routed_path(self, tokens: int) -> bool:
        """Whether an experts call of ``tokens`` tokens reads only its routed experts (else it is staged; a
        routed-fill forward stages only its routed misses)."""
        if self._routed_fills:
            return False
        if self.observed is None:
            return tokens <= self.routed_max_tokens
        return self.observed.routed(tokens)

    def forget_observations(self) -> None:
        """Drop the observed routing spreads (e.g. after a warmup on random ids)."""
        if self.observed is not None:
            self.observed.adaptive.forget()

    def observe_routing(self, layer: int, ids_TK: torch.Tensor) -> None:
        """An experts call's routed ids, for the observed spread (a no-op unless the forward is observed)."""
        if self.observed is not None:
            self.observed.layer(layer, ids_TK)

    # ------------------------------------------------------------------ routed fills
    def routed_fills_for(self, tokens: int, rows: int | None = None) -> bool:
        """Whether a prefill of ``tokens`` tokens (``rows`` rows once padded) that reads only its routed experts gets
        the missing ones over the copy engine, one host sync a layer (routed fills, ``staging.py``), instead of SM
        reads in a graph (``prefill.routed_copy`` resolved): never while every expert is resident (nothing to copy);
        per prompt, ``link_rates.routed_fills_pay`` with the layer's routed misses: as earlier fills of as many rows
        found them (the host learns each fill's routing), else expected (the observed routing's spread for this
        length where learned, else uniform routing, which overestimates a skewed router's misses: a wrong first
        choice corrects itself after one forward)."""
        copy = self.routed_path.routed_copy
        if copy == "uva" or self.holds_every_expert():
            return False
        if copy == "copy_engine":
            return True
        from moe_offload.link_rates import routed_fill_fixed_s, routed_fills_pay
        from moe_offload.prefill_path import distinct, resident_fraction

        missing = self.staging.missing_seen(rows if rows is not None else tokens)
        if missing is None:
            E = self.E
            share = self.observed.adaptive.share(tokens) if self.observed is not None else None
            routed = distinct(tokens * (share or 1.0), E, self.store.geometry.top_k)
            missing = (1.0 - resident_fraction(self.num_slots, len(self.store.layers), E)) * routed
        return routed_fills_pay(self.routed_path.link, missing, self.store.bytes_per_expert,
                                routed_fill_fixed_s(self.staging.plan_in_effect()))

    def decode_fills_for(self, tokens: int) -> bool:
        """Whether a decode step of ``tokens`` rows on the staged path (above the routed threshold) stages only its
        routed misses, one host sync a layer (routed fills, ``staging.py``), rather than whole missing layers:
        ``decode.path: fills`` only, never while every expert is resident; by the cost model
        (``CostModel.fill_s`` against ``staged_s``) with the misses earlier fills of as many rows found, else uniform
        routing's."""
        model = self._fill_model
        if model is None or self.holds_every_expert():
            return False
        from moe_offload.link_rates import routed_fill_fixed_s
        from moe_offload.prefill_path import resident_fraction

        E, K, R = self.E, self.store.geometry.top_k, self.store.bytes_per_expert
        resident = resident_fraction(self.num_slots, len(self.store.layers), E)
        missing = self.staging.missing_seen(tokens)
        return (model.fill_s(tokens, E, K, R, resident, routed_fill_fixed_s(self.staging.plan_in_effect()), missing)
                < model.staged_s(tokens, E, K, R, resident))

    @contextlib.contextmanager
    def routed_fill_forward(self):
        """Experts calls inside take the staged path, whatever their token count (a routed-fill forward being
        captured piecewise: its experts calls split the capture, ``prefill_graph.py``)."""
        saved, self._routed_fills = self._routed_fills, True
        try:
            yield self
        finally:
            self._routed_fills = saved
