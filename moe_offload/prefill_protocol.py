"""The prefill protocol of an ``OffloadMoeCache``, and the hit path its passes copy with.

The protocol, owned by the caller (the engine, or the first experts call of a forward that nobody announced)::

    with cache.prefill_pass():          # one per model forward on the prefill path
        views, index_N = cache.stage_rows(layer)  # per MoE layer: its bank for compute; the layer two ahead is assembled at done()
        ... compute ...
        cache.done(layer)               # the layer's GEMMs are enqueued

A pass that raises leaves nothing unordered behind (``staging.py``). The hit path (how prefill hits reach staging,
``hit_copy.py``) is resolved once, at the first pass or boundary (or the warmup's ``resolve_hit_path``), and a hit
or batched copy that fails mid-run degrades it for the rest of the cache's life, counted.

A mixin of ``OffloadMoeCache`` (``cache.py``), which it is no use without: it sets the cache's ``_resolution`` and
``_pass_open``, and drives its ``staging``, ``decode``, ``pool``, ``streams`` and ``counters``.

Legend: T tokens, K top-k, E experts per layer; ``index_N`` (``stage_rows``): the bank row of each of a layer's
E experts.
"""

from __future__ import annotations

import contextlib

import torch

from moe_offload.hit_copy import FullLayerCopy, H2DRows, log_hit_fallback, resolve_hit_copy


class PrefillProtocol:
    """``prefill_pass`` / ``stage_rows`` / ``done`` and the hit path of an ``OffloadMoeCache`` (see the module
    docstring)."""

    @property
    def hit_path(self) -> str:
        """The prefill hit path in use: ``gather``, ``batch_memcpy`` or ``full_layer_copy``."""
        return self.staging.hit.name

    # ------------------------------------------------------------------ hit path
    def resolve_hit_path(self) -> None:
        """Decide how prefill hits are copied (once; the warmup calls it under load)."""
        if self._resolution is not None:
            return
        cfg = self.prefill_cfg
        res = resolve_hit_copy(cfg.hit_copy, cfg.hit_copy_on_unavailable, cfg.overlap, self.num_slots, self.device,
                               self.store.bytes_per_expert, self.streams.copy)
        self._resolution = res
        res.h2d.on_batch_failure = self._h2d_batch_failed
        self.staging.hit, self.staging.h2d = res.hit, res.h2d
        self.decode.h2d = res.h2d

    def _h2d_batch_failed(self, exc: Exception) -> None:
        """The batched H2D call failed mid-run (``H2DRows`` copies per run from now on): counted now, and
        per prefill pass from now on like a batch path declined at start-up."""
        self._resolution.batch_h2d_reason = "call_failed"
        self.counters.declined["batch_h2d:call_failed"] += 1

    def _hit_failed(self, exc: Exception):
        """A hit copy raised mid-run: full-layer copies for the rest of the process (or fail)."""
        reason, detail = "call_failed", f"{type(exc).__name__}: {exc}"
        if self.prefill_cfg.hit_copy_on_unavailable == "error":
            from moe_offload.hit_copy import HitPathUnavailable

            raise HitPathUnavailable(reason, detail) from exc
        self._resolution.decline = (reason, detail)
        if self.staging.hit.name == "batch_memcpy":  # the binding failed: PCIe misses per run from now on
            self._resolution.h2d = self.staging.h2d = self.decode.h2d = H2DRows(stream=self.streams.copy)
        log_hit_fallback(reason, detail)
        self.counters.fallback(reason)  # this pass; later passes are counted in begin
        return FullLayerCopy()

    # ------------------------------------------------------------------ prefill
    @contextlib.contextmanager
    def prefill_pass(self, routed_fills: bool = False):
        """One prefill pass (one model forward on the prefill path): the first layer's copy starts now,
        overlapping whatever the caller runs before the first MoE layer. On an exception the compute
        stream is joined behind every copy in flight (no host sync). ``routed_fills``: every experts call of the
        pass stages only the missing experts its tokens routed, just in time (``staging.py``): nothing is copied
        ahead."""
        self._check_open("prefill_pass")
        self.staging.routed_fills = routed_fills
        with self.routed_fill_forward() if routed_fills else contextlib.nullcontext():
            self._begin()
            self._pass_open = True
            try:
                yield self
            except BaseException:
                self.streams.current_joins_copies()
                self.staging.computing = None
                raise
            finally:
                self._pass_open = False
                self.staging.routed_fills = False

    def _begin(self) -> None:
        self.resolve_hit_path()
        # decode admissions enqueued at the last step boundary enter the map now (their copies were issued
        # a step ago): left pending until the next decode step, their slots were neither resident nor free
        # for this prefill (after a request ended, up to cache.admit_per_step slots sat out every prefill
        # until the next request decoded)
        self.decode.commit_pending()
        self.counters.prefills += 1
        self.staging.begin()
        res = self._resolution
        if res.decline is not None:
            self.counters.fallback(res.decline[0])
        if self.device.type == "cuda" and res.batch_h2d_reason is not None:
            self.counters.declined[f"batch_h2d:{res.batch_h2d_reason}"] += 1
        if self.prefill_cfg.overlap and not self.staging.routed_fills:  # both buffers: layers 0 and 1 (later ones
            # are refilled at release, ``done``); a routed-fill pass copies each layer once its routing is known
            b0 = self.staging.prefetch(self.store.layers[0])
            if len(self.store.layers) > 1:  # into the other buffer: a reusable fill of layer 0 is kept
                self.staging.prefetch(self.store.layers[1], into=1 - b0)

    def stage(self, layer: int) -> dict[str, torch.Tensor]:
        """Views ``[E, ...]`` of ``layer`` (``stage_rows``; a layer read in place is gathered from its slots
        into new tensors: for callers that want the bank itself, not the compute path)."""
        views, index_N = self.stage_rows(layer)
        if index_N is None:
            return views
        return {k: v.index_select(0, index_N.long()) for k, v in views.items()}

    def stage_rows(self, layer: int, ids_TK: torch.Tensor | None = None
                   ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """``(views, index_N)`` of ``layer`` for compute (the compute stream waits for them): its staged
        views ``[E, ...]`` and None, or, when every expert of it is resident and ``prefill.read_in_place``
        is on, the pool's views and the layer's device slot table row (``staging.py``). The next layer's
        assembly is enqueued behind it. The first MoE layer of a forward outside ``prefill_pass()`` begins
        a pass itself. ``ids_TK``: the call's routed ids, which a routed-fill pass stages by (HOST SYNC there)."""
        self._check_open("stage_rows")
        self.pool.check_layer(layer, "stage_rows")
        if layer == self.store.layers[0]:
            if self._pass_open:
                self._pass_open = False
            else:
                self._begin()
        return self.staging.wait(layer, ids_TK)

    def done(self, layer: int) -> None:
        """``layer``'s GEMMs are enqueued: admission into free slots, then its buffer is released and (with
        ``prefill.overlap``) refilled at once with the layer two ahead. Issued here, at the earliest point
        its copies may be enqueued (they wait for the release on the device), rather than when the host
        reaches the next experts call: a host held back by a long launch queue (the linear-attention layers
        of qwen3_next) no longer delays the copy engine (README "Decisions", prefetch at release)."""
        refill = None
        if self.prefill_cfg.overlap and not self.staging.routed_fills:
            lp = self.pool.layer_pos[layer] + 2
            refill = self.store.layers[lp] if lp < len(self.store.layers) else None
        self.staging.done(layer, refill)
