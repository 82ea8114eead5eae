"""Lookahead prefetch of the decode path (``decode.lookahead``): the next MoE layer's missing experts are
copied while this layer computes.

Legend: L MoE layers (``lp`` = position in ``store.layers``), E experts per layer, T tokens of a step, K top-k,
X rows per parity (``min(decode.max_tokens * K, E)``), R bytes of one expert row.

At MoE layer ``lp`` of a decode step (``T <= decode.max_tokens``):
1. ``take(lp)``, before its misses are served: if this forward predicted layer ``lp`` (at ``lp - 1``), the
   compute stream waits for that copy (``wait_stream`` on the lookahead stream) and gets its row map
   ``row_of_PE[lp % 2]``; the miss server reads the experts it holds from there instead of copying them
   (``kernels/decode_miss.py``, PF).
2. ``issue(lp + 1, hidden_TH)``, after this layer's own misses are enqueued: layer ``lp + 1``'s router
   applied to this layer's MoE input predicts its routing (``router.forward``: the module's hooks, e.g.
   transformers' router-logit recorder, do not see it); on the lookahead stream, after everything queued on
   the compute stream so far, the predicted experts that are not resident are copied by SMs (one CTA per SM,
   leaving the rest to the compute) from mapped host memory into parity ``(lp + 1) % 2``'s X rows
   (``prefetch_misses``), which that layer reads after its own ``take``.

The copy of layer ``lp + 1`` overlaps layer ``lp``'s expert compute and layer ``lp + 1``'s attention; this
layer's own miss copy, on the critical path, is not slowed by it. Parity ``p``'s rows are rewritten two layers later, by a copy that starts after the compute
stream's position, i.e. after the layer that read them. Nothing here syncs the host; in a captured step
the fork and the join are graph edges. Wrong predictions cost bytes over PCIe (counted), never results:
a mispredicted expert is read from host memory in the step as without lookahead, and every row holds the
exact host bytes of its expert, so outputs are bitwise those of the step without lookahead.

Counted per layer (``DecodeResidency.counts_LC`` columns 4 and 5): distinct missing experts read from a
lookahead row (used) and experts the lookahead copied; ``stats()["lookahead"]`` gives recall (used /
distinct missing experts of the layers it predicts, i.e. all but the first) and precision (used / copied).

Enabling it takes 2 x min(decode.max_tokens x K, E) rows from the budget: a byte or fraction budget then buys
fewer slots, which may move ``prefill.routed_max_tokens: auto``'s threshold (chosen from the resident
fraction); logits are bitwise those without the lookahead at the same slots and paths.
"""

from __future__ import annotations

import logging

import torch

from moe_offload import log
from moe_offload.kernels.decode_miss import MissCopyConfig, prefetch_misses, prefetch_misses_reference

#: one CTA per SM for the prefetch copy (the miss server's own copy uses 4): ~130 x 16 KiB reads in flight
#: cover PCIe's latency x bandwidth (~100 KB) and leave the SMs to the compute it overlaps
_COPY = MissCopyConfig(ctas_per_sm=1)


def routers_by_layer(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> its MoE router module (transformers' ``*TopKRouter``/``*TopkRouter``, which return
    ``(logits, weights, ids)`` for every family of ``checkpoint/families.py``)."""
    from moe_offload.integrations.hf import layer_of

    out = {}
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith(("TopKRouter", "TopkRouter")):
            out[layer_of(name)] = mod
    return out


def lookahead_rows(max_tokens: int, store) -> int:
    """Pool rows the lookahead needs: two parities of ``min(max_tokens * K, E)``."""
    return 2 * min(max_tokens * store.geometry.top_k, store.num_experts)


def attach_routers(cache, model: torch.nn.Module) -> None:
    """Give ``cache``'s lookahead (``decode.lookahead``) the routers of ``model``; a no-op when it is off."""
    if cache.decode.lookahead is not None:
        cache.decode.lookahead.set_routers(routers_by_layer(model), cache.counters)


class Lookahead:
    """The lookahead state of one cache's decode path (see the module docstring)."""

    def __init__(self, store, pool, streams, base: int, rows: int, max_tokens: int):
        self.store, self.pool = store, pool
        self.device = pool.device
        self.base, self.rows, self.max_tokens = base, rows, max_tokens
        E = store.num_experts
        self.row_of_PE = torch.full((2, E), -1, dtype=torch.int32, device=self.device)
        self.streams = streams  # its copies run on streams.lookahead(); cache.synchronize() waits for it
        self._routers: dict[int, torch.nn.Module] = {}  # lp -> router of that MoE layer
        # lp -> predicted ids of a prefetch this forward issued and has not taken yet (kept alive until joined:
        # the lookahead stream reads them)
        self._issued: dict[int, torch.Tensor] = {}

    def set_routers(self, routers: dict[int, torch.nn.Module], counters=None) -> list[int]:
        """``routers``: decoder layer -> router module (``routers_by_layer``). MoE layers after the first without
        one are never predicted: logged once and counted in ``counters.declined["lookahead:no_router"]``.
        Returns them."""
        self._routers = {lp: routers[layer] for lp, layer in enumerate(self.store.layers) if layer in routers}
        missing = [layer for layer in self.store.layers[1:] if layer not in routers]
        if missing:
            log.event("lookahead_layers_unpredicted", logging.WARNING, layers=missing,
                      detail="no router module found for these MoE layers; their misses are read in the step")
            if counters is not None:
                counters.declined["lookahead:no_router"] += len(missing)
        return missing

    @property
    def ready(self) -> bool:
        return bool(self._routers)

    def take(self, lp: int) -> torch.Tensor | None:
        """The row map of layer ``lp``'s prefetch, if this forward issued one (the compute stream then waits
        for its copy), else None."""
        if lp not in self._issued:
            return None
        s = self.streams
        if s.is_cuda:
            s.current().wait_stream(s.lookahead())
        del self._issued[lp]  # joined: the compute stream may reuse the ids' memory now
        return self.row_of_PE[lp % 2]

    def issue(self, lp: int, hidden_TH: torch.Tensor, counts_1: torch.Tensor) -> None:
        """Predict MoE layer ``lp``'s routing from ``hidden_TH`` and copy its missing experts (no host sync)."""
        router = self._routers.get(lp)
        if router is None or hidden_TH.shape[0] > self.max_tokens:
            return
        with torch.no_grad():
            ids_TK = router.forward(hidden_TH)[2]
        layer = self.store.layers[lp]
        table_E = self.pool.table_LE[lp]
        host = self.store.device_rows(layer, self.device)
        row_of_E = self.row_of_PE[lp % 2]
        base = self.base + (lp % 2) * self.rows
        s = self.streams
        if s.is_cuda:  # fork: after everything the compute stream has queued (the reads of these rows included)
            s.lookahead().wait_stream(s.current())
        with s.on(s.lookahead()):  # a no-op on the CPU
            if self.device.type == "cuda":
                prefetch_misses(table_E, ids_TK, host, self.pool.rows_NR, base, row_of_E, counts_1, _COPY)
            else:  # the CPU (the stream-order tests run it under fake streams)
                counts_1 += prefetch_misses_reference(table_E, ids_TK, host, self.pool.rows_NR, base, row_of_E)
        self._issued[lp] = ids_TK

    def reset(self) -> None:
        """A new step: nothing issued (a forward that raised may have left a prefetch untaken; its rows and
        map stay consistent, but a new step predicts afresh)."""
        if self._issued and self.streams.is_cuda:  # an untaken copy may still read its ids
            self.streams.current().wait_stream(self.streams.lookahead())
        self._issued.clear()
