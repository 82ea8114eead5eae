"""OffloadedExperts: a drop-in for transformers' experts modules backed by the OffloadMoeCache.

Call: ``(hidden_TH [T, H], top_k_index [T, K], top_k_weights [T, K]) -> [T, H]``.
Path by token count, fixed per cache when it is built (``cache.routed_max_tokens``, ``prefill_path.py``;
single prompts above it may be routed by the routing the cache observed, ``observed_routing.py``):
- ``T <= cache.routed_max_tokens`` (never below ``decode.max_tokens`` unless ``decode.path`` resolves to auto, as host does where the link was measured; ``prefill.routed_max_tokens``
  may extend it to short prompts where the cost model says copying only the routed experts pays) runs
  the routed-only (decode) path: no host sync, resident experts read in place from their slots, the
  routed misses read from mapped host memory into scratch rows; capturable in a CUDA graph;
- longer forwards take the staged (prefill) path: the whole layer assembled in a staging buffer, the
  next layer's assembly overlapping this layer's compute;
- a prefill the routed path would take, on a host where SM reads of mapped memory are slow
  (``prefill.routed_copy``, ``cache.routed_fills_for``), is staged too, but each call stages only its routed
  misses over the copy engine once its routing is known (routed fills: ``staging.py``, ``prefill_graph.py``).

Legend: T tokens, K top-k, H hidden, N rows of the bank views the compute reads.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from moe_offload.cache import OffloadMoeCache
from moe_offload.compute.base import ExpertCompute
from moe_offload.compute.decode import DecodeCompute


class OffloadedExperts(nn.Module):
    """Experts of one MoE layer, computed from the cache. ``reduce``: TP all-reduce (or None);
    ``prefill_compute``: the prefill path's compute when it differs (e.g. graphed)."""

    def __init__(self, layer_idx: int, cache: OffloadMoeCache, compute: ExpertCompute, decode_max_tokens: int,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 prefill_compute: ExpertCompute | None = None, decode_compute: ExpertCompute | None = None):
        """``decode_max_tokens``: the decode steps this module must serve on the decode path (a graph
        captures them); the cache must have been sized for at least that many tokens."""
        super().__init__()
        if layer_idx not in cache.store.layers:
            raise ValueError(f"layer_idx={layer_idx!r} is not a MoE layer of the cache's store "
                             f"({list(cache.store.layers)[:8]}...); attach OffloadedExperts to those layers only")
        if decode_max_tokens > cache.routed_max_tokens:
            raise ValueError(f"decode_max_tokens={decode_max_tokens} but the cache serves at most "
                             f"{cache.routed_max_tokens} tokens on the decode path; build OffloadMoeCache with "
                             f"decode_max_tokens={decode_max_tokens}")
        self.decode_compute = decode_compute or compute
        self.layer_idx = layer_idx
        self.cache = cache
        self.compute = compute
        self.prefill_compute = prefill_compute or compute
        self.reduce = reduce
        self.top_k = cache.store.geometry.top_k
        self._routed = None  # (ids_TK, rows_TK, alignment) from ``route``, for the forward that takes those ids

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, experts={self.cache.E}, compute={self.compute.name}"

    def uses_decode_path(self, num_tokens: int) -> bool:
        """Whether a forward of ``num_tokens`` tokens takes the routed-only (decode) path."""
        return self.cache.takes_routed_path(num_tokens)

    @property
    def adds_residual(self) -> bool:
        """Whether a ``residual_TH`` may be passed to ``forward``: not where the experts are sharded over ranks with
        no reduce of their own (a host reduces their partial sums; the residual would be added once per rank)."""
        return self.reduce is not None or self.cache.store.tp_size == 1

    def forward(self, hidden_TH: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                residual_TH: torch.Tensor | None = None, x_split_TH: torch.Tensor | None = None) -> torch.Tensor:
        """``[T, H]``; with ``residual_TH`` (``[T, H]``, the decoder layer's residual stream) ``residual_TH + out``
        rounded as the layer's own add would be. On the decode path of one rank with the fused decode compute the
        add happens inside the MoE's last launch (``kernels/moe_sum.py``); elsewhere it is a torch add.
        ``x_split_TH``: ``hidden_TH`` in the layout ``split_block_k`` named (the norm kernel wrote it), used by the
        swapped tile kernels on the decode path, ignored elsewhere."""
        T = hidden_TH.shape[0]
        # shapes and dtypes only (host metadata, no sync): a shorter top_k_index dropped rows silently before
        if (hidden_TH.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape[0] != T
                or tuple(top_k_weights.shape) != tuple(top_k_index.shape) or top_k_index.dtype.is_floating_point
                or top_k_index.dtype == torch.bool):
            raise ValueError(f"layer {self.layer_idx}: hidden_TH [T, H], top_k_index [T, K] (integer) and "
                             f"top_k_weights [T, K] must agree; got {tuple(hidden_TH.shape)}, "
                             f"{tuple(top_k_index.shape)} {top_k_index.dtype}, {tuple(top_k_weights.shape)}")
        if residual_TH is not None and not self.adds_residual:
            raise ValueError(f"layer {self.layer_idx}: a residual_TH with experts sharded over "
                             f"{self.cache.store.tp_size} ranks and no reduce would be added to a partial sum (once "
                             "per rank); add the residual after the host's own reduction")
        self.cache.observe_routing(self.layer_idx, top_k_index)
        if self.uses_decode_path(T):
            if residual_TH is not None and self.reduce is None and isinstance(self.decode_compute, DecodeCompute):
                return self._decode(hidden_TH, top_k_index, top_k_weights, residual_TH, x_split_TH)
            out = self._decode(hidden_TH, top_k_index, top_k_weights, x_split_TH=x_split_TH)
        else:
            out = self._prefill(hidden_TH, top_k_index, top_k_weights)
        out = self.reduce(out) if self.reduce is not None else out
        return out if residual_TH is None else residual_TH + out

    def route(self, hidden_TH: torch.Tensor, logits_TE: torch.Tensor, top_k: int, renorm: bool,
              w_dtype: torch.dtype):
        """``(w_TK, ids_TK)`` of this layer's router (softmax, top-k, optional renormalisation, as
        ``kernels/router.py``) for a forward on the fused decode path, with the misses' plan (and the tile kernels'
        alignment) in the same launch; the next ``forward`` with these ids uses that plan. None where this does not
        apply (the caller runs ``router_topk``): not CUDA, a staged forward, a padded prefill, the lookahead on,
        the unfused decode compute, more than ``compute.route_plan_max_pairs`` (at most
        ``decode_route.ROUTE_PLAN_MAX_PAIRS``) pairs."""
        cache = self.cache
        T, E = logits_TE.shape
        src_T = cache.pad_src_N
        dc = self.decode_compute
        if (not hidden_TH.is_cuda or not isinstance(dc, DecodeCompute) or not (dc.fused and dc.fused_launches)
                or T * top_k > dc.route_max_pairs or top_k != self.top_k or not self.uses_decode_path(T)
                or (src_T is not None and src_T.shape[0] == T) or not cache.decode_routes(T, top_k, E)
                or self._splits(hidden_TH, top_k)):
            return None
        self._begin_step(hidden_TH)
        views = cache.decode_views()
        block_m = dc.align_block_m(hidden_TH, top_k, views)
        w_TK, ids_TK, rows_TK, alignment = cache.decode_route(self.layer_idx, logits_TE, top_k, renorm, w_dtype,
                                                              block_m)
        self._routed = (ids_TK, rows_TK, alignment)
        return w_TK, ids_TK

    def split_block_k(self, hidden_TH: torch.Tensor) -> int | None:
        """For the decoder layer's norm before this MoE (``integrations/fused_norms.py``): the K chunk in which a
        forward of ``hidden_TH`` ([T, H]) wants its activations split as well (the swapped tile kernels on the fused
        decode path, ``DecodeCompute.split_block_k``), else None."""
        dc = self.decode_compute
        if not (hidden_TH.is_cuda and isinstance(dc, DecodeCompute) and self.uses_decode_path(hidden_TH.shape[0])):
            return None
        return dc.split_block_k(hidden_TH, self.top_k, self.cache.decode_views())

    def _splits(self, hidden_TH, top_k: int) -> bool:
        """Whether this decode-path forward copies its misses beside the compute of the pairs read from slots
        (``decode.overlap_misses_from``: the cache's threshold and the tile kernels; a padded prefill's pad rows
        route as their source rows first, as in the one-pass plan)."""
        dc = self.decode_compute
        return (isinstance(dc, DecodeCompute) and dc.overlap
                and self.cache.decode_splits(hidden_TH.shape[0]) and dc.splits(hidden_TH, top_k,
                                                                             self.cache.decode_views()))

    def _begin_step(self, hidden_TH) -> None:
        """At the first MoE layer of an eager step: the step boundary (admissions), before any plan reads the table.
        A captured step's boundary is its replayer's (Engine) job."""
        eager = not (hidden_TH.is_cuda and torch.cuda.is_current_stream_capturing())
        if eager and self.layer_idx == self.cache.layers[0]:
            self.cache.step_boundary()

    def _decode(self, hidden_TH, topk_ids_TK, topk_w_TK, residual_TH=None, x_split_TH=None):
        cache = self.cache
        eager = not (hidden_TH.is_cuda and torch.cuda.is_current_stream_capturing())
        layers = cache.layers
        routed, self._routed = self._routed, None
        views = cache.decode_views()
        fused = isinstance(self.decode_compute, DecodeCompute)
        if routed is None and self._splits(hidden_TH, topk_ids_TK.shape[1]):
            # the misses' copy on a side stream while the pairs read from slots compute (decode.overlap_misses_from)
            self._begin_step(hidden_TH)
            rows_TK, scratch_base, join = cache.decode_plan_split(self.layer_idx, pad_rows_routed(cache, topk_ids_TK))
            try:
                out = self.decode_compute.split(hidden_TH, rows_TK, topk_w_TK, views, scratch_base, join,
                                                residual_TH=residual_TH, x_split=x_split_TH)
            finally:
                join()  # whatever happened: nothing after this layer may run unordered with its copy
            if eager and self.layer_idx == layers[-1]:
                cache.decode_step_enqueued()
            return out
        if routed is not None and routed[0] is topk_ids_TK:  # planned in the router's launch (``route``)
            rows_TK, alignment = routed[1:]
        else:
            topk_ids_TK = pad_rows_routed(cache, topk_ids_TK)
            self._begin_step(hidden_TH)
            block_m = self.decode_compute.align_block_m(hidden_TH, topk_ids_TK.shape[1], views) if fused else None
            # the plan of the misses also groups the rows for the tile kernels, in its own launch
            rows_TK, alignment = cache.decode_plan(self.layer_idx, topk_ids_TK, hidden_TH, block_m)
        args = (hidden_TH, rows_TK, topk_w_TK, views, cache.decode_num_rows)
        kw = {"alignment": alignment, "x_split": x_split_TH} if fused else {}
        out = self.decode_compute(*args, **kw) if residual_TH is None else self.decode_compute(
            *args, residual_TH=residual_TH, **kw)
        if eager and self.layer_idx == layers[-1]:
            cache.decode_step_enqueued()
        return out

    def _prefill(self, hidden_TH, topk_ids_TK, topk_w_TK):
        if hidden_TH.is_cuda and torch.cuda.is_current_stream_capturing():  # a prefill graph
            split = self.cache.prefill_split
            if split is not None:  # piecewise: this call runs eagerly between two captured stretches
                return split.split(self, hidden_TH, topk_ids_TK, topk_w_TK)
            from moe_offload.prefill_graph import in_place_rows

            views, index_N = in_place_rows(self.cache, self.layer_idx)
            return self.prefill_compute(hidden_TH, topk_ids_TK, topk_w_TK, views, self.cache.E, index_N)
        return self.staged(hidden_TH, topk_ids_TK, topk_w_TK)

    def staged(self, hidden_TH, topk_ids_TK, topk_w_TK):
        """The staged (prefill) path of one call, eagerly: the layer's bank from the cache's pass (in a routed-fill
        pass only the routed misses, ``staging.py``), the compute, the release (``cache.done``). Before the TP reduce
        (``forward`` applies it)."""
        topk_ids_TK = pad_rows_routed(self.cache, topk_ids_TK)
        views, index_N = self.cache.stage_rows(self.layer_idx, topk_ids_TK)
        out = self.prefill_compute(hidden_TH, topk_ids_TK, topk_w_TK, views, self.cache.E, index_N)
        self.cache.done(self.layer_idx)
        return out


def pad_rows_routed(cache: OffloadMoeCache, ids_TK: torch.Tensor) -> torch.Tensor:
    """In a padded prefill (``cache.pad_src_N``, prefill_graph.py; routed or routed fills) pad rows route as their
    sequence's last real row, so padding copies no expert the prompt did not route; other calls as they are."""
    src_T = cache.pad_src_N
    if src_T is not None and src_T.shape[0] == ids_TK.shape[0]:
        return ids_TK.index_select(0, src_T)
    return ids_TK


def offloaded_experts(model: nn.Module, cache: OffloadMoeCache | None = None) -> list[OffloadedExperts]:
    """The model's OffloadedExperts modules (of ``cache`` only, when given), in layer order."""
    mods = [m for m in model.modules() if isinstance(m, OffloadedExperts) and (cache is None or m.cache is cache)]
    return sorted(mods, key=lambda m: m.layer_idx)
